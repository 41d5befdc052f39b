"""The asyncio driver: the only code that awaits on behalf of a rank.

It reads the loop clock once per input, feeds the rank machine, executes the drained actions
(post on the bus, compute a bucket, publish a report), and keeps one timer armed at the
machine's next deadline. A deadline that is already due is run through ``loop.call_soon``,
never a timer: that is the unclamped, FIFO yield between rounds that PROTOCOL.md ("The leader
loop") requires. On Pyodide ``call_soon`` goes through a MessageChannel (60-100 us, never
clamped to 4 ms); natively it is the ready queue.

Every task the driver starts is held and supervised: an exception becomes ``fault`` in the
state report and a log line, never a silent death.
"""

from __future__ import annotations

import asyncio
import sys
import logging
import os
import pathlib
import sysconfig
import traceback
from typing import Any, Callable

from ..protocol.actions import Compute, Post, Report
from ..protocol.machine import RankMachine

log = logging.getLogger("tabcohort.runtime")

#: a rank whose compute raised this many times in a row (no bucket in between) gives up: the
#: job has a bug that every retry meets, not a passing fault (README "Write your own job")
COMPUTE_FAILURES_FATAL = 3
#: where a frame is not the job's: this package, the standard library, installed packages
_NOT_JOB_DIRS = tuple({str(pathlib.Path(__file__).resolve().parents[1]) + os.sep,
                       sysconfig.get_paths()["stdlib"] + os.sep, sysconfig.get_paths()["purelib"] + os.sep,
                       sysconfig.get_paths()["platlib"] + os.sep})


