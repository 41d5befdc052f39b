"""A volunteer who navigates away leaves the room at once (the page closes its sockets on
``pagehide``): the room does not keep a rank that will not answer until its heartbeat times out
(with the back/forward cache, a frozen page's socket stayed open for about 13 s). Going back
gives a training rank again."""

from __future__ import annotations

import time

import pytest

from .conftest import wait_for, wait_tab

pytestmark = pytest.mark.browser


def test_a_tab_navigated_away_leaves_the_room_at_once_and_trains_again_when_it_comes_back(cluster, tabs):
    url = cluster.serve()
    tab = tabs(url, "?room=digits")
    native = cluster.rank()
    st = wait_tab(tab, lambda s: s["cohort"] == 2 and s["ready"] and s["step"] >= 5, 90, "a tab and a rank training")
    tab_id = st["id"]

    def tab_connected() -> bool:
        return any(r["id"] == tab_id and r["connected"] for r in cluster.state()["ranks"])
    assert tab_connected()
    tab.page.goto(f"{url}/healthz")            # same origin: the page may go to the back/forward cache
    t0 = time.monotonic()
    wait_for(lambda: not tab_connected(), 4, "the room to see the tab's rank leave")
    left_s = time.monotonic() - t0
    tab.page.go_back()
    wait_tab(tab, lambda s: s and s["cohort"] == 2 and s["ready"] and s["step"] > st["step"], 90,
             "the tab training again after going back")
    assert native.p.poll() is None, native.text()
    print(f"\nthe room saw the tab leave {left_s:.2f} s after it navigated away")
