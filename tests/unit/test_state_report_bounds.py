"""A leader's state report stays within what the server accepts however many ranks came and went
(PROTOCOL.md "Server controls": a control of at most 64 KiB, per-rank records no longer than a
room's seats, 200 at the least). Its per-rank records (``flaps``, ``held_ms``, ``applied``,
``clipped``) kept every rank that ever passed: in a room where thousands of tabs came and went
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
    for k in (2, 3):                              # two live ones with the smallest records
        m.applied_by[k] = 1
        m.held_ms[k] = 0.1
    st = m.state(2.0)
    for field in ("flaps", "held_ms", "applied", "clipped"):
        assert len(st[field]) <= REPORT_RANKS_MAX, field
    assert {"00000002", "00000003"} <= set(st["applied"]) and {"00000002", "00000003"} <= set(st["held_ms"])
    assert f"{5009:08x}" in st["applied"] and f"{10:08x}" not in st["applied"]   # then the largest
    assert len(json.dumps({"type": "report", "state": st})) < 64 * 1024
