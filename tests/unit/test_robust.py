"""Untrusted ranks (PROTOCOL.md, "Untrusted ranks"): robust aggregation at the leader, rounds
validated by followers, roles bound by the server, silent members and squatting candidates."""

from __future__ import annotations

import math
import random

import pytest

from tabcohort.protocol import Compute, Timing
from tabcohort.protocol.robust import (BIAS_MIN_BUCKETS, CLIP_FACTOR, BiasMonitor, clip_to_median_norm, l2_norm,
                                      trimmed_mean)
from tabcohort.vec import to_vector

from .machine_helpers import beat, grad, rig, round_msg

T = Timing()


def leader(peers, **kw):
    r = rig(1, now=-T.beat_ms, ready=True, **kw)
    for p in peers:
        r.m.handle(beat(p), now_ms=-T.beat_ms)
    r.m.on_timer(now_ms=0)
    r.drain()
    return r


def tick(r, until, peers=()):
    while (d := r.m.next_deadline_ms()) is not None and d <= until:
        for p in peers:
            r.m.handle(beat(p), now_ms=d)
        r.m.on_timer(now_ms=d)
    for p in peers:
        r.m.handle(beat(p), now_ms=until)


# ---------------------------------------------------------------- the aggregation rules
def test_clipping_bounds_a_poisoned_bucket_and_leaves_honest_ones_alone():
    own = to_vector([0.1, -0.2, 0.3, 0.1])
    honest = to_vector([0.12, -0.18, 0.25, 0.08])
    poison = to_vector([1e30] * 4)
    out, clipped = clip_to_median_norm({1: (1.0, 8, own), 2: (1.0, 8, honest), 3: (1.0, 8, poison)}, own=1)
    assert set(clipped) == {3} and clipped[3] > 1e20
    assert out[1][2] is own and out[2][2] is honest
    assert math.isclose(l2_norm(out[3][2]), CLIP_FACTOR * l2_norm(own), rel_tol=1e-5)


def test_with_one_other_bucket_the_leaders_own_norm_is_the_reference():
    own = to_vector([0.1] * 4)
    out, clipped = clip_to_median_norm({1: (1.0, 8, own), 2: (1.0, 8, to_vector([50.0] * 4))}, own=1)
    assert set(clipped) == {2}
    assert math.isclose(l2_norm(out[2][2]), CLIP_FACTOR * l2_norm(own), rel_tol=1e-5)


def test_norms_measured_as_buckets_arrive_give_the_same_clipping():
    # the leader measures each bucket when it is accepted and hands those norms in; a norm it
    # did not measure is computed here (docs/PROTOCOL.md "Untrusted ranks")
    own, honest, poison = to_vector([0.1, -0.2, 0.3, 0.1]), to_vector([0.1] * 4), to_vector([9.0] * 4)
    buckets = {1: (1.0, 8, own), 2: (1.0, 8, honest), 3: (1.0, 8, poison)}
    want = clip_to_median_norm(buckets, own=1)
    for known in ({}, {1: l2_norm(own)}, {k: l2_norm(b[2]) for k, b in buckets.items()}):
        out, clipped = clip_to_median_norm(buckets, own=1, norms=known)
        assert clipped == want[1] and [tuple(o[2]) for o in out.values()] == [tuple(o[2]) for o in want[0].values()]
    _, clipped = clip_to_median_norm(buckets, own=1, norms={3: 0.01})   # the norms given are used
    assert clipped == {}


def test_the_leader_measures_each_bucket_once_as_it_is_accepted(monkeypatch):
    import tabcohort.protocol.machine as machine_mod

    measured = []
    real = machine_mod.l2_norm
    monkeypatch.setattr(machine_mod, "l2_norm", lambda v: measured.append(len(v)) or real(v))
    def bucket_of(k, col, g, _own_samples):
        return list(g) if k in col.shares else None
    r, _ = _lead_rounds(bucket_of)
    assert r.m.step > 0 and measured            # the machine's own measurements were used...
    import tabcohort.protocol.robust as robust_mod
    monkeypatch.setattr(robust_mod, "l2_norm", lambda v: pytest.fail("norm measured twice"))
    r, _ = _lead_rounds(bucket_of)              # ...and none is measured again by the clip rule
    assert r.m.step > 0


