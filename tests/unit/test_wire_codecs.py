"""Precision codecs: exact rules, explicit error bounds, special values (docs/INTERFACES.md, "Wire").

Synchronous and stdlib-only (the numpy path is a parameter that is skipped without numpy).
"""

from __future__ import annotations

import array
import math
import random
import struct

import pytest

from tabcohort.errors import ConfigError, LocalProtocolError
from tabcohort.wire import FLAG_F32_FALLBACK, FrameReader, FrameWriter, get_codec
from tabcohort.wire.codecs import BF16_OVERFLOW
from tabcohort.wire.vec import as_f32_np, as_f32_py

from ._wire_util import INF, NAN, PATHS, PRECISIONS, bits_f32, f32, from_bits, random_vector, same_bits, tolist

FLT_MAX = from_bits(0x7F7FFFFF)


def enc(prec: str, xs, use_numpy: bool, block: int = 256):
    c = get_codec(prec)
    x = as_f32_np(xs) if use_numpy else as_f32_py(xs)
    return c.encode(x, use_numpy=use_numpy, block=block)


def roundtrip(prec: str, xs, use_numpy: bool, block: int = 256):
    c = get_codec(prec)
    e = enc(prec, xs, use_numpy, block)
    assert len(e.data) == c.data_len(len(xs), e.flags, e.block)
    return e, c.decode(e.data, len(xs), e.flags, e.block, use_numpy=use_numpy)


def test_registry_names_and_unknown():
    assert [get_codec(p).name for p in PRECISIONS] == PRECISIONS
    with pytest.raises(ConfigError, match="precision"):
        get_codec("fp8")


# --- f32 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_numpy", PATHS)
def test_f32_is_bit_exact(use_numpy):
    xs = random_vector(random.Random(1), 500)
    e, out = roundtrip("f32", xs, use_numpy)
    assert same_bits(out, xs)
    # (array, not struct: Python 3.14's struct keeps signalling-NaN payloads, the C cast quiets them)
    assert e.data == array.array("f", xs).tobytes()
    assert get_codec("f32").quantize(as_f32_py(xs), use_numpy=False) is None


# --- f16 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_numpy", PATHS)
@pytest.mark.parametrize("x, want", [
    (1 + 2.0**-11, 1.0),  # tie -> even
    (1 + 3 * 2.0**-11, 1 + 2.0**-9),  # tie -> even (up)
    (65504.0, 65504.0),  # largest finite f16
    (65519.0, 65504.0),  # below the overflow threshold: rounds down
    (2.0**-24, 2.0**-24),  # smallest f16 subnormal
    (2.0**-25, 0.0),  # half the smallest subnormal: tie -> even (zero)
    (3 * 2.0**-26, 2.0**-24),
    (2.0**-149, 0.0),  # f32 subnormal underflows to zero
    (-0.0, -0.0),
    (INF, INF),
    (-INF, -INF),
])
def test_f16_rounding_and_boundaries(use_numpy, x, want):
    e, out = roundtrip("f16", [x], use_numpy)
    assert e.flags == 0
    assert same_bits(out, [want])


@pytest.mark.parametrize("use_numpy", PATHS)
def test_f16_nan_is_canonical(use_numpy):
    e, out = roundtrip("f16", [NAN, -NAN, from_bits(0x7F800001), from_bits(0xFFC12345)], use_numpy)
    assert e.data == b"\x00\x7e" * 4
    assert all(math.isnan(v) for v in tolist(out))


@pytest.mark.parametrize("use_numpy", PATHS)
@pytest.mark.parametrize("big", [65520.0, -65520.0, 1e5, FLT_MAX])
def test_f16_overflow_falls_back_to_f32(use_numpy, big):
    xs = [0.1, big, INF, NAN]
    w = FrameWriter(1, precision="f16", use_numpy=use_numpy)
    e, out = roundtrip("f16", xs, use_numpy)
    assert e.flags & FLAG_F32_FALLBACK and len(e.data) == 16
    assert same_bits(out, [f32(0.1), big, INF, NAN])
    r = FrameReader(use_numpy=use_numpy)
    (m,) = r.feed(w.write({"t": "grad", "term": 1, "step": 1, "loss": 0.0, "samples": 1, "g": xs})[0], now_ms=0)
    assert w.f16_fallbacks == 1 and same_bits(m["g"], out)


