"""Restarting a non-leader rank never moves the lead (docs/PROTOCOL.md, "Lineage and terms":
leadership is sticky; a joiner with a lower id never takes over while rounds flow).

``tabcohort serve`` and three ``tabcohort rank`` processes in a WebSocket star: the leader, a
follower that stays (the observer: it sees every round), and a follower that is killed (SIGKILL)
and started again, each time with a fresh id from the server (random, so about half are lower
than the leader's). The leader's id and term must never change, the observer must follow one
leader throughout, and the gaps between the rounds it receives must stay within the bound below.
CI restarts 8 times (or more, at most 24, until two restarts drew an id below the leader's);
``-m slow`` restarts 20 times (at most 60). Every wait is a bounded poll.
"""

from __future__ import annotations

import time

import pytest

from tabcohort.runtime.native import RoundGaps

from .conftest import Cluster, wait_for

pytestmark = pytest.mark.integration

MIN_LOWER = 2
COLLECT_MS = 2000.0   # PROTOCOL.md default collect window (takeover: 3200 ms)


def _one_leader(reps: list[dict], n: int) -> dict | None:
    if len(reps) != n:
        return None
    leads = [r for r in reps if r.get("is_leader")]
    if len(leads) != 1 or any(r["leader"] != leads[0]["id"] or not r["ready"] for r in reps):
        return None
    return leads[0]


def _restart_many(cluster: Cluster, n_restarts: int) -> None:
    cluster.serve("--report-interval", "0.25")
    ranks = [cluster.rank() for _ in range(3)]
    lead = wait_for(lambda: (ld := _one_leader(cluster.reports(), 3)) and ld["step"] >= 200 and ld, 90,
                    "3 ranks training under one leader past step 200")
    followers = [p for p in ranks if p.p.pid != lead["pid"]]
    observer, victim = followers
    leaders_seen: set[tuple[int, int]] = set()
    lower_ids = 0

    def check(reps: list[dict]) -> list[dict]:
        for r in reps:
            if r.get("is_leader"):
                leaders_seen.add((r["id"], r.get("term")))
        return reps

    t0 = time.time()
    g0 = next(r for r in cluster.reports() if r["pid"] == observer.p.pid)["round_gaps"]
    kills: list[float] = []
    i = 0
    # ids are random: go on past n_restarts (bounded) until some restarts drew an id below the
    # leader's, the case a lowest-id-wins rule gets wrong (with ids in joining order there are none)
    while i < n_restarts or (lower_ids < MIN_LOWER and i < 3 * n_restarts):
        i += 1
        kills.append(time.time())
        victim.kill()
        victim = cluster.rank()
        # synced by a round of the same leader: ready, following it, past the step of the restart
        step0 = max(r["step"] for r in cluster.reports())
        joined = wait_for(lambda: next((r for r in check(cluster.reports()) if r["pid"] == victim.p.pid
                                        and r["ready"] and r["leader"] == lead["id"] and r["step"] > step0), None),
                          60, f"restart {i}: the restarted rank to follow the leader")
        lower_ids += joined["id"] < lead["id"]
    final = wait_for(lambda: _one_leader(check(cluster.reports()), 3), 20, "one leader after the restarts")
    obs = next(r for r in cluster.reports() if r["pid"] == observer.p.pid)
    gaps = obs["round_gaps"]
    elapsed = time.time() - t0
    n_rounds = gaps["n"] - g0["n"]
    largest = [g for g, t in gaps["largest"] if t >= t0]
    median = gaps["p50_ms"]
    # where each of the largest gaps ended, in seconds after the latest kill before it
    after_kill = [round(t - max((k for k in kills if k <= t), default=t0), 2) for g, t in gaps["largest"] if t >= t0]
    print(f"\n{i} restarts in {elapsed:.1f} s ({lower_ids} with an id below the leader's "
          f"{lead['id']:08x}): leaders seen {sorted((f'{k:08x}', t) for k, t in leaders_seen)}, "
          f"{n_rounds} rounds at the observer, median gap {median} ms, largest {largest[:4]} ms "
          f"(ending {after_kill[:4]} s after a kill); "
          f"observer's leaders {[(f'{k:08x}', s) for k, _t, s in obs['leaders']]}")
    assert leaders_seen == {(lead["id"], lead["term"])}, leaders_seen
    assert final["id"] == lead["id"] and final["term"] == lead["term"]
    assert [k for k, _t, _s in obs["leaders"]] == [lead["id"]], obs["leaders"]
    assert obs["counters"].get("takeover", 0) == 0 and obs["counters"].get("stand_down", 0) == 0
    # A takeover stalls the cohort for policy.takeover (3.2 s); a kill that the witness reports
    # must not cost the collect window (2.4 s for 3 ranks) either. With real processes on a
    # shared 2-core machine, each restart's own start (imports, dataset, model) takes a core for
    # about a second and other jobs take the rest: gaps of 50-500 ms (median ~1.3 ms) are CPU
    # starvation, not protocol, so the bound is half the base collect window.
    bound_ms = max(2 * median, COLLECT_MS / 2)
    assert not largest or largest[0] <= bound_ms, (largest, median)
    # (the report keeps the 8 largest gaps of the rank's life: if they are all above the bound,
    # a gap of the restarts above it could have been left out)
    kept = [g for g, _t in gaps["largest"]]
    assert len(kept) < 8 or kept[-1] <= bound_ms, gaps["largest"]
    cluster.post(f"/api/rooms/{cluster.room}/stop")
    finals = wait_for(lambda: (fs := [r for r in cluster.reports(connected_only=False) if r.get("final")])
                      and len(fs) == 3 and fs, 30, "the final reports of the 3 ranks")
    assert len({r["digest"] for r in finals}) == 1


def test_eight_restarts_of_a_follower_never_move_the_lead(cluster):
    _restart_many(cluster, 8)


@pytest.mark.slow
def test_twenty_restarts_of_a_follower_never_move_the_lead(cluster):
    _restart_many(cluster, 20)


def test_round_gaps_report_the_median_and_the_largest_gaps_in_bounded_memory():
    g = RoundGaps()
    assert g.report() == {"n": 0, "p50_ms": None, "largest": []}
    t = 0.0
    g.record(t, 100.0)                       # the first round starts a gap, it is not one
    for k, gap in enumerate([2.0] * 600 + [3.0] * 399 + [2500.0]):
        t += gap / 1000.0
        g.record(t, 100.0 + k)
    rep = g.report()
    assert rep["n"] == 1000
    assert 2.0 <= rep["p50_ms"] <= 2.0 * 1.091        # the upper edge of the median's bin
    assert rep["largest"][0] == [2500.0, 100.0 + 999] and len(rep["largest"]) == 8
    assert [x for x, _ in rep["largest"][1:]] == [3.0] * 7
    g.record(t, 3000.0)                       # two rounds at the same instant: a zero gap
    assert g.report()["n"] == 1001 and g.report()["p50_ms"] <= 2.0 * 1.091
