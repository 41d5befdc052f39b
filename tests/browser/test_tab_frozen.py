"""A frozen tab (PROTOCOL.md, "Suspension"). Chromium is driven over raw DevTools
(tests/browser/cdp.py): the tab is hidden by activating a second tab, then frozen with
``Page.setWebLifecycleState`` for 10 s (its dedicated worker stops too: the Python rank is
suspended without knowing it), then resumed. With a native rank in the room, the cohort goes on
without the tab, the tab treats itself as having left (``counters.suspended``), rejoins and is
synced, and the cohort's step never goes backwards (no rewind to the frozen rank's stale
parameters, even when the frozen tab was the leader). Every wait is a bounded poll."""

from __future__ import annotations

import time

import pytest

from .conftest import RoomRecorder, wait_for

pytestmark = pytest.mark.browser

FREEZE_S = 10.0
BEAT, DROP = 400, 1600  # PROTOCOL.md defaults (ms)


def tab_state(page, timeout_s: float = 10.0) -> dict | None:
    return page.tc("tc.state", timeout_s=timeout_s)


def open_ready_tab(chromium, url: str, cohort: int, timeout_s: float = 120.0):
    page = chromium.open(f"{url}/?room=digits")

    def ready():
        errs = page.tc("tc.errors.filter(e => e.kind !== 'stderr')")
        if errs:
            raise AssertionError(f"the page reports an error: {errs}")
        s = tab_state(page)
        return s if s and s["ready"] and s["cohort"] == cohort else None
    return page, wait_for(ready, timeout_s, f"the tab to be ready in a cohort of {cohort}", interval_s=0.5)


def report(cluster, rank_id: int) -> dict | None:
    for r in cluster.state()["ranks"]:
        if r["id"] == rank_id:
            return r
    return None


