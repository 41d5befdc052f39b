"""Local steps end to end (docs/PROTOCOL.md, "Local steps and optimizer state"): ``tabcohort
serve --local-steps 8`` and three ``tabcohort rank`` processes on 127.0.0.1; the leader is
killed; the optimizer state travels with the rounds and into the checkpoint. Every wait is a
bounded poll of the server's JSON."""

from __future__ import annotations

import hashlib
import time
import urllib.request
from array import array

import pytest

from .conftest import wait_for

pytestmark = pytest.mark.integration

BEAT, DROP, TAKEOVER = 400, 1600, 3200
HANDOVER_BOUND_S = (DROP + TAKEOVER + 2 * BEAT) / 1000 + 1.0


def _leader(reports: list[dict]) -> dict | None:
    leads = [r for r in reports if r.get("is_leader")]
    return leads[0] if len(leads) == 1 else None


def _checkpoint(cluster) -> tuple[dict, bytes]:
    with urllib.request.urlopen(f"{cluster.url}/api/rooms/{cluster.room}/checkpoint", timeout=5) as r:
        return dict(r.headers), r.read()


def test_three_ranks_with_local_steps_survive_a_leader_kill_and_end_bit_identical(cluster, tmp_path):
    cluster.serve("--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-interval", "1",
                  "--local-steps", "8", "--inner-lr", "0.1")
    ranks = [cluster.rank() for _ in range(3)]
    st = wait_for(lambda: (s := cluster.state())["accuracy"] is not None and s["accuracy"] >= 0.95 and s,
                  90, "3 ranks with 8 local steps to reach 95 % held-out accuracy")
    print(f"\n95 % accuracy at outer step {st['step']} (acc {st['accuracy']:.4f})")
    reps = wait_for(lambda: (rs := cluster.reports()) and len(rs) == 3 and rs, 20, "3 reports")
    assert {(r["local_steps"], r["outer_optimizer"]) for r in reps} == {(8, "nesterov")}

    # the checkpoint is the parameters, then the leader's momentum (as many values)
    ck = wait_for(lambda: cluster.state()["checkpoint"], 20, "a checkpoint")
    headers, body = _checkpoint(cluster)
    n = reps[0]["bucket_len"]
    assert len(body) == 8 * n and hashlib.sha256(body).hexdigest() == headers["X-Tabcohort-Digest"]
    momentum = array("f", body[4 * n:])
    assert any(abs(v) > 0 for v in momentum), "the checkpoint's momentum is all zeros"

    # kill the leader: the next leader takes over within the bound and goes on from the state
    # its last adopted round carried
    lead = wait_for(lambda: _leader(cluster.reports()), 10, "exactly one leader")
    victim = next(p for p in ranks if p.p.pid == lead["pid"])
    step_at_kill = lead["step"]
    t_kill = time.time()
    victim.kill()
    survivors = [p for p in ranks if p is not victim]

    def new_leader_round():
        for r in cluster.reports():
            if r["pid"] == lead["pid"]:
                continue
            for k, t_first, _step in r.get("leaders") or []:
                if k != lead["id"] and t_first > t_kill:
                    return k, t_first
        return None
    new_id, t_first = wait_for(new_leader_round, HANDOVER_BOUND_S + 10, "a new leader's first round")
    print(f"handover after {t_first - t_kill:.2f} s (bound {HANDOVER_BOUND_S:.1f} s)")
    assert t_first - t_kill <= HANDOVER_BOUND_S
    wait_for(lambda: (s := cluster.state())["step"] >= step_at_kill + 20 and s, 60,
             "20 more outer steps under the new leader")

    cluster.post(f"/api/rooms/{cluster.room}/stop")
    finals = wait_for(lambda: (fs := [r for r in cluster.reports(connected_only=False)
                                      if r.get("final") and r["pid"] != lead["pid"]]) and len(fs) == 2 and fs,
                      30, "final reports of the 2 surviving ranks")
    assert len({r["digest"] for r in finals}) == 1, finals
    for p in survivors:
        assert p.p.wait(20) == 0, p.text()
    ck = wait_for(lambda: (c := cluster.state()["checkpoint"]) and c["final"] and c, 10, "the final checkpoint")
    assert ck["accuracy"] >= 0.95
    headers, body = _checkpoint(cluster)
    # the final checkpoint's parameters are the ranks' (their digest is of the parameters alone)
    params = array("f", body[:4 * n])
    assert hashlib.sha256(params.tobytes()).hexdigest() == finals[0]["digest"]
    print(f"final: outer step {ck['step']}, accuracy {ck['accuracy']:.4f}, 2 ranks bit-identical")


