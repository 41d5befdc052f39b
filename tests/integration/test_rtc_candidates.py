"""A peer's trickled ICE candidates reach a native rank's aiortc connection at most
``MAX_REMOTE_CANDIDATES`` times per connection (README "Limits"): each one costs aioice a sort
of its whole check list and connectivity checks for good."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.integration


def test_a_peers_candidate_flood_is_capped_at_a_native_rank():
    from tabcohort.bus.aio import AiortcConnector
    from tabcohort.bus.rtc_util import MAX_REMOTE_CANDIDATES

    class Listener:
        id = 5

        def __getattr__(self, name):
            return lambda *a, **k: None

    async def main() -> tuple[int, int]:
        conn = AiortcConnector(host_addresses=["127.0.0.1"])
        ch = conn.open(9, Listener())             # this rank offers: remote candidates trickle in
        for i in range(300):
            ch.signal({"kind": "candidate", "candidate": {
                "candidate": f"candidate:{i} 1 udp 2122260223 127.1.{i // 250}.{i % 250 + 1} {20000 + i} typ host",
                "sdpMid": "0", "sdpMLineIndex": 0}})
        taken = ch.n_candidates
        ch.close()
        await conn.aclose()
        return taken, conn.drops.get("rtc_candidate_limit", 0)
    taken, dropped = asyncio.run(main())
    assert taken == MAX_REMOTE_CANDIDATES and dropped == 300 - MAX_REMOTE_CANDIDATES


@pytest.mark.parametrize("cand", [
    {"candidate": "xxxx", "sdpMid": None, "sdpMLineIndex": 0},          # aiortc's parser: an assert
    {"candidate": "candidate:1 1 udp x 127.0.0.1 9 typ host", "sdpMid": "0", "sdpMLineIndex": 0},  # 7 fields
    {"candidate": "candidate:1 1 udp prio 127.0.0.1 port typ host", "sdpMid": "0", "sdpMLineIndex": 0},
    {"candidate": "candidate:1 1 udp 1 127.0.0.1 9 typ host " + "x" * 2000, "sdpMid": "0"},
    {"candidate": 5}, {"candidate": "candidate:1 1 udp 1 127.0.0.1 9 typ host", "sdpMLineIndex": "0"},
    {"candidate": "candidate:1 1 udp 1 127.0.0.1 9 typ host", "sdpMid": ["0"]}, "candidate:1", None,
])
def test_a_candidate_that_is_no_candidate_line_is_refused_before_aiortc(cand):
    # a fuzzer's find: "xxxx" reached aiortc's candidate_from_sdp, whose `assert len(bits) >= 8`
    # failed in the server's task (python -O would have removed the assert: an IndexError)
    from tabcohort.bus.rtc_util import END_OF_CANDIDATES, parse_candidate

    with pytest.raises(ValueError):
        parse_candidate(cand)
    good = parse_candidate({"candidate": "candidate:1 1 udp 2122260223 127.0.0.1 9 typ host", "sdpMid": "0",
                            "sdpMLineIndex": 0})
    assert (good.ip, good.port, good.sdpMid) == ("127.0.0.1", 9, "0")
    assert parse_candidate({"candidate": ""}) is END_OF_CANDIDATES


def test_a_bad_candidate_is_counted_at_a_native_rank():
    from tabcohort.bus.aio import AiortcConnector

    class Listener:
        id = 5

        def __getattr__(self, name):
            return lambda *a, **k: None

    async def main() -> dict:
        conn = AiortcConnector(host_addresses=["127.0.0.1"])
        ch = conn.open(9, Listener())
        ch.signal({"kind": "candidate", "candidate": {"candidate": "xxxx", "sdpMid": None, "sdpMLineIndex": 0}})
        ch.close()
        await conn.aclose()
        return conn.drops
    assert asyncio.run(main()).get("rtc_bad_candidate") == 1
