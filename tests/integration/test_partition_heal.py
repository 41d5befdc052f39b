"""A rank's link frozen and healed, over the real server and real processes (docs/PROTOCOL.md,
"Lineage and terms", "Membership and majority", "Suspension").

``tabcohort serve`` and three ``tabcohort rank`` processes in a WebSocket star. A link is frozen
by SIGSTOP of one rank's process: its socket stays open, it neither reads nor sends, as a rank
whose reader stalls for seconds; SIGCONT heals it. After the heal the cohort must train at its
normal rate under exactly one leader, no rank's step may go back (no rewind to a stale lineage),
and at stop every rank holds the same parameters. Every wait is a bounded poll of the server's
JSON; nothing sleeps to wait.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from .conftest import Cluster, Proc, wait_for

pytestmark = pytest.mark.integration

FREEZE_S = 10.0
RATE_WINDOW_S = 3.0


class StepLog:
    """Samples of every rank's reported step (by pid), to find a rewind and measure rates."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.by_pid: dict[int, list[tuple[float, int]]] = {}

    def sample(self) -> list[dict]:
        reps = self.cluster.reports()
        now = time.monotonic()
        for r in reps:
            seq = self.by_pid.setdefault(r["pid"], [])
            if not seq or seq[-1][1] != r["step"]:
                seq.append((now, r["step"]))
        return reps

    def rewinds(self) -> dict[int, list[tuple[int, int]]]:
        """pid -> [(step before, step after)] wherever a rank's step went down."""
        out: dict[int, list[tuple[int, int]]] = {}
        for pid, seq in self.by_pid.items():
            downs = [(a[1], b[1]) for a, b in zip(seq, seq[1:]) if b[1] < a[1]]
            if downs:
                out[pid] = downs
        return out

    def rate(self, window_s: float) -> float:
        """Rounds per second of the cohort's highest step over ``window_s`` (sampled here)."""
        def top() -> int:
            return max((r["step"] for r in self.sample()), default=0)
        t0, s0 = time.monotonic(), top()
        wait_for(lambda: (self.sample() and False) or time.monotonic() - t0 >= window_s, window_s + 5,
                 "the rate window", interval_s=0.2)
        return (top() - s0) / (time.monotonic() - t0)


def _one_leader(reps: list[dict], n: int) -> dict | None:
    """The leader's report when ``n`` ranks report, exactly one says it leads, and all follow it."""
    if len(reps) != n:
        return None
    leads = [r for r in reps if r.get("is_leader")]
    if len(leads) != 1:
        return None
    lead = leads[0]
    if any(r["leader"] != lead["id"] or not r["ready"] for r in reps):
        return None
    return lead


def _freeze(p: Proc) -> None:
    os.kill(p.p.pid, signal.SIGSTOP)


def _thaw(p: Proc) -> None:
    os.kill(p.p.pid, signal.SIGCONT)


def _run_freeze(cluster: Cluster, *, freeze_leader: bool, freeze_s: float = FREEZE_S) -> None:
    cluster.serve("--report-interval", "0.25")
    ranks = [cluster.rank() for _ in range(3)]
    log = StepLog(cluster)
    lead = wait_for(lambda: (s := log.sample()) and _one_leader(s, 3) and _one_leader(s, 3)["step"] >= 200
                    and _one_leader(s, 3), 90, "3 ranks training under one leader past step 200")
    before = log.rate(RATE_WINDOW_S)
    lead = wait_for(lambda: _one_leader(log.sample(), 3), 20, "one leader before the freeze")
    if freeze_leader:
        victim = next(p for p in ranks if p.p.pid == lead["pid"])
    else:
        victim = next(p for p in ranks if p.p.pid != lead["pid"])
    _freeze(victim)
    try:
        t_frozen = time.monotonic()
        # the majority trains on while the link is frozen (a new leader, if it was the leader)
        def majority_moves() -> dict | None:
            reps = [r for r in log.sample() if r["pid"] != victim.p.pid]
            leads = [r for r in reps if r.get("is_leader") and r["pid"] != victim.p.pid]
            return leads[0] if len(leads) == 1 and leads[0]["step"] > lead["step"] + 50 else None
        maj = wait_for(majority_moves, freeze_s, "the majority to train on while one link is frozen")
        t_maj = time.monotonic()
        if freeze_leader:
            assert maj["term"] > lead["term"], (maj, lead)
        # hold the freeze for freeze_s in all (sampling the steps meanwhile)
        wait_for(lambda: (log.sample() and False) or time.monotonic() - t_frozen >= freeze_s, freeze_s + 5,
                 "the end of the freeze", interval_s=0.2)
        maj_step = max(r["step"] for r in log.sample() if r["pid"] != victim.p.pid)
        during = (maj_step - maj["step"]) / max(1e-3, time.monotonic() - t_maj)
        pressure = cluster.state()["pressure"]
    finally:
        _thaw(victim)
    t_heal = time.monotonic()
    wait_for(lambda: (s := log.sample()) and (ld := _one_leader(s, 3)) and ld["step"] > maj_step, 30,
             "all 3 ranks under one leader again after the heal")
    settle_s = time.monotonic() - t_heal
    after = log.rate(RATE_WINDOW_S)
    final_lead = wait_for(lambda: _one_leader(log.sample(), 3), 10, "one leader after the rate window")
    st = cluster.state()
    print(f"\n{'leader' if freeze_leader else 'follower'} frozen {freeze_s:.0f} s: {before:.0f} rounds/s before, "
          f"{during:.0f} while frozen (relay pressure {pressure}), {after:.0f} after the heal (settled in "
          f"{settle_s:.1f} s); majority step at the heal {maj_step}; leader {lead['id']:08x} term "
          f"{lead['term']} -> {final_lead['id']:08x} term {final_lead['term']}; relay drops {st['drops']}")
    # the rate after the heal, within a factor of the rate before (the bug this guards against
    # left a healed cohort at 0.4 rounds/s, each round waiting out the collect window)
    assert after >= max(before / 5, 20.0), (before, after)
    if freeze_leader:
        assert final_lead["pid"] != victim.p.pid and final_lead["term"] > lead["term"]
    else:
        assert final_lead["id"] == lead["id"] and final_lead["term"] == lead["term"]
    assert not log.rewinds(), log.rewinds()
    cluster.post(f"/api/rooms/{cluster.room}/stop")
    finals = wait_for(lambda: (fs := [r for r in cluster.reports(connected_only=False) if r.get("final")])
                      and len(fs) == 3 and fs, 30, "the final reports of the 3 ranks")
    assert len({r["digest"] for r in finals}) == 1, [(r["pid"], r["step"], r["digest"][:12]) for r in finals]
    assert min(r["step"] for r in finals) >= maj_step
    for p in ranks:
        assert p.p.wait(20) == 0, p.text()[-3000:]


