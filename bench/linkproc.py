"""Rank and probe processes for the link benchmarks (bench_links.py, bench_overhead.py), and
the orchestration helpers they share.

As a script this is one *process* of a benchmark, started by the orchestrator against a real
``tabcohort serve`` on loopback:

- ``rank``: a real :class:`RankMachine` driven by the real asyncio driver over a real bus
  (``ws-star``: the star bus on the WebSocket; ``rtc-star``: the star bus on an aiortc data
  channel to the server; ``rtc-mesh``: the mesh bus, aiortc data channels between ranks) with a :class:`ToyWorker`
  whose bucket takes ``--compute-ms`` of awaited time. Every ``--sample-ms`` it appends one JSON
  line to ``--out``: wall time ``t`` (``time.time()``, shared by every process on the machine),
  ``step``, ``reduced`` (buckets that entered a reduce here, i.e. while leading), ``calls``
  (buckets computed), ``n`` (cohort size of its policy), ``leader``, ``links``;
- ``raw``: the same link with nothing of ours in between, to measure its round trip: a
  pre-encoded chunk (header + a tiny ``grad``) ping-ponged between two processes. ``ws-star``
  uses bare aiohttp WebSocket clients against the server's relay (register, then binary
  frames); ``rtc-star`` sends on the star bus's aiortc channel and receives in its message
  callback (the server relays as for the protocol); ``rtc-mesh`` sends on the mesh bus's
  peer-to-peer aiortc channel and receives in its callback. ``--role echo`` answers every chunk (it writes ``--out``.ready once it can, and only then is
  the pinger started: a ping lost before that would shift every later reply);
  ``--role ping`` sends ``--count`` pings back to back (after 20 unmeasured ones) and writes
  ``{"rtt_ms": [...], "links": ...}`` to ``--out``.

Both exit on SIGTERM/SIGINT or after ``--max-s``.

    python bench/linkproc.py rank --url WS_URL --link ws-star --rule grace --compute-ms 50 --out F
    python bench/linkproc.py raw --url WS_URL --link rtc-mesh --role ping --count 500 --out F
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "client_py", ROOT / "server", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

LINKS = ("ws-star", "rtc-star", "rtc-mesh", "tcp-mesh")
LOOPBACK = ["127.0.0.1"]
JOB = "bench-links"


# ---------------------------------------------------------------------------- orchestration
def serve_args(link: str) -> list[str]:
    """``tabcohort serve`` arguments for a room that serves ``link``."""
    # (the benchmark's ranks are its own processes without the trainer token: a trusted group)
    base = ["--dataset", "synthetic", "--report-interval", "5", "--any-rank-may-lead"]
    if link == "rtc-star":
        return base + ["--rtc-hosts", "127.0.0.1"]
    if link == "rtc-mesh":
        return base + ["--topology", "mesh"]
    return base


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TABCOHORT_")}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client_py"), str(ROOT / "server"), e.get("PYTHONPATH", "")])
    e["PYTHONUNBUFFERED"] = "1"
    return e


class Procs:
    """The helper processes one benchmark run started (only these are ever signalled)."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[subprocess.Popen, Any]] = []

    def start(self, *args: str, log: str) -> subprocess.Popen:
        fh = open(self.tmp / log, "wb")
        p = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).resolve()), *args], stdout=fh,
                             stderr=subprocess.STDOUT, env=env(), cwd=str(ROOT))
        self.procs.append((p, fh))
        return p

    def check(self) -> None:
        for p, fh in self.procs:
            if p.poll() not in (None, 0):
                raise RuntimeError(f"helper {p.args[2:4]} exited {p.returncode}:\n"
                                   + pathlib.Path(fh.name).read_text(errors="replace")[-2000:])

    def stop(self, timeout_s: float = 10.0) -> None:
        for p, _ in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout_s
        for p, fh in self.procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            fh.close()
        self.procs = []


