"""A module job with about 100 MB of data in a tab (README "Write your own job", Data): the tab
streams the data with progress, keeps it, imports the job and computes buckets on its pure-Python
path. In CI's browser tier (about 15-20 s and 2 GB of memory at its peak). The timings it prints
are README's figures for 100 MB in a tab."""

from __future__ import annotations

import time

import pytest

from .conftest import wait_for, wait_tab

pytestmark = pytest.mark.browser

ROWS, COLS = 200_000, 128          # float32: 102.4 MB

JOB = f'''"""softmax regression over {ROWS} x {COLS} random features: a job that is mostly data."""
import math
from array import array

SPEC = {{"name": "big-data-{ROWS}x{COLS}"}}
ROWS, COLS, K = {ROWS}, {COLS}, 4


def load_data():
    import numpy as np
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, COLS), dtype=np.float32)
    return {{"x": x, "y": (x[:, 0] > 0).astype("int32") + 2 * (x[:, 1] > 0).astype("int32")}}


class Worker:
    def __init__(self, data, batch):
        self.x, self.y = data["x"].data, data["y"].data     # flat arrays: rows are sliced lazily
        self.batch, self.bucket_len = batch, K * (COLS + 1)
        self.p = array("f", [0.0] * self.bucket_len)

    def params(self): return array("f", self.p)
    def set_params(self, v): self.p = array("f", v)

    def _probs(self, row):
        z = [sum(map(float.__mul__, self.p[c * (COLS + 1):c * (COLS + 1) + COLS], row)) + self.p[c * (COLS + 1) + COLS]
             for c in range(K)]
        e = [math.exp(v - max(z)) for v in z]
        return [v / sum(e) for v in e]

    def grads(self, offset, samples):
        g, loss = [0.0] * self.bucket_len, 0.0
        for i in ((offset + k) % ROWS for k in range(samples)):
            row = list(self.x[i * COLS:(i + 1) * COLS])
            p = self._probs(row)
            loss -= math.log(max(p[self.y[i]], 1e-12))
            for c in range(K):
                d = (p[c] - (c == self.y[i])) / samples
                b = c * (COLS + 1)
                g[b:b + COLS] = [a + d * r for a, r in zip(g[b:b + COLS], row)]
                g[b + COLS] += d
        return loss / samples, array("f", g)

    def evaluate(self):
        n = 500
        return sum(max(range(K), key=self._probs(list(self.x[i * COLS:(i + 1) * COLS])).__getitem__) == self.y[i]
                   for i in range(ROWS - n, ROWS)) / n


def make_worker(data, *, batch, seed, backend):
    return Worker(data, batch)
'''


def test_a_tab_loads_a_100_mb_job_and_computes_buckets(cluster, tabs, tmp_path):
    job = tmp_path / "big_job.py"
    job.write_text(JOB)
    url = cluster.serve("--job", str(job), "--batch", "8", "--global-batch", "16")
    cluster.rank("--trust-job")
    t0 = time.monotonic()
    tab = tabs(url, "?room=digits&numpy=off")
    wait_for(lambda: (tab.tc("tc.download") or {}).get("got", 0) > 0, 120, "the download to start")
    joined = wait_for(lambda: tab.tc("tc.joinedAt"), 600, "the tab to load the 100 MB job and join", interval_s=1.0)
    t_join = time.monotonic() - t0
    info = tab.tc("tc.job")
    assert info["status"] == "ready" and info["data_bytes"] >= 100e6, info
    assert tab.tc("tc.download")["got"] == info["data_bytes"]
    st = wait_tab(tab, lambda s: s["ready"] and s["cohort"] == 2, 120, "a cohort of 2")
    lead = wait_for(lambda: next((r for r in cluster.reports() if r.get("is_leader")
                                  and f"{st['id']:08x}" in (r.get("speeds") or {})), None), 120,
                    "the leader to measure the tab's buckets")
    speed = lead["speeds"][f"{st['id']:08x}"]
    print(f"\n{info['data_bytes'] / 1e6:.1f} MB job data: page -> joined {t_join:.1f} s "
          f"(joinedAt {joined}); the tab computed buckets: {speed:.0f} samples/s")
