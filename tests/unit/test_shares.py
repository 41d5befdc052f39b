"""Shares of a fixed global batch (PROTOCOL.md, "Shares"): the planner's properties and the
machine's use of them."""

from __future__ import annotations

import math

from hypothesis import given, settings, strategies as st

from tabcohort.protocol import Compute, Timing
from tabcohort.protocol.assign import windows
from tabcohort.protocol.shares import SpeedTable, plan_shares

from .machine_helpers import beat, grad, rig, round_msg

T = Timing()


def table(speeds, overhead_ms=None, sizes=(8, 16, 32)):
    """A speed table as the leader would build it: buckets of several sizes at
    ``overhead + s / speed``."""
    t = SpeedTable()
    for k, v in speeds.items():
        for s in sizes:
            t.observe(k, s, (overhead_ms or {}).get(k, 0.5) + 1000.0 * s / v)
    return t


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4096), st.dictionaries(st.integers(1, 50), st.tuples(
    st.floats(1.0, 1e5), st.floats(0.0, 50.0), st.integers(1, 4096)), min_size=1, max_size=12),
    st.booleans())
def test_shares_cover_the_global_batch_within_caps_once(total, ranks, probe):
    speeds = {k: v for k, (v, _, _) in ranks.items()}
    over = {k: o for k, (_, o, _) in ranks.items()}
    caps = {k: c for k, (_, _, c) in ranks.items()}
    shares, probing = plan_shares(total, sorted(ranks), caps, table(speeds, over), probe=probe)
    assert shares and all(v >= 1 for v in shares.values())
    assert all(shares[k] <= caps[k] for k in shares)
    assert probing <= set(shares) and all(shares[k] == 1 for k in probing)
    covered = sum(v for k, v in shares.items() if k not in probing)
    assert covered <= total
    if set(shares) == set(ranks) and not probing:     # nobody left out: the whole batch is covered
        assert covered == min(total, sum(caps.values()))
    # consecutive windows: every sample index of the round is assigned exactly once
    offs = windows(shares, 10**12)
    spans = sorted((offs[k], offs[k] + shares[k]) for k in shares)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert spans[0][0] == 10**12 % 2**32


def test_shares_follow_speed_and_equalise_finish_times():
    speeds = {1: 1000, 2: 500, 3: 250, 4: 100}
    t = table(speeds)
    shares, _ = plan_shares(640, [1, 2, 3, 4], {k: 640 for k in speeds}, t)
    assert sum(shares.values()) == 640
    assert shares[1] > shares[2] > shares[3] > shares[4] > 0
    finish = [t.predicted_ms(k, v) for k, v in shares.items()]
    assert max(finish) / min(finish) < 1.1


def test_a_rank_whose_one_sample_would_arrive_last_by_far_gets_no_share_and_is_probed():
    t = table({1: 1000, 2: 1000, 3: 20})            # two fast ranks and a tab-like one
    shares, probing = plan_shares(64, [1, 2, 3], {1: 64, 2: 64, 3: 64}, t)
    assert shares == {1: 32, 2: 32} and probing == set()
    shares, probing = plan_shares(64, [1, 2, 3], {1: 64, 2: 64, 3: 64}, t, probe=True)
    assert shares[3] == 1 and probing == {3}
    # with enough work per round the slow rank adds: it gets a share of its own
    t2 = table({1: 10000, 2: 10000, 3: 3000}, {3: 20.0})
    big, _ = plan_shares(2000, [1, 2, 3], {k: 2000 for k in (1, 2, 3)}, t2)
    assert big[3] > 100 and sum(big.values()) == 2000


def test_a_rank_without_history_gets_a_small_probe_share_and_the_first_round_is_equal():
    first, _ = plan_shares(64, [1, 2, 3], {1: 64, 2: 64, 3: 64}, SpeedTable())
    assert sorted(first.values()) == [21, 21, 22]
    t = table({1: 1000, 2: 1000})
    later, _ = plan_shares(64, [1, 2, 9], {1: 64, 2: 64, 9: 64}, t)
    assert later[9] == 64 // 12 and sum(later.values()) == 64


