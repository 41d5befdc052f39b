"""Property tests (hypothesis): idempotence for every codec, and the two paths byte-identical.

Every codec: quantizing what was already quantized changes nothing; the numpy
and pure-Python paths produce byte-identical frames (docs/INTERFACES.md).
"""

from __future__ import annotations

import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tabcohort.wire import FrameReader, FrameWriter  # noqa: E402

from ._wire_util import PATHS, PRECISIONS, f32_bits_list, same_bits  # noqa: E402

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

any_f32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
vectors = st.lists(any_f32, max_size=600)
finite_vectors = st.lists(finite_f32, max_size=600)
# Blocks whose values share a magnitude (exercise the scale) and tiny/huge ranges.
scaled = st.builds(lambda xs, e: [math.ldexp(x, e) for x in xs],
                   st.lists(st.floats(-1, 1, width=32), min_size=1, max_size=300),
                   st.integers(-149, 127)).map(lambda xs: [x if abs(x) <= 3.4028234663852886e38 else 0.0 for x in xs])


def _vec_for(prec: str):
    return st.one_of(finite_vectors, scaled) if prec == "int8" else st.one_of(vectors, scaled)


@pytest.mark.parametrize("use_numpy", PATHS)
@pytest.mark.parametrize("prec", PRECISIONS)
def test_quantize_is_idempotent(use_numpy, prec):
    @SETTINGS
    @given(xs=_vec_for(prec), block=st.sampled_from([1, 3, 256]))
    def check(xs, block):
        w = FrameWriter(1, precision=prec, int8_block=block, use_numpy=use_numpy)
        q = w.quantize(xs)
        if q is None:
            assert prec == "f32"
            return
        assert same_bits(w.quantize(q), q)

    check()


@pytest.mark.needs_numpy
@pytest.mark.parametrize("prec", PRECISIONS)
def test_numpy_and_stdlib_paths_give_identical_bytes(prec):
    pytest.importorskip("numpy")

    @SETTINGS
    @given(xs=_vec_for(prec), block=st.sampled_from([1, 5, 256]), mmb=st.sampled_from([64, 200, 65536]))
    def check(xs, block, mmb):
        msg = {"t": "grad", "term": 1, "step": 3, "loss": 0.25, "samples": 8, "g": xs, "to": 9}
        wp = FrameWriter(1, precision=prec, int8_block=block, max_message_bytes=mmb, use_numpy=False)
        wn = FrameWriter(1, precision=prec, int8_block=block, max_message_bytes=mmb, use_numpy=True)
        chunks = wp.write(msg)
        assert chunks == wn.write(msg)
        assert wp.f16_fallbacks == wn.f16_fallbacks
        outs = []
        for use_numpy in (False, True):
            r = FrameReader(use_numpy=use_numpy)
            got = [m for c in chunks for m in r.feed(c, now_ms=0)]
            assert len(got) == 1 and not r.drops
            outs.append(got[0]["g"])
        assert f32_bits_list(outs[0]) == f32_bits_list(outs[1])
        qp, qn = wp.quantize(xs), wn.quantize(xs)
        if prec == "f32":
            assert qp is None and qn is None
        else:
            assert f32_bits_list(qp) == f32_bits_list(outs[0]) == f32_bits_list(qn)

    check()
