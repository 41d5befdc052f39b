"""A relay re-cuts a frame for a receiver whose link takes smaller messages (``wire.rechunk``,
docs/INTERFACES.md "Wire"): header and opaque payload slices only, chunk by chunk in any order,
and the receiver's FrameReader reassembles the very message the sender wrote."""

from __future__ import annotations

import random

import pytest

from tabcohort.errors import RemoteProtocolError
from tabcohort.wire import CHUNK_HEADER, FrameReader, FrameWriter, parse_route, rechunk, split_frame

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _round(n: int) -> dict:
    return {"t": "round", "term": 1, "from": 7, "step": 3, "lr": 0.1, "loss": 1.0, "samples": 8, "cohort": 2,
            "assign": {7: 0, 9: 32}, "shares": {7: 32, 9: 32}, "cursor": 0,
            "params": [float(i % 97) / 7 for i in range(n)]}


@SETTINGS
@given(n=st.integers(0, 30_000), sender_max=st.integers(64, 300_000), recv_max=st.integers(64, 70_000),
       seed=st.integers(0, 2**32 - 1), to=st.sampled_from([None, 9]))
def test_a_recut_frame_reassembles_to_the_same_message_in_any_order(n, sender_max, recv_max, seed, to):
    msg = _round(n)
    if to is not None:
        msg["to"] = to
    chunks = FrameWriter(7, max_message_bytes=sender_max).write(msg)
    out = [c for ch in chunks for c in rechunk(ch, recv_max)]
    assert all(len(c) <= recv_max for c in out)
    routes = [parse_route(c) for c in out]
    assert {(r.sender, r.recipient, r.frame_id, r.frame_len, r.count) for r in routes} == \
        {(7, to, routes[0].frame_id, routes[0].frame_len, len(out))}
    assert sorted(r.index for r in routes) == list(range(len(out)))
    if len(chunks) == 1 and len(chunks[0]) <= recv_max:
        assert out == chunks                              # nothing to re-cut
    random.Random(seed).shuffle(out)
    reader = FrameReader()
    got = [m for c in out for m in reader.feed(c, now_ms=0)]
    (m,) = got
    assert reader.drops == {}
    direct = FrameReader()
    (ref,) = [m for c in chunks for m in direct.feed(c, now_ms=0)]   # the frame as sent, uncut
    assert [float(x) for x in m["params"]] == [float(x) for x in ref["params"]]
    assert m.get("to") == to and m["assign"] == msg["assign"] and m["step"] == 3


def test_each_chunk_of_a_frame_maps_to_the_same_number_of_pieces():
    body = bytes(range(256)) * 1000                      # 256,000 bytes
    chunks = split_frame(body, sender=1, recipient=None, frame_id=5, max_message_bytes=65536)
    assert len(chunks) == 4
    pieces = [rechunk(c, 16384) for c in chunks]
    assert len({len(p) for p in pieces}) == 1           # the last (short) chunk too
    count = parse_route(pieces[0][0]).count
    assert count == 4 * len(pieces[0])
    assert b"".join(c[CHUNK_HEADER.size:] for p in pieces for c in p) == body


def test_a_chunk_that_fits_every_piece_of_its_frame_passes_unchanged():
    chunks = split_frame(b"x" * 10_000, sender=1, recipient=2, frame_id=1, max_message_bytes=4096)
    assert [rechunk(c, 16384) for c in chunks] == [[c] for c in chunks]


def test_a_chunk_larger_than_its_frame_allows_is_refused_not_split():
    # chunk 0 of 3 of a 10,000-byte frame: a uniform cut gives it at most 4,999 bytes
    hdr = CHUNK_HEADER.pack(1, 0, 1, 0, 3, 0, 3, 10_000)
    with pytest.raises(RemoteProtocolError) as e:
        rechunk(hdr + b"y" * 6000, 1024)                 # 3 chunks of a 10,000-byte frame: <= 4,999 each
    assert e.value.reason == "bad_chunk"
    with pytest.raises(RemoteProtocolError) as e:
        rechunk(b"\x02" + hdr[1:] + b"y", 1024)
    assert e.value.reason == "bad_version"
    # more than 65535 chunks after the cut: refused (the frame cannot be carried), never raised as
    # anything but RemoteProtocolError
    hdr = CHUNK_HEADER.pack(1, 0, 1, 0, 3, 0, 60_000, 60_000 * 1000)
    with pytest.raises(RemoteProtocolError) as e:
        rechunk(hdr + b"z" * 1000, 64)
    assert e.value.reason == "absurd_size"
