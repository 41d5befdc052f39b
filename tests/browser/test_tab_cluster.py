"""A tab in a cluster (README "Cluster"): two ``tabcohort serve --redis`` nodes and a real
``redis-server``; the room is owned by node A. A real Chromium tab opened at node B's page (with
``?room=``, and without) lands on A's page (307), joins the room there and trains with a native
rank that was also pointed at B; a tab whose node (A) is killed moves to B, which took the room
over, and trains there. Every wait is a bounded poll."""

from __future__ import annotations

import signal
import time

import pytest

from tests.integration.test_cluster import ROOM, _owner, _rank, start_a_then_b
from tests.integration.test_cluster import redis_server  # noqa: F401  (the fixture)

from .conftest import wait_for, wait_tab

pytestmark = pytest.mark.browser


def test_a_tab_opened_at_a_node_that_does_not_own_the_room_trains_at_the_owner(redis_server, tabs, tmp_path):
    procs = []
    try:
        a, b = start_a_then_b(tmp_path, redis_server.url, procs)
        wait_for(lambda: _owner(b) == "A", 10, "node B to list the room with owner A")
        rank = _rank(tmp_path, b.url, 0)           # a native rank pointed at B, sent to A
        procs.append(rank)
        tab = tabs(b.url, f"?room={ROOM}")         # the page at B: 307 to A's page
        wait_for(lambda: tab.page.url.startswith(a.url), 30, "the page to be at node A")
        wait_for(lambda: tab.tc("tc.joinedAt"), 90, "the tab to boot Pyodide and join at A")
        st = wait_tab(tab, lambda s: s["ready"] and s["cohort"] == 2, 60, "a cohort of the tab and the rank")
        s0 = st["step"]
        wait_tab(tab, lambda s: s["step"] >= s0 + 20, 60, "20 more steps seen by the tab")
        room = a.state()
        kinds = sorted((r["report"] or {}).get("kind", "?") for r in room["ranks"] if r["connected"])
        assert room["n_connected"] == 2 and "tab" in kinds, kinds
        # without ?room=: B sends the page of its (only) room to the owner too, and the page
        # there names the room
        other = tabs(b.url)
        wait_for(lambda: other.page.url.startswith(a.url)
                 and f"room {ROOM}" in (other.page.text_content("#room-name") or ""), 60,
                 "the page without a room to show A's page of the room")
        assert not tab.console_errors, tab.console_errors
        print(f"\na tab opened at node B ({b.url}) trains at the owner A ({a.url}): step {tab.state()['step']}")
    finally:
        for p in procs:
            p.kill()


def _evaluate(tab, expr: str):
    """``expr`` on the tab's current page, or ``None`` while it navigates (no document yet)."""
    try:
        return tab.tc(expr)
    except Exception:   # (Playwright: the execution context was destroyed by a navigation)
        return None


