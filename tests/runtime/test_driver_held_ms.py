"""The driver tells its machine how long a compute held the event loop (``bucket_ready``'s
``held_ms``): a leader whose job computes in its loop's turn reads nothing meanwhile, so a peer's
bucket handled right after the leader's own may have waited behind it, and its turnaround is only
an upper bound (PROTOCOL.md "Shares", a bucket that waited behind the leader's compute)."""

from __future__ import annotations

import asyncio
import time

from tabcohort.bus.memory import MemoryNetwork
from tabcohort.model.toy import ToyWorker
from tabcohort.protocol import RankMachine
from tabcohort.runtime.driver import RankDriver
from tabcohort.sched import AsyncioScheduler

COMPUTE_S = 0.004


class Synchronous(ToyWorker):
    """Yields once, then computes for 4 ms without yielding (as a job's synchronous ``grads``
    does behind the job worker's ``asyncio.sleep(0)``)."""

    async def grads(self, offset, samples=None):
        await asyncio.sleep(0)
        end = time.perf_counter() + COMPUTE_S
        while time.perf_counter() < end:
            pass
        return self.grads_sync(offset, samples)


class Yielding(ToyWorker):
    """Takes longer, but awaits meanwhile (a device readback): the loop reads while it waits."""

    async def grads(self, offset, samples=None):
        await asyncio.sleep(5 * COMPUTE_S)
        return self.grads_sync(offset, samples)


def held_ms_reported(worker_cls) -> list[float]:
    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        net = MemoryNetwork(AsyncioScheduler(loop), seed=1)
        w = worker_cls(bucket_len=4, batch=2)
        bus = net.attach(1)
        m = RankMachine(1, w, bus, job="t", now_ms=RankDriver.clock_ms(loop), lr=0.05, ready=True)
        seen: list[float] = []
        real = m.bucket_ready

        def recording(token, loss, g, *, now_ms, samples=None, held_ms=0.0):
            seen.append(held_ms)
            return real(token, loss, g, now_ms=now_ms, samples=samples, held_ms=held_ms)
        m.bucket_ready = recording
        d = RankDriver(m, w, bus, reads_first=True)
        d.start()
        try:
            end = loop.time() + 20
            while len(seen) < 8:
                assert loop.time() < end, seen
                await asyncio.sleep(0.005)
        finally:
            await d.close()
        return seen
    return asyncio.run(run())


def test_a_compute_that_holds_the_loop_reports_how_long():
    seen = held_ms_reported(Synchronous)
    assert all(v >= 0.9 * COMPUTE_S * 1000 for v in seen), seen


def test_a_compute_that_awaits_reports_only_its_last_step():
    seen = held_ms_reported(Yielding)
    # (its last step is a toy's grads: microseconds; the bound leaves a loaded machine 10 ms)
    assert all(v < 2.5 * COMPUTE_S * 1000 for v in seen), seen
