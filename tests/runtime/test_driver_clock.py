"""The driver arms its timer from one clock reading. Pyodide's WebLoop reads the clock again in
``call_at`` and raises ``ValueError("Can't schedule in the past")`` when the deadline passed in
between (a new user saw it in tabs on a busy machine: the timer was then lost until the next
message). This loop behaves as WebLoop does there, with ``LAG_S`` of time passing between the
caller's reading and ``call_at``'s, every time."""

from __future__ import annotations

import asyncio
import time

from tabcohort.bus.memory import MemoryNetwork
from tabcohort.model.toy import ToyWorker
from tabcohort.protocol import RankMachine
from tabcohort.runtime.driver import RankDriver
from tabcohort.sched import AsyncioScheduler

LAG_S = 1.0   # longer than any protocol deadline is ahead (beats: 400 ms)


class LaggyLoop(asyncio.SelectorEventLoop):
    """``call_at`` into what is the past ``LAG_S`` later raises, as WebLoop's does;
    ``call_later`` (a delay, no second clock reading) works."""

    def call_at(self, when, callback, *args, context=None):
        if when < self.time() + LAG_S:
            raise ValueError("Can't schedule in the past")
        return super().call_at(when, callback, *args, context=context)

    def call_later(self, delay, callback, *args, context=None):
        if delay < 0:
            raise ValueError("Can't schedule in the past")
        return asyncio.BaseEventLoop.call_at(self, self.time() + delay, callback, *args, context=context)


def test_timer_deadlines_survive_a_clock_that_moves_between_readings():
    loop = LaggyLoop()
    errors: list = []
    loop.set_exception_handler(lambda _l, ctx: errors.append(ctx.get("exception") or ctx.get("message")))

    async def run() -> list:
        net = MemoryNetwork(AsyncioScheduler(loop), seed=1)
        ds = []
        for k in (1, 2):
            w = ToyWorker(bucket_len=4, batch=2, compute_ms=2.0)
            bus = net.attach(k)
            m = RankMachine(k, w, bus, job="t", now_ms=RankDriver.clock_ms(loop), lr=0.05)
            ds.append(RankDriver(m, w, bus))
        for d in ds:
            d.start()
        end = time.monotonic() + 20.0
        while not all(d.machine.step >= 20 for d in ds) and not any(d.errors for d in ds) and not errors:
            assert time.monotonic() < end, [d.machine.step for d in ds]
            await asyncio.sleep(0.01)
        for d in ds:
            await d.close()
        return [e for d in ds for e in d.errors]
    try:
        driver_errors = loop.run_until_complete(run())  # bounded inside, by wall time
    finally:
        loop.close()
    assert not driver_errors and not errors, (driver_errors, errors)
