"""Memory of a training tab over 1,000 rounds: the page's JS heap, the worker's JS heap and
Pyodide's wasm linear memory, measured over raw DevTools (tests/browser/cdp.py) after a warm-up
(step ~100) and 1,000 rounds later, each after a forced garbage collection. A tab and a native
rank train together, so the tab both sends and receives every round.

Bounds (README-ready; measured growth on this machine is printed by the test):
  - page JS heap (main thread: UI, charts, WebSocket relay): grows < 2 MiB over 1,000 rounds;
  - worker JS heap (Pyodide's JS side, message relay): grows < 4 MiB over 1,000 rounds;
  - wasm linear memory (the Python heap; it never shrinks): grows < 16 MiB over 1,000 rounds.
The 1,000-round run takes about 100 s on 2 cores (marked ``slow``); a 250-round variant with the
same bounds runs in CI. Every wait is a bounded poll."""

from __future__ import annotations

import pytest

from .conftest import wait_for
from .test_tab_frozen import open_ready_tab, tab_state

pytestmark = pytest.mark.browser

MiB = 1 << 20
WARMUP = 100
BOUND = {"page_js": 2 * MiB, "worker_js": 4 * MiB, "wasm": 16 * MiB}
WASM_EXPR = ("(() => { const m = self.tcPyodide && self.tcPyodide._module; if (!m) return null; "
             "return m.HEAP8 ? m.HEAP8.length : (m.wasmMemory ? m.wasmMemory.buffer.byteLength : null); })()")


def measure(chromium, page, worker: str) -> dict:
    out = {}
    for name, sess in (("page_js", page.session), ("worker_js", worker)):
        chromium.call("HeapProfiler.collectGarbage", {}, sess, 30)
        out[name] = chromium.call("Runtime.getHeapUsage", {}, sess, 30)["usedSize"]
    out["wasm"] = page.eval(WASM_EXPR, session=worker, timeout_s=10)
    out["step"] = tab_state(page)["step"]
    return out


@pytest.mark.parametrize("rounds", [pytest.param(250, id="250"), pytest.param(1000, id="1000", marks=pytest.mark.slow)])
def test_tab_memory_over_rounds_stays_bounded(cluster, chromium, rounds):
    url = cluster.serve("--any-rank-may-lead")   # tabs only: a trusted group
    page, st = open_ready_tab(chromium, url, cohort=1)
    cluster.rank()
    wait_for(lambda: (x := tab_state(page)) and x["cohort"] == 2 and x["ready"] and x, 60,
             "a cohort of 2 (tab + native)", interval_s=0.3)
    worker = page.worker_session()
    assert worker, "the page's dedicated worker was not auto-attached"
    assert page.eval(WASM_EXPR, session=worker) is not None, "self.tcPyodide (web/rank-worker.js) is missing"
    s0 = tab_state(page)["step"]
    wait_for(lambda: tab_state(page)["step"] >= s0 + WARMUP, 60, f"{WARMUP} warm-up rounds", interval_s=0.5)
    m0 = measure(chromium, page, worker)
    wait_for(lambda: tab_state(page)["step"] >= m0["step"] + rounds, 30 + rounds * 0.15, f"{rounds} more rounds",
             interval_s=1.0)
    m1 = measure(chromium, page, worker)
    after = tab_state(page)
    assert after["ready"] and after["cohort"] == 2
    growth = {k: m1[k] - m0[k] for k in BOUND}
    print(f"\nmemory over {m1['step'] - m0['step']} rounds (steps {m0['step']} -> {m1['step']}): " + "; ".join(
        f"{k} {m0[k] / MiB:.2f} -> {m1[k] / MiB:.2f} MiB (growth {growth[k] / MiB:+.2f}, bound {BOUND[k] / MiB:.0f})"
        for k in BOUND))
    for k, bound in BOUND.items():
        assert growth[k] < bound, (k, m0, m1)
