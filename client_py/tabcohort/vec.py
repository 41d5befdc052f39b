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
    pairs = iter(zip(weights, vectors))
    w, v = next(pairs)
    w = float(w)
    acc = [0.0 + w * x for x in v]
    for w, v in pairs:
        w = float(w)
        acc = [a + w * x for a, x in zip(acc, v)]
    return array("f", acc)


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
        acc_k.fill(0.0)
        for w, v in zip(ws, vs):
            tmp_k[...] = v[a:b]   # exact (float32 -> float64)
            tmp_k *= w
            acc_k += tmp_k
        out[a:b] = acc_k
    return out


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
