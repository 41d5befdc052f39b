"""Frame bodies: one message in a fixed per-type schema (docs/INTERFACES.md, "Wire").

A frame body is ``u8 type`` followed by the type's fields in the order of :data:`SCHEMAS`,
little-endian, no padding. ``from`` and ``to`` are not in the body: they travel in every chunk's
routing header (:mod:`tabcohort.wire.chunk`).

Field encodings:

- ``u16``/``u32``/``u64``: unsigned integers; ``f64``: IEEE binary64 (NaN allowed: a ``round``'s
  ``loss`` is NaN before the first reduce); ``bool``: one byte, 0 or 1.
- ``str``: ``u16`` byte length + UTF-8 bytes, at most the field's maximum (INTERFACES.md).
- ``assign``: ``u32`` count + count x (``u32`` id, ``u32`` offset, ``u32`` share), ids strictly
  ascending; it carries two message keys, ``assign`` ({id: offset}) and ``shares`` ({id: share},
  the same ids; a share is the number of samples assigned, >= 1).
- ``vec``: ``u8`` codec id, ``u8`` flags (bit 0: f32 fallback), ``u32`` element count,
  ``u32`` int8 block size (0 for other codecs), then the codec's payload
  (:mod:`tabcohort.wire.codecs`). ``vec?`` is a ``vec`` that a message may leave out: it is
  sent as the empty vector (a ``round``'s ``opt``, the optimizer state, docs/PROTOCOL.md "Local
  steps and optimizer state"), and an empty one decodes as absent.
"""

from __future__ import annotations

import struct
from typing import Any, Callable

from ..errors import LocalProtocolError, RemoteProtocolError
from . import limits as L
from .codecs import CODECS_BY_ID, FLAG_F32_FALLBACK, Codec
from .vec import as_f32_np, as_f32_py, f32_view

MSG_TYPES = {"hello": 1, "beat": 2, "round": 3, "grad": 4}
MSG_NAMES = {v: k for k, v in MSG_TYPES.items()}

#: Per message type: (key, kind) in wire order; a ("str", n) kind holds at most n UTF-8 bytes.
SCHEMAS: dict[str, tuple[tuple[str, Any], ...]] = {
    "hello": (("version", "u16"), ("job", ("str", 128)), ("batch", "u32"), ("ready", "bool"),
              ("running", "bool"), ("step", "u64"), ("model", ("str", 256)), ("backend", ("str", 64))),
    "beat": (("batch", "u32"), ("ready", "bool"), ("running", "bool"), ("step", "u64"),
             ("backend", ("str", 64)), ("term", "u64")),
    "round": (("step", "u64"), ("term", "u64"), ("lr", "f64"), ("loss", "f64"), ("samples", "u64"), ("cohort", "u32"),
              ("cursor", "u64"), ("assign", "assign"), ("params", "vec"), ("opt", "vec?")),
    "grad": (("step", "u64"), ("term", "u64"), ("loss", "f64"), ("samples", "u64"), ("g", "vec")),
}

_INT = {"u16": (struct.Struct("<H"), 0xFFFF), "u32": (struct.Struct("<I"), 0xFFFFFFFF),
        "u64": (struct.Struct("<Q"), 0xFFFFFFFFFFFFFFFF)}
_F64 = struct.Struct("<d")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_TRIPLE = struct.Struct("<III")
VEC_HEADER = struct.Struct("<BBII")
#: Bytes a reader places before a body it reassembles into a buffer of its own, so that the
#: float32 payloads of ``round`` and ``grad`` land 4-aligned there and decode as views of that
#: buffer, without a copy (:func:`decode_body` with ``owned``). Both start at a body offset of
#: 3 (mod 4): ``grad``'s after 1 + 4 x 8 bytes and the vector header; ``round``'s after
#: 1 + 6 x 8 + 4 bytes, an ``assign`` of 4 + 12 x count and the header. A vector elsewhere (a
#: round's ``opt``, after ``params``) lands unaligned and decodes with a copy, as would one of a
#: layout that moved them. A ``params`` view keeps the whole body's buffer (its ``opt`` bytes too).
BODY_ALIGN_PAD = (-(1 + 4 * 8 + VEC_HEADER.size)) % 4


def encode_body(msg: dict, *, codec: Codec, block: int, use_numpy: bool,
                on_fallback: Callable[[], None] | None = None) -> bytes:
    """Encode a message dict (without ``from``/``to``) as a frame body: the bytes of
    :func:`encode_parts` joined (same arguments, same errors)."""
    return b"".join(encode_parts(msg, codec=codec, block=block, use_numpy=use_numpy, on_fallback=on_fallback))


