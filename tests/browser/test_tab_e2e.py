"""Two tabs (Pyodide in Chromium) and one native rank train the digits model together through the
server's WebSocket star relay. Every wait is a bounded poll."""

from __future__ import annotations

import time

import pytest

from .conftest import wait_for, wait_tab

pytestmark = pytest.mark.browser

TARGET = 0.90


def test_two_tabs_and_a_native_rank_train_digits_to_90_percent_bit_identical(cluster, tabs):
    url = cluster.serve()
    t0 = time.monotonic()
    a, b = tabs(url, "?room=digits"), tabs(url, "?room=digits")
    for t in (a, b):
        wait_for(lambda t=t: t.tc("tc.joinedAt"), 60, "a tab to boot Pyodide and join")
    boots = [(t.tc("tc.boot.pyodide_s"), t.tc("tc.joinedAt")) for t in (a, b)]
    native = cluster.rank()
    ids = {}
    for t in (a, b):
        st = wait_tab(t, lambda s: s["cohort"] == 3 and s["ready"], 60, "a cohort of 3 seen by each tab")
        ids[st["id"]] = t
    step3 = max(t.state()["step"] for t in (a, b))

    def trained():
        s = cluster.state()
        return s["accuracy"] is not None and s["accuracy"] >= TARGET and s["step"] >= step3 + 20 and s
    st = wait_for(trained, 120, f"the cohort of 3 to reach {TARGET:.0%} held-out accuracy")
    t_trained = time.monotonic() - t0
    mid = {k: t.state() for k, t in ids.items()}
    cluster.post(f"/api/rooms/{cluster.room}/stop")

    finals = wait_for(lambda: (fs := [r for r in cluster.reports(connected_only=False) if r.get("final")])
                      and len(fs) == 3 and fs, 40, "final reports of the 3 ranks")
    digests = {r["digest"] for r in finals}
    assert len(digests) == 1, [(r["id"], r["digest"][:12], r["step"]) for r in finals]
    assert native.p.wait(20) == 0, native.text()
    for t in (a, b):
        stopped = wait_for(lambda t=t: t.tc("tc.stopped"), 20, "the tab's stopped message")
        assert stopped["digest"] in digests
        # teardown: every Pyodide proxy the rank created was destroyed
        td = wait_for(lambda t=t: t.tc("tc.events.find(e => e.k === 'teardown') || null"), 20, "the tab's teardown")
        assert td["proxies_created"] > 0 and td["proxies_destroyed"] == td["proxies_created"], td
    backends = {r["id"]: r["backend"] for r in finals}
    tab_ids = set(ids)
    native_id = next(k for k in backends if k not in tab_ids)
    # auto: Chromium here exposes WebGPU on SwiftShader (a CPU implementation); the start probe times
    # webgpu against js and keeps the faster. It is usually js, but on a loaded 2-core machine
    # SwiftShader once won the probe (CI): either is a correct choice, never python; a js tab says why
    assert all(backends[k] in ("js", "webgpu") for k in tab_ids), backends
    assert all("slower than js" in (r.get("backend_note") or "") for r in finals
               if r["id"] in tab_ids and r["backend"] == "js"), finals

    # every link of every tab is the WebSocket star relay, and it carried bytes both ways
    for k, s in mid.items():
        links = {ln["peer"]: ln for ln in s["links"]}
        others = (tab_ids | {native_id}) - {k}
        assert others <= set(links), (k, links)
        for p in others:
            assert links[p]["transport"] == "ws-star"
            assert links[p]["sent"] > 0 and links[p]["received"] > 0, links[p]
        assert s["link"]["uplink_bytes"] > 0 and s["link"]["downlink_bytes"] > 0
    room = cluster.state()
    assert room["counters"]["bytes_relayed"] > 0
    assert not [e for t in (a, b) for e in t.console_errors], [t.console_errors for t in (a, b)]
    ck = wait_for(lambda: (c := cluster.state()["checkpoint"]) and c.get("final") and c, 15, "the final checkpoint")
    # (the room reached TARGET; the final model, a few rounds later, may evaluate a hair lower:
    # a clean-clone run saw 0.897)
    assert ck["digest"] in digests and ck["accuracy"] >= TARGET - 0.02
    print(f"\n{TARGET:.0%} reached at step {st['step']} (acc {st['accuracy']:.4f}) {t_trained:.1f} s after start; "
          f"final checkpoint acc {ck['accuracy']:.4f}, 3 ranks bit-identical ({next(iter(digests))[:16]}); "
          f"tabs: Pyodide boot {boots[0][0]:.2f}/{boots[1][0]:.2f} s, joined {boots[0][1]:.2f}/{boots[1][1]:.2f} s "
          f"after page load; relayed {room['counters']['bytes_relayed']} bytes")
