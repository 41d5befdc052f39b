"""A native rank's SIGINT / SIGTERM handlers (``tabcohort.runtime.native.stop_on_signals``): the
first signal asks every rank of the process for the ordered stop, and the handlers from before
are back once the last rank ends, in whatever order the ranks end (two ranks of one process, the
first ending first, left a stale handler that swallowed the next Ctrl-C: a review)."""

from __future__ import annotations

import asyncio
import signal

from tabcohort.runtime.native import stop_on_signals


def test_ranks_that_end_in_any_order_leave_the_handlers_they_found():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

    async def run() -> list:
        loop = asyncio.get_running_loop()
        outer = signal.getsignal(signal.SIGINT)          # (asyncio.run's own)
        got: list = []
        end_a = stop_on_signals(loop, lambda why: got.append(("a", why)))
        end_b = stop_on_signals(loop, lambda why: got.append(("b", why)))
        end_a()                                          # the first rank ends first
        signal.raise_signal(signal.SIGTERM)              # the second still stops in order
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.01)
        end_b()
        assert signal.getsignal(signal.SIGINT) is outer
        return got
    assert asyncio.run(run()) == [("b", "signal SIGTERM")]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
