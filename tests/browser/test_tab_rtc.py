"""Tabs over WebRTC. Two tabs and one native rank train the digits model in a *mesh* room: every pair of ranks has
its own WebRTC data channel (the tabs' are the page's RTCPeerConnections, the native rank's are
aiortc), negotiated through the server. The test asserts each link's transport and that the data
channels carried the parameters: a silent fallback to the relay fails it. Every wait is a
bounded poll."""

from __future__ import annotations

import time

import pytest

from .conftest import wait_for, wait_tab

pytestmark = pytest.mark.browser
pytest.importorskip("aiortc")

TARGET = 0.90
#: Chromium offers loopback host candidates only to a page holding media permission
QUERY = "?room=digits&rtc-loopback=1"


def test_two_tabs_and_a_native_rank_train_over_a_webrtc_mesh(cluster, tabs):
    url = cluster.serve("--topology", "mesh")
    t0 = time.monotonic()
    a, b = tabs(url, QUERY), tabs(url, QUERY)
    for t in (a, b):
        wait_for(lambda t=t: t.tc("tc.joinedAt"), 60, "a tab to boot Pyodide and join")
    native = cluster.rank("--rtc-hosts", "127.0.0.1")
    ids = {}
    for t in (a, b):
        st = wait_tab(t, lambda s: s["cohort"] == 3 and s["ready"] and len(s["links"]) == 2
                      and all(ln["transport"] != "connecting" for ln in s["links"]), 60,
                      "a cohort of 3 with every link settled, seen by each tab")
        ids[st["id"]] = t
    step3 = max(t.state()["step"] for t in (a, b))

    def trained():
        s = cluster.state()
        return s["accuracy"] is not None and s["accuracy"] >= TARGET and s["step"] >= step3 + 20 and s
    st = wait_for(trained, 150, f"the mesh of 3 to reach {TARGET:.0%} held-out accuracy")
    t_trained = time.monotonic() - t0
    mid = {k: t.state() for k, t in ids.items()}
    reps = wait_for(lambda: (rs := cluster.reports()) and len(rs) == 3 and all(
        len(r.get("links") or {}) == 2 and r["step"] >= st["step"] for r in rs) and rs, 15,
        "a report from each rank after the target")
    # the server's relay counters while training, before the stop: as the ranks leave, a frame to
    # a peer whose channel has just closed takes the relay, the fallback (CI once saw one 52-byte
    # frame relayed after the stop, with every rank's relay bytes 0 in its report before it)
    relayed = cluster.state()["counters"]
    cluster.post(f"/api/rooms/{cluster.room}/stop")

    finals = wait_for(lambda: (fs := [r for r in cluster.reports(connected_only=False) if r.get("final")])
                      and len(fs) == 3 and fs, 40, "final reports of the 3 ranks")
    digests = {r["digest"] for r in finals}
    assert len(digests) == 1, [(r["id"], r["digest"][:12], r["step"]) for r in finals]
    assert native.p.wait(20) == 0, native.text()

    # every pair is on a data channel, from both ends, and the channels carried the parameters
    for r in reps:
        assert set(r["links"].values()) == {"rtc"}, (r["id"], r["links"])
        lb = r["link_bytes"]
        assert lb["relay"] == 0, (r["id"], lb)
        # >= 10 parameter vectors (a tab's rounds are coalesced while its channel is behind and its
        # buckets are its share of the global batch: CI saw 19.6 vectors' worth from a tab)
        assert lb["rtc"] >= 4 * r["bucket_len"] * 10, (r["id"], lb)
    for k, s in mid.items():
        assert s["transport"] == "rtc-mesh"
        for ln in s["links"]:
            assert ln["transport"] == "rtc" and ln["sent"] > 0 and ln["received"] > 0, (k, ln)
    assert relayed["frames_relayed"] == 0, relayed
    # the tabs' channels are the page's own: each tab opened channels to its two peers and no
    # others (a pair that missed the connect bound under load opens again on its retry,
    # docs/PROTOCOL.md "Direct TCP path", Retry: CI saw 3 opens for 2 peers, with nothing relayed)
    for t in (a, b):
        keys = t.tc("tc.rtcOpenedKeys")
        assert len(keys) == 2 and t.tc("tc.rtcOpened") >= 2, (keys, t.tc("tc.rtcOpened"))
    assert not [e for t in (a, b) for e in t.console_errors], [t.console_errors for t in (a, b)]
    print(f"\nmesh: {TARGET:.0%} at step {st['step']} (acc {st['accuracy']:.4f}) {t_trained:.1f} s after start; "
          f"data-channel bytes per rank {[r['link_bytes']['rtc'] for r in reps]}, relay 0; "
          f"3 ranks bit-identical ({next(iter(digests))[:16]})")


def test_a_tab_joins_a_star_room_over_a_data_channel_to_the_server(cluster, tabs):
    """``?link=rtc``: the tab's link to the server is a page-owned data channel (the server ends
    it with aiortc); the WebSocket carries only controls once the channel is up."""
    url = cluster.serve("--rtc-hosts", "127.0.0.1")
    tab = tabs(url, "?room=digits&link=rtc&rtc-loopback=1")
    wait_for(lambda: tab.tc("tc.joinedAt"), 60, "the tab to boot Pyodide and join")
    cluster.rank("--link", "rtc", "--rtc-hosts", "127.0.0.1")
    st0 = wait_tab(tab, lambda s: s["cohort"] == 2 and s["ready"], 60, "a cohort of 2 seen by the tab")
    wait_for(lambda: (s := cluster.state())["step"] >= st0["step"] + 40 and s, 90, "40 rounds")
    tab_id = st0["id"]
    rep = wait_for(lambda: next((r for r in cluster.reports() if r["id"] == tab_id
                                 and r["step"] >= st0["step"] + 40), None), 15, "the tab's report")
    assert rep["links"] == {"server": "rtc"}, rep["links"]
    lb = rep["link_bytes"]
    # (before the channel opens a first hello may cross the socket; the buckets are the tab's
    # shares, so how many it sent in 40 rounds depends on its measured speed: at least 5 of them,
    # 14 on a loaded host in CI)
    assert lb["rtc"] >= 4 * rep["bucket_len"] * 5 and lb["ws"] <= 0.01 * lb["rtc"], lb
    st = tab.state()
    assert st["transport"] == "rtc-star" and all(ln["transport"] == "rtc-star" for ln in st["links"]), st["links"]
    server_side = {r["id"]: r["link"] for r in cluster.state()["ranks"] if r["connected"]}
    assert server_side[tab_id] == "rtc", server_side
    assert tab.tc("tc.rtcOpened") == 1
    assert not tab.console_errors, tab.console_errors
    print(f"\nrtc star: tab moved {lb['rtc']} bytes on its data channel, {lb['ws']} on the socket")