@pytest.mark.parametrize("use_numpy", PATHS)
def test_f16_error_bound(use_numpy):
    xs = random_vector(random.Random(2), 4000, specials=False, scale_exp=(-30, 15))
    e, out = roundtrip("f16", xs, use_numpy)
    assert e.flags == 0
    for x, q in zip(xs, tolist(out)):
        assert abs(x - q) <= max(abs(x) * 2.0**-11, 2.0**-25), (x, q)


# --- bf16 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_numpy", PATHS)
@pytest.mark.parametrize("xbits, want_bits", [
    (0x3F808000, 0x3F80),  # tie -> even (down)
    (0x3F818000, 0x3F82),  # tie -> even (up)
    (0x3F808001, 0x3F81),
    (0x7F7F7FFF, 0x7F7F),  # just below the overflow threshold: largest finite bf16
    (0x00000001, 0x0000),  # smallest f32 subnormal -> +0
    (0x00008000, 0x0000),  # tie at a subnormal -> even
    (0x00018000, 0x0002),
    (0x80000000, 0x8000),  # -0
    (0x7F800000, 0x7F80),
    (0xFF800000, 0xFF80),
    (0x7F800001, 0x7FC0),  # signalling NaN -> canonical quiet NaN
    (0xFFFFFFFF, 0x7FC0),
])
def test_bf16_rounding_and_specials(use_numpy, xbits, want_bits):
    e, out = roundtrip("bf16", [from_bits(xbits)], use_numpy)
    assert e.flags == 0 and e.data == struct.pack("<H", want_bits)
    got = bits_f32(tolist(out)[0])
    assert got == want_bits << 16


@pytest.mark.parametrize("use_numpy", PATHS)
@pytest.mark.parametrize("big", [BF16_OVERFLOW, -BF16_OVERFLOW, FLT_MAX])
def test_bf16_overflow_falls_back_to_f32(use_numpy, big):
    assert bits_f32(BF16_OVERFLOW) == 0x7F7F8000
    e, out = roundtrip("bf16", [1.0, big, NAN], use_numpy)
    assert e.flags & FLAG_F32_FALLBACK
    assert same_bits(out, [1.0, big, NAN])


@pytest.mark.parametrize("use_numpy", PATHS)
def test_bf16_error_bound(use_numpy):
    xs = random_vector(random.Random(3), 4000, specials=False, scale_exp=(-140, 120))
    _, out = roundtrip("bf16", xs, use_numpy)
    for x, q in zip(xs, tolist(out)):
        assert abs(x - q) <= max(abs(x) * 2.0**-8, 2.0**-134), (x, q)


# --- int8 ------------------------------------------------------------------------------------
def int8_bound(block_vals: list[float]) -> float:
    """Per-element bound: half a quantization step, plus float32 output rounding, plus the
    subnormal-scale clamp (below 2**-140)."""
    absmax = max((abs(v) for v in block_vals), default=0.0)
    return absmax / 254 * (1 + 2.0**-20) + absmax * 2.0**-24 + 2.0**-140


