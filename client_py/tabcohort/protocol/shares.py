"""Speed-proportional shares of a fixed global batch (PROTOCOL.md, "Shares").

Pure functions and a small estimator; no clock reads (times come in as arguments).

Each rank's bucket turnaround (from the round being sent to its bucket arriving) is modelled
as ``t(s) = a + b * s`` for a share of ``s`` samples: ``a`` is the rank's fixed cost per round
(latency, a tab's page-worker hops), ``b`` its time per sample. Both come from an
exponentially weighted least-squares fit over the rank's recent buckets. The leader then picks
the shares that make every bucket arrive at the same time ``T`` (``a_k + b_k s_k = T``, the
shares summing to the global batch), so no rank waits for another; a rank whose one-sample
bucket (``a_k + b_k``) is predicted later than ``SLOW_MARGIN * T`` (1.05 T), or whose fixed cost
alone reaches ``T``, gets no share (one sample from it would make it the last bucket), unless the
other ranks' caps cannot cover the global batch without it.

A round ends with its last bucket, so a rank whose turnaround jitters (a tab's garbage
collection, a busy relay) delays the round whenever it is late even when it is on time on
average. Each rank's lateness (the root mean square of how much later than predicted its
buckets arrived, an EWMA) is added to its fixed cost: such a rank is planned to finish early
by that much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

#: weight of the newest bucket in a rank's turnaround statistics (EWMA)
SPEED_ALPHA = 0.3
#: a rank whose one-sample bucket is predicted later than this factor of the round's time gets
#: no share in that round
SLOW_MARGIN = 1.05
#: a rank with no share is probed with one sample every this many rounds, and at most once per
#: PROBE_INTERVAL_MS (milliseconds): a fast cohort would otherwise probe a slow tab hundreds of
#: times a second, each probe a bucket the tab computes for nothing
PROBE_EVERY = 8
PROBE_INTERVAL_MS = 250.0
#: a rank with no share in a round is sent it only if the leader's last broadcast round is
#: this old (milliseconds): it follows at most about 1000 / FOLLOW_INTERVAL_MS rounds per second
FOLLOW_INTERVAL_MS = 50.0
#: bytes per second of rounds the leader sends a rank outside the round's shares (its follow
#: rounds and its probes), at most: the intervals above are stretched to this for a large model
#: (at 4 bytes a parameter, 1.1M parameters: one round per 560 ms), up to a quarter of the
#: takeover time (see :func:`paced_interval_ms`)
FOLLOW_BYTES_PER_S = 8_000_000
#: how many of a rank's lateness (RMS of its buckets' arrival after the predicted time) it is
#: planned to finish before the others
LATENESS_MARGIN = 1.0
#: the leader plans shares afresh at most this often (milliseconds) while the ranks it plans
#: for, their caps and which of them have history stay the same, and at every probe round:
#: planning is per-rank work that took about a tenth of a leader's CPU at 5,000 rounds/s, and
#: the estimates it reads move by one EWMA step per bucket, not within a few rounds
REPLAN_INTERVAL_MS = 2.0
#: the time per sample the plan counts for a rank is at least this fraction of its one-sample
#: turnaround: a rank whose turnaround does not grow with its share (a GPU, a fixed per-round
#: cost) fits ``b`` near 0, and the equal-finish time ``T`` then sums terms ``a / b`` of 1e17,
#: whose rounding put ``T`` below ``a`` (negative shares: a 1,000-rank round planned 2 samples
#: of its 2,000). At 1e-6 the plan is well conditioned and the rank still counts as free per sample.
PLAN_MIN_PER_SAMPLE = 1e-6
#: a bucket handled at most CENSOR_WINDOW_MS (plus CENSOR_WINDOW_FRACTION of the leader's own
#: turnaround) after the leader's own bucket of its round may have waited behind the leader's
#: compute (a rank's event loop reads nothing while its job computes): its turnaround is an upper
#: bound, and it is counted as CENSORED_CREDIT of the smaller of it and the rank's prediction, so
#: such a rank's share grows until its buckets arrive measurably after the leader's own
CENSOR_WINDOW_MS = 0.5
CENSOR_WINDOW_FRACTION = 0.02
CENSORED_CREDIT = 0.65
#: a leader whose own compute holds its loop is planned to be ready this fraction of its own
#: turnaround before the others' buckets, scaled by ``1 - 2 f`` (``f`` its part of the global
#: batch; nothing from half on): see :func:`lead_head_start_ms`
LEAD_HEAD_START_FRACTION = 0.4


def lead_head_start_ms(own_turnaround_ms: float, own_fraction: float) -> float:
    """How much earlier (milliseconds) than the other ranks' buckets a leader whose compute holds
    its loop plans its own to be ready ("Shares"): ``LEAD_HEAD_START_FRACTION`` of its own last
    turnaround ``own_turnaround_ms``, times ``1 - 2 own_fraction`` (its share of the last round
    over the global batch), at least 0. Buckets that then arrive as planned find the leader
    reading, and are measured as they arrive instead of counted as early; its idle time costs
    the cohort about its own part of the compute, so a leader with half of it or more has none."""
    if not math.isfinite(own_turnaround_ms) or not math.isfinite(own_fraction):
        return 0.0
    return LEAD_HEAD_START_FRACTION * max(0.0, own_turnaround_ms) * max(0.0, 1.0 - 2.0 * own_fraction)


def censor_window_ms(own_turnaround_ms: float) -> float:
    """How long after the leader's own bucket (of a round its turnaround ``own_turnaround_ms``,
    milliseconds) another rank's bucket still counts as having queued behind it ("Shares")."""
    return CENSOR_WINDOW_MS + CENSOR_WINDOW_FRACTION * max(0.0, own_turnaround_ms)


