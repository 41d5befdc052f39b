"""The rank: one participant of the cohort protocol, as a sans-I/O state machine.

Every input carries ``now_ms`` (keyword-only); outputs are actions drained with
:meth:`RankMachine.drain` (:class:`~.actions.Post`, :class:`~.actions.Compute`,
:class:`~.actions.Report`) and the next deadline from :meth:`RankMachine.next_deadline_ms`.
No asyncio, no clock reads, no transport imports: the driver (``tabcohort.runtime``) or a
simulation does the waiting. Section names in comments refer to ``docs/PROTOCOL.md``.

Peer input never raises out of the machine: a malformed, foreign, stale or invalid message
is dropped and counted by reason in ``drops`` (and in the state report). Misuse by the
local caller raises :class:`~tabcohort.errors.LocalProtocolError`.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any, Protocol

from .. import PROTOCOL_VERSION
from ..errors import LocalProtocolError
from ..vec import RunningMean, all_finite, is_vector, to_vector, weighted_mean
from .actions import Action, Compute, Post, Report
from .assign import windows
from .optim import TrainConfig, empty, outer_step
from .optim import zeros as _zeros
from .robust import (AGGREGATES, CONTRIBUTOR_SHARE_FRACTION, BiasMonitor, clip_to_median_norm, l2_norm,
                     trimmed_mean)
from .shares import (CENSOR_WINDOW_MS, lead_head_start_ms, FOLLOW_INTERVAL_MS, censor_window_ms, PROBE_EVERY, PROBE_INTERVAL_MS, REPLAN_INTERVAL_MS, SpeedTable,
                     paced_interval_ms, plan_shares)
from .policy import Policy, Timing, policy
from .roster import Roster

_U32 = (1 << 32) - 1
_MAX_PACE_TRIES = 20  # "The leader loop": pace for at most 20 beats in all
_PACE_RETRY_MS = 25.0  # "The leader loop": pressure is checked again this often while pacing
_RATE_WINDOW_MS = 2000.0
_SPREAD_ALPHA = 0.25  # grace rule: weight of the newest round in the typical arrival spread
_GRACE_SKIP_MISSES = 2  # grace rule: a rank that missed this many rounds in a row is not awaited
_PROBATION_BUCKETS = 3  # "Flapping ranks": in-time buckets per eviction before a rank is awaited again
_PROBATION_MAX = 24
#: "Shares": probe shares kept per rank for matching late answers to their send time
_PROBES_KEPT = 4
#: "Untrusted ranks": a rank with this many probes outstanding, none answered, is silent
_PROBES_SILENT = 3
#: the state report's ``fault`` is cut to this many characters (PROTOCOL.md "State report")
FAULT_MAX_CHARS = 240
#: the most ranks a per-rank record of the state report names (``flaps``, ``held_ms``,
#: ``applied``, ``clipped``, ``speeds``, ``lateness_ms``): the ranks it holds now first, then the
#: largest of the others. A
#: leader of a room where thousands of tabs came and went kept every one of them, and its report
#: outgrew the server's 64 KiB control limit and a room's seats (200 at the least), and was
#: dropped whole ("Server controls")
REPORT_RANKS_MAX = 200
#: "Shares": the wait before a rank's next probe doubles per probe outstanding up to
#: PROBE_INTERVAL_MS * 2 ** this (8 s)
_PROBE_BACKOFF_MAX_EXP = 5
#: "Shares", minor stragglers: buckets still missing whose shares are at most this fraction of
#: the round's awaited samples are waited for in proportion to their samples, not to the end
MINOR_SHARE_FRACTION = 1 / 8
#: ... for at most this many times their part of the round's time (a dropped bucket costs its
#: samples twice: this round's, and its rank's next bucket starts late)
MINOR_WAIT_FACTOR = 2.0
#: ranks remembered as having left the room (the state report hides their speeds), the oldest
#: forgotten first
_LEFT_KEPT = 4096
#: a round's ``cohort`` count above this is shown as this (a peer's integer, display only)
_COHORT_SHOWN_MAX = 1_000_000
#: "Untrusted ranks": a rank with this many clipped buckets among its last _CLIP_WINDOW is
#: quarantined (no share) for _QUARANTINE_MS, doubled at each further quarantine (up to 64 x)
_CLIP_WINDOW = 8
_CLIP_QUARANTINE = 4
#: only a bucket clipped by at least this ratio (its norm over its bound) counts toward a
#: quarantine: an honest rank's batch near convergence can pass the bound (heavy-tailed batch
#: gradient norms); clipping already bounds it, quarantine would throw its compute away
_QUARANTINE_CLIP_RATIO = 10.0
_QUARANTINE_MS = 60_000.0
#: "Heartbeat and takeover": a member this many steps ahead of a rank, in its term, whose
#: lineage moves, follows a live leader (one round in flight is no evidence: a follower that
#: missed the dead leader's last round is one step behind the others)
_MOVING_AHEAD_STEPS = 2
#: the largest step a round may carry (a u64 beyond this is no step any lineage reached)
_MAX_STEP = 2**63 - 1
#: "Joining": how long a rank told that the server's roll call is partial (a restarted server's
#: ``welcome``) waits for the whole one before it may bootstrap: the ranks' reconnect bound
#: (``tabcohort.bus.room.RECONNECT_MAX_S``, 30 s; a test keeps them equal). Every rank of the
#: server's previous life that comes back has done so within it
ROLL_CALL_WAIT_MS = 30_000.0
#: "Publish": a member that announces a step below the final publish is sent it again at most
#: this often (a lossy link loses each send with its loss rate; a member that never catches up,
#: e.g. one that refuses the round, costs at most this many model sends)
REPUBLISH_MAX = 8

# Required keys and their types, per message type (see docs/INTERFACES.md).
_INT = int
_NUMBER = (float, int)
#: the largest int a float holds without overflow (``float(10**400)`` raises OverflowError)
_FLOAT_MAX_INT = int(1.7976931348623157e308)
_SCHEMA: dict[str, tuple[tuple[str, type | tuple[type, ...]], ...]] = {
    "hello": (("version", _INT), ("job", str), ("batch", _INT), ("ready", bool),
              ("running", bool), ("step", _INT), ("model", str), ("backend", str)),
    "beat": (("batch", _INT), ("ready", bool), ("running", bool), ("step", _INT), ("backend", str),
             ("term", _INT)),
    "round": (("step", _INT), ("term", _INT), ("lr", _NUMBER), ("assign", dict), ("shares", dict),
              ("cursor", _INT), ("params", object), ("loss", _NUMBER), ("samples", _INT), ("cohort", _INT)),
    "grad": (("step", _INT), ("term", _INT), ("loss", _NUMBER), ("samples", _INT), ("g", object)),
}


class Worker(Protocol):
    """The synchronous part of the worker contract that the machine calls directly
    (PROTOCOL.md, "Worker contract"). ``grads`` is requested through :class:`Compute`."""

    batch: int
    bucket_len: int
    model: str
    backend: str

    def apply(self, avg: Any, lr: float) -> None: ...
    def params(self) -> Any: ...
    def set_params(self, p: Any) -> None: ...
    def evaluate(self) -> float: ...


class Link(Protocol):
    """The synchronous read-outs of the bus the machine needs (PROTOCOL.md, "Bus contract")."""

    def pressure(self) -> float: ...
    def quantize(self, params: Any) -> Any: ...
    def total_bytes(self) -> int: ...


class _Collection:
    """The leader's collection state for one round ("Leader: driving one round", step 3)."""

    __slots__ = ("step", "term", "shares", "wanted", "awaited", "quorum", "received", "opened_ms",
                 "first_ms", "last_ms", "grace_until_ms", "window_end_ms", "arrived_ms", "norms",
                 "minor_until_ms", "assign", "grace_basis")

    def __init__(self, step: int, term: int, shares: dict[int, int], awaited: set[int], quorum: int,
                 opened_ms: float) -> None:
        self.step = step
        self.term = term
        self.shares = shares                    # id -> samples assigned ("Shares")
        wanted = set(shares)
        self.wanted = wanted                    # assigned ranks: their buckets are accepted
        self.awaited = awaited                  # the ranks the quorum is taken of ("Flapping ranks")
        self.quorum = quorum
        self.received: dict[int, tuple[float, int, Any]] = {}  # id -> (loss, samples, g)
        self.opened_ms = opened_ms              # when the round was sent
        self.first_ms: float | None = None      # first bucket arrival (own included)
        self.last_ms: float | None = None       # latest arrival of a bucket of this step
        self.grace_until_ms: float | None = None
        self.window_end_ms: float | None = None  # the collect window's end, once it is armed
        self.arrived_ms: dict[int, float] = {}   # id -> when its accepted bucket arrived
        self.norms: dict[int, float] = {}        # id -> its bucket's L2 norm (the clip rule)
        self.minor_until_ms: float | None = None  # "Shares": the wait for minor stragglers ends
        self.assign: dict[int, int] = {}         # id -> its window's offset (the round's assign)
        #: grace rule: (when the quorum was reached, the spread-based window, the elapsed time
        #: then), so each later arrival can shorten the window as the missing samples shrink
        self.grace_basis: tuple[float, float, float] | None = None


class _Spread:
    """Arrival times of the last finished round, kept (grace rule) until the next round's
    window is decided, so that buckets arriving after the round finished still count."""

    __slots__ = ("step", "wanted", "missing", "first_ms", "last_ms")

    def __init__(self, col: _Collection) -> None:
        self.step = col.step
        self.wanted = col.wanted
        self.missing = col.wanted - col.received.keys()
        self.first_ms = col.first_ms
        self.last_ms = col.last_ms


def _opt_len(msg: dict) -> int:
    """Length of a round's optimizer state (``opt``; absent: none). -1 when it is no vector."""
    opt = msg.get("opt")
    if opt is None:
        return 0
    return len(opt) if is_vector(opt) else -1


def _arrived(col: _Collection, now_ms: float, rank: int) -> None:
    """Record a bucket arrival time on the collection (first, latest, and the rank's)."""
    col.arrived_ms[rank] = now_ms
    if col.first_ms is None:
        col.first_ms = now_ms
    col.last_ms = now_ms if col.last_ms is None else max(col.last_ms, now_ms)


#: "Membership and majority": how much earlier than its own word of the leader's leave a
#: member may have been heard and still count towards a takeover (the server tells every rank
#: at about the same time; the others beat as they hear it)
WITNESS_SKEW_MS = 100.0


class Phase(enum.Enum):
    """Where the leader loop is ("The leader loop"); None when no loop runs."""

    PACE = "pace"          # deadline: the next try (paced on back-pressure)
    YIELD = "yield"        # due now: the FIFO yield between rounds
    OWN = "own"            # awaiting its own bucket
    COLLECT = "collect"    # deadline: the collect window
    FAULT = "fault"        # deadline: one beat after a failed round



def _per_rank(record: dict[int, Any], live: Any) -> dict[str, Any]:
    """``record`` (rank id -> a number) for the state report, hex-keyed and sorted: at most
    :data:`REPORT_RANKS_MAX` ranks, those in ``live`` first (the rank itself, its live peers,
    the ranks of its shares), then the others with the largest values."""
    if len(record) <= REPORT_RANKS_MAX:
        return {f"{k:08x}": v for k, v in sorted(record.items())}
    keep = sorted(record, key=lambda k: (k not in live, -record[k], k))[:REPORT_RANKS_MAX]
    return {f"{k:08x}": record[k] for k in sorted(keep)}

