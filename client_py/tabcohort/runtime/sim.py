"""A seeded discrete-event simulation of a cohort over the in-memory bus.

The same :class:`~tabcohort.protocol.RankMachine` as in production, driven by a
:class:`~tabcohort.sched.SimScheduler` instead of asyncio: virtual milliseconds, no wall time.
Compute takes ``compute_ms`` of virtual time per bucket (the gradient itself is computed at
request time, against the parameters the rank holds then). Faults: kill a rank, freeze it
(the suspension case: a frozen tab's inputs queue until it resumes), partition and heal the
network, per-link loss and delay (knobs of :class:`~tabcohort.bus.memory.MemoryNetwork`).
"""

from __future__ import annotations

import random
from typing import Any, Callable

from ..bus.memory import MemoryNetwork
from ..protocol.actions import Compute, Post, Report
from ..protocol.machine import RankMachine
from ..protocol.policy import Timing
from ..sched import SimScheduler


class SimRank:
    """One simulated rank: machine + memory bus + worker on the shared virtual clock."""

    def __init__(self, sim: "SimCohort", rank_id: int, worker: Any, *, compute_ms: float,
                 ready: bool, lr: float, eval_every: int, collect_rule: str = "quorum",
                 ms_per_sample: float = 0.0, global_batch: int | None = None, train: Any = None,
                 compute_jitter_ms: float = 0.0, blocking_compute: bool = False) -> None:
        self.sim = sim
        self.id = rank_id
        self.worker = worker
        self.compute_ms = compute_ms            # fixed cost per bucket (virtual ms)
        self.ms_per_sample = ms_per_sample      # plus this per sample of the share
        self.compute_jitter_ms = compute_jitter_ms  # plus uniform [0, this) from the sim's seed
        #: the rank handles nothing while it computes (a native rank's or a tab worker's event
        #: loop runs the job's grads in its own turn): inputs wait until the bucket is ready
        self.blocking_compute = blocking_compute
        self._busy_until_ms = 0.0
        self._computing = False
        self.bus = sim.network.attach(rank_id)
        self.bus.on_message = self._on_message
        self.machine = RankMachine(rank_id, worker, self.bus, job=sim.job, now_ms=sim.now_ms(),
                                   timing=sim.timing, ready=ready, lr=lr, eval_every=eval_every,
                                   precision=sim.network_precision, collect_rule=collect_rule,
                                   global_batch=global_batch, train=train)
        self.alive = True
        self.frozen = False
        self._held: list[Callable[[], None]] = []
        self._timer = None
        self._timer_when: float | None = None
        self.reports: list[dict] = []
        self._flush()

    # inputs -----------------------------------------------------------
    def _input(self, fn: Callable[[], None]) -> None:
        if not self.alive:
            return
        if self.frozen or self._computing:
            self._held.append(fn)
            return
        fn()
        self._flush()

    def _on_message(self, msg: dict) -> None:
        self._input(lambda: self.machine.handle(msg, now_ms=self.sim.now_ms()))

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_when = None
        self._input(lambda: self.machine.on_timer(now_ms=self.sim.now_ms()))

    def start(self, lr: float | None = None) -> None:
        self._input(lambda: self.machine.start(lr, now_ms=self.sim.now_ms()))

    def stop(self) -> None:
        self._input(lambda: self.machine.stop(now_ms=self.sim.now_ms()))

    # faults -----------------------------------------------------------
    def kill(self) -> None:
        """The process dies: no more input or output, no goodbye."""
        self.alive = False
        self.machine.dispose(now_ms=self.sim.now_ms())
        self.bus.close()
        if self._timer is not None:
            self._timer.cancel()
        if self.sim.witness:
            # the room's server sees the link close and tells every other rank
            for r in self.sim.alive():
                r._input(lambda r=r: r.machine.peer_left(self.id, now_ms=self.sim.now_ms()))

    def freeze(self, duration_ms: float) -> None:
        """Stop processing for ``duration_ms``; inputs queue and are delivered on resume."""
        self.frozen = True
        self.sim.scheduler.call_later(duration_ms, self._resume)

    def _resume(self) -> None:
        self.frozen = False
        held, self._held = self._held, []
        for fn in held:
            self._input(fn)
        self._input(lambda: self.machine.on_timer(now_ms=self.sim.now_ms()))

    # outputs ----------------------------------------------------------
    def _flush(self) -> None:
        if not self.alive:
            return
        for a in self.machine.drain():
            if isinstance(a, Post):
                if not self.sim.deliver_hello and a.msg.get("t") == "hello":
                    continue
                self.bus.post(a.msg)
            elif isinstance(a, Compute):
                self._compute(a)
            elif isinstance(a, Report):
                self.reports.append(a.state)
        d = self.machine.next_deadline_ms()
        if d is None:
            return
        if self._timer is not None and self._timer_when == d:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_when = d
        self._timer = self.sim.scheduler.call_later(max(0.0, d - self.sim.now_ms()), self._on_timer)

    def _compute(self, a: Compute) -> None:
        h = a.local_steps
        took = self.compute_ms + self.ms_per_sample * a.samples * h
        if self.compute_jitter_ms > 0:
            took += self.sim.rng.uniform(0.0, self.compute_jitter_ms)
        if self.blocking_compute:
            # computes one bucket after another, and holds every input meanwhile; the bucket is
            # handled first when the compute ends, then what queued behind it
            now = self.sim.now_ms()
            took = max(now, self._busy_until_ms) + took - now
            self._busy_until_ms = now + took
            self._computing = True
        try:
            if h > 1:
                loss, g = self.worker.local_grads_sync(a.offset, a.samples, h, a.inner_optimizer, a.inner_lr)
            else:
                loss, g = self.worker.grads_sync(a.offset, a.samples)
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
            self._computed(took, lambda: self.machine.bucket_failed(a.token, err, now_ms=self.sim.now_ms()))
            return
        self._computed(took, lambda: self.machine.bucket_ready(a.token, loss, g, now_ms=self.sim.now_ms(),
                                                               held_ms=took if self.blocking_compute else 0.0))

    def _computed(self, took: float, fn: Callable[[], None]) -> None:
        if not self.blocking_compute:
            self.sim.scheduler.call_later(took, lambda: self._input(fn))
            return

        def done() -> None:
            if self.sim.now_ms() >= self._busy_until_ms:
                self._computing = False
            if not self.alive:
                return
            if self.frozen:                  # (a freeze fault: the bucket waits with the rest)
                self._held.append(fn)
                return
            fn()
            self._flush()
            if not self._computing:
                held, self._held = self._held, []
                for h in held:
                    self._input(h)
        self.sim.scheduler.call_later(took, done)


