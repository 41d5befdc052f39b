"""A room of tabs only resumes from its checkpoint: the tab that starts the cohort loads the
room's checkpoint (``GET .../checkpoint``) before it joins, so its first round is the
checkpoint's step with the checkpoint's parameters, not a fresh init (docs/PROTOCOL.md
"Joining": a rank that starts without parameters must not train from its own init while a
cohort exists; README "Resuming"). Without it a tabs-only room (`RANKS=0 FRESH=0` of the demo)
would silently train again from scratch while every page said it resumed. Loaded again once the
room has finished, the page says so without booting Python or fetching the job, its data or the
checkpoint, and links the final model."""

from __future__ import annotations

import time

import pytest

from tests.integration.conftest import Cluster

from .conftest import trained_checkpoint_dir, wait_for, wait_tab

pytestmark = pytest.mark.browser
STEPS = 300


def test_a_tab_alone_resumes_the_room_at_its_checkpoint_step_and_accuracy(tmp_path, tabs):
    ck = trained_checkpoint_dir(tmp_path, STEPS)   # a native run first, stopped at STEPS: its final checkpoint is the room's newest

    second = Cluster(tmp_path / "second")
    (tmp_path / "second").mkdir()
    try:   # tabs only: any rank may lead, so the tab leads; the room stops 5 steps past the checkpoint
        url = second.serve("--checkpoint-dir", str(ck), "--checkpoint-interval", "1", "--any-rank-may-lead",
                           "--steps", str(STEPS + 5))
        room = second.state()
        assert room["resumed_from_step"] == STEPS
        stored_acc = room["resumed_from"]["accuracy"]
        assert stored_acc is not None and stored_acc > 0.5, stored_acc   # (digits: far above a fresh init's)
        tab = tabs(url, "?room=digits")
        st = wait_tab(tab, lambda s: s["step"] >= STEPS + 5 and not s["running"], 120,
                      "the tab to train the 5 steps past the checkpoint and stop")
        assert st["start_step"] == STEPS, st["start_step"]
        # the final checkpoint, 5 steps on: the checkpoint's model trained on (a fresh init 5
        # steps on would be far below it)
        final = wait_for(lambda: (c := second.state()["checkpoint"]) and c["step"] == STEPS + 5 and c, 30,
                         "the tab's final checkpoint")
        assert final["accuracy"] >= stored_acc - 0.1, (final, stored_acc)
        assert not tab.console_errors, tab.console_errors
        # the room has finished (--steps): the page loaded again leaves it before fetching the
        # job, its data or the checkpoint, and says so, as text (README "Resuming")
        wait_for(lambda: second.state()["stopped"], 15, "the room to stop at its step limit")
        t_reload = time.monotonic()
        tab.page.reload()
        done = wait_for(lambda: tab.tc("tc.finished"), 60, "the tab's finished message")
        t_finished = time.monotonic() - t_reload
        assert "the room has finished" in done["text"] and f"steps {STEPS + 5} reached" in done["text"], done
        assert tab.tc("tc.job") is None and tab.tc("tc.download") is None and tab.tc("tc.joinedAt") is None
        assert not [e for e in tab.tc("tc.events") if e.get("k") in ("job", "download", "joined")]
        status = tab.page.locator("#status")
        assert f"This room has finished (steps {STEPS + 5} reached)" in status.text_content()
        assert status.evaluate("e => e.childElementCount") == 0
        assert tab.tc("!!tc.worker") is False                     # no Python runtime booted for it
        link = tab.page.locator("#notes a")
        assert link.count() == 1 and link.get_attribute("href").endswith("/model"), link.count()
        # ... and what would train it again (the page gave no next step)
        assert "To train again, the operator serves the room again on a fresh --checkpoint-dir" \
            in tab.page.locator("#notes").text_content()
        assert tab.tc("tc.phase") == "stopped" and not tab.tc("tc.errors.filter(e => e.kind !== 'stderr')")
        print(f"\nreloaded on the finished room: said so {t_finished:.1f} s after the reload")
    finally:
        second.close()
