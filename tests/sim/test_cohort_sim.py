"""Seeded discrete-event simulations of many ranks over the in-memory bus.

Invariants are checked against the network's own delivery log (``MemoryNetwork.log``: every
message as the receiver decoded it), not against the machine code that enforces them.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random

import pytest

from tabcohort.model.toy import ToyWorker
from tabcohort.protocol import Timing, policy
from tabcohort.protocol.robust import clip_to_median_norm
from tabcohort.runtime.sim import SimCohort
from tabcohort.vec import digest, weighted_mean

T = Timing()
N_PARAMS = 6


def make(n, *, seed=0, compute_ms=20.0, ids=None, **kw):
    sim = SimCohort(seed=seed, **kw)
    ids = ids or list(range(1, n + 1))
    for k in ids:
        sim.add(k, ToyWorker(bucket_len=N_PARAMS, batch=3), compute_ms=compute_ms, lr=0.05)
    return sim


def entries(sim, t=None, since=-math.inf, until=math.inf):
    for e in sim.network.log:
        when, sender, recipient, msg = e
        if since <= when <= until and (t is None or msg["t"] == t):
            yield when, sender, recipient, msg


def rounds_by_sender(sim, since=-math.inf, until=math.inf):
    out = {}
    for when, sender, _, msg in entries(sim, "round", since, until):
        out.setdefault(sender, []).append((when, msg))
    return out


def stop_all_and_settle(sim):
    """Stop every rank, then run until no leader loop is left (a busy leader publishes when its
    round drains, at the latest when the collect window ends) and the publish is delivered."""
    for r in sim.alive():
        r.stop()
    sim.run_while(lambda: any(r.machine.looping for r in sim.alive()), limit_ms=sim.now_ms() + 10_000)
    sim.run_until(sim.now_ms() + 2 * T.beat_ms)


def digests(sim):
    return {r.id: digest(r.worker.params()) for r in sim.alive()}


def check_updates_use_only_buckets_of_their_step(sim, lr=0.05):
    """For each pair of consecutive rounds (N, N+1) from one leader, the parameter change
    must be explained by the leader's own bucket plus a subset of the step-N buckets
    delivered to it in between (sample-weighted mean, SGD at lr)."""
    checked = 0
    # the buckets delivered to each rank, in delivery order (the log is: one scan of it, then a
    # bisection per round; a scan per round made this check quadratic, most of a long run's time)
    to: dict = {}
    for w, s, rc, m in entries(sim, "grad"):
        to.setdefault(rc, ([], []))
        to[rc][0].append(w)
        to[rc][1].append((s, m))
    for leader, seq in rounds_by_sender(sim).items():
        seq = [(w, m) for w, m in seq if m["assign"]]
        times, delivered = to.get(leader, ([], []))
        for (t0, r0), (t1, r1) in zip(seq, seq[1:]):
            if r1["step"] != r0["step"] + 1:
                continue
            grads = delivered[bisect.bisect_left(times, t0):bisect.bisect_right(times, t1)]
            valid = [(s, m) for s, m in grads if m["step"] == r0["step"]]
            scratch = ToyWorker(bucket_len=N_PARAMS, batch=3)
            scratch.set_params(r0["params"])
            own_share = r0["shares"][leader]
            own_loss, own_g = scratch.grads_sync(r0["assign"][leader], own_share)
            target = [float(x) for x in r1["params"]]
            found = False
            for k in range(len(valid) + 1):
                for subset in itertools.combinations(valid, k):
                    # the leader's default aggregation (PROTOCOL.md "Untrusted ranks"): norms
                    # bounded relative to the round's median before the sample-weighted mean
                    got = {leader: (own_loss, own_share, own_g)}
                    got.update({s: (m["loss"], m["samples"], m["g"]) for s, m in subset})
                    got, _ = clip_to_median_norm(got, leader)
                    buckets = [(n, g) for _, n, g in got.values()]
                    tot = sum(s for s, _ in buckets)
                    avg = weighted_mean([g for _, g in buckets], [s / tot for s, _ in buckets])
                    w = ToyWorker(bucket_len=N_PARAMS, batch=3)
                    w.set_params(r0["params"])
                    w.apply(avg, r0["lr"])
                    if all(abs(a - float(b)) <= 1e-6 for a, b in zip(target, w.params())):
                        found = True
                        break
                if found:
                    break
            assert found, f"leader {leader}: step {r0['step']}->{r1['step']} not explained by step-{r0['step']} buckets"
            checked += 1
    return checked


def test_cohort_trains_and_ends_bit_identical():
    sim = make(4)
    sim.run_until(8000)
    steps = {r.id: r.machine.step for r in sim.alive()}
    assert min(steps.values()) > 50
    assert check_updates_use_only_buckets_of_their_step(sim) > 50
    leaders = rounds_by_sender(sim, since=3000)
    assert list(leaders) == [1]
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1


def test_killed_leader_is_replaced_within_bound():
    sim = make(4)
    sim.run_until(3000)
    kill_at = sim.now_ms()
    sim.ranks[1].kill()
    sim.run_until(kill_at + 10000)
    after = [(w, s) for s, seq in rounds_by_sender(sim, since=kill_at).items() for w, _ in seq if s != 1]
    first = min(after)
    p = policy(4, T)
    bound = p.drop_ms + p.takeover_ms + 2 * p.beat_ms
    assert first[1] == 2
    assert first[0] - kill_at <= bound, (first[0] - kill_at, bound)
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1
    check_updates_use_only_buckets_of_their_step(sim)


def test_late_joiner_is_synced_by_one_round():
    sim = make(3)
    sim.run_until(3000)
    late = sim.add(9, ToyWorker(bucket_len=N_PARAMS, batch=3), compute_ms=20.0, lr=0.05)
    assert not late.machine.ready
    done = sim.run_while(lambda: not any(rc == 9 for _, _, rc, _ in entries(sim, "round")),
                         limit_ms=6000, step_ms=1)
    assert done
    last = [m for _, _, rc, m in entries(sim, "round") if rc == 9][-1]
    assert late.machine.ready and late.machine.step == last["step"]
    assert digest(late.worker.params()) == digest(last["params"])
    sim.run_until(sim.now_ms() + 2000)
    assert sim.ranks[9].worker.calls > 0        # it contributes
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1


def test_islands_merge_under_lowest_id():
    sim = make(4, ids=[1, 2, 3, 4])
    sim.network.partition([{1, 2}, {3, 4}])
    sim.run_until(6000)
    islands = rounds_by_sender(sim, since=4000, until=6000)
    assert set(islands) == {1, 3}
    heal_at = sim.now_ms()
    sim.network.heal()
    p = policy(4, T)
    sim.run_until(heal_at + p.drop_ms + p.takeover_ms + 4 * p.beat_ms)
    settle = sim.now_ms()
    sim.run_until(settle + 3000)
    assert set(rounds_by_sender(sim, since=settle)) == {1}
    for r in sim.alive():
        assert r.machine.following in (1, None)
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1


def test_suspended_leader_that_resumes_does_not_rewind_the_cohort():
    sim = make(3)
    sim.run_until(3000)
    sim.ranks[1].freeze(6000)
    sim.run_until(9000)                         # 2 has taken over meanwhile
    before = max(m["step"] for _, s, _, m in entries(sim, "round") if s == 2)
    resume = sim.now_ms()
    sim.run_until(resume + 8000)
    steps_after = [m["step"] for _, s, _, m in entries(sim, "round", since=resume) if m["assign"]]
    assert min(steps_after) >= before
    assert sim.ranks[1].machine.counters["suspended"] == 1
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1
    check_updates_use_only_buckets_of_their_step(sim)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_faults_keep_invariants(seed):
    rng = random.Random(seed)
    ids = list(range(1, 7))
    sim = make(len(ids), seed=seed, compute_ms=15.0)
    for a, b in itertools.combinations(ids, 2):
        sim.network.set_link(a, b, delay_ms=rng.uniform(0, 5), jitter_ms=2, loss=0.01)
    t = 2000.0
    killed = set()
    for _ in range(4):
        t += rng.uniform(1000, 3000)
        kind = rng.choice(["kill", "partition", "add", "slow"])
        if kind == "kill":
            victim = rng.choice([k for k in sim.ranks if k not in killed])
            killed.add(victim)
            sim.at(t, sim.ranks[victim].kill)
        elif kind == "partition":
            alive = [k for k in sim.ranks if k not in killed]
            half = set(rng.sample(alive, len(alive) // 2))
            sim.at(t, lambda h=half, a=alive: sim.network.partition([h, set(a) - h]))
            sim.at(t + rng.uniform(1000, 4000), sim.network.heal)
        elif kind == "add":   # the new id is chosen when the add runs
            sim.at(t, lambda: sim.add(max(sim.ranks) + 1, ToyWorker(bucket_len=N_PARAMS, batch=3),
                                      compute_ms=15.0, lr=0.05))
        else:
            k = rng.choice([k for k in sim.ranks if k not in killed])
            sim.at(t, lambda k=k: setattr(sim.ranks[k], "compute_ms", 150.0))
    sim.run_until(t + 5000)
    sim.network.heal()
    p = policy(len(sim.alive()), T)
    quiet = sim.now_ms() + p.drop_ms + p.takeover_ms + 4 * p.beat_ms
    sim.run_until(quiet)
    sim.run_until(quiet + 3000)
    # one leader once takeover has elapsed (the network is whole again)
    assert len(rounds_by_sender(sim, since=quiet)) == 1
    check_updates_use_only_buckets_of_their_step(sim)
    # all faults heal before the stop (the publish is sent once: a lossy link may drop it)
    for a, b in itertools.combinations(sorted(sim.ranks), 2):
        sim.network.set_link(a, b, delay_ms=1.0, loss=0.0)
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1


@pytest.mark.parametrize("seed", range(6))
def test_a_lossy_cohort_ends_bit_identical_because_a_missed_publish_is_sent_again(seed):
    # PROTOCOL.md "Publish": the final publish crosses links that lose a fifth of all messages
    # and are never healed; a member that still announces an older step is sent it again
    sim = make(4, seed=seed, compute_ms=10.0)
    for a, b in itertools.permutations(sorted(sim.ranks), 2):
        sim.network.set_link(a, b, delay_ms=1.0, loss=0.2)
    sim.run_until(6000)
    for r in sim.alive():
        r.stop()
    sim.run_while(lambda: any(r.machine.looping for r in sim.alive()), limit_ms=sim.now_ms() + 10_000)
    sim.run_while(lambda: len(set(digests(sim).values())) > 1, limit_ms=sim.now_ms() + 20 * T.beat_ms)
    assert len(set(digests(sim).values())) == 1
    published = [r for r in sim.alive() if r.machine.counters["published"]]
    assert len(published) == 1 and all(r.machine.step == published[0].machine.step for r in sim.alive())
    if seed in (2, 3, 5):
        # these seeds lose the publish to a member (they end unequal without the rule; which
        # seeds do depends on every rule the run goes through: re-derive them when one changes)
        assert published[0].machine.counters["republished"] >= 1


def test_stop_right_after_bootstrap_ends_bit_identical_and_only_the_leader_publishes():
    # Rounds carry no ready/running, so peers learn that the bootstrapped leader is ready only
    # from its next beat. A stop before that beat must not make a follower think it leads.
    for stop_at, ids in itertools.product((820.0, 900.0, 1000.0, 1150.0), ([1, 2], [2, 1])):
        sim = make(2, compute_ms=5.0, ids=ids)   # creation order decides timer order at equal times
        sim.run_until(stop_at)
        assert sim.ranks[1].machine.ready and sim.ranks[1].machine.step > 0
        stop_all_and_settle(sim)
        assert sim.ranks[2].machine.counters["published"] == 0, stop_at
        assert len(set(digests(sim).values())) == 1, stop_at


def collect_run(rule, *, n=8, slow=False, jitter_ms=1.0, seconds=10.0):
    """Rounds/s and applied/computed buckets of an n-rank cohort (50 ms compute, one rank 10x
    slower when ``slow``), after a 3 s warm-up."""
    sim = SimCohort(seed=3)
    sim.network.set_default_link(jitter_ms=jitter_ms)
    ranks = [sim.add(k, ToyWorker(bucket_len=N_PARAMS, batch=3), ready=(k == 1), collect_rule=rule,
                     compute_ms=500.0 if slow and k == n else 50.0) for k in range(1, n + 1)]
    sim.run_until(3000)
    lead = ranks[0].machine
    s0, b0, c0 = lead.step, lead.counters["buckets_reduced"], sum(r.worker.calls for r in ranks)
    sim.run_until(3000 + seconds * 1000)
    computed = sum(r.worker.calls for r in ranks) - c0
    return (lead.step - s0) / seconds, (lead.counters["buckets_reduced"] - b0) / computed


def test_grace_rule_keeps_late_buckets_of_equally_fast_ranks_and_ignores_a_10x_straggler():
    """docs/PROTOCOL-NOTES.md note 7, end to end in virtual time (1 ms link jitter)."""
    q_rate, q_kept = collect_run("quorum")
    g_rate, g_kept = collect_run("grace")
    assert q_kept < 0.8 and g_kept > 0.99            # quorum 5 of 8: the rest were dropped
    assert g_rate > 0.97 * q_rate                     # ... for a round rate within 3 %
    g_slow, _ = collect_run("grace", slow=True)
    assert g_slow > 0.995 * g_rate                    # the straggler is not waited for


# ---------------------------------------------------------------- partitions (PROTOCOL.md, "Lineage and terms")
def leaders_since(sim, since):
    return {s for s, seq in rounds_by_sender(sim, since=since).items() if any(m["assign"] for _, m in seq)}


def settle_after_heal(sim, n):
    p = policy(n, T)
    quiet = sim.now_ms() + p.drop_ms + p.takeover_ms + p.collect_ms + 4 * p.beat_ms
    sim.run_until(quiet)
    return quiet


def test_a_healed_partition_keeps_the_majority_lineage_and_one_model():
    # 4 ranks, leader 1; {1} | {2, 3, 4} for 8 s, then heal
    sim = make(4)
    sim.run_until(3000)
    split = sim.now_ms()
    sim.network.partition([{1}, {2, 3, 4}])
    sim.run_until(split + 8000)
    minority = rounds_by_sender(sim, since=split + 2500, until=split + 8000).get(1, [])
    assert all(not m["assign"] for _, m in minority) or sim.ranks[1].machine.counters["round_no_majority"] > 0
    assert sim.ranks[1].machine.step <= max(m["step"] for _, s, _, m in entries(sim, "round", until=split) if s == 1) + 1
    majority_step = max(r.machine.step for k, r in sim.ranks.items() if k != 1)
    majority_term = max(r.machine.term for k, r in sim.ranks.items() if k != 1)
    assert majority_term == 2 and majority_step > sim.ranks[1].machine.step + 20
    heal = sim.now_ms()
    sim.network.heal()
    quiet = settle_after_heal(sim, 4)
    sim.run_until(quiet + 3000)
    assert len(leaders_since(sim, quiet)) == 1
    after = [m["step"] for _, s, _, m in entries(sim, "round", since=heal) if m["assign"]]
    assert min(after) >= majority_step - 1              # the majority is never rewound
    assert {r.machine.term for r in sim.alive()} == {majority_term}
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1


def test_one_against_one_picks_the_lowest_members_side_and_both_end_on_it():
    sim = make(2)
    sim.run_until(3000)
    sim.network.partition([{1}, {2}])
    sim.run_until(12_000)
    assert sim.ranks[2].machine.counters["takeover"] == 0 and sim.ranks[1].machine.step > 100
    sim.network.heal()
    quiet = settle_after_heal(sim, 2)
    assert leaders_since(sim, quiet) == {1} or not leaders_since(sim, quiet + 1)
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1


def _no_rewind_after_heal(sim, majority, n):
    """Heal, settle, and check the strict ``majority``'s lineage was not rewound: every round
    after the heal is at or past the step it had reached, one leader drives, one model ends."""
    floor = max(sim.ranks[k].machine.step for k in majority)
    heal = sim.now_ms()
    sim.network.heal()
    quiet = settle_after_heal(sim, n)
    sim.run_until(quiet + 2000)
    after = [m["step"] for _, s, _, m in entries(sim, "round", since=heal) if m["assign"]]
    assert after and min(after) >= floor - 1, (min(after), floor)     # the majority is never rewound
    assert len(leaders_since(sim, quiet)) == 1
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1


def test_a_leader_that_leaves_right_after_a_split_is_replaced_by_the_majority_side_only():
    # "Membership and majority", the witness: leader 1 and rank 2 are cut off from 3 and 4, and
    # 800 ms later 1 is killed (the server tells every rank it left). Rank 2, which had last
    # heard 3 and 4 within policy.drop, counted them and took over at once, as did 3 with 4:
    # two leads of one term, and at the heal the lower id (2, alone) rewound the majority by
    # 442 steps (a fault campaign). A takeover on the witness counts only members heard since.
    sim = make(4, compute_ms=10.0)
    sim.run_until(4000)
    sim.network.partition([{1, 2}, {3, 4}])
    sim.run_until(4800)
    sim.ranks[1].kill()
    sim.run_until(12_000)
    assert sim.ranks[2].machine.counters["takeover"] == 0 and not sim.ranks[2].machine.is_leader(sim.now_ms())
    assert sim.ranks[3].machine.is_leader(sim.now_ms())
    _no_rewind_after_heal(sim, {3, 4}, 3)


def test_a_rank_that_suspends_while_cut_off_does_not_bootstrap_a_lineage_of_its_own():
    # "Suspension": rank 3, cut off from {1, 2} and frozen past policy.drop, suspended and then
    # bootstrapped term 2 alone (no majority check); at the heal its term beat the majority's
    # and rewound it by 662 steps (a fault campaign). A bootstrap needs a majority of the
    # membership the rank holds, as a takeover does.
    sim = make(3, compute_ms=10.0)
    sim.run_until(3000)
    sim.network.partition([{1, 2}, {3}])
    sim.ranks[3].freeze(2500)
    sim.run_until(12_000)
    assert sim.ranks[3].machine.counters["bootstrap"] == 0 and sim.ranks[3].machine.term == 1
    _no_rewind_after_heal(sim, {1, 2}, 3)


def test_a_two_rank_cohort_whose_leader_was_frozen_trains_again_within_the_takeover_bound():
    # "Membership and majority": the leader (the lowest id) frozen 3 s came back suspended (not
    # ready) and waited for a round from its ready peer, which counted only ready members and so
    # had no majority (1 of 2, not the lowest): nobody trained for policy.forget, 60 s (a fault
    # campaign). A live member counts towards a majority whether or not it is ready.
    sim = make(2, compute_ms=10.0)
    sim.run_until(3000)
    step = sim.ranks[2].machine.step
    sim.ranks[1].freeze(3000)
    p = policy(2, T)
    sim.run_until(6000 + p.takeover_ms + p.collect_ms + 2 * p.beat_ms)
    assert all(r.machine.ready for r in sim.alive()) and sim.ranks[2].machine.step > step + 50
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1


def test_a_rank_slower_than_the_rounds_evicted_once_is_readmitted_without_a_global_batch():
    # "Flapping ranks": with no fixed global batch a rank on probation got its full share in
    # every round, not awaited; rounds ran every 10 ms, each superseding its 30 ms bucket in
    # flight, so it never delivered one and stayed on probation for good (a fault campaign).
    # It now gets probes, as under a fixed global batch, and their answers readmit it.
    sim = SimCohort(seed=0)
    for k, c in ((1, 10.0), (2, 10.0), (3, 30.0)):
        sim.add(k, ToyWorker(bucket_len=N_PARAMS, batch=3), compute_ms=c, lr=0.05)
    sim.run_until(5000)
    lead = sim.ranks[1].machine
    sim.network.partition([{1, 2}, {3}])
    sim.run_until(8000)
    sim.network.heal()
    applied = lead.applied_by.get(3, 0)
    sim.run_until(20_000)
    assert lead.flaps[3] == 1 and 3 not in lead._probation and lead.counters["readmitted"] >= 1
    assert lead.applied_by.get(3, 0) > applied + 100


def test_a_follower_cut_off_while_its_leader_holds_a_round_open_does_not_take_over():
    # "Heartbeat and takeover": a leader holding a round open for a lost bucket sends no round
    # for a collect window (2375 ms at n = 3); a follower cut off alone 2 s into it reached its
    # takeover window 1.2 s later, while the leader and rank 3, heard within policy.drop, still
    # counted as live: it took term 2 alone and at the heal rewound the majority from step 1082
    # to 520 (a fault campaign). A takeover counts only members heard a beat after the leader
    # last was, never the leader.
    sim = make(2, ids=[2, 3], compute_ms=10.0)
    sim.run_until(3000)
    sim.add(1, ToyWorker(bucket_len=N_PARAMS, batch=3), compute_ms=10.0, lr=0.05)   # follows 2
    sim.run_until(6000)
    net, r1 = sim.network, sim.ranks[1].machine
    net.set_link(1, 2, symmetric=False, loss=1.0)       # rank 1's next bucket to its leader lost
    sim.run_until(6030)
    net.set_link(1, 2, symmetric=False, loss=0.0)
    hb = r1._next_beat_ms                               # its first heartbeat past the window
    while hb <= r1.last_open_ms + policy(3, T).takeover_ms:
        hb += policy(3, T).beat_ms
    sim.run_until(hb - policy(3, T).drop_ms)
    while min(m.seen_ms for m in r1.roster.members.values()) < hb - policy(3, T).drop_ms + 1:
        sim.run_until(sim.now_ms() + 5)                  # the others heard within drop of it
    net.partition([{1}, {2, 3}])
    sim.run_until(sim.now_ms() + 6000)
    assert r1.counters["takeover"] == 0 and sim.ranks[2].machine.is_leader(sim.now_ms())
    _no_rewind_after_heal(sim, {2, 3}, 3)


def test_a_rank_whose_probe_outlasts_the_probe_interval_is_measured_and_never_silenced():
    # "Shares", probes: a rank given no share is probed at most every 250 ms, and each newer
    # probe superseded the one it was computing; a 400-ms rank answered none, was marked silent
    # 51 times a minute and never readmitted (a fault campaign). A probe is not sent while the
    # last one is younger than twice the rank's predicted one-sample turnaround.
    sim = SimCohort(seed=0)
    for k, c in ((1, 10.0), (2, 10.0), (3, 400.0)):
        sim.add(k, ToyWorker(bucket_len=N_PARAMS, batch=24), compute_ms=c, lr=0.05, global_batch=24)
    sim.run_until(30_000)
    lead = sim.ranks[1].machine
    grads = sum(1 for e in sim.network.log if e.sender == 3 and e.msg["t"] == "grad")
    assert 3 not in lead._silent and lead._silences[3] <= 1 and 3 not in lead._probation, (
        lead._silences[3], lead._probation)
    assert grads >= 50                                   # about one probe answered every 400 ms


@pytest.mark.parametrize("freeze_the_stale_rank", [False, True])
def test_a_stale_rank_never_overwrites_members_back_from_a_suspension_whose_lineage_is_ahead(freeze_the_stale_rank):
    # "Heartbeat and takeover", "Joining": rank 2 is cut off at step 220 while leader 1, 3 and 4
    # train on; 3 and 4 freeze, 1 leaves (the witness). At the heal 3 and 4 (step 520, back
    # suspended, not ready) counted towards rank 2's majority, and rank 2 took over (or
    # bootstrapped) from its step-220 parameters, which they then adopted: 300 steps rewound (a
    # review). A member not ready whose lineage is ahead is a candidate, and no rank bootstraps
    # while one is ahead of it.
    sim = make(4, compute_ms=10.0)
    sim.run_until(3000)
    sim.network.partition([{2}, {1, 3, 4}])
    sim.run_until(6000)
    sim.ranks[3].freeze(4000)
    sim.ranks[4].freeze(4000)
    sim.run_until(6100)
    sim.ranks[1].kill()
    if freeze_the_stale_rank:
        sim.ranks[2].freeze(2500)
    sim.run_until(9000)
    _no_rewind_after_heal(sim, {3, 4}, 3)


def test_a_witnessed_leader_departure_is_taken_over_within_a_fraction_of_a_beat():
    # "Membership and majority": a takeover on the witness counts only members heard since, and
    # the survivors beat at once on it, so the takeover waits for their beats (milliseconds),
    # not for their next periodic ones (a beat: 100 s at n = 1,000), and is decided when they come
    sim = make(10, compute_ms=10.0)
    sim.run_until(5000)
    lead = next(r for r in sim.alive() if r.machine.is_leader(sim.now_ms()))
    t_kill = sim.now_ms()
    lead.kill()
    sim.run_while(lambda: not any(r.machine.is_leader(sim.now_ms()) for r in sim.alive()),
                  limit_ms=t_kill + 4 * policy(10, T).beat_ms)
    assert sim.now_ms() - t_kill <= 0.25 * policy(10, T).beat_ms, sim.now_ms() - t_kill


@pytest.mark.parametrize("seed", [0, 1] + [pytest.param(s, marks=pytest.mark.sweep) for s in range(2, 8)])
def test_random_partitions_end_with_one_leader_one_model_and_no_majority_rewind(seed):
    """For random partition patterns and heal times: after the heal settles exactly one leader
    drives, the lineage of any strict majority is never rewound, and all ranks end bit-identical."""
    rng = random.Random(1000 + seed)
    n = rng.choice([3, 4, 5, 6])
    ids = list(range(1, n + 1))
    sim = make(n, seed=seed, compute_ms=15.0)
    for a, b in itertools.combinations(ids, 2):
        sim.network.set_link(a, b, delay_ms=rng.uniform(0, 5), jitter_ms=1)
    sim.run_until(2500)
    floors = []                      # (heal time, step the strict majority had reached)
    for _ in range(rng.choice([1, 2, 3])):
        sim.run_until(sim.now_ms() + rng.uniform(500, 3000))
        shuffled = ids[:]
        rng.shuffle(shuffled)
        cuts = sorted(rng.sample(range(1, n), rng.choice([1, 2]) if n > 2 else 1))
        groups = [set(shuffled[i:j]) for i, j in zip([0] + cuts, cuts + [n])]
        sim.network.partition(groups)
        sim.run_until(sim.now_ms() + rng.uniform(1000, 15_000))
        big = max(groups, key=len)
        if 2 * len(big) > n:
            floors.append((sim.now_ms(), max(sim.ranks[k].machine.step for k in big),
                           max(sim.ranks[k].machine.term for k in big)))
        sim.network.heal()
        sim.run_until(sim.now_ms() + rng.uniform(0, 4000))
    quiet = settle_after_heal(sim, n)
    sim.run_until(quiet + 3000)
    assert len(leaders_since(sim, quiet)) == 1
    for heal, floor, term in floors:
        later = [m for _, s, _, m in entries(sim, "round", since=heal + 1) if m["assign"] and m["term"] >= term]
        last_term = max((x["term"] for x in later), default=None)
        assert later and min(m["step"] for m in later if m["term"] == last_term) >= floor - 1
    terms = {r.machine.term for r in sim.alive()}
    assert len(terms) == 1
    check_updates_use_only_buckets_of_their_step(sim)
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1


def test_a_rank_awake_one_second_a_minute_does_not_stall_the_cohort():
    """A throttled rank (a background tab): evicted while asleep, and on return assigned but
    not awaited until it keeps up, so each wake-up costs the cohort no collect window."""
    sim = make(3, compute_ms=10.0)
    sim.run_until(3000)
    base0 = sim.ranks[1].machine.step
    sim.run_until(8000)
    base_rate = (sim.ranks[1].machine.step - base0) / 5.0
    t = sim.now_ms()
    s0 = sim.ranks[1].machine.step
    for k in range(4):
        sim.ranks[3].freeze(14_000)                   # asleep 14 s, awake 1 s
        sim.run_until(t + 15_000 * (k + 1))
    rate = (sim.ranks[1].machine.step - s0) / 60.0
    assert sim.ranks[1].machine.flaps[3] >= 3
    assert rate > 0.8 * base_rate, (rate, base_rate)
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1


# ---------------------------------------------------------------- shares (PROTOCOL.md, "Shares")
def hetero(speeds, *, global_batch=64, seconds=20.0, seed=5, overhead_ms=0.5, rule="grace"):
    """A cohort whose rank k computes a share of s samples in ``overhead + s / speed`` virtual
    ms (``speed`` in samples per ms); returns (applied samples/s after warm-up, sim)."""
    sim = SimCohort(seed=seed)
    sim.network.set_default_link(delay_ms=0.2, jitter_ms=0.1)
    for i, v in enumerate(speeds, 1):
        sim.add(i, ToyWorker(bucket_len=N_PARAMS, batch=global_batch), compute_ms=overhead_ms,
                ms_per_sample=1.0 / v, ready=(i == 1), collect_rule=rule, global_batch=global_batch)
    sim.run_until(4000)
    lead = sim.ranks[1].machine
    a0 = lead._applied_samples
    sim.run_until(4000 + seconds * 1000)
    return (lead._applied_samples - a0) / seconds, sim


def efficiency(speeds, **kw):
    together, sim = hetero(speeds, **kw)
    solo = sum(hetero([v], **kw)[0] for v in speeds)
    return together / solo, sim


@pytest.mark.parametrize("speeds", [(1.0, 1.0, 0.02), (1.0, 0.5, 0.25, 0.1)], ids=["tab-like", "spread4"])
def test_heterogeneous_cohorts_apply_nearly_the_sum_of_their_ranks_solo_throughput(speeds):
    eff, sim = efficiency(speeds)
    assert eff >= 0.9, eff
    shares = sim.ranks[1].machine.shares
    fast = [k for k, v in enumerate(speeds, 1) if v == max(speeds)]
    assert all(shares.get(k, 0) >= max(shares.values()) - 1 for k in fast)
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1


def test_sixteen_ranks_with_speeds_spread_twentyfold_keep_their_efficiency():
    speeds = [1.0 - 0.95 * i / 15 for i in range(16)]
    eff, _ = efficiency(speeds, global_batch=256, seconds=10.0)
    assert eff >= 0.9, eff


def test_a_tab_like_rank_never_slows_the_cohort():
    fast, _ = hetero([1.0, 1.0])
    mixed, sim = hetero([1.0, 1.0, 0.02])
    assert mixed >= 0.98 * fast, (mixed, fast)
    st = sim.ranks[1].machine.state(sim.now_ms())
    assert set(st["speeds"]) == {f"{k:08x}" for k in (1, 2, 3)}
    # every applied sample is accounted to the rank whose bucket carried it (one leader all along)
    assert sum(st["applied"].values()) == sim.ranks[1].machine._applied_samples
    assert st["applied"]["00000001"] > 0 and st["applied"]["00000002"] > 0


def test_a_tab_like_rank_whose_turnaround_jitters_still_adds_to_the_cohort():
    # "Shares", lateness: a round ends with its last bucket, so a rank late by up to 8 ms
    # (uniform) half the rounds would hold the round whenever it is late; planned to finish
    # early by its lateness, it adds its samples without holding the others (with the margin
    # removed this cohort applied ~1.02x the fast pair's samples/s, with it ~1.05x)
    def run(speeds, jitter_ms):
        sim = SimCohort(seed=5)
        sim.network.set_default_link(delay_ms=0.2, jitter_ms=0.1)
        for i, v in enumerate(speeds, 1):
            sim.add(i, ToyWorker(bucket_len=N_PARAMS, batch=64), compute_ms=0.5 if i < 3 else 2.5,
                    ms_per_sample=1.0 / v, ready=(i == 1), collect_rule="grace", global_batch=64,
                    compute_jitter_ms=jitter_ms if i == 3 else 0.0)
        sim.run_until(4000)
        a0 = sim.ranks[1].machine._applied_samples
        sim.run_until(24000)
        return (sim.ranks[1].machine._applied_samples - a0) / 20.0, sim
    fast, _ = run([1.0, 1.0], 0.0)
    mixed, sim = run([1.0, 1.0, 0.2], 8.0)
    assert mixed >= 1.035 * fast, (mixed, fast)
    lead = sim.ranks[1].machine
    assert lead.speeds.speeds[3].lateness_ms() > 1.0 and lead.state(sim.now_ms())["applied"]["00000003"] > 0


def joined_late(speeds, *, blocking, global_batch, seconds=20.0, seed=5):
    """Rank 1 trains alone for 2 s, the others join then; returns (applied samples/s over
    ``seconds`` after a 4 s settling, the leader's machine). ``blocking``: every rank handles no
    input while it computes, as a native rank's and a tab worker's event loop do."""
    sim = SimCohort(seed=seed)
    sim.network.set_default_link(delay_ms=0.2, jitter_ms=0.1)

    def add(i, v):
        sim.add(i, ToyWorker(bucket_len=N_PARAMS, batch=global_batch), compute_ms=0.5,
                ms_per_sample=1.0 / v, ready=(i == 1), collect_rule="grace",
                global_batch=global_batch, blocking_compute=blocking)
    add(1, speeds[0])
    for i, v in enumerate(speeds[1:], 2):
        sim.at(2000, lambda i=i, v=v: add(i, v))
    sim.run_until(6000)
    lead = sim.ranks[1].machine
    a0 = lead._applied_samples
    sim.run_until(6000 + seconds * 1000)
    return (lead._applied_samples - a0) / seconds, sim


@pytest.mark.parametrize("speeds,global_batch", [((1.0, 1.0), 256), ((1.0, 1.0, 0.02), 64),
                                                 ((1.0, 0.5, 0.25, 0.1), 64)],
                         ids=["pair", "tab-like", "spread4"])
def test_ranks_that_join_a_leader_busy_computing_still_get_their_share(speeds, global_batch):
    # "Shares", a bucket that queued behind the leader's own compute: a leader handles nothing
    # while its job computes, so a faster-than-planned rank's bucket is handled when the
    # leader's own is, and measured as slow as the leader. Without the credit a rank joining a
    # running leader stayed at its probe share for good (an equal pair: 32 of 256 samples, the
    # cohort at 0.57 of the same ranks that handle inputs while computing; tab-like 0.56)
    free, _ = joined_late(speeds, blocking=False, global_batch=global_batch)
    busy, sim = joined_late(speeds, blocking=True, global_batch=global_batch)
    assert busy >= 0.85 * free, (busy, free)
    lead = sim.ranks[1].machine
    assert lead.counters["turnaround_censored"] > 0
    shares = lead.shares
    assert shares.get(2, 0) >= 0.8 * shares[1] * speeds[1] / speeds[0], shares
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1


def check_round_windows(sim):
    """Every round's shares cover consecutive sample indices from its cursor, once each."""
    n = 0
    for _, _, _, m in entries(sim, "round"):
        if not m["assign"]:
            continue
        spans = sorted((m["assign"][k], m["shares"][k]) for k in m["assign"])
        pos = m["cursor"] % 2**32
        for off, sh in spans:
            assert off == pos, m
            pos = (pos + sh) % 2**32
        n += 1
    return n


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_heterogeneous_cohort_with_joins_leaves_kills_and_a_20x_speed_change_keeps_invariants(seed):
    rng = random.Random(seed)
    sim = SimCohort(seed=seed)
    sim.network.set_default_link(delay_ms=1.0, jitter_ms=0.5)
    speeds = {1: 1.0, 2: 0.5, 3: 0.1, 4: 0.05}
    for k, v in speeds.items():
        sim.add(k, ToyWorker(bucket_len=N_PARAMS, batch=24), compute_ms=1.0, ms_per_sample=1.0 / v,
                collect_rule=rng.choice(["grace", "quorum"]), global_batch=48, lr=0.05)
    sim.run_until(3000)
    sim.ranks[2].ms_per_sample = 20.0 / speeds[2]                 # 20x slower mid-run
    sim.run_until(6000)
    sim.add(9, ToyWorker(bucket_len=N_PARAMS, batch=24), compute_ms=1.0, ms_per_sample=0.5,
            global_batch=48, lr=0.05)                               # a join
    sim.run_until(8000)
    sim.ranks[4].stop()                                            # a leave
    leader = next(r for r in sim.alive() if r.machine.looping)
    sim.at(9000, leader.kill)                                      # a leader kill
    sim.run_until(16_000)
    sim.ranks[2].ms_per_sample = 1.0 / speeds[2]                   # and 20x faster again
    sim.run_until(20_000)
    assert check_round_windows(sim) > 50
    assert check_updates_use_only_buckets_of_their_step(sim) > 20
    steps = [r.machine.step for r in sim.alive()]
    assert min(steps) > 50
    stop_all_and_settle(sim)
    assert len(set(digests(sim).values())) == 1