class SimCohort:
    """A cohort of simulated ranks sharing one virtual clock and one in-memory network.

    Args:
        job: the job hash every rank carries.
        timing: protocol base periods.
        seed: seeds the network's fault knobs.
        precision: wire precision of the network.
        witness: model the room's server as the witness of links: a killed rank's peers are
            told it left (``RankMachine.peer_left``); a partition is never witnessed.
    """

    def __init__(self, *, job: str = "sim", timing: Timing = Timing(), seed: int = 0,
                 precision: str = "f32", witness: bool = True, **network_kw: Any) -> None:
        self.witness = witness
        self.scheduler = SimScheduler()
        self.network = MemoryNetwork(self.scheduler, seed=seed, precision=precision, **network_kw)
        self.network_precision = precision
        self.job = job
        self.timing = timing
        self.rng = random.Random(seed)
        self.ranks: dict[int, SimRank] = {}
        #: False while warm-starting a cohort as if it had formed (runtime.simscale): the ranks'
        #: ``hello`` posts are not sent (each would make every member broadcast a beat)
        self.deliver_hello = True

    def now_ms(self) -> float:
        return self.scheduler.now_ms()

    def add(self, rank_id: int, worker: Any, *, compute_ms: float = 5.0, ready: bool = False,
            start: bool = True, lr: float = 0.1, eval_every: int = 0,
            collect_rule: str = "quorum", ms_per_sample: float = 0.0,
            global_batch: int | None = None, train: Any = None, compute_jitter_ms: float = 0.0,
            blocking_compute: bool = False) -> SimRank:
        """Add a rank; its bucket takes ``compute_ms + ms_per_sample * share * H`` virtual ms,
        plus a uniform draw from ``[0, compute_jitter_ms)`` (a tab's garbage collection and
        scheduling; the sim's seeded generator) (``train``: the room's
        :class:`~tabcohort.protocol.optim.TrainConfig`, H its local steps; ``blocking_compute``:
        the rank handles no input while it computes, as a native rank and a tab's worker do,
        whose job runs in their event loop's turn)."""
        r = SimRank(self, rank_id, worker, compute_ms=compute_ms, ready=ready, lr=lr,
                    eval_every=eval_every, collect_rule=collect_rule, ms_per_sample=ms_per_sample,
                    global_batch=global_batch, train=train, compute_jitter_ms=compute_jitter_ms,
                    blocking_compute=blocking_compute)
        self.ranks[rank_id] = r
        if start:
            r.start()
        return r

    def at(self, t_ms: float, fn: Callable[[], Any]) -> None:
        """Schedule ``fn`` at virtual time ``t_ms``."""
        self.scheduler.call_later(t_ms - self.now_ms(), fn)

    def run_until(self, t_ms: float) -> None:
        self.scheduler.run_until(t_ms)

    def run_while(self, cond: Callable[[], bool], *, limit_ms: float, step_ms: float = 50.0) -> bool:
        """Advance in ``step_ms`` increments while ``cond()`` holds, at most until ``limit_ms``.
        Returns True when ``cond()`` became false."""
        while cond():
            if self.now_ms() >= limit_ms:
                return False
            self.run_until(min(limit_ms, self.now_ms() + step_ms))
        return True

    def alive(self) -> list[SimRank]:
        return [r for r in self.ranks.values() if r.alive]
