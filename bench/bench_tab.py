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
  the cohort), with it again, then alone again; at the room's default global batch (64) then
  twice more a window with a tab joined and one with it closed (``--pairs``, 3 in all): rounds/s
  of the mixed cohort / native-only at 64 is the median over the pairs of each mixed window
  against the mean of the native windows around it (a shared machine drifts by more than the
  effect measured, and the drift cancels to first order in a bracketed pair), and at a global batch
  whose native round takes >= 50 ms (``--big-global-batch``, 200000) the mixed cohort's applied
  samples/s against native-only + 0.8 x the tab's solo applied samples/s (the tab alone in a
  room of the same global batch, over whole rounds), with the tab's share and its part of the
  applied samples (the leader's ``applied`` by rank); and a large model (``--hidden 1024,1024``,
  4.5 MB rounds) with a js tab that gets no share, the mixed window against the native ones
  around it (what a follower costs the room). ``--shares-only`` runs just these.
  The shares rows run with the cores split (``CoreSplit``): the native ranks on one core, the
  server and Chromium on the other, as if the tab were a volunteer's own machine (on 2 shared
  cores a tab can otherwise only take CPU from the native ranks); ``--no-split-cores`` turns
  it off. Rounds/s and applied samples/s come from the same two reports of the leader.
  The control (both global batches): Chromium's CPU is measured in every window (``/proc``), and
  its extra with the tab open is replayed as a plain busy loop on the tab's core in native-only
  windows bracketed by unloaded ones; "mixed / native-only under that load" is what the tab
  costs the native ranks beyond its own CPU on a core of the same VM (two vCPUs share caches
  and, often, a physical core: a load on one slows the other, whatever the protocol does).

