"""A tab whose resume is refused (the server restarted without ``--checkpoint-dir``: 4004) joins
again as a new rank without a page reload, as a native rank does, and trains on with it."""

from __future__ import annotations

import signal
import urllib.parse

import pytest

from .conftest import wait_for, wait_tab

pytestmark = pytest.mark.browser


def test_a_tab_refused_its_resume_rejoins_as_a_new_rank_without_a_reload(cluster, tabs):
    url = cluster.serve()
    port = urllib.parse.urlsplit(url).port
    tab = tabs(url, "?room=digits")
    native = cluster.rank()
    st = wait_tab(tab, lambda s: s["cohort"] == 2 and s["ready"] and s["step"] >= 20, 90, "a tab and a rank training")
    old_id, step0 = st["id"], st["step"]
    tab.page.evaluate("window.__same_page = true")           # gone if the page were reloaded
    old = cluster.server
    old.p.send_signal(signal.SIGTERM)
    assert old.p.wait(20) == 0, old.text()
    cluster.serve("--port", str(port))                        # same port, no checkpoint directory
    st = wait_tab(tab, lambda s: s.get("rejoins") == 1 and s["id"] != old_id and s["cohort"] == 2 and s["ready"]
                  and s["step"] >= step0 + 20, 90, "the tab back as a new rank, training with the native rank")
    assert tab.page.evaluate("window.__same_page === true")  # no reload
    room = cluster.state()
    ids = {r["id"] for r in room["ranks"] if r["connected"]}
    assert st["id"] in ids and old_id not in ids and len(ids) == 2, room["ranks"]
    assert native.p.poll() is None, native.text()
    assert tab.tc("tc.phase") == "training" and not tab.tc("tc.errors.filter(e => e.kind !== 'stderr')")
    print(f"\nserver restarted at step {step0}; tab {old_id:08x} rejoined as {st['id']:08x}, "
          f"step {st['step']} with the native rank")
