"""How a follower leaves (tabcohort.runtime.session.RankSession.leave): it waits, bounded, for
the stopping leader's publication (PROTOCOL.md "Controls": a stopping leader publishes), unless
it stopped alone and the leader drives on."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from tabcohort.runtime.session import RankSession


def _follower(*, leader_heard: bool = True, others: tuple[int, ...] = ()
              ) -> tuple[SimpleNamespace, SimpleNamespace, SimpleNamespace]:
    machine = SimpleNamespace(id=2, looping=False, ready=True, at_step_limit=False, counters={}, step=7,
                              is_leader=lambda now_ms: False, leader_heard=lambda now_ms: leader_heard,
                              cohort_ids=lambda now_ms: sorted(others))
    driver = SimpleNamespace(stop=lambda: None, now_ms=lambda: 0.0)
    return machine, driver, SimpleNamespace(failed=None, connected=True, queued_bytes=lambda: 0)


def _stopped_room() -> tuple[RankSession, list[str]]:
    """A session the operator's stop of the room reached, and the list of what it says."""
    s = RankSession()
    said: list[str] = []
    s.progress = said.append
    s.on_control({"type": "stop", "reason": "stopped by the operator"})
    return s, said


async def _leave_quietly(s: RankSession, **follower) -> float:
    """Seconds ``s`` takes to leave while no round and no publication comes."""
    machine, driver, bus = _follower(**follower)
    t0 = time.monotonic()
    await s.leave(machine, driver, bus, upload=None, final_report=lambda: {}, poll_s=0.005)
    return time.monotonic() - t0


async def _leave(s: RankSession, publish_after_s: float, **follower) -> float:
    machine, driver, bus = _follower(**follower)

    async def leader() -> None:                   # rounds keep coming, then the publication
        t_end = time.monotonic() + publish_after_s
        while time.monotonic() < t_end:
            s.saw_round({"t": "round", "assign": [[1, 0, 2]]})
            await asyncio.sleep(0.01)
        s.saw_round({"t": "round", "assign": []})

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


@pytest.mark.needs_loop
def test_a_follower_that_read_the_stop_after_the_leaders_publication_leaves_at_once():
    # the server tells every rank at once; the leader read it first and published before this
    # rank read its own stop: the publication counts (a follower waited the whole 5 s for it)
    s = RankSession()
    s.saw_round({"t": "round", "assign": []})
    s.on_control({"type": "stop", "reason": "the server is shutting down"})
    machine, driver, bus = _follower()

    async def leave() -> float:
        t0 = time.monotonic()
        await s.leave(machine, driver, bus, upload=None, final_report=lambda: {}, poll_s=0.005)
        return time.monotonic() - t0

    assert asyncio.run(leave()) < 1.0 and s.publish_seen
    old = RankSession()                                   # one long before the stop does not count
    old.saw_round({"t": "round", "assign": []})
    old.publish_seen_s -= 10.0
    old.on_control({"type": "stop", "reason": "the server is shutting down"})
    old._publish_since_s = old.room_stop_s - 1.0          # (as leave() sets it)
    assert not old.publish_seen


@pytest.mark.needs_loop
def test_a_follower_of_a_stopped_room_waits_past_5_s_while_the_leaders_rounds_keep_coming():
    # a leader tab in a cohort of fast native ranks read the server's stop 7 s late (its page's
    # inbox behind their buckets): the followers stopped at 5 s and ended on other parameters
    # than the room's final checkpoint (a fault campaign with tabs, 2 of 3 runs of 60 s)
    s = RankSession()
    said: list[str] = []
    s.progress = said.append
    s.on_control({"type": "stop", "reason": "stopped by the operator"})
    waited = asyncio.run(_leave(s, publish_after_s=6.5))
    assert s.publish_seen and 6.5 <= waited < 8.0, waited
    assert not said, said


@pytest.mark.needs_loop
def test_a_follower_of_a_stopped_room_whose_leader_goes_quiet_leaves_at_5_s_and_says_so():
    s, said = _stopped_room()
    waited = asyncio.run(_leave_quietly(s))       # no rounds, no publication (the leader is gone)
    assert 5.0 <= waited < 6.0 and not s.publish_seen
    assert said and "without the leader's final publication" in said[0], said


@pytest.mark.needs_loop
def test_a_follower_of_a_stopped_room_whose_leader_is_no_longer_heard_leaves_at_once_and_says_so():
    # a contributor whose trainer had left waited 5 s for a publication no one would make, then
    # said its parameters "may differ" from the final checkpoint the trainer published as it left
    s, said = _stopped_room()
    waited = asyncio.run(_leave_quietly(s, leader_heard=False))
    assert waited < 0.5, waited
    assert said == ["stopping: no leader is heard in this room, so no final publication comes; this rank "
                    "keeps the parameters of step 7, the last round it followed"], said


@pytest.mark.needs_loop
def test_a_follower_whose_leader_is_gone_but_that_hears_another_member_waits_for_its_publication():
    # a rank that took over and has not yet sent this one a round publishes when it reads the stop
    s = RankSession()
    s.on_control({"type": "stop", "reason": "stopped by the operator"})
    waited = asyncio.run(_leave(s, publish_after_s=0.5, leader_heard=False, others=(3,)))
    assert s.publish_seen and 0.5 <= waited < 5.0, waited


