"""Harnesses: how the bus conformance battery drives one transport.

A harness makes ``n`` connected buses and moves time forward. Its methods are synchronous so
the battery also runs under Pyodide (where no asyncio loop can be run to completion). A
transport that needs asyncio (WebSocket relay, aiortc) subclasses :class:`LoopBusHarness`,
implements ``async asettle()`` / ``async amake(n)``, and its harness owns the loop.

To add a transport: write a harness here and register a factory in ``conftest.HARNESSES``.
Every registered harness runs every battery case; none may skip one.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tabcohort.bus import Bus, MemoryNetwork
from tabcohort.sched import SimScheduler
from tabcohort.wire import FrameWriter


class BusHarness:
    """What the battery needs from a transport under test.

    Attributes:
        precision: the wire precision of every bus made.
        max_message_bytes: the chunk limit, to compute encoded sizes.
        high_water_bytes: the per-link high-water mark (``pressure() == 1``).
    """

    precision = "f32"
    max_message_bytes = 65536
    high_water_bytes = 1 << 20

    def make(self, n: int) -> list[Bus]:
        """``n`` buses with distinct ids, connected to one another, ready to post."""
        raise NotImplementedError

    def settle(self) -> None:
        """Deliver everything deliverable now (bounded); return when the network is quiet."""
        raise NotImplementedError

    def stall(self, bus: Bus, stalled: bool) -> None:
        """Make ``bus`` stop (True) or resume (False) taking messages off the wire."""
        raise NotImplementedError

    def encoded_size(self, bus: Bus, msg: dict) -> int:
        """Bytes one copy of ``msg`` from ``bus`` puts on a link (chunk headers included)."""
        w = FrameWriter(bus.id, precision=self.precision, max_message_bytes=self.max_message_bytes)
        return sum(map(len, w.write(msg)))

    def received_size(self, sender: Bus, receiver: Bus, msg: dict) -> int:
        """Bytes one copy of ``msg`` from ``sender`` takes off ``receiver``'s link: the encoded
        size, unless a relay re-cuts chunks for the receiver's link (``wire.rechunk``)."""
        return self.encoded_size(sender, msg)

    def close(self) -> None:
        """Tear everything down."""


class LoopBusHarness(BusHarness):
    """Base for transports that need an asyncio loop: sync methods run the loop here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    async def amake(self, n: int) -> list[Bus]:
        raise NotImplementedError

    async def asettle(self) -> None:
        raise NotImplementedError

    def make(self, n: int) -> list[Bus]:
        return self.loop.run_until_complete(self.amake(n))

    def settle(self) -> None:
        self.loop.run_until_complete(self.asettle())

    def close(self) -> None:
        self.loop.close()


class MemoryHarness(BusHarness):
    """The in-memory bus on a :class:`SimScheduler` (virtual time)."""

    def __init__(self, precision: str = "f32", *, max_message_bytes: int = 65536,
                 high_water_bytes: int = 1 << 20, **link: Any) -> None:
        self.precision = precision
        self.max_message_bytes = max_message_bytes
        self.high_water_bytes = high_water_bytes
        self.sched = SimScheduler()
        self.net = MemoryNetwork(self.sched, seed=1, precision=precision,
                                 max_message_bytes=max_message_bytes, high_water_bytes=high_water_bytes)
        if link:
            self.net.set_default_link(**link)

    def make(self, n: int) -> list[Bus]:
        return [self.net.attach(0x10000000 + 7919 * i) for i in range(n)]

    def settle(self) -> None:
        for _ in range(100_000):
            t = self.sched.next_event_ms()
            if t is None:
                return
            self.sched.run_until(t)
        raise RuntimeError("memory network did not settle")

    def stall(self, bus: Bus, stalled: bool) -> None:
        self.net.stall(bus.id, stalled)
