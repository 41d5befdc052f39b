"""Scale of the server: up to 200 ranks in one room, as 8 client processes of 25 simulated ranks each,
against a real ``tabcohort serve`` on loopback. Reports the relay latency p50/p99 of a probe
pair relative to the same room when only the probe pair is in it, and the server's memory per
rank.

Method.

- The server is a ``tabcohort serve`` subprocess (room ``scale``, the default limits: 1024
  ranks per room). Its memory is VmRSS from ``/proc/PID/status``, its CPU utime + stime from
  ``/proc/PID/stat``.
- The probe pair is two bare aiohttp WebSocket clients in this process that register with the
  room and ping-pong a pre-encoded ``grad`` chunk addressed to each other through the relay:
  open loop, one ping every ``--interval-ms`` for ``--phase-s`` seconds, replies matched in
  order (so a slow relay cannot thin out the samples); every chunk not addressed to a probe is
  ignored. Unanswered pings are counted (``lost``).
- Idle: only the probe pair is in the room (measured before the ranks join and again after they
  left; the reference is the mean of both, each reported).
- Loaded, in stages (``--stages``, client processes in the room, added cumulatively: 2, 4, 8 =
  50, 100, 200 ranks): each client process (this script with ``--client``) connects
  ``--per-client`` star buses (real relay protocol on real WebSockets, one socket each).
  Each simulated rank does on the wire what a rank of a cohort of the room's size does at the
  protocol's rates, with pre-encoded real protocol messages and without decoding what it
  receives: a broadcast ``beat`` every ``policy(n).beat_ms`` (n = the room size it sees: 20 s at
  n = 200, random phase), a state report (JSON control) every ``--report-s``; one rank is the
  leader and broadcasts a ``round`` (64 parameters and an assignment for every rank)
  ``--round-hz`` times a second; every other rank answers each round with a ``grad`` to the
  leader after ``--compute-ms``. The default is 2 rounds/s (tabs with real compute per
  bucket); raise ``--round-hz`` to stress the relay.
- Server CPU per relayed frame (CPU time / frames enqueued to a peer, in the probe window) is the
  cost figure that does not depend on how much of the shared cores the server got; the
  latencies do: when the server's CPU demand exceeds its share, its queues grow for the whole
  window (open-loop probe), so read them with the load average printed next to them. The client
  processes run at ``nice 10`` so the load generators yield to the server under test.
- Memory per rank: (server RSS with the stage's ranks in the room) minus (RSS with the probe pair
  only, before any rank joined), divided by the stage's ranks.

Usage: PYTHONPATH=client_py:server python bench/bench_server_scale.py [--stages 2,4,8] [--per-client 25]
       [--phase-s 10] [--interval-ms 10] [--round-hz 2]
Writes bench/results/bench_server_scale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "client_py"), str(HERE.parent / "server")]

from linkproc import env, percentile  # noqa: E402

ROOM = "scale"
BUCKET_LEN = 64


# ---------------------------------------------------------------------------- a client process
async def client(a: argparse.Namespace) -> None:
    from tabcohort.bus.aio import star_bus
    from tabcohort.bus.star import StarBus
    from tabcohort.protocol.policy import policy
    from tabcohort.wire import FrameWriter, parse_route

    loop = asyncio.get_running_loop()
    def room_n(b: StarBus) -> int:
        return len(b.peers) + 1       # the room size this rank sees (probes included)
    buses: list[StarBus] = []
    for _ in range(a.per_client):
        b = star_bus(a.url, reconnect_max_s=5.0)
        await b.connect(timeout_s=30)
        buses.append(b)
    received = [0]
    tasks = []

    def follower(b: StarBus) -> None:
        grads: dict[int, list[bytes]] = {}

        def on_chunk(chunk: bytes) -> None:
            received[0] += 1
            r = parse_route(chunk)
            if r.recipient is None and r.frame_len > 100:   # a round (beats are ~25 bytes): answer it
                g = grads.get(r.sender)
                if g is None:
                    g = grads[r.sender] = FrameWriter(b.id).write(
                        {"t": "grad", "to": r.sender, "term": 1, "step": 1, "loss": 0.5, "samples": 8,
                         "g": [0.0] * BUCKET_LEN})
                loop.call_later(a.compute_ms / 1000.0, b.send_raw, g)
        b.on_chunk = on_chunk

    async def beats(b: StarBus) -> None:
        beat = FrameWriter(b.id).write({"t": "beat", "batch": 8, "ready": True, "running": True, "term": 1, "step": 1,
                                        "backend": "numpy"})
        await asyncio.sleep(random.uniform(0, policy(room_n(b)).beat_ms / 1000.0))
        while True:
            b.send_raw(beat)
            await asyncio.sleep(policy(room_n(b)).beat_ms / 1000.0)

    async def reports(b: StarBus) -> None:
        await asyncio.sleep(random.uniform(0, a.report_s))
        while True:
            n_total = room_n(b)
            pol = policy(n_total)
            b.send_control({"type": "report", "state": {
                "id": b.id, "leader": None, "is_leader": False, "ready": True, "running": True, "joining": False,
                "step": 1, "cohort": n_total, "loss": 0.5, "accuracy": None, "steps_per_s": a.round_hz,
                "samples_per_s": 8 * a.round_hz, "wire_bytes_per_s": 0.0, "bucket_len": BUCKET_LEN, "batch": 8,
                "model": "toy-lsq", "backend": "numpy", "precision": "f32", "lr": 0.01, "fault": None,
                "policy": {"n": n_total, "quorum": pol.quorum, "beat_ms": pol.beat_ms}, "digest": "0" * 64,
                "pid": os.getpid(), "counters": {"adopted": 1}}})
            await asyncio.sleep(a.report_s)

    async def rounds(b: StarBus) -> None:
        w = FrameWriter(b.id)
        k = 0
        while True:
            k += 1
            n_total = room_n(b)
            assign = {str(j): i * 8 for i, j in enumerate(sorted(b.peers))}
            b.send_raw(w.write({"t": "round", "term": 1, "step": k, "lr": 0.01, "assign": assign,
                                "shares": {k: 8 for k in assign}, "cursor": 0,
                                "params": [0.0] * BUCKET_LEN, "loss": 0.5, "samples": 8 * n_total,
                                "cohort": n_total}))
            await asyncio.sleep(1.0 / a.round_hz)

    for i, b in enumerate(buses):
        if a.leader and i == 0:
            b.on_chunk = lambda c: received.__setitem__(0, received[0] + 1)
            tasks.append(loop.create_task(rounds(b)))
        else:
            follower(b)
        tasks += [loop.create_task(beats(b)), loop.create_task(reports(b))]
    print(json.dumps({"connected": len(buses), "ids": [b.id for b in buses]}), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)       # until the orchestrator closes stdin
    for t in tasks:
        t.cancel()
    await asyncio.gather(*(b.aclose() for b in buses), return_exceptions=True)
    print(json.dumps({"received": received[0], "drops": [b.drops() for b in buses if b.drops()]}), flush=True)


# ---------------------------------------------------------------------------- the probe pair
class Probe:
    """One bare WebSocket client of the relay (register, then raw chunks). As the echo it
    answers every chunk addressed to it with one pre-encoded chunk; as the pinger it matches
    replies to its pings in order (each link and the relay's per-peer queue are FIFO)."""

    async def open(self, session, url: str) -> "Probe":
        import aiohttp

        self.ws = await session.ws_connect(url, max_msg_size=1 << 20)
        await self.ws.send_str(json.dumps({"type": "register", "version": 1}))
        self.id = int(json.loads((await self.ws.receive()).data)["id"])
        self.reply: bytes | None = None
        self.sent: deque[float] = deque()
        self.rtts: list[float] = []
        self.other_chunks = 0

        async def reader() -> None:
            from tabcohort.wire import parse_route
            async for msg in self.ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    continue
                if parse_route(msg.data).recipient != self.id:
                    self.other_chunks += 1
                elif self.reply is not None:                                  # echo
                    await self.ws.send_bytes(self.reply)
                elif self.sent:                                               # ping
                    self.rtts.append((time.perf_counter() - self.sent.popleft()) * 1000.0)
        self.task = asyncio.get_running_loop().create_task(reader())
        return self


def _chunk(sender: int, to: int) -> bytes:
    from tabcohort.wire import FrameWriter
    (c,) = FrameWriter(sender).write({"t": "grad", "to": to, "term": 1, "step": 1, "loss": 0.0, "samples": 1,
                                      "g": [0.0] * 8})
    return c


async def ping(p: Probe, q: Probe, seconds: float, interval_ms: float, drain_s: float = 30.0) -> dict:
    """Open-loop probe: a ping every ``interval_ms`` for ``seconds`` (so a slow relay cannot
    lower the sampling rate), then wait at most ``drain_s`` for the replies still out.
    Returns the round trips in ms (the first 10 dropped) and how many pings went unanswered."""
    loop = asyncio.get_running_loop()
    msg = _chunk(p.id, q.id)
    q.reply = _chunk(q.id, p.id)
    p.rtts, p.sent = [], deque()
    end = loop.time() + seconds
    n = 0
    while loop.time() < end:
        if p.ws.closed or q.ws.closed:
            raise RuntimeError(f"a probe socket closed (codes {p.ws.close_code}, {q.ws.close_code})")
        p.sent.append(time.perf_counter())
        await p.ws.send_bytes(msg)
        n += 1
        await asyncio.sleep(interval_ms / 1000.0)    # the probe's sending rate, not synchronisation
    end = loop.time() + drain_s
    while p.sent and loop.time() < end:
        await asyncio.sleep(0.02)
    return {"rtt_ms": p.rtts[10:], "sent": n, "lost": len(p.sent)}


def log(line: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def rss_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def cpu_s(pid: int) -> float:
    f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


async def orchestrate(a: argparse.Namespace) -> dict:
    import aiohttp
    from tests.integration.conftest import Cluster

    def lat(r: dict) -> dict:
        x = r["rtt_ms"]
        return {"p50_ms": statistics.median(x), "p99_ms": percentile(x, 99), "n": len(x), "lost": r["lost"]}

    with tempfile.TemporaryDirectory() as d:
        c = Cluster(pathlib.Path(d))
        c.room = ROOM
        clients: list[subprocess.Popen] = []
        try:
            # every simulated rank connects from 127.0.0.1: lift the per-address bounds (README "Limits")
            base = await asyncio.to_thread(c.serve, "--dataset", "synthetic", "--max-ranks-per-address", "1024",
                                           "--max-connections-per-address", "4096", "--any-rank-may-lead")
            pid = c.server.p.pid
            url = base.replace("http://", "ws://") + f"/api/rooms/{ROOM}/ws"
            async with aiohttp.ClientSession(headers=c._auth()) as session:   # (the operator sees every report whole)
                async def state() -> dict:
                    async with session.get(f"{base}/api/rooms/{ROOM}") as r:
                        return await r.json()

                async def until(cond, timeout_s: float, what: str):
                    end = time.monotonic() + timeout_s
                    while not (v := await cond()):
                        for cp in clients:
                            if cp.poll() not in (None, 0):
                                raise RuntimeError(f"a client exited {cp.returncode}")
                        if time.monotonic() > end:
                            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
                        await asyncio.sleep(0.2)
                    return v

                p, q = await Probe().open(session, url), await Probe().open(session, url)
                await until(lambda: _n(state, 2), 10, "the probe pair")
                idle_before = lat(await ping(p, q, a.phase_s, a.interval_ms))
                log(f"idle: p50 {idle_before['p50_ms']:.2f} ms, p99 {idle_before['p99_ms']:.2f} ms")
                rss_idle = rss_bytes(pid)
                stages = []
                for n_clients in sorted(int(x) for x in a.stages.split(",")):
                    n_ranks = n_clients * a.per_client
                    t_join = time.monotonic()
                    while len(clients) < n_clients:
                        k = len(clients)
                        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--client", "--url", url,
                               "--per-client", str(a.per_client), "--round-hz", str(a.round_hz),
                               "--compute-ms", str(a.compute_ms), "--report-s", str(a.report_s)] \
                            + (["--leader"] if k == 0 else [])
                        clients.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                        stderr=open(pathlib.Path(d) / f"client{k}.log", "wb"),
                                                        env=env(), cwd=str(HERE.parent)))
                    await until(lambda: _n(state, n_ranks + 2), 180, f"{n_ranks} ranks connected")
                    join_s = time.monotonic() - t_join
                    # traffic on: every simulated rank has reported at least once
                    await until(lambda: _reported(state, n_ranks), 60, "a report from every rank")
                    log(f"{n_ranks} ranks in the room ({join_s:.1f} s to join); probing")
                    s0, c0, t0 = (await state())["counters"], cpu_s(pid), time.monotonic()
                    loaded = lat(await ping(p, q, a.phase_s, a.interval_ms))
                    s1, c1, t1 = (await state())["counters"], cpu_s(pid), time.monotonic()
                    rss = rss_bytes(pid)
                    dt = t1 - t0
                    stages.append({
                        "ranks": n_ranks, "clients": n_clients, "join_s": join_s, **loaded,
                        "server_rss_bytes": rss, "server_bytes_per_rank": (rss - rss_idle) / n_ranks,
                        "relayed_frames_per_s": (s1["frames_relayed"] - s0["frames_relayed"]) / dt,
                        "relayed_bytes_per_s": (s1["bytes_relayed"] - s0["bytes_relayed"]) / dt,
                        "inbound_frames_per_s": (s1["frames_in"] - s0["frames_in"]) / dt,
                        "server_cpu_fraction": (c1 - c0) / dt, "loadavg_1m": os.getloadavg()[0]})
                    log(f"{n_ranks} ranks: p50 {loaded['p50_ms']:.2f} ms, p99 {loaded['p99_ms']:.2f} ms")
                drops = (await state()).get("drops")
                for cp in clients:
                    cp.stdin.close()
                for cp in clients:
                    await asyncio.to_thread(cp.wait, 60)
                await until(lambda: _n(state, 2), 60, "the ranks to leave")
                idle_after = lat(await ping(p, q, a.phase_s, a.interval_ms))
                for x in (p, q):
                    x.task.cancel()
                    await x.ws.close()
        finally:
            for cp in clients:
                if cp.poll() is None:
                    cp.kill()
                    cp.wait(10)
            c.close()
    idle = {k: (idle_before[k] + idle_after[k]) / 2 for k in ("p50_ms", "p99_ms")}
    for st in stages:
        st["p50_ratio"] = st["p50_ms"] / idle["p50_ms"]
        st["p99_ratio"] = st["p99_ms"] / idle["p99_ms"]
    return {"per_client": a.per_client, "round_hz": a.round_hz, "compute_ms": a.compute_ms,
            "report_s": a.report_s, "interval_ms": a.interval_ms, "phase_s": a.phase_s,
            "idle_before": idle_before, "idle_after": idle_after, "idle_mean": idle,
            "server_rss_idle_bytes": rss_idle, "stages": stages, "room_drops": drops, "cpus": os.cpu_count()}


