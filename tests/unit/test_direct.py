"""The direct TCP path's sans-I/O core (docs/PROTOCOL.md, "Direct TCP path"): the announced
address and key are untrusted, the handshake proves the key both ways, the stream framing
refuses absurd lengths."""

from __future__ import annotations

import os
import random

import pytest

from tabcohort.bus import direct
from tabcohort.bus.path import Path, PathKind, PathState


@pytest.mark.parametrize("addr,want", [
    ("127.0.0.1:40100", ("127.0.0.1", 40100)),
    ("192.0.2.7:1", ("192.0.2.7", 1)),
    ("[::1]:65535", ("::1", 65535)),
    ("[2001:db8::7]:8080", ("2001:db8::7", 8080)),
])
def test_an_ip_literal_and_port_parse(addr, want):
    assert direct.parse_addr(addr) == want
    assert direct.parse_addr(direct.format_addr(*want)) == want


@pytest.mark.parametrize("addr", [
    None, 7, b"127.0.0.1:1", "", "127.0.0.1", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:65536",
    "127.0.0.1:99999999", "localhost:80", "example.org:443", "0.0.0.0:80", "[::]:80", "224.0.0.1:5353",
    "[fe80::1%eth0]:80", "::1:80", "127.0.0.1:+80", "127.0.0.1: 80", "1" * 65 + ":1",
    "１２７.0.0.1:80", "127.0.0.1:８０",
])
def test_anything_else_is_refused(addr):
    assert direct.parse_addr(addr) is None


def test_keys_are_exactly_64_hex_digits():
    k = os.urandom(32)
    assert direct.parse_key(k.hex()) == k
    for bad in (None, 1, "", k.hex()[:-1], k.hex() + "0", "zz" * 32, k):
        assert direct.parse_key(bad) is None


def test_the_handshake_proves_the_key_both_ways_and_binds_ids_and_nonce():
    key, nonce = os.urandom(32), os.urandom(16)
    hello = direct.dial_hello(key, 5, 9, nonce)
    assert len(hello) == direct.HELLO.size == 60
    listener, dialler, n, mac = direct.read_hello(hello)
    assert (listener, dialler, n) == (5, 9, nonce)
    assert direct.hello_valid(key, listener, dialler, n, mac)
    assert not direct.hello_valid(os.urandom(32), listener, dialler, n, mac)   # another key
    assert not direct.hello_valid(key, listener, 8, n, mac)                    # another dialler
    assert not direct.hello_valid(key, 6, dialler, n, mac)                     # another listener
    assert not direct.hello_valid(key, listener, dialler, os.urandom(16), mac)
    acc = direct.accept_mac(key, 5, 9, nonce)
    assert len(acc) == direct.ACCEPT_BYTES and acc != mac   # the answer is not the hello echoed
    assert acc != direct.accept_mac(key, 5, 9, os.urandom(16))


def test_a_hello_of_the_wrong_size_or_magic_is_refused():
    hello = direct.dial_hello(os.urandom(32), 1, 2, os.urandom(16))
    assert direct.read_hello(hello[:-1]) is None
    assert direct.read_hello(hello + b"x") is None
    assert direct.read_hello(b"GET " + hello[4:]) is None


def test_chunk_stream_splits_any_cut_of_the_stream():
    rng = random.Random(3)
    chunks = [os.urandom(rng.randint(1, 3000)) for _ in range(40)]
    data = direct.frame(chunks)
    for _ in range(20):
        s, out, i = direct.ChunkStream(4096), [], 0
        while i < len(data):
            j = i + rng.randint(1, 700)
            out += s.feed(data[i:j])
            i = j
        assert out == chunks and s.error is None and s.pending_bytes() == 0