- compute backends (``--kernels-only`` runs just these): the grads time per bucket of the tab's
  webgpu, js and python backends, measured in one tab's worker (Pyodide), next to numpy natively
  in this process, on the same batches, for the digits MLP (64x32x10) and a model of over 1M
  parameters (64x1024x1024x10, on digits); the webgpu figures name the adapter (here SwiftShader,
  a CPU implementation: not a GPU's speed). And rounds/s of tab-only cohorts on each backend
  against native-only (the cohort rows name their backends).

Chromium is driven over raw DevTools (tests/browser/cdp.py), with ``--enable-unsafe-webgpu``. The machine has 2 shared cores:
read the ratios, not the bare times. Writes JSON to bench/results/bench_tab.json and prints a
Markdown table.

Usage: PYTHONPATH=client_py:server python bench/bench_tab.py [--window 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "client_py", ROOT / "server"):
    sys.path.insert(0, str(p))

from tests.browser.cdp import Chromium  # noqa: E402
from tests.browser.cores import CoreSplit  # noqa: E402
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
    # the page's dedicated worker: attached automatically (flat session, never paused), for profiles
    page.send("Target.setAutoAttach", {"autoAttach": True, "waitForDebuggerOnStart": False, "flatten": True})
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


def _category(frame: dict) -> str:
    url, fn = frame.get("url") or "", frame.get("functionName") or ""
    if fn in ("(idle)", "(program)", "(garbage collector)"):
        return {"(idle)": "idle", "(program)": "browser internals", "(garbage collector)": "JS garbage collection"}[fn]
    if "mlp-kernels.js" in url:
        return "compute kernels (js)"
    if url.startswith("wasm://") or "pyodide" in url:
        return "Python (Pyodide: protocol, wire, bus, driver)"
    if "rank-worker.js" in url or "app.js" in url:
        return "page <-> worker messaging (JS)"
    return "other JS (browser APIs)"


def cpu_profile(page, session: str, seconds: float) -> dict:
    """Sampled CPU profile of one DevTools session (the worker's or the page's): share of samples
    by category (``_category``); idle is time the thread waited."""
    page.cdp.call("Profiler.enable", None, session)
    page.cdp.call("Profiler.setSamplingInterval", {"interval": 200}, session)
    page.cdp.call("Profiler.start", None, session)
    t0 = time.monotonic()
    wait_for(lambda: time.monotonic() - t0 >= seconds, seconds + 5, "the profile window", interval_s=0.2)
    prof = page.cdp.call("Profiler.stop", None, session, 60)["profile"]
    page.cdp.call("Profiler.disable", None, session)
    by: dict[str, int] = {}
    for node in prof["nodes"]:
        c = _category(node["callFrame"])
        by[c] = by.get(c, 0) + node.get("hitCount", 0)
    total = sum(by.values()) or 1
    return {k: v / total for k, v in sorted(by.items(), key=lambda kv: -kv[1])}


def rounds_per_s(cluster: Cluster, window_s: float) -> dict:
    def sample():
        return time.monotonic(), cluster.state()["step"]
    t0, s0 = sample()
    wait_for(lambda: time.monotonic() - t0 >= window_s, window_s + 5, "the measuring window", interval_s=0.2)
    t1, s1 = sample()
    return {"rounds": s1 - s0, "seconds": round(t1 - t0, 3), "rounds_per_s": (s1 - s0) / (t1 - t0)}


def cohort(kind: str, window_s: float, warmup_rounds: int, chromium: Chromium, backend: str | None = None) -> dict:
    """One cohort of 2; ``backend``: the tabs' ``?backend=`` (their compute backend)."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-tab-cohort-"))
    c = Cluster(tmp)
    pages = []
    label = kind.replace(", mesh", f" ({backend}), mesh") if backend and kind.endswith(", mesh") else \
        f"{kind} ({backend})" if backend else kind
    out: dict = {"cohort": label, "kind": kind, "tab_backend": backend}
    try:
        mesh = kind.endswith("mesh")
        base = kind.split(",")[0]
        n_tabs = {"tab-only": 2, "mixed": 1, "native-only": 0}[base]
        # tabs carry no trainer token: a tab-only cohort trains only where any rank may lead
        # (docs/PROTOCOL.md "Roles"); in a mixed one the native ranks lead, as in the product
        url = c.serve(*(("--topology", "mesh") if mesh else ()),
                      *(("--any-rank-may-lead",) if base == "tab-only" else ()))
        hidden = "hidden" in kind
        for _ in range(2 - n_tabs):
            c.rank(*(("--rtc-hosts", "127.0.0.1") if mesh else ()))
        for _ in range(n_tabs):
            pages.append(open_tab(chromium, url, query=("&rtc-loopback=1" if mesh else "") + f"&backend={backend}"))
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
        if kind == "tab-only" and backend == "js":  # where a tab-only round's time goes
            # the leader's tab and a follower's: at this global batch the leader may compute whole
            # rounds alone, and a follower's profile is then only idle
            roles = {"leader": next((p for p in pages if (tc(p) or {}).get("is_leader")), pages[0])}
            roles["follower"] = next(p for p in pages if p is not roles["leader"])
            out["profile"] = {}
            for role, pg in roles.items():
                s0, t0 = c.state()["step"], time.monotonic()
                worker = pg.worker_session()
                out["profile"][role] = {"worker": cpu_profile(pg, worker, 4.0) if worker else None,
                                        "page": cpu_profile(pg, pg.session, 3.0),
                                        "shares": (tc(pg) or {}).get("shares")}
                out["profile"][role]["rounds_per_s"] = (c.state()["step"] - s0) / (time.monotonic() - t0)
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
            close_page(chromium, p)
        c.close()
    return out


# ---------------------------------------------------------------- compute backends in a tab
#: (label, hidden widths, bucket samples per backend): the python backend on the 1M model takes
#: seconds per sample under Pyodide, so its bucket there is 2 samples (the table says so)
KERNEL_MODELS = [("digits MLP 64x32x10", (32,), {"numpy": 32, "webgpu": 32, "js": 32, "python": 32}),
                 ("64x1024x1024x10 (1.13M params)", (1024, 1024), {"numpy": 32, "webgpu": 32, "js": 32, "python": 2})]

#: runs in the tab's worker: time buckets of each backend on the same batches (offsets 0, n, 2n, ...)
KERNELS_PY = """
import json, time
import js
from tabcohort.jobs import JobData
from tabcohort.jobs.builtin_mlp import OPTIONS, dataset_of
from tabcohort.model import PythonMLPWorker
from tabcohort.model.backend_js import JsMLPWorker, GpuMLPWorker
req = json.loads(_tc_req)
r = await js.fetch(req["url"])
ds = dataset_of(JobData.from_npz((await r.arrayBuffer()).to_bytes()), OPTIONS)
out = []
for m in req["models"]:
    hidden = tuple(m["hidden"])
    row = {}
    for name in ("webgpu", "js", "python"):
        n = m["samples"][name]
        try:
            if name == "webgpu":
                w = await GpuMLPWorker.create(ds, hidden=hidden, batch=n)
            elif name == "js":
                w = JsMLPWorker(ds, hidden=hidden, batch=n)
            else:
                w = PythonMLPWorker(ds, hidden=hidden, batch=n)
        except Exception as e:
            row[name] = {"error": str(e)[:200]}
            continue
        await w.grads(0, n)   # warm-up (JIT, pipelines)
        reps, t0, k = 0, time.perf_counter(), 0
        while reps < 3 or (time.perf_counter() - t0 < m["seconds"] and reps < 200):
            await w.grads(k * n, n)
            reps += 1
            k += 1
        dt = time.perf_counter() - t0
        row[name] = {"samples": n, "ms_per_bucket": dt / reps * 1e3, "buckets": reps,
                     "adapter": getattr(w, "adapter", None), "bucket_len": w.bucket_len}
        if name == "webgpu":
            w.fall_back("benchmark done")
    out.append(row)
json.dumps(out)
"""


def kernels_main(chromium: Chromium, seconds: float) -> dict:
    """Grads time per bucket: the tab's backends in one tab's worker, numpy natively, same batches."""
    from tabcohort.jobs import JobData
    from tabcohort.jobs.builtin_mlp import OPTIONS, dataset_of
    from tabcohort.model.backend_np import NumpyMLPWorker

    c = Cluster(pathlib.Path(tempfile.mkdtemp(prefix="bench-tab-kernels-")))
    page = None
    try:
        url = c.serve()
        page = chromium.open(f"{url}/?room=digits&autostart=0&backend=js")
        wait_for(lambda: tc(page, "tc.joinedAt"), 180, "the tab to boot and join")
        worker = wait_for(page.worker_session, 30, "the page's worker session")
        import urllib.request
        with urllib.request.urlopen(f"{url}/api/rooms/digits/job/data", timeout=30) as r:
            ds = dataset_of(JobData.from_npz(r.read()), OPTIONS)
        models = [{"label": lab, "hidden": list(h), "samples": n, "seconds": seconds} for lab, h, n in KERNEL_MODELS]
        req = json.dumps({"url": f"{url}/api/rooms/digits/job/data", "models": models})
        expr = (f"(async () => {{ const py = self.tcPyodide; py.globals.set('_tc_req', {json.dumps(req)});"
                f" return await py.runPythonAsync({json.dumps(KERNELS_PY)}); }})()")
        tab_rows = json.loads(page.eval(expr, timeout_s=900, session=worker))
        rows = []
        for m, tab in zip(models, tab_rows):
            n = m["samples"]["numpy"]
            w = NumpyMLPWorker(ds, hidden=tuple(m["hidden"]), batch=n)
            w.grads_sync(0, n)
            reps, t0, k = 0, time.perf_counter(), 0
            while reps < 3 or (time.perf_counter() - t0 < seconds and reps < 2000):
                w.grads_sync(k * n, n)
                reps += 1
                k += 1
            tab["numpy"] = {"samples": n, "ms_per_bucket": (time.perf_counter() - t0) / reps * 1e3, "buckets": reps,
                            "bucket_len": w.bucket_len}
            rows.append({"model": m["label"], "backends": tab})
        return {"rows": rows}
    finally:
        close_page(chromium, page)
        c.close()


def print_kernels(k: dict) -> None:
    adapter = next((r["backends"]["webgpu"].get("adapter") for r in k["rows"] if r["backends"]["webgpu"].get("adapter")),
                   None)
    print(f"\n*grads time per bucket: the tab's backends in one tab's worker (Pyodide), numpy natively, same "
          f"batches; webgpu on {adapter or 'no adapter'} (SwiftShader is a CPU implementation of WebGPU, not a GPU)*\n")
    print("| model | parameters | backend | where | bucket (samples) | ms / bucket | ms / sample | vs python (per sample) | vs numpy native (per sample) |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for r in k["rows"]:
        b = r["backends"]
        per = {n: v["ms_per_bucket"] / v["samples"] for n, v in b.items() if "ms_per_bucket" in v}
        for name in ("webgpu", "js", "python", "numpy"):
            v = b.get(name, {})
            where = "native" if name == "numpy" else "tab"
            label = f"webgpu ({v.get('adapter')})" if name == "webgpu" and v.get("adapter") else name
            if "ms_per_bucket" not in v:
                print(f"| {r['model']} | – | {label} | {where} | – | – | – | – | {v.get('error', 'not measured')} |")
                continue
            vs_py = f"{per['python'] / per[name]:.1f}x" if "python" in per else "–"
            vs_np = f"{per['numpy'] / per[name]:.3f}" if "numpy" in per else "–"
            print(f"| {r['model']} | {v['bucket_len']:,} | {label} | {where} | {v['samples']} | {v['ms_per_bucket']:.3f} | "
                  f"{per[name]:.4f} | {vs_py} | {vs_np} |")
    d = next((r["backends"] for r in k["rows"]), {})
    if all("ms_per_bucket" in d.get(n, {}) for n in ("js", "python")):
        ratio = d["python"]["ms_per_bucket"] / d["js"]["ms_per_bucket"]
        print(f"\ndigits MLP in the tab: js is **{ratio:.1f}x** python per bucket (goal >= 10x: "
              f"{'met' if ratio >= 10 else 'not met'})")


# ---------------------------------------------------------------- shares (PROTOCOL.md, "Shares")
def leader_applied(c: Cluster) -> tuple[float, int, dict, int, int] | None:
    """(when the leader's report was made, its applied samples in total, by rank, its step, its
    id) or None."""
    st = c.state()
    lead = next((r for r in st["ranks"] if r["connected"] and r["report"] and r["report"].get("is_leader")), None)
    if lead is None or lead["report_age_s"] is None:
        return None
    rep = lead["report"]
    applied = rep.get("applied") or {}
    return time.monotonic() - lead["report_age_s"], sum(applied.values()), applied, rep["step"], lead["id"]


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) used so far by ``root`` and every process below it."""
    from tests.browser.cores import _descendants

    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in _descendants(root):
        try:
            f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / tick


#: a duty-cycle CPU load on given cpus: busy ``duty`` of every 10 ms
BURNER = """
import os, sys, time
os.sched_setaffinity(0, {int(c) for c in sys.argv[2].split(",")})
duty = float(sys.argv[1])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.01 * duty:
        pass
    time.sleep(0.01 * (1 - duty))
"""


def shares_window(c: Cluster, window_s: float, tab_hex: str | None = None, cpu_root: int | None = None) -> dict:
    """Rounds/s and applied samples/s over a window, both from the same two reports of one
    leader (its step, and its ``applied`` by rank: samples of the buckets it reduced), so the
    two rates are of the same rounds; with ``tab_hex``, the tab's part of the applied samples;
    with ``cpu_root``, the cores that process tree (Chromium) used over the window."""
    a0 = wait_for(lambda: leader_applied(c), 20, "the leader's report")
    cpu0, t0 = (tree_cpu_s(cpu_root), time.monotonic()) if cpu_root else (0.0, 0.0)
    a1 = wait_for(lambda: (x := leader_applied(c)) and x[0] >= a0[0] + window_s and x, window_s + 20,
                  "a report a window later", interval_s=0.2)
    if a1[4] != a0[4]:
        raise RuntimeError("the leader changed during a measuring window")
    dt = a1[0] - a0[0]
    out = {"rounds_per_s": (a1[3] - a0[3]) / dt, "applied_per_s": (a1[1] - a0[1]) / dt, "seconds": round(dt, 2)}
    if cpu_root:
        out["cpu_root_cores"] = (tree_cpu_s(cpu_root) - cpu0) / (time.monotonic() - t0)
    if tab_hex is not None:
        tab = a1[2].get(tab_hex, 0) - a0[2].get(tab_hex, 0)
        out["tab_applied_per_s"] = tab / dt
        out["tab_applied_fraction"] = tab / max(1, a1[1] - a0[1])
    return out


def close_page(chromium: Chromium, page) -> None:
    """Close a tab if there is one (in a ``finally``: the browser may be gone already)."""
    if page is None:
        return
    try:
        chromium.call("Target.closeTarget", {"targetId": page.target_id}, timeout_s=10)
    except Exception:
        pass


def natives_alone(c: Cluster, ready_s: float) -> None:
    """Wait until the two native ranks are ready in a cohort of 2 and 10 rounds ran after it."""
    wait_for(lambda: len([r for r in c.reports() if r.get("ready") and r.get("cohort") == 2]) == 2, ready_s,
             "two native ranks in a cohort of 2")
    s0 = c.state()["step"]
    wait_for(lambda: c.state()["step"] >= s0 + 10, 60, "rounds without the tab", interval_s=0.2)


def join_tab(chromium: Chromium, c: Cluster, url: str, backend: str, split: "CoreSplit", rounds: int):
    """Open a tab on ``backend`` beside the two native ranks; return ``(page, its id in hex)``
    once it is ready in a cohort of 3 and ``rounds`` rounds ran with it."""
    page = open_tab(chromium, url, query=f"&backend={backend}")
    split.repin()
    wait_for(lambda: (s := tc(page)) and s["ready"] and s["cohort"] == 3, 180, "the tab ready in a cohort of 3")
    tab_hex = f"{tc(page)['id']:08x}"
    s0 = c.state()["step"]
    wait_for(lambda: c.state()["step"] >= s0 + rounds, 60, "rounds with the tab", interval_s=0.2)
    return page, tab_hex


def shares_cohort(chromium: Chromium, global_batch: int, window_s: float, split: "CoreSplit",
                  pairs: int = 1, load_control: bool = False) -> dict:
    """One server, global batch fixed: the 2 native ranks alone, then ``pairs`` times: with a
    tab (pure Python) joined, then alone again after it closed. Each mixed window is compared
    with the mean of the two native windows around it (a shared machine drifts by more than the
    effect measured here, and that drift cancels to first order in a bracketed pair); the first
    pair also measures the cohort with the tab stopped (connected, following, no share) and
    with it started again."""
    c = Cluster(pathlib.Path(tempfile.mkdtemp(prefix=f"bench-tab-shares-{global_batch}-")))
    page = None
    out: dict = {"global_batch": global_batch}

    try:
        url = split.serve(c, "--global-batch", str(global_batch))
        c.rank()
        c.rank()
        natives_alone(c, 60)
        cpu_root = chromium.proc.pid
        natives = [shares_window(c, window_s, cpu_root=cpu_root)]
        mixeds = []
        for i in range(pairs):
            page, tab_hex = join_tab(chromium, c, url, "python", split, 20)
            mixed = shares_window(c, window_s, tab_hex, cpu_root=cpu_root)
            if i == 0:
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
                again = shares_window(c, window_s, tab_hex, cpu_root=cpu_root)
                mixed = {k: (mixed[k] + again[k]) / 2 for k in mixed}
            mixeds.append(mixed)
            chromium.call("Target.closeTarget", {"targetId": page.target_id}, timeout_s=10)
            page = None
            natives_alone(c, 60)
            natives.append(shares_window(c, window_s, cpu_root=cpu_root))
        if load_control and split.enabled:
            # the control: what the tab's CPU costs the native ranks on this machine as a plain
            # load. Chromium's extra CPU with the tab open (over the native windows', where the
            # browser runs with no page) is replayed by a busy loop on the tab's core, in native
            # windows bracketed by unloaded ones: two vCPUs of one VM share caches and, often, a
            # physical core, so a load on one slows the other whatever the protocol does
            extra = statistics.mean(m["cpu_root_cores"] for m in mixeds) - \
                statistics.mean(w["cpu_root_cores"] for w in natives)
            duty = min(0.95, max(0.0, extra))
            loaded, around = [], []
            for _ in range(pairs):
                burner = subprocess.Popen([sys.executable, "-c", BURNER, str(duty), ",".join(map(str, sorted(split.tab)))])
                try:
                    loaded.append(shares_window(c, window_s))
                finally:
                    burner.kill()
                    burner.wait()
                around.append(shares_window(c, window_s))
            ref = [natives[-1]] + around
            out["load_control"] = {
                "duty": duty, "loaded_windows": loaded, "native_windows": ref,
                # each loaded window against the unloaded ones before and after it
                "loaded_over_native_paired": [w["rounds_per_s"] / ((ref[i]["rounds_per_s"] + ref[i + 1]["rounds_per_s"]) / 2)
                                              for i, w in enumerate(loaded)]}
        out["native_windows"], out["mixed_windows"] = natives, mixeds
        out["native"] = {k: sum(w[k] for w in natives) / len(natives) for k in natives[0]}
        out["mixed"] = {k: sum(w[k] for w in mixeds) / len(mixeds) for k in mixeds[0]}
        # each mixed window against the native windows just before and after it
        out["mixed_over_native_rounds_paired"] = [
            m["rounds_per_s"] / ((natives[i]["rounds_per_s"] + natives[i + 1]["rounds_per_s"]) / 2)
            for i, m in enumerate(mixeds)]
    finally:
        close_page(chromium, page)
        c.close()
    return out


def large_model_cohort(chromium: Chromium, window_s: float, split: "CoreSplit") -> dict:
    """The digits job on a large MLP (``--hidden 1024,1024``: 1.13M parameters, 4.5 MB rounds),
    the room's default global batch: the 2 native ranks alone, with a js tab joined (too slow
    for a share: it follows and is probed, docs/PROTOCOL.md "Shares"), and alone again; the mixed
    window against the mean of the two around it."""
    c = Cluster(pathlib.Path(tempfile.mkdtemp(prefix="bench-tab-large-")))
    page = None
    out: dict = {"hidden": [1024, 1024]}

    try:
        url = split.serve(c, "--hidden", "1024,1024")
        c.rank()
        c.rank()
        natives_alone(c, 120)
        before = shares_window(c, window_s)
        page, tab_hex = join_tab(chromium, c, url, "js", split, 10)
        mixed = shares_window(c, window_s, tab_hex)
        lead = next(r for r in c.reports() if r.get("is_leader"))
        out["tab_share"] = lead["shares"].get(tab_hex, 0)
        chromium.call("Target.closeTarget", {"targetId": page.target_id}, timeout_s=10)
        page = None
        natives_alone(c, 120)
        after = shares_window(c, window_s)
        out.update(native_windows=[before, after], mixed=mixed,
                   mixed_over_native_rounds=mixed["rounds_per_s"] / ((before["rounds_per_s"] + after["rounds_per_s"]) / 2))
    finally:
        close_page(chromium, page)
        c.close()
    return out


def tab_solo(chromium: Chromium, global_batch: int, min_s: float, split: "CoreSplit", rounds: int = 2) -> dict:
    """The tab alone in a room of the same global batch: applied samples/s over whole rounds."""
    c = Cluster(pathlib.Path(tempfile.mkdtemp(prefix=f"bench-tab-solo-{global_batch}-")))
    page = None
    try:
        url = split.serve(c, "--global-batch", str(global_batch), "--any-rank-may-lead")   # (the tab leads itself)
        page = open_tab(chromium, url, query="&backend=python")
        split.repin()
        # a round is the whole global batch in pure Python: at 200000 samples 2-5 minutes on these
        # machines (about 770 samples/s on a loaded day), so each wait is bounded per round
        round_bound_s = max(300.0, global_batch / 250.0)
        wait_for(lambda: (s := tc(page)) and s["ready"] and s["step"] >= 1, round_bound_s, "the tab alone, one round done")
        s = tc(page)["step"]
        wait_for(lambda: tc(page)["step"] > s, round_bound_s, "a round boundary", interval_s=0.02)
        t0, s0 = time.monotonic(), tc(page)["step"]
        wait_for(lambda: time.monotonic() - t0 >= min_s and tc(page)["step"] >= s0 + rounds,
                 max(600.0, (rounds + 1) * round_bound_s), "the tab's solo rounds", interval_s=0.02)
        dt, s1 = time.monotonic() - t0, tc(page)["step"]
        return {"rounds_per_s": (s1 - s0) / dt, "applied_per_s": (s1 - s0) * global_batch / dt,
                "seconds": round(dt, 2)}
    finally:
        close_page(chromium, page)
        c.close()


def shares_main(chromium: Chromium, a) -> dict:
    with CoreSplit([chromium.proc.pid], a.split_cores) as split:
        small = shares_cohort(chromium, a.small_global_batch, a.window, split, a.pairs, load_control=True)
        big = shares_cohort(chromium, a.big_global_batch, a.big_window, split, load_control=True)
        solo = tab_solo(chromium, a.big_global_batch, a.big_window, split)
        large = large_model_cohort(chromium, a.window, split)
    small["mixed_over_native_rounds"] = statistics.median(small["mixed_over_native_rounds_paired"])
    for x in (small, big):
        lc = x.get("load_control")
        if lc:
            lc["loaded_over_native"] = statistics.median(lc["loaded_over_native_paired"])
            # the mixed cohort against native-only carrying the tab's CPU as a plain load
            lc["mixed_over_native_loaded"] = x["mixed"]["rounds_per_s"] / (
                lc["loaded_over_native"] * x["native"]["rounds_per_s"]) if x is big else \
                small["mixed_over_native_rounds"] / lc["loaded_over_native"]
    for x in (small, big):
        x["mixed_over_tab_stopped_rounds"] = x["mixed"]["rounds_per_s"] / x["tab_stopped"]["rounds_per_s"]
    big["tab_solo"] = solo
    big["mixed_over_native_plus_0.8_tab"] = big["mixed"]["applied_per_s"] / (
        big["native"]["applied_per_s"] + 0.8 * solo["applied_per_s"])
    # the two parts of that sum, each against its own reference
    big["tab_part_over_tab_solo"] = big["mixed"]["tab_applied_per_s"] / solo["applied_per_s"]
    big["native_part_over_native_only"] = (big["mixed"]["applied_per_s"] - big["mixed"]["tab_applied_per_s"]) / \
        big["native"]["applied_per_s"]
    big["native_round_ms"] = 1000.0 / big["native"]["rounds_per_s"]
    if big.get("load_control"):
        # the "tab adds" sum with the native part taken under the tab's CPU as a plain load
        big["load_control"]["mixed_over_native_loaded_plus_0.8_tab"] = big["mixed"]["applied_per_s"] / (
            big["load_control"]["loaded_over_native"] * big["native"]["applied_per_s"] + 0.8 * solo["applied_per_s"])
    return {"small": small, "big": big, "large_model": large, "cores": split.describe()}


def print_shares(r: dict) -> None:
    sm, bg = r["small"], r["big"]
    print(f"\n*shares: {r['cores']}*")
    print("\n| shares (2 native ranks + 1 tab, ws star, same server) | global batch | native-only | mixed | ratio | tab's share |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| rounds/s | {sm['global_batch']} | {sm['native']['rounds_per_s']:.1f} | {sm['mixed']['rounds_per_s']:.1f} | "
          f"**{sm['mixed_over_native_rounds']:.2f}** | {sm['tab_share']} |")
    print(f"| rounds/s | {bg['global_batch']} | {bg['native']['rounds_per_s']:.1f} | {bg['mixed']['rounds_per_s']:.1f} | "
          f"{bg['mixed']['rounds_per_s'] / bg['native']['rounds_per_s']:.2f} | {bg['tab_share']} |")
    print(f"| applied samples/s | {bg['global_batch']} | {bg['native']['applied_per_s']:.0f} | "
          f"{bg['mixed']['applied_per_s']:.0f} | {bg['mixed']['applied_per_s'] / bg['native']['applied_per_s']:.2f} | "
          f"{bg['tab_share']} |")
    lg = r.get("large_model")
    if lg:
        nat = [w["rounds_per_s"] for w in lg["native_windows"]]
        print(f"| rounds/s, a 1.13M-parameter MLP (64x1024x1024x10), js tab | 64 | {sum(nat) / len(nat):.1f} | "
              f"{lg['mixed']['rounds_per_s']:.1f} | {lg['mixed_over_native_rounds']:.2f} | {lg['tab_share']} |")
    paired = sm["mixed_over_native_rounds_paired"]
    print(f"\nglobal batch {sm['global_batch']}: each window with the tab joined / the mean of the native-only windows "
          f"before and after it: {', '.join(f'{x:.3f}' for x in paired)} (median "
          f"**{sm['mixed_over_native_rounds']:.2f}**, the ratio in the table)")
    lc = sm.get("load_control")
    if lc:
        print(f"\nthe control at global batch {sm['global_batch']}: Chromium used {lc['duty'] * 100:.1f} % more of its "
              f"core with the tab open than with no page; that much plain CPU load on the same core (a busy loop, no "
              f"tab) slows the native-only pair to {', '.join(f'{x:.3f}' for x in lc['loaded_over_native_paired'])} "
              f"of its rate (median {lc['loaded_over_native']:.2f}): the mixed cohort / native-only under that load = "
              f"**{lc['mixed_over_native_loaded']:.2f}** (what the tab costs the pair beyond its CPU on a core this "
              f"VM shares)")
    print(f"\nrounds/s, mixed / the same cohort with the tab stopped (connected, following, no share): "
          f"{sm['mixed_over_tab_stopped_rounds']:.2f} at {sm['global_batch']}, "
          f"{bg['mixed_over_tab_stopped_rounds']:.2f} at {bg['global_batch']}")
    print(f"\nglobal batch {bg['global_batch']}: tab solo {bg['tab_solo']['applied_per_s']:.0f} applied samples/s; in the "
          f"mixed cohort the tab's buckets were {bg['mixed']['tab_applied_fraction'] * 100:.2f} % of the applied samples "
          f"({bg['mixed']['tab_applied_per_s']:.0f}/s); mixed / (native-only + 0.8 x tab solo) = "
          f"**{bg['mixed_over_native_plus_0.8_tab']:.2f}** (a native-only round: {bg['native_round_ms']:.0f} ms); "
          f"its parts: the tab's applied samples/s in the mixed cohort / its solo rate "
          f"**{bg['tab_part_over_tab_solo']:.2f}**, the native ranks' / native-only "
          f"{bg['native_part_over_native_only']:.2f}")
    blc = bg.get("load_control")
    if blc:
        print(f"\nthe control at global batch {bg['global_batch']}: the tab's CPU on its core ({blc['duty'] * 100:.1f} % of "
              f"it) as a plain load slows native-only to {blc['loaded_over_native']:.2f}; mixed / (native-only under "
              f"that load + 0.8 x tab solo) = **{blc['mixed_over_native_loaded_plus_0.8_tab']:.2f}**, rounds/s mixed / "
              f"native-only under that load {blc['mixed_over_native_loaded']:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=10.0, help="measuring window per cohort (s)")
    ap.add_argument("--warmup", type=int, default=30, help="warm-up rounds before the window")
    ap.add_argument("--small-global-batch", type=int, default=64, help="shares rows: the room's default")
    ap.add_argument("--big-global-batch", type=int, default=200000,
                    help="shares rows: a global batch whose native round takes >= 50 ms")
    ap.add_argument("--big-window", type=float, default=30.0,
                    help="shares rows: measuring window at the big global batch (s; its rounds are slow)")
    ap.add_argument("--pairs", type=int, default=3,
                    help="shares rows at the default global batch: (tab joined, tab closed) window pairs")
    ap.add_argument("--shares-only", action="store_true", help="only the shares rows")
    ap.add_argument("--no-split-cores", dest="split_cores", action="store_false",
                    help="shares rows: do not pin Chromium to a core of its own (see CoreSplit)")
    ap.add_argument("--kernels-only", action="store_true", help="only the compute-backend rows")
    ap.add_argument("--kernel-seconds", type=float, default=2.0, help="timing per backend and model (s)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "bench_tab.json"))
    a = ap.parse_args()
    chromium = Chromium(extra_flags=["--enable-unsafe-webgpu"])   # WebGPU (SwiftShader here)
    try:
        version = chromium.call("Browser.getVersion")["product"]
        kernels = None if a.shares_only else kernels_main(chromium, a.kernel_seconds)
        if a.kernels_only:
            print(f"\n{version}")
            print_kernels(kernels)
            return 0
        shares = shares_main(chromium, a)
        results = [] if a.shares_only else [
            cohort(k, a.window, a.warmup, chromium, b)
            for k, b in (("mixed", "js"), ("native-only", None), ("tab-only", "python"), ("tab-only", "js"),
                         ("tab-only", "webgpu"), ("mixed, tab hidden", "js"), ("tab-only, 1 hidden", "js"),
                         ("native-only, mesh", None), ("mixed, mesh", "js"), ("tab-only, mesh", "js"))]
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
        native_rps = by["native-only, mesh" if r["kind"].endswith("mesh") else "native-only"]["rounds_per_s"]
        r["vs_native"] = r["rounds_per_s"] / native_rps if native_rps else None
    joins = [r["join"] for r in results if "join" in r]
    doc = {"bench": "bench_tab", "chromium": version, "python": platform.python_version(),
           "window_s": a.window, "warmup_rounds": a.warmup, "cohorts": results, "shares": shares, "kernels": kernels,
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
    tj = by.get("tab-only (js)")
    if tj and tj.get("vs_native") is not None:
        print(f"\ntab-only cohort on js / native-only: **{tj['vs_native']:.2f}** (goal >= 0.5: "
              f"{'met' if tj['vs_native'] >= 0.5 else 'not met'}); on python "
              f"{by['tab-only (python)']['vs_native']:.2f}, on webgpu {by['tab-only (webgpu)']['vs_native']:.2f}")
    prof = (tj or {}).get("profile")
    if prof and all(prof.get(r, {}).get("worker") for r in ("leader", "follower")):
        print("\n*where a tab-only (js) round goes: sampled CPU profile (200 µs) of each tab's worker (4 s) and page "
              f"(3 s) while training, {prof['leader']['rounds_per_s']:.0f} / {prof['follower']['rounds_per_s']:.0f} "
              "rounds/s during the leader's / the follower's profiles (the profiler slows it); shares per round "
              f"{prof['leader']['shares']}*\n")
        cats: list = []
        for r in ("leader", "follower"):
            for th in ("worker", "page"):
                cats += [k for k in prof[r][th] if k not in cats]
        print("| tab | thread | " + " | ".join(cats) + " |")
        print("|---|---|" + "---:|" * len(cats))
        for r in ("leader", "follower"):
            for th in ("worker", "page"):
                print(f"| {r} | {th} | " + " | ".join(f"{prof[r][th].get(k, 0) * 100:.1f} %" for k in cats) + " |")
    print_kernels(kernels)
    print_shares(shares)
    print(f"\nJSON: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