def test_a_small_share_may_be_noisier_by_the_square_root_of_the_share_ratio():
    own = to_vector([1.0] * 4)
    noisy = to_vector([7.0] * 4)            # 7x the leader's norm, from 1 sample against 64
    _, clipped = clip_to_median_norm({1: (1.0, 64, own), 2: (1.0, 1, noisy)}, own=1)
    assert clipped == {}                    # its bound is 4 x 8 = 32x
    _, clipped = clip_to_median_norm({1: (1.0, 64, own), 2: (1.0, 64, noisy)}, own=1)
    assert set(clipped) == {2}


def test_a_trainers_norm_counts_twice_in_the_reference_as_the_leaders_does():
    # near convergence a leader's 3-sample bucket of fit examples is short, while a trainer's
    # 61-sample bucket holds a few hard ones: measured on digits (a pure-Python leader beside a
    # numpy trainer), the trainer's buckets ran 10-40 x the leader's norm, were clipped in every
    # round and the trainer was quarantined (docs/PROTOCOL.md "Untrusted ranks", trainers)
    own = to_vector([0.001] * 4)
    trainer = to_vector([0.05] * 4)
    _, clipped = clip_to_median_norm({1: (1.0, 3, own), 2: (1.0, 61, trainer)}, own=1)
    assert set(clipped) == {2} and clipped[2] >= 10.0          # the leader's norm alone: 50 x over its norm
    out, clipped = clip_to_median_norm({1: (1.0, 3, own), 2: (1.0, 61, trainer)}, own=1, trainers={2})
    assert clipped == {} and out[2][2] is trainer
    # a contributor beside them is still bounded by the trainers' median
    poison = to_vector([1e30] * 4)
    _, clipped = clip_to_median_norm({1: (1.0, 3, own), 2: (1.0, 61, trainer), 3: (1.0, 8, poison)}, own=1,
                                     trainers={2}, contributors={3})
    assert set(clipped) == {3} and clipped[3] > 1e20


def test_trimmed_mean_drops_the_extremes_per_coordinate():
    vs = [to_vector([1.0, 10.0]), to_vector([2.0, -1e6]), to_vector([3.0, 11.0]),
          to_vector([1e6, 12.0]), to_vector([2.0, 10.0])]
    got = list(trimmed_mean(vs, [1, 1, 1, 1, 1], trim=0.2))
    assert math.isclose(got[0], (2.0 + 3.0 + 2.0) / 3, rel_tol=1e-6)
    assert math.isclose(got[1], (10.0 + 11.0 + 10.0) / 3, rel_tol=1e-6)


@pytest.mark.parametrize("n", [3, 4])
def test_trimmed_mean_of_three_or_four_buckets_drops_a_poisoned_one(n):
    # PROTOCOL.md "Untrusted ranks": trimmed from 3 buckets on; floor(0.2 * n) is 0 below 5, and a
    # 1e30 bucket among 3 honest-looking ones came out as 2.5e29
    vs = [to_vector([1e30, -1e30])] + [to_vector([1.0 + k, 2.0 - k]) for k in range(n - 1)]
    got = list(trimmed_mean(vs, [1] * n, trim=0.2))
    assert all(math.isfinite(x) and abs(x) <= 3.0 for x in got), got