@pytest.mark.needs_loop
def test_a_publication_that_a_newer_lead_went_on_from_does_not_count_for_the_rooms_stop():
    # the leader of term 3 left alone (its own Ctrl-C) and published step 10; the witness let
    # another rank take over (term 4) at once, and the server stopped the room less than 1 s
    # later: that publication is not the model the room ends on, the new leader's is
    s = RankSession()
    s.saw_round({"t": "round", "term": 3, "step": 10, "assign": {}})
    s.saw_round({"t": "round", "term": 4, "step": 10, "assign": {5: [0, 2]}})
    s.on_control({"type": "stop", "reason": "duration 60 s reached"})
    machine, driver, bus = _follower()

    async def leave() -> float:
        async def new_leader() -> None:            # reads its stop a little later and publishes
            await asyncio.sleep(0.3)
            s.saw_round({"t": "round", "term": 4, "step": 11, "assign": {}})

        task = asyncio.ensure_future(new_leader())
        t0 = time.monotonic()
        await s.leave(machine, driver, bus, upload=None, final_report=lambda: {}, poll_s=0.005)
        waited = time.monotonic() - t0
        await task
        return waited

    assert 0.3 <= asyncio.run(leave()) < 5.0 and s.publish_seen
    # a round of the published lead that arrives after its publication (another path) is older
    # than it: the publication still counts
    r = RankSession()
    r.saw_round({"t": "round", "term": 3, "step": 11, "assign": {}})
    r.saw_round({"t": "round", "term": 3, "step": 10, "assign": {5: [0, 2]}})
    r.on_control({"type": "stop", "reason": "duration 60 s reached"})
    r._publish_since_s = r.room_stop_s - 1.0              # (as leave() sets it)
    assert r.publish_seen


def test_a_follower_stops_taking_part_when_it_reads_the_rooms_stop_and_a_leader_goes_on_to_publish():
    # PROTOCOL.md "Controls": the peer controls of the others leaving may come in the same read
    # as the stop; a follower still running then took over as a cohort of one and committed
    # steps alone before leave() had its turn (a thawed follower ended 30 steps past the room's
    # final checkpoint)
    for leads in (False, True):
        stops = []
        machine = SimpleNamespace(looping=leads, is_leader=lambda now_ms, leads=leads: leads)
        s = RankSession()
        s.driver = SimpleNamespace(machine=machine, now_ms=lambda: 0.0, stop=lambda: stops.append(1))
        s.on_control({"type": "stop", "reason": "stopped by the operator"})
        assert s.room_stopping and s.stop_reason == "server: stopped by the operator"
        assert stops == ([] if leads else [1]), leads


@pytest.mark.needs_loop
def test_a_follower_that_reads_the_rooms_stop_then_the_others_leaving_does_not_take_over():
    # the same with the real machine (PROTOCOL.md "Controls"): stop, then the peer controls of the
    # leader and the other follower leaving, in one read; without the early stop this rank, the
    # lowest id, held a membership of itself alone and took over
    from tabcohort.model.toy import ToyWorker

    from .machine_helpers import SEAT_JOB, SeatBus, beat, round_msg

    async def go():
        s = RankSession()
        s.on_control({"type": "welcome", "id": 1, "secret": "x", "peers": [3, 5], "may_lead": True,
                      "lead_peers": [3, 5]})
        m, d = s.seat(SeatBus(), ToyWorker(bucket_len=4, batch=2), SEAT_JOB, "job-test")
        d.start()
        t = d.now_ms()
        for k in (3, 5):
            m.peer_role(k, True)
            m.handle(beat(k, ready=True, running=True, term=1, step=10), now_ms=t)
        m.handle(round_msg(3, 11, term=1, assign={5: 0}), now_ms=t)
        assert m.ready and m.following == 3, dict(m.drops)
        s.on_control({"type": "stop", "reason": "stopped by the operator"})
        s.on_control({"type": "peer", "id": 3, "up": False})
        s.on_control({"type": "peer", "id": 5, "up": False})
        for i in range(1, 21):
            m.on_timer(now_ms=t + 400.0 * i)
        await d.close()
        return m
    m = asyncio.run(go())
    assert not m.is_leader(m._last_input_ms) and m.counters["takeover"] == 0 and m.step == 11


@pytest.mark.needs_loop
def test_a_leader_whose_link_to_the_server_failed_uploads_nothing_and_remembers_it():
    # README "Stopping": a server not back within the reconnect bound; the leader's stop line says
    # its final checkpoint was not stored (it said nothing: a new-user trial lost 13,168 steps)
    uploads: list[bool] = []

    async def upload(final: bool) -> None:
        uploads.append(final)

    for failed in ("gave up reconnecting after 29 s without the server", None):
        s = RankSession()
        s.progress = lambda line: None
        machine = SimpleNamespace(id=1, looping=False, ready=True, at_step_limit=False, counters={}, step=9,
                                  is_leader=lambda now_ms: True, leader_heard=lambda now_ms: True,
                                  cohort_ids=lambda now_ms: [1], republish_pending=lambda now_ms: False)
        driver = SimpleNamespace(stop=lambda: None, now_ms=lambda: 0.0)
        bus = SimpleNamespace(failed=failed, connected=not failed, queued_bytes=lambda: 0)
        asyncio.run(s.leave(machine, driver, bus, upload=upload, final_report=lambda: {}, poll_s=0.005))
        assert s.final_upload_skipped is bool(failed)
    assert uploads == [True]
