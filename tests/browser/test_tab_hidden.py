"""A hidden tab keeps its seat (README, "Tests", the browser tier): the rank runs in a dedicated
module Web Worker, whose timers Chromium does not throttle when the page is hidden, so its
heartbeats keep their period and the cohort never drops it. Chromium is driven over raw DevTools
(tests/browser/cdp.py; Playwright keeps pages visible); the tab is hidden by activating a second
tab. The rank's own largest gap between two heartbeats it sent (and between two messages it
received) is in its state report (``gaps``) and must stay under ``policy.drop``; the native rank's
cohort never loses the tab, and the tab never suspends itself. Every wait is a bounded poll."""

from __future__ import annotations

import time

import pytest

from .conftest import RoomRecorder, wait_for
from .test_tab_frozen import open_ready_tab, report, tab_state

# (serial: it asserts beat and report gaps, which a test beside it on the other worker would move)
pytestmark = [pytest.mark.browser, pytest.mark.serial]

DROP_MS = 1600  # policy.drop for a cohort of 2 with the PROTOCOL.md defaults (max(drop, 4 beats))


@pytest.mark.parametrize("hidden_s", [pytest.param(15.0, id="15s"),
                                      pytest.param(60.0, id="60s", marks=pytest.mark.slow)])
def test_hidden_tab_keeps_beating_and_is_never_dropped(cluster, chromium, hidden_s):
    # the product's case: a volunteer's tab (no trainer credential) in a native rank's room
    url = cluster.serve()
    cluster.rank()
    wait_for(lambda: (rs := cluster.reports()) and rs[0]["ready"], 60, "the native rank to lead")
    page, st = open_ready_tab(chromium, url, cohort=2)
    tab_id = st["id"]
    native_id = next(p["id"] for p in st["peers"] if p["id"] != tab_id)
    wait_for(lambda: (r := report(cluster, native_id)) and r["report"] and r["report"]["ready"]
             and r["report"]["cohort"] == 2, 30, "the native rank's report: ready in a cohort of 2")

    chromium.hide(page)
    wait_for(lambda: page.eval("document.visibilityState") == "hidden", 10, "the tab to be hidden")
    before = tab_state(page)
    t_hidden = time.monotonic()
    rec = RoomRecorder(cluster, period_s=0.5)
    try:
        wait_for(lambda: time.monotonic() - t_hidden >= hidden_s, hidden_s + 2, f"{hidden_s:.0f} s hidden")
        assert page.eval("document.visibilityState") == "hidden"
        after = tab_state(page)
        t_end = time.monotonic()
    finally:
        rec.stop()
    pol = after["policy"]
    drop_ms = max(DROP_MS, 4 * pol["beat_ms"])
    gaps = after["gaps"]
    # the rank's own beat period held while hidden (lifetime max, from before the join to now)
    assert gaps["beat_max_ms"] < drop_ms, gaps
    assert gaps["recv_max_ms"] < drop_ms, gaps
    assert gaps["report_max_ms"] < 2500, gaps      # its report loop kept its 1 s period
    assert gaps["beats"] - before["gaps"]["beats"] >= hidden_s * 1000 / pol["beat_ms"] * 0.8, (before["gaps"], gaps)
    # never suspended, never dropped: same id, ready, a cohort of 2 the whole time, on both sides
    assert (after.get("counters") or {}).get("suspended", 0) == 0, after.get("counters")
    assert after["id"] == tab_id and after["ready"] and after["cohort"] == 2
    nat = [(v, c) for _t, v, _age, c in rec.series(native_id, "cohort", since=t_hidden)]
    assert nat and all(v == 2 and c for v, c in nat), nat
    tab_rep = [(v, age, c) for t, v, age, c in rec.series(tab_id, "ready", since=t_hidden) if t <= t_end]
    assert tab_rep and all(v and c and age is not None and age < 3.0 for v, age, c in tab_rep), tab_rep
    # and it kept training: its step advanced with the cohort's
    assert after["step"] > before["step"]
    print(f"\nhidden {hidden_s:.0f} s: largest beat gap {gaps['beat_max_ms']:.0f} ms, largest receive gap "
          f"{gaps['recv_max_ms']:.0f} ms (policy.drop {drop_ms:.0f} ms, beat {pol['beat_ms']:.0f} ms); "
          f"{gaps['beats'] - before['gaps']['beats']} beats while hidden; step {before['step']} -> {after['step']}; "
          f"native's cohort 2 in all {len(nat)} samples; suspended 0")
