"""Chunks: every transmitted unit, with a routing header a relay can read (docs/INTERFACES.md, "Wire").

Chunk layout (little-endian, :data:`CHUNK_HEADER`, 22 bytes)::

    u8  version      WIRE_VERSION (1)
    u8  flags        bit 0: has recipient; other bits 0
    u32 sender       rank id (the message's ``from``)
    u32 recipient    rank id (the message's ``to``) if flag bit 0, else 0
    u32 frame_id     unique per sender (wraps at 2**32)
    u16 index        0 <= index < count
    u16 count        chunks in this frame, >= 1
    u32 frame_len    total frame-body bytes over all chunks
    ...              payload: bytes [index * P, ...) of the frame body

Every chunk of a frame carries the same header except ``index``, so a relay can route by
(sender, recipient) and drop a whole frame by (sender, frame_id) without decoding payloads,
and re-cut a frame for a receiver whose link takes smaller messages (:func:`rechunk`).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from ..errors import ConfigError, RemoteProtocolError
from . import limits as L

WIRE_VERSION = 1
CHUNK_HEADER = struct.Struct("<BBIIIHHI")
FLAG_HAS_RECIPIENT = 0x01
MAX_CHUNKS = 0xFFFF

#: A peer that advertises no maximum message size gets this (SCTP's conservative default, RFC 8831 section 6.6).
DEFAULT_MAX_MESSAGE_BYTES = 65_536
#: What Chromium and aiortc data channels advertise and enforce (256 KiB, their SDP's a=max-message-size).
DATA_CHANNEL_MAX_MESSAGE_BYTES = 262_144
MIN_MESSAGE_BYTES = 64


class Route(NamedTuple):
    """The routing header of one chunk (everything but the payload)."""

    sender: int
    recipient: int | None
    frame_id: int
    index: int
    count: int
    frame_len: int


def negotiate_max_message_bytes(local: int | None, remote: int | None) -> int:
    """The chunk size limit for a link: the smaller advertised maximum.

    Args:
        local: this side's maximum message size in bytes, or ``None`` for no own limit.
        remote: the size the peer advertised, or ``None`` if it advertised nothing, which
            means :data:`DEFAULT_MAX_MESSAGE_BYTES`. ``0`` (SDP: unlimited) counts as
            no limit.

    Raises:
        ConfigError: the result is below :data:`MIN_MESSAGE_BYTES`.
    """
    r = DEFAULT_MAX_MESSAGE_BYTES if remote is None else remote
    candidates = [v for v in (local, r) if v]
    out = min(candidates) if candidates else DATA_CHANNEL_MAX_MESSAGE_BYTES
    if out < MIN_MESSAGE_BYTES:
        raise ConfigError("max_message_bytes", out, f"must be >= {MIN_MESSAGE_BYTES}")
    return out


def parse_route(chunk: Any, limits: L.WireLimits | None = None) -> Route:
    """Read and validate a chunk's routing header without touching the payload.

    Args:
        chunk: bytes-like, one chunk as received.
        limits: if given, ``frame_len`` above ``limits.max_frame_bytes`` is rejected.

    Raises:
        RemoteProtocolError: ``truncated``, ``bad_version``, ``bad_chunk``, ``absurd_size`` or
            ``length_mismatch`` (payload longer than the frame).
    """
    if len(chunk) < CHUNK_HEADER.size:
        raise RemoteProtocolError(L.TRUNCATED, f"chunk of {len(chunk)} bytes")
    ver, flags, sender, rcpt, fid, index, count, frame_len = CHUNK_HEADER.unpack_from(chunk)
    if ver != WIRE_VERSION:
        raise RemoteProtocolError(L.BAD_VERSION, f"wire version {ver}")
    if flags & ~FLAG_HAS_RECIPIENT or (rcpt and not flags & FLAG_HAS_RECIPIENT):
        raise RemoteProtocolError(L.BAD_CHUNK, f"flags {flags:#x} recipient {rcpt}")
    if count == 0 or index >= count or count > max(frame_len, 1):
        raise RemoteProtocolError(L.BAD_CHUNK, f"index {index} count {count} frame_len {frame_len}")
    if limits is not None and frame_len > limits.max_frame_bytes:
        raise RemoteProtocolError(L.ABSURD_SIZE, f"frame_len {frame_len} > {limits.max_frame_bytes}")
    if len(chunk) - CHUNK_HEADER.size > frame_len:
        raise RemoteProtocolError(L.LENGTH_MISMATCH, "chunk payload longer than its frame")
    return Route(sender, rcpt if flags & FLAG_HAS_RECIPIENT else None, fid, index, count, frame_len)


def split_frame(body: Any, *, sender: int, recipient: int | None, frame_id: int,
                max_message_bytes: int) -> list[bytes]:
    """Cut a frame body into chunks of at most ``max_message_bytes`` bytes each.

    Args:
        body: the frame body, bytes-like or a list of bytes-like parts in order
            (:func:`tabcohort.wire.frame.encode_parts`): each chunk is joined straight from
            the parts, so a vector's bytes are copied once, into the chunks.

    Raises:
        ConfigError: ``max_message_bytes`` below :data:`MIN_MESSAGE_BYTES`.
        OverflowError: the frame needs more than 65535 chunks or 2**32 bytes.
    """
    if max_message_bytes < MIN_MESSAGE_BYTES:
        raise ConfigError("max_message_bytes", max_message_bytes, f"must be >= {MIN_MESSAGE_BYTES}")
    parts = [memoryview(p).cast("B") for p in body] if isinstance(body, list) else [memoryview(body).cast("B")]
    per = max_message_bytes - CHUNK_HEADER.size
    n = sum(len(p) for p in parts)
    count = max(1, -(-n // per))
    if count > MAX_CHUNKS or n > 0xFFFFFFFF:
        raise OverflowError(f"frame of {n} bytes needs {count} chunks of {per}")
    flags = FLAG_HAS_RECIPIENT if recipient is not None else 0
    rcpt = recipient if recipient is not None else 0
    chunks: list[bytes] = []
    it = iter(parts)
    part, pos = memoryview(b""), 0
    for i in range(count):
        seg: list[Any] = [CHUNK_HEADER.pack(WIRE_VERSION, flags, sender, rcpt, frame_id, i, count, n)]
        need = min(per, n - i * per)
        while need:
            if pos == len(part):
                part, pos = next(it), 0
                continue
            k = min(need, len(part) - pos)
            seg.append(part[pos:pos + k])
            pos += k
            need -= k
        chunks.append(b"".join(seg))
    return chunks


def rechunk(chunk: Any, max_message_bytes: int) -> list[bytes]:
    """Re-cut one relayed chunk for a link whose messages are at most ``max_message_bytes``.

    For a relay (docs/INTERFACES.md, "Wire"): it reads the routing header only and slices the
    payload as opaque bytes. Every chunk of a frame becomes the same number ``k`` of chunks, ``k``
    derived from the header alone (``frame_len`` and ``count`` bound the payload of any chunk a
    :func:`split_frame` writer cut), so the chunks of one frame can be re-cut one at a time, in
    any order, without state: chunk ``i`` becomes chunks ``i * k + j`` (``j < k``) of a frame of
    ``count * k`` chunks, same ``frame_id`` and ``frame_len``, and :class:`~tabcohort.wire.FrameReader`
    reassembles them as any other frame. When ``k == 1`` the chunk is returned unchanged.

    Args:
        chunk: bytes-like, one chunk as received (header + payload).
        max_message_bytes: the receiving link's largest message, header included
            (>= :data:`MIN_MESSAGE_BYTES`).

    Returns:
        The chunks to send in its place, in index order, each at most ``max_message_bytes``.

    Raises:
        ConfigError: ``max_message_bytes`` below :data:`MIN_MESSAGE_BYTES`.
        RemoteProtocolError: a bad header (as :func:`parse_route`), ``bad_chunk`` for a payload
            larger than its frame's chunks can be (not cut as :func:`split_frame` cuts), or
            ``absurd_size`` when the re-cut frame would need more than 65535 chunks.
    """
    if max_message_bytes < MIN_MESSAGE_BYTES:
        raise ConfigError("max_message_bytes", max_message_bytes, f"must be >= {MIN_MESSAGE_BYTES}")
    r = parse_route(chunk)
    per = max_message_bytes - CHUNK_HEADER.size
    # the largest payload a uniform cut gives any chunk of this frame: all but the last chunk
    # carry P bytes with P * (count - 1) < frame_len
    bound = r.frame_len if r.count == 1 else (r.frame_len - 1) // (r.count - 1)
    k = max(1, -(-bound // per))
    if k == 1:
        if len(chunk) > max_message_bytes:
            raise RemoteProtocolError(L.BAD_CHUNK, f"chunk of {len(chunk)} bytes in a frame cut at {bound}")
        return [bytes(chunk)]
    count = r.count * k
    if count > MAX_CHUNKS or count > r.frame_len:
        raise RemoteProtocolError(L.ABSURD_SIZE, f"re-cut frame would need {count} chunks")
    payload = memoryview(chunk)[CHUNK_HEADER.size :]
    n = len(payload)
    if n > k * per:
        raise RemoteProtocolError(L.BAD_CHUNK, f"payload of {n} bytes in a frame cut at {bound}")
    step = -(-n // k) if n else 0
    flags = FLAG_HAS_RECIPIENT if r.recipient is not None else 0
    rcpt = r.recipient if r.recipient is not None else 0
    base = r.index * k
    return [b"".join((CHUNK_HEADER.pack(WIRE_VERSION, flags, r.sender, rcpt, r.frame_id, base + j, count,
                                        r.frame_len), payload[j * step : (j + 1) * step]))
            for j in range(k)]
