"""The asyncio driver under virtual time (looptime): timeouts cost no wall time."""

from __future__ import annotations

import asyncio

import pytest

from tabcohort.bus.memory import MemoryNetwork
from tabcohort.model.toy import ToyWorker
from tabcohort.protocol import RankMachine
from tabcohort.runtime.driver import RankDriver
from tabcohort.sched import AsyncioScheduler
from tabcohort.vec import digest

pytestmark = [pytest.mark.asyncio, pytest.mark.looptime, pytest.mark.needs_loop]


async def wait_for(cond, *, timeout_s: float, poll_s: float = 0.05) -> None:
    """Wait (in loop time) until ``cond()`` holds, at most ``timeout_s``."""
    async def _poll():
        while not cond():
            await asyncio.sleep(poll_s)
    await asyncio.wait_for(_poll(), timeout_s)


def cohort(n, *, net=None, ready=False, compute_ms=5.0):
    """n ranks over a memory network. Compute takes ``compute_ms`` of loop time, so the loop
    idles and looptime can advance its clock (it never advances while callbacks are ready)."""
    loop = asyncio.get_running_loop()
    net = net or MemoryNetwork(AsyncioScheduler(loop), seed=1)
    drivers = []
    for k in range(1, n + 1):
        w = ToyWorker(bucket_len=6, batch=3, compute_ms=compute_ms)
        bus = net.attach(k)
        m = RankMachine(k, w, bus, job="t", now_ms=RankDriver.clock_ms(loop), lr=0.05, ready=ready)
        drivers.append(RankDriver(m, w, bus))
    return net, drivers


async def test_three_ranks_train_and_end_bit_identical():
    net, ds = cohort(3)
    for d in ds:
        d.start()
    await wait_for(lambda: all(d.machine.step >= 30 for d in ds), timeout_s=30)
    assert ds[0].machine.is_leader(ds[0].now_ms())
    for d in ds:
        d.stop()
    await wait_for(lambda: len({digest(d.worker.params()) for d in ds}) == 1, timeout_s=5)
    assert not any(d.errors for d in ds)
    for d in ds:
        await d.close()


async def test_no_timer_armed_between_rounds_of_a_busy_leader():
    loop = asyncio.get_running_loop()
    # ready from the start (as from a checkpoint) and compute without any timer: the loop
    # then runs rounds back to back and must never arm a positive-delay timer between them
    net, (d,) = cohort(1, ready=True, compute_ms=0.0)
    armed: list[float] = []
    rounds = 0
    real_call_at, real_call_later = loop.call_at, loop.call_later

    def call_at(when, cb, *args, **kw):
        if rounds >= 3 and when > loop.time():
            armed.append(when - loop.time())
        return real_call_at(when, cb, *args, **kw)

    def call_later(delay, cb, *args, **kw):
        if rounds >= 3 and delay > 0:
            armed.append(delay)
        return real_call_later(delay, cb, *args, **kw)

    real_post = d.bus.post

    def post(msg):
        nonlocal rounds
        if msg["t"] == "round":
            rounds += 1
        real_post(msg)

    d.bus.post = post
    loop.call_at, loop.call_later = call_at, call_later
    try:
        d.start()
        t0 = loop.time()
        for _ in range(5000):
            await asyncio.sleep(0)
            if rounds >= 200:
                break
        assert loop.time() == t0                   # no loop time passed: nothing waited
        assert rounds >= 200
        assert armed == [], f"timers with positive delay armed between rounds: {armed[:5]}"
    finally:
        loop.call_at, loop.call_later = real_call_at, real_call_later
        await d.close()


async def test_worker_failure_becomes_fault_and_loop_goes_on():
    net, (d,) = cohort(1)
    d.worker.fail_next = 1
    d.start()
    await wait_for(lambda: d.machine.step >= 5, timeout_s=10)
    assert d.machine.fault and "injected worker failure" in d.machine.fault
    assert d.machine.counters["round_fault"] == 1
    await d.close()


