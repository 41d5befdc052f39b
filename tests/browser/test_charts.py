"""The page's and the operator view's curves, readable at any loss scale: a room resumed from a
long run's checkpoint (loss near 1e-3..1e-4) says so on both pages; the loss axis is log-scaled
with distinct tick labels (never all "0"); a follower tab says why its accuracy panel is empty;
the operator view draws the room's history since it started and marks which ranks are tabs.
Screenshots: tests/browser/artifacts/charts-*.png."""

from __future__ import annotations

import re

import pytest

from tests.integration.conftest import Cluster

from .conftest import trained_checkpoint_dir, wait_for, wait_tab

pytestmark = pytest.mark.browser
STEPS = 1500


def _ticks(tab, chart: str) -> list[str]:
    """The y axis's labelled ticks as uPlot drew them (its computed ``axes[1]._values``; on a
    log axis uPlot leaves minor ticks unlabelled where labels would not fit)."""
    return tab.page.evaluate(f"""() => {{
        const el = document.querySelector('#{chart} .uplot');
        const p = el && window.__charts && window.__charts['{chart}'];
        return p ? (p.axes[1]._values || []).map(String).filter((v) => v !== "") : null; }}""")


def test_resumed_room_curves_are_readable_and_say_what_they_show(tmp_path, tabs):
    ck = trained_checkpoint_dir(tmp_path, STEPS)   # a long run first: its checkpoint's loss is tiny (what a second demo run resumes)
    second = Cluster(tmp_path / "second")
    (tmp_path / "second").mkdir()
    try:
        url = second.serve("--checkpoint-dir", str(ck), "--checkpoint-interval", "1")
        assert second.state()["resumed_from_step"] == STEPS
        second.rank()
        a, b = tabs(url, "?room=digits"), tabs(url, "?room=digits")
        for t in (a, b):
            wait_tab(t, lambda s: s["ready"] and s["cohort"] == 3 and s["step"] >= STEPS + 40, 120,
                     "a tab training in the resumed cohort of 3")
            notes = t.page.inner_text("#notes")
            # (said in the past tense once the room has trained on past it)
            assert re.search(rf"(is resuming|resumed) from its checkpoint at step {STEPS}\b", notes), notes
        follower = next(t for t in (a, b) if not t.state()["is_leader"])
        wait_for(lambda: follower.page.is_visible("#acc-note"), 10, "the follower's accuracy note")
        assert "Only the leader" in follower.page.inner_text("#acc-note")
        assert "leader evaluates" in follower.page.inner_text("#s-acc")
        ticks = _ticks(follower, "loss-chart")
        assert len(ticks) >= 2 and len(set(ticks)) == len(ticks) and "0" not in ticks, ticks
        follower.shot("charts-follower-page")

        op = tabs(url, "operator?room=digits")
        wait_for(lambda: op.page.evaluate("window.tcOperator && tcOperator.last && tcOperator.historyPoints"),
                 20, "the operator view's history and first poll")
        # the curves start at the room's start, not when the page opened
        assert op.page.evaluate("tcOperator.historyPoints") >= 3
        status = op.page.inner_text("#status")
        assert f"Resuming from the checkpoint at step {STEPS}" in status, status
        kinds = op.page.eval_on_selector_all("#ranks tbody tr td:nth-child(2)", "els => els.map(e => e.textContent)")
        assert sorted(kinds) == ["native", "tab (browser)", "tab (browser)"], kinds
        ticks = _ticks(op, "loss-chart")
        assert len(ticks) >= 2 and len(set(ticks)) == len(ticks) and "0" not in ticks, ticks
        op.shot("charts-operator")
        for t in (a, b, op):
            assert not t.console_errors, t.console_errors
    finally:
        second.close()
