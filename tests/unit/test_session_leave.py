"""How a follower leaves (tabcohort.runtime.session.RankSession.leave): it waits, bounded, for
the stopping leader's publication (PROTOCOL.md "Controls": a stopping leader publishes), unless
it stopped alone and the leader drives on."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from tabcohort.runtime.session import RankSession


def _follower() -> tuple[SimpleNamespace, SimpleNamespace, SimpleNamespace]:
    machine = SimpleNamespace(looping=False, ready=True, at_step_limit=False, counters={},
                              is_leader=lambda now_ms: False)
    driver = SimpleNamespace(stop=lambda: None, now_ms=lambda: 0.0)
    return machine, driver, SimpleNamespace(failed=None, connected=True, queued_bytes=lambda: 0)


async def _leave(s: RankSession, publish_after_s: float) -> float:
    machine, driver, bus = _follower()

    async def leader() -> None:                   # rounds keep coming, then the publication
        t_end = time.monotonic() + publish_after_s
        while time.monotonic() < t_end:
            s.rounds_seen += 1
            await asyncio.sleep(0.01)
        s.publish_seen = True

    task = asyncio.ensure_future(leader())
    t0 = time.monotonic()
    await s.leave(machine, driver, bus, upload=None, final_report=lambda: {}, poll_s=0.005)
    waited = time.monotonic() - t0
    task.cancel()
    return waited


@pytest.mark.needs_loop
def test_a_follower_of_a_room_the_server_stops_waits_for_a_leader_that_reads_the_stop_late():
    s = RankSession()
    s.on_control({"type": "stop", "reason": "the server is shutting down"})
    assert s.room_stopping
    waited = asyncio.run(_leave(s, publish_after_s=0.8))
    assert s.publish_seen and 0.8 <= waited < 5.0


@pytest.mark.needs_loop
def test_a_follower_that_stops_alone_leaves_while_the_leader_drives_on():
    s = RankSession()
    s.request_stop("interrupted")
    waited = asyncio.run(_leave(s, publish_after_s=3.0))
    assert not s.publish_seen and waited < 2.5            # (the publication would come at 3 s)
