"""A leader's state report stays within what the server accepts however many ranks came and went
(PROTOCOL.md "Server controls": a control of at most 64 KiB, per-rank records no longer than a
room's seats, 200 at the least). Its per-rank records (``flaps``, ``held_ms``, ``applied``,
``clipped``; ``speeds`` and ``lateness_ms`` of ranks it no longer remembers as left) kept every
rank that ever passed: in a room where thousands of tabs came and went
the report outgrew both and the server dropped it whole."""

from __future__ import annotations

import json

from tabcohort.protocol.machine import REPORT_RANKS_MAX

from .machine_helpers import beat, rig


def test_a_report_names_its_live_ranks_and_at_most_a_bounded_number_of_others():
    r = rig(1, ready=True)
    m = r.m
    m.start(now_ms=0.0)
    for k in (2, 3):
        m.handle(beat(k, step=0), now_ms=1.0)
    for k in range(10, 5010):                     # 5,000 ranks that came and left
        m.flaps[k] = 1
        m.held_ms[k] = 0.5
        m.applied_by[k] = k
        m.clipped[k] = 1
        m.speeds.observe(k, 4, 10.0)
        m.peer_left(k, now_ms=1.5)                # (more than the machine remembers as left)
    for k in (1, 2, 3):                           # itself and two live ones, the smallest records
        m.applied_by[k] = 1
        m.held_ms[k] = 0.1
    st = m.state(2.0)
    for field in ("flaps", "held_ms", "applied", "clipped", "speeds", "lateness_ms"):
        assert len(st[field]) <= REPORT_RANKS_MAX, (field, len(st[field]))
    mine = {"00000001", "00000002", "00000003"}
    assert mine <= set(st["applied"]) and mine <= set(st["held_ms"])
    assert f"{5009:08x}" in st["applied"] and f"{10:08x}" not in st["applied"]   # then the largest
    assert len(json.dumps({"type": "report", "state": st})) < 64 * 1024