def _lead_rounds(bucket_of, rounds: int = 12, roles=None, losses=None, **kw):
    """A clip-rule leader with followers 2 and 3 driven for ``rounds`` rounds; ``bucket_of(k, col,
    g, own_samples)`` is follower k's bucket (a list) for the round, or ``None`` to send nothing.
    ``roles``: follower -> may lead, as the server names them (none: roles not enforced);
    ``losses``: follower -> the loss its buckets claim (default 1.0)."""
    train_len = kw.pop("train_len", None)
    peers = kw.pop("peers", (2, 3))
    r = leader(list(peers), aggregate="clip", **kw)
    if train_len is not None:
        r.w.train_len = train_len
    for k, may in (roles or {}).items():
        r.m.peer_role(k, may)
    r.m.start(now_ms=0)
    t = 0.0
    for _ in range(rounds):
        acts = r.drain()
        own = [a for a in acts if isinstance(a, Compute) and a.own][-1]
        col = r.m._collection
        loss, g = r.w.grads_sync(own.offset, own.samples)
        if col is not None:
            for k in peers:
                b = bucket_of(k, col, g, own.samples)
                if b is not None:
                    r.m.handle(grad(k, 1, col.step, g=b, samples=col.shares[k], term=col.term,
                                    loss=(losses or {}).get(k, 1.0)), now_ms=t)
        r.m.bucket_ready(own.token, loss, g, now_ms=t, samples=own.samples)
        t += 1.0
        tick(r, t, peers=peers)
    return r, r.m.state(t)


def test_the_leader_clips_a_poisoning_follower_and_quarantines_it():
    def bucket_of(k, col, g, _own_samples):
        if k == 2:
            return list(g) if 2 in col.awaited else None
        return [1e30] * 4 if 3 in col.shares else None
    r, st = _lead_rounds(bucket_of)
    assert r.m.clipped[3] >= 4 and f"{3:08x}" in st["quarantined"] and st["clipped"][f"{3:08x}"] >= 4
    assert 3 not in r.m.shares                                  # quarantined: no share at all
    assert all(math.isfinite(x) and abs(x) < 1e6 for x in r.w.params())


def test_under_the_clip_rule_a_bucket_with_a_nan_or_an_infinity_is_dropped_and_counted():
    # its norm is the finiteness check there (robust.l2_norm): not finite -> dropped, never
    # reduced (docs/PROTOCOL.md "Leader: driving one round")
    for bad in (math.nan, math.inf, -math.inf):
        def bucket_of(k, col, g, _own_samples, bad=bad):
            if k not in col.shares:
                return None
            return [bad] + list(g)[1:] if k == 3 else list(g)
        r, _ = _lead_rounds(bucket_of)
        assert r.m.drops["grad_non_finite"] >= 1 and r.m.step > 0, (bad, dict(r.m.drops))
        assert r.m.counters["buckets_clipped"] == 0                  # dropped, not clipped to zero
        assert all(math.isfinite(x) for x in r.w.params())


def test_under_the_clip_rule_a_nan_own_bucket_is_dropped_by_its_norm_and_the_peers_apply():
    # the leader's own bucket is measured too, and its norm is its finiteness check
    # (robust.l2_norm; docs/PROTOCOL.md "Leader: driving one round", step 5)
    for bad in (math.nan, math.inf):
        r = leader([2], aggregate="clip")
        r.w.set_params([0.0] * 4)
        r.m.set_lr(1.0)
        r.m.start(now_ms=0)
        own = [a for a in r.drain() if isinstance(a, Compute) and a.own][-1]
        col = r.m._collection
        r.m.handle(grad(2, 1, col.step, g=[0.5] * 4, samples=col.shares[2], term=col.term), now_ms=1)
        r.m.bucket_ready(own.token, 1.0, to_vector([bad] * 4), now_ms=2, samples=own.samples)
        assert r.m.drops["own_bucket_invalid"] == 1, bad
        assert r.m.step == 1 and list(r.w.params()) == [-0.5] * 4, bad