def test_frozen_follower_heals_at_full_rate_under_the_same_leader(cluster):
    _run_freeze(cluster, freeze_leader=False)


def test_frozen_leader_is_replaced_by_the_majority_and_adopts_its_lineage(cluster):
    _run_freeze(cluster, freeze_leader=True)


# 25 s: past the server's WebSocket heartbeat (10 s) and the relay queue bound, so the server
# closes the frozen link (the witness reports the rank left) and the rank resumes its id
@pytest.mark.slow
@pytest.mark.parametrize("freeze_leader", [False, True], ids=["follower", "leader"])
def test_a_link_frozen_25_s_heals_the_same_way(cluster, freeze_leader):
    _run_freeze(cluster, freeze_leader=freeze_leader, freeze_s=25.0)


def _progress(p: Proc) -> list[tuple[int, str, int]]:
    """(step, leader id hex, cohort) of each progress line ``p`` printed."""
    return [(int(m[1]), m[2], int(m[3])) for m in
            re.finditer(r"step +(\d+) +leader ([0-9a-f]{8}|-)[^\n]*?cohort (\d+)", p.text())]


def test_a_rank_that_takes_over_reports_at_once_and_stores_the_final_checkpoint(cluster, tmp_path):
    """docs/PROTOCOL.md "Roles": a rank that begins to lead reports at once, not at its next
    report interval. Reports here come once an hour, so only that rule tells the server who
    leads: the first leader, then the rank that takes over when it is frozen. The operator stops
    the room before anyone's periodic report: the new leader's final checkpoint is stored (it was
    refused, 403, when the room still trusted the frozen rank it had taken over from)."""
    cluster.serve("--report-interval", "3600", "--checkpoint-dir", str(tmp_path / "ck"))
    ranks = [cluster.rank("--print-every", "0.3") for _ in range(3)]
    first = wait_for(lambda: (r := [x for x in cluster.reports() if x.get("is_leader")]) and r[0], 60,
                     "the first leader's report (sent when it began to lead)")
    victim = next(p for p in ranks if p.p.pid == first["pid"])
    others = [p for p in ranks if p is not victim]
    # both others follow it in a cohort of 3 (their own lines: they send no report for an hour)
    wait_for(lambda: all((pl := _progress(p)) and pl[-1][1] == f"{first['id']:08x}" and pl[-1][2] == 3
                         and pl[-1][0] > 0 for p in others), 60, "a cohort of 3 under the first leader")
    _freeze(victim)
    try:
        st = wait_for(lambda: (s := cluster.state())["trusted_id"] not in (None, first["id"]) and s, 20,
                      "the server to see the rank that took over")
        new = next(r for r in cluster.reports() if r["id"] == st["trusted_id"])
        assert new["is_leader"] and new["term"] > first["term"] and new["pid"] != victim.p.pid, new
        cluster.post(f"/api/rooms/{cluster.room}/stop")
        ck = wait_for(lambda: (c := cluster.state()["checkpoint"]) and c["final"] and c, 20,
                      "the new leader's final checkpoint")
    finally:
        _thaw(victim)
    finals = wait_for(lambda: (fs := [r for r in cluster.reports(connected_only=False)
                                      if r.get("final") and r["pid"] != victim.p.pid]) and len(fs) == 2 and fs,
                      30, "the final reports of the 2 ranks that trained on")
    assert ck["step"] >= new["step"] and ck["digest"].startswith(finals[0]["digest"][:16]), (ck, finals)
    assert len({r["digest"] for r in finals}) == 1, finals
    refused = "checkpoint upload: HTTP 403"   # (the rank's line for an upload the server refused)
    assert all(refused not in p.text() for p in others), cluster.logs()
    for p in others:
        assert p.p.wait(30) == 0, p.text()[-3000:]
