"""A server restarted without ``--checkpoint-dir`` has lost the ranks' resume key: every resume is
refused (4004). Each rank then joins again as a new rank, keeping its parameters and step, and
training goes on (docs/PROTOCOL-NOTES.md, note 11). Real processes on loopback; every wait
is a bounded poll."""

from __future__ import annotations

import signal
import time
import urllib.parse

import pytest

from .conftest import wait_for

pytestmark = pytest.mark.integration


def _connected(cluster) -> dict[int, dict]:
    return {r["id"]: r["report"] for r in cluster.state()["ranks"] if r["connected"] and r["report"]}


def test_ranks_refused_a_resume_after_a_restart_without_checkpoints_rejoin_and_train_on(cluster):
    cluster.serve()
    port = urllib.parse.urlsplit(cluster.url).port
    ranks = [cluster.rank() for _ in range(2)]
    before = wait_for(lambda: (c := _connected(cluster)) and len(c) == 2 and all(
        r["step"] >= 30 and r["cohort"] == 2 for r in c.values()) and c, 60, "2 ranks training")
    old_ids = set(before)
    step0 = max(r["step"] for r in before.values())
    old = cluster.server
    old.p.send_signal(signal.SIGTERM)
    assert old.p.wait(20) == 0, old.text()
    cluster.serve("--port", str(port))           # same port, no checkpoint directory
    t0 = time.monotonic()
    for p in ranks:
        wait_for(lambda p=p: "refused its resume" in p.text() or p.p.poll() is not None, 40,
                 "the rank to be refused its resume and rejoin")
    reps = wait_for(lambda: (c := _connected(cluster)) and len(c) == 2 and all(
        r["cohort"] == 2 and r["ready"] and r["step"] >= step0 + 30 for r in c.values()) and c, 60,
        "both ranks back as new ranks, training on together")
    t_back = time.monotonic() - t0
    assert not set(reps) & old_ids, (set(reps), old_ids)          # new ids: new seats
    assert all(p.p.poll() is None for p in ranks), cluster.logs()  # nobody exited
    assert all(r["rejoins"] == 1 for r in reps.values()), reps
    # training continued from where it was, not from the initial parameters: the step went on
    # from the old one and the loss stayed low
    assert all(r["start_step"] >= step0 for r in reps.values()), reps
    assert all(r["loss"] is not None and r["loss"] < 1.0 for r in reps.values()), reps
    print(f"\nserver restarted without checkpoints at step {step0}; both ranks rejoined with new ids "
          f"and reached step {max(r['step'] for r in reps.values())} together {t_back:.1f} s later")
