"""Robust aggregation of a round's buckets at the leader (PROTOCOL.md, "Untrusted ranks").

Pure functions over float32 vectors (numpy arrays or ``array('f')``, see :mod:`tabcohort.vec`);
no clock reads.

- :func:`clip_to_median_norm` (the default): every bucket's L2 norm is bounded by
  ``factor`` x a reference norm, the median of the round's norms with the leader's own bucket
  counted twice (the leader holds the trainer credential; with one other bucket the median is
  then the leader's), and so is every bucket of another rank the server named a trainer. A
  bucket of ``s`` samples may be noisier than the leader's ``s0``-sample bucket by
  sqrt(s0 / s), so its bound grows by that factor. This is norm clipping relative to
  the cohort, as in centered clipping (Karimireddy, He and Jaggi, "Learning from History for
  Byzantine Robust Optimization", ICML 2021), with the median as the robust centre of norms.
- :func:`trimmed_mean` (``--aggregate trimmed-mean``): the coordinate-wise trimmed mean (Yin,
  Chen, Kannan and Bartlett, "Byzantine-Robust Distributed Learning: Towards Optimal
  Statistical Rates", ICML 2018): per coordinate, the lowest and highest ``trim`` fraction of
  the buckets are dropped and the rest averaged with their sample weights.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from typing import Any, Collection, Sequence

from .._compat import np
from .policy import AGGREGATES

#: a bucket's norm may be at most this multiple of the reference norm (before the share factor)
CLIP_FACTOR = 4.0

#: a contributor's bucket norm may be at most this multiple of the reference norm (before the
#: share factor): the median, not CLIP_FACTOR times it. A bucket at its bound moves the mean by
#: its weight times the bound in every round; a contributor is no trainer, and an honest one's
#: bucket is rarely much longer than the median (a small share's noise has the share factor)
CONTRIBUTOR_CLIP_FACTOR = 1.0

#: "Untrusted ranks", a contributor's steady push: weight of the newest bucket in the EWMA of a
#: contributor's residual (its bucket as sent, before clipping, minus the round's trusted mean)
BIAS_ALPHA = 1.0 / 32
#: buckets a contributor gives before its residual is judged (the EWMA's warm-up)
BIAS_MIN_BUCKETS = 32
#: the ratio ``|EWMA(r)| / sqrt(EWMA(|r|^2))`` above which a contributor is quarantined. For an
#: honest one the residual is zero-mean noise (it samples the same data at the same parameters
#: as the trainers), and the ratio settles near ``sqrt(alpha / (2 - alpha))`` = 0.13 in many
#: dimensions; a contributor that pushes one way round after round keeps it near 1.
BIAS_RATIO = 0.6
#: residuals longer than this are judged in a count sketch of this many dimensions (numpy): a
#: fixed random sign and slot per coordinate, which keeps lengths in expectation and maps a
#: push to a push, so the leader keeps 32 KiB per contributor, not 8 bytes per parameter
BIAS_SKETCH_DIM = 4096
#: a contributor is judged only while its last BIAS_MIN_BUCKETS windows fell on at least this
#: many distinct places of the training set: one given the same rows round after round (a global
#: batch that divides the training set's size) has a residual that is the difference of fixed
#: samples, honest and steady
BIAS_MIN_DISTINCT_ROWS = 24

#: a rank that may not lead (a contributor) is given at most this fraction of a round's global
#: batch, whatever its measured speed (PROTOCOL.md, "Untrusted ranks"). The clip rule bounds a
#: bucket's length, not its direction; its weight is its samples. One contributor at the bound
#: pointing anywhere then moves the mean by at most ``f * CONTRIBUTOR_CLIP_FACTOR`` reference
#: norms (times the share factor) against the honest ``1 - f``: with f = 1/8, 0.125 against
#: 0.875. Without it a contributor that answered at once was measured the fastest rank, given
#: half of every round, and its reversed steps took the model to a loss of 1e30 in two seconds.
CONTRIBUTOR_SHARE_FRACTION = 0.125


#: elements per block of :func:`l2_norm` (its temporaries stay in cache)
NORM_BLOCK = 1 << 16

#: a float32 sum of squares inside this range is taken as it is (:func:`l2_norm`): no square
#: overflowed (each is at most the sum) and squares that underflowed float32 (each below 1e-38,
#: at most 2**32 of them) are under 1e-8 of it
_FAST_SUM_RANGE = (1e-20, 1e30)


def l2_norm(v: Any) -> float:
    """Euclidean norm of a float32 vector, shape (n,), as a Python float, within a relative
    1e-6 of the exact one (measured at most 8e-8, on a constant vector).

    Finite exactly when every element is: a NaN gives NaN, an infinity ``inf``, and finite
    float32 values cannot overflow the float64 sum of the exact path (each square is below
    1.2e77), so the leader checks a bucket's values and measures it in one pass.

    With numpy, the fast path: per block of :data:`NORM_BLOCK` elements the squares in float32,
    summed by numpy's pairwise summation (error growing with the log of the block's length,
    not the length), the block sums added in float64. A sum outside :data:`_FAST_SUM_RANGE` (a
    value not finite, a square that overflowed or underflowed float32) is measured again on
    the exact path: float64 squares, per block. No BLAS: a BLAS dot's partial sums depend on
    the machine's thread count, and on a loaded 2-core host its threads made one 1M-element
    norm take 14 ms. Why float32 first: the float64 path (a converted copy of each block) took
    0.64 ms for 1M values against 0.29 ms, and under the clip rule every bucket of a round is
    measured at the leader, on the round's critical path (the ``bench/bench_anchors.py`` round
    at N = 4 measures four)."""
    if np is not None and isinstance(v, np.ndarray):
        flat = v.reshape(-1)
        n = len(flat)
        if flat.dtype == np.float32 and n:
            sq = np.empty(min(n, NORM_BLOCK), dtype=np.float32)
            total = 0.0
            with np.errstate(invalid="ignore", over="ignore", under="ignore"):
                for a in range(0, n, NORM_BLOCK):
                    s = flat[a:a + NORM_BLOCK]
                    q = sq[:len(s)]
                    np.multiply(s, s, out=q)
                    total += float(np.add.reduce(q))
            lo, hi = _FAST_SUM_RANGE
            if lo <= total <= hi:
                return math.sqrt(total)
        tmp = np.empty(min(n, NORM_BLOCK), dtype=np.float64)
        total = 0.0
        with np.errstate(invalid="ignore", over="ignore"):   # (a signalling NaN or inf: the sum says so)
            for a in range(0, n, NORM_BLOCK):
                b = min(n, a + NORM_BLOCK)
                t = tmp[:b - a]
                t[...] = flat[a:b]
                total += float(np.einsum("i,i->", t, t))
        return math.sqrt(total)
    s = 0.0
    for x in v:
        s += float(x) * float(x)
    return math.sqrt(s)


def _median(xs: Sequence[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


def _scaled(v: Any, c: float) -> Any:
    if np is not None and isinstance(v, np.ndarray):
        return (v.astype(np.float64) * c).astype(np.float32)
    return array("f", [float(x) * c for x in v])


def clip_to_median_norm(buckets: dict[int, tuple[float, int, Any]], own: int, *,
                        factor: float = CLIP_FACTOR,
                        norms: dict[int, float] | None = None,
                        contributors: Collection[int] = (),
                        contributor_factor: float = CONTRIBUTOR_CLIP_FACTOR,
                        trainers: Collection[int] = (),
                        ) -> tuple[dict[int, tuple[float, int, Any]], dict[int, float]]:
    """Bound each bucket's norm relative to the cohort's.

    Args:
        buckets: rank id -> ``(loss, samples, g)``, ``g`` a float32 vector of shape
            ``(bucket_len,)`` (finite: the leader checks that first).
        own: the leader's id (its bucket counts twice in the median); if absent, every bucket
            counts once.
        factor: the bound as a multiple of the reference norm (> 0).
        norms: rank id -> :func:`l2_norm` of its ``g``, already computed (the leader measures
            each bucket as it arrives); the others are computed here.
        contributors: ranks that may not lead: their bound is ``contributor_factor`` (not
            ``factor``) x the reference, times the share factor.
        trainers: other ranks the server named as holding the trainer credential: their norms
            count twice in the reference, as the leader's does.

    Returns:
        ``(buckets, clipped)``: the buckets with every over-long ``g`` scaled down onto its
        bound (others unchanged, the same objects), and rank id -> ratio of its norm to its
        bound for every bucket that was clipped.
    """
    known = norms or {}
    norms = {k: known[k] if k in known else l2_norm(b[2]) for k, b in buckets.items()}
    twice = [k for k in norms if k == own or k in trainers]
    ref_norms = list(norms.values()) + [norms[k] for k in twice]
    ref = _median(ref_norms) if ref_norms else 0.0
    if not ref > 0 or not math.isfinite(ref):
        return buckets, {}
    s0 = buckets[own][1] if own in buckets else max(b[1] for b in buckets.values())
    out: dict[int, tuple[float, int, Any]] = {}
    clipped: dict[int, float] = {}
    for k, (loss, s, g) in buckets.items():
        bound = (contributor_factor if k in contributors else factor) * ref * max(1.0, math.sqrt(s0 / max(1, s)))
        n = norms[k]
        if k != own and (not math.isfinite(n) or n > bound):
            clipped[k] = n / bound if math.isfinite(n) else math.inf
            out[k] = (loss, s, _scaled(g, bound / n) if math.isfinite(n) and n > 0 else _scaled(g, 0.0))
        else:
            out[k] = (loss, s, g)
    return out, clipped


class BiasMonitor:
    """Each contributor's steady push, from its residuals (PROTOCOL.md, "Untrusted ranks").

    The clip rule bounds a bucket's length, not the direction it keeps taking: a contributor
    whose buckets point the same way round after round moves the model by its weight times its
    bound in every round, and honest buckets, mostly noise, do not hold it back. The residual
    ``r = g_k - m`` of a contributor's bucket as sent (before clipping) against the round's
    trusted mean ``m`` (the buckets of the ranks that may lead, sample-weighted) is zero-mean
    noise for an honest rank: both estimate the same gradient at the same parameters from the
    same data. The monitor keeps EWMAs of ``r`` and ``|r|^2`` per contributor; a mean residual
    long against its own RMS is a push. This is the "learning from history" idea of centered
    clipping (Karimireddy, He and Jaggi, ICML 2021) turned into a test per rank.

    Pure state, float64 vectors (numpy or lists); no clock reads. With numpy, a residual longer
    than ``sketch_dim`` is judged in a count sketch of that many dimensions (Charikar, Chen and
    Farach-Colton, "Finding frequent items in data streams", ICALP 2002): the state per
    contributor stays small whatever the model's size.
    """

    def __init__(self, *, alpha: float = BIAS_ALPHA, min_buckets: int = BIAS_MIN_BUCKETS,
                 ratio: float = BIAS_RATIO, sketch_dim: int = BIAS_SKETCH_DIM) -> None:
        self.alpha, self.min_buckets, self.ratio = float(alpha), int(min_buckets), float(ratio)
        self.sketch_dim = int(sketch_dim)
        self._sketch: tuple[int, Any, Any] | None = None   # (bucket_len, slot per coordinate, sign)
        self._mean: dict[int, Any] = {}       # rank -> EWMA of r, float64, shape (bucket_len,)
        self._ms: dict[int, float] = {}       # rank -> EWMA of |r|^2
        self._n: dict[int, int] = {}          # rank -> residuals seen
        self._rows: dict[int, deque] = {}     # rank -> keys of its last windows (their rows)

    def observe(self, k: int, g: Any, trusted_mean: Any, *, rows: Any = None) -> float | None:
        """Feed contributor ``k``'s bucket ``g`` (float32, shape ``(bucket_len,)``, finite) and
        the round's trusted mean (same shape). Returns the ratio ``|EWMA(r)| /
        sqrt(EWMA(|r|^2))`` once ``k`` has given ``min_buckets`` residuals, else ``None``;
        also ``None`` while the ``rows`` keys (where in the training set its bucket's samples
        were, any hashable) of its last ``min_buckets`` buckets take fewer than
        :data:`BIAS_MIN_DISTINCT_ROWS` values (``None``: not known, not checked)."""
        a = self.alpha
        recent = None
        if rows is not None:
            recent = self._rows.setdefault(k, deque(maxlen=self.min_buckets))
            recent.append(rows)
        if np is not None and isinstance(g, np.ndarray):
            r = g.astype(np.float64).reshape(-1) - np.asarray(trusted_mean, dtype=np.float64).reshape(-1)
            if len(r) > self.sketch_dim:
                r = self._sketched(r)
            rr = float(np.dot(r, r))
            m = self._mean.get(k)
            if m is None or len(m) != len(r):
                m = self._mean[k] = np.zeros(len(r), dtype=np.float64)
                self._ms[k], self._n[k] = 0.0, 0
            m *= 1.0 - a
            m += a * r
            mm = float(np.dot(m, m))
        else:
            r = [float(x) - float(y) for x, y in zip(g, trusted_mean)]
            rr = sum(x * x for x in r)
            m = self._mean.get(k)
            if m is None or len(m) != len(r):
                m = [0.0] * len(r)
                self._ms[k], self._n[k] = 0.0, 0
            m = self._mean[k] = [(1.0 - a) * x + a * y for x, y in zip(m, r)]
            mm = sum(x * x for x in m)
        self._ms[k] += a * (rr - self._ms[k])
        self._n[k] += 1
        if self._n[k] < self.min_buckets or not self._ms[k] > 0:
            return None
        if recent is not None and len(set(recent)) < min(BIAS_MIN_DISTINCT_ROWS, self.min_buckets):
            return None
        return math.sqrt(mm / self._ms[k])

    def _sketched(self, r: Any) -> Any:
        n = len(r)
        if self._sketch is None or self._sketch[0] != n:
            rng = np.random.default_rng(n)          # (fixed: the same sketch in every round)
            self._sketch = (n, rng.integers(0, self.sketch_dim, n), rng.choice((-1.0, 1.0), n))
        _, slot, sign = self._sketch
        return np.bincount(slot, weights=sign * r, minlength=self.sketch_dim)

    def biased(self, ratio: float | None) -> bool:
        """Whether a ratio :meth:`observe` returned says the rank pushes one way."""
        return ratio is not None and ratio > self.ratio

    def forget(self, k: int) -> None:
        """Drop ``k``'s history (it left, or was quarantined: it starts afresh)."""
        self._mean.pop(k, None)
        self._ms.pop(k, None)
        self._n.pop(k, None)
        self._rows.pop(k, None)

    def ranks(self) -> list[int]:
        return list(self._n)