async def _n(state, want: int) -> bool:
    return (await state())["n_connected"] == want


async def _reported(state, n: int) -> bool:
    return sum(1 for r in (await state())["ranks"] if r["connected"] and r["report"]) >= n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="2,4,8", help="client processes in the room at each measured stage "
                    "(added cumulatively; default 2,4,8 = 50, 100, 200 ranks)")
    ap.add_argument("--per-client", type=int, default=25, help="simulated ranks per client process (default 25)")
    ap.add_argument("--phase-s", type=float, default=10.0, help="probe time per phase (idle, loaded, idle)")
    ap.add_argument("--interval-ms", type=float, default=10.0, help="probe ping period (open loop)")
    ap.add_argument("--round-hz", type=float, default=2.0, help="rounds per second of the simulated leader")
    ap.add_argument("--compute-ms", type=float, default=50.0, help="simulated compute before a grad answers a round")
    ap.add_argument("--report-s", type=float, default=1.0, help="state report period of every rank")
    ap.add_argument("--json", type=pathlib.Path, default=HERE / "results" / "bench_server_scale.json")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--leader", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.client:
        os.nice(10)    # load generators yield the CPU to the server under test (2 shared cores)
        asyncio.run(client(a))
        return
    r = asyncio.run(orchestrate(a))
    top = r["stages"][-1]
    print(f"# server scale: up to {top['ranks']} ranks in one room ({top['clients']} processes x {r['per_client']} "
          f"simulated ranks, one WebSocket each), `tabcohort serve` on loopback\n")
    print(f"Per rank: beats at policy(n), a report every {r['report_s']:g} s, a grad {r['compute_ms']:g} ms after "
          f"each of the leader's {r['round_hz']:g} rounds/s. Probe pair: a ping every {r['interval_ms']:g} ms for "
          f"{r['phase_s']:g} s per phase (open loop). Idle room (probe pair only): p50 {r['idle_mean']['p50_ms']:.2f} ms "
          f"({r['idle_before']['p50_ms']:.2f} before / {r['idle_after']['p50_ms']:.2f} after), p99 "
          f"{r['idle_mean']['p99_ms']:.2f} ms ({r['idle_before']['p99_ms']:.2f} / {r['idle_after']['p99_ms']:.2f}).\n")
    print("| ranks | relayed frames/s | server CPU (of a core) | server CPU µs per relayed frame | probe p50 ms | p50 vs idle | probe p99 ms | "
          "p99 vs idle | unanswered | server memory per rank | load (1 min) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for x in r["stages"]:
        print(f"| {x['ranks']} | {x['relayed_frames_per_s']:.0f} | {x['server_cpu_fraction'] * 100:.0f} % | "
              f"{x['server_cpu_fraction'] / x['relayed_frames_per_s'] * 1e6:.0f} | "
              f"{x['p50_ms']:.2f} | {x['p50_ratio']:.2f} | {x['p99_ms']:.2f} | {x['p99_ratio']:.2f} | {x['lost']} | "
              f"{x['server_bytes_per_rank'] / 1024:.0f} KiB | {x['loadavg_1m']:.1f} on {r['cpus']} CPUs |")
    print(f"\nServer RSS {r['server_rss_idle_bytes'] / 2**20:.1f} MiB with the probe pair only; memory per rank = "
          f"(RSS with the ranks - that) / ranks.")
    if r["room_drops"]:
        print(f"\nRoom drops: {r['room_drops']}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
