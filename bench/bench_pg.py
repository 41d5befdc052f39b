"""All-reduce of 1M float32 across 2 and 4 local processes: tabcohort.pg vs torch gloo.

    PYTHONPATH=client_py python bench/bench_pg.py [--n 1000000] [--iters 20] [--worlds 2,4]

Each configuration runs in fresh processes on 127.0.0.1 (warm-up, then ``iters`` timed
all_reduce calls, each rank timing its own; the reported time per call is the median over
iterations of the slowest rank). tabcohort runs mesh and star at f32, plus mesh at bf16/int8;
when torch is importable, torch.distributed (gloo backend) all_reduce runs in the same
invocation, interleaved per world size, and the ratio gloo time / tabcohort time is printed
(> 1: tabcohort faster). torch is optional and in no requirements file. JSON goes to
bench/results/bench_pg.json. The machine is shared: only side-by-side ratios mean anything.

With ``--rtc`` a ``tabcohort serve`` is started and mesh f32 also runs over WebRTC data channels
(``PG_SERVER``, aiortc, loopback host candidates); its row reports the ratio WebRTC time / TCP
mesh f32 time (> 1: WebRTC slower).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def rank_main() -> None:
    """One rank (``--rank-of`` mode): prints a JSON list of per-iteration seconds."""
    import numpy as np

    kind, n, iters = os.environ["B_KIND"], int(os.environ["B_N"]), int(os.environ["B_ITERS"])
    x = np.random.default_rng(int(os.environ["RANK"])).standard_normal(n).astype(np.float32)
    times = []
    if kind == "torch":
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD"]))
        t = torch.from_numpy(x)
        for i in range(iters + 2):
            dist.barrier()
            y = t.clone()
            t0 = time.perf_counter()
            dist.all_reduce(y)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        dist.destroy_process_group()
    else:
        from tabcohort.pg import init_process_group_sync

        precision = os.environ.get("B_PRECISION", "f32")
        pg = init_process_group_sync()
        for i in range(iters + 2):
            pg.barrier()
            t0 = time.perf_counter()
            pg.all_reduce(x, "sum", precision=precision)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        pg.close()
    print("TIMES " + json.dumps(times), flush=True)


def start_server() -> tuple[subprocess.Popen, str]:
    """A ``tabcohort serve`` with a mesh room ``bench`` on a free port; returns (process, URL).
    Its output goes to a temporary file (a pipe nobody reads would block it when full)."""
    import tempfile

    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "client_py"), os.path.join(ROOT, "server")]))
    log = tempfile.NamedTemporaryFile(prefix="bench_pg_serve_", suffix=".log", delete=False)
    p = subprocess.Popen([sys.executable, "-m", "tabcohort.cli", "serve", "--port", "0", "--room", "bench",
                          "--topology", "mesh"], env=env, stdout=log, stderr=subprocess.STDOUT)
    end = time.monotonic() + 60
    while time.monotonic() < end and p.poll() is None:
        with open(log.name, "rb") as f:
            for line in f:
                if line.startswith(b"URL "):
                    return p, line.split()[1].decode()
        time.sleep(0.1)
    p.kill()
    raise RuntimeError(f"tabcohort serve printed no URL within 60 s (log: {log.name})")


def run(kind: str, world: int, n: int, iters: int, **env_extra: str) -> float:
    ports = free_ports(world)
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD=str(world), WORLD_SIZE=str(world), B_KIND=kind, B_N=str(n),
                   B_ITERS=str(iters), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]),
                   PEERS=",".join(f"127.0.0.1:{p}" for p in ports), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "client_py"), os.environ.get("PYTHONPATH", "")]),
                   **env_extra)
        if "PG_SERVER" in env_extra:
            del env["PEERS"]
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-of"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    per_rank = []
    for p in procs:
        out, err = p.communicate(timeout=600)  # ranks write little: the pipes never fill
        line = [ln for ln in out.decode().splitlines() if ln.startswith("TIMES ")]
        if p.returncode != 0 or not line:
            raise RuntimeError(f"{kind} world {world} failed: {err.decode()[-2000:]}")
        per_rank.append(json.loads(line[0][6:]))
    return statistics.median(max(col) for col in zip(*per_rank))


def main() -> int:
    if "--rank-of" in sys.argv:
        rank_main()
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "bench_pg.json"))
    ap.add_argument("--rtc", action="store_true", help="also mesh f32 over WebRTC data channels via a local server")
    args = ap.parse_args()
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    configs = [("tabcohort mesh f32", "pg", {"TOPOLOGY": "mesh"}), ("tabcohort star f32", "pg", {"TOPOLOGY": "star"}),
               ("tabcohort mesh bf16", "pg", {"TOPOLOGY": "mesh", "B_PRECISION": "bf16"}),
               ("tabcohort mesh int8", "pg", {"TOPOLOGY": "mesh", "B_PRECISION": "int8"})]
    if have_torch:
        configs.append(("torch gloo", "torch", {}))
    server = None
    if args.rtc:
        server, url = start_server()
        configs.append(("tabcohort mesh f32 WebRTC", "pg", {"TOPOLOGY": "mesh", "PG_SERVER": url, "PG_ROOM": "bench",
                                                             "PG_RTC_HOSTS": "127.0.0.1", "PG_TIMEOUT_S": "300"}))
    rows = []
    try:
        for world in [int(w) for w in args.worlds.split(",")]:
            res = {name: run(kind, world, args.n, args.iters, **extra) for name, kind, extra in configs}
            for name, sec in res.items():
                row = {"world": world, "impl": name, "ms_per_all_reduce": sec * 1e3,
                       "GB_per_s_algbw": 4 * args.n / sec / 1e9}
                if have_torch:
                    row["gloo_time_over_this"] = res["torch gloo"] / sec
                if name.endswith("WebRTC"):
                    row["this_time_over_tcp_mesh_f32"] = sec / res["tabcohort mesh f32"]
                rows.append(row)
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
    print(f"all_reduce of {args.n:,} float32, median of {args.iters} (slowest rank), torch: "
          f"{'yes' if have_torch else 'not installed'}\n")
    print("| world | implementation | ms / all_reduce | algbw GB/s | gloo time / this | this / TCP mesh f32 |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        ratio = f"{r['gloo_time_over_this']:.2f}" if "gloo_time_over_this" in r else "-"
        rtc = f"{r['this_time_over_tcp_mesh_f32']:.1f}" if "this_time_over_tcp_mesh_f32" in r else "-"
        print(f"| {r['world']} | {r['impl']} | {r['ms_per_all_reduce']:.2f} | {r['GB_per_s_algbw']:.2f} | {ratio} "
              f"| {rtc} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"n": args.n, "iters": args.iters, "torch": have_torch, "rows": rows}, f, indent=2)
    print(f"\nJSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
