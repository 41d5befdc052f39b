"""Float32 vector helpers that work with or without numpy.

A *vector* is a numpy ``float32`` array when numpy is importable, else ``array.array('f')``.
Only the few operations the protocol needs live here (length, finiteness, the
sample-weighted mean of PROTOCOL.md "Leader: driving one round", step 7).
"""

from __future__ import annotations

import math
from array import array
from typing import Any, Sequence

from ._compat import np


def to_vector(values: Any) -> Any:
    """Return ``values`` as this process's vector type (float32), copying.

    Args:
        values: numpy array, ``array.array`` or a sequence of floats.
    """
    if np is not None:
        return np.array(values, dtype=np.float32, copy=True).reshape(-1)
    if isinstance(values, array) and values.typecode == "f":
        return array("f", values)
    return array("f", [float(v) for v in values])


def is_vector(v: Any) -> bool:
    """Whether ``v`` is a float vector as the codecs decode one (and so one :func:`all_finite`,
    :func:`weighted_mean` and a worker take): a 1-D numpy array of a floating dtype, or an
    ``array.array`` of typecode ``'f'`` or ``'d'``. A message's ``params``, ``g`` or ``opt`` of
    any other type is malformed (PROTOCOL.md "Messages": the machine drops it, never raises)."""
    if np is not None and isinstance(v, np.ndarray):
        return v.ndim == 1 and v.dtype.kind == "f"
    return isinstance(v, array) and v.typecode in "fd"


#: elements per block of the numpy paths below: the temporaries stay in cache (512 KiB of
#: float64) instead of a full-length float64 copy per vector (page faults on every round)
BLOCK = 1 << 16


def all_finite(v: Any) -> bool:
    """True when every element of ``v`` is finite (no NaN, no +-inf)."""
    if np is not None and isinstance(v, np.ndarray):
        flat = v.reshape(-1)
        n = len(flat)
        if n <= BLOCK:
            return bool(np.isfinite(flat).all())
        buf = np.empty(BLOCK, dtype=bool)
        for a in range(0, n, BLOCK):
            b = min(n, a + BLOCK)
            if not np.isfinite(flat[a:b], out=buf[:b - a]).all():
                return False
        return True
    if isinstance(v, array) and v.typecode == "f":
        # float32 values summed in float64 cannot overflow (n * 3.4e38 < 1.8e308 for any n that
        # fits in memory), so the sum is finite exactly when every element is: one C loop
        return math.isfinite(sum(v))
    isfinite = math.isfinite
    for x in v:
        if not isfinite(x):
            return False
    return True


def weighted_mean(vectors: Sequence[Any], weights: Sequence[float]) -> Any:
    """``sum_i weights[i] * vectors[i]``, accumulated in float64, returned as float32.

    Args:
        vectors: equal-length float32 vectors, shape (bucket_len,).
        weights: one weight per vector (callers pass ``samples_i / sum(samples)``).

    Returns:
        A float32 vector of shape (bucket_len,): a copy of the one vector, bit for bit, when
        there is one with weight 1.0 (a round the leader computed alone, PROTOCOL.md "Leader:
        driving one round", step 7), so ``0.0 + 1.0 * -0.0`` does not turn its signed zeros
        into ``+0.0`` and the copy costs no arithmetic.
    """
    if len(vectors) == 1 and float(weights[0]) == 1.0:
        return to_vector(vectors[0])
    if np is not None:
        return _weighted_mean_np(vectors, weights)
    # the same float64 operations in the same order as the numpy path (``0.0 + w * x`` first,
    # so a -0.0 element gives +0.0 there too), as list comprehensions: no index arithmetic
    acc = None
    for w, v in zip(weights, vectors):
        acc = _fold_list(acc, float(w), v)
    return array("f", acc)