def test_an_honest_rank_a_little_over_the_bound_is_clipped_but_never_quarantined():
    # near convergence an honest batch's gradient can pass 4 x the median norm; clipping bounds
    # it, and only buckets far past the bound count toward a quarantine (docs/PROTOCOL.md
    # "Untrusted ranks")
    def bucket_of(k, col, g, own_samples):
        if k not in col.shares:
            return None
        scale = 1.0 if k == 2 else 6.0 * max(1.0, math.sqrt(own_samples / max(1, col.shares[k])))
        return [scale * x for x in g]
    r, st = _lead_rounds(bucket_of)
    assert r.m.clipped[3] >= 4 and not st["quarantined"] and 3 in r.m.shares


@pytest.mark.parametrize("roles", [None, {2: True, 3: True}])
def test_a_trainer_far_over_the_bound_is_never_quarantined(roles):
    # while the server names roles, a rank named a trainer holds the leader's credential: it could
    # lead and apply anything, so quarantining it guards nothing and throws its compute away
    # (a numpy trainer beside a pure-Python leader lost every share that way: docs/PROTOCOL.md
    # "Untrusted ranks", trainers); in a room without roles the clip rule quarantines it as before
    def bucket_of(k, col, g, own_samples):
        if k not in col.shares:
            return None
        return [(1.0 if k == 2 else 60.0) * x for x in g]
    r, st = _lead_rounds(bucket_of) if roles is None else _lead_rounds(bucket_of, roles=roles)
    assert r.m.clipped[3] >= 4
    if roles is None:
        assert f"{3:08x}" in st["quarantined"] and 3 not in r.m.shares
    else:
        assert not st["quarantined"] and 3 in r.m.shares


@pytest.mark.parametrize("roles", [None, {2: True, 3: True}])
def test_the_leader_counts_a_trainers_norm_twice_in_its_reference(roles):
    # a trainer's bucket 20 x the leader's: against the leader's norm alone (no roles named) it is
    # clipped in every round; counted twice beside the leader's, the reference is the mean of the
    # two and it never is (docs/PROTOCOL.md "Untrusted ranks", trainers)
    def bucket_of(k, col, g, own_samples):
        return [20.0 * x for x in g] if k in col.shares else None
    r, _ = _lead_rounds(bucket_of, roles=roles and {2: True}, rounds=6, peers=(2,))
    assert r.m.step > 0
    if roles is None:
        assert r.m.clipped[2] >= 3
    else:
        assert r.m.clipped[2] == 0


def test_a_contributors_bound_is_the_median_itself_and_a_trainers_four_times_it():
    own = to_vector([0.1, -0.2, 0.3, 0.1])
    twice = to_vector([0.2, -0.4, 0.6, 0.2])
    buckets = {1: (1.0, 8, own), 2: (1.0, 8, twice), 3: (1.0, 8, twice)}
    out, clipped = clip_to_median_norm(buckets, own=1, contributors={3})
    # (the reference: the median of |own| twice and |2 own| twice, 1.5 |own|)
    assert set(clipped) == {3} and math.isclose(clipped[3], 2.0 / 1.5, rel_tol=1e-5)
    assert out[2][2] is twice and math.isclose(l2_norm(out[3][2]), 1.5 * l2_norm(own), rel_tol=1e-5)


def _unit(n, seed):
    rng = random.Random(seed)
    v = [rng.gauss(0.0, 1.0) for _ in range(n)]
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v]


