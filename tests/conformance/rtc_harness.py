"""WebRTC buses under the conformance battery: a real server (tabcohort_server) on 127.0.0.1 in
the harness's loop, and aiortc data channels on loopback (host candidates forced to 127.0.0.1).

- ``RtcMeshHarness``: a mesh room; every pair must be on a data channel (``rtc``) before a case
  runs, so a silent fallback to the relay fails the battery.
- ``RtcStarHarness``: a star room whose ranks link to the server over WebRTC (``--link rtc``).

``small_message_bytes`` rewrites the ``a=max-message-size`` of SDPs on their way through the
server (RFC 8841 section 6), as a browser that takes 16 or 64 KiB messages advertises it: in the
mesh every offer and answer (each rank cuts its chunks to that size); in the star the ranks'
offers only, so ranks send 256 KiB chunks and the server must re-cut every large frame for
every receiver (``wire.rechunk``) or aiortc refuses the send.
"""

from __future__ import annotations

import asyncio
import re

from tabcohort.bus import Bus
from tabcohort.wire import rechunk

from .bus_harness import LoopBusHarness

SETTLE_TIMEOUT_S = 30.0
LOOPBACK = ["127.0.0.1"]


def cap_sdp(sdp: str, max_message_bytes: int) -> str:
    """``sdp`` with every ``a=max-message-size`` set to ``max_message_bytes``."""
    out, n = re.subn(r"a=max-message-size:\d+", f"a=max-message-size:{max_message_bytes}", sdp)
    if not n:
        raise AssertionError("the SDP carries no a=max-message-size to rewrite")
    return out