def trimmed_mean(vectors: Sequence[Any], weights: Sequence[float], trim: float = 0.2) -> Any:
    """Coordinate-wise trimmed, weighted mean.

    Args:
        vectors: equal-length float32 vectors, shape ``(bucket_len,)``.
        weights: one non-negative weight per vector (samples).
        trim: fraction of the vectors dropped at each end per coordinate, in ``[0, 0.5)``;
            ``floor(trim * n)`` of them, at least one from 3 vectors on when ``trim > 0`` (none
            when ``n < 3``): PROTOCOL.md, "Untrusted ranks" (20 % at each end from 3 buckets).

    Returns:
        A float32 vector of shape ``(bucket_len,)``.
    """
    n = len(vectors)
    cut = max(1, int(math.floor(trim * n))) if n >= 3 and trim > 0 else 0
    if np is not None:
        m = np.stack([np.asarray(v, dtype=np.float64) for v in vectors])          # (n, len)
        w = np.asarray(weights, dtype=np.float64)
        order = np.argsort(m, axis=0, kind="stable")
        keep = order[cut:n - cut]                                                 # (n - 2 cut, len)
        vals = np.take_along_axis(m, keep, axis=0)
        ws = w[keep]
        return (np.sum(vals * ws, axis=0) / np.maximum(np.sum(ws, axis=0), 1e-300)).astype(np.float32)
    length = len(vectors[0])
    out = array("f", [0.0] * length)
    for i in range(length):
        col = sorted(((float(v[i]), float(w)) for v, w in zip(vectors, weights)), key=lambda t: t[0])
        col = col[cut:n - cut]
        tw = sum(w for _, w in col)
        out[i] = sum(x * w for x, w in col) / tw if tw > 0 else 0.0
    return out


__all__ = ["AGGREGATES", "BIAS_ALPHA", "BIAS_MIN_BUCKETS", "BIAS_MIN_DISTINCT_ROWS", "BIAS_RATIO", "BIAS_SKETCH_DIM", "BiasMonitor", "CLIP_FACTOR",
           "CONTRIBUTOR_CLIP_FACTOR", "CONTRIBUTOR_SHARE_FRACTION", "clip_to_median_norm", "l2_norm", "trimmed_mean"]