async def test_report_callback_error_does_not_kill_the_rank():
    loop = asyncio.get_running_loop()
    net = MemoryNetwork(AsyncioScheduler(loop), seed=1)
    w = ToyWorker(bucket_len=4, batch=2, compute_ms=5.0)
    bus = net.attach(1)
    m = RankMachine(1, w, bus, job="t", now_ms=RankDriver.clock_ms(loop))

    def bad(state):
        raise RuntimeError("ui broke")

    d = RankDriver(m, w, bus, on_report=bad)
    d.start()
    await wait_for(lambda: m.step >= 5, timeout_s=10)
    await d.close()
    assert not d.tasks


async def test_local_steps_of_a_superseded_round_are_abandoned_between_inner_steps():
    from tabcohort.protocol.optim import TrainConfig

    loop = asyncio.get_running_loop()
    net = MemoryNetwork(AsyncioScheduler(loop), seed=1)
    train = TrainConfig(local_steps=8, outer_optimizer="nesterov", inner_lr=0.05)
    drivers = []
    for k, compute_ms in ((1, 2.0), (2, 2.0), (3, 2.0), (4, 40.0)):   # rank 4: 20x slower steps
        w = ToyWorker(bucket_len=6, batch=3, compute_ms=compute_ms)
        bus = net.attach(k)
        m = RankMachine(k, w, bus, job="t", now_ms=RankDriver.clock_ms(loop), lr=0.7, ready=True, train=train)
        drivers.append(RankDriver(m, w, bus))
    for d in drivers[1:] + drivers[:1]:
        d.start()
    slow = drivers[3]
    # a quorum of 3 finishes each round without the slow rank, whose 8 steps are superseded
    await wait_for(lambda: drivers[0].machine.step >= 20 and slow.machine.counters["abandoned_bucket"] >= 3,
                   timeout_s=60)
    for d in drivers:
        d.stop()
    await wait_for(lambda: len({digest(d.worker.params()) for d in drivers}) == 1, timeout_s=10)
    assert not any(d.errors for d in drivers)
    for d in drivers:
        await d.close()


async def test_a_bucket_that_needs_no_await_costs_its_round_one_loop_turn():
    """A worker whose bucket is ready without an await computes inside the turn that drove the
    round: no task, no done callback (on Pyodide each loop turn is a MessageChannel hop), so a
    busy leader's round costs one ``call_soon``, the yield between rounds."""
    loop = asyncio.get_running_loop()
    net, (d,) = cohort(1, ready=True, compute_ms=0.0)
    soon = 0
    real_call_soon = loop.call_soon

    def call_soon(cb, *args, **kw):
        nonlocal soon
        soon += 1
        return real_call_soon(cb, *args, **kw)

    d.start()
    for _ in range(50):
        await asyncio.sleep(0)
    loop.call_soon = call_soon
    try:
        s0, soon = d.machine.step, 0
        for _ in range(400):
            await asyncio.sleep(0)               # (each of these is one call_soon too)
        rounds = d.machine.step - s0
        assert rounds >= 100
        assert (soon - 400) / rounds <= 1.1, (soon, rounds)
    finally:
        loop.call_soon = real_call_soon
        await d.close()
    assert not d.errors


async def test_a_compute_step_that_raises_outside_the_worker_is_a_fault_not_a_crash():
    net, (d,) = cohort(1, ready=True, compute_ms=0.0)
    real = d.machine.bucket_ready
    calls = 0

    def bucket_ready(*a, **kw):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("machine bug")
        return real(*a, **kw)

    d.machine.bucket_ready = bucket_ready
    d.start()
    await wait_for(lambda: d.errors, timeout_s=5)
    assert "RuntimeError: machine bug" in d.errors[0]
    await d.close()


async def test_a_compute_that_awaits_is_closed_with_the_driver_even_before_its_task_ran():
    """A compute whose first step awaited goes on as a task; closing the driver before that
    task's first step still ends the compute (its finally runs) and cancels what it waited on."""
    loop = asyncio.get_running_loop()
    net, (d,) = cohort(1, ready=True, compute_ms=0.0)
    started, ended, waits = [], [], []

    async def grads(offset, samples=None):
        started.append(offset)
        try:
            fut = loop.create_future()
            waits.append(fut)
            await fut                                # never resolved: only closing ends it
        finally:
            ended.append(offset)

    d.worker.grads = grads
    d.start()                                         # drives a round: the compute's first step runs here
    assert started and not ended and d.tasks
    await d.close()                                   # cancels the task before its first step
    assert ended == started and all(f.cancelled() for f in waits)
    assert not d.tasks
