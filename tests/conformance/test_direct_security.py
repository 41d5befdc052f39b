"""A direct TCP path's listening port is reachable by anyone on the network: only a dialler that
proves the pair's key (docs/PROTOCOL.md, "Direct TCP path") gets a chunk read. Real sockets on
127.0.0.1 against a real server (the conformance harness's)."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "emscripten", reason="sockets: native tiers only")


@pytest.fixture
def pair():
    from .direct_harness import DirectHarness

    h = DirectHarness("f32")
    a, b = h.make(2)
    yield h, a, b
    h.close()


def _beat(sender: int) -> list[bytes]:
    from tabcohort.wire import FrameWriter

    return FrameWriter(sender).write({"t": "beat", "batch": 8, "ready": True, "running": True, "step": 7,
                                      "backend": "x", "term": 1})


async def _talk(port: int, data: bytes, wait_s: float = 2.0) -> bytes:
    """Send ``data``, read until the listener closes (bounded)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    got = b""
    try:
        while True:
            x = await asyncio.wait_for(r.read(65536), wait_s)
            if not x:
                break
            got += x
    except (asyncio.TimeoutError, ConnectionError):
        pass
    w.close()
    return got


def test_a_stranger_without_the_key_is_refused_and_injects_nothing(pair):
    from tabcohort.bus import direct

    h, a, b = pair
    lo = a if a.id < b.id else b   # the listener of the pair
    delivered: list[dict] = []
    lo.on_message = delivered.append
    port = lo.connector.server.sockets[0].getsockname()[1]
    frames = direct.frame(_beat(0xBAD))
    # garbage, an HTTP request, a well-formed hello for no pending offer: closed, nothing read
    for data in (os.urandom(60) + frames, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 40 + frames,
                 direct.dial_hello(os.urandom(32), lo.id, 0xBAD, os.urandom(16)) + frames):
        assert h.loop.run_until_complete(_talk(port, data)) == b""
    # an offer pending for a peer, and a dialler with the wrong key: closed, nothing read
    async def offer():
        c = lo.connector.open(0xBAD, lo)
        await asyncio.wait_for(_until(lambda: c.key is not None), 5)
        return c
    ch = h.loop.run_until_complete(offer())
    wrong = direct.dial_hello(os.urandom(32), lo.id, 0xBAD, os.urandom(16))
    assert h.loop.run_until_complete(_talk(port, wrong + frames)) == b""
    drops = lo.connector.drops
    assert drops.get("direct_bad_hello") == 2 and drops.get("direct_unexpected") == 1, drops
    assert drops.get("direct_auth_failed") == 1, drops
    assert not [m for m in delivered if m.get("from") == 0xBAD]
    # the pair's own path is untouched
    assert a.paths()[b.id] == "tcp" and b.paths()[a.id] == "tcp"
    ch.close()


def test_the_dialler_checks_the_listener_holds_the_key(pair):
    """A listener that answers with a wrong MAC (not the peer announced): the dialler drops it."""
    h, a, b = pair
    hi = a if a.id > b.id else b

    async def impostor() -> int:
        async def serve(r, w):
            await r.readexactly(60)
            w.write(os.urandom(32))
            await r.read()          # until the dialler hangs up
            w.close()
        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        return srv.sockets[0].getsockname()[1]
    port = h.loop.run_until_complete(impostor())
    n = hi.connector.drops.get("direct_auth_failed", 0)
    downs: list[str] = []

    class L:
        id = hi.id

        def channel_open(self, ch, m):
            downs.append("open")

        def channel_down(self, ch, why):
            downs.append(why)

        def channel_chunk(self, ch, c, owned=False):
            downs.append("chunk")

        def channel_progress(self, ch):
            downs.append("chunk")

        def channel_low(self, ch):
            pass

        def channel_signal(self, ch, s):
            pass
    async def dial():
        hi.connector.open(0xBAD, L(), offer={"kind": "direct", "addr": f"127.0.0.1:{port}", "key": "ab" * 32})
        await asyncio.wait_for(_until(lambda: downs), 10)
    h.loop.run_until_complete(dial())
    assert "open" not in downs and "chunk" not in downs, downs
    assert hi.connector.drops.get("direct_auth_failed", 0) == n + 1


