"""Browser tabs against native ranks, side by side in one run, on the same job (the
server's default digits room), each cohort on a fresh server:

- join time of a tab: page open -> first contributed bucket (the first round after it became
  ready), next to Pyodide's own boot time measured in the worker, and their ratio;
- rounds/s of a cohort of 2 for tab-only (2 tabs), native-only (2 native ranks) and mixed
  (1 tab + 1 native), from the server's room step over a fixed window after warm-up, in a
  WebSocket-star room and in a WebRTC-mesh room (the tabs' data channels are the page's own;
  a mesh row fails unless every link is on a data channel), each against native-only of the
  same topology;
- the same two tab cohorts with a tab hidden (its window minimized);
- the longest main-thread task of a training tab (PerformanceObserver ``longtask``: tasks over
  50 ms; plus the largest lateness of a 20 ms interval probe, which also sees shorter ones).

- shares of a fixed global batch (docs/PROTOCOL.md, "Shares"), on one server per global batch:
  2 native ranks alone, then with a tab (pure Python), with the tab stopped (connected, not in
  the cohort), with it again, then alone again (means of the two native and the two mixed
  windows, so a shared machine's drift cancels in part): rounds/s of the
  mixed cohort / native-only at the room's default global batch (64), and at a global batch
  whose native round takes >= 50 ms (``--big-global-batch``, 20000) the mixed cohort's applied
  samples/s against native-only + 0.8 x the tab's solo applied samples/s (the tab alone in a
  room of the same global batch, over whole rounds), with the tab's share and its part of the
  applied samples (the leader's ``applied`` by rank). ``--shares-only`` runs just these.

Chromium is driven over raw DevTools (tests/browser/cdp.py). The machine has 2 shared cores:
read the ratios, not the bare times. Writes JSON to bench/results/bench_tab.json and prints a
Markdown table.

Usage: PYTHONPATH=client_py:server python bench/bench_tab.py [--window 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "client_py", ROOT / "server"):
    sys.path.insert(0, str(p))

from tests.browser.cdp import Chromium  # noqa: E402
from tests.integration.conftest import Cluster, wait_for  # noqa: E402

#: main-thread probes, installed before the page's own scripts
PROBE = """
window.__tcLong = {max: 0, n: 0, lagMax: 0};
try {
  new PerformanceObserver((l) => { for (const e of l.getEntries()) {
    __tcLong.n++; __tcLong.max = Math.max(__tcLong.max, e.duration); } })
    .observe({type: "longtask", buffered: true});
} catch (e) { __tcLong.unsupported = String(e); }
(() => { let last = performance.now();
  setInterval(() => { const now = performance.now();
    __tcLong.lagMax = Math.max(__tcLong.lagMax, now - last - 20); last = now; }, 20); })();
