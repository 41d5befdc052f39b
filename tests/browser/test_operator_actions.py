"""The operator view's actions carry the operator token: from the link `tabcohort serve` prints
(``#operator=...``, taken off the address bar) or asked for; the room token alone cannot stop a
room, and the page says so."""

from __future__ import annotations

import pytest

from .conftest import ReportingRank, wait_for

pytestmark = pytest.mark.browser

ROOM_TOKEN = "room-token-operator-view-01"


def test_the_operator_link_stops_the_room_and_the_room_token_does_not(cluster, tabs):
    url = cluster.serve("--token", ROOM_TOKEN, "--any-rank-may-lead")  # tabs only: a trusted group
    serve_log = cluster.server.text()
    link = next(line.split("operate: ", 1)[1] for line in serve_log.splitlines() if "operate: " in line)
    assert link.endswith(f"#operator={cluster.operator_token}")

    # the room token only: polling works, Stop asks for the operator token; a wrong one is refused
    op = tabs(url, f"operator?room={cluster.room}&token={ROOM_TOKEN}")
    wait_for(lambda: op.page.evaluate("window.tcOperator && tcOperator.polls > 0"), 20, "the first poll")
    # Stop asks to confirm first (a misclick must not end a run), then for the token
    asked = []
    op.page.on("dialog", lambda d: (asked.append(d.type), d.accept("wrong-operator-token-000") if d.type == "prompt" else d.accept()))
    op.page.click("#stop-room")
    wait_for(lambda: "wrong" in op.page.inner_text("#stop-result"), 10, "the refusal")
    assert asked == ["confirm", "prompt"], asked
    assert not cluster.state()["stopped"]

    # the printed link: no room token in the URL, the fragment leaves the address bar, Stop works
    op2 = tabs(url, link[len(url) + 1:])
    wait_for(lambda: op2.page.evaluate("window.tcOperator && tcOperator.polls > 0"), 20, "the first poll")
    assert "operator=" not in op2.page.url
    # its "Join this room" link carries the room token the printed link does not (a tab opened
    # from it was refused); a room-token view has none to add
    join = op2.page.get_attribute("#join-link", "href")
    assert join == f"/?room={cluster.room}&token={ROOM_TOKEN}", join
    op2.page.once("dialog", lambda d: d.dismiss())     # the confirm, declined: nothing is sent
    op2.page.click("#stop-room")
    wait_for(lambda: "Not stopped" in op2.page.inner_text("#stop-result"), 10, "the declined confirm")
    assert not cluster.state()["stopped"]
    op2.page.once("dialog", lambda d: d.accept())
    op2.page.click("#stop-room")
    wait_for(lambda: cluster.state()["stopped"], 10, "the room to stop")
    assert cluster.state()["stop_reason"] == "stopped by the operator"
    wait_for(lambda: "Stopped" in op2.page.inner_text("#status"), 10, "the page to show it")
    assert not op2.console_errors, op2.console_errors


def test_a_stale_operator_token_is_said_and_the_view_goes_on_with_the_room_token(cluster, tabs):
    # a new-user trial: the operate: link of an earlier `serve` (each start makes a new operator
    # token) left that token in the tab; sent ahead of the room token, every poll was refused and
    # the view said "The room token is wrong or missing.", a reload too
    url = cluster.serve("--token", ROOM_TOKEN)
    op = tabs(url, f"operator?room={cluster.room}&token={ROOM_TOKEN}#operator=stale-operator-token-0000")
    wait_for(lambda: op.page.evaluate("window.tcOperator && tcOperator.polls > 0"), 20, "a poll with the room token")
    assert "operator token this page had was refused" in op.page.inner_text("#error")
    assert op.page.evaluate("sessionStorage.getItem('tc-operator')") is None
    assert "Not available" not in op.page.inner_text("#status")


