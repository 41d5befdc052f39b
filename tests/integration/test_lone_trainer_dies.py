"""The room's only rank that may lead dies (SIGKILL) while a rank that only contributes keeps
following it; a new rank with the trainer token joins and must take over (docs/PROTOCOL.md,
"Untrusted ranks": a joining trainer does not wait for a round from ranks that cannot send one;
"Lineage and terms": it leads above the term of the checkpoint it loaded, so the contributor,
still holding the dead leader's term, adopts its rounds). Before, the room stood still
until the contributor (there: a tab) was reloaded.

``tabcohort serve`` with a checkpoint interval of 1 s and three ``tabcohort rank`` processes over
the WebSocket star. Every wait is a bounded poll.
"""

from __future__ import annotations

import signal
import time

import pytest

from .conftest import Cluster, wait_for

pytestmark = pytest.mark.integration


def test_a_new_trainer_takes_over_from_a_dead_lone_trainer_and_the_contributor_follows(cluster: Cluster):
    cluster.serve("--report-interval", "0.25", "--checkpoint-interval", "1")
    a = cluster.rank()
    b = cluster.rank(trainer=False)

    def two_training() -> dict | None:
        reps = cluster.reports()
        if len(reps) == 2 and all(r.get("leader") == reps[0].get("leader") and r.get("ready") for r in reps):
            st = cluster.state()
            return st if (st.get("checkpoint") or {}).get("step") else None
        return None
    first = wait_for(two_training, 60, "the trainer and the contributor training, a checkpoint stored")
    old_leader = cluster.reports()[0]["leader"]
    a.kill()
    c = cluster.rank()

    def taken_over() -> dict | None:
        reps = cluster.reports()
        if len(reps) != 2:
            return None
        lead = [r for r in reps if r.get("is_leader")]
        if len(lead) == 1 and lead[0]["id"] != old_leader and all(r.get("leader") == lead[0]["id"] for r in reps) \
                and all(r.get("step", 0) > first["checkpoint"]["step"] for r in reps):
            return lead[0]
        return None
    try:
        new = wait_for(taken_over, 30, "the new trainer leading and the contributor following it")
    except AssertionError:
        raise AssertionError(f"{cluster.reports()}\n{cluster.logs()}") from None
    assert new["term"] > first["term"], (new["term"], first["term"])
    b.terminate(), c.terminate()


def test_a_contributor_whose_trainer_left_names_no_leader_and_leaves_at_once_when_the_room_stops(cluster: Cluster):
    """A new-user trial: the contributor's lines went on naming the trainer that had left, beside
    "waiting for a rank that may lead"; it now shows ``leader -``. When the server then stops the
    room the contributor leaves at once, holding the trainer's final publication, without saying
    its parameters "may differ" (a contributor that missed it leaves at once too and says why:
    tests/unit/test_session_leave.py)."""
    cluster.serve("--report-interval", "0.25")
    a = cluster.rank("--print-every", "0.5")
    b = cluster.rank("--print-every", "0.5", trainer=False)
    wait_for(lambda: (reps := cluster.reports()) and len(reps) == 2 and all(r.get("ready") for r in reps)
             and reps[0].get("leader") == reps[1].get("leader"), 60, "the trainer and the contributor training")
    a.terminate()                                   # an ordered stop of the only trainer
    assert a.p.returncode == 0, a.text()[-2000:]
    mark = len(b.text())
    line = wait_for(lambda: next((ln for ln in b.text()[mark:].splitlines() if "waiting for a rank that may lead" in ln),
                                 None), 30, "the contributor to say it waits for a rank that may lead")
    assert " leader -  " in line, line
    cluster.server.p.send_signal(signal.SIGINT)     # the server stops the room: no leader to publish
    t0 = time.monotonic()
    b.p.wait(20)
    took_s = time.monotonic() - t0
    out = b.text()
    assert b.p.returncode == 0 and "may differ from the room's final checkpoint" not in out, out[-2000:]
    assert took_s < 4.0, took_s                     # (it waited 5 s for the publication)