"""


def tc(page, expr: str = "tc.state"):
    return page.tc(expr)


def open_tab(chromium: Chromium, url: str, new_window: bool = True, query: str = ""):
    # a window of its own: a second tab in the same window would hide the first (and its main
    # thread's timers would be aligned to 1 s)
    tid = chromium.call("Target.createTarget", {"url": "about:blank", "newWindow": new_window})["targetId"]
    sid = chromium.call("Target.attachToTarget", {"targetId": tid, "flatten": True})["sessionId"]
    from tests.browser.cdp import Page

    page = Page(chromium, tid, sid)
    page.send("Page.enable")
    page.send("Runtime.enable")
    page.send("Page.addScriptToEvaluateOnNewDocument", {"source": PROBE})
    page.send("Page.navigate", {"url": f"{url}/?room=digits{query}"})
    page.t_open = time.monotonic()
    return page


def join_time(page) -> dict:
    """Poll (0.05 s) until the tab is ready and one round later (its first contributed bucket)."""
    ready_step = None
    t_ready = None

    def check():
        nonlocal ready_step, t_ready
        errs = tc(page, "tc.errors.filter(e => e.kind !== 'stderr')")
        if errs:
            raise RuntimeError(f"the page reports an error: {errs}")
        s = tc(page)
        if not s or not s["ready"]:
            return None
        if ready_step is None:
            ready_step, t_ready = s["step"], time.monotonic()
        return s["step"] > ready_step and time.monotonic()
    t_first = wait_for(check, 180, "the tab's first contributed bucket", interval_s=0.05)
    boot = tc(page, "tc.boot")
    return {"pyodide_boot_s": boot["pyodide_s"], "page_to_joined_s": tc(page, "tc.joinedAt"),
            "page_to_ready_s": t_ready - page.t_open, "page_to_first_bucket_s": t_first - page.t_open}


def rounds_per_s(cluster: Cluster, window_s: float) -> dict:
    def sample():
        return time.monotonic(), cluster.state()["step"]
    t0, s0 = sample()
    wait_for(lambda: time.monotonic() - t0 >= window_s, window_s + 5, "the measuring window", interval_s=0.2)
    t1, s1 = sample()
    return {"rounds": s1 - s0, "seconds": round(t1 - t0, 3), "rounds_per_s": (s1 - s0) / (t1 - t0)}


def cohort(kind: str, window_s: float, warmup_rounds: int, chromium: Chromium) -> dict:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"bench-tab-{kind}-"))
    c = Cluster(tmp)
    pages = []
    out: dict = {"cohort": kind}
    try:
        mesh = kind.endswith("mesh")
        url = c.serve(*(("--topology", "mesh") if mesh else ()))
        base = kind.split(",")[0]
        n_tabs = {"tab-only": 2, "mixed": 1, "native-only": 0}[base]
        hidden = "hidden" in kind
        for _ in range(2 - n_tabs):
            c.rank(*(("--rtc-hosts", "127.0.0.1") if mesh else ()))
        for _ in range(n_tabs):
            pages.append(open_tab(chromium, url, query="&rtc-loopback=1" if mesh else ""))
        if pages and not hidden:
            out["join"] = join_time(pages[0])
        if hidden:  # its window minimized: the first tab is hidden (its own window: the others stay visible)
            chromium.minimize(pages[0])
            wait_for(lambda: pages[0].eval("document.visibilityState") == "hidden", 10, "the first tab hidden")
        wait_for(lambda: len([r for r in c.reports() if r.get("ready") and r.get("cohort") == 2]) == 2, 180,
                 "a cohort of 2, both ready")
        s0 = c.state()["step"]
        wait_for(lambda: c.state()["step"] >= s0 + warmup_rounds, 60, "warm-up rounds", interval_s=0.2)
        if pages:  # the longest main-thread task counts from here (training only)
            pages[0].eval("__tcLong.max = 0; __tcLong.n = 0; __tcLong.lagMax = 0; true")
        out.update(rounds_per_s(c, window_s))
        if pages:
            out["main_thread"] = pages[0].eval("__tcLong")
            out["visibility"] = [p.eval("document.visibilityState") for p in pages]
        backends = sorted({r.get("backend") for r in c.reports()})
        out["backends"] = backends
        if mesh:  # the pair must really be on a data channel, or the row measures the relay
            paths = [v for r in c.reports() for v in (r.get("links") or {}).values()]
            out["paths"] = sorted(set(paths))
            if set(paths) != {"rtc"}:
                raise RuntimeError(f"{kind}: links not all on data channels: {paths}")
    finally:
        for p in pages:
            try:
                chromium.call("Target.closeTarget", {"targetId": p.target_id}, timeout_s=10)
            except Exception:
                pass
        c.close()
    return out


# ---------------------------------------------------------------- shares (PROTOCOL.md, "Shares")
def leader_applied(c: Cluster) -> tuple[float, int, dict] | None:
    """(when the leader's report was made, its applied samples in total, by rank) or None."""
    st = c.state()
    lead = next((r for r in st["ranks"] if r["connected"] and r["report"] and r["report"].get("is_leader")), None)
    if lead is None or lead["report_age_s"] is None:
        return None
    applied = lead["report"].get("applied") or {}
    return time.monotonic() - lead["report_age_s"], sum(applied.values()), applied


def shares_window(c: Cluster, window_s: float, tab_hex: str | None = None) -> dict:
    """Rounds/s (room step) and applied samples/s (the leader's ``applied`` by rank) over a window;
    with ``tab_hex``, the tab's part of the applied samples."""
    a0 = wait_for(lambda: leader_applied(c), 20, "the leader's report")
    t0, s0 = time.monotonic(), c.state()["step"]
    wait_for(lambda: time.monotonic() - t0 >= window_s, window_s + 5, "the measuring window", interval_s=0.2)
    t1, s1 = time.monotonic(), c.state()["step"]
    a1 = wait_for(lambda: (x := leader_applied(c)) and x[0] > a0[0] + window_s * 0.9 and x, 20, "a newer report")
    out = {"rounds_per_s": (s1 - s0) / (t1 - t0), "applied_per_s": (a1[1] - a0[1]) / (a1[0] - a0[0])}
    if tab_hex is not None:
        tab = a1[2].get(tab_hex, 0) - a0[2].get(tab_hex, 0)
        out["tab_applied_per_s"] = tab / (a1[0] - a0[0])
        out["tab_applied_fraction"] = tab / max(1, a1[1] - a0[1])
    return out


def shares_cohort(chromium: Chromium, global_batch: int, window_s: float) -> dict:
    """One server, global batch fixed: 2 native ranks alone, then with a tab (pure Python), then
    alone again (their mean is the native-only rate: the drift of a shared machine cancels)."""
    c = Cluster(pathlib.Path(tempfile.mkdtemp(prefix=f"bench-tab-shares-{global_batch}-")))
    page = None
    out: dict = {"global_batch": global_batch}
    try:
        url = c.serve("--global-batch", str(global_batch))
        c.rank()
        c.rank()
        wait_for(lambda: len([r for r in c.reports() if r.get("ready") and r.get("cohort") == 2]) == 2, 60,
                 "two native ranks in a cohort of 2")
        s0 = c.state()["step"]
        wait_for(lambda: c.state()["step"] >= s0 + 10, 60, "warm-up rounds", interval_s=0.2)
        native1 = shares_window(c, window_s)
        page = open_tab(chromium, url)
        wait_for(lambda: (s := tc(page)) and s["ready"] and s["cohort"] == 3, 180, "the tab ready in a cohort of 3")
        tab_hex = f"{tc(page)['id']:08x}"
        s0 = c.state()["step"]
        wait_for(lambda: c.state()["step"] >= s0 + 20, 60, "rounds with the tab", interval_s=0.2)
        mixed1 = shares_window(c, window_s, tab_hex)
        lead = next(r for r in c.reports() if r.get("is_leader"))
        out["tab_share"] = lead["shares"].get(tab_hex, 0)
        out["tab_speed"] = lead["speeds"].get(tab_hex)
        out["shares"] = lead["shares"]
        # the tab out of the cohort (stopped: still connected, following) and back in
        tc(page, "tc.sendControl('stop'), true")
        wait_for(lambda: any(r.get("is_leader") and r.get("cohort") == 2 for r in c.reports()), 30,
                 "the cohort of 2 with the tab stopped")
        out["tab_stopped"] = shares_window(c, window_s)
        tc(page, "tc.sendControl('start'), true")
        wait_for(lambda: any(r.get("is_leader") and r.get("cohort") == 3 for r in c.reports()), 60,
                 "the tab back in the cohort")
        s0 = c.state()["step"]
        wait_for(lambda: c.state()["step"] >= s0 + 10, 60, "rounds with the tab again", interval_s=0.2)
        mixed2 = shares_window(c, window_s, tab_hex)
        mixed = {k: (mixed1[k] + mixed2[k]) / 2 for k in mixed1}
        out["mixed_windows"] = [mixed1, mixed2]
        chromium.call("Target.closeTarget", {"targetId": page.target_id}, timeout_s=10)
        page = None
        wait_for(lambda: len([r for r in c.reports() if r.get("ready") and r.get("cohort") == 2]) == 2, 60,
                 "the native ranks alone again")
        s0 = c.state()["step"]
        wait_for(lambda: c.state()["step"] >= s0 + 10, 60, "rounds without the tab", interval_s=0.2)
        native2 = shares_window(c, window_s)
        out["native"] = {k: (native1[k] + native2[k]) / 2 for k in native1}
        out["native_windows"] = [native1, native2]
        out["mixed"] = mixed
    finally:
        if page is not None:
            try:
                chromium.call("Target.closeTarget", {"targetId": page.target_id}, timeout_s=10)
            except Exception:
                pass
        c.close()
    return out


def tab_solo(chromium: Chromium, global_batch: int, min_s: float, rounds: int = 2) -> dict:
    """The tab alone in a room of the same global batch: applied samples/s over whole rounds."""
    c = Cluster(pathlib.Path(tempfile.mkdtemp(prefix=f"bench-tab-solo-{global_batch}-")))
    page = None
    try:
        url = c.serve("--global-batch", str(global_batch))
        page = open_tab(chromium, url)
        wait_for(lambda: (s := tc(page)) and s["ready"] and s["step"] >= 1, 300, "the tab alone, one round done")
        s = tc(page)["step"]
        wait_for(lambda: tc(page)["step"] > s, 300, "a round boundary", interval_s=0.02)
        t0, s0 = time.monotonic(), tc(page)["step"]
        wait_for(lambda: time.monotonic() - t0 >= min_s and tc(page)["step"] >= s0 + rounds, 600,
                 "the tab's solo rounds", interval_s=0.02)
        dt, s1 = time.monotonic() - t0, tc(page)["step"]
        return {"rounds_per_s": (s1 - s0) / dt, "applied_per_s": (s1 - s0) * global_batch / dt,
                "seconds": round(dt, 2)}
    finally:
        if page is not None:
            try:
                chromium.call("Target.closeTarget", {"targetId": page.target_id}, timeout_s=10)
            except Exception:
                pass
        c.close()


def shares_main(chromium: Chromium, a) -> dict:
    small = shares_cohort(chromium, a.small_global_batch, a.window)
    big = shares_cohort(chromium, a.big_global_batch, a.window)
    solo = tab_solo(chromium, a.big_global_batch, a.window)
    small["mixed_over_native_rounds"] = small["mixed"]["rounds_per_s"] / small["native"]["rounds_per_s"]
    for x in (small, big):
        x["mixed_over_tab_stopped_rounds"] = x["mixed"]["rounds_per_s"] / x["tab_stopped"]["rounds_per_s"]
    big["tab_solo"] = solo
    big["mixed_over_native_plus_0.8_tab"] = big["mixed"]["applied_per_s"] / (
        big["native"]["applied_per_s"] + 0.8 * solo["applied_per_s"])
    return {"small": small, "big": big}


def print_shares(r: dict) -> None:
    sm, bg = r["small"], r["big"]
    print("\n| shares (2 native ranks + 1 tab, ws star, same server) | global batch | native-only | mixed | ratio | tab's share |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| rounds/s | {sm['global_batch']} | {sm['native']['rounds_per_s']:.1f} | {sm['mixed']['rounds_per_s']:.1f} | "
          f"**{sm['mixed_over_native_rounds']:.2f}** | {sm['tab_share']} |")
    print(f"| rounds/s | {bg['global_batch']} | {bg['native']['rounds_per_s']:.1f} | {bg['mixed']['rounds_per_s']:.1f} | "
          f"{bg['mixed']['rounds_per_s'] / bg['native']['rounds_per_s']:.2f} | {bg['tab_share']} |")
    print(f"| applied samples/s | {bg['global_batch']} | {bg['native']['applied_per_s']:.0f} | "
          f"{bg['mixed']['applied_per_s']:.0f} | {bg['mixed']['applied_per_s'] / bg['native']['applied_per_s']:.2f} | "
          f"{bg['tab_share']} |")
    print(f"\nrounds/s, mixed / the same cohort with the tab stopped (connected, following, no share): "
          f"{sm['mixed_over_tab_stopped_rounds']:.2f} at {sm['global_batch']}, "
          f"{bg['mixed_over_tab_stopped_rounds']:.2f} at {bg['global_batch']}")
    print(f"\nglobal batch {bg['global_batch']}: tab solo {bg['tab_solo']['applied_per_s']:.0f} applied samples/s; in the "
          f"mixed cohort the tab's buckets were {bg['mixed']['tab_applied_fraction'] * 100:.2f} % of the applied samples "
          f"({bg['mixed']['tab_applied_per_s']:.0f}/s); mixed / (native-only + 0.8 x tab solo) = "
          f"**{bg['mixed_over_native_plus_0.8_tab']:.2f}**")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=10.0, help="measuring window per cohort (s)")
    ap.add_argument("--warmup", type=int, default=30, help="warm-up rounds before the window")
    ap.add_argument("--small-global-batch", type=int, default=64, help="shares rows: the room's default")
    ap.add_argument("--big-global-batch", type=int, default=20000,
                    help="shares rows: a global batch whose native round takes >= 50 ms")
    ap.add_argument("--shares-only", action="store_true", help="only the shares rows")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "bench_tab.json"))
    a = ap.parse_args()
    chromium = Chromium()
    try:
        version = chromium.call("Browser.getVersion")["product"]
        shares = shares_main(chromium, a)
        results = [] if a.shares_only else [
            cohort(k, a.window, a.warmup, chromium)
            for k in ("mixed", "native-only", "tab-only", "mixed, tab hidden", "tab-only, 1 hidden",
                      "native-only, mesh", "mixed, mesh", "tab-only, mesh")]
    finally:
        chromium.close()
    if a.shares_only:
        doc = {"bench": "bench_tab", "chromium": version, "window_s": a.window, "shares": shares}
        pathlib.Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\n{version}, window {a.window:.0f} s")
        print_shares(shares)
        print(f"\nJSON: {a.json}")
        return 0
    by = {r["cohort"]: r for r in results}
    for r in results:  # against the native-only cohort of the same topology
        native_rps = by["native-only, mesh" if r["cohort"].endswith("mesh") else "native-only"]["rounds_per_s"]
        r["vs_native"] = r["rounds_per_s"] / native_rps if native_rps else None
    joins = [r["join"] for r in results if "join" in r]
    doc = {"bench": "bench_tab", "chromium": version, "python": platform.python_version(),
           "window_s": a.window, "warmup_rounds": a.warmup, "cohorts": results, "shares": shares,
           "join_over_pyodide_boot": [j["page_to_first_bucket_s"] / j["pyodide_boot_s"] for j in joins]}
    pathlib.Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")

    print(f"\n{version}, window {a.window:.0f} s per cohort of 2, same job (digits), one run\n")
    print("| cohort | backends | rounds/s | vs native-only | longest main-thread task (longtask) | max 20 ms-probe lateness | visibility |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        mt = r.get("main_thread")
        lt = "–" if not mt else (f"{mt['max']:.0f} ms ({mt['n']} tasks > 50 ms)" if mt["n"] else "none > 50 ms")
        lag = "–" if not mt else f"{mt['lagMax']:.0f} ms"
        print(f"| {r['cohort']} | {', '.join(map(str, r['backends']))} | {r['rounds_per_s']:.1f} | "
              f"{r['vs_native']:.2f} | {lt} | {lag} | {', '.join(r.get('visibility', [])) or '–'} |")
    print("\n| cohort | Pyodide boot (s) | page → joined (s) | page → ready (s) | page → first bucket (s) | first bucket / boot |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "join" in r:
            j = r["join"]
            print(f"| {r['cohort']} | {j['pyodide_boot_s']:.2f} | {j['page_to_joined_s']:.2f} | {j['page_to_ready_s']:.2f} | "
                  f"{j['page_to_first_bucket_s']:.2f} | {j['page_to_first_bucket_s'] / j['pyodide_boot_s']:.2f} |")
    print_shares(shares)
    print(f"\nJSON: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
