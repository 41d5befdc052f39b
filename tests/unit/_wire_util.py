"""Helpers for the wire tests: both encode/decode paths, float32 bit tricks, vectors."""

from __future__ import annotations

import array
import math
import random
import struct

import pytest

from tabcohort._compat import np

#: Parametrize a test over the stdlib path and (when numpy is importable) the numpy path.
PATHS = [
    pytest.param(False, id="py"),
    pytest.param(True, id="np", marks=[pytest.mark.needs_numpy,
                                       pytest.mark.skipif(np is None, reason="needs numpy")]),
]

PRECISIONS = ["f32", "f16", "bf16", "int8"]
INF = math.inf
NAN = math.nan


def f32(x: float) -> float:
    """``x`` rounded to float32 (round to nearest even), as a Python float."""
    return array.array("f", [x])[0]


def bits_f32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def from_bits(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u))[0]


def tolist(v) -> list[float]:
    return [float(t) for t in v]


def f32_bits_list(v) -> list[int]:
    """Bit patterns of a decoded float32 vector (numpy or array)."""
    raw = bytes(memoryview(v).cast("B")) if not hasattr(v, "tobytes") else v.tobytes()
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def same_bits(a, b) -> bool:
    """Equal element for element with NaN == NaN (any NaN) and -0 != +0."""
    la, lb = tolist(a), tolist(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if math.isnan(x) and math.isnan(y):
            continue
        if x != y or math.copysign(1.0, x) != math.copysign(1.0, y):
            return False
    return True


SPECIALS = [0.0, -0.0, 1.0, -1.0, INF, -INF, NAN, 2.0**-149, -(2.0**-149), 2.0**-126,
            from_bits(0x007FFFFF), 65504.0, 65519.0, 6e-8, 2.0**-24, 2.0**-25, 3.4e38, -3.4e38,
            from_bits(0x7F7FFFFF), 1 + 2.0**-11, 1 + 3 * 2.0**-11, from_bits(0x3F808000),
            from_bits(0x3F818000)]


def random_vector(rng: random.Random, n: int, *, specials: bool = True, finite: bool = False,
                  scale_exp: tuple[int, int] = (-30, 30)) -> list[float]:
    """A float32-representable vector with a spread of magnitudes and optional specials."""
    out = []
    for _ in range(n):
        r = rng.random()
        if specials and r < 0.05:
            v = rng.choice(SPECIALS)
        elif specials and r < 0.10:
            v = from_bits(rng.getrandbits(32))
        else:
            v = rng.uniform(-1, 1) * 2.0 ** rng.randint(*scale_exp)
        v = f32(v) if math.isfinite(v) and abs(v) <= 3.4028234663852886e38 else v
        if finite and not math.isfinite(v):
            v = 0.5
        out.append(v)
    return out
