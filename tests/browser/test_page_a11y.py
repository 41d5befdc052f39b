"""The page and the operator view: accessibility (axe-core: no serious or critical violations at
375x667 and at desktop size), no console errors, clear errors (wrong token, server unreachable),
and screenshots of loading / training / stopped / error / operator view in tests/browser/artifacts/."""

from __future__ import annotations

import pathlib
import zipfile

import pytest

from .conftest import wait_for, wait_tab

pytestmark = pytest.mark.browser

AXE = pathlib.Path(__file__).resolve().parents[2] / "node_modules" / "axe-core" / "axe.min.js"
MOBILE = {"width": 375, "height": 667}
DESKTOP = {"width": 1280, "height": 900}


def axe_serious(page) -> list[dict]:
    if not page.evaluate("typeof axe !== 'undefined'"):
        # evaluated over DevTools, not as a <script> tag: the page's CSP blocks inline script
        page.evaluate(f"() => {{ {AXE.read_text()}\n; window.axe = axe; }}")
    got = page.evaluate("""async () => (await axe.run(document, {resultTypes: ['violations']})).violations
        .map(v => ({id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.map(n => n.target.join(' ')).slice(0, 3)}))""")
    return [v for v in got if v["impact"] in ("serious", "critical")]


def check_both_sizes(tab, name: str) -> None:
    for label, vp in (("375x667", MOBILE), ("desktop", DESKTOP)):
        tab.page.set_viewport_size(vp)
        bad = axe_serious(tab.page)
        assert not bad, f"{name} at {label}: {bad}"
        tab.shot(f"{name}-{label}")


def test_page_states_operator_view_accessible_and_clean(cluster, tabs):
    if not AXE.is_file():
        pytest.fail("node_modules/axe-core is missing: run npm ci")
    url = cluster.serve("--token", "room-token-s3cret-0123", "--checkpoint-interval", "1",
                        "--any-rank-may-lead")  # a lone tab leads only in a trusted-group room
    t = tabs(url, "?room=digits&token=room-token-s3cret-0123", viewport=MOBILE)
    wait_for(lambda: t.tc("tc.phase") in ("loading", "training"), 20, "the loading phase")
    if t.tc("tc.phase") == "loading":
        t.shot("loading-375x667")
        assert not axe_serious(t.page)

    wait_tab(t, lambda s: s["ready"] and s["step"] >= 20, 60, "training (20 steps)")
    check_both_sizes(t, "training")
    assert t.page.is_visible("#leader-controls")  # a lone tab leads: lr and precision are offered
    # the tab's controls (state reports, backlog) pass the server's schemas; its report counts
    wait_for(lambda: cluster.state()["step"] >= 20, 20, "the tab's report to be trusted")
    assert not [k for k in cluster.state()["drops"] if k.startswith("bad_")], cluster.state()["drops"]

    op = tabs(url, "operator?room=digits&token=room-token-s3cret-0123", viewport=DESKTOP)
    wait_for(lambda: op.page.evaluate("window.tcOperator && tcOperator.last && tcOperator.last.ranks.length"),
             20, "the operator view's first poll")
    wait_for(lambda: op.page.evaluate("tcOperator.last.checkpoint"), 20, "a checkpoint in the operator view")
    wait_for(lambda: op.page.is_visible("#ckpt-link"), 5, "the checkpoint download link")
    # beside it the model export `tabcohort evaluate --model` reads (it offered the raw checkpoint only)
    assert op.page.is_visible("#model-link")
    assert "tabcohort evaluate" in op.page.text_content("#model-link")
    href = op.page.get_attribute("#model-link", "href")
    assert href == "/api/rooms/digits/model?token=room-token-s3cret-0123", href
    check_both_sizes(op, "operator")
    # the operator's link (no room token in the URL): the view fetches the export with the operator
    # token and hands the browser the .npz
    op2 = tabs(url, f"operator?room=digits#operator={cluster.operator_token}", viewport=DESKTOP)
    wait_for(lambda: op2.page.is_visible("#model-link"), 20, "the model link in the operator's view")
    with op2.page.expect_download(timeout=10_000) as dl:
        op2.page.click("#model-link")
    assert dl.value.suggested_filename.startswith("digits-step") and dl.value.suggested_filename.endswith(".npz")
    with zipfile.ZipFile(dl.value.path()) as z:
        assert sorted(z.namelist()) == ["job.json", "params.npy"], z.namelist()
    assert not op2.console_errors, op2.console_errors

    cluster.post(f"/api/rooms/{cluster.room}/stop?token=room-token-s3cret-0123")
    wait_for(lambda: t.tc("tc.phase") == "stopped", 20, "the tab to stop")
    check_both_sizes(t, "stopped")

    bad = tabs(url, "?room=digits&token=wrong", viewport=MOBILE)
    wait_for(lambda: bad.tc("tc.phase") == "error", 20, "the wrong-token error")
    assert "token" in bad.page.inner_text("#error").lower()
    check_both_sizes(bad, "error-token")

    for tab in (t, op):
        assert not tab.console_errors, tab.console_errors
    # the wrong token is a 403 the page handles; the browser still logs the failed request itself
    assert all("403" in e for e in bad.console_errors), bad.console_errors