def encode_parts(msg: dict, *, codec: Codec, block: int, use_numpy: bool,
                 on_fallback: Callable[[], None] | None = None) -> list[Any]:
    """Encode a message dict (without ``from``/``to``) as the parts of a frame body, in order.

    A vector's payload may be a read-only view of the caller's array (f32 on the numpy path:
    no copy), so the parts are valid until that array changes: join or copy them before
    returning to the caller (:meth:`tabcohort.wire.FrameWriter.write` cuts them into chunks at
    once, the only copy of the vector's bytes before the socket's).

    Args:
        msg: a message with ``t`` and every key of its schema (INTERFACES.md, "Messages").
        codec: the wire precision for ``params``/``g``.
        block: int8 block size.
        use_numpy: which path encodes vectors (both give the same bytes).
        on_fallback: called once per vector sent as f32 because it did not fit f16/bf16.

    Raises:
        LocalProtocolError: unknown ``t``, a missing key, or a value out of its wire range.
    """
    t = msg.get("t")
    if t not in SCHEMAS:
        raise LocalProtocolError(f"unknown message type {t!r}")
    parts: list[Any] = [bytes((MSG_TYPES[t],))]
    for key, kind in SCHEMAS[t]:
        if kind == "vec?":       # an optional vector: absent is sent as the empty vector
            kind = "vec"
            if key not in msg:
                msg = {**msg, key: ()}
        if key not in msg:
            raise LocalProtocolError(f"{t} message lacks {key!r}")
        v = msg[key]
        try:
            if kind in _INT:
                st, hi = _INT[kind]
                if isinstance(v, bool) or not 0 <= int(v) <= hi or int(v) != v:
                    raise LocalProtocolError(f"{t}.{key}={v!r} is not a {kind}")
                parts.append(st.pack(int(v)))
            elif kind == "f64":
                parts.append(_F64.pack(float(v)))
            elif kind == "bool":
                parts.append(b"\x01" if v else b"\x00")
            elif kind == "assign":
                shares = dict(msg.get("shares") or {})
                offsets = dict(v)
                if set(shares) != set(offsets):
                    raise LocalProtocolError(f"{t}.shares must name the same ids as {t}.{key}")
                items = sorted((int(k), int(o), int(shares[k])) for k, o in offsets.items())
                if any(sh < 1 for _, _, sh in items):
                    raise LocalProtocolError(f"{t}.shares must be >= 1")
                parts.append(_U32.pack(len(items)))
                parts.extend(_TRIPLE.pack(k, o, sh) for k, o, sh in items)
            elif kind == "vec":
                x = as_f32_np(v) if use_numpy else as_f32_py(v)
                if len(x) > 0xFFFFFFFF:
                    raise LocalProtocolError(f"{t}.{key} too long")
                e = codec.encode(x, use_numpy=use_numpy, block=block)
                if e.flags & FLAG_F32_FALLBACK and on_fallback is not None:
                    on_fallback()
                parts.append(VEC_HEADER.pack(e.code, e.flags, len(x), e.block))
                parts.append(e.data)
            else:  # ("str", max)
                b = str(v).encode("utf-8")
                if len(b) > kind[1]:
                    raise LocalProtocolError(f"{t}.{key} is {len(b)} bytes > {kind[1]}")
                parts.append(_U16.pack(len(b)) + b)
        except (struct.error, TypeError, ValueError, OverflowError) as exc:
            raise LocalProtocolError(f"{t}.{key}={v!r}: {exc}") from None
    return parts


