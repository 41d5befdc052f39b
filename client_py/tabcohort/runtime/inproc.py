"""The in-process cohort: N ranks in one process over the in-memory bus, in real time.

Each rank is a real :class:`~tabcohort.protocol.RankMachine` driven by the asyncio
:class:`~tabcohort.runtime.driver.RankDriver`; the bus exchanges only encoded frames. Used by
``tabcohort simulate`` and by the benchmarks.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..bus.memory import MemoryNetwork
from ..errors import ConfigError, TabcohortError
from ..jobs.worker import LOSS_BLOWUP, global_batch_note, loss_ceiling, slow_call_note
from ..protocol import RankMachine, Timing
from ..protocol.optim import TrainConfig
from ..sched import AsyncioScheduler
from ..vec import digest
from .driver import RankDriver, job_frame

#: More ranks than this in one process are a configuration error, not a slow death: every
#: rank beats to every other, about n^2 deliveries per beat period (README "Scaling limits");
#: here 5 steps took about 3 s at 64 ranks, 24 s at 128 and 48 s at 256 (on 2 loaded cores).
MAX_RANKS = 256
#: the largest batch or global batch, as ``serve`` bounds it (``JobConfig.validate``)
MAX_BATCH = 2**24
#: the machine's default lr ceiling (``RankMachine(lr_max=...)``; ``serve --lr-max``); a run
#: whose lr is higher raises its ranks' ceiling to it (they are all this process's own)
LR_MAX = 10.0
#: the longest one-way link delay (ms): an infinite one would deliver nothing, each rank alone
MAX_DELAY_MS = 60_000.0
#: A run whose step has not advanced for this long while buckets are non-finite has diverged.
DIVERGED_AFTER_S = 5.0
#: how often the run checks its fault triggers and stop conditions (seconds)
FAULT_POLL_S = 0.005
#: past ``max_seconds`` by this much (seconds) the in-memory network drops what is in flight
#: (``MemoryNetwork.cut_at_ms``), so a run whose event loop is flooded still stops in time
CUT_AFTER_S = 0.5
#: a partition healed less than this before the end (seconds) may explain ranks on two models
CATCH_UP_S = 1.0


@dataclass
class InprocConfig:
    """Settings of an in-process run. Validated by :meth:`validate` before anything starts.

    Times are milliseconds; ``*_at_step`` faults fire when the cohort's step reaches them
    (0 = never).
    """

    ranks: int = 4
    dataset: str = "digits"
    batch: int = 32
    hidden: tuple[int, ...] = (32,)
    activation: str = "relu"
    lr: float = 0.5
    steps: int = 400
    target_accuracy: float = 0.0
    max_seconds: float = 300.0
    precision: str = "f32"
    seed: int = 0
    backend: str = "auto"
    eval_every: int = 10
    timing: Timing = field(default_factory=Timing)
    kill_leader_at_step: int = 0
    add_rank_at_step: int = 0
    partition_at_step: int = 0
    heal_after_ms: float = 3000.0
    loss: float = 0.0
    delay_ms: float = 0.0
    collect_rule: str = "grace"
    #: samples per round (PROTOCOL.md, "Shares"); 0: ``ranks x batch``, fixed from the start
    global_batch: int = 0
    #: local steps and the optimizers (PROTOCOL.md, "Local steps and optimizer state")
    train: TrainConfig = field(default_factory=TrainConfig)
    #: capacity of every link, bytes/s (0: unlimited; ``MemoryNetwork`` knob)
    bandwidth_bytes_per_s: float = 0.0
    #: a module job, ``PATH_OR_MODULE[:FACTORY]`` (README "Write your own job"), instead of the
    #: built-in MLP job over ``dataset``; loaded once, each rank builds its worker from it
    job: str | None = None
    #: the module job's options (its ``OPTIONS`` overridden; README "Write your own job")
    job_options: dict = field(default_factory=dict)

    @property
    def resolved_global_batch(self) -> int:
        return self.global_batch or self.ranks * self.batch

    def validate(self) -> None:
        """Raises:
            ConfigError: naming the first invalid setting and its value.
        """
        def pos_int(name: str, minimum: int = 1) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ConfigError(name, v, f"must be an integer >= {minimum}")
        pos_int("ranks")
        if self.ranks > MAX_RANKS:
            raise ConfigError("ranks", self.ranks, f"at most {MAX_RANKS} ranks run in one process (every rank beats "
                              "to every other: about n^2 deliveries per beat period, README \"Scaling "
                              "limits\"; bench/bench_scale.py simulates larger cohorts)")
        pos_int("batch")
        pos_int("steps")
        for name in ("kill_leader_at_step", "add_rank_at_step", "partition_at_step", "eval_every", "global_batch",
                     "seed"):   # (seed as `serve` checks it)
            pos_int(name, 0)
        for name in ("batch", "global_batch"):   # as `serve` bounds them (a u32 on the wire, and memory)
            if getattr(self, name) > MAX_BATCH:
                raise ConfigError(name, getattr(self, name), f"must be at most {MAX_BATCH}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr) or self.lr <= 0:
            raise ConfigError("lr", self.lr, "must be a finite number > 0")
        for name, lo, hi in (("loss", 0.0, 1.0), ("delay_ms", 0.0, MAX_DELAY_MS), ("bandwidth_bytes_per_s", 0.0, math.inf),
                             ("target_accuracy", 0.0, 1.0), ("max_seconds", 0.0, math.inf),
                             ("heal_after_ms", 0.0, math.inf)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= v <= hi) or (
                    math.isinf(v) and hi != math.inf):
                # (a loss of 1 delivers nothing: the interval it says is [0, 1))
                # (max_seconds is a bound on the run: 0 is refused below, so its interval is open)
                raise ConfigError(name, v, "must be a number in [0, 1)" if name == "loss"
                                  else "must be a number > 0 (the run's time bound)" if name == "max_seconds"
                                  else f"must be a number in [{lo}, {hi}]")
        if self.target_accuracy and not self.eval_every:
            raise ConfigError("target_accuracy", self.target_accuracy, "needs evaluations: with --eval-every 0 "
                              "the accuracy is never measured and the run would never reach it")
        if self.loss >= 1.0:
            raise ConfigError("loss", self.loss, "must be below 1 (at 1 no message is delivered: each rank "
                              "trains alone and the run ends on as many models as ranks)")
        for name in ("kill_leader_at_step", "add_rank_at_step", "partition_at_step"):
            at = getattr(self, name)
            if at and at >= self.steps:
                # (the run ends at --steps: the fault never happened, and nothing said so)
                raise ConfigError(name, at, f"is not before --steps {self.steps}: the run would end first")
        if self.partition_at_step and self.ranks < 2:
            raise ConfigError("partition_at_step", self.partition_at_step,
                              f"needs at least 2 ranks (--ranks {self.ranks}): one rank has no one to be cut off from")
        if self.max_seconds <= 0:
            raise ConfigError("max_seconds", self.max_seconds, "must be a number > 0 (the run's time bound)")
        if self.kill_leader_at_step and self.ranks < 2:
            raise ConfigError("kill_leader_at_step", self.kill_leader_at_step,
                              f"needs at least 2 ranks (--ranks {self.ranks}): killing the only rank leaves "
                              "no one to take over")
        from ..wire.codecs import get_codec
        get_codec(self.precision)
        if self.collect_rule not in ("quorum", "grace"):
            raise ConfigError("collect_rule", self.collect_rule, "must be 'quorum' or 'grace'")
        if any(h <= 0 for h in self.hidden):
            raise ConfigError("hidden", self.hidden, "layer widths must be positive integers")


@dataclass
class InprocResult:
    """What a run ended with."""

    steps: int
    #: held-out accuracy in [0, 1]; None when the job's evaluate() gave anything else
    accuracy: float | None
    loss: float
    samples_per_s: float
    seconds: float
    bit_identical: bool
    digests: dict[int, str]
    leaders: list[int]
    events: list[str]
    #: the last leader's shares of the global batch (samples per rank, by 8-hex-digit id: every
    #: rank of the run, 0 for one the round gave no share) and its measured throughput of each
    #: rank (samples/s) (PROTOCOL.md "Shares"); empty without a leader
    shares: dict[str, int] = field(default_factory=dict)
    speeds: dict[str, float] = field(default_factory=dict)
    #: why the ranks may not have ended on one model (a partition still open, or healed only
    #: just before the end), or None
    note: str | None = None
    #: what ended the run: ``steps``, ``target_accuracy`` or ``max_seconds``
    stopped_by: str = "steps"
    #: a rank's ``grads`` calls held the event loop too long, and what to do (or None)
    slow_call: str | None = None
    #: the ranks leading at the end when more than one did: the run ended as that many separate
    #: cohorts, each trained alone (empty when it ended as one cohort). Their parameters can
    #: still agree, since each computed the same rounds alone: no success (PROTOCOL.md,
    #: "Membership and majority")
    separate_leaders: list[int] = field(default_factory=list)


class InprocCohort:
    """N ranks sharing one in-memory network and one dataset, on the running loop."""

    def __init__(self, cfg: InprocConfig, *, progress: Callable[[str], None] | None = None) -> None:
        cfg.validate()
        from ..jobs import BUILTIN, PROBE_TIMEOUT_S, check_round_fits, load_job, probe
        from ..jobs.builtin_mlp import canonical
        self.cfg = cfg
        self.progress = progress or (lambda line: None)
        # the built-in MLP is a job like any other, with the dataset and the model as its options
        options = dict(cfg.job_options) or None if cfg.job else canonical(
            {"dataset": cfg.dataset, "hidden": list(cfg.hidden), "activation": cfg.activation, "data_seed": cfg.seed})
        bound_s = None if sys.platform == "emscripten" else PROBE_TIMEOUT_S   # (no threads there)
        self.loaded_job = load_job(cfg.job or BUILTIN, options=options, timeout_s=bound_s)   # JobError before any rank starts
        notes: list[str] = []
        w = probe(self.loaded_job, batch=cfg.resolved_global_batch, seed=cfg.seed, backend=cfg.backend,
                  timeout_s=bound_s, notes=notes)
        for note in notes:
            self.progress(f"warning: {note}")
        check_round_fits(self.loaded_job, w.bucket_len, cfg.train.state_len(w.bucket_len))
        if cfg.job:
            self._compare_paths(w, bound_s)
        self.rng = random.Random(cfg.seed)
        self.loop = asyncio.get_running_loop()
        self.network = MemoryNetwork(AsyncioScheduler(self.loop), seed=cfg.seed, precision=cfg.precision,
                                     log=False)   # (nothing here reads it: it grew for the whole run)
        self.drivers: dict[int, RankDriver] = {}
        self.events: list[str] = []
        self._slow_call_said = False
        self._note: str | None = None
        #: ranks whose job's compute failed every time, and why (the run ends with an error)
        self._compute_failed: dict[int, str] = {}
        self._stopped_by = "steps"
        #: the two sides of the partition (--partition-at), once it began
        self._sides: list[set[int]] = []
        #: seconds since the run began when its partition healed, or None
        self._healed_at_s: float | None = None
        self.job: str | None = None

    def _compare_paths(self, w: Any, bound_s: float | None) -> None:
        """A module job with both a numpy and a pure-Python path: they agree on one batch, as
        serve checks (:func:`tabcohort.jobs.compare_paths`), whichever of them this run uses."""
        from ..jobs import JobError, compare_paths
        from ..jobs.worker import resolve_backend
        job, cfg = self.loaded_job, self.cfg
        if resolve_backend("auto") == "python" or (job.backends is not None and
                                                   not {"numpy", "python"} <= set(job.backends)):
            return
        other = "numpy" if w.backend == "python" else "python"
        try:
            o = job.make_worker(batch=cfg.resolved_global_batch, seed=cfg.seed, backend=other)
        except JobError:                    # (a job with one path only)
            return
        np_w, py_w = (o, w) if other == "numpy" else (w, o)
        params = w.params()
        note = compare_paths(job, np_w, py_w, timeout_s=bound_s)
        if note is not None:
            self.progress(f"warning: {note}")
        w.set_params(params)

    def _new_id(self) -> int:
        while True:
            k = self.rng.getrandbits(32)
            if k not in self.drivers:
                return k

    def _lr_advice(self) -> str:
        """What to lower after a divergence: the round's lr, and with local steps the inner one
        too (a diverging inner lr was answered "try a smaller --lr": a new-user trial)."""
        t = self.cfg.train
        if t.local_steps > 1:
            return (f"try a smaller --inner-lr (now {t.inner_lr:g}, {t.inner_optimizer}) or --lr (the outer "
                    f"one, now {self.cfg.lr:g})")
        return f"try a smaller --lr (now {self.cfg.lr:g})"

    def add_rank(self) -> RankDriver:
        cfg = self.cfg
        k = self._new_id()
        # a rank's batch is the most it computes per bucket: here any rank may take the whole round
        w = self.loaded_job.make_worker(batch=cfg.resolved_global_batch, seed=cfg.seed, backend=cfg.backend)
        if self.job is None:
            self.job = self.loaded_job.job_hash(w, cfg.train.spec())
            note = global_batch_note(cfg.resolved_global_batch, getattr(w, "train_len", None))
            if note:
                self._event(f"warning: {note}")
        for other in self.drivers:
            if cfg.loss or cfg.delay_ms or cfg.bandwidth_bytes_per_s:
                self.network.set_link(k, other, delay_ms=cfg.delay_ms, loss=cfg.loss,
                                      bandwidth_bytes_per_s=cfg.bandwidth_bytes_per_s)
        bus = self.network.attach(k)
        m = RankMachine(k, w, bus, job=self.job, now_ms=RankDriver.clock_ms(self.loop), timing=cfg.timing,
                        lr=cfg.lr, eval_every=cfg.eval_every, precision=cfg.precision,
                        collect_rule=cfg.collect_rule, global_batch=cfg.resolved_global_batch,
                        step_limit=cfg.steps, train=cfg.train,
                        # every rank here is this process's own: the lr ceiling (against a hostile
                        # leader, docs/PROTOCOL.md "Untrusted ranks") is the run's own lr, as
                        # `serve --lr-max` would be set for it
                        lr_max=max(LR_MAX, cfg.lr))
        d = RankDriver(m, w, bus, on_compute_failed=lambda why, k=k: self._compute_failed.setdefault(k, why))
        self.drivers[k] = d
        d.start()
        return d

    def leader(self) -> RankDriver | None:
        for d in self.drivers.values():
            if d.machine.looping:
                return d
        return None

    def step(self) -> int:
        return max((d.machine.step for d in self.drivers.values()), default=0)

    async def kill(self, d: RankDriver) -> None:
        """Crash a rank: no publish, no goodbye."""
        del self.drivers[d.machine.id]
        d.bus.close()
        await d.close()
        for other in self.drivers.values():   # the witness a server room has: its link closed
            other.peer_left(d.machine.id)

    async def run(self) -> InprocResult:
        cfg = self.cfg
        for _ in range(cfg.ranks):
            self.add_rank()
        t0 = time.monotonic()
        # (--max-seconds held only between this loop's polls: 128 ranks starting together flooded
        # the event loop with start-up beats and ran 164 s of --max-seconds 10)
        self.network.cut_at_ms = self.network.scheduler.now_ms() + (cfg.max_seconds + CUT_AFTER_S) * 1000.0
        last_print = -1.0
        leaders: list[int] = []
        pending = {"kill": cfg.kill_leader_at_step, "add": cfg.add_rank_at_step,
                   "partition": cfg.partition_at_step}
        heal_at: float | None = None
        last_step, last_advance = -1, 0.0
        runaway_since: float | None = None   # when the leader's loss first passed the ceiling
        while True:
            # faults are checked every FAULT_POLL_S (a fast cohort runs thousands of steps a second)
            await asyncio.sleep(FAULT_POLL_S)
            now = time.monotonic() - t0
            step = self.step()
            ld = self.leader()
            if ld is not None and (not leaders or leaders[-1] != ld.machine.id):
                leaders.append(ld.machine.id)
            if pending["kill"] and step >= pending["kill"] and ld is not None:
                pending["kill"] = 0
                self._event(f"step {step}: killing leader {ld.machine.id:08x}")
                await self.kill(ld)
            if pending["add"] and step >= pending["add"]:
                pending["add"] = 0
                d = self.add_rank()
                self._event(f"step {step}: added rank {d.machine.id:08x}")
            if pending["partition"] and step >= pending["partition"]:
                pending["partition"] = 0
                ids = sorted(self.drivers)
                half = len(ids) // 2
                self._sides = [set(ids[:half]), set(ids[half:])]
                self.network.partition(self._sides)
                heal_at = now + cfg.heal_after_ms / 1000.0
                self._event(f"step {step}: partitioned into {len(ids[:half])}+{len(ids) - half}")
            if heal_at is not None and now >= heal_at:
                heal_at = None
                self._healed_at_s = now
                self.network.heal()
                self._event(f"step {step}: healed the partition")
            if self._compute_failed:
                k, why = next(iter(self._compute_failed.items()))
                for d in list(self.drivers.values()):
                    await d.close()
                raise TabcohortError(f"rank {k:08x} at step {step}: {why}")
            if step != last_step:
                last_step, last_advance = step, now
            elif now - last_advance > DIVERGED_AFTER_S and self._non_finite() > 0:
                raise await self._closed_with(TabcohortError(
                    f"training diverged at step {step}: gradients or updates are no longer finite and "
                    f"no round has applied for {DIVERGED_AFTER_S:g} s (the parameters stay the last finite "
                    f"ones: a NaN or infinity never reaches them); {self._lr_advice()}, or "
                    f"look for a NaN in the job's loss or gradients"))
            # a loss over the ceiling for DIVERGED_AFTER_S stops the run as it stops a served room
            # (the server's rule, "Divergence" in README): it trained on to --steps, then said so
            over = self._runaway(self.leader())
            if over is None:
                runaway_since = None
            elif runaway_since is None:
                runaway_since = now
            elif now - runaway_since >= DIVERGED_AFTER_S:
                raise await self._closed_with(TabcohortError(
                    f"training diverged at step {step}: the training loss has stayed above {over[1]:.3g} "
                    f"({LOSS_BLOWUP:g}x a guess's) for {DIVERGED_AFTER_S:g} s, now {over[0]:.4g} (gradients "
                    f"finite, the parameters ran away); {self._lr_advice()}"))
            acc = self._accuracy()
            if now - last_print >= 1.0:
                last_print = now
                self._print_progress(now, step, acc)
            if step >= cfg.steps:
                break
            if cfg.target_accuracy and acc is not None and acc >= cfg.target_accuracy:
                self._stopped_by = "target_accuracy"
                break
            if now >= cfg.max_seconds:
                self._event(f"stopping: max_seconds={cfg.max_seconds} reached at step {step}")
                self._stopped_by = "max_seconds"
                break
        seconds = time.monotonic() - t0
        cut = self.network.scheduler.now_ms() >= self.network.cut_at_ms
        if not cut:   # (a cut network stays cut: what was queued would flood the loop again)
            self.network.cut_at_ms = math.inf   # (the final publish must arrive)
        if cut:
            self._note = (f"the in-memory network was cut {CUT_AFTER_S:g} s past --max-seconds with messages "
                          f"still queued: {len(self.drivers)} ranks in one process send more than it handles "
                          f"(every rank beats to every other, about n^2 deliveries per beat period: README "
                          f"\"Scaling limits\")")
        elif heal_at is not None:
            self._note = (f"the run ended inside the partition (it was to heal {cfg.heal_after_ms:g} ms after it "
                          f"began): the side that paused never saw the last rounds; let the run last past the "
                          f"heal (more --steps, or a shorter --heal-after-ms)")
        elif self._healed_at_s is not None and seconds - self._healed_at_s < CATCH_UP_S:
            self._note = (f"the partition healed only {(seconds - self._healed_at_s) * 1000:.0f} ms before the end: the "
                          f"side that paused may not have caught up; let the run last past the heal (more --steps)")
        samples = self._applied_samples()
        # (at the step limit no rank leads any more; every rank holds the last round's loss)
        over = self._runaway(self.leader() or max(self.drivers.values(), key=lambda d: d.machine.step, default=None))
        if over is not None:
            raise await self._closed_with(TabcohortError(
                f"training diverged at step {last_step}: the training loss ended at {over[0]:.4g}, "
                f"{LOSS_BLOWUP:g}x a guess's ({over[1] / LOSS_BLOWUP:.3g}: gradients stayed finite, "
                f"the parameters ran away); {self._lr_advice()}"))
        return await self._finish(seconds, samples, leaders, partitioned=heal_at is not None, cut=cut)

    async def _closed_with(self, exc: TabcohortError) -> TabcohortError:
        """Close every rank's driver, then hand back ``exc`` to raise."""
        for d in list(self.drivers.values()):
            await d.close()
        return exc

    @staticmethod
    def _runaway(d: RankDriver | None) -> tuple[float, float] | None:
        """(loss, ceiling) when ``d``'s last loss is finite and over the job's runaway ceiling
        (:func:`~tabcohort.jobs.worker.loss_ceiling`), else None."""
        ceiling = loss_ceiling(d.worker) if d is not None else None
        loss = d.machine.loss if d is not None else None
        if ceiling is None or loss is None or not math.isfinite(loss) or loss <= ceiling:
            return None
        return loss, ceiling

    def _non_finite(self) -> int:
        keys = ("reduce_non_finite", "own_bucket_invalid", "grad_non_finite")
        return sum(d.machine.drops.get(k, 0) for d in self.drivers.values() for k in keys) + sum(
            d.machine.diverged for d in self.drivers.values())

    def _accuracy(self) -> float | None:
        ld = self.leader()
        return ld.machine.accuracy if ld is not None else None

    def so_far(self) -> tuple[int, float | None]:
        """``(step, accuracy)`` reached so far: the furthest rank's step and the leader's last
        held-out accuracy (else the furthest rank's), None before any evaluation. For a run
        stopped from outside (Ctrl-C), whose result :meth:`run` never returned."""
        if not self.drivers:
            return 0, None
        best = max(self.drivers.values(), key=lambda d: d.machine.step)
        acc = self._accuracy()
        return best.machine.step, acc if acc is not None else best.machine.accuracy

    def _applied_samples(self) -> int:
        # followers count the samples each adopted round reports, so any surviving rank
        # has (about) the cohort's total, including rounds of a leader that was killed
        return max((d.machine.applied_samples for d in self.drivers.values()), default=0)

    def _slow_call(self) -> str | None:
        """:func:`~tabcohort.jobs.worker.slow_call_note` of a rank whose ``grads`` calls hold the
        loop too long, its advice in this run's terms (``--global-batch``), or None."""
        slow = next((d.worker.slow_call for d in self.drivers.values() if getattr(d.worker, "slow_call", None)), None)
        return None if slow is None else slow_call_note(slow, flag="--global-batch", ranks=max(1, len(self.drivers)))

    def _print_progress(self, now: float, step: int, acc: float | None) -> None:
        if not self._slow_call_said and (slow := self._slow_call()):
            self._slow_call_said = True
            self._event(f"warning: {slow}")
        ld = self.leader()
        st = ld.state() if ld is not None else None
        if st is None:
            # (a short run's one line said "joining or handover" at its final step)
            why = ("the step limit: rounds have stopped" if self.cfg.steps and step >= self.cfg.steps else
                   "starting: no rank leads yet" if step == 0 else "no rank driving rounds: joining or handover")
            self.progress(f"[{now:6.1f}s] step {step:5d}  {why} ({len(self.drivers)} rank{'' if len(self.drivers) == 1 else 's'})")
            return
        acc_s = f"{acc * 100:5.1f}%" if acc is not None else "  n/a"
        loss = st["loss"]   # (NaN before the first round: it said "loss nan")
        loss_s = f"{loss:.4f}" if isinstance(loss, (int, float)) and math.isfinite(loss) else "   n/a"
        self.progress(f"[{now:6.1f}s] step {step:5d}  leader {st['id_hex']}  cohort {st['cohort']}  "
                      f"loss {loss_s}  acc {acc_s}  {st['steps_per_s']:6.1f} steps/s  "
                      f"{st['samples_per_s']:8.0f} samples/s  {st['wire_bytes_per_s'] / 1e6:6.2f} MB/s")
        if st.get("shares") or st.get("speeds"):
            # "Shares": who computes how much of the global batch, and why (measured samples/s)
            speeds, shares = st.get("speeds") or {}, st.get("shares") or {}
            self.progress("          shares  " + "  ".join(
                f"{k} {shares.get(k, 0)} ({speeds[k]:.0f}/s)" if k in speeds else f"{k} {shares.get(k, 0)}"
                for k in sorted(set(shares) | set(speeds))))

    def _event(self, text: str) -> None:
        self.events.append(text)
        self.progress("  * " + text)

    async def _finish(self, seconds: float, samples: int, leaders: list[int], *,
                      partitioned: bool = False, cut: bool = False) -> InprocResult:
        if not leaders:
            # a run shorter than one poll ended before a leader was seen driving: the rank that
            # published the final parameters led it (`--steps 5` said "leaders []")
            leaders = [d.machine.id for d in self.drivers.values() if d.machine.counters.get("published")][:1]
        ld = self.leader() or (self.drivers.get(leaders[-1]) if leaders else None)
        st = ld.state() if ld is not None else {}       # the last leader's shares and speeds
        # ranks that each lead a cohort of their own at the end (links that carry no beat in time:
        # `--link-bandwidth 1` ended "bit-identical: yes" with four ranks each alone, a new-user trial)
        # (a rank that follows itself and hears no member at all: looping alone missed lone
        # leaders that had stopped at the step limit)
        separate = sorted(d.machine.id for d in self.drivers.values() if d.machine.following == d.machine.id
                          and not any(True for _ in d.machine.roster.live(d.now_ms(), d.machine.policy.drop_ms)))
        separate = separate if len(separate) > 1 else []
        # A run that ends inside its partition is checked inside it: healing here let the final
        # publish, still in flight, reach the paused side or not by the event loop's timing, so
        # the same run ended "bit-identical: yes" or "NO" by chance.
        if not partitioned:
            self.network.heal()
        for d in self.drivers.values():
            d.stop()
        # the model the run reports: the last leader's, else the most advanced rank's (inside a
        # partition the paused side's model is many steps behind; the first rank's was reported)
        best = ld or max(self.drivers.values(), key=lambda d: d.machine.step)
        # wait (bounded) until the publish has reached every rank it can reach: all of them, or
        # inside a partition that model's side (the other side holds what it had)
        reach = set(self.drivers)
        if partitioned:
            reach = next((g for g in self._sides if best.machine.id in g), reach) & reach
        deadline = time.monotonic() + (0.0 if cut else 10.0)   # (a cut network delivers nothing more)
        while time.monotonic() < deadline:
            if len({digest(self.drivers[k].worker.params()) for k in reach}) == 1:
                break
            await asyncio.sleep(0.05)
        ds = {d.machine.id: digest(d.worker.params()) for d in self.drivers.values()}
        off = sorted(k for k in reach if ds[k] != ds[best.machine.id])
        why = None
        n = 4 * best.worker.bucket_len
        links = (f"--link-bandwidth {self.cfg.bandwidth_bytes_per_s:g} bytes/s carries one round ({n:,} bytes "
                 f"of parameters) in {n / self.cfg.bandwidth_bytes_per_s:.1f} s" if self.cfg.bandwidth_bytes_per_s else
                 f"--link-delay-ms {self.cfg.delay_ms:g} delays every message that long" if self.cfg.delay_ms else
                 f"--link-loss {self.cfg.loss:g} lost the messages that would have joined them" if self.cfg.loss else
                 None)
        if self.cfg.loss:
            why = (f"missed the leader's final publish of step {best.machine.step}: --link-loss "
                   f"{self.cfg.loss:g} lost it and each re-send within 10 s (PROTOCOL.md, \"Publish\": at "
                   f"most 8 per rank, a beat apart)")
        elif self.cfg.bandwidth_bytes_per_s:   # (it said "NO" and nothing more: a new-user trial)
            why = f"did not receive the leader's final publish of step {best.machine.step} within 10 s: {links}"
        elif self.cfg.delay_ms:                # (--link-delay-ms 60000: the same)
            why = (f"did not receive the leader's final publish of step {best.machine.step} within 10 s: "
                   f"--link-delay-ms {self.cfg.delay_ms:g} delays every message that long (longer than the "
                   f"takeover window, each rank may also have led alone)")
        if off and self._note is None and why is not None:
            behind = ", ".join(f"{k:08x} at step {self.drivers[k].machine.step}" for k in off)
            self._note = f"{behind} {why}; the model the run reports is the leader's"
        if separate:   # (said beside what was said before: a cut network's note says why too)
            self._note = "; ".join(x for x in (
                self._note, f"the ranks ended as {len(separate)} separate cohorts, led by "
                            f"{', '.join(f'{k:08x}' for k in separate)}, each hearing no other rank: they did not "
                            f"train together" + (f" ({links})" if links else "")
                            + "; parameters that agree were computed the same way alone") if x)
        try:
            acc: float | None = float(best.worker.evaluate())
        except Exception as exc:
            where = job_frame(exc, getattr(best.worker, "job_files", None))
            for d in list(self.drivers.values()):
                await d.close()
            raise TabcohortError(f"the job's evaluate() raised {type(exc).__name__}: {str(exc)[:160]}"
                                 + (f" (at {where})" if where else "")) from None
        if not 0.0 <= acc <= 1.0:
            acc = None          # ("Worker contract": no accuracy; NaN is not JSON either)
        steps = max(d.machine.step for d in self.drivers.values())
        loss = best.machine.loss
        for d in list(self.drivers.values()):
            await d.close()
        shares = dict(st.get("shares") or {})
        if shares:     # (a round names only the ranks it gives samples: the others have 0)
            shares = {f"{k:08x}": 0 for k in sorted(ds)} | shares
        return InprocResult(steps=steps, accuracy=acc, loss=loss,
                            samples_per_s=samples / seconds if seconds > 0 else 0.0, seconds=seconds,
                            bit_identical=len(set(ds.values())) == 1, digests=ds, leaders=leaders,
                            events=self.events, shares=shares,
                            speeds=dict(st.get("speeds") or {}),
                            note=None if len(set(ds.values())) == 1 and not separate else self._note,
                            stopped_by=self._stopped_by, slow_call=self._slow_call(), separate_leaders=separate)


async def run_inprocess(cfg: InprocConfig, *, progress: Callable[[str], None] | None = None) -> InprocResult:
    """Run an in-process cohort to its stop condition and return the result."""
    return await InprocCohort(cfg, progress=progress).run()
