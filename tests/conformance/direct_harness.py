"""The direct TCP bus (``tcp-mesh``, :func:`tabcohort.bus.aio.direct_bus`) under the conformance
battery: a real server (tabcohort_server) on 127.0.0.1 in the harness's loop, star room, and
every pair of buses on its own authenticated TCP connection before a case runs, so a silent
fallback to the relay fails the battery."""

from __future__ import annotations

import asyncio

from tabcohort.bus import Bus

from .rtc_harness import SETTLE_TIMEOUT_S, _RtcHarness


class DirectHarness(_RtcHarness):
    topology = "star"

    def __init__(self, precision: str = "f32") -> None:
        super().__init__(precision)
        from tabcohort.bus.direct import DIRECT_MAX_MESSAGE_BYTES

        self.max_message_bytes = DIRECT_MAX_MESSAGE_BYTES   # every pair is direct: its cut

    async def amake(self, n: int) -> list[Bus]:
        from tabcohort.bus.aio import direct_bus

        new = []
        for _ in range(n):
            b = direct_bus(self.url, precision=self.precision, direct_host="127.0.0.1", idle_timeout_s=None,
                           connect_timeout_s=20.0)
            await b.connect()
            new.append(b)
        self.buses += new
        live = [b for b in self.buses if not b.closed]
        ids = {b.id for b in live}
        await self._until(lambda: all(set(b.paths()) == ids - {b.id} and set(b.paths().values()) <= {"tcp"}
                                      for b in live), "every pair on its direct TCP path")
        # the server knows no pair needs its relay (else it would relay broadcasts twice)
        await self._until(lambda: all(self.room.peers[b.id].relay_peers == set() for b in live),
                          "relay_peers declared empty")
        return new

    def _quiet(self) -> bool:
        live = {b.id: b for b in self.buses if not b.closed}
        for a in live.values():
            for p, path in a.path_of.items():
                b = live.get(p)
                if b is None:
                    continue
                if path.label != "tcp":
                    return False
                if b.stalled:
                    continue
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
                raise RuntimeError("direct TCP mesh did not settle")