def _fold_list(acc: list[float] | None, w: float, v: Any) -> list[float]:
    """``(0.0 if acc is None else acc) + w * v`` elementwise in float64, as a new list (the
    pure-Python reduce: ``0.0 + w * x`` first, so a -0.0 element gives +0.0 as numpy's does)."""
    if acc is None:
        return [0.0 + w * x for x in v]
    return [a + w * x for a, x in zip(acc, v)]


def _weighted_mean_np(vectors: Sequence[Any], weights: Sequence[float]) -> Any:
    """The numpy path: per block of :data:`BLOCK` elements, ``acc = 0; acc += float(w) *
    float64(v)`` for each vector in order, then rounded to float32. The same IEEE operations on
    each element as one full-length float64 accumulation (so bit-identical to it), without
    full-length float64 temporaries."""
    vs = [np.asarray(v).reshape(-1) for v in vectors]
    ws = [float(w) for w in weights]
    n = len(vs[0])
    out = np.empty(n, dtype=np.float32)
    m = min(n, BLOCK)
    acc = np.empty(m, dtype=np.float64)
    tmp = np.empty(m, dtype=np.float64)
    for a in range(0, n, BLOCK):
        b = min(n, a + BLOCK)
        k = b - a
        acc_k, tmp_k = acc[:k], tmp[:k]
        for i, (w, v) in enumerate(zip(ws, vs)):
            tmp_k[...] = v[a:b]   # exact (float32 -> float64)
            tmp_k *= w
            if i:
                acc_k += tmp_k
            else:                 # ``0.0 + w * x`` (a -0.0 gives +0.0), with no pass to zero acc
                np.add(tmp_k, 0.0, out=acc_k)
        out[a:b] = acc_k
    return out


