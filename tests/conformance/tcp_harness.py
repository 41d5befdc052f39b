"""The direct TCP bus (tabcohort.pg.tcp) under the conformance battery: real sockets on
127.0.0.1 with ephemeral ports, a full mesh built by the same listener/dial handshake the
process group uses, in the harness's own loop."""

from __future__ import annotations

import asyncio

from tabcohort.bus import Bus
from tabcohort.wire import FrameWriter

from .bus_harness import LoopBusHarness

SETTLE_TIMEOUT_S = 20.0


class TcpHarness(LoopBusHarness):
    def __init__(self, precision: str = "f32", *, max_message_bytes: int = 1 << 20) -> None:
        super().__init__()
        self.precision = precision
        self.max_message_bytes = max_message_bytes
        self.high_water_bytes = 1 << 20
        self.buses: list = []

    async def amake(self, n: int) -> list[Bus]:
        from tabcohort.pg.tcp import Listener, TcpBus, dial

        buses = [TcpBus(i, precision=self.precision, max_message_bytes=self.max_message_bytes,
                        high_water_bytes=self.high_water_bytes) for i in range(n)]
        listeners = [Listener(b, world=n, topology="mesh", expect=set(range(b.id + 1, n))) for b in buses]
        ports = [await lst.start("127.0.0.1", 0) for lst in listeners]
        deadline = self.loop.time() + SETTLE_TIMEOUT_S
        await asyncio.gather(*(dial(b, j, "127.0.0.1", ports[j], world=n, topology="mesh", deadline=deadline)
                               for b in buses for j in range(b.id)))
        await asyncio.wait_for(asyncio.gather(*(lst.arrived.wait() for lst in listeners)), SETTLE_TIMEOUT_S)
        for lst in listeners:
            lst.close()
        self.buses = buses
        return buses

    def encoded_size(self, bus: Bus, msg: dict) -> int:
        """TCP carries each chunk behind a 4-byte length prefix; bytes() counts it."""
        w = FrameWriter(bus.id, precision=self.precision, max_message_bytes=self.max_message_bytes)
        return sum(len(c) + 4 for c in w.write(msg))

    def _snapshot(self):
        return [(b.id, p, lk.sent, lk.received, b.queued_bytes(p)) for b in self.buses for p, lk in b.links.items()]

    def _quiet(self) -> bool:
        by_id = {b.id: b for b in self.buses}
        for a in self.buses:
            if a.closed:
                continue
            for p, lk in a.links.items():
                b = by_id[p]
                if b.closed or not lk.alive:
                    continue
                if b._gate.is_set() and b.links[a.id].received != lk.sent:
                    return False
        return True

    async def asettle(self) -> None:
        end = self.loop.time() + SETTLE_TIMEOUT_S
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
            if self.loop.time() > end:
                raise RuntimeError("TCP buses did not settle")

    def stall(self, bus: Bus, stalled: bool) -> None:
        bus.stall(stalled)

    def close(self) -> None:
        async def down() -> None:
            for b in self.buses:
                await b.aclose()
        self.loop.run_until_complete(down())
        super().close()