@dataclass
class Speed:
    """Exponentially weighted moments of one rank's (share, turnaround) observations."""

    m_s: float
    m_t: float
    m_ss: float
    m_st: float
    n: int = 1
    #: EWMA of the squared lateness (ms^2): how much later than the model predicted the
    #: rank's buckets arrived (early arrivals count 0)
    m_late2: float = 0.0
    #: the fit of the current moments (``None``: not computed since they last changed)
    _fit: tuple[float, float] | None = field(default=None, repr=False, compare=False)

    def model(self) -> tuple[float, float]:
        """``(a_ms, b_ms_per_sample)`` of ``t(s) = a + b s``, both >= 0, ``b > 0``."""
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float]:
        var = self.m_ss - self.m_s * self.m_s
        if self.n >= 3 and var > (0.05 * self.m_s) ** 2:
            b = (self.m_st - self.m_s * self.m_t) / var
            a = self.m_t - b * self.m_s
            if b > 0 and a >= 0:
                return a, b
            if b > 0:                      # a < 0: noise; all of it per sample
                return 0.0, self.m_t / self.m_s
        # one share size seen so far: the time cannot be split, count it all per sample
        # except what the smallest observations say is fixed
        return 0.0, max(self.m_t, 1e-6) / max(self.m_s, 1e-9)

    def lateness_ms(self) -> float:
        """The RMS of the rank's lateness, ms (each bucket's arrival after the model's
        prediction, at most the prediction itself)."""
        return math.sqrt(self.m_late2)

    @property
    def samples_per_s(self) -> float:
        return 1000.0 * self.m_s / max(self.m_t, 1e-6)


