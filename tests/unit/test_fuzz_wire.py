"""Fuzz the reader with mutated valid chunks (docs/INTERFACES.md, "Wire").

A seeded, deterministic mutator (bit flips, byte overwrites, truncation, extension, splices,
header and body field overwrites with boundary values) feeds >= 100,000 inputs natively
(10,000 under Pyodide; ``TABCOHORT_FUZZ_N`` overrides). Asserted: ``feed`` never raises, the
reader never holds more than its bounds, and every drop reason of the reader fires.
"""

from __future__ import annotations

import os
import random
import struct
import sys
import tracemalloc

import pytest

from tabcohort._compat import np
from tabcohort.wire import CHUNK_HEADER, FrameReader, FrameWriter, WireLimits

N_DEFAULT = 10_000 if sys.platform == "emscripten" else 100_000
N = int(os.environ.get("TABCOHORT_FUZZ_N", N_DEFAULT))

LIMITS = WireLimits(max_frame_bytes=4096, max_incomplete_frames_per_sender=2,
                    max_incomplete_bytes=8192, reassembly_timeout_ms=40.0, max_vector_len=256,
                    max_assign=16, max_int8_block=64)
REQUIRED = {"truncated", "bad_version", "unknown_type", "length_mismatch", "absurd_size",
            "invalid_utf8", "bad_chunk", "reassembly_overflow", "reassembly_timeout"}
BOUNDARY = [0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x10000, 0x7FFFFFFF, 0xFFFFFFFF]
# (offset, struct format) of the chunk header fields after the version byte
HEADER_FIELDS = [(0, "<B"), (1, "<B"), (2, "<I"), (6, "<I"), (10, "<I"), (14, "<H"), (16, "<H"), (18, "<I")]


def corpus(rng: random.Random) -> list[list[bytes]]:
    """Frames (lists of chunks) of every type, precision and chunking."""
    frames = []
    for prec in ("f32", "f16", "bf16", "int8"):
        for mmb in (64, 100, 65536):
            w = FrameWriter(rng.randrange(1, 6), precision=prec, max_message_bytes=mmb, int8_block=8)
            n = rng.choice([0, 1, 5, 24])
            g = [rng.uniform(-3, 3) for _ in range(n)]
            frames.append(w.write({"t": "grad", "term": 1, "step": 4, "loss": 0.5, "samples": 3, "g": g, "to": 1}))
            frames.append(w.write({"t": "round", "term": 1, "step": 9, "lr": 0.1, "loss": 1.0, "samples": 8,
                                   "cohort": 2, "assign": {1: 0, 2: 8}, "shares": {1: 8, 2: 8}, "cursor": 0,
                                   "params": g}))
            frames.append(w.write({"t": "hello", "version": 1, "job": "jøb", "batch": 8, "ready": True,
                                   "running": True, "step": 0, "model": "mlp", "backend": "py"}))
            frames.append(w.write({"t": "beat", "batch": 8, "ready": False, "running": True, "term": 1, "step": 3,
                                   "backend": "é" * 10}))
    return frames


def mutate(rng: random.Random, chunk: bytes, pool: list[bytes]) -> bytes:
    b = bytearray(chunk)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.randrange(9)
        if op == 0 and b:  # bit flip
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:  # random byte
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 2:  # truncate
            del b[rng.randrange(len(b) + 1):]
        elif op == 3:  # extend
            b += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif op == 4:  # splice with another chunk
            o = rng.choice(pool)
            b = b[: rng.randrange(len(b) + 1)] + o[rng.randrange(len(o) + 1):]
        elif op in (5, 6) and len(b) >= CHUNK_HEADER.size:  # header field overwrite
            off, fmt = rng.choice(HEADER_FIELDS)
            v = rng.choice(BOUNDARY) & (0xFF if fmt == "<B" else 0xFFFF if fmt == "<H" else 0xFFFFFFFF)
            struct.pack_into(fmt, b, off, v)
        elif op == 7 and len(b) > CHUNK_HEADER.size + 4:  # body field overwrite
            fmt = rng.choice(("<B", "<H", "<I"))
            off = rng.randrange(CHUNK_HEADER.size, len(b) - struct.calcsize(fmt) + 1)
            struct.pack_into(fmt, b, off, rng.choice(BOUNDARY) & ((1 << 8 * struct.calcsize(fmt)) - 1))
        elif op == 8 and len(b) > CHUNK_HEADER.size:  # non-UTF-8 bytes somewhere in the body
            off = rng.randrange(CHUNK_HEADER.size, len(b))
            b[off : off + 2] = rng.choice((b"\xc3\x28", b"\xff", b"\xed\xa0\x80"))
    return bytes(b)


