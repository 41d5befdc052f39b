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