@pytest.mark.parametrize("use_numpy", PATHS)
@pytest.mark.parametrize("block", [1, 7, 256])
def test_int8_error_bound_and_layout(use_numpy, block):
    xs = random_vector(random.Random(4), 1000, specials=False, finite=True, scale_exp=(-140, 120))
    e, out = roundtrip("int8", xs, use_numpy, block)
    nb = -(-len(xs) // block)
    assert e.block == block and len(e.data) == 4 * nb + len(xs)
    out = tolist(out)
    for b in range(nb):
        blk = xs[b * block : (b + 1) * block]
        bound = int8_bound(blk)
        for x, q in zip(blk, out[b * block : (b + 1) * block]):
            assert abs(x - q) <= bound, (x, q, bound)


@pytest.mark.parametrize("use_numpy", PATHS)
def test_int8_scale_rule(use_numpy):
    xs = [0.5, -1.27, 0.0, 0.3]
    e, out = roundtrip("int8", xs, use_numpy, 4)
    (s,) = struct.unpack_from("<f", e.data)
    assert s == f32(f32(1.27) / 127)  # s = float32(absmax / 127), computed in float64
    q = list(struct.unpack_from("<4b", e.data, 4))
    assert q == [max(-127, min(127, round(x / s))) for x in map(f32, xs)]
    assert q[1] == -127
    assert tolist(out) == [f32(v * s) for v in q]


@pytest.mark.parametrize("use_numpy", PATHS)
def test_int8_zero_blocks_and_signed_zero(use_numpy):
    xs = [0.0] * 256 + [-0.0] * 3 + [2.0**-149] * 2
    e, out = roundtrip("int8", xs, use_numpy)
    assert e.data[:8] == bytes(8)  # both scales are 0: all-zero block, and absmax too small
    assert tolist(out) == [0.0] * len(xs)
    assert all(math.copysign(1.0, v) > 0 for v in tolist(out))


@pytest.mark.parametrize("use_numpy", PATHS)
def test_int8_extremes_stay_finite(use_numpy):
    xs = [FLT_MAX, -FLT_MAX, 1.0, from_bits(0x00000042)]
    _, out = roundtrip("int8", xs, use_numpy, 2)
    out = tolist(out)
    assert all(math.isfinite(v) for v in out)
    assert abs(out[0] - FLT_MAX) <= FLT_MAX / 254 and out[1] == -out[0]


@pytest.mark.parametrize("use_numpy", PATHS)
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_int8_rejects_non_finite(use_numpy, bad):
    with pytest.raises(LocalProtocolError, match="non-finite"):
        enc("int8", [1.0, bad], use_numpy)


# --- every codec -----------------------------------------------------------------------------
@pytest.mark.parametrize("use_numpy", PATHS)
@pytest.mark.parametrize("prec", PRECISIONS)
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257])
def test_lengths_and_idempotence(use_numpy, prec, n):
    xs = random_vector(random.Random(n), n, finite=prec == "int8")
    w = FrameWriter(3, precision=prec, use_numpy=use_numpy)
    q = w.quantize(xs)
    if prec == "f32":
        assert q is None
        return
    assert len(q) == n
    assert same_bits(w.quantize(q), q)


@pytest.mark.parametrize("use_numpy", PATHS)
@pytest.mark.parametrize("prec", PRECISIONS)
def test_idempotence_seeded(use_numpy, prec):
    rng = random.Random(5)
    w = FrameWriter(3, precision=prec, use_numpy=use_numpy, int8_block=64)
    for _ in range(30):
        xs = random_vector(rng, rng.randint(0, 300), finite=prec == "int8",
                           scale_exp=(-150, 127) if rng.random() < 0.3 else (-8, 8))
        q = w.quantize(xs)
        if q is not None:
            assert same_bits(w.quantize(q), q)


@pytest.mark.parametrize("use_numpy", PATHS)
@pytest.mark.parametrize("prec", PRECISIONS)
def test_inputs_of_every_kind_encode_alike(use_numpy, prec):
    xs = [f32(v) for v in random_vector(random.Random(6), 100, specials=False, finite=True)]
    w = FrameWriter(3, precision=prec, use_numpy=use_numpy)
    kinds = [xs, array.array("f", xs), array.array("d", xs)]
    if use_numpy:
        from tabcohort._compat import np
        kinds += [np.array(xs, dtype=np.float32), np.array(xs, dtype=np.float64)]
    bodies = {w.encode_body({"t": "grad", "term": 1, "step": 0, "loss": 0.0, "samples": 1, "g": k}) for k in kinds}
    assert len(bodies) == 1


@pytest.mark.parametrize("use_numpy", PATHS)
def test_double_outside_float32_is_local_error(use_numpy):
    w = FrameWriter(3, use_numpy=use_numpy)
    with pytest.raises(LocalProtocolError, match="float32 range"):
        w.quantize([1.0, 1e39])
    assert w.quantize([1.0, INF]) is None  # an infinity stays an infinity at f32