class _RtcHarness(LoopBusHarness):
    topology = "star"

    def __init__(self, precision: str = "f32", *, small_message_bytes: int | None = None) -> None:
        super().__init__()
        self.precision = precision
        self.small_message_bytes = small_message_bytes
        self.n_rewritten = 0
        self.max_message_bytes = 262144
        self.high_water_bytes = 1 << 20
        self.buses: list = []
        self.runner = None
        self.room = None
        self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        from aiohttp import web
        from tabcohort_server import JobConfig, ServerConfig, ServerLimits
        from tabcohort_server.app import ROOMS, create_app

        cfg = ServerConfig(rooms={"conf": JobConfig(dataset="synthetic", precision=self.precision,
                                                    topology=self.topology)},
                           limits=ServerLimits(pressure_stall_s=3600.0, queue_high_water_bytes=self.high_water_bytes,
                                               queue_max_bytes=256 << 20, queue_max_items=100_000),
                           rtc_host_addresses=LOOPBACK)
        app = create_app(cfg)
        self.room = app[ROOMS].get("conf")
        if self.small_message_bytes is not None:
            self._rewrite_sdps(self.small_message_bytes)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}/api/rooms/conf/ws"

    def _capped(self, sig: dict, n: int) -> dict:
        if isinstance(sig.get("sdp"), str) and sig.get("kind") in ("offer", "answer"):
            self.n_rewritten += 1
            return dict(sig, sdp=cap_sdp(sig["sdp"], n))
        return sig

    def _rewrite_sdps(self, n: int) -> None:
        raise NotImplementedError

    async def _until(self, cond, what: str, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while not cond():
            if loop.time() > end:
                raise TimeoutError(f"condition not reached: {what}")
            await asyncio.sleep(0.005)

    def stall(self, bus: Bus, stalled: bool) -> None:
        bus.stall(stalled)

    def close(self) -> None:
        async def down() -> None:
            for b in self.buses:
                await b.aclose()
            await self.runner.cleanup()
        self.loop.run_until_complete(down())
        super().close()


class RtcMeshHarness(_RtcHarness):
    topology = "mesh"

    def __init__(self, precision: str = "f32", *, small_message_bytes: int | None = None) -> None:
        super().__init__(precision, small_message_bytes=small_message_bytes)
        if small_message_bytes is not None:
            self.max_message_bytes = small_message_bytes   # every link's cut

    def _rewrite_sdps(self, n: int) -> None:
        room, forward = self.room, self.room.signal     # offers and answers between ranks
        room.signal = lambda p, obj: forward(p, self._capped(obj, n))

    async def amake(self, n: int) -> list[Bus]:
        from tabcohort.bus.aio import mesh_bus

        new = []
        for _ in range(n):
            b = mesh_bus(self.url, precision=self.precision, host_addresses=LOOPBACK, idle_timeout_s=None,
                           connect_timeout_s=20.0)
            await b.connect()
            new.append(b)
        self.buses += new
        live = [b for b in self.buses if not b.closed]
        ids = {b.id for b in live}
        await self._until(lambda: all(set(b.paths()) == ids - {b.id} and set(b.paths().values()) <= {"rtc"}
                                      for b in live), "every pair on a data channel")
        return new

    def _quiet(self) -> bool:
        live = {b.id: b for b in self.buses if not b.closed}
        for a in live.values():
            for p, path in a.path_of.items():
                b = live.get(p)
                if b is None:
                    continue  # a closed peer: its path may have moved to the relay, nothing to carry
                if path.state.value != "rtc":
                    return False
                if b.stalled:
                    continue  # a stalled receiver cannot make progress: nothing to wait for
                if path.queued_bytes or a.channel_of.get(p) is None or a.channel_buffered(p):
                    return False
                if b.path(a.id).received != path.sent:
                    return False
        return True

    async def asettle(self) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + SETTLE_TIMEOUT_S
        stable = 0
        while stable < 3:
            await asyncio.sleep(0.005)
            stable = stable + 1 if self._quiet() else 0
            if loop.time() > end:
                raise RuntimeError("WebRTC mesh did not settle")


class RtcStarHarness(_RtcHarness):
    """A star room whose ranks all link to the server over a data channel; settles like the
    WebSocket star (the relay's counters against the buses'), channel counters included."""

    topology = "star"

    def _rewrite_sdps(self, n: int) -> None:
        room, answer = self.room, self.room.on_server_signal    # the ranks' offers to the server
        room.on_server_signal = lambda p, sig: answer(p, self._capped(sig, n))

    def received_size(self, sender: Bus, receiver: Bus, msg: dict) -> int:
        """What arrives: the server re-cuts to the receiver's channel size."""
        if self.small_message_bytes is None:
            return self.encoded_size(sender, msg)
        from tabcohort.wire import FrameWriter
        w = FrameWriter(sender.id, precision=self.precision, max_message_bytes=self.max_message_bytes)
        return sum(len(c) for ch in w.write(msg) for c in rechunk(ch, self.small_message_bytes))

    async def amake(self, n: int) -> list[Bus]:
        from tabcohort.bus.aio import star_bus

        new = []
        for _ in range(n):
            b = star_bus(self.url, link="rtc", precision=self.precision, host_addresses=LOOPBACK, connect_timeout_s=20.0)
            await b.connect()
            if b.paths()[0] != "rtc":
                raise RuntimeError(f"star data channel did not open: {b.path.why}")
            if self.small_message_bytes is not None:    # the server's side of the channel is capped
                await self._until(lambda b=b: (lk := self.room.peers[b.id].rtc) is not None and lk.up,
                                  "server channel up")
                sctp = self.room.peers[b.id].rtc.pc.sctp
                assert sctp._remote_max_message_size == self.small_message_bytes, sctp._remote_max_message_size
                assert b.writer.max_message_bytes == self.max_message_bytes
            new.append(b)
        self.buses += new
        ids = {b.id for b in self.buses}
        await self._until(lambda: all(b.peers == ids - {b.id} for b in self.buses if not b.closed)
                          and all(self.room.peers[b.id].rtc is not None and self.room.peers[b.id].rtc.up
                                  for b in self.buses if not b.closed), "peers known, server channels up")
        return new

    def _quiet(self) -> bool:
        room = self.room
        for b in self.buses:
            if b.closed:
                continue
            p = room.peers.get(b.id)
            if p is None or b.queued_bytes() or (b.channel is not None and b.channel.buffered_bytes()):
                return False
            if p.rtc is None:
                return False
            gated = b.stalled
            if not gated and (p.queue or (p.rtc.channel is not None and p.rtc.channel.bufferedAmount)
                              or p.rtc.bytes_out != b.path.direct_received):
                return False
        sent = sum(x.path.direct_sent for x in self.buses)
        got = sum(room.peers[x.id].rtc.bytes_in for x in self.buses if x.id in room.peers and room.peers[x.id].rtc)
        return sent == got

    async def asettle(self) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + SETTLE_TIMEOUT_S
        stable = 0
        while stable < 4:
            await asyncio.sleep(0.005)
            stable = stable + 1 if self._quiet() else 0
            if loop.time() > end:
                raise RuntimeError("WebRTC star did not settle")