def run_fuzz(n: int, seed: int) -> tuple[dict[str, int], int]:
    rng = random.Random(seed)
    frames = corpus(rng)
    pool = [c for f in frames for c in f]
    drops: dict[str, int] = {}
    decoded = 0
    now = 0.0
    paths = [False, True] if np is not None else [False]
    reader = None
    for i in range(n):
        if i % 2000 == 0:
            if reader is not None:
                for k, v in reader.drops.items():
                    drops[k] = drops.get(k, 0) + v
                decoded += reader.n_frames
            reader = FrameReader(LIMITS, use_numpy=paths[(i // 2000) % len(paths)])
        now += rng.choice((0.0, 1.0, 1.0, 5.0))
        frame = rng.choice(frames)
        if rng.random() < 0.15:  # a whole valid frame, some chunks mutated
            chunks = [mutate(rng, c, pool) if rng.random() < 0.3 else c for c in frame]
        else:
            chunks = [mutate(rng, rng.choice(frame), pool)]
        for c in chunks:
            try:
                reader.feed(c, now_ms=now)
            except Exception as exc:  # pragma: no cover - the assertion is the point
                pytest.fail(f"feed raised {exc!r} on input {c.hex()} (seed {seed}, i {i})")
            if reader._held_bytes > LIMITS.max_incomplete_bytes:
                pytest.fail(f"reader holds {reader._held_bytes} bytes")
    for k, v in reader.drops.items():
        drops[k] = drops.get(k, 0) + v
    return drops, decoded + reader.n_frames


def test_fuzz_mutated_frames_every_reason_fires():
    drops, decoded = run_fuzz(N, seed=20240601)
    missing = REQUIRED - set(drops)
    assert not missing, f"reasons that never fired: {sorted(missing)}; got {drops}"
    assert decoded > N // 100, "the mutator should leave some frames decodable"


def test_absurd_declarations_allocate_nothing_big():
    """Headers that declare huge frames/vectors/strings are refused before allocation."""
    lim = WireLimits()  # the real defaults: 64 MiB frames, 16 Mi-element vectors
    r = FrameReader(lim)
    w = FrameWriter(1, max_message_bytes=64)
    chunk = w.write({"t": "grad", "term": 1, "step": 1, "loss": 0.0, "samples": 1, "g": [1.0] * 30})[0]
    hostile = []
    for count, frame_len in ((0xFFFF, 0xFFFFFFFF), (0xFFFF, lim.max_frame_bytes), (2, 2**25)):
        b = bytearray(chunk)
        struct.pack_into("<HI", b, 16, count, frame_len)
        hostile.append(bytes(b))
    body = b"\x04" + struct.pack("<QdQBBII", 1, 0.0, 1, 0, 0, 0xFFFFFFFF, 0)
    hostile.append(CHUNK_HEADER.pack(1, 0, 1, 0, 0, 0, 1, len(body)) + body)
    body = b"\x04" + struct.pack("<QdQBBII", 1, 0.0, 1, 0, 0, lim.max_vector_len, 0)
    hostile.append(CHUNK_HEADER.pack(1, 0, 1, 0, 0, 0, 1, len(body)) + body)
    tracemalloc.start()
    try:
        for i in range(2000):
            c = bytearray(hostile[i % len(hostile)])
            struct.pack_into("<I", c, 2, i % 50)  # many senders ...
            struct.pack_into("<I", c, 10, i)  # ... and frame ids
            r.feed(bytes(c), now_ms=float(i))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"peak {peak} bytes"
    assert r.drops.get("reassembly_overflow", 0) > 0 and r.drops.get("absurd_size", 0) > 0


def _never_completed(sender: int, frame_id: int, chunk_bytes: int, count: int = 4) -> bytes:
    """Chunk 0 of a ``count``-chunk frame whose other chunks never come (a hostile peer)."""
    head = CHUNK_HEADER.pack(1, 0, sender, 0, frame_id, 0, count, chunk_bytes * count)
    return head + bytes(chunk_bytes)


def test_one_senders_never_completed_frames_cost_only_its_own_budget():
    """A hostile sender streams first chunks of frames that never complete: the reader holds at
    most that sender's budget for it, and an honest sender's multi-chunk frame, interleaved,
    still completes (the hostile sender's frames are the ones evicted)."""
    lim = WireLimits(max_frame_bytes=64 << 10, max_incomplete_frames_per_sender=4,
                     max_incomplete_bytes=1 << 20, max_incomplete_bytes_per_sender=40 << 10)
    r = FrameReader(lim)
    honest = FrameWriter(7, max_message_bytes=1024).write(
        {"t": "grad", "term": 1, "step": 3, "loss": 0.5, "samples": 8, "g": [0.25] * 2000})
    assert len(honest) > 4
    got = []
    rng = random.Random(5)
    for i, ch in enumerate(honest):
        for k in range(rng.randint(1, 6)):      # a flood between every honest chunk
            r.feed(_never_completed(9, i * 10 + k, rng.choice((1000, 8000, 16000))), now_ms=i)
            assert r.held_bytes(9) <= lim.sender_budget_bytes
            assert r.held_bytes() <= lim.max_incomplete_bytes
        got += r.feed(ch, now_ms=i)
    assert len(got) == 1 and got[0]["from"] == 7 and len(got[0]["g"]) == 2000
    assert r.drops["reassembly_overflow"] > 0


def test_the_total_budget_evicts_the_heaviest_sender_first():
    lim = WireLimits(max_frame_bytes=64 << 10, max_incomplete_frames_per_sender=8,
                     max_incomplete_bytes=48 << 10, max_incomplete_bytes_per_sender=64 << 10)
    r = FrameReader(lim)
    r.feed(_never_completed(1, 1, 4000), now_ms=0)           # the honest sender's partial frame, oldest
    for k in range(20):                                       # a heavy sender fills the rest
        r.feed(_never_completed(2, k, 8000), now_ms=1)
    assert r.held_bytes(1) == 4000                            # never evicted for the heavy one
    assert r.held_bytes() <= lim.max_incomplete_bytes
    # the default per-sender budget is one largest frame
    assert WireLimits().sender_budget_bytes == WireLimits().max_frame_bytes