@dataclass
class SpeedTable:
    """Per-rank turnaround statistics, fed by the leader as buckets arrive."""

    speeds: dict[int, Speed] = field(default_factory=dict)

    def observe(self, rank: int, samples: int, turnaround_ms: float, *, censored: bool = False) -> None:
        """A bucket of ``samples`` samples arrived ``turnaround_ms`` after its round was sent.

        ``censored``: it may have waited behind the leader's own compute (PROTOCOL.md "Shares"),
        so ``turnaround_ms`` is an upper bound: counted as :data:`CENSORED_CREDIT` of the smaller
        of it and the rank's prediction."""
        if samples <= 0 or not math.isfinite(turnaround_ms) or turnaround_ms < 0:
            return
        s, t = float(samples), max(0.01, float(turnaround_ms))
        sp = self.speeds.get(rank)
        if censored:
            if sp is not None:
                fa, fb = sp.model()
                t = min(t, fa + fb * s)
            t *= CENSORED_CREDIT
        if sp is None:
            self.speeds[rank] = Speed(s, t, s * s, s * t)
            return
        a = SPEED_ALPHA
        # lateness against the model the leader plans with (the fit, or its fallback), on every
        # bucket, probes too, so it follows the rank's current jitter and decays while the rank
        # only answers probes; at most the predicted turnaround itself, so neither one outlier
        # (a rank's 2 s pause) nor a fallback's error on a probe shuts a rank out for long
        fa, fb = sp.model()
        pred = fa + fb * s
        late = min(max(0.0, t - pred), pred)
        sp.m_late2 += a * (late * late - sp.m_late2)
        sp.m_s += a * (s - sp.m_s)
        sp.m_t += a * (t - sp.m_t)
        sp.m_ss += a * (s * s - sp.m_ss)
        sp.m_st += a * (s * t - sp.m_st)
        sp.n += 1
        sp._fit = None

    def forget(self, rank: int) -> None:
        self.speeds.pop(rank, None)

    def predicted_ms(self, rank: int, samples: int) -> float | None:
        """Predicted turnaround of a bucket of ``samples`` (None: no history)."""
        sp = self.speeds.get(rank)
        if sp is None:
            return None
        a, b = sp.model()
        return a + b * samples


def _equal_finish(total: float, ranks: Sequence[int], caps: Mapping[int, int],
                  models: Mapping[int, tuple[float, float]]) -> tuple[dict[int, float], set[int]]:
    """Fractional shares with ``a_k + b_k s_k`` equal for every rank not capped, summing to
    ``min(total, sum of caps)``; a rank whose fixed cost exceeds the common time is excluded
    while the others' caps still cover ``total`` (a fixed global batch is never cut short to
    leave a slow rank out)."""
    active = list(ranks)
    fixed: dict[int, float] = {}
    excluded: set[int] = set()
    while active:
        left = total - sum(fixed.values())
        inv = sum(1.0 / models[k][1] for k in active)
        T = (left + sum(models[k][0] / models[k][1] for k in active)) / inv
        # a rank whose one-sample bucket would arrive well after T: no share, if the others
        # can cover the round without it
        late = [k for k in active if models[k][0] + models[k][1] > SLOW_MARGIN * T or models[k][0] >= T]
        room = sum(caps[j] for j in active) + sum(fixed.values())
        late = [k for k in late if room - caps[k] >= total]
        if late and len(active) + len(fixed) > 1:
            worst = max(late, key=lambda k: (models[k][0] + models[k][1], k))
            active.remove(worst)
            excluded.add(worst)
            continue
        share = {k: (T - models[k][0]) / models[k][1] for k in active}
        over = [k for k in active if share[k] > caps[k]]
        if over:
            for k in over:
                fixed[k] = float(caps[k])
                active.remove(k)
            continue
        fixed.update(share)
        break
    return fixed, excluded


def _round_shares(frac: Mapping[int, float], caps: Mapping[int, int], total: int,
                  models: Mapping[int, tuple[float, float]] | None = None) -> dict[int, int]:
    """Integers from fractional shares by the largest remainder (ties: lower id), within caps,
    summing to ``min(total, sum of caps)``. With ``models`` (each rank's ``(a_ms,
    b_ms_per_sample)``), a rank whose bucket with the extra sample would be predicted later than
    :data:`SLOW_MARGIN` times the plan's finish time is passed over while another rank can take
    the sample (one sample of a slow rank costs many of a fast one), and among such ranks the
    one predicted to finish first takes it."""
    ints = {k: max(0, min(caps[k], int(math.floor(v + 1e-9)))) for k, v in frac.items()}
    left = min(total, sum(caps[k] for k in frac)) - sum(ints.values())
    order = sorted(frac, key=lambda k: (-(frac[k] - ints[k]), k))
    if models is not None and left > 0:
        finish = max((models[k][0] + models[k][1] * v for k, v in frac.items() if v > 0), default=0.0)
        after = {k: models[k][0] + models[k][1] * (ints[k] + 1) for k in order}
        late = sorted((k for k in order if after[k] > SLOW_MARGIN * finish), key=lambda k: (after[k], k))
        late_set = set(late)
        order = [k for k in order if k not in late_set] + late
    while left > 0:
        moved = False
        for k in order:
            if left <= 0:
                break
            if ints[k] < caps[k] and frac[k] > 0:
                ints[k] += 1
                left -= 1
                moved = True
        if not moved:
            break
    return ints