def test_one_read_takes_in_every_chunk_it_holds_and_a_long_one_reads_on_into_its_own_buffer():
    # between chunks the stream reads into a scratch buffer: a beat and a bucket queued behind
    # one another are one read (a read per length prefix and per chunk cost a loop turn each:
    # behind a leader's 2 ms computes a 77 KB bucket arrived 12-20 ms after it was sent)
    small = [os.urandom(n) for n in (52, 1, 70_000, 300)]
    s = direct.ChunkStream(direct.DIRECT_MAX_MESSAGE_BYTES)
    data = direct.frame(small)
    buf = s.buffer()
    assert len(buf) >= len(data)
    buf[:len(data)] = data
    assert [bytes(c) for c in s.advance(len(data))] == small and s.pending_bytes() == 0
    # a chunk longer than the scratch buffer: its head is copied, the rest read straight into it
    big = os.urandom(direct.SCRATCH_BYTES * 3 + 5)
    data = direct.frame([big, b"after"])
    first = s.buffer()
    first[:] = data[:len(first)]
    assert s.advance(len(first)) == []
    rest = s.buffer()
    assert len(rest) == len(big) - (len(first) - 4)          # exactly the chunk's remaining bytes
    rest[:] = data[len(first):len(first) + len(rest)]
    (got,) = s.advance(len(rest))
    assert bytes(got) == big and not isinstance(got, bytes)  # a writable buffer of its own
    tail = data[len(first) + len(rest):]
    s.buffer()[:len(tail)] = tail
    assert [bytes(c) for c in s.advance(len(tail))] == [b"after"]


@pytest.mark.parametrize("n", [0, 4097, 2**32 - 1])
def test_chunk_stream_refuses_an_absurd_length_and_stays_refused(n):
    s = direct.ChunkStream(4096)
    assert s.feed(direct.frame([b"ok"])) == [b"ok"]
    assert s.feed(direct.LEN.pack(n) + b"x" * 10) == []
    assert s.error is not None and str(n) in s.error
    assert s.feed(direct.frame([b"later"])) == []


def test_a_direct_path_reports_its_kind_when_open_and_relay_after_fallback():
    p = Path(7, now_ms=0.0, kind=PathKind.TCP)
    assert p.label == "connecting"
    p.opened(direct.DIRECT_MAX_MESSAGE_BYTES, now_ms=10.0)
    assert p.state is PathState.DIRECT and p.label == "tcp" and p.up_after_ms == 10.0
    p.fallback("direct connection lost")
    assert p.label == "relay" and p.why == "direct connection lost"
    assert Path(8, now_ms=0.0).kind is PathKind.RTC   # the default stays the data channel


def test_a_frame_carried_whole_on_a_direct_path_decodes_its_vectors_as_views_of_its_chunk():
    # docs/PROTOCOL.md "Direct TCP path": a round or a bucket of up to DIRECT_MAX_MESSAGE_BYTES
    # is one chunk, read into a buffer of its own (ChunkStream) laid out so that its float32
    # vectors land 4-aligned: the reader decodes them without a copy. A chunk that is not the
    # caller's to give (bytes, read-only) still decodes as a copy.
    np = pytest.importorskip("numpy")
    from tabcohort.wire import FrameReader, FrameWriter

    g = np.arange(1000, dtype=np.float32) / 7
    params = np.arange(1000, dtype=np.float32) * 3
    w = FrameWriter(5, max_message_bytes=direct.DIRECT_MAX_MESSAGE_BYTES)
    for msg in ({"t": "grad", "term": 1, "step": 3, "loss": 0.5, "samples": 8, "g": g},
                {"t": "round", "term": 1, "step": 3, "lr": 0.1, "loss": 1.0, "samples": 8, "cohort": 2,
                 "assign": {5: 0, 6: 8}, "shares": {5: 8, 6: 8}, "cursor": 0, "params": params}):
        chunks = w.write(msg)
        assert len(chunks) == 1
        s = direct.ChunkStream(direct.DIRECT_MAX_MESSAGE_BYTES)
        (c,) = chunks       # as the socket fills the stream's buffers: the length, then the chunk
        s.buffer()[:4] = direct.LEN.pack(len(c))
        assert s.advance(4) == []
        s.buffer()[:] = c
        got = s.advance(len(c))
        key = "g" if msg["t"] == "grad" else "params"
        (out,) = FrameReader(use_numpy=True).feed(got[0], now_ms=0.0, owned=True)
        assert np.array_equal(out[key], msg[key])
        assert np.shares_memory(out[key], np.frombuffer(got[0], np.uint8))     # a view: no copy
        (copied,) = FrameReader(use_numpy=True).feed(bytes(got[0]), now_ms=0.0, owned=True)
        assert np.array_equal(copied[key], msg[key]) and copied[key].flags.writeable
