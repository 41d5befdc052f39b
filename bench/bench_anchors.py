"""Against what a native user would pick instead: one synchronous data-parallel step on
1M float32 parameters across 2 and 4 local processes, measured side by side in one run:

- ``gloo dp``: ``torch.distributed`` with the gloo backend: broadcast of the parameters from
  rank 0, then reduce of the gradient to rank 0 (what our cohort round does: the leader sends
  the parameters, the followers' buckets come back and are reduced there);
- ``gloo all_reduce``: one all_reduce of the gradient (the classic DDP step);
- ``hivemind``: one ``DecentralizedAverager.step()`` of hivemind 1.1.12 (its own libp2p
  daemon; a group of exactly N, matchmaking time 0.5 s instead of the default 5 s);
- ``ours``: a cohort round of N rank processes (the real RankMachine, driver and bus, as in
  ``bench/linkproc.py rank``, with a worker that has no compute: a fixed 1M-float32 gradient
  and a numpy update) on the
  WebSocket star and the WebRTC mesh through a real ``tabcohort serve``, and the fastest of the two;
  each link also with glibc's allocator defaults (``--allocator held,default``: the ranks and the
  server with ``TABCOHORT_MALLOC_HOLD=0``) beside the held allocator they run with (tabcohort._alloc).

Time per step is the median over steps (after warm-up) of the slowest rank for gloo and hivemind,
and 1 / (rounds/s) for ours. Each row is also a ratio to ours (> 1: theirs is slower).
``--profile`` adds where our time goes for one round at N: encode (FrameWriter.write of the
parameters and of each bucket), decode (FrameReader.feed), reduce (sum of N-1 buckets), apply
(the SGD update), measured in this process, and the remainder of the round time (transport:
sockets, the relay, the event loop).

torch and hivemind are optional and in no requirements file (``pip install torch==2.13.0``
takes a CPU build from the machines' disk; ``pip install hivemind==1.1.12``): this is not in
CI. Use ``--anchor-python`` for an interpreter that has them (e.g. a venv made with
``--system-site-packages``); rows whose library is missing say so.

Usage: PYTHONPATH=client_py:server python bench/bench_anchors.py [--worlds 2,4] [--steps 20]
       [--anchor-python PATH] [--seconds 8]
Writes bench/results/bench_anchors.json. The machine is shared: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT), str(ROOT / "client_py"), str(ROOT / "server")]

N_PARAMS = 1_000_000


# ---------------------------------------------------------------------------- worker processes
def gloo_worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    params = torch.zeros(N_PARAMS)
    grad = torch.randn(N_PARAMS, generator=torch.Generator().manual_seed(rank))
    res: dict[str, list[float]] = {"dp": [], "all_reduce": []}
    for _ in range(3 + steps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(params, src=0)
        dist.reduce(grad, dst=0)
        res["dp"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(grad)
        res["all_reduce"].append(time.perf_counter() - t0)
        grad.div_(world)
    dist.destroy_process_group()
    pathlib.Path(out).write_text(json.dumps({k: v[3:] for k, v in res.items()}))


def hivemind_worker(rank: int, world: int, peers_file: str, steps: int, out: str) -> None:
    import hivemind
    import torch

    if rank == 0:
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        pathlib.Path(peers_file + ".tmp").write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
        os.replace(peers_file + ".tmp", peers_file)
    else:
        end = time.monotonic() + 60
        while not os.path.exists(peers_file):
            if time.monotonic() > end:
                raise TimeoutError("rank 0's DHT address never appeared")
            time.sleep(0.05)
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           initial_peers=json.loads(pathlib.Path(peers_file).read_text()))
    t = torch.randn(N_PARAMS, generator=torch.Generator().manual_seed(rank))
    av = hivemind.averaging.DecentralizedAverager(
        averaged_tensors=[t], dht=dht, prefix="bench_anchors", target_group_size=world,
        min_group_size=world, min_matchmaking_time=0.5, request_timeout=5.0, start=True)
    times, failed = [], 0
    for _ in range(2 + steps):
        t0 = time.perf_counter()
        got = av.step(timeout=60)
        if got is None:
            failed += 1
        times.append(time.perf_counter() - t0)
    av.shutdown()
    dht.shutdown()
    pathlib.Path(out).write_text(json.dumps({"step": times[2:], "failed": failed}))


class FixedGradWorker:
    """The worker contract with no compute: a fixed float32 gradient, numpy SGD update (what a
    step of the anchors does too: only communication and the update are measured)."""

    model = "fixed-grad"
    backend = "numpy"

    def __init__(self, bucket_len: int, batch: int = 8) -> None:
        import numpy as np

        self.np = np
        self.bucket_len, self.batch, self.calls = bucket_len, batch, 0
        self._p = np.zeros(bucket_len, np.float32)
        self._g = np.random.default_rng(0).standard_normal(bucket_len).astype(np.float32) * 1e-3
        #: the leader's rounds, timed as gloo's step is: from the parameters' send (broadcast)
        #: to the reduced update applied (reduce), seconds
        self.t_round: float | None = None
        self.round_s: list[float] = []

    async def grads(self, offset: int, samples: int | None = None):
        self.calls += 1
        return 0.5, self._g

    def apply(self, avg, lr: float) -> None:
        self._p -= self.np.float32(lr) * self.np.asarray(avg, self.np.float32)
        if self.t_round is not None:   # the leader: its round's parameters went out at t_round
            self.round_s.append(time.perf_counter() - self.t_round)
            self.t_round = None

    def params(self):
        return self._p

    def set_params(self, p) -> None:
        self._p = self.np.array(p, self.np.float32)

    def evaluate(self) -> float:
        return 0.0

    def spec(self) -> dict:
        return {"name": self.model, "bucket_len": self.bucket_len}


def ours_worker(url: str, link: str, out: str, max_s: float, world: int) -> None:
    """One rank of our cohort (as bench/linkproc.py's ``rank``, with :class:`FixedGradWorker`).
    Only rounds that give every one of the ``world`` ranks a share are timed, as gloo's step
    has every rank in it: a round can leave a rank out (one held back after a missed bucket,
    docs/PROTOCOL.md "Untrusted ranks"; or before the cohort formed), and a round the leader
    computes alone moves no data."""
    import asyncio

    from linkproc import _links, _stop_event, make_bus

    from tabcohort._alloc import hold_allocator
    from tabcohort.protocol import RankMachine
    from tabcohort.runtime.driver import RankDriver

    hold_allocator()   # as ``tabcohort rank`` does

    async def run() -> None:
        stop = _stop_event(max_s)
        loop = asyncio.get_running_loop()
        bus = make_bus(link, url, **({"idle_timeout_s": 10.0} if link in ("rtc-mesh", "tcp-mesh") else {}))
        await bus.connect()
        w = FixedGradWorker(N_PARAMS)
        post = bus.post

        def timed_post(msg, **kw):
            if msg.get("t") == "round":
                w.t_round = time.perf_counter() if len(msg.get("shares") or ()) >= world else None
            post(msg, **kw)
        bus.post = timed_post
        # a fixed global batch of every rank's cap: no rank can cover a round without the others,
        # so every round has all of them in it, as gloo's step does ("Shares"); the rooms' grace
        # rule, so a round at N = 4 waits for its 4th bucket as gloo's reduce does (the quorum
        # rule ended it at 3 of 4)
        m = RankMachine(bus.id, w, bus, job="bench-anchors", now_ms=RankDriver.clock_ms(loop), lr=0.01,
                        eval_every=0, global_batch=world * w.batch, collect_rule="grace")
        d = RankDriver(m, w, bus, reads_first=True)   # (as the native runtime runs it)
        d.start(0.01)
        with open(out, "a", buffering=1) as fh:
            while not stop.is_set():
                rs, w.round_s = w.round_s, []
                fh.write(json.dumps({"t": time.time(), "step": m.step, "leader": bool(m.looping),
                                     "cohort": len(m.cohort_ids(d.now_ms())), "links": _links(bus),
                                     "round_s": rs}) + "\n")
                try:
                    await asyncio.wait_for(stop.wait(), 0.1)
                except asyncio.TimeoutError:
                    pass
        await d.close()
        await bus.aclose()
    asyncio.run(run())


# ---------------------------------------------------------------------------- orchestration
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def run_workers(python: str, mode: str, world: int, steps: int, tmp: pathlib.Path, timeout_s: float) -> list[dict]:
    port = free_port()
    outs = [tmp / f"{mode}-{world}-{r}.json" for r in range(world)]
    peers = tmp / f"{mode}-{world}-peers.json"
    procs = []
    for r in range(world):
        arg = str(port) if mode == "gloo" else str(peers)
        procs.append(subprocess.Popen([python, __file__, "--worker", mode, str(r), str(world), arg, str(steps),
                                       str(outs[r])], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    try:
        for p in procs:
            p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    bad = [(p.returncode, p.stdout.read().decode(errors="replace")[-1500:]) for p in procs if p.returncode]
    if bad:
        raise RuntimeError(f"{mode} workers failed: {bad}")
    return [json.loads(o.read_text()) for o in outs]


def slowest_median(per_rank: list[list[float]]) -> float:
    return statistics.median(max(xs) for xs in zip(*per_rank))


def ours(world: int, link: str, seconds: float, tmp: pathlib.Path, *, allocator: str = "held") -> dict:
    """Our cohort of ``world`` ranks on ``link``; ``allocator``: ``held`` (what ``tabcohort rank``
    and ``serve`` do, :mod:`tabcohort._alloc`) or ``default`` (glibc's defaults, for the A/B)."""
    from linkproc import Procs, env, samples, serve_args, wait_until

    procs = Procs(tmp)
    tag = f"{link}-{allocator}-{world}"
    log = tmp / f"serve-{tag}.log"
    fh = open(log, "wb")
    penv = {**env(), "TABCOHORT_MALLOC_HOLD": "1" if allocator == "held" else "0"}

    srv = subprocess.Popen([sys.executable, "-m", "tabcohort", "serve", "--port", "0", "--room", "anchors",
                            *serve_args(link)], stdout=fh, stderr=subprocess.STDOUT, env=penv, cwd=str(ROOT))
    try:
        def url() -> str | None:
            for line in log.read_text().splitlines():
                if line.startswith("URL "):
                    return line.split()[1].replace("http://", "ws://") + "/api/rooms/anchors/ws"
            if srv.poll() is not None:
                raise RuntimeError("serve exited:\n" + log.read_text())
            return None
        ws = wait_until(url, 30, "the server URL")
        outs = [tmp / f"ours-{tag}-{i}.jsonl" for i in range(world)]
        for i, o in enumerate(outs):
            procs.procs.append((subprocess.Popen(
                [sys.executable, __file__, "--worker", "ours", ws, link, str(o), str(seconds + 120), str(world)],
                stdout=(fh_i := open(tmp / f"rank-{tag}-{i}.log", "wb")), stderr=subprocess.STDOUT,
                env=penv, cwd=str(ROOT)), fh_i))

        def lead() -> dict | None:
            ss = [s for o in outs for s in samples(o)[-1:]]
            lead = [s for s in ss if s["leader"]]
            return lead[0] if len(ss) == world and lead and lead[0]["cohort"] == world and lead[0]["step"] >= 5 \
                else None
        wait_until(lead, 90, f"a cohort of {world} on {link} past 5 rounds", check=procs.check)
        def step() -> int:  # the cohort's step: the highest any rank has seen
            return max(s["step"] for o in outs for s in samples(o)[-1:])
        s0, t0 = step(), time.monotonic()
        wait_until(lambda: time.monotonic() - t0 >= seconds, seconds + 5, "the window", check=procs.check)
        s1, t1 = step(), time.monotonic()
        w0 = time.time() - (t1 - t0)
        rounds = [x for o in outs for smp in samples(o) if smp["t"] >= w0 and smp["leader"]
                  for x in smp.get("round_s") or []]
        if lead() is None:
            raise RuntimeError(f"{link}: the cohort of {world} did not hold through the window")
        links = sorted({v for o in outs for v in (samples(o)[-1].get("links") or {}).values()})
    finally:
        procs.stop()
        srv.terminate()
        srv.wait(10)
        fh.close()
    rps = (s1 - s0) / (t1 - t0)
    if not rounds:
        raise RuntimeError(f"{link}: no timed round in the window")
    # step_s: the median round, broadcast to reduce applied (as gloo's step, between barriers);
    # loop_s: 1 / rounds per second (the round and the leader loop's gaps between rounds)
    return {"link": link, "allocator": allocator, "rounds_per_s": rps, "step_s": statistics.median(rounds), "rounds_timed": len(rounds),
            "loop_s": 1 / rps if rps else float("inf"), "links": links}


def profile(world: int, reps: int = 5) -> dict:
    """Where one round's CPU goes at the leader and a follower (f32, 1M parameters), in ms, with
    the functions the round runs on the direct path: frames cut at its chunk size, a frame read
    whole into a buffer of its own and decoded as views (``FrameReader.feed(owned=True)``), the
    clip rule's norm of every bucket (``robust.l2_norm``), the sample-weighted mean
    (``vec.weighted_mean``) and the finiteness checks of the mean and of the parameters after
    the update (``vec.all_finite``)."""
    import numpy as np

    from tabcohort.bus.direct import DIRECT_MAX_MESSAGE_BYTES, ChunkStream
    from tabcohort.protocol.robust import l2_norm
    from tabcohort.vec import all_finite, weighted_mean
    from tabcohort.wire import FrameReader, FrameWriter

    params = np.random.default_rng(0).standard_normal(N_PARAMS).astype(np.float32)
    w, r = FrameWriter(1, max_message_bytes=DIRECT_MAX_MESSAGE_BYTES), FrameReader(None)
    round_msg = {"t": "round", "term": 1, "step": 1, "lr": 0.1, "loss": 1.0, "samples": 8, "cohort": world,
                 "assign": {2: 0}, "shares": {2: 8}, "cursor": 0, "params": params}
    grad_msg = {"t": "grad", "term": 1, "step": 1, "loss": 0.5, "samples": 8, "g": params, "to": 2}

    def t(f, setup=lambda: None) -> float:
        xs = []
        for _ in range(reps):
            arg = setup()
            t0 = time.perf_counter()
            f(arg)
            xs.append(time.perf_counter() - t0)
        return statistics.median(xs) * 1000
    enc_round = t(lambda _: w.write(round_msg))
    enc_grad = t(lambda _: w.write(grad_msg))
    rc, gc = w.write(round_msg), w.write(grad_msg)

    def received(chunks):   # as the socket leaves them: each chunk in a buffer of its own (not timed)
        out = []
        for c in chunks:
            s = ChunkStream(len(c))
            s.buffer()[:4] = len(c).to_bytes(4, "little")
            s.advance(4)
            s.buffer()[:] = c
            out += s.advance(len(c))
        return out

    def feed(chunks):
        for c in chunks:
            list(r.feed(c, now_ms=0.0, owned=True))
    dec_round = t(feed, lambda: received(rc))
    dec_grad = t(feed, lambda: received(gc))
    bufs = [params.copy() for _ in range(world)]
    norm_ms = t(lambda _: l2_norm(bufs[0]))
    reduce_ms = t(lambda _: weighted_mean(bufs, [1 / world] * world))
    p2 = params.copy()

    def apply(_):
        avg = weighted_mean(bufs, [1 / world] * world)
        all_finite(avg)
        np.subtract(p2, np.float32(0.01) * avg, out=p2)
        all_finite(p2)
    apply_ms = t(apply) - reduce_ms
    # the round's critical path: the leader encodes the round once; a follower decodes it and
    # encodes its bucket; the leader decodes N-1 buckets, measures N, reduces and applies
    path = enc_round + dec_round + enc_grad + (world - 1) * dec_grad + world * norm_ms + reduce_ms + apply_ms
    return {"encode_round_ms": enc_round, "encode_bucket_ms": enc_grad, "decode_round_ms": dec_round,
            "decode_bucket_ms": dec_grad, "norm_ms": norm_ms, "reduce_ms": reduce_ms, "apply_ms": apply_ms,
            "critical_path_cpu_ms": path}


def label(o: dict) -> str:
    """A cohort row's name: its link, and the allocator when it is not held."""
    return o["link"] if o.get("allocator", "held") == "held" else f"{o['link']} (glibc malloc)"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker" and sys.argv[2] == "ours":
        ours_worker(sys.argv[3], sys.argv[4], sys.argv[5], float(sys.argv[6]), int(sys.argv[7]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, rank, world, arg, steps, out = sys.argv[2:8]
        if mode == "gloo":
            gloo_worker(int(rank), int(world), int(arg), int(steps), out)
        else:
            hivemind_worker(int(rank), int(world), arg, int(steps), out)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per anchor (after warm-up)")
    ap.add_argument("--seconds", type=float, default=8.0, help="measuring window for our cohort")
    ap.add_argument("--links", default="tcp-mesh,ws-star")
    ap.add_argument("--allocator", default="held,default",
                    help="our processes' C allocator, comma-separated: held (as tabcohort rank/serve run) "
                         "and/or default (glibc's defaults), each link run with each, alternating")
    ap.add_argument("--anchor-python", default=sys.executable,
                    help="interpreter with torch (and hivemind) for the anchors")
    ap.add_argument("--json", default=str(HERE / "results" / "bench_anchors.json"))
    a = ap.parse_args()
    worlds = [int(x) for x in a.worlds.split(",")]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-anchors-"))
    torch_ok, hm_ok = has(a.anchor_python, "torch"), has(a.anchor_python, "hivemind")
    rows = []
    for world in worlds:
        row: dict = {"world": world}
        row["ours"] = []
        for link in a.links.split(","):
            for alloc in a.allocator.split(","):
                try:
                    row["ours"].append(ours(world, link, a.seconds, tmp, allocator=alloc))
                except (RuntimeError, TimeoutError) as e:  # reported, not hidden: the row says why
                    row["ours"].append({"link": link, "allocator": alloc, "error": str(e).splitlines()[0][:200],
                                        "step_s": float("inf")})
        # (the best link as shipped: the allocator held, as tabcohort rank runs)
        best = min([o for o in row["ours"] if o.get("allocator") == "held"] or row["ours"], key=lambda o: o["step_s"])
        row["ours_best"] = best
        if torch_ok:
            g = run_workers(a.anchor_python, "gloo", world, a.steps, tmp, 600)
            row["gloo_dp_s"] = slowest_median([x["dp"] for x in g])
            row["gloo_all_reduce_s"] = slowest_median([x["all_reduce"] for x in g])
        if hm_ok:
            h = run_workers(a.anchor_python, "hivemind", world, max(5, a.steps // 2), tmp, 900)
            row["hivemind_step_s"] = slowest_median([x["step"] for x in h])
            row["hivemind_failed_steps"] = sum(x["failed"] for x in h)
        row["profile"] = profile(world)
        rows.append(row)
    doc = {"bench": "bench_anchors", "n_params": N_PARAMS, "steps": a.steps, "torch": torch_ok,
           "hivemind": hm_ok, "rows": rows}
    pathlib.Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")

    print(f"\n1M float32, one synchronous step, local processes, one run (ratio = their time / ours; > 1: ours faster)\n")
    print("| N | ours (best link) | ours per link (s/step) | gloo bcast+reduce | gloo all_reduce | hivemind averager |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        b = r["ours_best"]["step_s"]
        per = ", ".join(f"{label(o)} {o['step_s']:.3f}" if "error" not in o else f"{label(o)}: {o['error']}"
                        for o in r["ours"])

        def cell(key: str) -> str:
            v = r.get(key)
            return "not installed" if v is None else f"{v:.3f} s ({v / b:.2f})"
        print(f"| {r['world']} | {b:.3f} s ({r['ours_best']['link']}) | {per} | {cell('gloo_dp_s')} | "
              f"{cell('gloo_all_reduce_s')} | {cell('hivemind_step_s')} |")
    print("\nOur round per link against gloo's broadcast + reduce, both timed from the parameters' send to the "
          "reduced result (ratio = ours / gloo; <= 1.5 is the goal)\n")
    print("| N | link | round (median) | 1 / rounds per s | gloo bcast+reduce | ours / gloo |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        g = r.get("gloo_dp_s")
        for o in r["ours"]:
            if "error" in o:
                print(f"| {r['world']} | {label(o)} | {o['error']} | | | |")
                continue
            ratio = f"{o['step_s'] / g:.2f}" if g else "no torch"
            gl = f"{g * 1000:.1f} ms" if g else "not installed"
            print(f"| {r['world']} | {label(o)} | {o['step_s'] * 1000:.1f} ms | {o['loop_s'] * 1000:.1f} ms | {gl} | {ratio} |")
    pairs = [(r["world"], o, d) for r in rows for o in r["ours"] for d in r["ours"]
             if o["link"] == d["link"] and o.get("allocator") == "held" and d.get("allocator") == "default"
             and "error" not in o and "error" not in d]
    if pairs:
        print("\nThe allocator held (tabcohort._alloc, as `tabcohort rank` and `serve` run) against glibc's "
              "defaults, same link, same run (ratio = default / held; > 1: holding is faster)\n")
        print("| N | link | round, held | round, glibc default | default / held |")
        print("|---|---|---|---|---|")
        for world, o, d in pairs:
            print(f"| {world} | {o['link']} | {o['step_s'] * 1000:.1f} ms | {d['step_s'] * 1000:.1f} ms | "
                  f"{d['step_s'] / o['step_s']:.2f} |")
    print("\nWhere our round goes on the direct path (CPU ms in this process, f32; norms: the clip rule's, "
          "of every bucket; apply: the update and the finiteness checks; transport = the rest of the round):\n")
    print("| N | encode round | decode round | encode bucket | decode bucket x (N-1) | norms x N | reduce | apply | "
          "CPU path | round | transport + loop |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p, b = r["profile"], r["ours_best"]["step_s"] * 1000
        print(f"| {r['world']} | {p['encode_round_ms']:.1f} | {p['decode_round_ms']:.1f} | {p['encode_bucket_ms']:.1f} | "
              f"{(r['world'] - 1) * p['decode_bucket_ms']:.1f} | {r['world'] * p['norm_ms']:.1f} | "
              f"{p['reduce_ms']:.1f} | {p['apply_ms']:.1f} | "
              f"{p['critical_path_cpu_ms']:.1f} | {b:.1f} | {max(0.0, b - p['critical_path_cpu_ms']):.1f} |")
    print(f"\nJSON: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
