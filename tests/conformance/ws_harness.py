"""The WebSocket star bus under the conformance battery: a real server (tabcohort_server) on
127.0.0.1 with an ephemeral port, in the harness's own loop, and real client sockets."""

from __future__ import annotations

import asyncio

from tabcohort.bus import Bus

from .bus_harness import LoopBusHarness

SETTLE_TIMEOUT_S = 20.0


class WsHarness(LoopBusHarness):
    def __init__(self, precision: str = "f32", *, max_message_bytes: int = 65536) -> None:
        super().__init__()
        self.precision = precision
        self.max_message_bytes = max_message_bytes
        self.high_water_bytes = 1 << 20
        self.buses: list = []
        self.runner = None
        self.room = None
        self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        from aiohttp import web
        from tabcohort_server import JobConfig, ServerConfig, ServerLimits
        from tabcohort_server.app import ROOMS, create_app

        cfg = ServerConfig(rooms={"conf": JobConfig(dataset="synthetic", precision=self.precision)},
                           # pressure_report_s 1 ms: the relay tells pressure changes almost at once (the
                           # battery checks the bus contract; the relay's coalescing of sub-1 changes is
                           # tests/integration/test_rooms.py's), and _quiet flushes a held-back one
                           limits=ServerLimits(pressure_stall_s=3600.0, queue_high_water_bytes=self.high_water_bytes,
                                               queue_max_bytes=256 << 20, queue_max_items=100_000,
                                               pressure_report_s=1e-3))
        app = create_app(cfg)
        self.room = app[ROOMS].get("conf")
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}/api/rooms/conf/ws"

    async def amake(self, n: int) -> list[Bus]:
        from tabcohort.bus.aio import star_bus

        new = []
        for _ in range(n):
            b = star_bus(self.url, precision=self.precision, max_message_bytes=self.max_message_bytes,
                      high_water_bytes=self.high_water_bytes)
            await b.connect()
            new.append(b)
        self.buses += new
        ids = {b.id for b in self.buses}
        await self._until(lambda: all(b.peers == ids - {b.id} for b in self.buses if not b.closed))
        return new

    async def _until(self, cond, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while not cond():
            if loop.time() > end:
                raise TimeoutError("condition not reached")
            await asyncio.sleep(0.002)

    def _snapshot(self):
        room = self.room
        out = []
        for b in self.buses:
            p = room.peers.get(b.id)
            out.append((b.n_sent, b.n_received, b.queued_bytes(), None if p is None else
                        (p.n_in, p.n_out, p.queued_bytes, p.connected), b.relay_pressure))
        return out

    def _quiet(self) -> bool:
        room = self.room
        if room._pressure_dirty:   # a change held back by pressure_report_s: the relay's tick would tell it
            room.flush_pressure()
            return False
        for b in self.buses:
            if b.closed:
                continue
            p = room.peers.get(b.id)
            if p is None or b.queued_bytes() or p.n_in != b.n_sent:
                return False
            gated = b.stalled
            if not gated and (p.queue or p.n_out != b.n_received):
                return False
        return True

    async def asettle(self) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + SETTLE_TIMEOUT_S
        last, stable = None, 0
        while True:
            await asyncio.sleep(0.002)
            snap = self._snapshot()
            if self._quiet() and snap == last:
                stable += 1
                if stable >= 3:
                    return
            else:
                stable = 0
            last = snap
            if loop.time() > end:
                raise RuntimeError("WebSocket relay did not settle")

    def stall(self, bus: Bus, stalled: bool) -> None:
        bus.stall(stalled)

    def close(self) -> None:
        async def down() -> None:
            for b in self.buses:
                await b.aclose()
            await self.runner.cleanup()
        self.loop.run_until_complete(down())
        super().close()
