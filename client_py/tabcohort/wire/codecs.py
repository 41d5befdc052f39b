"""Wire-precision codecs: one small object per precision, in a registry keyed by wire name.

docs/INTERFACES.md, wire precision. Every codec is exact: the stdlib path and the numpy path produce
the same bytes, and decoding is a pure function of those bytes, so ``quantize(x)`` (decode of
encode) is exactly what a receiver holds. For every codec ``q(q(x)) == q(x)`` bit for bit.

Rules (all values are float32 first; see :mod:`tabcohort.wire.vec` for the conversion):

- ``f32``: raw little-endian float32; decode(encode(x)) == x bit for bit (NaN payloads kept).
- ``f16``: IEEE binary16, round to nearest, ties to even. Every NaN becomes the canonical
  quiet NaN ``0x7e00``. If any finite value would round to an infinity (``|x| >= 65520``), the
  whole array travels as f32 instead, flagged with :data:`FLAG_F32_FALLBACK` and counted by the
  writer: no finite value ever becomes an infinity.
- ``bf16``: the upper 16 bits of float32 after round to nearest, ties to even; every NaN
  becomes ``0x7fc0``. Same f32 fallback rule as f16 (a finite ``|x| >= 0x7f7f8000``'s value,
  about 3.3961e38, would round to inf): one rule for both 16-bit formats.
- ``int8``: blocks of ``block`` elements (256 unless configured; the size travels in the frame).
  Per block, in float64: ``s = float32(absmax / 127)``;
  ``q = clamp(round_half_even(x / s), -127, 127)``; decode ``float32(q * s)``. ``s == 0``
  (an all-zero block, or absmax below about 8e-44) decodes to exact zeros (``-0.0`` becomes
  ``+0.0``). Non-finite input is an error. One exception to the formula above: for
  ``absmax == FLT_MAX`` (and only then) ``float32(127 * s)`` overflows, so the decoded maximum
  would be an infinity; there ``s`` is lowered by one ulp (no finite value becomes infinite).
  Idempotence: checked exhaustively over every finite float32 absmax (about 2**31 values,
  ``tests/unit/test_wire_int8_scale.py``, marked slow): ``float32(float32(127 * s) / 127) == s``,
  so a decoded block, whose absmax is ``float32(127 * s)``, re-quantizes with the same scale and
  the same q. No scale fix-up beyond the overflow case is needed.
  Overhead: one float32 scale per block, ``4 / block`` bytes per element (1.5625 % of the
  int8 payload at 256; a ratio to f32 of ``0.25 + 1 / block``).
"""

from __future__ import annotations

import array
import math
import struct
from typing import Any

from .._compat import np
from ..errors import ConfigError, LocalProtocolError, RemoteProtocolError
from .precision import check_precision
from .vec import f32_vector, from_le_bytes_py, le_bytes_py

#: Array flag: a f16/bf16 array travels as f32 because a finite value would overflow.
FLAG_F32_FALLBACK = 0x01

F16_NAN = 0x7E00
BF16_NAN = 0x7FC0
#: Smallest float32 magnitude that rounds to infinity in bf16 (bits 0x7f7f8000).
BF16_OVERFLOW = struct.unpack("<f", struct.pack("<I", 0x7F7F8000))[0]
DEFAULT_INT8_BLOCK = 256


class Encoded:
    """One encoded array: codec id, flags, int8 block size (0 otherwise) and payload bytes
    (bytes-like: f32 on the numpy path is a read-only view of the encoded array, valid while
    that array is unchanged)."""

    __slots__ = ("code", "flags", "block", "data")

    def __init__(self, code: int, flags: int, block: int, data: Any) -> None:
        self.code, self.flags, self.block, self.data = code, flags, block, data


class Codec:
    """Base: a wire precision. Subclasses implement the two paths of encode and decode.

    Attributes:
        name: the wire name (``"f32"``, ``"f16"``, ``"bf16"``, ``"int8"``).
        code: the codec id byte in an array header.
    """

    name = ""
    code = -1

    def encode(self, x: Any, *, use_numpy: bool, block: int = DEFAULT_INT8_BLOCK) -> Encoded:
        """Encode float32 data (``array('f')`` or numpy float32, shape (n,)).

        Raises:
            LocalProtocolError: the values cannot be represented (int8 and non-finite input).
        """
        raise NotImplementedError

    def data_len(self, n: int, flags: int, block: int) -> int:
        """Payload bytes for ``n`` elements (used by the reader before it allocates)."""
        if flags & FLAG_F32_FALLBACK:
            return 4 * n
        return self._data_len(n, block)

    def _data_len(self, n: int, block: int) -> int:
        raise NotImplementedError

    def decode(self, data: Any, n: int, flags: int, block: int, *, use_numpy: bool) -> Any:
        """Decode ``data`` (exactly :meth:`data_len` bytes) into a float32 vector of shape (n,).

        Raises:
            RemoteProtocolError: ``bad_value`` for bytes no encoder produces.
        """
        if flags & FLAG_F32_FALLBACK:
            return f32_vector(data, use_numpy)
        return self._decode(data, n, block, use_numpy)

    def _decode(self, data: Any, n: int, block: int, use_numpy: bool) -> Any:
        raise NotImplementedError

    def quantize(self, x: Any, *, use_numpy: bool, block: int = DEFAULT_INT8_BLOCK) -> Any:
        """What a receiver decodes for ``x`` (float32 data), or ``None`` at full precision."""
        e = self.encode(x, use_numpy=use_numpy, block=block)
        return self.decode(e.data, len(x), e.flags, e.block, use_numpy=use_numpy)

    def ratio(self, n: int, block: int = DEFAULT_INT8_BLOCK) -> float:
        """Payload bytes relative to f32 for ``n`` elements (no fallback)."""
        return self._data_len(n, block) / (4 * n) if n else 1.0


