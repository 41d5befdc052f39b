"""The server's console says when a rank joins a room, takes its seat again or leaves, with the
count of connected ranks (``Room.on_membership``; ``tabcohort serve`` prints the line): a
newcomer's console said nothing while ranks came and went. Hundreds of tabs opening one page
must not flood it: at most ``MEMBERSHIP_LINES_PER_MINUTE`` lines a minute per room, the rest
counted on the next line."""

from __future__ import annotations

import pytest

pytest.importorskip("tabcohort_server")   # (the server never runs in a tab)
from tabcohort_server.config import JobConfig, ServerLimits  # noqa: E402
from tabcohort_server.rooms import MEMBERSHIP_LINES_BURST, MEMBERSHIP_LINES_PER_MINUTE, Room  # noqa: E402
from tabcohort_server.serve import _say_membership  # noqa: E402


def _room() -> tuple[Room, list[str]]:
    r = Room("digits", JobConfig(dataset="synthetic"), ServerLimits(), clock=lambda: 0.0)
    lines: list[str] = []
    r.on_membership.append(lambda room, p, event: _say_membership(room, p, event, lines.append))
    return r, lines


def test_a_join_a_resume_and_a_leave_are_said_with_the_count_and_role():
    r, lines = _room()
    p = r.register(now=0, trainer=True)
    q = r.register(now=0)
    assert lines == [f"tabcohort serve: room digits: rank {p.id:08x} joined (may lead; 1 connected)",
                     f"tabcohort serve: room digits: rank {q.id:08x} joined (contributes buckets; 2 connected)"]
    r.disconnect(q, now=1.0)
    assert lines[-1] == (f"tabcohort serve: room digits: rank {q.id:08x} left (1 connected; its seat is held "
                         f"{ServerLimits().resume_grace_s:g} s for it to resume)")
    r.register(now=2.0, resume_id=q.id, resume_secret=q.secret)
    assert lines[-1] == f"tabcohort serve: room digits: rank {q.id:08x} is back on its seat (2 connected)"
    # a newer link of a connected rank replaces its old one: one line ("back"), not a leave too
    n = len(lines)
    r.register(now=3.0, resume_id=q.id, resume_secret=q.secret)
    assert len(lines) == n + 1 and "is back on its seat (2 connected)" in lines[-1], lines[n:]
    r.stop("operator")
    r.disconnect(p, now=4.0)
    assert lines[-1] == f"tabcohort serve: room digits: rank {p.id:08x} left (1 connected)"   # (no seat to hold)


def test_a_crowd_of_joins_is_bounded_and_the_rest_counted():
    r, lines = _room()
    for _ in range(50):
        r.register(now=0.0)
    assert len(lines) == MEMBERSHIP_LINES_BURST
    r.register(now=60.0 / MEMBERSHIP_LINES_PER_MINUTE)     # one line's worth of budget later
    assert len(lines) == MEMBERSHIP_LINES_BURST + 1
    assert lines[-1].endswith(f"; 51 connected; {50 - int(MEMBERSHIP_LINES_BURST)} more joins and leaves "
                              "since the last line not shown)"), lines[-1]
    assert r.membership_unsaid == 0


def test_an_output_that_fails_does_not_fail_the_registration():
    r = Room("digits", JobConfig(dataset="synthetic"), ServerLimits(), clock=lambda: 0.0)

    def broken(line: str) -> None:
        raise OSError("the terminal hung up")
    r.on_membership.append(lambda room, p, event: _say_membership(room, p, event, broken))
    p = r.register(now=0)
    r.disconnect(p, now=1.0)
    assert not r.connected


def test_ranks_sent_to_the_room_s_owner_are_not_told_a_seat_is_held_here():
    # a cluster node that lost the room closes its ranks' links (Room.evict_all); each line said
    # their seats were held here for them to resume, where they never come back
    r, lines = _room()
    p = r.register(now=0, trainer=True)
    q = r.register(now=0)
    assert r.evict_all(4012, "http://node-b:8080", now=1.0) == 2
    assert lines[-2:] == [f"tabcohort serve: room digits: rank {p.id:08x} was sent away: this node no longer "
                          f"owns the room (1 connected)",
                          f"tabcohort serve: room digits: rank {q.id:08x} was sent away: this node no longer "
                          f"owns the room (0 connected)"], lines


def test_what_went_past_the_line_budget_is_said_at_exit():
    # a mass leave at the stop: the lines within the budget were said, and nothing after them
    # said how many more there were
    from aiohttp import web
    from tabcohort_server.app import ROOMS
    from tabcohort_server.rooms import RoomRegistry
    from tabcohort_server.serve import _say_membership as say, say_unsaid
    reg = RoomRegistry({"digits": JobConfig(dataset="synthetic"), "quiet": JobConfig(dataset="synthetic")},
                       ServerLimits(), seed=1, clock=lambda: 0.0)
    app = web.Application()
    app[ROOMS] = reg
    lines: list[str] = []
    r = reg.rooms["digits"]
    r.on_membership.append(lambda room, p, event: say(room, p, event, lines.append))
    ps = [r.register(now=0.0) for _ in range(30)]
    for p in ps:
        r.disconnect(p, now=0.0)
    r.faults_unsaid = 2
    n = len(lines)
    say_unsaid(app, lines.append)
    unsaid = 60 - int(MEMBERSHIP_LINES_BURST)
    assert lines[n:] == [f"tabcohort serve: room digits: {unsaid} joins and leaves and 2 faults since its last "
                         f"line not shown"], lines[n:]
    assert r.membership_unsaid == 0 and r.faults_unsaid == 0
    say_unsaid(app, lines.append)                 # (said once; the quiet room says nothing)
    assert len(lines) == n + 1