def test_the_view_polls_on_after_answers_that_are_not_the_room_s_state(cluster, tabs):
    # a review: one answer that was not the room's JSON (a cluster node's 503 while the room
    # changes nodes, a proxy's HTML page) threw in the poll loop, and the view froze for good
    url = cluster.serve()
    link = next(line.split("operate: ", 1)[1] for line in cluster.server.text().splitlines() if "operate: " in line)
    op = tabs(url, link[len(url) + 1:])
    wait_for(lambda: op.page.evaluate("window.tcOperator && tcOperator.polls > 0"), 20, "the first poll")
    bad = [(503, "application/json", '{"error": "no node owns the room right now; retry"}'),
           (200, "text/html", "<html><body>a proxy's page</body></html>")]
    said: list[str] = []

    def answer(route) -> None:
        if bad:
            status, kind, body = bad.pop(0)
            route.fulfill(status=status, content_type=kind, body=body)
        else:
            route.continue_()
    op.page.route(lambda u: f"/api/rooms/{cluster.room}" in u and "/ws" not in u and "checkpoint" not in u, answer)
    wait_for(lambda: (t := op.page.inner_text("#status")) and "retrying" in t and said.append(t) is None and not bad,
             20, "both bad answers, said")
    assert any("answered 503 without the room's state" in t for t in said), said
    polls = op.page.evaluate("tcOperator.polls")
    wait_for(lambda: op.page.evaluate("tcOperator.polls") >= polls + 2, 20, "polling to go on")
    wait_for(lambda: "retrying" not in op.page.inner_text("#status"), 10, "the status once the room answers")


def operator_view(cluster, tabs, url: str):
    link = next(line.split("operate: ", 1)[1] for line in cluster.server.text().splitlines() if "operate: " in line)
    op = tabs(url, link[len(url) + 1:])
    wait_for(lambda: op.page.evaluate("window.tcOperator && tcOperator.polls > 0"), 20, "the first poll")
    return op


def test_the_status_says_when_no_rank_is_connected_or_leads(cluster, tabs):
    # a new-user trial: with no rank connected (before any joined, after all left) the view said
    # "Training (star over ws)."
    url = cluster.serve()
    op = operator_view(cluster, tabs, url)
    status = lambda: op.page.inner_text("#status")  # noqa: E731
    wait_for(lambda: "Waiting for ranks: none connected" in status(), 10, "the status before any rank joins")
    assert "Training" not in status()
    rank = ReportingRank(url, cluster.room)     # connected, but it may not lead
    wait_for(lambda: "1 rank connected; no rank leads yet" in status(), 10, "the status with a rank that cannot lead")
    assert "Training" not in status()
    rank.leave()
    wait_for(lambda: "Waiting for ranks: none connected" in status(), 10, "the status after the rank left")
    assert "Training" not in status()
    assert not op.console_errors, op.console_errors


def test_a_rank_that_left_stays_in_the_table_marked_left_with_its_fault(cluster, tabs):
    # a new-user trial: a tab whose job failed left, and its row (with the fault that said why)
    # dropped out of the Ranks table once the server released its seat (after --grace)
    url = cluster.serve("--grace", "1")
    op = operator_view(cluster, tabs, url)
    public = tabs(url, f"operator?room={cluster.room}")     # no operator token: no fault is sent
    fault = "job failed: ValueError: <b>bad shape</b> " + "x" * 200   # (as text, clipped)
    gone = ReportingRank(url, cluster.room, fault=fault)
    stays = ReportingRank(url, cluster.room)

    def row(page, rank_id: int) -> dict | None:
        return page.evaluate("""(hid) => { const rows = [...document.querySelectorAll('#ranks tbody tr')];
            const tr = rows.find(r => r.cells[0].textContent === hid);
            return tr ? {left: tr.classList.contains('left'), at: rows.indexOf(tr), title: tr.cells[11].title,
                         cells: [...tr.cells].map(c => c.textContent)} : null; }""", f"{rank_id:08x}")

    r = wait_for(lambda: (r := row(op.page, gone.id)) and r["cells"][11] == fault and r, 10, "the rank's fault")
    assert r["cells"][2] == "yes" and not r["left"], r
    p = wait_for(lambda: row(public.page, gone.id), 10, "the rank in the view without the operator token")
    assert p["cells"][11] == "–", p   # not sent to it: not "none"
    gone.leave()
    r = wait_for(lambda: (r := row(op.page, gone.id)) and r["cells"][2] == "no (seat held)" and r, 10, "the rank marked left")
    assert r["left"] and r["cells"][11] == fault and r["title"] == fault, r
    assert r["at"] == 1, r    # after the connected rank
    # the server releases its seat after --grace; the view keeps the row, marked so
    wait_for(lambda: all(x["id"] != gone.id for x in cluster.state()["ranks"]), 10, "the server to release the seat")
    r = wait_for(lambda: (r := row(op.page, gone.id)) and r["cells"][2] == "left (seat released)" and r, 10,
                 "the released rank's row")
    assert r["left"] and r["cells"][11] == fault and r["title"] == fault and r["cells"][12] == "–", r
    assert row(op.page, stays.id)["cells"][2] == "yes"
    assert op.page.evaluate("document.querySelectorAll('#ranks tbody b, #ranks tbody img').length") == 0
    stays.leave()
    for t in (op, public):
        assert not t.console_errors, t.console_errors
