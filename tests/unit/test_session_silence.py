"""The session gives its bus the machine's ``policy.drop_ms`` as the silence bound of a direct
path (docs/PROTOCOL.md "Direct TCP path", "Silence"): a path that goes silent without closing
must move to the relay before the followers' takeover window, or the leader's rounds are thrown
away (a leader whose direct paths dropped every packet committed 1,600-6,400 steps, with the
server up, that the followers, taking over at 3.2 s, never had)."""

from __future__ import annotations

import asyncio

import pytest

from tabcohort.model.toy import ToyWorker
from tabcohort.protocol.policy import policy
from tabcohort.runtime.session import RankSession

from .machine_helpers import SEAT_JOB, SeatBus


@pytest.mark.needs_loop
def test_the_seat_gives_the_bus_the_policys_drop_as_the_silence_bound_and_follows_it():
    async def go():
        s, bus = RankSession(), SeatBus()
        s.on_control({"type": "welcome", "id": 1, "secret": "x", "peers": [], "may_lead": True, "lead_peers": []})
        m, d = s.seat(bus, ToyWorker(bucket_len=4, batch=2), SEAT_JOB, "job-test")
        d.start()
        assert bus.silence_bounds_ms == [m.policy.drop_ms] == [1600.0]
        assert m.policy.drop_ms < m.policy.takeover_ms
        m.policy = policy(16, m.timing)           # (the cohort grew: every window stretches)
        d.stop()                                  # (a report)
        await d.close()
        return bus.silence_bounds_ms, m.policy.drop_ms
    bounds, drop_ms = asyncio.run(go())
    assert bounds == [1600.0, drop_ms] and drop_ms > 1600.0


def test_a_bad_silence_bound_is_refused_by_name():
    from tabcohort.bus.star import StarBus

    from .test_mesh_supervise import _Socket
    bus = StarBus(_Socket(), "ws://127.0.0.1:1/api/rooms/r/ws")
    bus.set_silence_bound_ms(1600.0)
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1600"):
        with pytest.raises(ValueError, match="silence bound"):
            bus.set_silence_bound_ms(bad)