# Measured here (13 runs): the tab trained at B 13-23 s after the kill, whichever id is the lower:
# the resumed native rank's welcome at B omits the tab's old id, so it leaves the rank's membership
# at once (docs/PROTOCOL.md "Membership and majority", the roll call; before, an old id lower than
# the rank's blocked its majority for policy.forget, ~61 s)
def test_a_tab_whose_node_dies_moves_to_the_node_that_takes_the_room_over(redis_server, tabs, tmp_path):
    """The page's own node is SIGKILLed: the page (which knew the other live nodes from
    ``/api/rooms``) goes to node B with ``?failover=``, B serves it while Redis still names the
    dead owner, the page waits there until B owns the room, then boots, joins and trains at B
    with the native rank that resumed there."""
    procs = []
    try:
        a, b = start_a_then_b(tmp_path, redis_server.url, procs)
        rank = _rank(tmp_path, b.url, 0)           # (pointed at B: after A dies it reconnects there)
        procs.append(rank)
        tab = tabs(a.url, f"?room={ROOM}")         # the page from A, the owner
        wait_for(lambda: tab.tc("tc.joinedAt"), 90, "the tab to boot Pyodide and join at A")
        at_a = wait_tab(tab, lambda s: s["ready"] and s["cohort"] == 2, 60, "a cohort of the tab and the rank at A")
        wait_for(lambda: (a.state().get("checkpoint") or {}).get("step", 0) > 0, 30, "a checkpoint on A")
        rank_id = next(r["id"] for r in a.state()["ranks"] if (r["report"] or {}).get("kind") == "native")
        t_kill = time.monotonic()
        a.proc.p.send_signal(signal.SIGKILL)
        a.proc.p.wait(10)
        urls: list[str] = []
        tab.page.on("framenavigated", lambda f: f.parent_frame is None and urls.append(f.url))
        try:
            # (location read in the page: Playwright's page.url is only refreshed by its own calls)
            wait_for(lambda: _evaluate(tab, "location.origin") == b.url, 60, "the page to move to node B")
        except AssertionError as e:
            shown = _evaluate(tab, "document.getElementById('status').textContent")
            raise AssertionError(f"{e}; A {a.url} B {b.url} now {tab.page.url}; navigations {urls}; page status {shown!r}; "
                                 f"console {tab.console_errors[-5:]}") from None
        moved_s = time.monotonic() - t_kill
        wait_for(lambda: _evaluate(tab, "!location.search.includes('failover') && window.tc && tc.joinedAt"), 150,
                 "the page to wait for B to own the room, boot again and join at B")
        try:
            # (the moved tab is a new rank; its old id left the native rank's membership at B's welcome)
            st = wait_tab(tab, lambda s: s["ready"] and s["cohort"] == 2, 60, "a cohort of the tab and the rank at B")
        except AssertionError as e:
            t = tab.state() or {}
            room = b.state()
            raise AssertionError(
                f"{e}: the tab (at A: id {at_a['id']}, step {at_a['step']}) "
                f"{({k: t.get(k) for k in ('id', 'step', 'ready', 'cohort', 'leader', 'term', 'drops', 'wire_drops', 'counters', 'links', 'phase', 'running', 'may_lead')})}; "
                f"events {_evaluate(tab, 'JSON.stringify(tc.events.slice(-12))')}; "
                f"B's room: step {room['step']}, ranks {[(r['id'], r['connected'], (r['report'] or {}).get('kind'), (r['report'] or {}).get('ready'), (r['report'] or {}).get('cohort')) for r in room['ranks']]}; "
                f"rank log {rank.text()[-1500:]}") from None
        s0 = st["step"]
        wait_tab(tab, lambda s: s["step"] >= s0 + 20, 60, "20 more steps seen by the tab at B")
        trained_s = time.monotonic() - t_kill
        # (the room's trusted step comes from the leader's periodic report, so it lags the steps
        # the tab has seen: wait for the report rather than read it once)
        wait_for(lambda: b.state()["resumed_from_step"] is not None
                 and b.state()["step"] > b.state()["resumed_from_step"], 30,
                 "B's room to report a step past the checkpoint it resumed from")
        room = b.state()
        kinds = sorted((r["report"] or {}).get("kind", "?") for r in room["ranks"] if r["connected"])
        assert room["n_connected"] == 2 and "tab" in kinds, kinds
        # B's roll call did not list the tab's old id: it left the membership there (the
        # roll call B sends once the window of ranks moving over, resume_grace_s, is over: a
        # welcome within it is partial, docs/PROTOCOL.md "Membership and majority")
        def native_counters() -> dict:
            return next((r["report"] or {}).get("counters", {}) for r in b.state()["ranks"]
                        if r["connected"] and (r["report"] or {}).get("kind") == "native")
        wait_for(lambda: native_counters().get("left_by_roll_call", 0) >= 1, 60,
                 "B's roll call to take the tab's old id out of the native rank's membership")
        notes = tab.page.text_content("#notes") or ""
        assert "took the room over" in notes, notes
        print(f"\nnode A killed: the page moved to B after {moved_s:.1f} s and trained there "
              f"{trained_s:.1f} s after the kill (step {tab.state()['step']}; id {at_a['id']:08x} at A, "
              f"{tab.state()['id']:08x} at B; rank {rank_id:08x})")
    finally:
        for p in procs:
            p.kill()
