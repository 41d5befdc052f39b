"""Pure parts of the collectives: signatures, shard bounds and reductions (no I/O).

Reductions run in rank order ``0 .. world-1`` on float32 values, so every rank that repeats
them gets the same bits; numpy and the stdlib path give identical results (an IEEE float32
``+``, ``*``, ``/`` computed in float64 and rounded once equals the float32 operation).
"""

from __future__ import annotations

import array
import math
from typing import Any, NamedTuple, Sequence

from .._compat import np

COLLS = {"all_reduce": 1, "broadcast": 2, "barrier": 3, "federated_average": 4}
COLL_NAMES = {v: k for k, v in COLLS.items()}
OPS = {"sum": 0, "mean": 1, "min": 2, "max": 3}
OP_NAMES = {v: k for k, v in OPS.items()}
PRECISIONS = {"f32": 0, "f16": 1, "bf16": 2, "int8": 3}
PREC_NAMES = {v: k for k, v in PRECISIONS.items()}
#: Shard boundaries are multiples of this (the default int8 block), so quantizing shards equals
#: quantizing the whole vector.
SHARD_UNIT = 256


class Sig(NamedTuple):
    """What every rank must agree on for one collective (travels in ``grad.samples``)."""

    coll: int
    op: int
    prec: int
    root: int
    n: int

    def pack(self, phase: int) -> int:
        return (self.coll << 60) | (phase << 56) | (self.op << 52) | (self.prec << 48) | (self.root << 32) | self.n

    @staticmethod
    def unpack(v: int) -> tuple["Sig", int]:
        return (Sig((v >> 60) & 0xF, (v >> 52) & 0xF, (v >> 48) & 0xF, (v >> 32) & 0xFFFF, v & 0xFFFFFFFF),
                (v >> 56) & 0xF)

    def describe(self) -> str:
        name = COLL_NAMES.get(self.coll, f"collective {self.coll}")
        extra = {1: f", op={OP_NAMES.get(self.op)!r}", 2: f", root={self.root}", 3: "", 4: ""}.get(self.coll, "")
        return f"{name}(n={self.n}{extra}, precision={PREC_NAMES.get(self.prec)!r})"


def shard_bounds(n: int, world: int) -> list[tuple[int, int]]:
    """Rank j owns ``[lo_j, hi_j)``: contiguous, ``SHARD_UNIT``-aligned, nearly equal."""
    units = -(-n // SHARD_UNIT)
    out = []
    for j in range(world):
        lo = min(n, (j * units // world) * SHARD_UNIT)
        hi = min(n, ((j + 1) * units // world) * SHARD_UNIT)
        out.append((lo, hi))
    return out


def as_flat(x: Any, var: str = "x") -> tuple[Any, Any]:
    """(flat float32 vector, how to rebuild the caller's type) for numpy or ``array('f')`` input.

    Raises:
        TypeError: not float32 data.
    """
    if np is not None and isinstance(x, np.ndarray):
        if x.dtype != np.float32:
            raise TypeError(f"{var} must be float32, got dtype {x.dtype}")
        return np.ascontiguousarray(x).reshape(-1), ("np", x.shape)
    if isinstance(x, array.array):
        if x.typecode != "f":
            raise TypeError(f"{var} must be array('f'), got array({x.typecode!r})")
        return (np.frombuffer(x, dtype=np.float32) if np is not None else x), ("array", None)
    raise TypeError(f"{var} must be a float32 numpy array or array('f'), got {type(x).__name__}")


def rebuild(flat: Any, how: Any) -> Any:
    """The result in the caller's type (a new object; the input is never modified)."""
    kind, shape = how
    if kind == "np":
        return np.array(flat, dtype=np.float32).reshape(shape)
    if np is not None and isinstance(flat, np.ndarray):
        return array.array("f", flat.astype(np.float32).tobytes())
    return array.array("f", flat)


def empty(n: int) -> Any:
    return np.empty(n, dtype=np.float32) if np is not None else array.array("f", bytes(4 * n))


def to_vec(v: Any) -> Any:
    """A decoded wire vector (numpy or array('f')) as this module's vector type."""
    if np is not None:
        return v if isinstance(v, np.ndarray) else np.frombuffer(v, dtype=np.float32)
    return v


def _py_min(a: float, b: float) -> float:
    return a if (a != a or a < b) else (b if b == b and b < a else (a if b == b else b))


def _py_max(a: float, b: float) -> float:
    return a if (a != a or a > b) else (b if b == b and b > a else (a if b == b else b))


def reduce(op: str, parts: Sequence[Any], world: int) -> Any:
    """Reduce float32 vectors (in the given, rank, order) with ``op``.

    ``sum``: ``((x0 + x1) + x2) + ...`` in float32; ``mean``: that sum / float32(world);
    ``min``/``max``: elementwise, NaN propagates.
    """
    if np is not None:
        acc = np.array(parts[0], dtype=np.float32, copy=True)
        f = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum}[op]
        for p in parts[1:]:
            f(acc, p, out=acc)
        if op == "mean":
            acc /= np.float32(world)
        return acc
    acc = array.array("f", parts[0])
    for p in parts[1:]:
        if op in ("sum", "mean"):
            acc = array.array("f", [a + b for a, b in zip(acc, p)])
        elif op == "min":
            acc = array.array("f", [_py_min(a, b) for a, b in zip(acc, p)])
        else:
            acc = array.array("f", [_py_max(a, b) for a, b in zip(acc, p)])
    if op == "mean":
        acc = array.array("f", [a / world for a in acc])
    return acc


def weighted_mean(parts: Sequence[Any], weights: Sequence[float]) -> Any:
    """``float32(sum_i w_i * x_i / sum_i w_i)``, accumulated in float64 in rank order."""
    total = 0.0
    for w in weights:
        total += w
    if np is not None:
        acc = np.zeros(len(parts[0]), dtype=np.float64)
        for w, p in zip(weights, parts):
            acc += np.float64(w) * np.asarray(p, dtype=np.float64)
        return (acc / total).astype(np.float32)
    acc = [0.0] * len(parts[0])
    for w, p in zip(weights, parts):
        acc = [a + w * float(v) for a, v in zip(acc, p)]
    return array.array("f", [a / total for a in acc])


def check_weight(w: Any) -> float:
    """A federated-average weight: a finite number >= 0 (``ValueError`` otherwise)."""
    try:
        f = float(w)
    except (TypeError, ValueError):
        raise ValueError(f"weight={w!r} must be a number") from None
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"weight={w!r} must be finite and >= 0")
    return f
