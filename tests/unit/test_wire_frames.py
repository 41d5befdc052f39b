"""Frames and chunks: message round trips, chunk headers, bounded reassembly
(docs/INTERFACES.md, "Wire"). Synchronous; time is an argument."""

from __future__ import annotations

import math
import random
import struct

import pytest

from tabcohort.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from tabcohort.wire import (
    CHUNK_HEADER,
    DATA_CHANNEL_MAX_MESSAGE_BYTES,
    FrameReader,
    FrameWriter,
    Route,
    WireLimits,
    negotiate_max_message_bytes,
    parse_route,
)

from ._wire_util import PATHS, PRECISIONS, random_vector, same_bits

HELLO = {"t": "hello", "version": 1, "job": "ab" * 32, "batch": 64, "ready": False, "running": True,
         "step": 2**63 + 5, "model": "mlp-784-128-10 ✓", "backend": "numpy"}
BEAT = {"t": "beat", "batch": 7, "ready": True, "running": False, "term": 1, "step": 0, "backend": "py"}


def round_msg(params, **kw):
    m = {"t": "round", "term": 1, "step": 12, "lr": 0.05, "loss": math.nan, "samples": 0, "cohort": 3,
         "assign": {0xFFFFFFFF: 5, 2: 0, 7: 64}, "shares": {0xFFFFFFFF: 3, 2: 64, 7: 1},
         "cursor": 2**40, "params": params}
    m.update(kw)
    return m


def grad_msg(g, **kw):
    m = {"t": "grad", "term": 1, "step": 12, "loss": 2.5, "samples": 32, "g": g}
    m.update(kw)
    return m


def feed_all(reader, chunks, now_ms=0.0):
    return [m for c in chunks for m in reader.feed(c, now_ms=now_ms)]


@pytest.mark.parametrize("use_numpy", PATHS)
@pytest.mark.parametrize("msg", [HELLO, BEAT, dict(BEAT, to=0)], ids=["hello", "beat", "beat-to-0"])
def test_scalar_messages_round_trip(use_numpy, msg):
    w = FrameWriter(0xDEADBEEF, use_numpy=use_numpy)
    (m,) = feed_all(FrameReader(use_numpy=use_numpy), w.write(msg))
    assert m == dict(msg, **{"from": 0xDEADBEEF})