def _train_to_a_checkpoint_and_stop(cluster, ckdir: str, *opts: str) -> tuple[dict, bytes]:
    """Two ranks train until a checkpoint at step >= 20 is stored; every process is stopped;
    the stored checkpoint (metadata, body)."""
    from tabcohort_server import checkpoint

    cluster.serve("--checkpoint-dir", ckdir, "--checkpoint-interval", "0.5", *opts)
    ranks = [cluster.rank() for _ in range(2)]
    wait_for(lambda: (c := cluster.state()["checkpoint"]) and c["step"] >= 20 and c, 60, "a checkpoint at step >= 20")
    for p in ranks:
        p.kill()
    cluster.server.terminate()
    return checkpoint.load(ckdir, cluster.room)


def test_a_cohort_resuming_a_checkpoint_resumes_its_momentum(cluster, tmp_path):
    from tabcohort_server import checkpoint

    ckdir = str(tmp_path / "ck")
    opts = ("--local-steps", "8", "--inner-lr", "0.1")
    meta, data = _train_to_a_checkpoint_and_stop(cluster, ckdir, *opts)
    n = meta["n"]
    p0, m0 = array("f", data[:4 * n]), array("f", data[4 * n:])
    assert len(m0) == n and any(abs(v) > 0 for v in m0)
    # one more outer step from the checkpoint, by one rank: it must start from the stored momentum
    cluster.serve("--checkpoint-dir", ckdir, "--steps", str(meta["step"] + 1), *opts)
    solo = cluster.rank()
    assert solo.p.wait(60) == 0, solo.text()
    meta1, data1 = checkpoint.load(ckdir, cluster.room)
    assert meta1["step"] == meta["step"] + 1
    p1, m1 = array("f", data1[:4 * n]), array("f", data1[4 * n:])
    # Nesterov (docs/PROTOCOL.md "Local steps and optimizer state"): m1 = mu m0 + d and
    # p1 = p0 - lr (d + mu m1); with the momentum lost (m0 = 0) the update would differ
    mu, lr = 0.9, 0.7
    worst = worst_lost = 0.0
    for a0, b0, a1, b1 in zip(p0, m0, p1, m1):
        d = b1 - mu * b0
        worst = max(worst, abs(a0 - lr * (d + mu * b1) - a1))
        worst_lost = max(worst_lost, abs(a0 - lr * (b1 + mu * b1) - a1))
    print(f"\nresumed at step {meta['step']}: Nesterov residual {worst:.2e} (with the momentum lost: {worst_lost:.2e})")
    assert worst < 1e-5 < worst_lost


def test_a_cohort_resuming_a_checkpoint_goes_on_through_the_training_set_where_it_was(cluster, tmp_path):
    # PROTOCOL.md "Leader: driving one round", step 2: the checkpoint carries the leader's cursor
    # (a resumed cohort started again at sample 0, and its epoch fell from 19,348 to 0)
    from tabcohort_server import checkpoint

    ckdir = str(tmp_path / "ck")
    meta, _ = _train_to_a_checkpoint_and_stop(cluster, ckdir, "--global-batch", "48")
    assert meta["cursor"] >= 20 * 48 - 48, meta     # (a newcomer's first rounds may be short of 48)
    cluster.serve("--checkpoint-dir", ckdir, "--steps", str(meta["step"] + 5), "--global-batch", "48")
    solo = cluster.rank()
    assert solo.p.wait(60) == 0, solo.text()
    meta1, _ = checkpoint.load(ckdir, cluster.room)
    assert meta1["step"] == meta["step"] + 5 and meta1["cursor"] == meta["cursor"] + 5 * 48, (meta, meta1)