class RankMachine:
    """One rank of the cohort protocol. Sans-I/O: no clock, no sockets, no asyncio.

    Args:
        rank_id: this rank's uint32 id.
        worker: the worker (model) for the synchronous calls: apply, params, set_params, evaluate.
        link: the bus read-outs: ``pressure()``, ``quantize()``, ``total_bytes()``.
        job: the job hash (``protocol.job.job_hash``); peers with another job are ignored.
        now_ms: creation time; the heartbeat starts here and a ``hello`` is announced.
        timing: base periods (PROTOCOL.md defaults).
        lr: initial learning rate (the leader's; followers adopt the leader's).
        ready: True when this rank starts with parameters that come from the cohort
            (a checkpoint); False to join.
        eval_every: the leader evaluates held-out accuracy every this many steps (0: never).
        precision: the wire precision name, for the state report.
        collect_rule: ``"quorum"`` (PROTOCOL.md: finish as soon as the quorum is reached) or
            ``"grace"`` (docs/PROTOCOL-NOTES.md, note 7): once the quorum is reached, wait a
            short grace window for the remaining buckets, of length
            ``min(max(spread, grace_margin * typical_spread), bound * elapsed)``
            (spread: time since this round's first bucket arrived; typical_spread: an EWMA of
            the first-to-last arrival spread of previous rounds, late buckets included;
            elapsed: time since the round was sent; bound: ``grace_fraction``, or, under a
            fixed ``global_batch``, ``MINOR_WAIT_FACTOR`` times the missing buckets' fraction
            of the awaited samples when larger), never past the collect window.
        grace_fraction: least bound of the grace window relative to the round's elapsed time.
        grace_margin: the grace window covers at least this many typical spreads.
        term: the lineage term this rank's parameters come from (PROTOCOL.md, "Lineage and
            terms"); 0 for a rank that has never adopted or driven a round.
        global_batch: the samples one round covers, split across the cohort in proportion to
            each rank's measured throughput and capped by each rank's declared batch
            (PROTOCOL.md, "Shares"); None: every rank's share is its declared batch.
        step_limit: the job's exact step limit (docs/PROTOCOL-NOTES.md, note 13), or None. A
            leader whose step reached it drives no further round: it stops (``running`` false)
            and publishes, so the cohort ends at exactly this step; a follower that adopts a
            round at the limit stops too and computes nothing for it.
        may_lead: this rank's role as the server bound it to its link (docs/PROTOCOL.md,
            "Roles"): True if it may lead (run the optimizer, publish parameters); False if it
            may only contribute buckets.
        train: local steps and the optimizers (:class:`~.optim.TrainConfig`; PROTOCOL.md,
            "Local steps and optimizer state"); default: one synchronous SGD step per round.
        opt_state: the leader's optimizer state to start from (a checkpoint's): float32,
            shape (``train.state_len(bucket_len)``,), or None (zeros).
        start_step: the step this rank starts at (the checkpoint it loaded), >= 0.
        start_cursor: the samples assigned before ``start_step`` (the checkpoint's cursor), >= 0:
            a resumed cohort goes on through the training set where it was ("Shares", data
            coverage) and its epoch goes on counting, where both started again from 0.
        term_floor: the term of the checkpoint it loaded (its leader's), >= 0: a term this rank
            starts by bootstrap or takeover is above it (PROTOCOL.md, "Lineage and terms": a
            rank that may lead, joining a room whose leader is gone, must outrank the lineage
            its followers still hold).

    Raises:
        LocalProtocolError: an id outside uint32, or a non-positive batch or bucket length.
    """

    def __init__(self, rank_id: int, worker: Worker, link: Link, *, job: str, now_ms: float,
                 timing: Timing = Timing(), lr: float = 0.1, ready: bool = False,
                 eval_every: int = 10, precision: str = "f32", collect_rule: str = "quorum",
                 grace_fraction: float = 0.1, grace_margin: float = 2.0, term: int = 0,
                 global_batch: int | None = None, step_limit: int | None = None,
                 may_lead: bool = True, lr_max: float = 10.0, aggregate: str = "clip",
                 train: TrainConfig | None = None, opt_state: Any = None, start_step: int = 0,
                 term_floor: int = 0, start_cursor: int = 0, join_reach_ms: float = 0.0) -> None:
        if isinstance(rank_id, bool) or not isinstance(rank_id, int) or not 0 <= rank_id <= _U32:
            raise LocalProtocolError(f"rank id must be a uint32, got {rank_id!r}")
        if worker.batch <= 0 or worker.bucket_len <= 0:
            raise LocalProtocolError("worker.batch and worker.bucket_len must be positive")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or not 0 <= start_step <= _MAX_STEP:
            raise LocalProtocolError(f"start_step must be an integer in [0, 2^63), got {start_step!r}")
        if isinstance(term_floor, bool) or not isinstance(term_floor, int) or not 0 <= term_floor <= _MAX_STEP:
            raise LocalProtocolError(f"term_floor must be an integer in [0, 2^63), got {term_floor!r}")
        if isinstance(start_cursor, bool) or not isinstance(start_cursor, int) or not 0 <= start_cursor <= _MAX_STEP:
            raise LocalProtocolError(f"start_cursor must be an integer in [0, 2^63), got {start_cursor!r}")
        self.term_floor = term_floor
        if isinstance(join_reach_ms, bool) or not isinstance(join_reach_ms, (int, float)) or \
                not (math.isfinite(join_reach_ms) and join_reach_ms >= 0):
            raise LocalProtocolError(f"join_reach_ms must be a number of ms >= 0, got {join_reach_ms!r}")
        #: how long the link may take before this rank can hear a peer at all (a mesh: a pair's
        #: frames wait for its data channel, up to the connect bound, then take the relay); a
        #: joiner waits this much longer for a witnessed rank that may lead ("Joining")
        self.join_reach_ms = float(join_reach_ms)
        if collect_rule not in ("quorum", "grace"):
            raise LocalProtocolError(f"collect_rule must be 'quorum' or 'grace', got {collect_rule!r}")
        if not 0 <= grace_fraction <= 1:
            raise LocalProtocolError(f"grace_fraction must be in [0, 1], got {grace_fraction!r}")
        if not 0 <= grace_margin <= 100:
            raise LocalProtocolError(f"grace_margin must be in [0, 100], got {grace_margin!r}")
        if step_limit is not None and (isinstance(step_limit, bool) or not isinstance(step_limit, int)
                                       or step_limit < 1):
            raise LocalProtocolError(f"step_limit must be an integer >= 1 or None, got {step_limit!r}")
        if aggregate not in AGGREGATES:
            raise LocalProtocolError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
        if isinstance(lr_max, bool) or not isinstance(lr_max, (int, float)) or not lr_max > 0 \
                or not math.isfinite(lr_max):
            raise LocalProtocolError(f"lr_max must be a positive finite number, got {lr_max!r}")
        self.step_limit = step_limit
        # "Local steps and optimizer state": the room's setting, and the leader's optimizer
        # state, which travels with every round (one source of truth, like the parameters)
        self.train = train if train is not None else TrainConfig()
        self.state_len = self.train.state_len(worker.bucket_len)
        if opt_state is not None and len(opt_state) not in (0, self.state_len):
            raise LocalProtocolError(f"opt_state has length {len(opt_state)}, expected {self.state_len}")
        if opt_state is not None and not all_finite(opt_state):
            raise LocalProtocolError("opt_state is not all finite")
        self.opt_state: Any = to_vector(opt_state) if opt_state is not None and len(opt_state) else None
        # with local steps a round comes once per H inner steps: the observed time per round
        # (an EWMA over adopted rounds) extends the takeover window ("Local steps")
        self.round_period_ms: float | None = None
        self._last_adopted: tuple[float, int] | None = None
        self.contribution_ms: float | None = None     # how long this rank's last bucket took
        self._inflight_since_ms = 0.0
        # "Untrusted ranks": who may lead (bound to each link by the server), the bound on a
        # round's learning rate, and how the leader aggregates buckets
        self.may_lead = bool(may_lead)
        self.lead_roles: dict[int, bool] = {}
        self.roles_enforced = False
        self.lr_max = float(lr_max)
        self.aggregate = aggregate
        #: the round's mean as its buckets arrive (weights = samples / the planned global batch)
        self._running_mean = RunningMean()
        #: the job's evaluate() raised in this many evaluations in a row (0 after one that did not)
        self.evaluate_failures = 0
        self._evaluate_error: Exception | None = None
        self.clipped: Counter[int] = Counter()             # rank -> buckets clipped
        self._clip_recent: dict[int, deque[bool]] = {}
        self._bias = BiasMonitor()                          # "Untrusted ranks": steady pushes
        self.quarantined: dict[int, float] = {}            # rank -> quarantined until (ms)
        self._left: dict[int, None] = {}                   # ranks the witness said left (ordered set)
        self._quarantines: Counter[int] = Counter()
        self._silent: set[int] = set()       # gave no bucket within a whole collect window
        #: members this rank's own link layer cannot reach (:meth:`unreachable`): out of view
        #: until heard from again
        self._unreachable: set[int] = set()
        self._silences: Counter[int] = Counter()
        # a held-back rank (silent or on probation) -> the (term, step) of its last bucket that
        # counted as in time; a rank on probation -> the rounds that finished without its bucket,
        # oldest first, with when each was sent (its answer may still come: "In time, for a rank
        # held back"), and the run it owes when a miss restarts its count
        self._credited: dict[int, tuple[int, int]] = {}
        self._missed: dict[int, deque[tuple[tuple[int, int], float]]] = {}
        self._probation_run: dict[int, int] = {}
        # "Shares", minor stragglers: id -> when a run of rounds finished without its bucket began
        self._minor_since: dict[int, float] = {}
        self._passed_over: dict[int, float] = {}   # takeover candidate -> since when it is owed a round
        self._skipped_leads: set[int] = set()      # candidates that never drove: not deferred to
        self.collect_rule = collect_rule
        self.grace_fraction = float(grace_fraction)
        self.grace_margin = float(grace_margin)
        # The typical arrival spread (grace rule): EWMA over rounds of first-to-last arrival.
        self.spread_ewma_ms: float | None = None
        self._spread_pending: _Spread | None = None   # last round, until its sample is taken
        self.missed_rounds: dict[int, int] = {}        # rank -> rounds in a row without its bucket
        self.id = rank_id
        self.worker = worker
        self.link = link
        self.job = job
        self.timing = timing
        self.lr = float(lr)
        self.eval_every = int(eval_every)
        #: the (term, step) whose parameters were last evaluated (:meth:`evaluate_now`,
        #: :attr:`accuracy_now`); None once other parameters were adopted
        self._evaluated_step: tuple[int, int] | None = None
        self.precision = precision

        self.ready = bool(ready)
        self.running = False
        self.disposed = False
        self.step = start_step
        self.loss = math.nan          # last reduced loss (leader) or the leader's (follower)
        self.samples = 0              # samples in the last reduce
        #: ranks in the cohort of the last round with shares this rank sent or adopted while
        #: running (the round's ``cohort``, PROTOCOL.md "Messages"); 0 before any. Kept once stopped, so a stop line
        #: can say the cohort the rank trained in (a follower's own roster may not yet hold a
        #: leader whose first beat it has not heard)
        self.round_cohort = 0
        self.accuracy: float | None = None
        self.fault: str | None = None
        self.drops: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()

        self.roster = Roster()
        self.policy: Policy = policy(1, timing)
        self.following: int | None = None   # the leader whose rounds this rank follows (self when leading)
        # Lineage and terms: the term of the lineage this rank's parameters belong to, and
        # whether this rank holds the lead of it (acquired by bootstrap or takeover only).
        if isinstance(term, bool) or not isinstance(term, int) or term < 0:
            raise LocalProtocolError(f"term must be a non-negative integer, got {term!r}")
        self.term = term
        self._leading = False
        # Membership and majority: id -> last time seen ready and running; a member leaves it
        # when it says it stopped, when the room's witness says its link closed, or after
        # policy.forget without a word.
        self.membership: dict[int, float] = {}
        # Flapping ranks: evictions per rank, and the in-time buckets a returning rank owes
        # before it is awaited again.
        self.flaps: Counter[int] = Counter()
        self._probation: dict[int, int] = {}
        if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                         or global_batch < 1):
            raise LocalProtocolError(f"global_batch must be an integer >= 1 or None, got {global_batch!r}")
        self.global_batch = global_batch
        self.speeds = SpeedTable()          # the leader's throughput estimates ("Shares")
        #: samples of each rank's buckets that entered a reduce this rank applied ("Shares")
        self.applied_by: dict[int, int] = {}
        #: per rank, how long the rounds this rank drove waited for that rank's bucket after every
        #: other awaited bucket had arrived, ms in total ("Shares": who holds the rounds)
        self.held_ms: dict[int, float] = {}
        self.cursor = start_cursor          # samples assigned before the next round sent or adopted
        # the cursor of the round at ``self.step`` while it is in flight (cursor has moved past it)
        self._step_cursor, self._cursor_step = start_cursor, start_step
        self.shares: dict[int, int] = {}    # the last round's shares (driven or adopted)
        # the last round this rank drove as a broadcast: when, in which term ("Shares")
        self._broadcast_ms = -math.inf
        self._broadcast_term = -1
        self._probe_ms = -math.inf          # when this rank last probed ranks with no share
        # the last plan of shares: (what it was planned for, when, shares, probing) ("Shares")
        self._plan: tuple[tuple, float, dict[int, int], bool] | None = None
        # the last rounds this rank drove: (term, step) -> (sent at, shares), for turnaround
        self._sent_rounds: dict[tuple[int, int], tuple[float, dict[int, int]]] = {}
        # when this rank's own bucket of each of those rounds was handled ("Shares": a bucket
        # that queued behind the leader's own compute)
        self._own_bucket_ms: dict[tuple[int, int], float] = {}
        # the turnaround of this rank's last own bucket when its compute held the loop (None:
        # it did not): such a leader plans its own bucket to be ready first ("Shares")
        self._own_held_turnaround_ms: float | None = None
        # each rank's last probe shares, oldest first: rank -> [(term, step, sent at, samples)],
        # at most _PROBES_KEPT. A probe is answered many rounds later in a fast cohort, long
        # after its round left _sent_rounds ("Shares")
        self._probe_sent: dict[int, list[tuple[int, int, float, int]]] = {}
        self._probes_outstanding: dict[int, int] = {}   # probes sent since the rank's last answer
        self._held_probe_ms: dict[int, float] = {}      # last probe to a held-back rank
        #: _paced_ms by (base, policy.takeover_ms): asked for in every round
        self._paced: dict[tuple[float, float], float] = {}
        self.diverged = 0                   # rounds refused: an update that overflowed, or no
                                            # bucket left but a non-finite own one (step 5)
        self._round_params: Any = None      # the parameters of the round being driven
        self._own_non_finite = False        # this round's own bucket was not finite (step 5)
        self.last_open_ms = now_ms
        self.defer_until_ms = -math.inf
        self._last_input_ms = now_ms

        # Joining ("Joining")
        self.joining = False
        self._join_attempts = 0
        self._next_join_ms: float | None = None
        self._join_started_ms = -math.inf
        # "Joining": peers the server says are connected and may lead (its welcome and ``peer``
        # controls), until their links close
        self._witnessed_leads: set[int] = set()
        # "Suspension": a rank back from a suspension bootstraps no lineage before this time
        self._bootstrap_not_before_ms = -math.inf
        # "Joining": the server's roll call is partial (a restarted server's welcome) until its
        # ``roll_call`` or this time: no bootstrap before it
        self._roll_call_partial_until_ms = -math.inf
        # "Membership and majority", the witness: when the server said the leader this rank
        # followed left (None once ``policy.drop`` has passed since, or before any)
        self._lead_left_ms: float | None = None
        # "Heartbeat and takeover": when the rank this one follows was last heard (any message)
        self._leader_heard_ms: float | None = None

        # Heartbeat ("Heartbeat and takeover")
        self._next_beat_ms = now_ms + self.policy.beat_ms

        # Leader loop ("The leader loop"): phase is None when no loop runs, else a Phase
        self._phase: Phase | None = None
        self._phase_deadline_ms: float | None = None
        self._pace_tries = 0
        self._pace_since_ms: float | None = None   # when this pacing began
        self._collection: _Collection | None = None
        self._round_step = 0
        self._own_token: int | None = None
        self._own_bucket: tuple[float, int, Any] | None = None
        self._stopping_publish = False
        # "Publish": the final (term, step) this rank published and, per member it re-sent the
        # publish to, (sends so far, when it last sent it)
        self._final: tuple[int, int, float] | None = None
        self._republished: dict[int, tuple[int, float]] = {}

        # Contribute ("Follower": at most one bucket in flight per rank)
        self._tokens = 0
        self._adopt_seq = 0
        self._inflight: tuple[int, int, int, int] | None = None  # token, adopt_seq, step, to
        self._pending: tuple[int, int, int, int] | None = None   # adopt_seq, step, offset, to

        self._rates: deque[tuple[float, int, int, int]] = deque()
        self._applied_steps = 0
        self._applied_samples = 0
        self._actions: list[Action] = []
        self._foreign: set[int] = set()   # peers whose hello named another version or job
        self._announce()

    # ------------------------------------------------------------------ queries
    def drain(self) -> list[Action]:
        """Return and clear the actions emitted since the last call, in order."""
        out, self._actions = self._actions, []
        return out

    def next_deadline_ms(self) -> float | None:
        """The earliest time at which :meth:`on_timer` must be called, or None (disposed)."""
        if self.disposed:
            return None
        ds = [self._next_beat_ms]
        if self.joining and self._next_join_ms is not None:
            ds.append(self._next_join_ms)
        if self._phase_deadline_ms is not None:
            ds.append(self._phase_deadline_ms)
        return min(ds)

    def live_ids(self, now_ms: float) -> list[int]:
        """Ids of members seen within ``policy.drop`` ("Membership": live)."""
        return sorted(m.id for m in self.roster.live(now_ms, self.policy.drop_ms))

    def cohort_ids(self, now_ms: float) -> list[int]:
        """Self (if running and ready) plus live members that are ready and running, ascending."""
        ids = [m.id for m in self.roster.live(now_ms, self.policy.drop_ms) if m.ready and m.running]
        if self.running and self.ready:
            ids.append(self.id)
        return sorted(ids)

    def leader_id(self, now_ms: float) -> int | None:
        """The rank whose lead this rank is in: itself while it holds the lead, else the sender
        of the rounds it follows (None before any) (PROTOCOL.md, "Lineage and terms")."""
        if self._leading and self.running and self.ready:
            return self.id
        return self.following

    def is_leader(self, now_ms: float) -> bool:
        """Running, ready and holding the lead (acquired by bootstrap or takeover, kept until
        a round of a winning lineage arrives, PROTOCOL.md "Lineage and terms")."""
        return self.running and self.ready and not self.disposed and self._leading

    def members(self, now_ms: float) -> set[int]:
        """The membership a majority is taken of: self (when ready and running) and every rank
        seen ready and running within ``policy.forget`` that has not left
        (PROTOCOL.md, "Membership and majority")."""
        out = set(self.membership)
        if self.ready and self.running:
            out.add(self.id)
        return out

    def has_majority(self, now_ms: float, *, heard_since_ms: float | None = None) -> bool:
        """True when this rank, with the live running members, makes more than half of
        :meth:`members`, or exactly half including the lowest member id (the tie-break that
        lets exactly one side of an even split go on; PROTOCOL.md, "Membership and majority").
        A member counts whether or not it is ready (one back from a suspension is on this side
        of any split). ``heard_since_ms``: count only members heard after it (a takeover's
        view, :meth:`_takeover_heard_since`). A member this rank's link layer reported
        :meth:`unreachable` is out of view until heard from again."""
        # counted without building sets: the leader asks this once or twice per round
        drop_ms, roster = self.policy.drop_ms, self.roster.members
        since = -math.inf if heard_since_ms is None else heard_since_ms
        n_members, n_visible, lowest, lowest_visible = 1, 1, self.id, True
        for k in self.membership:
            if k == self.id:
                continue
            n_members += 1
            m = roster.get(k)
            seen = bool(m is not None and m.running and now_ms - m.seen_ms <= drop_ms and m.seen_ms > since
                        and k not in self._unreachable)
            n_visible += seen
            if k < lowest:
                lowest, lowest_visible = k, seen
        return 2 * n_visible > n_members or (2 * n_visible == n_members and lowest_visible)

    @property
    def at_step_limit(self) -> bool:
        """True when the job has a step limit and this rank's step reached it
        (docs/PROTOCOL-NOTES.md, note 13)."""
        return self.step_limit is not None and self.step >= self.step_limit

    @property
    def looping(self) -> bool:
        """True while the leader loop runs (never two at once)."""
        return self._phase is not None

    # ------------------------------------------------------------------ inputs
    def start(self, lr: float | None = None, *, now_ms: float) -> None:
        """Control ``start(lr?)``: running; announce; join if not ready, else lead if leader."""
        if self._input(now_ms):
            return
        if lr is not None:
            self.set_lr(lr, now_ms=now_ms)
        self.running = True
        self.last_open_ms = now_ms
        self._announce()
        if not self.ready:
            self._begin_join(now_ms)
        elif self._leading:
            self._maybe_start_loop(now_ms)
        elif self.following is None and self._may_take_lead(now_ms):
            # ready from the start (a checkpoint) and no lead known: lead as a bootstrap would
            self._take_lead(now_ms)
        self._report(now_ms)

    def stop(self, *, now_ms: float) -> None:
        """Control ``stop()``: a leader that is ready and idle publishes now; a busy loop
        publishes when it drains. Then beat and report ("Controls")."""
        if self._input(now_ms):
            return
        was_leader = self.is_leader(now_ms) or self.looping
        self.running = False
        self.joining = False
        self._leading = False
        if was_leader and self.ready:
            if self._phase in (Phase.OWN, Phase.COLLECT):
                self._stopping_publish = True      # the loop publishes when it drains
            else:
                self._end_loop()
                self._publish(now_ms)
        self._beat(now_ms)
        self._report(now_ms)

    def set_lr(self, lr: float, *, now_ms: float | None = None) -> None:
        """Control ``set_lr(lr)``.

        Raises:
            LocalProtocolError: lr is not a finite number in ``[0, lr_max]`` (followers drop a
                round above ``lr_max``: PROTOCOL.md, "Untrusted ranks").
        """
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise LocalProtocolError(f"learning rate must be finite and >= 0, got {lr!r}")
        if lr > self.lr_max:
            raise LocalProtocolError(f"learning rate {lr:g} is above the room's lr_max {self.lr_max:g}")
        self.lr = float(lr)

    def dispose(self, *, now_ms: float) -> None:
        """Control ``dispose()``: stop timers, release collection state; no handling after."""
        self._end_loop()
        self.disposed = True
        self.running = False
        self.joining = False
        self._actions.clear()

    def peer_role(self, peer_id: int, may_lead: bool) -> None:
        """The room's server says whether ``peer_id`` may lead (it holds the trainer credential)
        (PROTOCOL.md, "Untrusted ranks"). Once the server has named any role, a rank it has
        not named may not lead."""
        if isinstance(peer_id, bool) or not isinstance(peer_id, int) or not 0 <= peer_id <= _U32:
            return
        self.roles_enforced = True
        self.lead_roles[peer_id] = bool(may_lead)
        if may_lead and peer_id != self.id:
            self._witnessed_leads.add(peer_id)
        else:
            self._witnessed_leads.discard(peer_id)

    def set_roles(self, *, may_lead: bool, enforced: bool = True) -> None:
        """This rank's own role, from the server's welcome (PROTOCOL.md, "Untrusted ranks")."""
        self.may_lead = bool(may_lead)
        self.roles_enforced = self.roles_enforced or bool(enforced)

    def may_lead_rank(self, rank_id: int) -> bool:
        """Whether ``rank_id`` may lead, as far as this rank knows from the server."""
        if rank_id == self.id:
            return self.may_lead
        return self.lead_roles.get(rank_id, not self.roles_enforced)

    def _shown_speed(self, k: int) -> bool:
        """Whether the state report shows rank ``k``'s speed: not once the room's witness said
        it left (:meth:`peer_left`), unless it is a member again or holds a share of the last
        plan. A rank that merely went quiet stays shown (a finished run's summary names every
        rank that computed)."""
        return k not in self._left or k in self.membership or k in self.shares

    def peer_left(self, rank_id: int, *, now_ms: float) -> None:
        """The room's witness (the server, which sees every rank's link) says ``rank_id``'s link
        closed: it has left, not become unreachable. It leaves the membership and the roster at
        once; if it was the leader, the takeover need not wait out ``policy.takeover``; if a
        round in flight awaits its bucket, it is no longer awaited (the quorum shrinks with the
        awaited set) (PROTOCOL.md, "Membership and majority")."""
        if self._input(now_ms):
            return
        if isinstance(rank_id, bool) or not isinstance(rank_id, int) or rank_id == self.id:
            return
        self.counters["peer_left"] += 1
        self._left[rank_id] = None
        if len(self._left) > _LEFT_KEPT:          # (bounded: the oldest departures are forgotten)
            del self._left[next(iter(self._left))]
        self._witnessed_leads.discard(rank_id)
        self.membership.pop(rank_id, None)
        self.roster.members.pop(rank_id, None)
        self._end_probation(rank_id)
        self._silent.discard(rank_id)
        self._unreachable.discard(rank_id)
        self._credited.pop(rank_id, None)
        self._minor_since.pop(rank_id, None)
        self._bias.forget(rank_id)
        self._clip_recent.pop(rank_id, None)
        if self.following == rank_id and not self._leading:
            # the whole window (its stretches too): the witness says the leader is gone, so no
            # paced round of a large model is on its way ("Heartbeat and takeover")
            # (and a millisecond more: a survivor's beat can arrive at this very instant)
            self.last_open_ms = min(self.last_open_ms, now_ms - self._takeover_window_ms(now_ms) - 1.0)
            self._lead_left_ms = now_ms
            # beat at once: a takeover counts only members heard since, and the others' next
            # periodic beats are up to a beat away (100 s at n = 1,000)
            self._beat(now_ms)
        col = self._collection
        if col is not None and rank_id in col.wanted and rank_id not in col.received:
            # a round in flight no longer waits for a rank that left: without this every kill
            # of a follower costs the cohort the whole collect window
            col.wanted.discard(rank_id)
            col.awaited.discard(rank_id)
            col.quorum = max(1, min(col.quorum, len(col.awaited)))
            self.counters["released_left"] += 1
            self._collected(col, now_ms)

    def roll_call(self, connected: Iterable[int], *, now_ms: float) -> None:
        """The witness's roll call: a ``welcome`` from the server lists every other rank whose
        link to the room is open (``peers``). A member it does not list has no link: it left
        while this rank was away, and is treated as :meth:`peer_left` (the ``up: false`` this
        rank missed). Why: a rank that reconnected, or moved to the server node that took the
        room over, never hears of the ranks that left meanwhile; their ids stayed members for
        ``policy.forget`` (60 s) and, when lower, took its majority, so a tab that moved with
        it waited a minute to train (PROTOCOL.md, "Membership and majority")."""
        if self._input(now_ms):
            return
        listed = {k for k in connected if isinstance(k, int) and not isinstance(k, bool)}
        self._witnessed_leads &= listed          # ("Joining": one not listed has no link)
        self._roll_call_partial_until_ms = -math.inf   # ("Joining": the whole roll call is in)
        for k in sorted(self.membership):
            if k != self.id and k not in listed:
                self.counters["left_by_roll_call"] += 1
                self.peer_left(k, now_ms=now_ms)

    def unreachable(self, rank_ids: Iterable[int], *, now_ms: float) -> None:
        """This rank's own link layer has no path to ``rank_ids`` any more (its link to the room
        closed and no direct path to them is open): they stay members, but are out of view at
        once for the majority (:meth:`has_majority`) until a message from one is heard again,
        not only after ``policy.drop`` without their beats. Why: a leader whose only link, the
        room's relay, closed went on committing rounds no other rank received until their
        beats were ``policy.drop`` (1.6 s) old (about 5,400 in a measured run of three ranks
        whose server was killed): a lineage of its own, thrown away once another rank took
        over (PROTOCOL.md, "Membership and majority"). A round in flight that awaits their
        buckets commits nothing at its end (``round_no_majority``), and the lead pauses
        (``paused_no_majority``)."""
        if self._input(now_ms):
            return
        ids = {k for k in rank_ids if isinstance(k, int) and not isinstance(k, bool) and k != self.id}
        ids &= set(self.membership)
        if ids:
            self.counters["unreachable"] += len(ids)
            self._unreachable |= ids

    def roll_call_partial(self, *, now_ms: float) -> None:
        """The server says its roll call is partial (a restarted server's ``welcome``,
        ``partial: true``): ranks it does not list may be on their way back. Until its whole roll
        call (:meth:`roll_call`), for at most :data:`ROLL_CALL_WAIT_MS`, this rank bootstraps no
        lineage (PROTOCOL.md, "Joining"). Why: a rank that joined a restarted server before the
        room's leader was back heard nobody, held a membership of itself alone and bootstrapped a
        term above its checkpoint's; the server took it for the leader and refused the real
        leader's checkpoint (a fault campaign over the WebSocket star)."""
        if self._input(now_ms):
            return
        self._roll_call_partial_until_ms = max(self._roll_call_partial_until_ms, now_ms + ROLL_CALL_WAIT_MS)

    def handle(self, msg: Any, *, now_ms: float) -> None:
        """Feed one decoded peer message. Never raises for bad peer input."""
        if self._input(now_ms):
            return
        reason = self._check(msg)
        if reason is not None:
            self.drops[reason] += 1
            return
        t = msg["t"]
        sender = msg["from"]
        if t == "hello":
            if msg["version"] != PROTOCOL_VERSION or msg["job"] != self.job:
                self._foreign_add(sender)
                self.drops["foreign_job" if msg["version"] == PROTOCOL_VERSION else "bad_version"] += 1
                return
            self._foreign.discard(sender)
        elif sender in self._foreign:
            self.drops["foreign"] += 1
            return
        if t == "round" and len(msg["params"]) != self.worker.bucket_len:
            self.drops["round_bad_length"] += 1
            return
        if t == "round" and _opt_len(msg) not in (0, self.state_len):
            self.drops["round_bad_state_length"] += 1   # the room's optimizer state, or none
            return
        if t == "grad" and len(msg["g"]) != self.worker.bucket_len:
            self.drops["grad_bad_length"] += 1
            return
        self._unreachable.discard(sender)              # heard from: in view again
        returning = sender not in self.roster.members and self.flaps.get(sender, 0) > 0
        m = self.roster.refresh(msg, now_ms, self.policy.drop_ms)
        if m.term > self.term and not self.may_lead_rank(sender):
            # "Untrusted ranks": only a rank that may lead starts a term; a higher term from
            # any other is a false claim (it must not push the next takeover's term up)
            self.drops["term_claim_not_trainer"] += 1
            m.term = self.term
        if returning:
            # an evicted rank comes back: awaited again only once it keeps up ("Flapping ranks")
            self._start_probation(sender, min(_PROBATION_MAX, _PROBATION_BUCKETS * self.flaps[sender]))
        if m.ready and m.running:
            self.membership[sender] = now_ms
        elif not m.running and t in ("hello", "beat"):
            self.membership.pop(sender, None)          # it stopped: it left
        if t == "hello":
            # so the newcomer learns the roster: addressed to it, as only it needs the answer
            # ("Follower: receiving messages", hello)
            self._beat(now_ms, to=sender)
        elif t == "round":
            self._on_round(msg, now_ms)
        elif t == "grad":
            self._on_grad(msg, now_ms)
        if sender == self.following and not self._leading:
            self._leader_heard_ms = now_ms
        if self._lead_left_ms is not None and t == "beat" and self._try_takeover(now_ms):
            # the witness said the leader left and the survivors beat at once: take over when
            # their beats make the majority, not at this rank's next heartbeat ("Membership and majority")
            self._report(now_ms)

    def on_timer(self, *, now_ms: float) -> None:
        """A deadline passed (or the driver yielded between rounds): run what is due."""
        if self._input(now_ms):
            return
        if now_ms >= self._next_beat_ms:
            self._heartbeat(now_ms)
        if self.joining and self._next_join_ms is not None and now_ms >= self._next_join_ms:
            self._join_tick(now_ms)
        if self._phase_deadline_ms is not None and now_ms >= self._phase_deadline_ms:
            self._phase_deadline_ms = None
            if self._phase is Phase.COLLECT:
                self._finish_round(now_ms)
            elif self._phase in (Phase.PACE, Phase.YIELD, Phase.FAULT):
                if self._phase is not Phase.PACE:
                    self._pace_tries = 0
                    self._pace_since_ms = None
                self._phase = Phase.PACE
                self._loop_step(now_ms)

    def bucket_ready(self, token: int, loss: float, g: Any, *, now_ms: float,
                     samples: int | None = None, held_ms: float = 0.0) -> None:
        """A requested :class:`Compute` finished.

        Args:
            token: the token of the Compute action.
            loss: mean loss over the bucket's samples.
            g: float32 vector, shape (bucket_len,): the mean gradient.
            samples: samples in the bucket (default: the share the Compute asked for).
            held_ms: how long, up to now, the compute ran without yielding (a synchronous job
                in an event loop's turn), ms: this rank handled no input meanwhile, so a
                leader's peers' buckets handled right after its own may have waited behind it
                (PROTOCOL.md, "Shares"). 0: the rank kept handling inputs while it computed.
        """
        if self._input(now_ms):
            return
        if token == self._own_token:
            self._own_token = None
            share = self.train.local_steps * self.shares.get(self.id, self.worker.batch)
            self._on_own_bucket(float(loss), share if samples is None else int(samples), g, now_ms,
                                held_ms=held_ms)
        elif self._inflight is not None and token == self._inflight[0]:
            _, seq, step, to, term, share = self._inflight
            samples = share if samples is None else int(samples)
            self._inflight = None
            self.contribution_ms = now_ms - self._inflight_since_ms
            if seq != self._adopt_seq and self._pending is not None:
                self.counters["stale_bucket"] += 1      # a newer round gave this rank a share
            elif not all_finite(g) or not math.isfinite(loss) or len(g) != self.worker.bucket_len:
                self.drops["own_bucket_invalid"] += 1  # never send what the leader must drop
            else:
                if seq != self._adopt_seq:
                    # superseded by rounds with no share for this rank: too late to count, sent
                    # for the leader's turnaround model ("Contribute"; "Shares", probes)
                    self.counters["stale_bucket_sent"] += 1
                self._actions.append(Post({"t": "grad", "from": self.id, "to": to, "step": step,
                                           "term": term, "loss": float(loss), "samples": samples,
                                           "g": g}))
            self._start_pending_contribution()
        else:
            self.counters["unknown_token"] += 1

    def compute_current(self, token: int) -> bool:
        """True while the Compute ``token`` can still count or be measured: the leader's own
        bucket of the round it drives, or a follower's bucket until a newer adopted round gives
        the rank a share of its own (rounds without one leave it to finish: it is sent, and the
        leader measures the rank by it). A driver running H inner steps checks it between steps
        and abandons superseded work (:meth:`bucket_abandoned`; PROTOCOL.md, "Local steps and
        optimizer state")."""
        if token == self._own_token:
            return True
        inflight = self._inflight
        return (inflight is not None and token == inflight[0]
                and (inflight[1] == self._adopt_seq or self._pending is None))

    def bucket_abandoned(self, token: int, *, now_ms: float) -> None:
        """The driver gave up the Compute ``token`` because it no longer counts (a newer round
        was adopted, or the lead was lost): nothing is sent; the next contribution starts."""
        if self._input(now_ms):
            return
        self.counters["stale_bucket"] += 1
        self.counters["abandoned_bucket"] += 1
        if self._inflight is not None and token == self._inflight[0]:
            self._inflight = None
            self._start_pending_contribution()

    def runtime_fault(self, error: str, *, now_ms: float) -> None:
        """A fault outside the machine (a task of its driver died): ``fault`` in the state report."""
        if self._input(now_ms):
            return
        self.fault = str(error)
        self._report(now_ms)

    def set_precision(self, precision: str, *, now_ms: float) -> None:
        """The wire precision this rank now sends at (the bus already switched), for the state report."""
        if self._input(now_ms):
            return
        self.precision = str(precision)

    @property
    def applied_samples(self) -> int:
        """Samples of every reduce this rank applied (its own rounds and adopted ones)."""
        return self._applied_samples

    def take_evaluate_error(self) -> Exception | None:
        """The exception the worker's ``evaluate()`` last raised, once (then None): the runtime
        says where in the job it came from (:attr:`evaluate_failures` counts them in a row)."""
        exc, self._evaluate_error = self._evaluate_error, None
        return exc

    def bucket_failed(self, token: int, error: str, *, now_ms: float) -> None:
        """A requested :class:`Compute` raised; ``error`` becomes ``fault`` in the report."""
        if self._input(now_ms):
            return
        self.fault = error
        if token == self._own_token:
            self._own_token = None
            self._round_fault(error, now_ms)
        elif self._inflight is not None and token == self._inflight[0]:
            self._inflight = None
            self._start_pending_contribution()
        self._report(now_ms)

    def leader_heard(self, now_ms: float) -> bool:
        """Whether the leader this rank follows is still heard: this rank leads, or the rank it
        follows is live (seen within ``policy.drop_ms``: PROTOCOL.md, "live")."""
        if self.is_leader(now_ms) or self.looping:
            return True
        return self.following is not None and any(m.id == self.following
                                                  for m in self.roster.live(now_ms, self.policy.drop_ms))

    # ------------------------------------------------------------------ state report
    def state(self, now_ms: float) -> dict:
        """The state report (PROTOCOL.md, "State report"); rates over about 2 s."""
        # a pure query: the rate window is sampled by the heartbeat (_sample_rates), never here
        total_bytes = int(self.link.total_bytes())
        t0, s0, n0, b0 = self._rates[0] if self._rates else (now_ms, self._applied_steps,
                                                               self._applied_samples, total_bytes)
        dt = (now_ms - t0) / 1000.0
        rate = (lambda a, b: (a - b) / dt) if dt > 0 else (lambda a, b: 0.0)
        pol = self.policy
        live = {m.id: m for m in self.roster.live(now_ms, pol.drop_ms)}
        leading = self.is_leader(now_ms) or self.looping
        shown = [(k, sp) for k, sp in self.speeds.speeds.items() if self._shown_speed(k)]
        kept = set(live) | {self.id} | set(self.shares)     # (what a bounded record keeps first)
        return {
            "id": self.id, "id_hex": f"{self.id:08x}", "leader": self.leader_id(now_ms),
            # whether that leader is still heard (a rank whose leader died kept naming it, and a
            # tab said "follower" with its step frozen: a new-user trial)
            "leader_live": self.leader_heard(now_ms),
            "is_leader": leading,
            "ready": self.ready, "running": self.running, "joining": self.joining,
            "step": self.step, "cohort": len(self.cohort_ids(now_ms)),
            "loss": self.loss, "accuracy": self.accuracy,
            "steps_per_s": rate(self._applied_steps, s0), "samples_per_s": rate(self._applied_samples, n0),
            # (never negative: a bus whose counters went back, a link's bytes gone with it)
            "wire_bytes_per_s": max(0.0, rate(total_bytes, b0)),
            "peers": [{"id": k, "backend": m.backend} for k, m in sorted(live.items())],
            "bucket_len": self.worker.bucket_len, "batch": self.worker.batch,
            "model": self.worker.model, "backend": self.worker.backend, "precision": self.precision,
            # (bounded: a report whose fault is longer than the server's 256 characters is
            # dropped whole, and a job's exception message can be any length)
            "lr": self.lr, "fault": None if self.fault is None else self.fault[:FAULT_MAX_CHARS], "term": self.term,
            "members": len(self.members(now_ms)), "majority": self.has_majority(now_ms),
            "flaps": _per_rank(self.flaps, kept),
            "probation": sorted(f"{k:08x}" for k in self._probation), "diverged": self.diverged,
            "global_batch": self.global_batch, "samples_assigned": self.cursor, "epoch": self._epoch(),
            "shares": {f"{k:08x}": v for k, v in sorted(self.shares.items())},
            # (of this rank, its members and the last plan's ranks: the estimates of ranks that
            # left are kept for a rejoin, and were shown as if they still computed: a new-user trial)
            "speeds": _per_rank({k: round(sp.samples_per_s * self.train.local_steps, 1) for k, sp in shown},
                                kept),
            "lateness_ms": _per_rank({k: round(sp.lateness_ms(), 2) for k, sp in shown}, kept),
            "held_ms": {k: round(v, 1) for k, v in _per_rank(self.held_ms, kept).items()},
            "local_steps": self.train.local_steps, "outer_optimizer": self.train.outer_optimizer,
            "applied": _per_rank(self.applied_by, kept),
            "may_lead": self.may_lead, "aggregate": self.aggregate,
            "clipped": _per_rank(self.clipped, kept),
            "quarantined": {f"{k:08x}": round(max(0.0, t - now_ms) / 1000.0, 1)
                            for k, t in sorted(self.quarantined.items())},
            "silent": sorted(f"{k:08x}" for k in self._silent),
            "policy": {"n": pol.n, "quorum": pol.quorum, "beat_ms": pol.beat_ms, "collect_rule": self.collect_rule},
            "drops": dict(self.drops), "counters": dict(self.counters),
        }

    # ------------------------------------------------------------------ internals
    def _train_len(self) -> int | None:
        """The worker's training-set size, when it says."""
        n = getattr(self.worker, "train_len", None)
        if n is None:
            n = getattr(getattr(self.worker, "dataset", None), "train_len", None)
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    @property
    def accuracy_now(self) -> float | None:
        """:attr:`accuracy` when it was evaluated on the parameters held now (this term's
        :attr:`step`), else None: the held-out accuracy a checkpoint of these parameters may
        carry. :attr:`accuracy` itself is the last evaluation's, up to ``eval_every - 1`` steps
        old, and a checkpoint labelled with it was ranked "best" by another model's accuracy
        (README "Checkpoints and stopping")."""
        return self.accuracy if self._evaluated_step == (self.term, self.step) else None

    @property
    def checkpoint_cursor(self) -> int:
        """The samples assigned before the round at :attr:`step` (a checkpoint's cursor, with
        that step and the parameters before that round): while the round at ``step`` is in
        flight, ``cursor`` has already moved past its windows, and a cohort resumed with it
        would skip them ("Resuming from a checkpoint")."""
        return self._step_cursor if self.step < self._cursor_step else self.cursor

    def _epoch(self) -> float | None:
        """Epochs covered by the samples assigned so far, when the worker knows its training set."""
        n = self._train_len()
        return round(self.cursor / n, 3) if n is not None else None

    def _foreign_add(self, sender: int) -> None:
        self._foreign.add(sender)
        self.roster.members.pop(sender, None)

    def _input(self, now_ms: float) -> bool:
        """Common prologue of every input: returns True when the machine is disposed.
        Applies the suspension rule ("Suspension")."""
        if self.disposed:
            return True
        gap = now_ms - self._last_input_ms
        self._last_input_ms = max(self._last_input_ms, now_ms)
        if gap > self.policy.drop_ms and (self.ready or self.looping):
            self._suspend(now_ms)
        return False

    def _suspend(self, now_ms: float) -> None:
        """Treat self as having left: clear ready, release collection, stop leading, rejoin."""
        self.counters["suspended"] += 1
        self.ready = False
        self._end_loop()
        self._leading = False
        self.following = None
        self._pending = None
        self._adopt_seq += 1          # any bucket in flight is now stale
        self.roster.prune(now_ms, self.policy.drop_ms)
        # its view of the room is as old as the suspension: it hears the room for policy.drop
        # (several beats of any survivor) before it may bootstrap, lest it start the term a
        # survivor's takeover started and win the tie by its lower id ("Suspension")
        self._bootstrap_not_before_ms = now_ms + self.policy.drop_ms
        if self.running:
            self._begin_join(now_ms)
        self._announce()

    def _check(self, msg: Any) -> str | None:
        """Structural validation; returns a drop reason or None."""
        if not isinstance(msg, dict):
            return "malformed"
        t = msg.get("t")
        schema = _SCHEMA.get(t) if isinstance(t, str) else None
        if schema is None:
            return "unknown_type"
        sender = msg.get("from")
        if isinstance(sender, bool) or not isinstance(sender, int) or not 0 <= sender <= _U32:
            return "malformed"
        to = msg.get("to")
        if to is not None and to != self.id:
            return "not_for_me"
        if sender == self.id:
            return "from_self"
        for key, typ in schema:
            if key not in msg:
                return "malformed"
            v = msg[key]
            if typ is object:          # params, g: a decoded float vector, nothing else
                if not is_vector(v):
                    return "malformed"
                continue
            if isinstance(v, bool) and typ is not bool:
                return "malformed"
            if not isinstance(v, typ):
                return "malformed"
            if typ is _NUMBER and isinstance(v, int) and not -_FLOAT_MAX_INT <= v <= _FLOAT_MAX_INT:
                return "malformed"     # (math.isfinite of it would raise OverflowError)
        return None

    def _announce(self) -> None:
        self._actions.append(Post({
            "t": "hello", "from": self.id, "version": PROTOCOL_VERSION, "job": self.job,
            "batch": self.worker.batch, "ready": self.ready, "running": self.running,
            "step": self.step, "model": self.worker.model, "backend": self.worker.backend}))

    def _beat(self, now_ms: float, to: int | None = None) -> None:
        msg = {
            "t": "beat", "from": self.id, "batch": self.worker.batch, "ready": self.ready,
            # a stopping leader still draining its loop keeps leading until its final publish,
            # or followers would see it stop, count themselves leader and publish stale
            # parameters of their own (docs/PROTOCOL-NOTES.md, note 10)
            "running": self.running or self._stopping_publish, "step": self.step,
            "backend": self.worker.backend, "term": self.term}
        if to is not None:
            msg["to"] = to
        self._actions.append(Post(msg))

    def _report(self, now_ms: float) -> None:
        self._actions.append(Report(self.state(now_ms)))

    # --- heartbeat and takeover
    def _sample_rates(self, now_ms: float) -> None:
        """One sample of the rate window ("State report": rates over about 2 s), at each beat."""
        self._rates.append((now_ms, self._applied_steps, self._applied_samples, int(self.link.total_bytes())))
        while len(self._rates) > 2 and now_ms - self._rates[1][0] >= _RATE_WINDOW_MS:
            self._rates.popleft()

    def _heartbeat(self, now_ms: float) -> None:
        self._sample_rates(now_ms)
        for k in self.roster.prune(now_ms, self.policy.drop_ms):
            if k in self.membership:
                self.flaps[k] += 1                   # evicted without leaving ("Flapping ranks")
            self._silent.discard(k)                  # it returns under the flapping rule
            self._minor_since.pop(k, None)
            self._bias.forget(k)
        for k in [k for k, t in self.membership.items() if now_ms - t > self.policy.forget_ms]:
            del self.membership[k]
            self._unreachable.discard(k)
            self._end_probation(k)
            self._credited.pop(k, None)
            self.applied_by.pop(k, None)
        self.policy = policy(len(self.roster.members) + 1, self.timing)
        self._next_beat_ms = now_ms + self.policy.beat_ms
        self._beat(now_ms)
        self._republish(now_ms)
        if self.running and self.ready and self._phase is None and self._collection is None:
            if self._leading:
                if self.has_majority(now_ms):         # a lead paused without a majority resumes
                    self.counters["lead_resumed"] += 1
                    self._maybe_start_loop(now_ms)
            else:
                self._try_takeover(now_ms)
        self._report(now_ms)

    def _observe_round_period(self, step: int, now_ms: float) -> None:
        """"Local steps": fold the time per step between two adopted rounds into the EWMA."""
        last = self._last_adopted
        self._last_adopted = (now_ms, step)
        if last is None or step <= last[1]:
            return
        sample = (now_ms - last[0]) / (step - last[1])
        ewma = self.round_period_ms
        self.round_period_ms = sample if ewma is None else ewma + 0.3 * (sample - ewma)

    def _takeover_window_ms(self, now_ms: float) -> float:
        """How long a follower waits after its last adopted round before it takes over, ms
        (PROTOCOL.md "Heartbeat and takeover"): ``policy.takeover``, plus the local-steps slack
        ("Local steps"), plus the stretch of the follow interval for a large model ("Shares":
        a rank without a share is sent a round only every paced follow interval)."""
        return (self.policy.takeover_ms + self._round_slack_ms(now_ms)
                + self._paced_ms(FOLLOW_INTERVAL_MS) - FOLLOW_INTERVAL_MS)

    def _round_slack_ms(self, now_ms: float) -> float:
        """How much longer than ``policy.takeover`` a follower waits for the next round with local
        steps: the observed time per round, or the time its own last bucket (H inner steps) took
        if longer (a round is due once per H inner steps, which may take longer than the
        takeover window; the leader's own bucket takes about as long: "Shares", equal finish),
        and while its own bucket is still being computed, the time that has taken so far; none
        without local steps ("Local steps and optimizer state")."""
        if self.train.local_steps == 1:
            return 0.0
        running = now_ms - self._inflight_since_ms if self._inflight is not None else 0.0
        slack = max(self.round_period_ms or 0.0, self.contribution_ms or 0.0, running)
        return min(slack, self.policy.forget_ms)   # a round is never waited for longer than a member

    def _takeover_heard_since(self, now_ms: float) -> float | None:
        """The time after which a member must have been heard to count towards a takeover's
        majority, or None (the live set: "Membership and majority", "Heartbeat and takeover").
        Within ``policy.drop`` of the witness saying the leader left: the witness's word, less
        :data:`WITNESS_SKEW_MS` (the others had it at about the same time and beat at once).
        Otherwise, for two takeover windows: a beat after the leader was last heard (it beats
        every beat, so a member heard later is on this side of whatever cut it off; the leader
        itself never counts)."""
        left = self._lead_left_ms
        if left is not None and now_ms - left > self.policy.drop_ms:
            left = self._lead_left_ms = None          # the live set alone is exact again
        if left is not None:
            return left - WITNESS_SKEW_MS
        heard = self._leader_heard_ms
        if (heard is not None and self.following is not None and self.following != self.id
                and now_ms - self.last_open_ms <= 2 * self._takeover_window_ms(now_ms)):
            return heard + self.policy.beat_ms
        return None

    def _try_takeover(self, now_ms: float) -> bool:
        """Take over if due ("Heartbeat and takeover"): running, ready, idle, not leading, no
        accepted round for the takeover window, and :meth:`_may_take_lead`."""
        if (self.running and self.ready and self._phase is None and self._collection is None
                and not self._leading and now_ms - self.last_open_ms > self._takeover_window_ms(now_ms)
                and self._may_take_lead(now_ms)):
            self.counters["takeover"] += 1
            self._take_lead(now_ms)
            return True
        return False

    def _may_take_lead(self, now_ms: float) -> bool:
        """Takeover eligibility (PROTOCOL.md, "Heartbeat and takeover"): past ``deferUntil``,
        a majority in view (of members heard since :meth:`_takeover_heard_since`), and this
        rank is the lowest id among itself and the live running members that may lead (ready,
        or not ready but ahead of it) whose (term, step) is the most advanced: a rank whose
        lineage is behind must adopt, not lead."""
        since = self._takeover_heard_since(now_ms)
        if not self.may_lead or now_ms < self.defer_until_ms or not self.has_majority(now_ms, heard_since_ms=since):
            return False
        if self._lineage_moves_ahead(now_ms):
            # a member this rank hears follows a leader this rank cannot hear: it is alive
            self.counters["takeover_deferred_lineage_moves"] += 1
            return False
        while True:
            # (a member not ready, back from a suspension, whose lineage is ahead of this rank's
            # is a candidate too: it counts towards the majority, and this rank must not
            # overwrite its steps with older parameters)
            cands = [(m.term, m.step, m.id) for m in self.roster.live(now_ms, self.policy.drop_ms)
                     if m.running and self.may_lead_rank(m.id) and m.id not in self._skipped_leads
                     and (m.ready or (m.term, m.step) > (self.term, self.step))]
            cands.append((self.term, self.step, self.id))
            best = max((t, st) for t, st, _ in cands)
            chosen = min(k for t, st, k in cands if (t, st) == best)
            if chosen == self.id:
                return True
            # "Untrusted ranks": a candidate this rank has deferred to for a whole takeover
            # window without a round from it is not deferred to again until it drives
            since = self._passed_over.setdefault(chosen, now_ms)
            if now_ms - since <= self.policy.takeover_ms:
                return False
            self._skipped_leads.add(chosen)
            self.counters["lead_candidate_skipped"] += 1

    def _lineage_moves_ahead(self, now_ms: float) -> bool:
        """True when a live running member announces a lineage at least
        :data:`_MOVING_AHEAD_STEPS` steps ahead of this rank's (or of a later term) and moved
        forward within ``policy.drop``: it adopts rounds of a leader this rank does not hear, so
        that leader is alive, and a takeover now would start a term on older parameters
        (PROTOCOL.md, "Heartbeat and takeover": a lineage that moves is led)."""
        drop_ms = self.policy.drop_ms
        for m in self.roster.live(now_ms, drop_ms):
            if m.running and now_ms - m.advanced_ms <= drop_ms and (
                    m.term > self.term or (m.term == self.term and m.step >= self.step + _MOVING_AHEAD_STEPS)):
                return True
        return False

    def _take_lead(self, now_ms: float) -> None:
        """Start a new term (one above every term this rank has seen) and lead it."""
        if not self.may_lead:
            self.counters["lead_refused_no_role"] += 1    # "Untrusted ranks": contributes only
            return
        seen = [m.term for m in self.roster.members.values() if self.may_lead_rank(m.id)]
        self.term = max([self.term, self.term_floor] + seen) + 1
        self._leading = True
        self.following = self.id
        self.last_open_ms = now_ms
        self._maybe_start_loop(now_ms)

    # --- joining
    def _begin_join(self, now_ms: float) -> None:
        self.joining = True
        self._join_attempts = 0
        self._join_started_ms = now_ms
        self._next_join_ms = now_ms + self.timing.beat_ms

    def _join_tick(self, now_ms: float) -> None:
        self._next_join_ms = now_ms + self.timing.beat_ms
        if self.ready or not self.running:
            self.joining = False
            return
        self._announce()
        live = list(self.roster.live(now_ms, self.policy.drop_ms))
        # a round comes only from a rank that may lead: ready ranks that only contribute (the
        # followers of a leader that is gone) are no reason to wait ("Untrusted ranks")
        mine = (self.term, self.step)
        if any(m.ready and self.may_lead_rank(m.id) and (m.term, m.step) >= mine for m in live):
            return
        if now_ms - self._join_started_ms < self.policy.takeover_ms + self.join_reach_ms and \
                self._witnessed_leads - {m.id for m in live}:
            # "Joining": the server says a rank that may lead is connected, and it is not heard
            # (a leader whose compute held its event loop; its beats are late; in a mesh, its
            # frames wait for the pair's channel, up to the link's connect bound): no attempt yet
            self.counters["join_waited_for_witnessed_lead"] += 1
            return
        if now_ms < self._roll_call_partial_until_ms and not self._every_lead_member_heard(live):
            # "Joining": the server's roll call is partial (it restarted): a rank that may lead
            # and has not reconnected yet is not heard, nor is it in any list; no attempt yet
            # (unless every member that may lead is heard: none is missing)
            self.counters["join_waited_for_roll_call"] += 1
            return
        self._join_attempts += 1
        not_behind = [m for m in live if m.running and self.may_lead_rank(m.id) and (m.term, m.step) >= mine]
        if self._join_attempts >= 2 and self.may_lead and now_ms >= self._bootstrap_not_before_ms and self.id == min(
                [self.id] + [m.id for m in not_behind]) \
                and not any((m.term, m.step) > mine for m in not_behind) \
                and self.has_majority(now_ms):
            # (a majority of the membership it holds: a bootstrap starts a term as a takeover
            # does, and one made alone, cut off, won over the majority's lineage at the heal)
            self.counters["bootstrap"] += 1
            self.ready = True
            self.joining = False
            self.last_open_ms = now_ms
            # Rounds carry no ready/running: beat now so peers learn at once that this rank is
            # ready, not a beat period later (until then a follower would count itself leader).
            self._beat(now_ms)
            self._take_lead(now_ms)

    def _every_lead_member_heard(self, live: list) -> bool:
        """This rank holds members that may lead, and every one of them is in ``live`` (heard
        within ``policy.drop``): none of them is among the ranks a partial roll call may still
        bring back ("Joining"). False for a rank that holds no such member (a new joiner)."""
        leads = [k for k in self.membership if self.may_lead_rank(k)]
        heard = {m.id for m in live}
        return bool(leads) and all(k in heard for k in leads)

    # --- follower
    def _on_round(self, msg: dict, now_ms: float) -> None:
        """PROTOCOL.md, "Follower: receiving messages", round; lineages are ordered by
        (term, lower sender id) ("Lineage and terms")."""
        sender = msg["from"]
        term = msg["term"]
        # "Untrusted ranks": a round is adopted only from a rank the server says may lead, with
        # a finite learning rate within the room's bound and a step no lineage can exceed
        if not self.may_lead_rank(sender):
            self.drops["round_not_trainer"] += 1
            return
        lr = msg["lr"]
        if not isinstance(lr, (int, float)) or not math.isfinite(lr) or not 0 <= lr <= self.lr_max:
            self.drops["round_bad_lr"] += 1
            return
        if msg["step"] > _MAX_STEP:
            self.drops["round_bad_step"] += 1
            return
        if self._leading or self.looping or self._collection is not None:
            # a rank holding the lead yields only to a winning lineage, and then adopts it
            if (term, -sender) < (self.term, -self.id):
                self.drops["round_while_leading"] += 1
                return
            self._stand_down(now_ms)
        elif term < self.term:
            self.drops["stale_term"] += 1             # a deposed lineage: never rewind to it
            return
        elif term == self.term and self.following is not None and sender != self.following:
            if sender > self.following:
                self.drops["pretender"] += 1
                return
            # the same term led by two ranks (a simultaneous takeover): the lower id wins
        elif term == self.term and sender == self.following and msg["step"] < self.step:
            self.drops["stale_round"] += 1            # an out-of-order duplicate of this lead
            return
        if not all_finite(msg["params"]) or (_opt_len(msg) and not all_finite(msg["opt"])):
            self.drops["round_non_finite"] += 1       # never adopt non-finite parameters or state
            return
        self.last_open_ms = now_ms
        # adopt: idempotent and order-independent. The accuracy held no longer labels the
        # parameters (another lineage's may share this term and step), even when set_params
        # raises: it may have changed them first
        self._evaluated_step = None
        try:
            self.worker.set_params(msg["params"])
        except Exception as exc:  # a worker bug must not escape as a peer-input crash
            self.fault = f"set_params: {exc!r}"
            self.drops["round_rejected_by_worker"] += 1
            return
        if _opt_len(msg):
            # the leader's optimizer state travels with its round: a takeover resumes from it
            self.opt_state = to_vector(msg["opt"])
        if self.train.local_steps > 1:
            self._observe_round_period(int(msg["step"]), now_ms)
        self.following = sender
        self._passed_over.pop(sender, None)
        self._skipped_leads.discard(sender)
        self.term = int(term)
        became_ready = not self.ready
        # the rates count every step the cohort applied since the last adopted round: a follower
        # that adopts only the newest of several rounds (superseded ones dropped unread) still
        # reports the cohort's rate, not its adoption rate (a native follower showed 20 steps/s
        # beside a leader's 3,000); a round of a step it already holds (a diverged leader's round
        # sent again) is no step (it counted one: "step 47 ... 2.6 steps/s" beside the leader's 0.0)
        advanced = 1 if became_ready else max(0, int(msg["step"]) - self.step)
        self.step = int(msg["step"])
        self.lr = float(lr)
        self.ready = True
        self.joining = False
        self.loss = float(msg["loss"])
        self.samples = int(msg["samples"])
        # (display only; a peer's count is bounded like any other untrusted integer. Not from a
        # publish, which a stopped leader counts without itself, nor once this rank stopped)
        if self.running and msg["assign"]:
            self.round_cohort = max(0, min(int(msg["cohort"]), _COHORT_SHOWN_MAX))
        self._applied_steps += advanced
        self._applied_samples += self.samples * advanced
        self._adopt_seq += 1
        self.counters["adopted"] += 1
        if became_ready or not msg["assign"]:
            # peers learn at once that this rank is ready (see bootstrap); and a publish (the
            # one round with no assignment) is answered at once with this rank's new step, so
            # its sender knows who has it ("Publish", re-publish) without waiting a beat
            self._beat(now_ms)
        shares = msg["shares"]
        self.shares = dict(shares)
        self._step_cursor = int(msg["cursor"])
        self.cursor = self._step_cursor + self.train.local_steps * sum(shares.values())
        self._cursor_step = int(msg["step"]) + (1 if shares else 0)
        if self.at_step_limit and self.running:
            # the cohort ends at the job's step limit (note 13): nothing to compute
            self.counters["step_limit"] += 1
            self.running = False
            self._pending = None
            self._beat(now_ms)
            self._report(now_ms)
            return
        offset = msg["assign"].get(self.id)
        if self.running and offset is not None:
            self._pending = (self._adopt_seq, self.step, int(offset), sender, self.term,
                             int(shares.get(self.id, self.worker.batch)))
            self._start_pending_contribution()

    def _start_pending_contribution(self) -> None:
        if self._inflight is not None or self._pending is None:
            return
        seq, step, offset, to, term, share = self._pending
        self._pending = None
        if seq != self._adopt_seq:
            return
        self._tokens += 1
        self._inflight = (self._tokens, seq, step, to, term, self.train.local_steps * share)
        self._inflight_since_ms = self._last_input_ms
        self._actions.append(self._compute(step, offset, share, own=False))

    def _stand_down(self, now_ms: float) -> None:
        """Give up the lead to a winning lineage; the caller adopts its round."""
        self.counters["stand_down"] += 1
        self._end_loop()
        self._leading = False
        self._stopping_publish = False
        self.defer_until_ms = now_ms + self.timing.takeover_ms
        self._report(now_ms)

    # --- leader loop
    def _maybe_start_loop(self, now_ms: float) -> None:
        if self._phase is not None or not self.is_leader(now_ms):
            return
        self._phase = Phase.PACE
        self._pace_tries = 0
        self._pace_since_ms = None
        self._loop_step(now_ms)

    def _end_loop(self) -> None:
        self._spread_pending = None
        self._own_held_turnaround_ms = None   # (a later lead measures its own anew)
        self._phase = None
        self._phase_deadline_ms = None
        self._collection = None
        self._running_mean.release()   # (not leading: its buckets and sum go)
        self._own_token = None
        self._own_bucket = None

    def _loop_step(self, now_ms: float) -> None:
        """Between rounds: check the loop's condition, pace on pressure, drive a round."""
        if self.at_step_limit and self.is_leader(now_ms):
            # the job's step limit (note 13): stop here and publish, as stop() does
            self.counters["step_limit"] += 1
            self.running = False
            self.joining = False
            self._end_loop()
            self._publish(now_ms)
            self._beat(now_ms)
            self._report(now_ms)
            return
        if not self.is_leader(now_ms):
            stopped = not self.running or self._stopping_publish
            self._end_loop()
            if stopped and self.ready and not self.disposed:
                self._stopping_publish = False
                self._publish(now_ms)
                self._beat(now_ms)                 # and now it has stopped (note 10)
            return
        if not self.has_majority(now_ms):
            # "Membership and majority": a leader that cannot see a majority of its members
            # commits nothing; it keeps the lead and resumes at a heartbeat once it sees one
            self.counters["paused_no_majority"] += 1
            self._end_loop()
            return
        # beats spent pacing so far (the bound counts time, the retries come every 25 ms)
        if self._pace_since_ms is not None:
            self._pace_tries = int((now_ms - self._pace_since_ms) // self.policy.beat_ms)
        if self.link.pressure() > 1 and self._pace_tries < _MAX_PACE_TRIES:
            if self._pace_since_ms is None:
                self._pace_since_ms = now_ms
            self.counters["paced"] += 1
            self._phase = Phase.PACE
            self._phase_deadline_ms = now_ms + min(self.policy.beat_ms, _PACE_RETRY_MS)
            return
        self._pace_since_ms = None
        self._drive_round(now_ms)

    def _drive_round(self, now_ms: float) -> None:
        ids = self.cohort_ids(now_ms)
        batches = {}
        for k in ids:
            m = self.roster.members.get(k)
            batches[k] = m.batch if (m is not None and m.batch) else self.worker.batch
        probing: set[int] = set()
        # "Untrusted ranks": quarantined ranks get no share; silent ones and ranks on probation
        # only a probe ("Flapping ranks": a share not awaited is the others' samples, lost
        # whenever it misses the round, and one that each newer round supersedes never arrives)
        for k, until in list(self.quarantined.items()):
            if now_ms >= until:
                del self.quarantined[k]
                self._clip_recent.pop(k, None)
                self.counters["quarantine_ended"] += 1
        held_back = {k for k in ids if k != self.id and (
            k in self.quarantined or k in self._silent or k in self._probation)}
        ids = [k for k in ids if k not in held_back]
        capped: dict[int, int] = {}
        if self.global_batch is not None and self.roles_enforced:
            # "Untrusted ranks": a contributor holds at most a fixed part of the global batch,
            # however fast it answers (its weight in the mean is its share)
            cap = max(1, int(self.global_batch * CONTRIBUTOR_SHARE_FRACTION))
            for k in ids:
                if batches[k] > cap and not self.may_lead_rank(k):
                    batches[k] = capped[k] = cap
        if self.global_batch is None:
            shares = {k: int(batches[k]) for k in ids}
        else:
            # "Shares": the global batch in proportion to measured throughput, within caps
            probe = self.step % PROBE_EVERY == 0 and now_ms - self._probe_ms >= self._paced_ms(PROBE_INTERVAL_MS)
            # a rank with no history is probed again while its probes are unanswered only after
            # PROBE_INTERVAL_MS, doubled for each one outstanding (a silent newcomer would get a
            # share every round; a slow one's answer must find its probe still kept)
            unanswered = {k for k in ids if k != self.id and k not in self.speeds.speeds
                          and self._probe_backing_off(k, now_ms)}
            planned = [k for k in ids if k not in unanswered]
            key = (self.global_batch, tuple((k, batches[k], k in self.speeds.speeds) for k in planned))
            plan = self._plan
            if (not probe and plan is not None and plan[0] == key and not plan[3]
                    and 0 <= now_ms - plan[1] < REPLAN_INTERVAL_MS):
                shares, probing = dict(plan[2]), set()      # "Shares": the plan of 2 ms ago
            else:
                # "Shares": a leader whose compute holds its loop, with less than half of the
                # global batch, is planned to be ready first
                own_ms = self._own_held_turnaround_ms
                head = None if own_ms is None else {
                    self.id: lead_head_start_ms(own_ms, self.shares.get(self.id, 0) / self.global_batch)}
                shares, probing = plan_shares(self.global_batch, planned, batches, self.speeds, probe=probe,
                                              head_start_ms=head)
                if head is not None and shares.get(self.id, 0) <= 1 and self.id in planned:
                    # the head start left this rank (nearly) out of its own round: planned without
                    # it (the round then covers the global batch with its own bucket in it)
                    shares, probing = plan_shares(self.global_batch, planned, batches, self.speeds, probe=probe)
                for k in [k for k in probing if self._probe_in_flight(k, now_ms)]:
                    probing.discard(k)                      # its last probe is still being computed
                    shares.pop(k, None)
                self._plan = (key, now_ms, dict(shares), bool(probing))
            if probing:
                self._probe_ms = now_ms
            if capped and any(shares.get(k) == c for k, c in capped.items()):
                self.counters["contributor_share_capped"] += 1
            if self.id not in shares:
                shares[self.id] = 1                 # the leader's own bucket is always reduced
        probe_ms = self._paced_ms(PROBE_INTERVAL_MS) if held_back else 0.0
        for k in sorted(held_back - self.quarantined.keys()):
            if self._probe_backing_off(k, now_ms) or self._probe_in_flight(k, now_ms):
                continue                             # its last probes are unanswered: back off
            if 0 <= now_ms - self._held_probe_ms.get(k, -probe_ms) < probe_ms:
                continue                             # at most one probe per PROBE_INTERVAL_MS
            self._held_probe_ms[k] = now_ms
            shares[k] = 1
            probing.add(k)
        if self._held_probe_ms:
            for k in self._held_probe_ms.keys() - held_back:  # readmitted or gone: forget
                del self._held_probe_ms[k]
        # "Local steps": a rank's window covers H consecutive inner batches of its share
        h = self.train.local_steps
        assign = windows({k: h * s for k, s in shares.items()}, self.cursor)
        self.shares = shares
        self._round_step = self.step
        if len(shares) > 1:
            # install the collection state BEFORE sending the round (step 3); ranks on
            # probation or on a probe share are assigned and accepted but not awaited
            awaited = {k for k in shares if k not in self._probation and k not in probing}
            awaited.add(self.id)
            self._collection = _Collection(self.step, self.term, dict(shares), awaited,
                                           min(len(awaited), self.policy.quorum), now_ms)
        else:
            self._collection = None
        self._running_mean.reset()
        if self._collection is not None:
            self._collection.assign = assign
        self._sent_rounds[(self.term, self.step)] = (now_ms, dict(shares))
        while len(self._sent_rounds) > 4:
            self._own_bucket_ms.pop(next(iter(self._sent_rounds)), None)
            del self._sent_rounds[next(iter(self._sent_rounds))]
        for k in probing:
            q = self._probe_sent.setdefault(k, [])
            q.append((self.term, self.step, now_ms, shares[k]))
            del q[:-_PROBES_KEPT]
            self._probes_outstanding[k] = self._probes_outstanding.get(k, 0) + 1
            if len(q) >= _PROBES_SILENT and k not in self._silent:
                # "Untrusted ranks", silent members: probes keep going unanswered
                self._silent.add(k)
                self._silences[k] += 1
                self.drops["probe_unanswered"] += 1
        if len(self._probe_sent) > len(ids) + len(held_back):
            # more ranks with probes kept than the cohort has: some left, forget their probes
            # (against the cohort, not the round's shares: a member without a share whose probe
            # is outstanding would otherwise cost this scan in every round)
            live = set(ids) | held_back
            for k in [k for k in self._probe_sent if k not in live]:
                del self._probe_sent[k]
                self._probes_outstanding.pop(k, None)
        self._round_params = self.worker.params()
        self.round_cohort = len(ids)
        msg = {
            "t": "round", "from": self.id, "step": self.step, "term": self.term, "lr": self.lr,
            "assign": assign, "shares": dict(shares), "cursor": self.cursor,
            "params": self._round_params, "loss": self.loss, "samples": self.samples,
            "cohort": len(ids), "opt": self._carried_state()}
        to = self._round_recipients(shares, now_ms)
        if to is None:
            self._actions.append(Post(msg))
        else:
            self.counters["rounds_addressed"] += 1
            for k in to:
                self._actions.append(Post({**msg, "to": k}))
        self._step_cursor = self.cursor
        self.cursor += h * sum(shares.values())
        self._cursor_step = self.step + 1
        self.last_open_ms = now_ms
        self._phase = Phase.OWN
        self._phase_deadline_ms = None
        self._own_bucket = None
        self._tokens += 1
        self._own_token = self._tokens
        self._actions.append(self._compute(self.step, assign[self.id], shares[self.id], own=True))

    def _compute(self, step: int, offset: int, share: int, *, own: bool) -> Compute:
        """The Compute action for a bucket of ``share`` samples per inner step ("Local steps")."""
        t = self.train
        return Compute(token=self._tokens, step=step, offset=offset, own=own, samples=share,
                       local_steps=t.local_steps, inner_optimizer=t.inner_optimizer,
                       inner_lr=float(t.inner_lr))

    def _carried_state(self) -> Any:
        """What a round carries of the leader's optimizer state: all of it (zeros before the
        first outer step), or the empty vector when the optimizer has none."""
        if self.state_len == 0:
            return empty()
        if self.opt_state is None:
            self.opt_state = _zeros(self.state_len)
        return self.opt_state

    def optimizer_state(self) -> Any:
        """A copy of the leader's optimizer state (float32, shape (state_len,)), or None when
        the room's optimizer has none (PROTOCOL.md, "Local steps and optimizer state")."""
        if self.state_len == 0:
            return None
        return to_vector(self.opt_state) if self.opt_state is not None else _zeros(self.state_len)

    def _paced_ms(self, base_ms: float) -> float:
        """``base_ms`` stretched for this model's round size ("Shares": rounds to ranks outside
        the shares stay within ``shares.FOLLOW_BYTES_PER_S``). A follower waits the stretch of
        the follow interval longer before it takes over ("Heartbeat and takeover"): a rank
        without a share may see no round for that much longer."""
        key = (base_ms, self.policy.takeover_ms)
        v = self._paced.get(key)
        if v is None:
            v = self._paced[key] = paced_interval_ms(base_ms, 4 * (self.worker.bucket_len + self.state_len),
                                                     self.policy.takeover_ms)
        return v

    def _round_recipients(self, shares: dict[int, int], now_ms: float) -> list[int] | None:
        """Who this round is sent to: ``None`` for everyone (a broadcast), else the ranks with
        a share, each addressed (PROTOCOL.md, "Shares": followers without a share).

        Everyone gets it when the last broadcast is ``FOLLOW_INTERVAL_MS`` old, in a term's
        first round, and whenever the ranks with a share are more than half of the peers (a
        broadcast is one send through a relay; addressed copies cost one send each)."""
        holders = sorted(k for k in shares if k != self.id)
        peers = [m.id for m in self.roster.live(now_ms, self.policy.drop_ms) if m.id != self.id]
        due = (self._broadcast_term != self.term
               or now_ms - self._broadcast_ms >= self._paced_ms(FOLLOW_INTERVAL_MS) or now_ms < self._broadcast_ms)
        if due or not peers or 2 * len(holders) > len(peers):
            self._broadcast_ms = now_ms
            self._broadcast_term = self.term
            return None
        return holders

    def _on_own_bucket(self, loss: float, samples: int, g: Any, now_ms: float, *,
                       held_ms: float = 0.0) -> None:
        if self._phase is not Phase.OWN:
            self.counters["late_own_bucket"] += 1
            return
        col = self._collection
        finite, norm = self._finite_and_norm(col, g)
        if len(g) != self.worker.bucket_len or not finite or not math.isfinite(loss) or samples <= 0:
            self.drops["own_bucket_invalid"] += 1
            self._own_held_turnaround_ms = None
            if len(g) == self.worker.bucket_len and samples > 0:
                # "Leader: driving one round", step 5: the job's own loss or gradients are not
                # finite; a round this leaves with no bucket counts as diverged
                self._own_non_finite = True
                self.fault = (f"diverged: the leader's own bucket of step {self.step} is not finite "
                              f"(the job's loss or gradients hold NaN or inf; lr {self.lr:g})")
        else:
            self._own_bucket = (loss, samples, g)
            self._observe_turnaround(self.id, self.term, self._round_step, samples, now_ms)
            sent = self._sent_rounds.get((self.term, self._round_step))
            held = held_ms > CENSOR_WINDOW_MS and sent is not None
            if held:
                self._own_bucket_ms[(self.term, self._round_step)] = now_ms
            self._own_held_turnaround_ms = now_ms - sent[0] if held else None
        if col is None:
            self._finish_round(now_ms)
            return
        if self._own_bucket is not None:
            col.received[self.id] = self._own_bucket
            if norm is not None:
                col.norms[self.id] = norm
            _arrived(col, now_ms, self.id)
            self._accumulate(col, samples, g)
        else:
            # the leader's own bucket is not coming: the round waits only for the others'
            col.wanted.discard(self.id)
            col.awaited.discard(self.id)
            col.quorum = max(1, min(col.quorum, len(col.awaited)))
        self._phase = Phase.COLLECT
        self._phase_deadline_ms = now_ms + self.policy.collect_ms
        col.window_end_ms = self._phase_deadline_ms
        if not col.awaited:
            self._finish_round(now_ms)
        else:
            self._collected(col, now_ms)

    def _on_grad(self, msg: dict, now_ms: float) -> None:
        col = self._collection
        sender = msg["from"]
        if col is None:
            self._late_bucket(msg, now_ms)
            self._late_delivery(msg, now_ms)
            self._observe_turnaround(sender, msg["term"], msg["step"], msg["samples"], now_ms)
            self.drops["grad_no_collection"] += 1
            return
        if msg["term"] == col.term and msg["step"] != col.step:
            # a bucket of an earlier round: too late to count, but it tells the rank's speed
            # (and, from a held-back rank, that it answers)
            self._late_delivery(msg, now_ms)
            self._observe_turnaround(sender, msg["term"], msg["step"], msg["samples"], now_ms)
        if msg["term"] != col.term:
            self.drops["grad_wrong_term"] += 1
            return
        if msg["step"] != col.step:
            self._late_bucket(msg, now_ms)
            self.drops["grad_wrong_step"] += 1
            return
        if sender not in col.wanted:
            self.drops["grad_not_wanted"] += 1
            return
        if sender in col.received:
            self.drops["grad_duplicate"] += 1
            return
        g = msg["g"]
        loss = msg["loss"]
        finite, norm = self._finite_and_norm(col, g)
        if not finite or not math.isfinite(loss):
            self.drops["grad_non_finite"] += 1
            self._rejected(col, sender, now_ms)
            return
        if msg["samples"] != self.train.local_steps * col.shares[sender]:
            self.drops["grad_bad_samples"] += 1        # a bucket must cover exactly its share
            self._rejected(col, sender, now_ms)
            return
        col.received[sender] = (float(loss), int(msg["samples"]), g)
        if norm is not None:
            col.norms[sender] = norm
        _arrived(col, now_ms, sender)
        self._accumulate(col, int(msg["samples"]), g)
        self._delivered_in_time(sender, (col.term, col.step), now_ms)
        self._observe_turnaround(sender, col.term, col.step, msg["samples"], now_ms)
        self._collected(col, now_ms)

    def _delivered_in_time(self, sender: int, key: tuple[int, int], now_ms: float) -> None:
        """A bucket of ``sender`` for round ``key`` (term, step) came in time: a silent rank is
        put on probation ("Untrusted ranks"), a rank on probation owes one bucket fewer
        ("Flapping ranks")."""
        if sender not in self._silent and sender not in self._probation:
            return
        self._credited[sender] = key
        if sender in self._silent:
            # delivered again: it owes in-time buckets before it is awaited ("Untrusted ranks")
            self._silent.discard(sender)
            self._start_probation(sender, min(_PROBATION_MAX, _PROBATION_BUCKETS * 2 ** min(4, self._silences[sender])))
            self.counters["silent_delivered"] += 1
        pending = self._missed.get(sender)
        if pending:
            if pending[0][0] < key:
                # an earlier round's bucket never came, and now never counts (one credit per
                # round, never an older one): a miss, the count restarts with this bucket
                self._restart_probation(sender)
            elif pending[0][0] == key:
                pending.popleft()
        owed = self._probation[sender]                 # this bucket is the first of them
        if owed <= 1:
            self._end_probation(sender)
            self._credited.pop(sender, None)
            self.counters["readmitted"] += 1
        else:
            self._probation[sender] = owed - 1

    def _start_probation(self, k: int, owed: int) -> None:
        """``k`` owes ``owed`` in-time buckets, in a row, before it is awaited ("Flapping ranks")."""
        self._probation[k] = self._probation_run[k] = owed
        self._missed.pop(k, None)

    def _restart_probation(self, k: int) -> None:
        """``k`` missed a round on probation: it owes its whole run anew (never fewer than it
        owed when its probation began: a miss must not shorten it)."""
        self._probation[k] = max(self._probation_run.get(k, 0),
                                 min(_PROBATION_MAX, _PROBATION_BUCKETS * max(1, self.flaps[k])))
        self._missed.pop(k, None)

    def _end_probation(self, k: int) -> None:
        self._probation.pop(k, None)
        self._probation_run.pop(k, None)
        self._missed.pop(k, None)

    def _late_delivery(self, msg: dict, now_ms: float) -> None:
        """"Untrusted ranks" / "Flapping ranks": a held-back rank's bucket for a round that
        finished before it came (a probe or a share, not awaited) still counts as in time when it
        covers its share and came within one collect window of that round's send. Why: a probe
        is not awaited, so when the others' buckets are faster than its turnaround the round
        ends first; with "before the round ends" a rank slower than the rest (a tab, a native
        rank behind the relay) that was marked silent once was never readmitted."""
        sender = msg["from"]
        if sender not in self._silent and sender not in self._probation:
            return
        key = (msg["term"], msg["step"])
        if key <= self._credited.get(sender, (-1, -1)):
            return                                     # one credit per round, never an older one
        pr = next((x for x in self._probe_sent.get(sender) or () if x[:2] == key), None)
        sent = self._sent_rounds.get(key)
        if pr is not None:
            sent_ms, share = pr[2], pr[3]
        elif sent is not None:
            sent_ms, share = sent[0], sent[1].get(sender)
        else:
            return
        if share is None or msg["samples"] != self.train.local_steps * share:
            return
        if now_ms - sent_ms > self.policy.collect_ms or not all_finite(msg["g"]):
            return
        self.counters["late_delivery_counted"] += 1
        self._delivered_in_time(sender, key, now_ms)

    def _collected(self, col: _Collection, now_ms: float) -> None:
        """A bucket arrived or the awaited set shrank while collecting: finish at the quorum,
        else wait for minor stragglers only as long as they are worth."""
        if self._phase is not Phase.COLLECT:
            return
        if len(col.received) >= col.quorum:
            self._quorum_reached(col, now_ms)
        else:
            self._wait_for_minor(col, now_ms)

    def _wait_for_minor(self, col: _Collection, now_ms: float) -> None:
        """"Shares", minor stragglers: once the buckets still missing hold at most
        MINOR_SHARE_FRACTION of the round's awaited samples (M of S), the round waits for them
        at most ``MINOR_WAIT_FACTOR * e * M / S`` more, ``e`` the time since it was sent; then it
        finishes without them (their buckets are dropped as late and still measure their
        ranks). Waiting w ms delays the whole round by w / e of its time to gain M / S of its
        samples, and a dropped bucket also delays its rank's next one."""
        if self.global_batch is None or col.quorum < len(col.awaited):
            return              # no fixed global batch, or a quorum (n > 3) decides: not this rule
        missing = col.awaited - col.received.keys()
        if not missing or self.id in missing:
            return
        awaited_samples = sum(col.shares.get(k, 0) for k in col.awaited)
        missing_samples = sum(col.shares.get(k, 0) for k in missing)
        if awaited_samples <= 0 or missing_samples > MINOR_SHARE_FRACTION * awaited_samples:
            return
        until = now_ms + MINOR_WAIT_FACTOR * (now_ms - col.opened_ms) * missing_samples / awaited_samples
        if col.minor_until_ms is None or until < col.minor_until_ms:
            col.minor_until_ms = until
        if self._phase_deadline_ms is None or until < self._phase_deadline_ms:
            self._phase_deadline_ms = until

    def _rejected(self, col: _Collection, sender: int, now_ms: float) -> None:
        """"Untrusted ranks": a rank whose bucket for this round was rejected has no other in
        flight (one bucket per rank), so the round stops waiting for it at once, and it is
        treated as silent (a probe share until it delivers a bucket in time)."""
        if sender in col.awaited and sender != self.id:
            col.awaited.discard(sender)
            col.quorum = max(1, min(col.quorum, len(col.awaited)))
            self._silent.add(sender)
            self._silences[sender] += 1
            self.counters["released_rejected"] += 1
            self._collected(col, now_ms)

    def _probe_backing_off(self, rank: int, now_ms: float) -> bool:
        """"Shares", no history: True while ``rank``'s last probe is unanswered and younger than
        PROBE_INTERVAL_MS doubled per probe outstanding (at most 2 ** _PROBE_BACKOFF_MAX_EXP
        times). Why the cap is not the probes kept: a rank whose probe takes longer than the
        last wait is given the next probe, which supersedes the one it is computing; with the
        wait capped at 2 s a tab needing 3 s for a probe was never measured, so never given a share."""
        q = self._probe_sent.get(rank)
        if not q:
            return False
        n = self._probes_outstanding.get(rank, 1)   # (at least 1 while any probe is kept)
        wait_ms = min(self._paced_ms(PROBE_INTERVAL_MS) * 2 ** min(n - 1, _PROBE_BACKOFF_MAX_EXP),
                      PROBE_INTERVAL_MS * 2 ** _PROBE_BACKOFF_MAX_EXP)    # (8 s for any model)
        return now_ms - q[-1][2] < wait_ms

    def _probe_in_flight(self, rank: int, now_ms: float) -> bool:
        """"Shares", probes: True while ``rank``'s last probe is unanswered and younger than twice
        its predicted one-sample turnaround (at most a collect window). Why: a newer probe
        supersedes the one the rank is computing ("Contribute"), so a rank whose probe takes
        longer than ``PROBE_INTERVAL_MS`` (250 ms) answered none, was marked silent after three
        and, owing 24 buckets out of its silences, never readmitted (a 400-ms rank: 51 silences a
        minute; a seeded fault campaign). False for a rank with no history (its own backoff,
        :meth:`_probe_backing_off`)."""
        q = self._probe_sent.get(rank)
        if not q:
            return False
        predicted = self.speeds.predicted_ms(rank, 1)
        if predicted is None:
            return False
        return now_ms - q[-1][2] < min(self.policy.collect_ms, 2.0 * predicted)

    def _observe_turnaround(self, rank: int, term: int, step: int, samples: int, now_ms: float) -> None:
        """"Shares": a bucket of a round this rank drove arrived; fold its turnaround into the
        sender's throughput estimate (only a bucket that covers its share counts)."""
        sent = self._sent_rounds.get((term, step))
        q = self._probe_sent.get(rank) or []
        pr = next((x for x in q if x[:2] == (term, step)), None)
        if sent is None:
            if pr is None:
                return
            sent = (pr[2], {rank: pr[3]})
        share = sent[1].get(rank)
        if share is None or self.train.local_steps * share != samples:
            return
        if self._minor_since and pr is None:
            # a bucket covering a share of a round (in time or late): no run of misses; a probe
            # or any other grad (a step it never had, a wrong term or size) does not count
            self._minor_since.pop(rank, None)
        if pr is not None:                       # answered: this rank's earlier probes are moot
            del q[:q.index(pr) + 1]
            if not q:
                del self._probe_sent[rank]
            self._probes_outstanding[rank] = len(q)
        own_ms = self._own_bucket_ms.get((term, step)) if rank != self.id else None
        # it may have waited behind this rank's own compute: its turnaround is an upper bound
        censored = own_ms is not None and now_ms - own_ms <= censor_window_ms(own_ms - sent[0])
        if censored:
            self.counters["turnaround_censored"] += 1
        # per sample of the share, so the shares are planned in the round's own units
        self.speeds.observe(rank, share, now_ms - sent[0], censored=censored)

    def _quorum_reached(self, col: _Collection, now_ms: float) -> None:
        """Received buckets (own included) reached the quorum while collecting."""
        if self.collect_rule == "quorum":
            self._finish_round(now_ms)
            return
        if col.grace_until_ms is None:
            self._take_spread_sample()
        # Every rank worth waiting for has delivered (all of them, usually): finish now. A rank
        # whose buckets missed the last rounds entirely (not even late) is a straggler: waiting
        # for it buys nothing.
        missed = self.missed_rounds
        if all(k in col.received or missed.get(k, 0) >= _GRACE_SKIP_MISSES for k in col.awaited):
            self._finish_round(now_ms)
            return
        if col.grace_basis is None:
            spread = now_ms - (col.first_ms if col.first_ms is not None else now_ms)
            typical = self.spread_ewma_ms if self.spread_ewma_ms is not None else 0.0
            col.grace_basis = (now_ms, max(spread, self.grace_margin * typical), now_ms - col.opened_ms)
            self.counters["grace_windows"] += 1
        # decided at the quorum, and shortened at each later arrival as the samples still missing
        # shrink (the bound is of the buckets still missing, not of those missing at the quorum)
        at_ms, window_ms, elapsed_ms = col.grace_basis
        until = at_ms + max(0.0, min(window_ms, self._grace_bound(col, missed) * elapsed_ms))
        # A zero window still ends at a deadline (due now), not at once: buckets that
        # arrived at the same instant and are queued behind this one are still taken.
        if col.grace_until_ms is None or until < col.grace_until_ms:
            col.grace_until_ms = until
            if self._phase_deadline_ms is None or until < self._phase_deadline_ms:
                self._phase_deadline_ms = until

    def _grace_bound(self, col: _Collection, missed: dict[int, int]) -> float:
        """The grace window's bound as a fraction of the round's elapsed time at the quorum
        (docs/PROTOCOL-NOTES.md note 7): ``grace_fraction``, or ``MINOR_WAIT_FACTOR * M / S`` when
        larger, ``M`` the samples of the awaited buckets still missing now (a rank skipped for its
        misses not counted; taken again at each arrival, so the window only shortens) and ``S``
        those of every awaited bucket: the minor stragglers' cost model ("Shares"),
        waiting delays the round by its fraction of the round's time to gain ``M / S`` of its
        samples. Only under a fixed global batch, where the shares are planned for every bucket
        to arrive together; without one a rank's share is its declared batch, and a slower rank
        is late every round. Why: at a flat 10 %, four equally fast ranks on a 2-core host lost the fourth
        bucket in about half the rounds (a quarter of the global batch, computed and sent for
        nothing), late only by the time the leader took to take in the third."""
        if self.global_batch is None:
            return self.grace_fraction   # shares not planned by speed: a late rank stays late
        awaited = sum(col.shares.get(k, 0) for k in col.awaited)
        missing = sum(col.shares.get(k, 0) for k in col.awaited
                      if k not in col.received and missed.get(k, 0) < _GRACE_SKIP_MISSES)
        return max(self.grace_fraction, MINOR_WAIT_FACTOR * missing / awaited if awaited > 0 else 0.0)

    def _late_bucket(self, msg: dict, now_ms: float) -> None:
        """A bucket of the previous round that arrived after it finished still tells how far
        apart arrivals are (grace rule): it extends that round's spread sample."""
        prev = self._spread_pending
        if prev is not None and msg["step"] == prev.step and msg["from"] in prev.missing:
            prev.missing.discard(msg["from"])
            prev.last_ms = now_ms if prev.last_ms is None else max(prev.last_ms, now_ms)

    def _take_spread_sample(self) -> None:
        """Fold the last finished round into the typical spread (an EWMA of its first-to-last
        arrival time, late buckets included) and into each wanted rank's run of missed rounds."""
        prev, self._spread_pending = self._spread_pending, None
        if prev is None:
            return
        missed = self.missed_rounds
        self.missed_rounds = {k: (missed.get(k, 0) + 1 if k in prev.missing else 0) for k in prev.wanted}
        if prev.first_ms is None or prev.last_ms is None:
            return
        sample = prev.last_ms - prev.first_ms
        ewma = self.spread_ewma_ms
        self.spread_ewma_ms = sample if ewma is None else ewma + _SPREAD_ALPHA * (sample - ewma)

    def _charge_hold(self, col: _Collection) -> None:
        """"Shares": the awaited rank whose bucket arrived last is charged the time the round
        waited for it after every other awaited bucket was in (``held_ms``, reported)."""
        times = heapq.nlargest(2, ((t, k) for k, t in col.arrived_ms.items() if k in col.awaited))
        if len(times) == 2:
            (t1, last), (t2, _) = times
            self.held_ms[last] = self.held_ms.get(last, 0.0) + (t1 - t2)

    def _mark_silent(self, k: int) -> None:
        """"Untrusted ranks", silent members: an awaited rank that gave nothing for a whole
        collect window is not waited for again until it delivers."""
        if k not in self.roster.members:
            return                                  # evicted meanwhile: "Flapping ranks" applies
        self._minor_since.pop(k, None)
        self._silent.add(k)
        self._silences[k] += 1
        self.counters["silent_marked"] += 1
        self.drops["bucket_missing"] += 1           # a share given, nothing delivered

    def _finish_round(self, now_ms: float) -> None:
        col = self._collection
        loss_from: list[tuple[float, int, Any]] | None = None
        if col is not None:
            minor: list[int] = []
            minor_wait_ms = 0.0
            by_minor = (col.minor_until_ms is not None and now_ms >= col.minor_until_ms
                        and (col.window_end_ms is None or col.minor_until_ms < col.window_end_ms))
            if col.window_end_ms is not None and now_ms >= col.window_end_ms and not by_minor:
                # "Untrusted ranks": an awaited rank that gave nothing in a whole collect window
                # is not waited for again until it delivers (every rule, every cohort size)
                for k in sorted(col.awaited - col.received.keys() - {self.id}):
                    self._mark_silent(k)
            elif by_minor:
                # "Shares", minor stragglers: finished without them. One slower than its model
                # said is measured at the time waited (a lower bound): a follower drops a bucket
                # a newer round made stale, so the late one may never come to tell it. One that
                # delivered nothing for a collect window is silent, as if it had held one.
                minor = sorted(col.awaited - col.received.keys() - {self.id})
                self.counters["minor_not_waited"] += len(minor)
                waited_ms = now_ms - col.opened_ms
                for k in minor:
                    predicted = self.speeds.predicted_ms(k, col.shares[k])
                    if predicted is not None and waited_ms > predicted:
                        self.speeds.observe(k, col.shares[k], waited_ms)
                    if now_ms - self._minor_since.setdefault(k, now_ms) >= self.policy.collect_ms:
                        self._mark_silent(k)
                minor_wait_ms = now_ms - max((t for k, t in col.arrived_ms.items() if k in col.awaited),
                                             default=now_ms)
            received = self._robust(col, now_ms)
            buckets = list(received.values())
            if self.roles_enforced:
                # "Untrusted ranks": the round's loss is the trainers' (a contributor's claimed
                # loss of 1e30 would trip the server's divergence stop and end the room)
                trusted = [b for k, b in received.items() if k == self.id or self.may_lead_rank(k)]
                if trusted and len(trusted) < len(buckets):
                    loss_from = trusted
            for k in col.wanted & self._probation.keys():
                if k not in col.received:
                    # its answer may still come ("In time, for a rank held back"): pending
                    self._missed.setdefault(k, deque()).append(((col.term, col.step), col.opened_ms))
            for k in [k for k, q in self._missed.items() if q and now_ms - q[0][1] > self.policy.collect_ms]:
                self._restart_probation(k)             # missed: nothing within a collect window
            if self.collect_rule == "grace":
                self._take_spread_sample()          # a round with no quorum wait has none yet
                self._spread_pending = _Spread(col)
        else:
            buckets = [self._own_bucket] if self._own_bucket is not None else []
        self._collection = None
        self._own_bucket = None
        self._phase_deadline_ms = None
        try:
            if buckets and not self.has_majority(now_ms):
                # a majority went out of view while the round was open: commit nothing
                self.counters["round_no_majority"] += 1
            elif buckets:
                step0 = self.step
                self._reduce_and_apply(buckets, now_ms, loss_from)
                if self.step > step0:
                    if self.global_batch is not None and self.samples < self.train.local_steps * self.global_batch:
                        # "Shares": the round applied fewer samples than the global batch
                        # (ranks still measured or silent, caps, buckets the collection rule
                        # did not wait for), and says so
                        self.counters["rounds_below_global_batch"] += 1
                    for k, (_, n, _) in (col.received.items() if col is not None else
                                         ((self.id, buckets[0]),)):
                        self.applied_by[k] = self.applied_by.get(k, 0) + n
                    if col is not None:
                        self._charge_hold(col)
                        for k in minor:            # the wait for them, shared among them
                            self.held_ms[k] = self.held_ms.get(k, 0.0) + minor_wait_ms / len(minor)
            else:
                self.counters["empty_round"] += 1
        except Exception as exc:
            self._own_non_finite = False
            self._round_fault(f"{type(exc).__name__}: {exc}", now_ms)
            return
        own_non_finite, self._own_non_finite = self._own_non_finite, False
        if own_non_finite and not buckets:
            # "Leader: driving one round", step 5: nothing to apply because the leader's own
            # bucket was not finite: counted as diverged (a room whose every bucket is NaN stops
            # by the divergence rule), and the next round waits a beat instead of spinning
            self.diverged += 1
            self._phase = Phase.FAULT
            self._phase_deadline_ms = now_ms + self.policy.beat_ms
            return
        # yield between rounds: due now, and the driver yields unclamped before on_timer
        self._phase = Phase.YIELD
        self._phase_deadline_ms = now_ms

    def _finite_and_norm(self, col: _Collection | None, g: Any) -> tuple[bool, float | None]:
        """Whether bucket ``g``'s values are all finite, and its L2 norm when the round measures
        it (the clip rule): that norm, measured as the bucket arrives, is finite exactly when
        every value is (robust.l2_norm), so it is the finiteness check then, not a second pass."""
        if col is not None and self._measures_norms(col):
            norm = l2_norm(g)
            return math.isfinite(norm), norm
        return all_finite(g), None

    def _accumulate(self, col: _Collection, samples: int, g: Any) -> None:
        """Fold an accepted bucket into the round's running mean ("Leader: driving one round",
        step 7), weighted by its samples over the planned global batch: when every assigned
        bucket arrives unclipped, the mean is ready when the last one is (bit-identical to
        reducing them all then, vec.RunningMean); otherwise the round is reduced anew. Only
        under the weighted mean, and where it pays (vec.RunningMean.worth)."""
        if self.aggregate == "trimmed-mean" or not RunningMean.worth(g):
            return
        planned = self.train.local_steps * sum(col.shares.values())
        if planned > 0:   # the round's last bucket is folded in with the rounding, at the reduce
            self._running_mean.add(g, samples / planned, last=len(col.received) == len(col.wanted))

    def _measures_norms(self, col: _Collection) -> bool:
        """Whether the buckets of ``col`` are measured (their L2 norms) as they are accepted: under
        the clip rule, in a round with other ranks than the leader. The buckets that arrive while
        the round still waits for others are measured then, not after the last one, on the
        round's critical path ("Robust aggregation at the leader")."""
        return self.aggregate == "clip" and len(col.wanted) > 1

    def _robust(self, col: _Collection, now_ms: float) -> dict[int, tuple[float, int, Any]]:
        """"Untrusted ranks": bound every bucket's norm relative to the cohort's (clip rule), and
        quarantine a rank whose buckets keep being clipped far past the bound."""
        received = col.received
        if self.aggregate != "clip" or len(received) < 2:
            return received
        contributors = ({k for k in received if k != self.id and not self.may_lead_rank(k)}
                        if self.roles_enforced else set())
        # "Untrusted ranks", trainers: while the server names roles, a rank it named may lead
        # holds the leader's credential; its norm counts twice in the reference, as the
        # leader's does, and it is never quarantined
        trainers = ({k for k in received if k != self.id and k not in contributors}
                    if self.roles_enforced else set())
        out, clipped = clip_to_median_norm(received, self.id, norms=col.norms, contributors=contributors,
                                           trainers=trainers)
        if contributors:
            self._watch_pushes(col, out, contributors, now_ms)
        for k in received:
            if k == self.id:
                continue
            if k in clipped:
                self.clipped[k] += 1
                self.counters["buckets_clipped"] += 1
            if k in trainers:
                continue
            hist = self._clip_recent.setdefault(k, deque(maxlen=_CLIP_WINDOW))
            hist.append(clipped.get(k, 0.0) >= _QUARANTINE_CLIP_RATIO)
            if sum(hist) >= _CLIP_QUARANTINE and k not in self.quarantined:
                self._quarantine(k, now_ms)
                hist.clear()
        return out

    def _quarantine(self, k: int, now_ms: float) -> None:
        """"Untrusted ranks": no share for _QUARANTINE_MS, doubled at each further quarantine up to 64 x."""
        self._quarantines[k] += 1
        self.quarantined[k] = now_ms + _QUARANTINE_MS * 2 ** min(6, self._quarantines[k] - 1)
        self.counters["quarantined"] += 1

    def _watch_pushes(self, col: _Collection, out: dict[int, tuple[float, int, Any]], contributors: set[int],
                      now_ms: float) -> None:
        """"Untrusted ranks", a contributor's steady push: each contributor's bucket (as sent,
        before clipping) against the round's trusted mean (the buckets of the ranks that may
        lead); a rank whose mean residual stays long against its own RMS is quarantined
        (robust.BiasMonitor). Its rows are the key of its window within the training set: a
        rank given the same rows round after round is not judged."""
        trusted = [b for k, b in out.items() if k not in contributors]
        total = sum(s for _, s, _ in trusted)
        if not trusted or total <= 0:
            return
        mean = weighted_mean([g for _, _, g in trusted], [s / total for _, s, _ in trusted])
        n = self._train_len()
        h = self.train.local_steps
        for k in sorted(contributors):
            offset, span = col.assign.get(k, 0), max(1, h * col.shares.get(k, 1))
            rows = ((offset % n) if n is not None else offset) // span
            ratio = self._bias.observe(k, col.received[k][2], mean, rows=rows)
            if self._bias.biased(ratio) and k not in self.quarantined:
                self._quarantine(k, now_ms)
                self.counters["quarantined_for_push"] += 1
                self._bias.forget(k)

    def _reduce_and_apply(self, buckets: list[tuple[float, int, Any]], now_ms: float,
                          loss_from: list[tuple[float, int, Any]] | None = None) -> None:
        total = sum(s for _, s, _ in buckets)
        weights = [s / total for _, s, _ in buckets]
        # the round's loss: sample-weighted over ``loss_from`` when given ("Untrusted ranks")
        src = buckets if loss_from is None else loss_from
        lt = sum(s for _, s, _ in src)
        loss = sum(s / lt * l for l, s, _ in src)
        if self.aggregate == "trimmed-mean":
            avg = trimmed_mean([g for _, _, g in buckets], [s for _, s, _ in buckets])
        else:
            vectors = [g for _, _, g in buckets]
            avg = self._running_mean.result(vectors, weights)
            if avg is None:
                avg = weighted_mean(vectors, weights)
            else:
                self.counters["rounds_reduced_on_arrival"] += 1
        self._running_mean.reset()
        if not all_finite(avg):
            self.drops["reduce_non_finite"] += 1
            self.counters["empty_round"] += 1
            return
        state = None
        if self.train.stateful:
            # "Local steps and optimizer state": the outer step with the carried state
            after, state = outer_step(self.worker.params(), avg, self.lr, self.opt_state,
                                      self.train.outer_momentum)
            if all_finite(after):
                self.worker.set_params(after)
        else:
            self.worker.apply(avg, self.lr)
            after = self.worker.params()
        if not all_finite(after) or (state is not None and not all_finite(state)):
            # the update overflowed float32: keep the round's (finite) parameters, publish
            # nothing new and say so ("Leader: driving one round", step 8)
            self.diverged += 1
            self.fault = (f"diverged: the update of step {self.step} made parameters non-finite "
                          f"(lr {self.lr:g}); kept the last finite parameters")
            if self._round_params is not None:
                self.worker.set_params(self._round_params)
            self.counters["apply_non_finite"] += 1
            self.counters["empty_round"] += 1
            return
        q = self.link.quantize(after)
        if q is not None:
            self.worker.set_params(q)
        if state is not None:
            # the state too is held as peers decode it, so a new leader resumes from the same bits
            qs = self.link.quantize(state)
            self.opt_state = qs if qs is not None else state
        self.step += 1
        self.loss = float(loss)
        self.samples = int(total)
        self._applied_steps += 1
        self._applied_samples += int(total)
        self.counters["buckets_reduced"] += len(buckets)
        if self.eval_every > 0 and self.step % self.eval_every == 0:
            self._evaluate()

    def evaluate_now(self) -> None:
        """Evaluate the parameters held now, unless this step was evaluated already (and when
        the room evaluates at all, ``eval_every > 0``): a leader's checkpoint upload, periodic
        or final, then carries the accuracy of its own parameters (:attr:`accuracy_now`), not
        one measured up to ``eval_every - 1`` steps earlier or none (a run that stopped between
        two evaluations stored its final model with no accuracy). A failure here is only
        counted (``evaluate_failed``, ``evaluate_out_of_range``; PROTOCOL.md "Worker
        contract"): the evaluations every ``eval_every`` steps are the ones that judge the job."""
        if self.eval_every > 0 and self._evaluated_step != (self.term, self.step):
            self._evaluate(on_demand=True)

    def _evaluate(self, *, on_demand: bool = False) -> None:
        """The job's held-out accuracy of the parameters held, into :attr:`accuracy` (None when
        evaluate() raised or answered outside [0, 1]). ``on_demand`` (:meth:`evaluate_now`): a
        failure is counted (``evaluate_failed``) but is no fault and no step towards stopping a
        failing job (the scheduled evaluations judge it, and at stop its real fault stays the
        one reported)."""
        self._evaluated_step = (self.term, self.step)
        try:
            acc = float(self.worker.evaluate())
        except Exception as exc:
            if on_demand:
                self.accuracy = None
                self.counters["evaluate_failed"] += 1
                return
            # "Worker contract": a job's evaluate() that raises leaves the round applied and
            # the accuracy unknown; it is not a round fault (which waited a beat after each
            # evaluation: a room ran 200 x slower with no word why). The runtime reads the
            # exception (take_evaluate_error) to say where, and stops a job that keeps failing
            self.accuracy = None
            self.counters["evaluate_failed"] += 1
            self.evaluate_failures += 1
            self.fault = f"evaluate() raised {type(exc).__name__}: {str(exc)[:160]}"
            self._evaluate_error = exc
            return
        if not on_demand:
            # (the scheduled evaluations judge the job: an upload's that works between two that
            # raised must not restart the count, or a job whose scheduled evaluate() always
            # raised was never stopped while checkpoints were uploaded in between)
            self.evaluate_failures = 0
        if 0.0 <= acc <= 1.0:
            self.accuracy = acc
        else:
            # "Worker contract": evaluate() is a held-out accuracy in [0, 1]. A report
            # carrying anything else is dropped whole at the server (its step and lead
            # with it), so the accuracy is reported as unknown and the fault counted
            self.accuracy = None
            self.counters["evaluate_out_of_range"] += 1

    def _round_fault(self, error: str, now_ms: float) -> None:
        self.fault = error
        self.counters["round_fault"] += 1
        self._collection = None
        self._running_mean.reset()
        self._own_bucket = None
        self._phase = Phase.FAULT
        self._phase_deadline_ms = now_ms + self.policy.beat_ms
        self._report(now_ms)

    def _publish(self, now_ms: float) -> None:
        """Send the final parameters with an empty assignment ("Publish"), and remember the
        final (term, step) for the re-publish rule (:meth:`_republish`)."""
        self.counters["published"] += 1
        self._final = (self.term, self.step, now_ms)
        self._republished = {}
        self._actions.append(Post(self._publish_msg()))

    def _republish(self, now_ms: float) -> None:
        """PROTOCOL.md, "Publish": at a heartbeat, send the publish again, addressed, to each
        live member that still announces a (term, step) below the published one although it
        was heard from at least a beat after this rank's last send to it; at most
        :data:`REPUBLISH_MAX` times per member. Ends when this rank runs again or its own
        (term, step) moved on (it led or adopted a newer round), or a live member announces a
        newer (term, step) than the publish: the cohort went on under another leader, whose
        rounds carry newer parameters to the members behind."""
        if self._final is None:
            return
        term, step, at_ms = self._final
        live = list(self.roster.live(now_ms, self.policy.drop_ms))
        if self.running or (self.term, self.step) != (term, step) or any((m.term, m.step) > (term, step)
                                                                          for m in live):
            self._final = None
            return
        for m in live:
            if (m.term, m.step) >= (term, step):
                continue
            sent, last_ms = self._republished.get(m.id, (0, at_ms))
            if sent >= REPUBLISH_MAX or m.seen_ms - last_ms < self.policy.beat_ms:
                continue
            self._republished[m.id] = (sent + 1, now_ms)
            self.counters["republished"] += 1
            self._actions.append(Post({**self._publish_msg(), "to": m.id}))

    def republish_pending(self, now_ms: float) -> bool:
        """Whether a live member still announces a (term, step) below this rank's final publish
        and may be sent it again ("Publish", re-publish): a runtime that is leaving waits
        (bounded) while this holds, so the re-sends happen before it goes."""
        if self._final is None or self.running or (self.term, self.step) != self._final[:2]:
            return False
        at_ms = self._final[2]
        live = list(self.roster.live(now_ms, self.policy.drop_ms))
        if any((m.term, m.step) > self._final[:2] for m in live):
            return False                 # the cohort went on under another leader
        # (a member last heard before the publish may have it and left: it is not waited for)
        return any((m.term, m.step) < self._final[:2] and m.seen_ms > at_ms
                   and self._republished.get(m.id, (0, 0.0))[0] < REPUBLISH_MAX
                   for m in live)

    def _publish_msg(self) -> dict:
        return {"t": "round", "from": self.id, "step": self.step, "term": self.term, "lr": self.lr, "assign": {},
                "shares": {}, "cursor": self.cursor,
                "params": self.worker.params(), "loss": self.loss, "samples": self.samples,
                "cohort": len(self.cohort_ids(self._last_input_ms)), "opt": self._carried_state()}