@pytest.mark.parametrize("kind", ["array", "numpy"])
def test_a_steady_push_is_told_from_noise_by_its_mean_residual(kind):
    # docs/PROTOCOL.md "Untrusted ranks": an honest contributor's residual is zero-mean noise,
    # whatever its scale from round to round (shares differ); a push as long as the noise's RMS,
    # always the same way, is told apart within a few dozen buckets
    if kind == "numpy":
        np = pytest.importorskip("numpy")
        vec = lambda xs: np.asarray(xs, dtype=np.float32)      # noqa: E731
    else:
        vec = to_vector
    rng, d = random.Random(7), 200
    zero, u = vec([0.0] * d), _unit(d, 8)
    mon = BiasMonitor()
    ratios = []
    for _ in range(1500):
        scale = rng.choice((0.25, 1.0, 4.0))
        ratios.append(mon.observe(1, vec([rng.gauss(0.0, scale) for _ in range(d)]), zero))
        assert not mon.biased(ratios[-1]), ratios[-1]
    assert ratios[BIAS_MIN_BUCKETS - 2] is None and max(r for r in ratios if r is not None) < 0.35
    first = None
    for i in range(200):
        noise = [rng.gauss(0.0, 1.0) for _ in range(d)]
        push = math.sqrt(d)                              # as long as the noise's RMS
        ratio = mon.observe(2, vec([e + push * x for e, x in zip(noise, u)]), zero)
        if mon.biased(ratio):
            first = i
            break
    assert first is not None and first <= 2 * BIAS_MIN_BUCKETS, first
    mon.forget(2)
    assert mon.observe(2, zero, zero) is None and 2 in mon.ranks()
    # the same push on rows that keep recurring (few distinct windows) is not judged
    rec = BiasMonitor()
    for i in range(200):
        noise = [rng.gauss(0.0, 1.0) for _ in range(d)]
        assert rec.observe(3, vec([e + math.sqrt(d) * x for e, x in zip(noise, u)]), zero, rows=i % 5) is None


@pytest.mark.needs_numpy
def test_a_long_residual_is_judged_in_a_small_sketch_that_still_tells_a_push_from_noise():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(3)
    d = 50_000
    mon = BiasMonitor()
    zero = np.zeros(d, dtype=np.float32)
    for _ in range(300):
        r = mon.observe(1, rng.standard_normal(d).astype(np.float32) * rng.choice((0.5, 2.0)), zero)
        assert not mon.biased(r), r
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    first = next((i for i in range(200) if mon.biased(mon.observe(
        2, (rng.standard_normal(d) + np.sqrt(d) * u).astype(np.float32), zero))), None)
    assert first is not None and first <= 2 * BIAS_MIN_BUCKETS, first
    assert all(len(v) == mon.sketch_dim for v in mon._mean.values())     # the state stays small


def test_the_rounds_loss_is_the_trainers_not_a_contributors_claim():
    # a contributor's loss of 1e30 made the leader report it, and the server stops a room whose
    # loss stays above 10x a uniform guess's for 5 s: a stranger could end the room
    def bucket_of(k, col, g, _own_samples):
        return list(g) if k in col.shares else None
    r, _ = _lead_rounds(bucket_of, rounds=6, roles={2: True, 3: False}, losses={3: 1e30})
    assert r.m.step >= 5 and r.m.loss < 10.0, r.m.loss
    assert r.m.applied_by.get(3, 0) > 0                     # its bucket still counted


def _pushing_rounds(push: float, seed: int, train_len: int | None = None):
    """Followers 2 (may lead) and 3 (contributes) answer the leader's own gradient plus noise;
    3 adds ``push`` along one fixed direction. ``train_len``: the toy training set's size."""
    rng, n = random.Random(seed), 32
    u = _unit(n, seed + 1)

    def bucket_of(k, col, g, _own_samples):
        if k not in col.shares:
            return None
        b = [x + rng.gauss(0.0, 0.3) for x in g]
        return [x + push * y for x, y in zip(b, u)] if k == 3 else b
    return _lead_rounds(bucket_of, rounds=160, roles={2: True, 3: False}, bucket_len=n, train_len=train_len)


