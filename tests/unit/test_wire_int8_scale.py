"""The int8 scale is reproduced by re-quantizing a decoded block (why ``q(q(x)) == q(x)``).

A decoded block's absmax is ``float32(127 * s)``; re-quantizing it gives the scale
``float32(float32(127 * s) / 127)``. These tests check that this equals ``s`` for every scale the
encoder produces (exhaustively in the slow test), and that 127 * s never overflows, which needs
the one-ulp exception at absmax == FLT_MAX (see :mod:`tabcohort.wire.codecs`).
"""

from __future__ import annotations

import random

import pytest

from tabcohort.wire import get_codec
from tabcohort.wire.vec import as_f32_py

from ._wire_util import f32, from_bits

FLT_MAX = from_bits(0x7F7FFFFF)


def scale_of(absmax: float) -> float:
    """The scale the stdlib encoder writes for a block whose absmax is ``absmax``."""
    e = get_codec("int8").encode(as_f32_py([absmax]), use_numpy=False, block=1)
    return as_f32_py(list(memoryview(e.data[:4]).cast("f")))[0]


def test_scale_reproduced_sampled():
    rng = random.Random(11)
    samples = [from_bits(rng.randrange(1, 0x7F800000)) for _ in range(3000)]
    samples += [from_bits(u) for u in (1, 2, 0x3F, 0x40, 0x7F, 0x80, 0x00800000, 0x7F7FFFFE)]
    for a in samples:
        s = scale_of(a)
        assert f32(f32(127 * s) / 127) == s, a
        assert f32(127 * s) <= FLT_MAX


def test_flt_max_lowers_the_scale_one_ulp():
    s = scale_of(FLT_MAX)
    assert s < f32(FLT_MAX / 127) and f32(127 * s) < float("inf")


def _np_scales(np, lo: int, hi: int):
    a = np.arange(lo, hi, dtype=np.uint32).view(np.float32)
    s = (a.astype(np.float64) / 127).astype(np.float32)
    with np.errstate(over="ignore"):
        t = (s.astype(np.float64) * 127).astype(np.float32)
    return a, s, t


@pytest.mark.needs_numpy
def test_scale_reproduced_one_binade_and_the_top():
    np = pytest.importorskip("numpy")
    for lo, hi in ((0x3F800000, 0x40000000), (0x00000001, 0x00100000), (0x7F700000, 0x7F7FFFFF)):
        a, s, t = _np_scales(np, lo, hi)
        assert not np.isinf(t).any()
        assert np.array_equal((t.astype(np.float64) / 127).astype(np.float32), s)


@pytest.mark.slow
@pytest.mark.needs_numpy
def test_scale_reproduced_exhaustive():
    """Every finite positive float32 absmax (about 2**31 values; ~1-2 minutes)."""
    np = pytest.importorskip("numpy")
    step = 1 << 24
    overflow = []
    for lo in range(1, 0x7F800000, step):
        a, s, t = _np_scales(np, lo, min(lo + step, 0x7F800000))
        inf = np.isinf(t)
        overflow += [int(u) for u in a[inf].view(np.uint32)]
        ok = (t.astype(np.float64) / 127).astype(np.float32) == s
        assert ok[~inf].all()
    assert overflow == [0x7F7FFFFF]
