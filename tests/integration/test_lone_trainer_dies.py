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
