"""A rank that reaches a cluster node which does not own its room: sent to the owner (the WebSocket
closed with 4012 and the owner's URL; what ``tabcohort serve --redis`` does) against a proxy on
the node it reached (every frame relayed twice). README "Cluster".

A real redis-server and two ``tabcohort serve --redis`` nodes (A owns the room) on loopback. Two
measurements, side by side in one run:

- **connect**: time from opening the socket to the server's ``welcome`` for a ``StarBus`` pointed at
  A (direct) and at B (4012, then A): the redirect's cost, paid once per (re)connect;
- **round trip**: a small frame from rank X to rank Y and back (``beat`` messages addressed
  ``to``), both ranks linked to A directly, against both linked through a minimal aiohttp
  WebSocket pass-through proxy standing in for B (what proxying costs on every frame).

Writes ``bench/results/cluster.json`` and prints a Markdown table.

Usage: PYTHONPATH=client_py:server python bench/bench_cluster.py [--pings 300] [--connects 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client_py"))
sys.path.insert(0, str(ROOT / "server"))

from tabcohort.bus.aio import star_bus, ws_url  # noqa: E402

ROOM = "r"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_url(log: pathlib.Path, p: subprocess.Popen, timeout_s: float = 60) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("URL "):
                return line.split()[1]
        if p.poll() is not None:
            raise SystemExit(f"serve exited: {log.read_text()}")
        time.sleep(0.1)
    raise SystemExit("no URL from serve")


async def _proxy(owner: str, port: int) -> object:
    """A pass-through WebSocket proxy on ``port`` to ``owner`` (both directions, message by message)."""
    import aiohttp
    from aiohttp import web

    async def handle(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=1 << 20)
        await ws.prepare(request)
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(ws_url(owner, ROOM), max_msg_size=1 << 20) as up:
                async def pump(a, b) -> None:
                    async for m in a:
                        if m.type == aiohttp.WSMsgType.BINARY:
                            await b.send_bytes(m.data)
                        elif m.type == aiohttp.WSMsgType.TEXT:
                            await b.send_str(m.data)
                        else:
                            break
                    await b.close()
                await asyncio.gather(pump(ws, up), pump(up, ws), return_exceptions=True)
        return ws

    app = web.Application()
    app.router.add_get(f"/api/rooms/{ROOM}/ws", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _connect_ms(url: str) -> float:
    bus = star_bus(ws_url(url, ROOM))
    t0 = time.perf_counter()
    await bus.connect()
    dt = (time.perf_counter() - t0) * 1000.0
    await bus.aclose()
    return dt


async def _rtt_ms(url: str, pings: int) -> tuple[float, float]:
    x, y = star_bus(ws_url(url, ROOM)), star_bus(ws_url(url, ROOM))
    await x.connect()
    await y.connect()
    loop = asyncio.get_running_loop()
    while y.id not in x.peers:
        await asyncio.sleep(0.01)
    got: asyncio.Queue = asyncio.Queue()
    beat = {"t": "beat", "batch": 1, "ready": True, "running": True, "step": 0, "backend": "x", "term": 0}
    y.on_message = lambda m: y.post(dict(beat, **{"from": y.id, "to": x.id, "step": m["step"]}))
    x.on_message = lambda m: got.put_nowait(m["step"])
    out = []
    for i in range(pings):
        t0 = loop.time()
        x.post(dict(beat, **{"from": x.id, "to": y.id, "step": i}))
        while await asyncio.wait_for(got.get(), 10) != i:
            pass
        out.append((loop.time() - t0) * 1000.0)
    await x.aclose()
    await y.aclose()
    return statistics.median(out), sorted(out)[int(0.99 * (len(out) - 1))]


async def amain(a: argparse.Namespace) -> dict:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    rport = _free_port()
    redis = subprocess.Popen([shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(rport), "--bind",
                              "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "client_py"), str(ROOT / "server")]))
    nodes = []
    try:
        urls = []
        for name in ("A", "B"):
            log = tmp / f"{name}.log"
            p = subprocess.Popen([sys.executable, "-m", "tabcohort.cli", "serve", "--port", "0", "--room", ROOM,
                                  "--dataset", "synthetic", "--redis", f"redis://127.0.0.1:{rport}/0", "--node-id",
                                  name, "--checkpoint-dir", str(tmp / "ck")], stdout=open(log, "wb"),
                                 stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
            nodes.append(p)
            urls.append(_wait_url(log, p))
        a_url, b_url = urls
        pport = _free_port()
        runner = await _proxy(a_url, pport)
        p_url = f"http://127.0.0.1:{pport}"
        direct, moved = [], []
        for _ in range(a.connects):       # interleaved
            direct.append(await _connect_ms(a_url))
            moved.append(await _connect_ms(b_url))
        rtt_direct = await _rtt_ms(a_url, a.pings)
        rtt_proxy = await _rtt_ms(p_url, a.pings)
        rtt_direct2 = await _rtt_ms(a_url, a.pings)
        await runner.cleanup()
        return {"connect_ms": {"direct": statistics.median(direct), "moved": statistics.median(moved)},
                "rtt_ms": {"direct": [rtt_direct, rtt_direct2], "proxy": rtt_proxy},
                "pings": a.pings, "connects": a.connects}
    finally:
        for p in nodes:
            p.terminate()
        for p in nodes:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        redis.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pings", type=int, default=300)
    ap.add_argument("--connects", type=int, default=20)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "cluster.json"))
    a = ap.parse_args(argv)
    r = asyncio.run(amain(a))
    pathlib.Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(a.json).write_text(json.dumps(r, indent=2))
    c, t = r["connect_ms"], r["rtt_ms"]
    d = statistics.mean(x[0] for x in t["direct"])
    print(f"*two `tabcohort serve --redis` nodes and a redis-server on loopback; median of {a.connects} "
          f"interleaved connects, {a.pings} round trips per path*")
    print()
    print("| path | connect to welcome ms (median) | frame round trip ms p50 | p99 | round trip vs direct |")
    print("|---|---:|---:|---:|---:|")
    print(f"| rank at the owner (direct) | {c['direct']:.2f} | {d:.3f} (before {t['direct'][0][0]:.3f} / after "
          f"{t['direct'][1][0]:.3f}) | {max(x[1] for x in t['direct']):.3f} | 1.00 |")
    print(f"| rank at another node, sent to the owner (4012) | {c['moved']:.2f} | {d:.3f} (as direct once moved) "
          f"| - | 1.00 |")
    print(f"| rank at another node that proxies every frame | {c['direct']:.2f} + one proxy hop | "
          f"{t['proxy'][0]:.3f} | {t['proxy'][1]:.3f} | {t['proxy'][0] / d:.2f} |")
    print()
    print(f"JSON: {os.path.relpath(a.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