class RunningMean:
    """:func:`weighted_mean` accumulated as the vectors arrive, so a leader's reduce is done by
    the time the last bucket of a round is in (PROTOCOL.md "Leader: driving one round", step 7:
    the sample-weighted mean; its weights ``samples_i / S`` are known in advance when ``S`` is
    the round's planned global batch).

    :meth:`add` folds one float32 vector of shape ``(n,)`` with its weight into a float64 sum
    of shape ``(n,)``: a numpy array held across rounds (``8 n`` bytes, allocated once per
    length: no page faults per round), or a list of floats for ``array('f')`` vectors (no
    numpy, as in a tab). :meth:`result` returns the float32 mean only for exactly the vectors
    added, the same objects in the same order with equal weights, and then bit-identical to
    ``weighted_mean(vectors, weights)`` (the same float64 operations on each element in the same
    order: ``0.0 + w_0 v_0``, then ``+ w_i v_i``); otherwise ``None`` and the caller reduces anew.
    """

    __slots__ = ("_acc", "_tmp", "_vectors", "_weights", "_n", "_deferred")

    def __init__(self) -> None:
        self._acc: Any = None
        self._tmp: Any = None
        self._vectors: list[Any] = []
        self._weights: list[float] = []
        self._n = 0
        self._deferred = False

    @staticmethod
    def worth(v: Any) -> bool:
        """Whether folding ``v`` in as it arrives shortens the reduce at the end: a numpy vector
        of at least :data:`BLOCK` elements (below that its reduce is shorter than the
        bookkeeping), or, without numpy, any ``array('f')`` vector (the pure-Python reduce costs
        per element)."""
        if np is not None:   # (an array('f') here goes through numpy at the end, faster than folding it)
            return isinstance(v, np.ndarray) and len(v) >= BLOCK
        return isinstance(v, array) and v.typecode == "f"

    def reset(self) -> None:
        """Forget the vectors added (a numpy sum's buffers stay for the next round)."""
        self._vectors, self._weights, self._n, self._deferred = [], [], 0, False
        if isinstance(self._acc, list):
            self._acc = None

    def release(self) -> None:
        """:meth:`reset`, and free the buffers (``8 n`` bytes): this rank no longer leads."""
        self.reset()
        self._acc = self._tmp = None

    def add(self, v: Any, w: float, *, last: bool = False) -> None:
        """Fold ``w * v`` into the sum (``v`` a numpy float32 vector or an ``array('f')``;
        anything else, another kind than the first vector's, or another length, stops the
        accumulation until :meth:`reset`). ``last``: the caller expects no further vector; it is
        then folded in by :meth:`result`, together with the rounding to float32 (one pass over
        the sum, not two)."""
        if self._n < 0:
            return
        kind = _kind(v)
        if kind is None or (self._vectors and (len(v) != self._n or kind != _kind(self._vectors[0]))):
            self._n = -1
            return
        if self._deferred:   # "last" was not: fold it in now
            self._deferred = False
            self._fold(self._vectors[-1], self._weights[-1], first=len(self._vectors) == 1)
        n, w = len(v), float(w)
        if kind == "np" and (self._acc is None or not isinstance(self._acc, np.ndarray) or len(self._acc) != n):
            self._acc = np.empty(n, dtype=np.float64)
            self._tmp = np.empty(min(n, BLOCK), dtype=np.float64)
        self._n = n
        self._vectors.append(v)
        self._weights.append(w)
        if last:
            self._deferred = True
        else:
            self._fold(v, w, first=len(self._vectors) == 1)

    def _fold(self, v: Any, w: float, *, first: bool, out: bool = False) -> Any:
        """``acc = (0.0 if first else acc) + w * float64(v)``, as :func:`weighted_mean` does it
        (numpy: per block, the temporary in cache); with ``out``, rounded to float32 and
        returned (numpy: block by block as each is summed)."""
        if not isinstance(v, np.ndarray if np is not None else ()):
            self._acc = _fold_list(None if first else self._acc, w, v)
            return array("f", self._acc) if out else None
        acc = self._acc
        n = len(acc)
        res = np.empty(n, dtype=np.float32) if out else None
        for a in range(0, n, BLOCK):
            b = min(n, a + BLOCK)
            tmp = self._tmp[:b - a]
            tmp[...] = v[a:b]          # exact (float32 -> float64)
            tmp *= w
            blk = acc[a:b]
            if first:             # ``0.0 + w * x`` (a -0.0 gives +0.0), with no pass to zero acc
                np.add(tmp, 0.0, out=blk)
            else:
                blk += tmp
            if res is not None:
                res[a:b] = blk
        return res

    def result(self, vectors: Sequence[Any], weights: Sequence[float]) -> Any:
        """The float32 mean of ``vectors`` when they are exactly those added (see the class),
        else ``None``."""
        if self._n <= 0 or len(vectors) != len(self._vectors) or len(vectors) < 2:
            return None
        for v, mine, w, w_mine in zip(vectors, self._vectors, weights, self._weights):
            if v is not mine or float(w) != w_mine:
                return None
        if not self._deferred:
            acc = self._acc
            return acc.astype(np.float32) if np is not None and isinstance(acc, np.ndarray) else array("f", acc)
        self._deferred = False
        self._n = -1            # the sum now holds the last vector too: no further answer
        return self._fold(self._vectors[-1], self._weights[-1], first=len(self._vectors) == 1, out=True)


def _kind(v: Any) -> str | None:
    """``"np"`` for a 1-D numpy float32 vector, ``"array"`` for an ``array('f')``, else None."""
    if np is not None and isinstance(v, np.ndarray):
        return "np" if v.dtype == np.float32 and v.ndim == 1 else None
    return "array" if isinstance(v, array) and v.typecode == "f" else None


def digest(v: Any) -> str:
    """SHA-256 hex of the vector's float32 little-endian bytes (for bit-identity checks)."""
    import hashlib
    import sys

    if np is not None and isinstance(v, np.ndarray):
        data = np.asarray(v, dtype="<f4").tobytes()
    else:
        a = array("f", v)
        if sys.byteorder != "little":  # pragma: no cover
            a.byteswap()
        data = a.tobytes()
    return hashlib.sha256(data).hexdigest()
