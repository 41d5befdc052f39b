"""Peer data is untrusted in every page: a rank whose every free-text field (hello, beat, state
report) is HTML with an event handler joins a room while a tab and the operator view are open;
no script of it runs in any page, nothing it names is fetched, and the pages show the text as
sent. And every page and asset carries a Content-Security-Policy that blocks inline script, under
which Pyodide still boots (the tab joins)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from .conftest import ReportingRank, wait_for, wait_tab

pytestmark = pytest.mark.browser


def payload(field: str) -> str:
    """Markup that runs only if parsed as HTML: it fetches URLs the test watches for and sets a
    global (short: a hello's backend string is at most 64 bytes)."""
    return f"<img src=/xss-{field} onerror=\"fetch('/xss-run');__xss=1\">"


class HostileRank(ReportingRank):
    """A reporting rank whose strings are all markup (hello, beats, report)."""

    def __init__(self, url: str, room: str) -> None:
        with urllib.request.urlopen(f"{url}/api/rooms/{room}/job", timeout=5) as r:
            self.job = json.load(r)
        super().__init__(url, room)

    def greet(self, bus) -> None:
        from tabcohort import PROTOCOL_VERSION

        bus.post({"t": "hello", "version": PROTOCOL_VERSION, "job": self.job["job_hash"], "batch": 8, "ready": False,
                  "running": False, "step": 0, "model": payload("model"), "backend": payload("backend")})

    def say(self, bus) -> None:
        bus.post({"t": "beat", "term": 1, "batch": 8, "ready": False, "running": False, "step": 0,
                  "backend": payload("backend")})
        super().say(bus)

    def state(self, rank_id: int) -> dict:
        return {"id": rank_id, "ready": False, "running": True, "step": 1, "cohort": 1, "batch": 8,
                "model": payload("rm"), "backend": payload("rb"),
                "precision": payload("precision"), "fault": payload("fault"), "transport": payload("t")}


def test_markup_from_a_rank_is_shown_as_text_and_never_runs_in_any_page(cluster, tabs):
    url = cluster.serve("--any-rank-may-lead")   # tabs only: a trusted group
    tab = tabs(url, "?room=digits")
    # the operator's own link (with the operator token the view gets every report whole; others
    # get a few scalars of the ranks the room does not trust: README "Untrusted peers in the page")
    op = tabs(url, f"operator?room=digits#operator={cluster.operator_token}")
    requests: list[str] = []
    violations: list[str] = []
    for t in (tab, op):
        t.page.on("request", lambda r: requests.append(r.url))
        t.page.on("console", lambda m: "Content Security Policy" in m.text and violations.append(m.text))
    wait_for(lambda: tab.tc("tc.joinedAt"), 90, "the tab to boot Pyodide under the CSP and join")
    hostile = HostileRank(url, cluster.room)     # (joined once made)
    try:
        hid = f"{hostile.id:08x}"
        st = wait_tab(tab, lambda s: any(p["id"] == hostile.id for p in s["peers"]), 30,
                      "the tab to see the hostile rank")
        assert [p["backend"] for p in st["peers"] if p["id"] == hostile.id] == [payload("backend")]
        # the tab's peer table shows the backend string as typed
        cell = wait_for(lambda: tab.page.evaluate(
            """(hid) => { const tr = [...document.querySelectorAll('#peers tbody tr')]
                 .find(r => r.cells[0].textContent.startsWith(hid));
               return tr ? {text: tr.cells[1].textContent, html: tr.cells[1].innerHTML} : null; }""", hid), 20,
            "the hostile rank's row in the tab")
        assert cell["text"] == payload("backend"), cell
        # the operator view's rank table: backend, precision and fault as typed
        cells = wait_for(lambda: op.page.evaluate(
            """(hid) => { const tr = [...document.querySelectorAll('#ranks tbody tr')]
                 .find(r => r.cells[0].textContent === hid);
               return tr ? [...tr.cells].map(c => c.textContent) : null; }""", hid), 20,
            "the hostile rank's row in the operator view")
        # (columns: rank, kind, connected, role, step, cohort, loss, backend, steps/s, bytes/s,
        # precision, fault, ...)
        assert cells[7] == payload("rb") and cells[10] == payload("precision") \
            and cells[11] == payload("fault"), cells
        # a long backend string is clipped in its column (the columns after it stay in view)
        # and whole in the cell's tooltip
        clip = op.page.evaluate(
            """(hid) => { const c = [...document.querySelectorAll('#ranks tbody tr')]
                 .find(r => r.cells[0].textContent === hid).cells[7];
               const em = parseFloat(getComputedStyle(c).fontSize);
               return {title: c.title, ems: c.getBoundingClientRect().width / em,
                       full: c.scrollWidth > c.clientWidth}; }""", hid)
        assert clip["title"] == payload("rb") and clip["ems"] <= 17.5, clip
        for t in (tab, op):
            # no element of the payload exists, no script of it ran, nothing it names was fetched
            assert t.page.evaluate("document.querySelectorAll('tbody img, tbody script').length") == 0
            assert t.page.evaluate("window.__xss === undefined")
        assert not [u for u in requests if "xss-" in u], [u for u in requests if "xss-" in u]
        assert not violations, violations   # nothing even tried to run
        assert hostile.error is None, hostile.error
    finally:
        hostile.leave()


def test_every_page_and_asset_carries_a_csp_that_blocks_inline_script(cluster, tabs):
    url = cluster.serve("--any-rank-may-lead")   # tabs only: a trusted group
    paths = ["/", "/operator", "/web/app.js", "/web/rank-worker.js", "/web/style.css", "/api/boot",
             "/api/rooms/digits", "/pyodide/pyodide.mjs", "/vendor/uplot/uPlot.iife.min.js", "/healthz"]
    for p in paths:
        with urllib.request.urlopen(f"{url}{p}", timeout=10) as r:
            csp = r.headers.get("Content-Security-Policy")
        assert csp, p
        script = next(d for d in csp.split(";") if d.strip().startswith("script-src"))
        assert "'unsafe-inline'" not in script and "'unsafe-eval'" not in script, (p, csp)
        assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp, (p, csp)
    op = tabs(url, "operator?room=digits")
    wait_for(lambda: op.page.evaluate("window.tcOperator && window.tcOperator.polls > 0"), 20, "the operator view")
    # an inline script and an inline event handler, inserted into the live page: both blocked
    got = op.page.evaluate("""() => new Promise((resolve) => {
        const seen = [];
        document.addEventListener('securitypolicyviolation', (e) => seen.push(e.violatedDirective));
        const s = document.createElement('script');
        s.textContent = 'window.__inline = 1';
        document.body.append(s);
        const d = document.createElement('div');
        d.innerHTML = '<img src="data:," onload="window.__handler = 1">';
        document.body.append(d);
        setTimeout(() => resolve({inline: window.__inline, handler: window.__handler, seen}), 500);
    })""")
    assert got.get("inline") is None and got.get("handler") is None, got
    assert any(v.startswith("script-src") for v in got["seen"]), got
