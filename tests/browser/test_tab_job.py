"""A module job in a tab (README "Write your own job"): two native ranks (numpy, --trust-job) and
one real Chromium tab (Pyodide, the job's pure-Python path: ``?numpy=off``) train the CNN job of
examples/jobs/cnn_digits.py (with synchronous rounds, and with 4 local steps and an outer Nesterov
step), and the sequence job of examples/jobs/char_model.py, and end bit-identical; the page says which job, its size and hash. Every wait is a bounded poll."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.request

import pytest

from tests.integration.conftest import ROOT

from .conftest import wait_for, wait_tab

pytestmark = pytest.mark.browser

CNN = str(ROOT / "examples" / "jobs" / "cnn_digits.py")
CHAR = str(ROOT / "examples" / "jobs" / "char_model.py")


#: DiLoCo-style rounds (docs/PROTOCOL.md, "Local steps and optimizer state"): each rank's bucket
#: is the pseudo-gradient of 4 inner SGD steps on its worker, the leader steps Nesterov
#: a job name that is markup (it would fetch /xss-name and set a global if parsed as HTML)
MARKUP_NAME = "<img src=/xss-name onerror=\"__xss=1\">"

LOCAL_STEPS = ("--local-steps", "4", "--inner-lr", "0.1", "--outer-optimizer", "nesterov", "--outer-lr", "0.7")


@pytest.mark.parametrize("job_path,lr,name,target,extra", [
    (CNN, "0.3", "cnn-digits-3x3x6", 0.90, ()),            # held-out accuracy
    (CHAR, "0.5", "charlm-", 0.65, ()),                    # next-character accuracy on held-out text
    (CNN, "0.3", "cnn-digits-3x3x6", 0.90, LOCAL_STEPS),   # the tab runs inner steps of the job's worker
], ids=["cnn", "sequence", "cnn-local-steps"])
def test_two_native_ranks_and_a_tab_train_a_module_job_bit_identical(cluster, tabs, job_path, lr, name, target,
                                                                      extra):
    # (with local steps the round's lr is --outer-lr: --lr beside it is refused as the same setting)
    url = cluster.serve("--job", job_path, *(() if "--outer-lr" in extra else ("--lr", lr)), *extra)
    tab = tabs(url, "?room=digits&numpy=off")
    wait_for(lambda: tab.tc("tc.joinedAt"), 90, "the tab to boot Pyodide, load the job and join")
    job = tab.tc("tc.job")
    assert job["status"] == "ready" and job["name"].startswith(name) and job["backend"] == "python", job
    text = tab.page.text_content("#job")
    assert job["name"] in text and job["code_sha256"][:12] in text and "python" in text, text
    assert tab.tc("tc.download")["got"] == job["data_bytes"]
    natives = [cluster.rank("--trust-job"), cluster.rank("--trust-job")]
    st = wait_tab(tab, lambda s: s["cohort"] == 3 and s["ready"], 60, "a cohort of 3 seen by the tab")
    tab_id = st["id"]
    start = st["step"]

    def trained():
        s = cluster.state()
        return s["accuracy"] is not None and s["accuracy"] >= target and s["step"] >= start + 30 and s
    wait_for(trained, 120, f"the cohort of 3 to reach {target:.0%} held-out accuracy")
    # the tab computed buckets (its pure-Python path), not only followed: the leader measured its
    # speed. Its first answer is a probe ("Shares"), which a fast native pair can outrun to the
    # target (4 inner CNN steps in Pyodide's pure Python take seconds), so wait for it, bounded
    def leader() -> dict | None:
        return next((r for r in cluster.reports() if r.get("is_leader")), None)
    t0 = time.monotonic()
    try:
        wait_for(lambda: (r := leader()) and f"{tab_id:08x}" in r["speeds"], 60, "the leader to measure the tab")
    except AssertionError:
        r = leader() or {}
        raise AssertionError(f"speeds {r.get('speeds')}, drops {r.get('drops')}, counters {r.get('counters')}, "
                             f"tab {tab.state()}") from None
    print(f"the leader measured the tab {time.monotonic() - t0:.1f} s after the cohort trained: {leader()['speeds']}")
    cluster.post(f"/api/rooms/{cluster.room}/stop")
    finals = wait_for(lambda: (fs := [r for r in cluster.reports(connected_only=False) if r.get("final")])
                      and len(fs) == 3 and fs, 40, "final reports of the 3 ranks")
    digests = {r["digest"] for r in finals}
    assert len(digests) == 1, [(r["id"], r["digest"][:12], r["step"]) for r in finals]
    backends = {r["id"]: r["backend"] for r in finals}
    assert backends[tab_id] == "python" and sorted(backends.values()) == ["numpy", "numpy", "python"], backends
    for p in natives:
        assert p.p.wait(20) == 0, p.text()
    stopped = wait_for(lambda: tab.tc("tc.stopped"), 20, "the tab's stopped message")
    assert stopped["digest"] in digests
    ck = wait_for(lambda: (c := cluster.state()["checkpoint"]) and c.get("final") and c, 15, "the final checkpoint")
    assert ck["accuracy"] >= target - 0.02, ck
    # the checkpoint's body is the parameters, then the leader's optimizer state (the outer
    # momentum with Nesterov: docs/PROTOCOL.md "Local steps and optimizer state"); its digest
    # is the body's, and its parameters are the ranks' own
    info = json.load(urllib.request.urlopen(f"{cluster.url}/api/rooms/{cluster.room}/job", timeout=5))
    req = urllib.request.Request(f"{cluster.url}/api/rooms/{cluster.room}/checkpoint",
                                 headers={"Authorization": f"Bearer {cluster.operator_token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    n, k = info["bucket_len"], info["state_len"]
    assert len(body) == 4 * (n + k) and (k > 0) == bool(extra), (len(body), n, k)
    assert hashlib.sha256(body).hexdigest() == ck["digest"]
    assert hashlib.sha256(body[:4 * n]).hexdigest() in digests
    assert not tab.console_errors, tab.console_errors
    print(f"\n{job['name']} job: final step {ck['step']}, held-out accuracy {ck['accuracy']:.4f}, 2 native ranks (numpy) "
          f"+ 1 tab (pure Python) bit-identical ({next(iter(digests))[:16]})")


def test_a_tab_that_cannot_import_the_job_says_so(cluster, tabs, tmp_path):
    """A job whose module imports a package only the server has (aiohttp): the server accepts it
    (its checks run natively, numpy blocked or not), a tab fails to import it and says so on the
    page (an error of kind job), without hanging; a reload takes the job's data from the
    browser's Cache Storage. (A job that needs numpy is announced as numpy only and refused
    before the download: test_a_tab_without_numpy_says_a_numpy_only_job_cannot_run_here...)"""
    job = tmp_path / "needs_aiohttp.py"
    job.write_text((ROOT / "examples" / "jobs" / "cnn_digits.py").read_text().replace(
        "import math\n", "import math\ntry:\n    import aiohttp  # a package a tab cannot import\n"
                         "except ImportError as e:  # (with a message of any length: the job author's)\n"
                         "    raise ImportError(f'{e} ' + 'x' * 5000) from None\n", 1))
    url = cluster.serve("--job", str(job))
    tab = tabs(url, "?room=digits&numpy=off")
    err = wait_for(lambda: tab.tc("tc.errors.find(e => e.kind === 'job') || null"), 90, "the page's job error")
    assert "failed to load in this tab" in err["text"] and "aiohttp" in err["text"], err
    assert len(err["text"]) <= 1000 and len(tab.page.text_content("#error")) < 1200, err   # cut for the page
    assert tab.tc("tc.job")["status"] == "failed"
    assert "failed to load" in tab.page.text_content("#job")
    assert "aiohttp" in tab.page.text_content("#error")
    assert "failed to load in this tab" in tab.page.text_content("#s-fault")   # not "none"
    assert tab.tc("tc.joinedAt") is None
    # ... and in its state report to the server: a seat that never said hello, with the fault
    rep = wait_for(lambda: next((r for r in cluster.reports(connected_only=False)
                                 if "failed to load in this tab" in (r.get("fault") or "")), None),
                   20, "the tab's state report with the fault")
    assert rep["kind"] == "tab" and rep["ready"] is False and "aiohttp" in rep["fault"], rep
    # the data was downloaded before the import failed, and kept: a reload takes it from the cache
    assert tab.tc("tc.download")["cached"] is False
    tab.page.reload()
    wait_for(lambda: tab.tc("tc.errors.find(e => e.kind === 'job') || null"), 90, "the job error after a reload")
    dl = tab.tc("tc.download")
    assert dl["what"] == "data" and dl["cached"] is True and dl["got"] == tab.tc("tc.job")["data_bytes"], dl


def test_a_tab_without_numpy_says_a_numpy_only_job_cannot_run_here_before_downloading_it(cluster, tabs, tmp_path):
    """A job listing ``BACKENDS = ("numpy",)``: a tab without numpy says so on its page and in its
    state report, before fetching the job's data (a new-user trial: the tab called the factory,
    which raised "No module named 'numpy'" from a temporary path)."""
    job = tmp_path / "numpy_only.py"
    # (its name, which the page shows, is markup: the server's strings are text in the page)
    src = (ROOT / "examples" / "jobs" / "cnn_digits.py").read_text()
    assert '"name": "cnn-digits-3x3x6"' in src
    job.write_text(src.replace('"name": "cnn-digits-3x3x6"', f'"name": {json.dumps(MARKUP_NAME)}', 1)
                   + '\nBACKENDS = ("numpy",)\n')
    url = cluster.serve("--job", str(job))
    tab = tabs(url, "?room=digits&numpy=off")
    err = wait_for(lambda: tab.tc("tc.errors.find(e => e.kind === 'job') || null"), 90, "the page's job error")
    assert "runs on numpy only (its BACKENDS), and this tab has no numpy" in err["text"], err
    assert "No module named" not in err["text"] and "--job=" not in err["text"], err
    assert tab.tc("tc.download") is None          # nothing was fetched for a job it cannot run
    # the page's Faults field is the tab's own fault, as text (it said "none" beside the error)
    fault = tab.page.text_content("#s-fault")
    assert "runs on numpy only (its BACKENDS), and this tab has no numpy" in fault and MARKUP_NAME in fault, fault
    assert tab.page.evaluate("document.querySelector('#s-fault').children.length") == 0
    assert tab.page.evaluate("document.querySelector('#s-fault img, #job img, #error img')") is None
    assert tab.tc("window.__xss") is None
    rep = wait_for(lambda: next((r for r in cluster.reports(connected_only=False)
                                 if "runs on numpy only" in (r.get("fault") or "")), None),
                   20, "the tab's state report with the fault")
    assert rep["kind"] == "tab" and rep["ready"] is False, rep
