"""A volunteer's tab whose only leader (a native trainer rank) is killed says that training waits
for a rank that may lead, instead of "follower" with its step frozen (a new-user trial)."""

from __future__ import annotations

import pytest

from .conftest import wait_for, wait_tab

pytestmark = pytest.mark.browser


def test_a_tab_whose_only_leader_is_gone_says_it_waits_for_one(cluster, tabs):
    url = cluster.serve()
    native = cluster.rank()
    tab = tabs(url, "?room=digits")
    wait_tab(tab, lambda s: s["ready"] and s["cohort"] == 2 and s["step"] >= 20, 120, "the tab following the rank")
    assert "follower" in tab.page.inner_text("#s-role")
    native.kill()
    wait_for(lambda: "no rank that may lead is in the room" in tab.page.inner_text("#s-role"), 30,
             "the tab to say its leader is gone")
    assert tab.state()["leader_live"] is False