def _f32_bytes(x: Any, use_numpy: bool) -> bytes:
    return x.astype("<f4", copy=False).tobytes() if use_numpy else le_bytes_py(x)


class F32(Codec):
    name, code = "f32", 0

    def encode(self, x: Any, *, use_numpy: bool, block: int = DEFAULT_INT8_BLOCK) -> Encoded:
        """On the numpy path the payload is a read-only byte view of ``x`` (little-endian
        float32, contiguous) rather than a copy: valid while ``x`` is unchanged."""
        if use_numpy:
            le = np.ascontiguousarray(x, dtype="<f4")
            view = memoryview(le).cast("B")
            return Encoded(self.code, 0, 0, view.toreadonly())
        return Encoded(self.code, 0, 0, le_bytes_py(x))

    def _data_len(self, n: int, block: int) -> int:
        return 4 * n

    def _decode(self, data: Any, n: int, block: int, use_numpy: bool) -> Any:
        return f32_vector(data, use_numpy)

    def quantize(self, x: Any, *, use_numpy: bool, block: int = DEFAULT_INT8_BLOCK) -> Any:
        return None


class _Half(Codec):
    """A 16-bit float codec: ``_py``/``_np`` return the packed bytes, or None when a finite value
    would become an infinity, in which case the whole array travels as f32 (flagged)."""

    def encode(self, x: Any, *, use_numpy: bool, block: int = DEFAULT_INT8_BLOCK) -> Encoded:
        data = self._np(x) if use_numpy else self._py(x)
        if data is None:
            return Encoded(self.code, FLAG_F32_FALLBACK, 0, _f32_bytes(x, use_numpy))
        return Encoded(self.code, 0, 0, data)

    def _data_len(self, n: int, block: int) -> int:
        return 2 * n


class F16(_Half):
    name, code = "f16", 1

    @staticmethod
    def _py(x: array.array) -> bytes | None:
        try:  # CPython packs 'e' with round-half-even and raises when it would round to inf
            data = struct.pack(f"<{len(x)}e", *x)
        except OverflowError:
            return None
        if math.isfinite(sum(x)):
            return data
        nans = [i for i, v in enumerate(x) if v != v]
        if not nans:
            return data
        out = bytearray(data)
        for i in nans:
            out[2 * i] = F16_NAN & 0xFF
            out[2 * i + 1] = F16_NAN >> 8
        return bytes(out)

    @staticmethod
    def _np(x: Any) -> bytes | None:
        with np.errstate(over="ignore", invalid="ignore"):
            h = x.astype("<f2")
        if np.any(np.isinf(h) & np.isfinite(x)):
            return None
        nan = np.isnan(x)
        if nan.any():
            h.view("<u2")[nan] = F16_NAN
        return h.tobytes()

    def _decode(self, data: Any, n: int, block: int, use_numpy: bool) -> Any:
        if use_numpy:
            return np.frombuffer(data, dtype="<f2").astype(np.float32)
        return array.array("f", struct.unpack(f"<{n}e", data))


class BF16(_Half):
    name, code = "bf16", 2

    @staticmethod
    def _py(x: array.array) -> bytes | None:
        u = array.array("I")
        u.frombytes(x.tobytes())
        r = array.array("H", [((v + 0x7FFF + ((v >> 16) & 1)) >> 16) & 0xFFFF for v in u])
        if len(x) and math.isfinite(sum(x)):
            if max(x) >= BF16_OVERFLOW or min(x) <= -BF16_OVERFLOW:
                return None
        elif len(x):
            for i, v in enumerate(x):
                if v != v:
                    r[i] = BF16_NAN
                elif BF16_OVERFLOW <= abs(v) < math.inf:
                    return None
        return le_bytes_py(r)

    @staticmethod
    def _np(x: Any) -> bytes | None:
        u = x.view(np.uint32)
        r = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype("<u2")
        if np.any(np.isfinite(x) & ((r & 0x7FFF) == 0x7F80)):
            return None
        nan = np.isnan(x)
        if nan.any():
            r[nan] = BF16_NAN
        return r.tobytes()

    def _decode(self, data: Any, n: int, block: int, use_numpy: bool) -> Any:
        if use_numpy:
            return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        out = bytearray(2 * len(data))
        mv = memoryview(data)
        out[2::4] = mv[0::2]
        out[3::4] = mv[1::2]
        return from_le_bytes_py("f", out)


