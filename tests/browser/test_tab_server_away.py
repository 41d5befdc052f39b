"""A tab whose server is away (SIGTERM, then back on the same port and checkpoint directory) says
that its link is lost and it is reconnecting, not that the room has no rank that may lead: the
native trainer rank led on the whole time, and the page told the user to start one with the
trainer token (a fault campaign with tabs). Back, it trains on with the cohort."""

from __future__ import annotations

import signal
import urllib.parse

import pytest

from .conftest import wait_for, wait_tab

pytestmark = pytest.mark.browser
#: the give-up test's reconnect bound (the page's ?reconnect=; 30 s by default)
RECONNECT_S = 5


def test_a_tab_cut_off_from_its_server_says_it_is_reconnecting(cluster, tabs, tmp_path):
    ck = str(tmp_path / "ck")
    url = cluster.serve("--checkpoint-dir", ck)
    port = urllib.parse.urlsplit(url).port
    cluster.rank()
    tab = tabs(url, "?room=digits")
    st = wait_tab(tab, lambda s: s["cohort"] == 2 and s["ready"] and s["step"] >= 20, 120, "a tab and a rank training")
    assert "follower" in tab.page.inner_text("#s-role")
    old = cluster.server
    old.p.send_signal(signal.SIGTERM)
    assert old.p.wait(20) == 0, old.text()
    role = wait_for(lambda: (t := tab.page.inner_text("#s-role")) and "reconnecting" in t and t, 30,
                    "the page to say the tab is reconnecting")
    assert "link to the server is lost" in role and "no rank that may lead" not in role, role
    assert not (tab.state().get("link") or {}).get("connected", True)
    cluster.serve("--port", str(port), "--checkpoint-dir", ck)
    back = wait_tab(tab, lambda s: s["cohort"] == 2 and s["ready"] and (s.get("link") or {}).get("connected")
                    and s["step"] >= st["step"] + 20, 90, "the tab back, training with the rank")
    wait_for(lambda: "reconnecting" not in tab.page.inner_text("#s-role"), 10, "the page to drop the notice")
    assert tab.tc("tc.phase") == "training"
    print(f"\nserver away at step {st['step']}; page said {role!r}; back at step {back['step']}")


def test_a_tab_whose_server_never_comes_back_gives_up_and_says_to_reload(cluster, tabs):
    # past its reconnect bound the tab stops; its page said (a fault campaign) the room had no
    # rank that may lead, and not how to join again. (The page's ?reconnect= bound, 30 s by
    # default, the ranks': the test waited it out whole)
    url = cluster.serve()
    cluster.rank()
    tab = tabs(url, f"?room=digits&reconnect={RECONNECT_S}")
    wait_tab(tab, lambda s: s["cohort"] == 2 and s["ready"] and s["step"] >= 20, 120, "a tab and a rank training")
    cluster.server.p.send_signal(signal.SIGKILL)
    cluster.server.p.wait(20)
    wait_for(lambda: tab.tc("tc.phase") == "stopped", 75, "the tab to give up reconnecting")
    status, role = tab.page.inner_text("#status"), tab.page.inner_text("#s-role")
    assert "gave up reconnecting" in status and "Reload the page to join again" in status, status
    assert f"the {RECONNECT_S} s bound" in status, status
    assert "no rank that may lead" not in role and "reconnecting" not in role, role