def wait_until(cond: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05,
               check: Callable[[], None] | None = None) -> Any:
    """Poll ``cond`` until truthy; raise after ``timeout_s`` naming ``what``."""
    end = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if check is not None:
            check()
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def samples(path: pathlib.Path) -> list[dict]:
    """The JSON lines a rank process wrote so far (a torn last line is skipped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[k]


# ---------------------------------------------------------------------------- in the process
def make_bus(link: str, url: str, **kw: Any) -> Any:
    from tabcohort.bus.aio import direct_bus, mesh_bus, star_bus
    if link == "tcp-mesh":   # a star room; every pair of native ranks on its direct TCP path
        return direct_bus(url, direct_host="127.0.0.1", **kw)
    if link == "ws-star":
        return star_bus(url, **kw)
    if link.startswith("ws-star:"):   # ws-star:BYTES, chunks of at most BYTES on the WebSocket
        return star_bus(url, max_message_bytes=int(link.split(":", 1)[1]), **kw)
    if link == "rtc-star":
        return star_bus(url, link="rtc", host_addresses=LOOPBACK, **kw)
    if link == "rtc-mesh":
        return mesh_bus(url, host_addresses=LOOPBACK, **kw)
    raise ValueError(f"unknown link {link!r}; expected one of {LINKS}")


def _links(bus: Any) -> dict:
    return {("server" if k == 0 else f"{k:08x}"): v for k, v in bus.paths().items()}


def _stop_event(max_s: float) -> asyncio.Event:
    loop = asyncio.get_running_loop()
    ev = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ev.set)
    loop.call_later(max_s, ev.set)
    return ev


async def run_rank(a: argparse.Namespace) -> None:
    from tabcohort.model.toy import ToyWorker
    from tabcohort.protocol import RankMachine
    from tabcohort.runtime.driver import RankDriver

    stop = _stop_event(a.max_s)
    loop = asyncio.get_running_loop()
    kw: dict[str, Any] = {}
    if a.link == "rtc-mesh":
        kw["idle_timeout_s"] = 5.0
    bus = make_bus(a.link, a.url, **kw)
    await bus.connect()
    w = ToyWorker(bucket_len=a.bucket_len, batch=a.batch, compute_ms=a.compute_ms)
    m = RankMachine(bus.id, w, bus, job=JOB, now_ms=RankDriver.clock_ms(loop), lr=0.01, eval_every=0,
                    collect_rule=a.rule)
    d = RankDriver(m, w, bus, reads_first=True)   # (as the native runtime runs it)
    d.start(0.01)
    with open(a.out, "a", buffering=1) as out:
        while not stop.is_set():
            now = d.now_ms()
            out.write(json.dumps({"t": time.time(), "id": bus.id, "step": m.step,
                                  "reduced": m.counters["buckets_reduced"], "calls": w.calls,
                                  "n": m.policy.n, "leader": bool(m.looping), "links": _links(bus),
                                  "takeovers": m.counters["takeover"] + m.counters["bootstrap"],
                                  "cohort": len(m.cohort_ids(now))}) + "\n")
            try:
                await asyncio.wait_for(stop.wait(), a.sample_ms / 1000.0)
            except asyncio.TimeoutError:
                pass
    await d.close()
    await bus.aclose()


def _chunk(sender: int, to: int) -> bytes:
    """A tiny ``grad`` message from ``sender`` to ``to``, encoded once (one chunk)."""
    from tabcohort.wire import FrameWriter

    (c,) = FrameWriter(sender).write({"t": "grad", "to": to, "term": 1, "step": 1, "loss": 0.0, "samples": 1,
                                      "g": [0.0] * 8})
    return c


async def run_raw(a: argparse.Namespace) -> None:
    from tabcohort.wire import parse_route

    stop = _stop_event(a.max_s)
    loop = asyncio.get_running_loop()
    replies: dict[int, bytes] = {}
    got: list[asyncio.Future] = []

    def reply_for(my_id: int, sender: int) -> bytes:
        c = replies.get(sender)
        if c is None:
            c = replies[sender] = _chunk(my_id, sender)
        return c

    def on_chunk(data: bytes, send: Callable[[bytes], None], my_id: int) -> None:
        if a.role == "echo":
            send(reply_for(my_id, parse_route(data).sender))
        elif got and not got[0].done():
            got[0].set_result(None)

    links: dict = {}
    if a.link == "ws-star":
        import aiohttp
        session = aiohttp.ClientSession()
        ws = await session.ws_connect(a.url, max_msg_size=1 << 20)
        await ws.send_str(json.dumps({"type": "register", "version": 1}))
        welcome = json.loads((await ws.receive()).data)
        my_id, peers = int(welcome["id"]), set(int(k) for k in welcome.get("peers", ()))

        async def reader() -> None:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    if a.role == "echo":
                        await ws.send_bytes(reply_for(my_id, parse_route(msg.data).sender))
                    elif got and not got[0].done():
                        got[0].set_result(None)
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    obj = json.loads(msg.data)
                    if obj.get("type") == "peer":
                        (peers.add if obj.get("up") else peers.discard)(int(obj["id"]))
        tasks = [loop.create_task(reader())]
        send = ws.send_bytes                  # a coroutine: awaited below
        peer_ready = lambda: next(iter(peers), None)  # noqa: E731
        links = {"server": "ws"}

        async def close() -> None:
            for t in tasks:
                t.cancel()
            await ws.close()
            await session.close()
    else:
        bus = make_bus(a.link, a.url, **({"idle_timeout_s": None} if a.link == "rtc-mesh" else {}))
        await bus.connect()
        my_id = bus.id
        if a.link == "rtc-star":
            if bus.paths()[0] != "rtc":
                raise RuntimeError(f"the star channel did not open: {bus.path.why}")

            def send(c: bytes) -> None:
                bus.channel.send([c])
            # the raw channel callback (the bus is the channel's listener), nothing of ours after it
            bus.channel_chunk = lambda ch, data: on_chunk(data, send, my_id)
            bus.relay_sink = lambda data: None   # chunks relayed over the socket: not measured
            peer_ready = lambda: next(iter(bus.peers), None)  # noqa: E731
        else:
            def peer_ready() -> int | None:
                up = [k for k, v in bus.paths().items() if v == "rtc"]
                return up[0] if up else None

            def send(c: bytes) -> None:
                bus.channel_of[peer_ready()].send([c])
            bus.channel_chunk = lambda ch, data: on_chunk(data, send, my_id)   # the raw channel callback
            bus.relay.relay_sink = lambda data: None  # nothing may arrive on the relay
        links = _links(bus)

        async def close() -> None:
            await bus.aclose()

    if a.role == "echo":
        pathlib.Path(a.out + ".ready").write_text("ready")   # the orchestrator starts the pinger now
    if a.role == "ping":
        end = loop.time() + 30
        while (peer := peer_ready()) is None:
            if loop.time() > end:
                raise RuntimeError("no peer to ping within 30 s")
            await asyncio.sleep(0.01)
        ping = _chunk(my_id, peer)
        rtts = []
        for i in range(20 + a.count):
            got[:] = [loop.create_future()]
            t0 = time.perf_counter()
            sent = send(ping)
            if sent is not None:
                await sent
            await asyncio.wait_for(got[0], 10)
            if i >= 20:
                rtts.append((time.perf_counter() - t0) * 1000.0)
        if a.link != "ws-star":
            links = _links(bus)
        pathlib.Path(a.out).write_text(json.dumps({"rtt_ms": rtts, "links": links}))
    else:
        await stop.wait()
    await close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("rank")
    r.add_argument("--rule", choices=("quorum", "grace"), default="quorum")
    r.add_argument("--compute-ms", type=float, default=50.0)
    r.add_argument("--bucket-len", type=int, default=64)
    r.add_argument("--batch", type=int, default=8)
    r.add_argument("--sample-ms", type=float, default=50.0)
    w = sub.add_parser("raw")
    w.add_argument("--role", choices=("ping", "echo"), required=True)
    w.add_argument("--count", type=int, default=500)
    for p in (r, w):
        p.add_argument("--url", required=True, help="the room's WebSocket URL")
        p.add_argument("--link", choices=LINKS, required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--max-s", type=float, default=180.0)
    a = ap.parse_args()
    asyncio.run(run_rank(a) if a.mode == "rank" else run_raw(a))


if __name__ == "__main__":
    main()
