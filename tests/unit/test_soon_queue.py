"""The tab worker's immediate callbacks (``tabcohort.runtime.soon``): at most one host task
pending however many callbacks are queued, in call order. The host is modelled on Pyodide's
``scheduleCallbackImmediate`` (pyodide.asm.mjs): one posted message per callback, each message
running every callback queued when it arrives; a worker serves its tasks in the order they were
queued, so the messages pending are what a timer, a fetch or a page message waits behind."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable

import pytest

from tabcohort.runtime.soon import IMMEDIATE_DELAY_S, SoonQueue, install


class StubLoop:
    """What an ``asyncio.Handle`` asks of its loop (no loop runs in these tests)."""

    def get_debug(self) -> bool:
        return False

    def call_exception_handler(self, context: dict) -> None:
        raise AssertionError(context)


class SharedChannelHost:
    """Pyodide's immediate scheduling: ``post`` queues ``fn`` and posts one message; a message
    runs every ``fn`` queued when it is served."""

    def __init__(self) -> None:
        self.queued: deque[Callable[[], None]] = deque()
        self.messages = 0

    def post(self, fn: Callable[[], None]) -> None:
        self.queued.append(fn)
        self.messages += 1

    def serve_one(self) -> None:
        self.messages -= 1
        for _ in range(len(self.queued)):
            self.queued.popleft()()


def leader_loop_backlog(*, with_queue: bool, turns: int, extra_every: int) -> tuple[int, list[str]]:
    """A leader loop that queues its next turn from each turn (the driver's call_soon) and, every
    ``extra_every`` turns, one more callback beside it (a task woken by a page message). Returns
    the most host messages pending at once and the order the callbacks ran in."""
    host = SharedChannelHost()
    loop = StubLoop()
    ran: list[str] = []
    queue = SoonQueue(host.post)

    def soon(fn: Callable[[], None]) -> None:
        if with_queue:
            queue.push(asyncio.Handle(fn, (), loop))
        else:
            host.post(fn)
    state = {"turn": 0}

    def turn() -> None:
        state["turn"] += 1
        ran.append(f"t{state['turn']}")
        if state["turn"] < turns:
            soon(turn)
            if state["turn"] % extra_every == 0:
                soon(lambda k=state["turn"]: ran.append(f"x{k}"))
    soon(turn)
    most = 0
    while host.messages:
        most = max(most, host.messages)
        host.serve_one()
    return most, ran


def test_pyodides_own_scheduling_piles_up_a_message_per_extra_callback():
    # the cause (a tab leading two native ranks: timers and page messages seconds late):
    # every callback queued beside the loop's own leaves a message that never drains
    most, _ = leader_loop_backlog(with_queue=False, turns=1000, extra_every=10)
    assert most >= 90


def test_one_host_task_pending_however_many_callbacks_are_queued():
    most, ran = leader_loop_backlog(with_queue=True, turns=1000, extra_every=10)
    assert most == 1
    # call order: the extra callback queued after turn k runs after turn k+1 (queued first)
    _, ran_host = leader_loop_backlog(with_queue=False, turns=1000, extra_every=10)
    assert ran == ran_host
    assert ran.index("x10") == ran.index("t11") + 1


def test_a_pump_runs_only_what_was_ready_when_it_started():
    host = SharedChannelHost()
    loop = StubLoop()
    q = SoonQueue(host.post)
    ran: list[int] = []
    q.push(asyncio.Handle(lambda: (ran.append(1), q.push(asyncio.Handle(ran.append, (3,), loop))), (), loop))
    q.push(asyncio.Handle(ran.append, (2,), loop))
    cancelled = asyncio.Handle(ran.append, (99,), loop)
    q.push(cancelled)
    cancelled.cancel()
    assert host.messages == 1 and q.pending()
    host.serve_one()
    assert ran == [1, 2] and host.messages == 1      # 3 waits for the next pump
    host.serve_one()
    assert ran == [1, 2, 3] and host.messages == 0 and not q.pending()
    assert (q.n_pumps, q.n_run, q.max_ready_len) == (2, 3, 3)


def test_a_handle_that_raises_through_leaves_the_rest_to_the_next_pump():
    host = SharedChannelHost()
    loop = StubLoop()
    q = SoonQueue(host.post)
    ran: list[int] = []

    def leave() -> None:
        raise SystemExit(0)      # (asyncio's Handle lets only these through)
    q.push(asyncio.Handle(leave, (), loop))
    q.push(asyncio.Handle(ran.append, (2,), loop))
    with pytest.raises(SystemExit):
        host.serve_one()
    assert ran == [] and host.messages == 1
    host.serve_one()
    assert ran == [2]


@pytest.mark.needs_loop
def test_install_keeps_asyncio_working_and_timers_on_the_host():
    async def main() -> tuple[list[str], SoonQueue, bool]:
        loop = asyncio.get_running_loop()
        q = install(loop)
        assert install(loop) is q
        order: list[str] = []
        loop.call_soon(order.append, "a")
        loop.call_later(IMMEDIATE_DELAY_S, order.append, "b")   # immediate, as Pyodide runs it
        loop.call_soon(order.append, "c")
        late = loop.call_later(0.05, order.append, "late")      # a real timer of the host
        fut = loop.create_future()
        loop.call_soon(fut.set_result, "done")
        order.append(await fut)
        await asyncio.sleep(0)
        task = asyncio.ensure_future(asyncio.sleep(0.06, "slept"))
        order.append(await task)
        return order, q, isinstance(late, asyncio.TimerHandle)
    order, q, timer = asyncio.run(main())
    assert order == ["a", "b", "c", "done", "late", "slept"]
    assert timer and q.n_run >= 4 and q.max_ready_len >= 4