def test_server_unreachable_is_a_clear_error(cluster, browser):
    url = cluster.serve()
    ctx = browser.new_context(viewport=MOBILE)
    try:
        page = ctx.new_page()
        page.route("**/api/**", lambda route: route.abort("connectionrefused"))
        page.goto(f"{url}/?room=digits")
        wait_for(lambda: page.evaluate("window.tc && tc.phase") == "error", 20, "the unreachable error")
        assert "unreachable" in page.inner_text("#error").lower()
        assert not axe_serious(page)
        from .conftest import ARTIFACTS
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "error-unreachable-375x667.png"), full_page=True)
    finally:
        ctx.close()


def test_an_unknown_room_names_the_rooms_the_server_has(cluster, tabs):
    # a new-user trial: the page said there was no such room and named none (the CLI names them:
    # "its rooms: ..."); a token room is named too, as the CLI does (GET /api/rooms lists it)
    url = cluster.serve("--token", "room-token-unknown-room-01")
    t = tabs(url, "?room=nosuch&token=room-token-unknown-room-01", viewport=MOBILE)
    wait_for(lambda: t.tc("tc.phase") == "error", 20, "the unknown room's error")
    assert t.page.inner_text("#error") == "There is no room named “nosuch” on this server. Rooms here: digits."
    links = t.page.eval_on_selector_all("#error a", "as => as.map(a => [a.textContent, a.getAttribute('href')])")
    # (the link keeps the page's other options: a reviewer's point, the token was dropped)
    assert links == [["digits", "/?room=digits&token=room-token-unknown-room-01"]], links
    assert t.tc("tc.errors")[-1]["text"].endswith("Rooms here: digits."), t.tc("tc.errors")
    assert not axe_serious(t.page)
    # the 404 is one the page handles; the browser still logs the failed request itself
    assert all("404" in e for e in t.console_errors), t.console_errors


def test_a_bad_page_option_is_named_before_anything_loads(cluster, tabs):
    url = cluster.serve()
    for query, named in [("room=digits&link=bogus", "?link=bogus"), ("room=digits&batch=abc", "?batch=abc"),
                         ("room=digits&autostart=maybe", "?autostart=maybe"),
                         ("room=digits&backend=foo", "?backend=foo"), ("room=digits&batch=-3", "?batch=-3"),
                         ("room=digits&reconnect=31", "?reconnect=31"), ("room=digits&reconnect=0", "?reconnect=0"),
                         ("link=xyz", "?link=xyz")]:      # (no ?room=: the server's room is named)
        t = tabs(url, f"?{query}")
        wait_for(lambda t=t: t.tc("tc.phase") == "error", 10, f"the page's config error for {query}")
        assert named in t.page.inner_text("#error")
        # the header kept the room's name (it read just "tabcohort" on a bad option)
        wait_for(lambda t=t: t.page.text_content("#room-name") == "room digits", 10, f"the room's name for {query}")
        assert t.page.title() == "tabcohort: room digits", t.page.title()
        assert t.tc("tc.worker === undefined"), "the page started the rank anyway"
        t.close()