class _Cursor:
    __slots__ = ("mv", "pos", "owned")

    def __init__(self, body: Any, owned: bool = False) -> None:
        self.mv = memoryview(body)
        self.pos = 0
        self.owned = owned

    def take(self, n: int, reason: str = L.TRUNCATED) -> memoryview:
        if n > len(self.mv) - self.pos:
            raise RemoteProtocolError(reason, f"need {n} bytes at {self.pos}, have {len(self.mv) - self.pos}")
        out = self.mv[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> tuple:
        return st.unpack(self.take(st.size))


def decode_body(body: Any, *, limits: L.WireLimits, use_numpy: bool, owned: bool = False) -> dict:
    """Decode a frame body into a message dict (without ``from``/``to``).

    Args:
        body: bytes-like, the reassembled frame body.
        limits: bounds checked before any allocation.
        use_numpy: vectors come back as numpy float32 arrays (else ``array('f')``).
        owned: ``body`` is writable memory that only the returned message will hold (a reader's
            own reassembly buffer): an f32 vector there that is 4-aligned is returned as a view
            of it instead of a copy (see :data:`BODY_ALIGN_PAD`).

    Raises:
        RemoteProtocolError: with ``reason`` one of :data:`tabcohort.wire.limits.DROP_REASONS`.
    """
    c = _Cursor(body, owned)
    (code,) = c.take(1)
    t = MSG_NAMES.get(code)
    if t is None:
        raise RemoteProtocolError(L.UNKNOWN_TYPE, f"type byte {code}")
    msg: dict = {"t": t}
    for key, kind in SCHEMAS[t]:
        if kind in _INT:
            (msg[key],) = c.unpack(_INT[kind][0])
        elif kind == "f64":
            (msg[key],) = c.unpack(_F64)
        elif kind == "bool":
            (b,) = c.take(1)
            if b > 1:
                raise RemoteProtocolError(L.BAD_VALUE, f"{t}.{key} bool byte {b}")
            msg[key] = b == 1
        elif kind == "assign":
            msg[key], msg["shares"] = _decode_assign(c, limits)
        elif kind == "vec":
            msg[key] = _decode_vec(c, limits, use_numpy)
        elif kind == "vec?":
            v = _decode_vec(c, limits, use_numpy)
            if len(v):
                msg[key] = v
        else:
            (n,) = c.unpack(_U16)
            if n > kind[1]:
                raise RemoteProtocolError(L.ABSURD_SIZE, f"{t}.{key} length {n} > {kind[1]}")
            try:
                msg[key] = str(c.take(n), "utf-8")
            except UnicodeDecodeError:
                raise RemoteProtocolError(L.INVALID_UTF8, f"{t}.{key}") from None
    if c.pos != len(c.mv):
        raise RemoteProtocolError(L.LENGTH_MISMATCH, f"{len(c.mv) - c.pos} trailing bytes")
    return msg


def _decode_assign(c: _Cursor, limits: L.WireLimits) -> tuple[dict[int, int], dict[int, int]]:
    (n,) = c.unpack(_U32)
    if n > limits.max_assign:
        raise RemoteProtocolError(L.ABSURD_SIZE, f"assign count {n} > {limits.max_assign}")
    raw = c.take(12 * n, L.LENGTH_MISMATCH)
    out: dict[int, int] = {}
    shares: dict[int, int] = {}
    last = -1
    for k, o, sh in _TRIPLE.iter_unpack(raw):
        if k <= last:
            raise RemoteProtocolError(L.BAD_VALUE, "assign ids not strictly ascending")
        if sh < 1:
            raise RemoteProtocolError(L.BAD_VALUE, "assign share 0")
        out[k] = o
        shares[k] = sh
        last = k
    return out, shares


def _decode_vec(c: _Cursor, limits: L.WireLimits, use_numpy: bool) -> Any:
    code, flags, n, block = c.unpack(VEC_HEADER)
    codec = CODECS_BY_ID.get(code)
    if codec is None or flags & ~FLAG_F32_FALLBACK:
        raise RemoteProtocolError(L.BAD_VALUE, f"vector codec {code} flags {flags:#x}")
    if flags and codec.name not in ("f16", "bf16"):
        raise RemoteProtocolError(L.BAD_VALUE, f"f32 fallback flag on {codec.name}")
    if n > limits.max_vector_len:
        raise RemoteProtocolError(L.ABSURD_SIZE, f"vector length {n} > {limits.max_vector_len}")
    if codec.name == "int8":
        if block > limits.max_int8_block:
            raise RemoteProtocolError(L.ABSURD_SIZE, f"int8 block {block}")
        if block == 0:
            raise RemoteProtocolError(L.BAD_VALUE, "int8 block 0")
    elif block != 0:
        raise RemoteProtocolError(L.BAD_VALUE, f"block {block} on {codec.name}")
    data = c.take(codec.data_len(n, flags, block), L.LENGTH_MISMATCH)
    if c.owned and use_numpy and (codec.name == "f32" or flags & FLAG_F32_FALLBACK):
        view = f32_view(data)
        if view is not None:
            return view
    return codec.decode(data, n, flags, block, use_numpy=use_numpy)