@pytest.mark.parametrize("use_numpy", PATHS)
@pytest.mark.parametrize("prec", PRECISIONS)
@pytest.mark.parametrize("mmb", [64, 1000, DATA_CHANNEL_MAX_MESSAGE_BYTES])
def test_vector_messages_round_trip_chunked(use_numpy, prec, mmb):
    xs = random_vector(random.Random(7), 3000, finite=prec == "int8")
    w = FrameWriter(5, precision=prec, max_message_bytes=mmb, use_numpy=use_numpy)
    r = FrameReader(use_numpy=use_numpy)
    for msg in (round_msg(xs), grad_msg(xs, to=1)):
        chunks = w.write(msg)
        assert all(len(c) <= mmb for c in chunks)
        assert len(chunks) == max(1, -(-(sum(map(len, chunks)) - CHUNK_HEADER.size * len(chunks))
                                       // (mmb - CHUNK_HEADER.size)))
        random.Random(1).shuffle(chunks)  # reassembly does not need order
        (m,) = feed_all(r, chunks)
        key = "params" if msg["t"] == "round" else "g"
        want = w.quantize(xs)
        assert same_bits(m[key], xs if want is None else want)
        rest = {k: v for k, v in m.items() if k not in (key, "loss")}
        assert rest == {k: v for k, v in dict(msg, **{"from": 5}).items() if k not in (key, "loss")}
    assert not r.drops and r.n_incomplete == 0


@pytest.mark.parametrize("n_assigned", [0, 1, 2, 5])
def test_a_reassembled_f32_vector_is_a_view_of_the_readers_own_buffer(n_assigned):
    """A frame reassembled from several chunks is copied once, into the reader's buffer, and its
    f32 vector (``round`` with any assignment, ``grad``) is an aligned, writable view of that
    buffer; a single-chunk frame's vector (the transport's memory) is still a copy."""
    np = pytest.importorskip("numpy")
    xs = np.arange(5000, dtype=np.float32) - 2500.5
    assign = {k + 1: 7 * k for k in range(n_assigned)}
    shares = {k + 1: 3 for k in range(n_assigned)}
    r = FrameReader(use_numpy=True)
    for mmb, copied in ((1000, False), (1 << 16, True)):
        w = FrameWriter(5, precision="f32", max_message_bytes=mmb, use_numpy=True)
        for msg, key in ((round_msg(xs, assign=assign, shares=shares), "params"), (grad_msg(xs), "g")):
            chunks = w.write(msg)
            assert (len(chunks) == 1) == copied
            (m,) = feed_all(r, chunks)
            v = m[key]
            assert same_bits(v, xs) and v.dtype == np.float32
            assert v.flags.aligned and v.flags.writeable
            assert v.flags.owndata == copied, (msg["t"], mmb)
            v[0] = 1.0        # the vector is the message's own: the sender's array is untouched
            assert xs[0] == -2500.5
    assert not r.drops


@pytest.mark.parametrize("use_numpy", PATHS)
def test_empty_and_one_element_vectors(use_numpy):
    w = FrameWriter(1, precision="int8", use_numpy=use_numpy)
    r = FrameReader(use_numpy=use_numpy)
    for xs in ([], [0.75]):
        (m,) = feed_all(r, w.write(grad_msg(xs)))
        assert len(m["g"]) == len(xs)


def test_chunk_header_layout_and_route():
    w = FrameWriter(0x01020304, max_message_bytes=64)
    chunks = w.write(grad_msg([1.0] * 40, to=0x0A0B0C0D))
    body_len = sum(len(c) - CHUNK_HEADER.size for c in chunks)
    for i, c in enumerate(chunks):
        assert c[0] == 1 and c[1] == 1
        assert struct.unpack_from("<IIIHHI", c, 2) == (0x01020304, 0x0A0B0C0D, 0, i, len(chunks), body_len)
        assert parse_route(c) == Route(0x01020304, 0x0A0B0C0D, 0, i, len(chunks), body_len)
    (c2,) = w.write(BEAT)
    assert parse_route(c2) == Route(0x01020304, None, 1, 0, 1, len(c2) - CHUNK_HEADER.size)
    assert c2[CHUNK_HEADER.size] == 2  # the frame body starts with the type byte


def test_frame_ids_wrap_per_sender():
    w = FrameWriter(1)
    w._next_id = 0xFFFFFFFF
    assert parse_route(w.write(BEAT)[0]).frame_id == 0xFFFFFFFF
    assert parse_route(w.write(BEAT)[0]).frame_id == 0


@pytest.mark.parametrize("chunk, reason", [
    (b"\x01\x00", "truncated"),
    (CHUNK_HEADER.pack(2, 0, 1, 0, 0, 0, 1, 1) + b"\x02", "bad_version"),
    (CHUNK_HEADER.pack(1, 2, 1, 0, 0, 0, 1, 1) + b"\x02", "bad_chunk"),
    (CHUNK_HEADER.pack(1, 0, 1, 9, 0, 0, 1, 1) + b"\x02", "bad_chunk"),
    (CHUNK_HEADER.pack(1, 0, 1, 0, 0, 1, 1, 1) + b"\x02", "bad_chunk"),
    (CHUNK_HEADER.pack(1, 0, 1, 0, 0, 0, 0, 1) + b"\x02", "bad_chunk"),
    (CHUNK_HEADER.pack(1, 0, 1, 0, 0, 0, 3, 2) + b"\x02", "bad_chunk"),
    (CHUNK_HEADER.pack(1, 0, 1, 0, 0, 0, 1, 2**31) + b"\x02", "absurd_size"),
    (CHUNK_HEADER.pack(1, 0, 1, 0, 0, 0, 1, 1) + b"\x02\x02", "length_mismatch"),
])
def test_parse_route_rejects(chunk, reason):
    with pytest.raises(RemoteProtocolError) as ei:
        parse_route(chunk, WireLimits())
    assert ei.value.reason == reason
    r = FrameReader()
    assert r.feed(chunk, now_ms=0) == [] and r.drops == {reason: 1}


def body_chunk(body: bytes, sender: int = 1) -> bytes:
    return CHUNK_HEADER.pack(1, 0, sender, 0, 0, 0, 1, len(body)) + body


def _vec(code, flags, n, block, data=b""):
    return struct.pack("<BBII", code, flags, n, block) + data


GRAD_HEAD = b"\x04" + struct.pack("<QQdQ", 1, 1, 0.5, 2)


@pytest.mark.parametrize("body, reason", [
    (b"", "truncated"),
    (b"\x09", "unknown_type"),
    (b"\x02" + struct.pack("<I", 1), "truncated"),
    (b"\x02" + struct.pack("<IBBQ", 1, 2, 0, 0) + b"\x00\x00", "bad_value"),
    (b"\x02" + struct.pack("<IBBQ", 1, 1, 0, 0) + b"\x41\x00", "absurd_size"),
    (b"\x02" + struct.pack("<IBBQ", 1, 1, 0, 0) + b"\x02\x00\xc3\x28", "invalid_utf8"),
    (b"\x02" + struct.pack("<IBBQ", 1, 1, 0, 0) + b"\x00\x00" + b"\x00" * 8 + b"\x00", "length_mismatch"),
    (b"\x02" + struct.pack("<IBBQ", 1, 1, 0, 0) + b"\x00\x00" + b"\x00" * 7, "truncated"),
    (GRAD_HEAD + _vec(0, 0, 3, 0, b"\x00" * 11), "length_mismatch"),
    (GRAD_HEAD + _vec(0, 0, 2**31, 0), "absurd_size"),
    (GRAD_HEAD + _vec(7, 0, 0, 0), "bad_value"),
    (GRAD_HEAD + _vec(0, 1, 0, 0), "bad_value"),
    (GRAD_HEAD + _vec(3, 0, 1, 0, b"\x00" * 5), "bad_value"),
    (GRAD_HEAD + _vec(3, 0, 1, 2**30, b"\x00" * 5), "absurd_size"),
    (GRAD_HEAD + _vec(3, 0, 1, 4, struct.pack("<f", -1.0) + b"\x01"), "bad_value"),
    (GRAD_HEAD + _vec(3, 0, 1, 4, struct.pack("<f", math.inf) + b"\x01"), "bad_value"),
    (GRAD_HEAD + _vec(3, 0, 1, 4, struct.pack("<f", 1.0) + b"\x80"), "bad_value"),
    (b"\x03" + struct.pack("<QQddQIQI", 1, 1, 0.1, 0.0, 1, 1, 0, 2**31), "absurd_size"),
    (b"\x03" + struct.pack("<QQddQIQI", 1, 1, 0.1, 0.0, 1, 1, 0, 5) + b"\x00" * 12, "length_mismatch"),
    (b"\x03" + struct.pack("<QQddQIQIIIIIII", 1, 1, 0.1, 0.0, 1, 1, 0, 2, 5, 0, 1, 5, 0, 1), "bad_value"),
])
@pytest.mark.parametrize("use_numpy", PATHS)
def test_frame_body_drops(use_numpy, body, reason):
    r = FrameReader(use_numpy=use_numpy)
    assert r.feed(body_chunk(body), now_ms=0) == []
    assert r.drops == {reason: 1}


def test_reassembly_overflow_evicts_oldest_per_sender():
    lim = WireLimits(max_incomplete_frames_per_sender=2)
    r = FrameReader(lim)
    w = FrameWriter(3, max_message_bytes=64)
    frames = [w.write(grad_msg([float(i)] * 20)) for i in range(3)]
    other = FrameWriter(4, max_message_bytes=64).write(grad_msg([9.0] * 20))
    for f in frames + [other]:
        assert r.feed(f[0], now_ms=0) == []
    assert r.drops == {"reassembly_overflow": 1} and r.n_incomplete == 3
    assert feed_all(r, frames[0][1:]) == []  # its first chunk was evicted: it restarts, incomplete
    (m,) = feed_all(r, frames[2][1:])
    assert list(m["g"])[:1] == [2.0]


def test_reassembly_total_byte_bound():
    r = FrameReader(WireLimits(max_incomplete_bytes=100))
    w = FrameWriter(3, max_message_bytes=64)
    chunks = w.write(grad_msg([1.0] * 100))
    feed_all(r, chunks[:-1])
    assert r.drops.get("reassembly_overflow", 0) >= 1
    assert r._held_bytes <= 100


def test_reassembly_timeout():
    r = FrameReader(WireLimits(reassembly_timeout_ms=1000))
    chunks = FrameWriter(3, max_message_bytes=64).write(grad_msg([1.0] * 20))
    r.feed(chunks[0], now_ms=0)
    assert r.expire(999) == 0 and r.n_incomplete == 1
    assert feed_all(r, chunks[1:-1], now_ms=500) == []
    assert r.feed(chunks[-1], now_ms=1000) == []  # expired before this chunk was taken
    assert r.drops["reassembly_timeout"] == 1


def test_inconsistent_and_duplicate_chunks():
    w = FrameWriter(3, max_message_bytes=64)
    chunks = w.write(grad_msg([1.0] * 20))
    r = FrameReader()
    r.feed(chunks[0], now_ms=0)
    r.feed(chunks[0], now_ms=0)
    assert r.drops == {"duplicate_chunk": 1}
    bad = bytearray(chunks[1])
    struct.pack_into("<H", bad, 16, len(chunks) + 1)  # a different count for the same frame
    r.feed(bytes(bad), now_ms=0)
    assert r.drops["bad_chunk"] == 1 and r.n_incomplete == 0
    # a reassembled frame longer than declared
    r2 = FrameReader()
    long = bytearray(chunks[1])
    long += b"\x00" * 5
    r2.feed(chunks[0], now_ms=0)
    r2.feed(bytes(long), now_ms=0)
    feed_all(r2, chunks[2:])
    assert "length_mismatch" in r2.drops


def test_writer_rejects_bad_messages_and_config():
    w = FrameWriter(1)
    for bad in ({"t": "nope"}, {"t": "beat"}, dict(BEAT, batch=-1), dict(BEAT, step=2**64),
                dict(BEAT, backend="x" * 65), dict(BEAT, to=2**32), dict(BEAT, **{"from": 2}),
                grad_msg(["a"]), dict(BEAT, batch=1.5)):
        with pytest.raises(LocalProtocolError):
            w.write(bad)
    for kw in ({"precision": "f8"}, {"max_message_bytes": 10}, {"int8_block": 0}):
        with pytest.raises(ConfigError):
            FrameWriter(1, **kw)
    with pytest.raises(ConfigError):
        FrameWriter(-1)
    with pytest.raises(LocalProtocolError, match="chunks"):
        FrameWriter(1, max_message_bytes=64).write(grad_msg([0.0] * 700_000))


def test_negotiate_max_message_bytes():
    assert negotiate_max_message_bytes(DATA_CHANNEL_MAX_MESSAGE_BYTES, None) == 65536
    assert negotiate_max_message_bytes(DATA_CHANNEL_MAX_MESSAGE_BYTES, 262144) == 262144
    assert negotiate_max_message_bytes(100_000, 262144) == 100_000
    assert negotiate_max_message_bytes(None, 0) == DATA_CHANNEL_MAX_MESSAGE_BYTES
    with pytest.raises(ConfigError):
        negotiate_max_message_bytes(10, None)


def test_a_frame_cut_into_one_byte_chunks_is_charged_for_each_part_it_holds():
    # a hostile trial: 4 never-completed frames of 65,534 one-byte chunks held 160 MB while the
    # reader charged 256 KiB of its 64 MiB budget; each part is now charged at least
    # PART_MIN_CHARGE_BYTES (its chunk's header, buffer object and slot)
    from tabcohort.wire.chunk import CHUNK_HEADER
    from tabcohort.wire.reader import PART_MIN_CHARGE_BYTES

    budget = 1 << 20
    r = FrameReader(WireLimits(max_incomplete_bytes_per_sender=budget))
    count = 65535
    for fid in range(4):
        for i in range(4096):
            r.feed(CHUNK_HEADER.pack(1, 0, 0x1234, 0, fid, i, count, count) + b"x", now_ms=0.0)
    assert r.held_bytes(0x1234) <= budget
    assert r.drops.get("reassembly_overflow", 0) >= 4 * 4096 * PART_MIN_CHARGE_BYTES // budget - 4
    # an honest frame cut at the smallest chunk size still completes, its tail charged as it is
    w = FrameWriter(3, max_message_bytes=64)
    (m,) = feed_all(r, w.write(grad_msg([1.0] * 20)))
    assert list(m["g"]) == [1.0] * 20 and r.held_bytes(3) == 0