def test_frozen_tab_resumes_by_the_suspension_rule_without_rewinding_the_cohort(cluster, chromium):
    url = cluster.serve("--any-rank-may-lead")   # tabs only: a trusted group
    page, st = open_ready_tab(chromium, url, cohort=1)   # alone: it bootstraps and leads
    tab_id = st["id"]
    # a native rank joins; the lower id leads (ids are random: the tab leads in about half the runs,
    # and then this is the rewind case of "Suspension": a frozen leader that resumes)
    cluster.rank()
    s = wait_for(lambda: (x := tab_state(page)) and x["cohort"] == 2 and x["ready"] and x["leader"] is not None
                 and x, 60, "a cohort of 2 (tab + native)", interval_s=0.3)
    native_id = next(p["id"] for p in s["peers"] if p["id"] != tab_id)
    tab_led = tab_id < native_id
    wait_for(lambda: (r := report(cluster, native_id)) and r["report"] and r["report"]["ready"], 30,
             "the native rank's ready report")
    rec = RoomRecorder(cluster)
    try:
        s0 = tab_state(page)["step"]
        wait_for(lambda: tab_state(page)["step"] >= s0 + 10, 30, "10 steps of the cohort of 2", interval_s=0.2)

        chromium.hide(page)
        wait_for(lambda: page.eval("document.visibilityState") == "hidden", 10, "the tab to be hidden")
        before = tab_state(page)
        assert before["ready"] and before["cohort"] == 2
        counters0 = dict(before.get("counters") or {})
        worker = page.worker_session()
        assert worker, "the page's dedicated worker was not auto-attached"

        page.freeze()
        t_freeze = time.monotonic()
        # meanwhile the native rank drops the silent tab and the cohort goes on without it
        nat0 = report(cluster, native_id)["report"]["step"]
        wait_for(lambda: (r := report(cluster, native_id)["report"]) and r["cohort"] == 1
                 and r["step"] >= nat0 + 5, FREEZE_S, "the native rank to go on alone while the tab is frozen")
        frozen_tab_report = report(cluster, tab_id)
        wait_for(lambda: time.monotonic() - t_freeze >= FREEZE_S, FREEZE_S + 1, f"{FREEZE_S:.0f} s frozen")
        # a frozen tab sends nothing: its last report is as old as the freeze
        age = report(cluster, tab_id)["report_age_s"]
        assert age is not None and age >= FREEZE_S - 3, age
        nat_at_resume = report(cluster, native_id)["report"]["step"]

        page.resume()
        t_resume = time.monotonic()
        after = wait_for(lambda: (x := tab_state(page)) and x["ready"] and x["cohort"] == 2
                         and (x.get("counters") or {}).get("suspended", 0) > counters0.get("suspended", 0) and x,
                         30, "the resumed tab to suspend itself, rejoin and be synced")
        rejoin_s = time.monotonic() - t_resume
        # the server sees it too: counters.suspended in the tab's state report
        wait_for(lambda: (r := report(cluster, tab_id)["report"]) and (r.get("counters") or {}).get("suspended", 0) >= 1
                 and r["ready"], 10, "the server's report of the tab: suspended >= 1 and ready again")
        st_end = tab_state(page)["step"]
        wait_for(lambda: (r := report(cluster, native_id)["report"]) and r["step"] >= st_end + 10 and r["cohort"] == 2,
                 30, "10 more steps of the cohort of 2 after the resume")
        events = page.eval("tc.events.filter(e => e.k === 'freeze' || e.k === 'resume').map(e => e.k)")
    finally:
        rec.stop()

    # the cohort's step never went backwards: the native rank's reported step and the room's step
    nat_steps = [v for _t, v, _age, _c in rec.series(native_id, "step")]
    assert nat_steps and all(b >= a for a, b in zip(nat_steps, nat_steps[1:])), nat_steps
    # the room's step as the live ranks report it (connected, report under 1 s old): the room's
    # own "step" is a max over every seat's last report, a frozen or replaced one included (a CI
    # run saw it dip by one while the native rank's steps stayed monotonic)
    # The native rank's last report always counts (its steps are monotonic, checked above): a CI
    # run sampled the resumed tab's first report, its step from before the freeze, at a moment
    # the native rank's report was 1.2 s old, and read that as the room going back; a resumed
    # leader's rewind is what the lead_after check below catches.
    room_steps = [max(live) for _t, s in rec.samples
                  if (live := [r["report"]["step"] for r in s["ranks"] if r["connected"] and r["report"]
                               and (r["id"] == native_id
                                    or (r["report_age_s"] is not None and r["report_age_s"] < 1.0))])]
    assert room_steps and all(b >= a for a, b in zip(room_steps, room_steps[1:])), \
        [(round(t, 2), s["step"], [(r["id"], r["connected"], r["report_age_s"], (r["report"] or {}).get("step"))
                                   for r in s["ranks"]]) for t, s in rec.samples][:60]
    # every report that says it leads, after the resume, carries a step >= the step at resume
    lead_after = [(r["id"], r["report"]["step"]) for t, s in rec.samples if t >= t_resume
                  for r in s["ranks"] if r["report"] and r["report"].get("is_leader") and r["report_age_s"] < 1.0]
    assert all(step >= nat_at_resume for _id, step in lead_after), (nat_at_resume, lead_after[:20])
    # the tab, once ready again, carries the cohort's step (synced, not its stale one)
    tab_after = [(t, v) for t, v, age, _c in rec.series(tab_id, "step", since=t_resume) if age is not None and age < 1.0]
    assert after["step"] >= nat_at_resume, (after["step"], nat_at_resume)
    assert all(v >= before["step"] for _t, v in tab_after), tab_after
    # it kept its seat (same id) and the room never evicted it
    assert after["id"] == tab_id
    assert events[:2] == ["freeze", "resume"], events
    # the worker was frozen too (not only the page): the Python rank's own largest gap between two
    # heartbeats it sent spans the freeze (a running worker would have kept beating every ~400 ms)
    beat_gap = after["gaps"]["beat_max_ms"]
    assert beat_gap >= (FREEZE_S - 2) * 1000, after["gaps"]
    print(f"\nfrozen {FREEZE_S:.0f} s (tab {'led' if tab_led else 'followed'}; tab {tab_id:08x}, native {native_id:08x}): "
          f"tab step {before['step']} before, native went on alone to {nat_at_resume}; tab suspended "
          f"{after['counters'].get('suspended')}x, ready again in a cohort of 2 {rejoin_s:.2f} s after resume at step "
          f"{after['step']}; worker's largest beat gap {beat_gap:.0f} ms; "
          f"frozen tab's report age at resume {age:.1f} s; native steps monotonic over {len(nat_steps)} samples; "
          f"tab's report while frozen said step {frozen_tab_report['report']['step']}")