def test_a_contributor_that_pushes_one_way_is_quarantined_and_an_honest_one_is_not():
    for seed in (1, 2, 3):
        r, st = _pushing_rounds(0.0, seed)
        assert not st["quarantined"] and r.m.counters["quarantined_for_push"] == 0, (seed, st["quarantined"])
        assert 3 in r.m.shares
    r, st = _pushing_rounds(2.0, 4)
    assert r.m.counters["quarantined_for_push"] == 1 and f"{3:08x}" in st["quarantined"]
    assert 3 not in r.m.shares and r.m.counters["quarantined"] == 1   # (not the clip rule's)
    # a trainer is never judged against the others: its buckets are the reference
    r, st = _pushing_rounds(0.0, 5)
    assert set(r.m._bias.ranks()) == {3}
    # a contributor given the same rows in every round (here a round covers the whole toy set
    # of 6 samples) is not judged: an honest one's residual is then the steady difference of
    # fixed samples (a hostile trial: honest contributors quarantined at a global batch equal to
    # the training set or a third of it)
    r, st = _pushing_rounds(2.0, 4, train_len=6)
    assert r.m.counters["quarantined_for_push"] == 0 and 3 in r.m.shares


# ---------------------------------------------------------------- followers validate rounds
def test_a_follower_drops_rounds_with_an_absurd_lr_or_step():
    r = rig(5)
    r.m.start(now_ms=0)
    r.m.handle(round_msg(1, 3, lr=10000.0), now_ms=1)
    r.m.handle(round_msg(1, 3, lr=-1.0), now_ms=1)
    r.m.handle(round_msg(1, 2**64 - 1), now_ms=1)
    assert r.m.drops["round_bad_lr"] == 2 and r.m.drops["round_bad_step"] == 1 and not r.m.ready
    r.m.handle(round_msg(1, 3, lr=0.5), now_ms=2)
    assert r.m.ready and r.m.lr == 0.5


def test_with_roles_a_follower_adopts_rounds_only_from_a_rank_the_server_says_may_lead():
    r = rig(5)
    r.m.peer_role(1, False)
    r.m.peer_role(2, True)
    r.m.start(now_ms=0)
    r.m.handle(round_msg(1, 3, params=[math.nan] * 4), now_ms=1)
    r.m.handle(round_msg(9, 3), now_ms=1)                # not named by the server: may not lead
    assert r.m.drops["round_not_trainer"] == 2 and not r.m.ready
    r.m.handle(round_msg(2, 3), now_ms=2)
    assert r.m.ready and r.m.following == 2


def test_a_volunteer_never_bootstraps_nor_takes_over_and_a_trainer_with_a_higher_id_does():
    vol = rig(1)
    vol.m.set_roles(may_lead=False)
    vol.m.peer_role(7, True)
    tr = rig(7)
    tr.m.peer_role(1, False)
    vol.m.start(now_ms=0)
    tr.m.start(now_ms=0)
    t = 0.0
    while t < 3000:
        t += 100.0
        vol.m.handle(beat(7, ready=tr.m.ready, running=True), now_ms=t)
        tr.m.handle(beat(1, ready=vol.m.ready, running=True), now_ms=t)
        vol.m.on_timer(now_ms=t)
        tr.m.on_timer(now_ms=t)
        vol.drain(), tr.drain()
    assert tr.m.is_leader(t) and not vol.m.is_leader(t)
    assert vol.m.counters["bootstrap"] == 0 and tr.m.counters["bootstrap"] == 1


