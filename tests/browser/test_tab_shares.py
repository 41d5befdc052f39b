"""A volunteer tab adds compute without slowing the native ranks (docs/PROTOCOL.md, "Shares"):
two native ranks train in a WebSocket-star room with a global batch large enough that a round
takes milliseconds of numpy; a real Chromium tab (Pyodide, the pure-Python backend:
``?backend=python``, the slowest) joins. The leader gives the tab a share its speed can deliver
in the round's time, its buckets enter the reduce (the leader's ``applied`` samples by rank), and
the native ranks' round rate with the tab stays at least 0.8 of their rate without it (before it
joined, and while it is stopped: a shared machine's drift hits both). The cores are split as in
bench/bench_tab.py (``cores.CoreSplit``): the native ranks on one, the server and Chromium on the
other, as if the tab were the volunteer's own machine; on 2 shared cores Chromium's Python would
otherwise take CPU from the natives' numpy, which is the scheduler's doing, not the protocol's.
The tab caps its bucket (``?batch=``, a volunteer's setting). Every wait is a bounded poll."""

from __future__ import annotations

import time

import pytest

from .conftest import wait_for, wait_tab
from .cores import CoreSplit, browser_pids

# (serial: it asserts a rate ratio, which a test beside it on the other worker would move)
pytestmark = [pytest.mark.browser, pytest.mark.serial]

#: samples a round: a native numpy round on one core takes ~50 ms, so a tab's page-worker hops
#: (~10 ms) and its lateness fit (at 20000, ~11 ms rounds, the tab was left out of many rounds)
GLOBAL_BATCH = 100000
#: the round rate is the best of a few short windows: other jobs on a small machine slow some
WINDOW_S, WINDOWS = 3.0, 2
#: the tab's cap (samples per bucket): a small part of a round of its Python
TAB_BATCH = 8


def leader_report(cluster) -> dict | None:
    return next((r for r in cluster.reports() if r.get("is_leader")), None)


def round_rate(cluster, window_s: float = WINDOW_S, windows: int = WINDOWS) -> float:
    """Rounds/s of the room (the leader's step): the best of ``windows`` windows of ``window_s``."""
    best = 0.0
    for _ in range(windows):
        t0, s0 = time.monotonic(), cluster.state()["step"]
        wait_for(lambda: time.monotonic() - t0 >= window_s, window_s + 5, "the measuring window", interval_s=0.1)
        best = max(best, (cluster.state()["step"] - s0) / (time.monotonic() - t0))
    return best


def test_a_joining_tab_gets_a_share_its_buckets_are_applied_and_the_native_round_rate_holds(cluster, tabs):
    pids = browser_pids()
    assert pids, "no Chromium process below this one"
    with CoreSplit(pids) as split:
        _natives_with_and_without_a_tab(cluster, tabs, split)


def _natives_with_and_without_a_tab(cluster, tabs, split: CoreSplit) -> None:
    url = split.serve(cluster, "--global-batch", str(GLOBAL_BATCH))
    cluster.rank()
    cluster.rank()
    wait_for(lambda: len([r for r in cluster.reports() if r.get("ready") and r.get("cohort") == 2]) == 2, 40,
             "two native ranks in a cohort of 2")
    s0 = cluster.state()["step"]
    wait_for(lambda: cluster.state()["step"] >= s0 + 10, 30, "native warm-up rounds")
    without = [round_rate(cluster)]

    tab = tabs(url, f"?room=digits&batch={TAB_BATCH}&backend=python")
    split.repin()
    st = wait_tab(tab, lambda s: s["ready"] and s["cohort"] == 3, 60, "the tab ready in a cohort of 3")
    tab_hex = f"{st['id']:08x}"
    assert st["backend"] == "python"

    def tab_applied():
        r = leader_report(cluster)
        return r and r.get("applied", {}).get(tab_hex, 0) > 0 and r
    lead = wait_for(tab_applied, 30, "the leader to apply a bucket of the tab")
    assert lead["global_batch"] == GLOBAL_BATCH
    assert tab_hex in lead["speeds"]
    with_tab = [round_rate(cluster)]
    lead = wait_for(lambda: (r := leader_report(cluster)) and r["shares"].get(tab_hex, 0) > 0 and r, 10,
                    "a round with a share for the tab")
    assert lead["shares"][tab_hex] <= TAB_BATCH, lead["shares"]   # a share of its own, capped
    # the page shows its share and its measured speed as text
    text = wait_for(lambda: (t := tab.page.evaluate("document.getElementById('s-share').textContent"))
                    and "samples/s measured" in t and not t.startswith("none") and t, 10, "the page's share")
    assert f"of {GLOBAL_BATCH}" in text, text
    # once more with the tab out of the cohort (stopped) and back in: the machine's drift hits both
    tab.tc("tc.sendControl('stop')")
    wait_for(lambda: (r := leader_report(cluster)) and r.get("cohort") == 2, 20, "the cohort of 2 without the tab")
    without.append(round_rate(cluster))
    tab.tc("tc.sendControl('start')")
    wait_for(lambda: (r := leader_report(cluster)) and r.get("cohort") == 3 and r["shares"].get(tab_hex, 0) > 0, 30,
             "the tab back in the cohort with a share")
    with_tab.append(round_rate(cluster))
    # the best rate with the tab against the mean rate without it (before it joined, while stopped):
    # a tab that were awaited would hold each round for its turnaround (tens of ms against the
    # natives' few: a rate of a few percent). The ratio itself is measured in bench/bench_tab.py.
    assert max(with_tab) >= 0.8 * sum(without) / len(without), (with_tab, without, lead["shares"], lead["speeds"])
    print(f"\nnative round rate with the tab / without: {max(with_tab) / (sum(without) / len(without)):.2f} "
          f"({split.describe()}); the tab's share {lead['shares'][tab_hex]}, applied {lead['applied'].get(tab_hex)}")


def test_a_tab_left_without_a_share_says_why_on_its_page(cluster, tabs):
    # the default room (global batch 64): a native round is faster than one bucket of a
    # pure-Python tab, so the tab gets no share; its page says it follows and why, instead of a
    # bare "none" a volunteer would read as an idle tab
    url = cluster.serve()
    cluster.rank()
    tab = tabs(url, "?room=digits&backend=python")
    wait_tab(tab, lambda s: s["cohort"] == 2 and s["ready"] and s["step"] >= 50 and not s["is_leader"], 90,
             "a tab following a native leader")
    text = wait_for(lambda: (t := tab.page.evaluate("document.getElementById('s-share').textContent"))
                    and "follows every round" in t and t, 15, "the page's reason for no share")
    assert text.startswith("none") and "--global-batch" in text, text
    # a control only a leader applies, asked of this contributing tab: refused as a note, and the
    # page does not turn to "Not running." while the rank trains on (it did: the refusal went
    # through the page's failure path)
    tab.tc("tc.sendControl('lr', 0.1)")
    wait_for(lambda: "Not applied: only a rank the server lets lead" in tab.tc("document.getElementById('notes')"
                                                                              ".textContent"), 10, "the refusal's note")
    assert tab.tc("tc.phase") != "error" and tab.tc("document.getElementById('status').textContent") != "Not running."
    assert tab.tc("document.getElementById('error').hidden")
    s0 = tab.state()["step"]
    wait_tab(tab, lambda s: s["step"] > s0, 15, "the tab still following rounds")