def test_a_long_chunk_arriving_slowly_keeps_its_path_up(pair):
    """docs/PROTOCOL.md "Direct TCP path", Fallback: the bytes of a chunk still arriving count
    as the peer's, so a whole-frame chunk on a slow link (seconds for 4 MiB at a few Mbit/s,
    the peer's beats queued behind it) does not expire its path by the idle bound."""
    from tabcohort.bus import direct
    from tabcohort.vec import to_vector
    from tabcohort.wire import FrameWriter

    h, a, b = pair
    got: list[dict] = []
    a.on_message = got.append
    a.idle_timeout_s = 0.3
    g = to_vector(range(200_000))      # (an exact float32 each: compared below as a list)
    (chunk,) = FrameWriter(b.id, max_message_bytes=direct.DIRECT_MAX_MESSAGE_BYTES).write(
        {"t": "grad", "term": 1, "step": 1, "loss": 0.5, "samples": 8, "g": g, "to": a.id})
    data = direct.frame([chunk])
    transport = b.channel_of[a.id].stream.transport

    async def trickle():
        parts = 10
        step = -(-len(data) // parts)
        for i in range(parts):            # 10 x 0.15 s: five idle bounds without a whole chunk
            transport.write(data[i * step:(i + 1) * step])
            await asyncio.sleep(0.15)
            a.supervise(a.now_ms())
            assert a.paths()[b.id] == "tcp", (i, a.paths())
        await asyncio.wait_for(_until(lambda: got), 5)
    h.loop.run_until_complete(trickle())
    assert got[0]["t"] == "grad" and list(got[0]["g"]) == list(g)
    assert a.paths()[b.id] == "tcp"


def test_a_member_cannot_speak_for_another_rank_on_its_own_path():
    """docs/PROTOCOL.md "Direct TCP path": a chunk on a peer's path is that peer's, as the relay
    binds a chunk's sender to its link. A member that completed the handshake and writes frames
    naming another rank (a beat "from" a rank saying it stopped, a bucket "from" it, a rank not
    in the room) gets them dropped and counted (``spoofed_sender``); its own frames still go."""
    from tabcohort.bus import direct
    from tabcohort.wire import FrameWriter

    from .direct_harness import DirectHarness

    h = DirectHarness("f32")
    try:
        a, b, c = h.make(3)
        got: list[dict] = []
        a.on_message = got.append
        forged = FrameWriter(c.id).write({"t": "beat", "batch": 8, "ready": True, "running": False, "step": 7,
                                          "backend": "x", "term": 9})
        forged += FrameWriter(c.id, max_message_bytes=direct.DIRECT_MAX_MESSAGE_BYTES).write(
            {"t": "grad", "term": 1, "step": 1, "loss": 0.5, "samples": 8, "g": [1.0] * 10, "to": a.id})
        forged += FrameWriter(0xBAD).write({"t": "beat", "batch": 8, "ready": True, "running": True, "step": 7,
                                            "backend": "x", "term": 1})
        own = FrameWriter(b.id).write({"t": "beat", "batch": 8, "ready": True, "running": True, "step": 3,
                                       "backend": "x", "term": 1})
        b.channel_of[a.id].stream.transport.write(direct.frame(forged + own))

        async def wait():
            await asyncio.wait_for(_until(lambda: got), 5)
            await asyncio.sleep(0.2)          # (anything forged would have come by now)
        h.loop.run_until_complete(wait())
        assert [(m["t"], m["from"]) for m in got] == [("beat", b.id)], got
        assert a.drops().get("spoofed_sender") == 3, a.drops()
        assert a.paths()[b.id] == "tcp" and a.paths()[c.id] == "tcp"
    finally:
        h.close()


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.01)


def test_a_dial_given_up_in_its_handshake_closes_its_connection():
    """PROTOCOL.md "Direct TCP path", Fallback: a listener that takes the connection and never
    answers. The dialler gives up at its connect bound and closes the socket (it stayed open: one
    leaked connection per offer, and any member could send offers naming such a port)."""
    from tabcohort.bus.aio import TcpConnector

    async def main() -> tuple[list[str], bytes | None]:
        eof: list[bytes] = []

        async def tarpit(r, w):
            await r.readexactly(60)                 # the dialler's hello, then silence
            try:
                eof.append(await asyncio.wait_for(r.read(1), 10.0))
            except asyncio.TimeoutError:
                pass
            w.close()
        srv = await asyncio.start_server(tarpit, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        conn = TcpConnector(host="127.0.0.1", connect_timeout_s=0.5)
        downs: list[str] = []

        class L:
            id = 5

            def channel_down(self, ch, why):
                downs.append(why)

            def __getattr__(self, name):
                return lambda *a, **k: downs.append(name)
        conn.open(9, L(), offer={"kind": "direct", "addr": f"127.0.0.1:{port}", "key": "ab" * 32})
        await asyncio.wait_for(_until(lambda: eof), 5)
        await conn.aclose()
        srv.close()
        return downs, eof[0]
    downs, got = asyncio.run(main())
    assert got == b"" and len(downs) == 1 and "failed" in downs[0], downs