# ---------------------------------------------------------------- silent members, squatters
def test_a_silent_member_is_waited_for_once_then_only_probed_until_it_delivers():
    r = leader([2, 3], aggregate="mean", global_batch=12)
    r.m.start(now_ms=0)
    t, waits = 0.0, []
    for _ in range(6):
        acts = r.drain()
        own = [a for a in acts if isinstance(a, Compute) and a.own][-1]
        col = r.m._collection
        opened = t
        r.m.handle(grad(2, 1, col.step, samples=col.shares[2], term=col.term), now_ms=t)   # 3 never answers
        r.m.bucket_ready(own.token, *r.w.grads_sync(own.offset, own.samples), now_ms=t, samples=own.samples)
        while r.m._collection is col:
            t = r.m.next_deadline_ms()
            tick(r, t, peers=(2, 3))
        waits.append(t - opened)
        assert r.m._collection is None or 3 not in r.m._collection.awaited or len(waits) == 1
        t += 1.0
        tick(r, t, peers=(2, 3))
    assert waits[0] >= T.collect_ms - 1 and max(waits[1:]) < T.collect_ms / 4, waits
    # a probe, not awaited (and, while probes go unanswered, at most one per PROBE_INTERVAL_MS)
    assert r.m.state(t)["silent"] == [f"{3:08x}"] and r.m.shares.get(3) in (None, 1)


def test_a_lowest_id_candidate_that_never_drives_is_not_deferred_to_past_a_takeover_window():
    # rank 1 beats ready and running with the lineage's step but never sends a round: rank 2
    # defers to it for one takeover window, then takes over itself
    r = rig(2, now=-T.beat_ms, ready=True)
    r.m.handle(beat(1, ready=True, running=True), now_ms=-T.beat_ms)
    r.m.start(now_ms=0)
    t = 0.0
    while t < 4 * T.takeover_ms and not r.m.is_leader(t):
        t += 100.0
        r.m.handle(beat(1, ready=True, running=True), now_ms=t)
        r.m.on_timer(now_ms=t)
        r.drain()
    assert r.m.is_leader(t) and r.m.counters["lead_candidate_skipped"] == 1
    assert t <= 3 * T.takeover_ms, t


def test_a_rejected_bucket_releases_the_round_at_once_and_the_sender_is_only_probed():
    r = leader([2, 3], aggregate="mean", global_batch=12)
    r.m.start(now_ms=0)
    acts = r.drain()
    own = [a for a in acts if isinstance(a, Compute) and a.own][-1]
    col = r.m._collection
    r.m.bucket_ready(own.token, *r.w.grads_sync(own.offset, own.samples), now_ms=1, samples=own.samples)
    r.m.handle(grad(2, 1, col.step, samples=col.shares[2], term=col.term), now_ms=2)
    r.m.handle(grad(3, 1, col.step, samples=2**62, term=col.term), now_ms=3)    # claims more weight
    assert r.m._collection is None and r.m.step == 1                           # finished at once
    assert r.m.counters["released_rejected"] == 1 and r.m.state(3)["silent"] == [f"{3:08x}"]


def test_a_higher_term_claimed_by_a_rank_that_may_not_lead_is_dropped_and_not_followed_upward():
    r = rig(5, now=-T.beat_ms, ready=True)
    r.m.peer_role(1, False)
    r.m.peer_role(7, True)
    r.m.handle(beat(1, term=2**64 - 1), now_ms=0)
    assert r.m.drops["term_claim_not_trainer"] == 1 and r.m.roster.members[1].term == r.m.term
    r.m.start(now_ms=0)
    t = 0.0
    while not r.m.is_leader(t) and t < 4 * T.takeover_ms:
        t += 100.0
        r.m.handle(beat(1, term=2**64 - 1), now_ms=t)
        r.m.on_timer(now_ms=t)
        r.drain()
    assert r.m.is_leader(t) and r.m.term < 10          # its new term ignores the false claim