def plan_shares(total: int, ids: Sequence[int], caps: Mapping[int, int], table: SpeedTable, *,
                probe: bool = False, head_start_ms: Mapping[int, float] | None = None
                ) -> tuple[dict[int, int], set[int]]:
    """The shares of one round (PROTOCOL.md, "Shares").

    Args:
        total: the global batch (samples the round should cover), >= 1.
        ids: the cohort's ids.
        caps: each rank's declared maximum per bucket (its ``batch``), >= 1.
        table: the leader's turnaround statistics.
        probe: this round probes ranks that get no share with one sample each.
        head_start_ms: ranks planned to be ready this much (milliseconds) before the others
            (a leader whose compute holds its loop: :func:`lead_head_start_ms`).

    Returns:
        ``(shares, probing)``: samples per rank, each >= 1 (ranks with no share are left
        out), summing to ``min(total, sum of caps)`` (plus one per probe); and the ranks on a
        probe share (one sample for a rank that was given no share; a first share for a rank with
        no history), which are not to be awaited.
    """
    ids = sorted(ids)
    caps = {k: max(1, int(caps[k])) for k in ids}
    known = [k for k in ids if k in table.speeds]
    unknown = [k for k in ids if k not in table.speeds]
    shares: dict[int, int] = {}
    left = int(total)
    if not known:
        # nobody measured yet (a cohort's first round): equal shares within caps
        frac = {k: total / len(ids) for k in ids}
        for _ in range(len(ids)):
            over = [k for k in frac if frac[k] > caps[k]]
            if not over:
                break
            rest = [k for k in frac if k not in over]
            extra = sum(frac[k] - caps[k] for k in over)
            for k in over:
                frac[k] = float(caps[k])
            for k in rest:
                frac[k] += extra / len(rest)
        ints = _round_shares(frac, caps, left)
        return {k: v for k, v in ints.items() if v > 0}, set()
    # a rank with no history gets a small probe share first, not awaited: a new rank (a
    # silent one too, rejoining under a fresh id) never holds a round up before it is measured
    probing: set[int] = set()
    probe_share = max(1, left // (4 * len(ids)))
    for k in unknown:
        if left <= 0:
            break
        shares[k] = min(caps[k], probe_share, left)
        left -= shares[k]
        probing.add(k)
    models = {}
    for k in known:
        sp = table.speeds[k]
        a, b = sp.model()
        a += LATENESS_MARGIN * sp.lateness_ms()                  # a jittery rank finishes early
        if head_start_ms:
            h = head_start_ms.get(k, 0.0)
            a += h if math.isfinite(h) and h > 0 else 0.0
        models[k] = (a, max(b, PLAN_MIN_PER_SAMPLE * (a + b)))
    frac, excluded = _equal_finish(left, known, caps, models)
    ints = _round_shares(frac, {k: caps[k] for k in frac}, left, models)
    for k, v in ints.items():
        if v > 0:
            shares[k] = v
        else:
            excluded.add(k)
    if probe:
        for k in sorted(excluded):
            shares[k] = 1
            probing.add(k)
    return shares, probing


def paced_interval_ms(base_ms: float, round_bytes: int, takeover_ms: float) -> float:
    """The interval between rounds sent to a rank outside the shares (PROTOCOL.md, "Shares":
    followers without a share, probes): ``base_ms`` (:data:`FOLLOW_INTERVAL_MS`,
    :data:`PROBE_INTERVAL_MS`), stretched so those rounds stay within
    :data:`FOLLOW_BYTES_PER_S`, but never past ``takeover_ms / 4`` (a follower must see a round
    well within the takeover time, or it would take over from a live leader).

    Args:
        base_ms: the interval for a small model, milliseconds.
        round_bytes: the bytes of one round's vectors (4 per parameter and per optimizer-state
            value: the f32 size, an upper bound at lower wire precisions).
        takeover_ms: the policy's takeover time, milliseconds.

    Returns:
        Milliseconds, >= ``base_ms``.
    """
    return max(base_ms, min(takeover_ms / 4.0, 1000.0 * round_bytes / FOLLOW_BYTES_PER_S))
