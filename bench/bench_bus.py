"""The room buses' own cost, A/B between two source trees in one run (ratios, not bare times).

For each tree (``--trees``: directories holding ``client_py`` and ``server``; default this one)
and each bus kind (``ws-star``, ``rtc-star``, ``rtc-mesh``) a child process starts a real server
(``tabcohort_server``) on 127.0.0.1, connects two buses and measures, within the timed region:

- bulk: ``--mb`` MB of ``grad`` messages of ``--params`` float32 parameters posted from one bus
  to the other, paced on ``pressure() < 1`` (as the leader paces): goodput MB/s and CPU s per MB
  (process time: server, both buses and the reader, all in this one process);
- small: ``--beats`` ``beat`` messages back to back: messages/s and CPU us per message.

Runs alternate between trees (``--reps`` rounds), and the medians of the per-round ratios
(tree B over tree A) are reported. CPU per unit is the figure our code changes; wall time
swings with the load of a shared machine. A tree from before the buses were composed (the
``WsBus`` / ``RtcStarBus`` / ``RtcMeshBus`` classes) is measured through those names.

    PYTHONPATH=client_py:server python bench/bench_bus.py --trees /tmp/old,. [--reps 3]

Writes bench/results/bench_bus.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
KINDS = ("ws-star", "rtc-star", "rtc-mesh")
LOOPBACK = ["127.0.0.1"]


def _make(kind: str, url: str) -> object:
    try:
        from tabcohort.bus.aio import mesh_bus, star_bus
    except ImportError:   # a tree from before the composition
        from tabcohort.bus.rtc import RtcMeshBus, RtcStarBus
        from tabcohort.bus.ws import WsBus
        if kind == "ws-star":
            return WsBus(url)
        if kind == "rtc-star":
            return RtcStarBus(url, host_addresses=LOOPBACK, connect_timeout_s=20.0)
        return RtcMeshBus(url, host_addresses=LOOPBACK, idle_timeout_s=None, connect_timeout_s=20.0)
    if kind == "ws-star":
        return star_bus(url)
    if kind == "rtc-star":
        return star_bus(url, link="rtc", host_addresses=LOOPBACK, connect_timeout_s=20.0)
    return mesh_bus(url, host_addresses=LOOPBACK, idle_timeout_s=None, connect_timeout_s=20.0)


def _paths(bus: object) -> dict:
    f = getattr(bus, "paths", None) or getattr(bus, "links", None)
    return f() if f is not None else {0: "ws"}


async def _until(cond, what: str, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise RuntimeError(f"not reached within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.001)


async def measure(kind: str, mb: float, params: int, beats: int) -> dict:
    from aiohttp import web
    from tabcohort_server import JobConfig, ServerConfig, ServerLimits
    from tabcohort_server.app import create_app

    topology = "mesh" if kind == "rtc-mesh" else "star"
    app = create_app(ServerConfig(rooms={"b": JobConfig(dataset="synthetic", topology=topology)},
                                  limits=ServerLimits(pressure_stall_s=3600.0), rtc_host_addresses=LOOPBACK))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"ws://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/api/rooms/b/ws"
    a, b = _make(kind, url), _make(kind, url)
    await a.connect()
    await b.connect()
    got = {"grad": 0, "beat": 0}
    b.on_message = lambda m: got.__setitem__(m["t"], got[m["t"]] + 1)
    end = time.monotonic() + 30
    while not (b.id in a.peers and a.id in b.peers and set(_paths(a).values()) <= {"rtc", "ws"}
               and (kind == "ws-star" or set(_paths(a).values()) == {"rtc"})):
        if time.monotonic() > end:
            raise RuntimeError(f"{kind}: buses not up: {_paths(a)}")
        await asyncio.sleep(0.01)
    import array
    g = array.array("f", [0.5] * params)
    n_grads = max(1, int(mb * 1e6 / (4 * params)))
    msg = {"t": "grad", "step": 1, "term": 1, "loss": 0.1, "samples": 8, "g": g, "to": b.id}
    t0, c0 = time.monotonic(), time.process_time()
    for _ in range(n_grads):
        while a.pressure() >= 1.0:
            await asyncio.sleep(0.001)
        a.post(msg)
        await asyncio.sleep(0)
    await _until(lambda: got["grad"] >= n_grads, f"{kind}: {n_grads} grads delivered (got {got})")
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    size = n_grads * 4 * params / 1e6
    beat = {"t": "beat", "batch": 8, "ready": True, "running": True, "step": 1, "backend": "py", "term": 1}
    t1, c1 = time.monotonic(), time.process_time()
    for i in range(beats):
        while a.pressure() >= 1.0:
            await asyncio.sleep(0.001)
        a.post(beat)
        if i % 64 == 0:
            await asyncio.sleep(0)
    await _until(lambda: got["beat"] >= beats, f"{kind}: {beats} beats delivered (got {got})")
    bwall, bcpu = time.monotonic() - t1, time.process_time() - c1
    for x in (a, b):
        await x.aclose()
    await runner.cleanup()
    return {"kind": kind, "mb_per_s": size / wall, "cpu_s_per_mb": cpu / size,
            "beats_per_s": beats / bwall, "cpu_us_per_beat": 1e6 * bcpu / beats}


def child(a: argparse.Namespace) -> None:
    out = asyncio.run(measure(a.kind, a.mb, a.params, a.beats))
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", default=str(HERE.parent), help="comma-separated source trees (A,B)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mb", type=float, default=32.0)
    ap.add_argument("--params", type=int, default=65536)
    ap.add_argument("--beats", type=int, default=3000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="ws-star", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    trees = [pathlib.Path(t).resolve() for t in a.trees.split(",")]
    rows: dict[str, dict[str, list[dict]]] = {}
    for rep in range(a.reps):
        for kind in a.kinds.split(","):
            for tree in (trees if rep % 2 == 0 else trees[::-1]):   # alternate which tree goes first
                env = dict(os.environ, PYTHONPATH=f"{tree / 'client_py'}{os.pathsep}{tree / 'server'}")
                r = subprocess.run([sys.executable, __file__, "--child", "--kind", kind, "--mb", str(a.mb),
                                    "--params", str(a.params), "--beats", str(a.beats)], env=env,
                                   capture_output=True, text=True, timeout=600)
                if r.returncode:
                    raise SystemExit(f"{tree} {kind}: {r.stderr[-3000:]}")
                res = json.loads(r.stdout.strip().splitlines()[-1])
                rows.setdefault(kind, {}).setdefault(str(tree), []).append(res)
                print(f"rep {rep} {kind:8s} {tree}: {res['mb_per_s']:7.1f} MB/s {res['cpu_s_per_mb'] * 1e3:6.2f} "
                      f"ms CPU/MB  {res['beats_per_s']:8.0f} beats/s {res['cpu_us_per_beat']:6.1f} us CPU/beat",
                      flush=True)
    summary = {}
    if len(trees) == 2:
        A, B = map(str, trees)
        for kind, by in rows.items():
            ratio = {k: statistics.median(b[k] / x[k] for x, b in zip(by[A], by[B]))
                     for k in ("mb_per_s", "cpu_s_per_mb", "beats_per_s", "cpu_us_per_beat")}
            summary[kind] = ratio
            print(f"{kind:8s} B/A medians: goodput {ratio['mb_per_s']:.2f}, CPU/MB {ratio['cpu_s_per_mb']:.2f}, "
                  f"beats/s {ratio['beats_per_s']:.2f}, CPU/beat {ratio['cpu_us_per_beat']:.2f}")
    res_dir = HERE / "results"
    res_dir.mkdir(exist_ok=True)
    (res_dir / "bench_bus.json").write_text(json.dumps({"args": vars(a), "rows": rows, "ratio_b_over_a": summary},
                                                       indent=1))


if __name__ == "__main__":
    main()