def test_l2_norm_is_the_float64_norm_within_1e_6_and_exact_past_float32s_range():
    import math as _m

    np = pytest.importorskip("numpy")
    from tabcohort.protocol.robust import NORM_BLOCK, l2_norm

    def exact(v):
        return _m.sqrt(_m.fsum(float(x) * float(x) for x in v.astype(np.float64)))

    rng = np.random.default_rng(5)
    for n in (1, NORM_BLOCK - 1, NORM_BLOCK, 3 * NORM_BLOCK + 11):
        # the fast path (float32 squares): gradients, and constant vectors (its worst case)
        for v in ((rng.standard_normal(n) * 1e-3).astype(np.float32), np.full(n, 0.1, np.float32),
                  np.full(n, 1 / 3, np.float32)):
            assert l2_norm(v) == pytest.approx(exact(v), rel=1e-6)
        # squares past float32's range (1e15 ** 2 overflows the fast sum's bound, 1e-25 ** 2
        # underflows): measured again in float64
        for scale in (1e15, 1e-25):
            v = (rng.standard_normal(n) * scale).astype(np.float32)
            assert l2_norm(v) == pytest.approx(exact(v), rel=1e-12)
    big = float(np.float32(3e38))
    assert l2_norm(np.full(10, big, dtype=np.float32)) == pytest.approx(big * _m.sqrt(10), rel=1e-12)
    assert l2_norm(np.zeros(5, dtype=np.float32)) == 0.0


def test_l2_norm_is_finite_exactly_when_every_value_is():
    # the leader's finiteness check of a bucket under the clip rule (robust.l2_norm)
    from array import array

    from tabcohort.protocol.robust import NORM_BLOCK

    biggest = 3.4028234663852886e38                       # float32's largest finite value
    n = 2 * NORM_BLOCK + 5
    vectors = [array("f", [biggest] * n)]
    try:
        import numpy as np
        vectors.append(np.full(n, biggest, dtype=np.float32))
    except ImportError:
        pass
    for v in vectors:
        assert math.isfinite(l2_norm(v))
        for bad in (math.nan, math.inf, -math.inf):
            w = v[:]
            w[NORM_BLOCK + 3] = bad
            assert not math.isfinite(l2_norm(w)), (type(v), bad)


def test_a_trainer_joining_a_room_whose_leader_is_gone_leads_above_the_checkpoints_term():
    """PROTOCOL.md "Untrusted ranks" and "Lineage and terms": a rank that may lead, joining
    where only ranks that contribute are ready (the followers of a leader that left), does
    not wait for a round from them (none can come) but bootstraps, at a term above the term of
    the checkpoint it loaded, so those followers, still holding the gone leader's term, adopt
    its rounds."""
    tr = rig(7, term_floor=3)            # loaded a checkpoint uploaded by a leader at term 3
    tr.m.peer_role(1, False)              # 1 only contributes; it still follows term 3
    tr.m.start(now_ms=0)
    t = 0.0
    while t < 3000 and not tr.m.is_leader(t):
        t += 100.0
        tr.m.handle(beat(1, ready=True, running=True, step=900, term=3), now_ms=t)
        tr.m.on_timer(now_ms=t)
        tr.drain()
    assert tr.m.is_leader(t) and tr.m.counters["bootstrap"] == 1, tr.m.counters
    assert tr.m.term == 4
    # the contributor, following term 3, adopts the new leader's rounds
    vol = rig(1, ready=True, term=3)
    vol.m.set_roles(may_lead=False)
    vol.m.peer_role(7, True)
    vol.m.handle(round_msg(7, 1, term=tr.m.term), now_ms=t)
    assert vol.m.following == 7 and vol.m.term == 4


def test_a_checkpoints_term_header_is_validated_and_a_bad_one_is_no_floor():
    """``X-Tabcohort-Term`` comes from the server: anything but an integer in [0, 2^63) gives
    term floor 0 (the rule as without a checkpoint), never an exception or a huge floor."""
    from tabcohort.runtime.session import checkpoint_term
    assert checkpoint_term({"X-Tabcohort-Term": "7"}) == 7
    for bad in ({}, {"X-Tabcohort-Term": ""}, {"X-Tabcohort-Term": "-1"}, {"X-Tabcohort-Term": "1e3"},
                {"X-Tabcohort-Term": str(1 << 63)}, {"X-Tabcohort-Term": "<b>3</b>"}, {"X-Tabcohort-Term": None}):
        assert checkpoint_term(bad) == 0, bad
