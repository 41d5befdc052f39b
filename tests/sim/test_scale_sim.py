"""The cohort-size figures of ``tabcohort.runtime.simscale`` (bench/bench_scale.py runs n up to
1,000; here small n, seeded, in seconds): what PROTOCOL.md's cohort-size policy predicts."""

from __future__ import annotations

import pytest

from tabcohort.protocol import Timing, policy
from tabcohort.runtime.simscale import run_scale

T = Timing()


@pytest.fixture(scope="module")
def small():
    return {n: run_scale(n, steady_ms=3000.0, joins=1, leaves=1, kills=1, compute_ms=100.0, seed=3)
            for n in (8, 24)}


def test_beats_per_rank_follow_the_stretched_beat_and_every_rank_hears_about_four_per_beat_period(small):
    for n, r in small.items():
        p = policy(n, T)
        assert r.beats_sent_per_rank_per_s == pytest.approx(1000.0 / p.beat_ms, rel=0.35), (n, r)
        assert r.beats_received_per_rank_per_s == pytest.approx((n - 1) * 1000.0 / p.beat_ms, rel=0.35), (n, r)


def test_leader_ingress_per_round_grows_with_the_cohort_and_a_join_costs_a_beat_from_every_member(small):
    a, b = small[8], small[24]
    assert a.grads_into_leader_per_round == pytest.approx(7, abs=0.5)
    assert b.grads_into_leader_per_round == pytest.approx(23, abs=0.5)
    assert b.bytes_into_leader_per_round / a.bytes_into_leader_per_round == pytest.approx(23 / 7, rel=0.25)
    for n, r in small.items():
        # each member answers each of the joiner's hellos with a beat addressed to it: linear in n
        assert n - 1 <= r.beats_per_join <= 4 * (n - 1), (n, r.beats_per_join)


def test_churn_ends_with_one_leader_bit_identical_and_the_witnessed_reelection_within_its_bound(small):
    for n, r in small.items():
        assert r.formed_ms is not None and r.rounds_per_s > 5
        assert r.leaders_after_churn == 1 and r.rounds_after_churn > 0
        assert r.bit_identical is True
        assert all(x <= r.reelect_bound_ms for x in r.reelect_ms), (n, r.reelect_ms, r.reelect_bound_ms)


def test_without_a_witness_the_reelection_waits_for_the_takeover_period():
    r = run_scale(6, steady_ms=1000.0, kills=1, witness=False, settle=False, seed=1)
    p = policy(6, T)
    assert p.takeover_ms - p.beat_ms <= r.reelect_ms[0] <= r.reelect_bound_ms