def job_frame(exc: BaseException, job_files: "set[str] | None" = None) -> str | None:
    """``file.py:LINE in FUNC`` (the file's base name) of the innermost frame of ``exc``'s
    traceback in ``job_files`` (the job's own files, absolute paths), else outside this package
    and the standard library and site-packages (a job's code), else the innermost frame; None
    without a traceback, and for an error this package raised about what the job returned
    (``JobError``: its message says what is wrong, and a line of tabcohort's own is no help)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    mine = [f for f in frames if job_files and os.path.abspath(f.filename) in job_files]
    theirs = [f for f in frames if not f.filename.startswith(_NOT_JOB_DIRS)]
    if not (mine or theirs) and type(exc).__name__ == "JobError":
        return None
    f = (mine or theirs or frames)[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"


#: ``reads_first`` is honoured natively only: a browser's event loop clamps timers (Pyodide's
#: WebLoop: setTimeout, >= 4 ms once nested), where ``call_soon`` is a MessageChannel hop
_DUE_TIMER_OK = sys.platform != "emscripten"


class RankDriver:
    """Drives one :class:`RankMachine` with asyncio.

    Args:
        machine: the rank state machine (created with ``now_ms`` from :meth:`now_ms`).
        worker: the worker; ``await worker.grads(offset)`` returns ``(loss, vector)``.
        bus: the bus; the driver sets ``bus.on_message`` and calls ``bus.post``.
        on_report: optional callback receiving each state report dict.
        on_compute_failed: optional callback, called once with the reason when the worker's
            compute raised :data:`COMPUTE_FAILURES_FATAL` times in a row (the runtime stops the
            rank with it: a job that fails every time must not retry for good).
        loop: the event loop (default: the running loop).
        yield_delay_ms: 0 (the default and the right choice) runs due deadlines through
            ``call_soon``. A positive value runs them through a timer of that delay instead:
            only for the benchmark that shows what a clamped 4 ms browser timer would cost.
        reads_first: natively, run due deadlines through a timer due at once instead of
            ``call_soon``: asyncio runs the turn's socket callbacks before the timers that came
            due, so what arrived while the rank computed is read before its next compute by a
            receiver that is a protocol callback (the direct TCP path), and one compute later
            instead of two by one that is a task woken through ``call_soon`` (the WebSocket
            relay's reader). Behind ``call_soon`` a leader computing 2 ms a round read a
            follower's direct-path bucket two rounds late and measured its turnaround (what its
            share is planned by, PROTOCOL.md "Shares") at ~10 ms instead of ~5. For a rank on
            sockets (the native runtime); ranks sharing one loop without sockets (the in-process
            simulation) gain nothing and pay the timer heap (about 12 % of rounds/s with a tiny
            model).
    """

    def __init__(self, machine: RankMachine, worker: Any, bus: Any, *,
                 on_report: Callable[[dict], None] | None = None,
                 on_compute_failed: Callable[[str], None] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None, yield_delay_ms: float = 0.0,
                 reads_first: bool = False) -> None:
        self.machine = machine
        self.yield_delay_ms = float(yield_delay_ms)
        self.reads_first = bool(reads_first) and _DUE_TIMER_OK
        self.worker = worker
        self.bus = bus
        self.on_report = on_report
        self.on_compute_failed = on_compute_failed
        #: the worker's compute raised this many times in a row
        self.compute_failures = 0
        self.loop = loop or asyncio.get_running_loop()
        self.last_report: dict | None = None
        self.tasks: set[asyncio.Task] = set()
        self.errors: list[str] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when_ms: float | None = None
        self._soon: asyncio.Handle | None = None
        self._closed = False
        self._step_started_ms = 0.0   # when the compute coroutine's current step began
        self._wakers: list[list[Any]] = []      # [period_ms, next due ms, event]
        bus.on_message = self._on_message
        self._flush()

    @staticmethod
    def clock_ms(loop: asyncio.AbstractEventLoop | None = None) -> float:
        """The loop clock in milliseconds (asyncio speaks seconds; converted here only)."""
        return (loop or asyncio.get_running_loop()).time() * 1000.0

    def now_ms(self) -> float:
        return self.loop.time() * 1000.0

    def wake_every(self, period_s: float) -> asyncio.Event:
        """An event this driver sets, from within its own turns (each input, each deadline), once
        ``period_s`` seconds have passed since it last set it; the caller clears it.

        For periodic work beside the machine (state reports, a page's view): on Pyodide a busy
        leader's rounds run through ``call_soon`` (MessageChannel turns), and a plain
        ``asyncio.sleep`` loop there ran 2-10 s late (the cause was the backlog of host messages
        that Pyodide's own ``call_soon`` piled up, which ``tabcohort.runtime.soon`` removes).
        Waiting on this event (with the timer as a fallback when the driver is idle) keeps the
        period.
        """
        ev = asyncio.Event()
        self._wakers.append([float(period_s) * 1000.0, self.now_ms() + float(period_s) * 1000.0, ev])
        return ev

    def _wake(self, now_ms: float) -> None:
        for w in self._wakers:
            if now_ms >= w[1]:
                w[1] = now_ms + w[0]
                w[2].set()

    # ------------------------------------------------------------------ controls
    def start(self, lr: float | None = None) -> None:
        self.machine.start(lr, now_ms=self.now_ms())
        self._flush()

    def stop(self) -> None:
        self.machine.stop(now_ms=self.now_ms())
        self._flush()

    def set_lr(self, lr: float) -> None:
        self.machine.set_lr(lr, now_ms=self.now_ms())

    def peer_left(self, rank_id: int) -> None:
        """The room's server (the witness of links) says ``rank_id``'s link closed."""
        if self._closed:
            return
        self.machine.peer_left(rank_id, now_ms=self.now_ms())
        self._flush()

    def unreachable(self, rank_ids: list) -> None:
        """This rank's bus lost its path to ``rank_ids`` (``RankMachine.unreachable``)."""
        if self._closed:
            return
        self.machine.unreachable(rank_ids, now_ms=self.now_ms())
        self._flush()

    def roll_call(self, connected: list) -> None:
        """A ``welcome`` (the link opened again) lists every other rank connected to the room:
        members it omits left while this rank was away (``RankMachine.roll_call``)."""
        if self._closed:
            return
        self.machine.roll_call(connected, now_ms=self.now_ms())
        self._flush()

    def roll_call_partial(self) -> None:
        """A restarted server's ``welcome`` is partial: ranks it does not list may be on their
        way back; no bootstrap until its ``roll_call`` (``RankMachine.roll_call_partial``)."""
        if self._closed:
            return
        self.machine.roll_call_partial(now_ms=self.now_ms())
        self._flush()

    def state(self) -> dict:
        """A fresh state report, with the bus's wire-level drops merged in."""
        st = self.machine.state(self.now_ms())
        st["wire_drops"] = dict(self.bus.drops())
        return st

    async def close(self) -> None:
        """Dispose the machine, cancel the timer and every task, and wait for them."""
        if self._closed:
            return
        self._closed = True
        self.machine.dispose(now_ms=self.now_ms())
        self._cancel_timers()
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    # ------------------------------------------------------------------ inputs
    def _on_message(self, msg: dict) -> None:
        if self._closed:
            return
        now = self.now_ms()
        self.machine.handle(msg, now_ms=now)
        self._flush()
        if self._wakers:
            self._wake(now)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_when_ms = None
        self._tick()

    def _on_soon(self) -> None:
        self._soon = None
        self._tick()

    def _tick(self) -> None:
        if self._closed:
            return
        now = self.now_ms()
        self.machine.on_timer(now_ms=now)
        self._flush()
        if self._wakers:
            self._wake(now)

    def _step_started(self) -> None:
        self._step_started_ms = self.now_ms()

    def _start_compute(self, action: Compute) -> None:
        """Run the compute coroutine's first step here, in the turn that asked for it: a bucket
        that needs no await (one slice of a fast worker) finishes without a task, so a round
        costs one turn of the event loop instead of three (the task's step and its done
        callback each take one; on Pyodide each turn is a MessageChannel hop). A compute that
        awaits goes on as a supervised task from where it stopped. (Its first step runs in the
        caller's turn, outside a task of its own: a worker's ``grads`` must not need
        ``current_task()`` before its first await.)"""
        coro = self._compute(action)
        self._step_started_ms = self.now_ms()
        try:
            first = coro.send(None)
        except StopIteration:
            return
        except (Exception, asyncio.CancelledError) as exc:   # as in a task: a fault, not a crash
            self._fault("".join(traceback.format_exception_only(type(exc), exc)).strip())
            return
        rest = _Resume(coro, first, self._step_started)
        task = self.loop.create_task(rest.run())
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        task.add_done_callback(rest.finish)

    async def _compute(self, action: Compute) -> None:
        try:
            if action.local_steps > 1:
                # H inner steps, sliced; a superseded round's work is dropped between steps
                # (PROTOCOL.md, "Local steps and optimizer state")
                got = await self.worker.local_grads(
                    action.offset, action.samples, action.local_steps, action.inner_optimizer,
                    action.inner_lr, should_stop=lambda: self._closed or not self.machine.compute_current(action.token))
                if got is None:
                    if not self._closed:
                        self.machine.bucket_abandoned(action.token, now_ms=self.now_ms())
                        self._flush()
                    return
                loss, g = got
            else:
                loss, g = await self.worker.grads(action.offset, action.samples)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            where = job_frame(exc, getattr(self.worker, "job_files", None))
            error = f"{type(exc).__name__}: {str(exc)[:160]}" + (f" (at {where})" if where else "")
            log.warning("rank %08x: compute failed: %s", self.machine.id, error)
            if not self._closed:
                self.machine.bucket_failed(action.token, error, now_ms=self.now_ms())
                self._flush()
                self.compute_failures += 1
                if self.compute_failures == COMPUTE_FAILURES_FATAL and self.on_compute_failed is not None:
                    self.on_compute_failed(f"the job's compute failed {self.compute_failures} times in a row: "
                                           f"{error}")
            return
        self.compute_failures = 0
        if not self._closed:
            # (since its step began, the loop read nothing: "Shares", a bucket that waited)
            now = self.now_ms()
            self.machine.bucket_ready(action.token, loss, g, now_ms=now,
                                      held_ms=now - self._step_started_ms)
            self._flush()

    # ------------------------------------------------------------------ outputs
    def _evaluate_failed(self, exc: Exception) -> None:
        """The job's evaluate() raised (the machine applied the round and carries on): said once
        per run of failures, with the job's line; fatal after COMPUTE_FAILURES_FATAL in a row,
        as a failing compute is (README "Write your own job")."""
        where = job_frame(exc, getattr(self.worker, "job_files", None))
        error = f"{type(exc).__name__}: {str(exc)[:160]}" + (f" (at {where})" if where else "")
        n = self.machine.evaluate_failures
        if n == 1:
            log.warning("rank %08x: the job's evaluate() failed: %s", self.machine.id, error)
        if n == COMPUTE_FAILURES_FATAL and self.on_compute_failed is not None:
            self.on_compute_failed(f"the job's evaluate() failed {n} times in a row: {error}")

    def _flush(self) -> None:
        if self._closed:
            return
        exc = self.machine.take_evaluate_error()
        if exc is not None:
            self._evaluate_failed(exc)
        computes = []
        for action in self.machine.drain():
            if isinstance(action, Post):
                try:
                    self.bus.post(action.msg)
                except Exception as exc:  # a failing send must not kill the rank
                    self._fault(f"post {action.msg.get('t')}: {type(exc).__name__}: {exc}")
            elif isinstance(action, Compute):
                computes.append(action)      # after every post of this drain (the round first)
            elif isinstance(action, Report):
                self.last_report = action.state
                if self.on_report is not None:
                    try:
                        self.on_report(action.state)
                    except Exception:
                        log.exception("on_report callback failed")
        self._rearm()
        for action in computes:
            if not self._closed:
                self._start_compute(action)

    def _rearm(self) -> None:
        deadline = self.machine.next_deadline_ms()
        if deadline is None:
            self._cancel_timers()
            return
        now = self.now_ms()
        if deadline <= now:
            if self._soon is None:          # unclamped FIFO yield: no timer armed
                if self.yield_delay_ms > 0:
                    self._soon = self.loop.call_later(self.yield_delay_ms / 1000.0, self._on_soon)
                elif self.reads_first:   # a timer due now: after the turn's socket callbacks
                    self._soon = self.loop.call_later(0.0, self._on_soon)
                else:
                    self._soon = self.loop.call_soon(self._on_soon)
            return
        if self._timer is not None and self._timer_when_ms == deadline:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_when_ms = deadline
        # a delay from one clock reading, never negative: Pyodide's WebLoop.call_at reads the
        # clock again and raises "Can't schedule in the past" if it moved past the deadline
        self._timer = self.loop.call_later(max(0.0, (deadline - now) / 1000.0), self._on_timer)

    def _cancel_timers(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_when_ms = None
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return          # (the process is stopping at once: a second Ctrl-C, said by the CLI)
        if exc is not None:
            self._fault("".join(traceback.format_exception_only(type(exc), exc)).strip())

    def _fault(self, text: str) -> None:
        log.error("rank %08x: %s", self.machine.id, text)
        self.errors.append(text)
        if not self._closed:
            self.machine.runtime_fault(text, now_ms=self.now_ms())
            self._flush()


def bus_role(bus: Any) -> tuple[bool, dict[int, bool]]:
    """The role the server bound to this rank's link and its peers' (docs/PROTOCOL.md "Roles"),
    from a :class:`~tabcohort.bus.base.RoomBus`'s ``welcome`` and ``peer`` controls:
    ``(may_lead, {peer id: may lead})``."""
    return bool(bus.may_lead), dict(bus.lead_roles)


def apply_roles(driver: Any, obj: dict) -> None:
    """Feed the server's role announcements (``peer`` with ``may_lead``; a reconnect's
    ``welcome`` with ``lead_peers``) to the rank machine (``RankMachine.peer_role``)."""
    machine = None if driver is None else driver.machine
    if machine is None:
        return
    t = obj.get("type")
    if t == "peer" and obj.get("up") is True:
        k = obj.get("id")
        if isinstance(k, int) and not isinstance(k, bool):
            machine.peer_role(k, obj.get("may_lead") is True)
    elif t == "welcome":
        leads = obj.get("lead_peers") if isinstance(obj.get("lead_peers"), list) else []
        for k in obj.get("peers") or ():
            if isinstance(k, int) and not isinstance(k, bool):
                machine.peer_role(k, k in leads)


class _Resume:
    """Continue a coroutine that has already been stepped once (and yielded ``first``) inside
    a task: every value it yields goes to the task as if the task had stepped it from the
    start (a future to wait on, or None: a bare yield to the loop), and every exception the
    task throws in (cancellation) goes into it."""

    def __init__(self, coro: Any, first: Any, on_step: Callable[[], None]) -> None:
        self.coro, self.first, self.on_step = coro, first, on_step

    async def run(self) -> Any:
        return await self

    def finish(self, task: asyncio.Task) -> None:
        """Done callback: a task cancelled before its first step never resumed the coroutine;
        close it (its ``finally`` blocks run now) and cancel what it was waiting on."""
        if task.cancelled():
            self.coro.close()
            if isinstance(self.first, asyncio.Future):
                self.first.cancel()

    def __await__(self) -> Any:
        pending = self.first
        while True:
            try:
                sent = yield pending
            except BaseException as exc:     # thrown in by the task: pass it on
                self.on_step()
                try:
                    pending = self.coro.throw(exc)
                except StopIteration as done:
                    return done.value
                continue
            self.on_step()
            try:
                pending = self.coro.send(sent)
            except StopIteration as done:
                return done.value