def leader_with(peers, *, global_batch, batches=None, now=0.0):
    r = rig(1, now=now - T.beat_ms, ready=True, global_batch=global_batch, batch=64)
    for p in peers:
        r.m.handle(beat(p, batch=(batches or {}).get(p, 64)), now_ms=now - T.beat_ms)
    r.m.on_timer(now_ms=now)
    r.drain()
    return r


def test_the_round_carries_offsets_shares_and_cursor_and_the_global_batch_stays_fixed():
    r = leader_with([2, 3], global_batch=48)
    r.m.start(now_ms=0)
    acts = r.drain()
    rd = r.posts(acts, "round")[0]
    assert rd["shares"] == {1: 16, 2: 16, 3: 16} and rd["cursor"] == 0
    assert rd["assign"] == {1: 0, 2: 16, 3: 32}
    own = [a for a in acts if isinstance(a, Compute)][0]
    assert own.samples == 16
    assert r.m.cursor == 48 and r.m.state(0)["global_batch"] == 48


def test_a_bucket_that_does_not_cover_exactly_its_share_is_dropped():
    r = leader_with([2, 3], global_batch=48)
    r.m.start(now_ms=0)
    r.drain()
    r.m.handle(grad(2, 1, 0, samples=2**62), now_ms=1)
    r.m.handle(grad(3, 1, 0, samples=15), now_ms=1)
    assert r.m.drops["grad_bad_samples"] == 2 and r.m._collection.received == {}
    r.m.handle(grad(2, 1, 0, samples=16), now_ms=2)
    assert 2 in r.m._collection.received


def test_buckets_turnaround_feeds_the_speeds_and_the_shares_follow():
    r = leader_with([2], global_batch=60)
    r.m.start(now_ms=0)
    t = 0.0
    for _ in range(12):
        acts = r.drain()
        own = [a for a in acts if isinstance(a, Compute) and a.own][-1]
        col = r.m._collection
        share2 = col.shares[2]
        r.m.bucket_ready(own.token, *r.w.grads_sync(own.offset, own.samples), now_ms=t + own.samples * 1.0)
        r.m.handle(grad(2, 1, col.step, samples=share2), now_ms=t + share2 * 3.0)   # 3x slower
        t += 200
        r.m.on_timer(now_ms=t)
    sh = r.m.shares
    assert sh[1] > 2 * sh[2] > 0 and sum(sh.values()) == 60
    assert r.m.state(t)["speeds"][f"{1:08x}"] > 2 * r.m.state(t)["speeds"][f"{2:08x}"]


def test_a_follower_computes_exactly_its_share_and_continues_the_cursor():
    r = rig(5)
    r.m.start(now_ms=0)
    r.m.handle(round_msg(1, 3, assign={1: 100, 5: 130}, shares={1: 30, 5: 7}, cursor=100), now_ms=1)
    c = [a for a in r.drain() if isinstance(a, Compute)][0]
    assert c.offset == 130 and c.samples == 7
    r.m.bucket_ready(c.token, *r.w.grads_sync(c.offset, c.samples), now_ms=2)
    g = r.posts(t="grad")[0]
    assert g["samples"] == 7 and r.m.cursor == 137
    assert math.isclose(r.m.state(2)["samples_assigned"], 137)


def test_a_capped_rank_takes_its_cap_and_the_others_split_the_rest_by_speed():
    t = table({1: 10000, 2: 1000, 3: 500})
    shares, _ = plan_shares(64, [1, 2, 3], {1: 8, 2: 64, 3: 64}, t)
    assert shares[1] == 8 and sum(shares.values()) == 64
    assert abs(shares[2] - 2 * shares[3]) <= 2, shares