def _prev_f32_py(s: float) -> float:
    (bits,) = struct.unpack("<I", struct.pack("<f", s))
    return struct.unpack("<f", struct.pack("<I", bits - 1))[0]


class Int8(Codec):
    name, code = "int8", 3

    def encode(self, x: Any, *, use_numpy: bool, block: int = DEFAULT_INT8_BLOCK) -> Encoded:
        if not 1 <= block <= 0xFFFFFFFF:
            raise ConfigError("int8_block", block, "must be an integer in [1, 2**32 - 1]")
        data = self._np(x, block) if use_numpy else self._py(x, block)
        return Encoded(self.code, 0, block, data)

    @staticmethod
    def _py(x: array.array, block: int) -> bytes:
        n = len(x)
        if not math.isfinite(sum(x)):
            raise LocalProtocolError("int8 cannot represent non-finite values")
        nb = -(-n // block)
        scales = array.array("f", bytes(4 * nb))
        q = array.array("b", bytes(n))
        f = array.array("f", [0.0])
        inf = math.inf
        for b in range(nb):
            lo = b * block
            hi = min(lo + block, n)
            blk = x[lo:hi]
            f[0] = (max(max(blk), -min(blk)) + 0.0) / 127.0  # + 0.0: -0.0 -> +0.0
            s = f[0]
            f[0] = s * 127.0
            if f[0] == inf:  # only absmax == FLT_MAX: the decoded maximum would be inf
                s = _prev_f32_py(s)
            scales[b] = s
            if s == 0.0:
                continue
            vals = [round(v / s) for v in blk]
            if max(vals) > 127 or min(vals) < -127:
                vals = [max(-127, min(127, v)) for v in vals]
            q[lo:hi] = array.array("b", vals)
        return le_bytes_py(scales) + q.tobytes()

    @staticmethod
    def _np(x: Any, block: int) -> bytes:
        n = x.shape[0]
        if not np.all(np.isfinite(x)):
            raise LocalProtocolError("int8 cannot represent non-finite values")
        nb = -(-n // block)
        xd = np.zeros(nb * block, dtype=np.float64)
        xd[:n] = x
        xb = xd.reshape(nb, block)
        with np.errstate(over="ignore"):
            s = (np.abs(xb).max(axis=1, initial=0.0) / 127.0).astype(np.float32)
            over = np.isinf((s.astype(np.float64) * 127.0).astype(np.float32))
        if over.any():  # only absmax == FLT_MAX: the decoded maximum would be inf
            s[over] = np.nextafter(s[over], np.float32(0))
        sd = s.astype(np.float64)
        zero = sd == 0.0
        q = np.rint(xb / np.where(zero, 1.0, sd)[:, None])
        q[zero] = 0.0
        np.clip(q, -127, 127, out=q)
        return s.astype("<f4").tobytes() + q.astype(np.int8).reshape(-1)[:n].tobytes()

    def _data_len(self, n: int, block: int) -> int:
        return 4 * (-(-n // block)) + n

    def _decode(self, data: Any, n: int, block: int, use_numpy: bool) -> Any:
        nb = -(-n // block)
        if use_numpy:
            s = np.frombuffer(data, dtype="<f4", count=nb).astype(np.float32)
            q = np.frombuffer(data, dtype=np.int8, offset=4 * nb, count=n)
            if not np.all(np.isfinite(s)) or np.any(np.signbit(s)) or np.any(q == -128):
                raise RemoteProtocolError("bad_value", "int8 scale or value out of range")
            return q.astype(np.float32) * np.repeat(s, block)[:n]
        mv = memoryview(data)
        scales = from_le_bytes_py("f", mv[: 4 * nb])
        q = array.array("b")
        q.frombytes(mv[4 * nb : 4 * nb + n])
        if nb and (not math.isfinite(sum(scales)) or any(math.copysign(1.0, s) < 0 for s in scales)):
            raise RemoteProtocolError("bad_value", "int8 scale not finite and >= 0")
        if n and min(q) == -128:
            raise RemoteProtocolError("bad_value", "int8 value -128")
        out = array.array("f", bytes(4 * n))
        for b in range(nb):
            lo = b * block
            hi = min(lo + block, n)
            s = scales[b]
            out[lo:hi] = array.array("f", [v * s for v in q[lo:hi]])
        return out


CODECS: dict[str, Codec] = {c.name: c for c in (F32(), F16(), BF16(), Int8())}
CODECS_BY_ID: dict[int, Codec] = {c.code: c for c in CODECS.values()}


def get_codec(name: str) -> Codec:
    """The codec for a wire precision name.

    Raises:
        ConfigError: ``name`` is not one of ``f32``, ``f16``, ``bf16``, ``int8``.
    """
    return CODECS[check_precision(name)]
