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


def test_a_repeat_within_the_grace_is_the_same_stop_and_one_after_it_stops_at_once(monkeypatch):
    # scripts/demo.sh passes a terminal's Ctrl-C on to its ranks as SIGTERM milliseconds after
    # the ranks got the SIGINT themselves: taken as "stop at once", it killed the leader before
    # its final checkpoint upload (the demo's Ctrl-C test in CI)
    from tabcohort.runtime import native

    async def run() -> list:
        loop = asyncio.get_running_loop()
        got: list = []
        end = stop_on_signals(loop, got.append)
        try:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)          # passed on at once: the same stop
            for _ in range(100):
                if got:
                    break
                await asyncio.sleep(0.01)
            monkeypatch.setattr(native, "SIGNAL_REPEAT_GRACE_S", 0.0)
            try:
                signal.raise_signal(signal.SIGTERM)      # after the grace: at once
            except SystemExit as exc:
                got.append(exc.code)
        finally:
            end()
        return got
    assert asyncio.run(run()) == ["signal SIGINT", 143]

    async def twice() -> list:
        # a second Ctrl-C, however quick, is "at once" (README: "a second one stops it at once")
        monkeypatch.setattr(native, "SIGNAL_REPEAT_GRACE_S", 60.0)
        got: list = []
        end = stop_on_signals(asyncio.get_running_loop(), got.append)
        try:
            signal.raise_signal(signal.SIGINT)
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                got.append("at once")
        finally:
            end()
        return got
    assert asyncio.run(twice())[0] == "at once"


def test_a_hangup_is_the_ordered_stop_unless_ignored_and_a_repeated_one_is_the_same_stop():
    # a closed terminal (an ssh session that dropped) killed the rank mid-round, and a leader's
    # final checkpoint with it; under nohup (SIGHUP ignored) the hangup is meant to pass
    async def run() -> list:
        loop = asyncio.get_running_loop()
        got: list = []
        end = stop_on_signals(loop, got.append)
        try:
            signal.raise_signal(signal.SIGHUP)
            signal.raise_signal(signal.SIGHUP)           # (the kernel's and the shell's): no SystemExit
            for _ in range(100):
                if got:
                    break
                await asyncio.sleep(0.01)
        finally:
            end()
        return got
    before = signal.getsignal(signal.SIGHUP)
    assert asyncio.run(run()) == ["signal SIGHUP"]
    assert signal.getsignal(signal.SIGHUP) is before
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        async def under_nohup() -> object:
            end = stop_on_signals(asyncio.get_running_loop(), lambda why: None)
            try:
                return signal.getsignal(signal.SIGHUP)
            finally:
                end()
        assert asyncio.run(under_nohup()) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
