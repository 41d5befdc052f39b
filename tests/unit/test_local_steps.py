"""Local steps and the leader's optimizer state (docs/PROTOCOL.md, "Local steps and optimizer
state"): the pure core with explicit time, and the workers' inner steps."""

from __future__ import annotations

import math

import pytest

from tabcohort.errors import ConfigError, LocalProtocolError
from tabcohort.model.toy import ToyWorker
from tabcohort.protocol import Compute
from tabcohort.protocol.optim import TrainConfig, outer_step
from tabcohort.vec import digest, to_vector

from ._drive import drive
from .machine_helpers import beat, grad, hello, rig, round_msg

NESTEROV = TrainConfig(local_steps=4, outer_optimizer="nesterov", inner_lr=0.05)


def _bucket(k: int, n: int = 4) -> list[float]:
    """A deterministic pseudo-gradient for round k."""
    return [((k * 7 + j * 3) % 11) / 11.0 - 0.4 for j in range(n)]


def _run_alone(r, rounds: int, now: float) -> float:
    """Let a lone leader drive ``rounds`` rounds, feeding bucket k for round k."""
    for _ in range(rounds):
        acts = r.drain()
        comps = r.computes(acts)
        assert len(comps) == 1, acts
        c = comps[0]
        r.m.bucket_ready(c.token, 1.0, to_vector(_bucket(c.step)), now_ms=now)
        now += 1.0
        r.m.on_timer(now_ms=now)          # the yield between rounds: the next round is driven
    return now


def test_train_config_errors_name_the_option_and_value():
    for kw, name in (({"local_steps": 0}, "--local-steps"), ({"local_steps": 2.5}, "--local-steps"),
                     ({"inner_optimizer": "lion"}, "--inner-optimizer"), ({"inner_lr": -1.0}, "--inner-lr"),
                     ({"inner_lr": math.nan}, "--inner-lr"), ({"outer_optimizer": "adamw"}, "--outer-optimizer"),
                     ({"outer_momentum": 1.0}, "--outer-momentum")):
        with pytest.raises(ConfigError) as e:
            TrainConfig(**kw)
        assert e.value.variable == name and repr(list(kw.values())[0]) in str(e.value)
    assert TrainConfig().spec() is None            # the default keeps the job hash it had
    assert NESTEROV.spec()["local_steps"] == 4 and NESTEROV.state_len(10) == 10
    assert TrainConfig(local_steps=4).state_len(10) == 0


def test_outer_nesterov_step_is_pytorch_nesterov_rounded_once():
    p, d, m = ([float(x) for x in to_vector(v)] for v in ([1.0, -2.0, 0.5], [0.1, 0.2, -0.3], [0.5, 0.0, 1.0]))
    p2, m2 = outer_step(to_vector(p), to_vector(d), 0.7, to_vector(m), 0.9)
    want_m = [0.9 * a + b for a, b in zip(m, d)]
    want_p = [a - 0.7 * (b + 0.9 * float(to_vector([c])[0])) for a, b, c in zip(p, d, want_m)]
    assert digest(m2) == digest(to_vector(want_m)) and digest(p2) == digest(to_vector(want_p))
    # the first step starts from zero momentum
    p3, m3 = outer_step(to_vector(p), to_vector(d), 0.7, None, 0.9)
    assert digest(m3) == digest(to_vector(d))


def test_a_round_covers_h_inner_batches_and_the_cursor_advances_by_h_times_the_global_batch():
    r = rig(1, ready=True, global_batch=8, train=NESTEROV, batch=4)
    r.m.handle(hello(2, ready=True, batch=4), now_ms=1)
    r.m.start(now_ms=2)
    rd = r.posts(t="round")[0]
    assert rd["shares"] == {1: 4, 2: 4}
    assert rd["assign"] == {1: 0, 2: 16}            # each window is H x share samples
    assert r.m.cursor == 4 * 8
    assert len(rd["opt"]) == 4                       # the momentum travels with the round
    # a follower continues the cursor by H x the round's samples
    f = rig(2, train=NESTEROV)
    f.m.start(now_ms=0)
    f.m.handle(hello(1, ready=True), now_ms=1)
    f.m.handle(round_msg(1, 0, assign={1: 0, 2: 16}, shares={1: 4, 2: 4}, cursor=32), now_ms=2)
    assert f.m.cursor == 32 + 4 * 8
    comps = f.computes(f.drain())
    assert [(c.offset, c.samples, c.local_steps, c.inner_optimizer, c.inner_lr) for c in comps] == [
        (16, 4, 4, "sgd", 0.05)]


def test_a_bucket_must_cover_h_times_its_share():
    r = rig(1, ready=True, global_batch=8, train=NESTEROV, batch=4)
    r.m.handle(hello(2, ready=True, batch=4), now_ms=1)
    r.m.start(now_ms=2)
    r.drain()
    r.m.handle(grad(2, 1, 0, samples=4), now_ms=3)       # one inner batch's share: dropped
    assert r.m.drops["grad_bad_samples"] == 1
    r2 = rig(1, ready=True, global_batch=8, train=NESTEROV, batch=4)
    r2.m.handle(hello(2, ready=True, batch=4), now_ms=1)
    r2.m.start(now_ms=2)
    r2.drain()
    r2.m.handle(grad(2, 1, 0, samples=16), now_ms=3)     # H x share: accepted
    assert r2.m.drops["grad_bad_samples"] == 0 and 2 in r2.m._collection.received


def _leader_after(rounds: int):
    a = rig(2, ready=True, train=NESTEROV, lr=0.7)
    a.m.start(now_ms=0)
    now = _run_alone(a, rounds, 1.0)
    return a, now


def test_a_new_leaders_first_outer_step_uses_the_carried_momentum_exactly():
    # the uninterrupted run: the leader drives 6 rounds; the 7th round's message carries
    # (p_6, m_6); it then applies bucket 6
    a, now = _leader_after(6)
    acts = a.drain()
    rd = [x.msg for x in acts if hasattr(x, "msg") and x.msg["t"] == "round"][-1]
    own = a.computes(acts)[0]
    assert rd["step"] == 6 and len(rd["opt"]) == 4 and any(v != 0 for v in rd["opt"])
    a.m.bucket_ready(own.token, 1.0, to_vector(_bucket(6)), now_ms=now)
    want_p, want_m = digest(a.m.worker.params()), digest(a.m.optimizer_state())

    def take_over(round_seen):
        b = rig(1, train=NESTEROV, lr=0.7)
        b.m.start(now_ms=0)
        b.m.handle(hello(2, ready=True), now_ms=1)
        b.m.handle(round_seen, now_ms=2)
        b.m.peer_left(2, now_ms=3)                   # the leader was killed: the witness says so
        t = 3.0
        while not b.m.is_leader(t):
            t += 100.0
            b.m.on_timer(now_ms=t)
        comps = b.computes(b.drain())
        assert len(comps) == 1 and comps[0].step == 6
        b.m.bucket_ready(comps[0].token, 1.0, to_vector(_bucket(6)), now_ms=t + 1)
        return digest(b.m.worker.params()), digest(b.m.optimizer_state())

    assert take_over(rd) == (want_p, want_m)
    # without the carried state the new leader's step is a different one (the test can fail)
    bare = {k: v for k, v in rd.items() if k != "opt"}
    assert take_over(bare) != (want_p, want_m)


def test_a_round_with_non_finite_or_wrong_length_state_is_dropped():
    f = rig(2, train=NESTEROV)
    f.m.start(now_ms=0)
    f.m.handle(hello(1, ready=True), now_ms=1)
    bad = round_msg(1, 0)
    bad["opt"] = to_vector([0.0, math.nan, 0.0, 0.0])
    f.m.handle(bad, now_ms=2)
    assert f.m.drops["round_non_finite"] == 1 and not f.m.ready
    short = round_msg(1, 0)
    short["opt"] = to_vector([0.0, 0.0])
    f.m.handle(short, now_ms=3)
    assert f.m.drops["round_bad_state_length"] == 1 and not f.m.ready
    ok = round_msg(1, 0)
    ok["opt"] = to_vector([0.5, 0.0, 0.0, 0.0])
    f.m.handle(ok, now_ms=4)
    assert f.m.ready and digest(f.m.optimizer_state()) == digest(to_vector([0.5, 0.0, 0.0, 0.0]))
    with pytest.raises(LocalProtocolError):
        rig(3, train=NESTEROV, opt_state=to_vector([math.inf] * 4))


def test_the_leader_holds_its_state_at_the_wire_precision():
    r = rig(2, ready=True, train=NESTEROV, lr=0.7)
    r.link.quantizer = lambda v: to_vector([round(float(x), 2) for x in v])
    r.m.start(now_ms=0)
    _run_alone(r, 3, 1.0)
    st = r.m.optimizer_state()
    assert digest(st) == digest(to_vector([round(float(x), 2) for x in st]))
    assert any(abs(float(x)) > 0 for x in st)


def test_a_diverging_outer_step_keeps_params_and_state():
    r = rig(2, ready=True, train=NESTEROV, lr=0.7)
    r.m.start(now_ms=0)
    now = _run_alone(r, 2, 1.0)
    p0, m0 = digest(r.m.worker.params()), digest(r.m.optimizer_state())
    c = r.computes(r.drain())[0]
    r.m.bucket_ready(c.token, 1.0, to_vector([3e38] * 4), now_ms=now)   # overflows float32
    assert r.m.diverged == 1
    assert (digest(r.m.worker.params()), digest(r.m.optimizer_state())) == (p0, m0)


def test_clipping_bounds_a_poisoned_pseudo_gradient():
    r = rig(1, ready=True, global_batch=12, train=NESTEROV, lr=0.7, aggregate="clip")
    for k in (2, 3):
        r.m.handle(hello(k, ready=True), now_ms=1)
    r.m.start(now_ms=2)
    acts = r.drain()
    own = r.computes(acts)[0]
    shares = r.posts(acts, "round")[0]["shares"]
    r.m.handle(grad(2, 1, 0, g=[0.01] * 4, samples=4 * shares[2]), now_ms=3)
    r.m.handle(grad(3, 1, 0, g=[1e6] * 4, samples=4 * shares[3]), now_ms=3)
    r.m.bucket_ready(own.token, 1.0, to_vector([0.01] * 4), now_ms=4)
    assert r.m.counters["buckets_clipped"] == 1 and r.m.step == 1
    assert max(abs(float(x)) for x in r.m.worker.params()) < 1.0


def test_a_superseded_contribution_is_abandoned_and_the_next_one_starts():
    f = rig(2, train=NESTEROV)
    f.m.start(now_ms=0)
    f.m.handle(hello(1, ready=True), now_ms=1)
    f.m.handle(round_msg(1, 0, assign={2: 0}, shares={2: 2}), now_ms=2)
    c0 = f.computes(f.drain())[0]
    assert f.m.compute_current(c0.token)
    f.m.handle(round_msg(1, 1, assign={2: 8}, shares={2: 2}), now_ms=3)
    assert not f.m.compute_current(c0.token)
    assert f.computes(f.drain()) == []              # one bucket in flight per rank
    f.m.bucket_abandoned(c0.token, now_ms=4)
    c1 = f.computes(f.drain())
    assert [c.offset for c in c1] == [8] and f.m.counters["abandoned_bucket"] == 1


def test_work_superseded_only_by_rounds_without_a_share_for_the_rank_finishes_and_is_sent():
    # PROTOCOL.md "Local steps and optimizer state": a slow rank's probe must finish to be measured
    f = rig(2, train=NESTEROV)
    f.m.start(now_ms=0)
    f.m.handle(hello(1, ready=True), now_ms=1)
    f.m.handle(round_msg(1, 0, assign={2: 0}, shares={2: 2}), now_ms=2)
    c0 = f.computes(f.drain())[0]
    for step in (1, 2, 3):                          # the fast cohort goes on without rank 2
        f.m.handle(round_msg(1, step, assign={1: 8 * step}, shares={1: 2}), now_ms=2 + step)
        assert f.m.compute_current(c0.token)
    f.drain()
    f.m.bucket_ready(c0.token, 0.5, [0.1] * 4, now_ms=9)
    sent = [p for p in f.posts(f.drain(), "grad")]
    assert len(sent) == 1 and sent[0]["step"] == 0 and f.m.counters["stale_bucket_sent"] == 1


# --------------------------------------------------------------------- workers
def test_inner_steps_agree_across_backends_and_leave_the_workers_parameters_alone():
    from tabcohort._compat import np
    from tabcohort.model import load_dataset, make_worker

    ds = load_dataset("synthetic")
    backends = ["python"] + (["numpy"] if np is not None else [])   # a tab may have no numpy
    for opt in ("sgd", "adam"):
        got = {}
        for b in backends:
            w = make_worker(ds, backend=b, batch=16)
            p0 = digest(w.params())
            loss, d = w.local_grads_sync(5, 8, 3, opt, 0.1)
            assert digest(w.params()) == p0 and max(abs(float(x)) for x in d) > 0
            got[b] = (round(loss, 9), digest(d))
        assert len(set(got.values())) == 1, got
    # one SGD step's pseudo-gradient is lr x the gradient
    _, g = w.grads_sync(5, 8)
    _, d1 = w.local_grads_sync(5, 8, 1, "sgd", 0.5)
    assert max(abs(float(a) - 0.5 * float(b)) for a, b in zip(d1, g)) < 1e-7


def test_inner_steps_are_sliced_and_a_superseded_computation_stops():
    from tabcohort.model import load_dataset, make_worker

    w = ToyWorker(bucket_len=4, batch=2)
    full, n_yields = drive(w.local_grads(0, 2, 8, "sgd", 0.1))
    assert full is not None and n_yields >= 7            # control back between every inner step
    assert digest(full[1]) == digest(w.local_grads_sync(0, 2, 8, "sgd", 0.1)[1])
    left = [3]

    def stop():
        left[0] -= 1
        return left[0] < 0
    cut, n_cut = drive(w.local_grads(0, 2, 8, "sgd", 0.1, should_stop=stop))
    assert cut is None and n_cut < n_yields              # abandoned between inner steps
    # an MLP's inner steps are sliced within a step too (the backend's own slices)
    m = make_worker(load_dataset("synthetic"), backend="python", batch=64)
    _, n_mlp = drive(m.local_grads(0, 64, 2, "sgd", 0.1))
    assert n_mlp > 1 + 2 * ((64 - 1) // m.yield_every) - 1


def test_the_checkpoint_carries_the_state_and_a_resumed_leader_starts_from_it():
    from tabcohort.runtime.session import checkpoint_body, load_checkpoint

    a, _ = _leader_after(5)
    data, sha = checkpoint_body(a.m, a.w)
    assert len(data) == 4 * (4 + 4)                 # parameters, then as much momentum
    b = rig(2, ready=True, train=NESTEROV, lr=0.7)
    step, state = load_checkpoint(b.w, data, {"X-Tabcohort-Digest": sha, "X-Tabcohort-Step": "5"}, state_len=4)
    assert step == 5 and digest(b.w.params()) == digest(a.w.params())
    resumed = rig(2, ready=True, train=NESTEROV, lr=0.7, opt_state=state)
    resumed.w.set_params(b.w.params())
    resumed.m.start(now_ms=0)
    rd = resumed.posts(t="round")[0]
    assert digest(rd["opt"]) == digest(a.m.optimizer_state())
    # a diverged state is never uploaded
    a.m.opt_state = to_vector([math.nan] * 4)
    assert checkpoint_body(a.m, a.w) is None


def test_options_take_diloco_defaults_for_local_steps_and_name_bad_values():
    from tabcohort.protocol.optim import from_options

    assert from_options() == (TrainConfig(), 0.5)                       # H = 1: as before
    cfg, lr = from_options(local_steps=16)
    assert (cfg.outer_optimizer, cfg.outer_momentum, lr, cfg.inner_lr) == ("nesterov", 0.9, 0.7, 0.1)
    assert from_options(local_steps=4, inner_optimizer="adam")[0].inner_lr == 0.001
    assert from_options(local_steps=4, lr=0.3)[1] == 0.3 and from_options(outer_lr=0.2)[1] == 0.2
    assert from_options(local_steps=4, lr=0.2, outer_lr=0.2)[1] == 0.2
    # (settings that do nothing were accepted in silence: inner ones at H = 1, momentum for SGD)
    for kw, name in (({"outer_lr": 0.0}, "--outer-lr"), ({"lr": math.inf}, "--lr"),
                     ({"local_steps": 5000}, "--local-steps"), ({"inner_optimizer": "adam"}, "--inner-optimizer"),
                     ({"inner_lr": 0.1}, "--inner-lr"), ({"outer_momentum": 0.5}, "--outer-momentum"),
                     ({"local_steps": 4, "outer_optimizer": "sgd", "outer_momentum": 0.5}, "--outer-momentum"),
                     # (--lr is the round's lr too: it was silently ignored beside --outer-lr)
                     ({"local_steps": 4, "lr": 0.3, "outer_lr": 0.5}, "--outer-lr")):
        with pytest.raises(ConfigError) as e:
            from_options(**kw)
        assert e.value.variable == name


def test_synchronous_nesterov_carries_its_momentum_too():
    sync = TrainConfig(outer_optimizer="nesterov")
    r = rig(2, ready=True, train=sync, lr=0.1)
    r.m.start(now_ms=0)
    now = _run_alone(r, 3, 1.0)
    assert {c.local_steps for c in r.computes(r.out)} == {1}         # the plain gradient
    rd = r.posts(r.drain(), "round")[-1]
    p0 = [0.0] * 4                                                    # the toy's init
    m = None
    for k in range(3):                                                # replay the three steps
        p0, m = outer_step(to_vector(p0), to_vector(_bucket(k)), 0.1, m, 0.9)
    assert digest(rd["params"]) == digest(p0) and digest(rd["opt"]) == digest(m) and now > 0


def _follow_slow_rounds(train, round_every_ms: float, rounds: int, *, then_silent_ms: float,
                        compute_ms: float = 5000.0):
    """A follower (id 1) of a leader (id 2) whose rounds come every ``round_every_ms`` and whose
    beats keep coming; the follower's own bucket takes ``compute_ms``; after ``rounds`` rounds
    the leader sends beats only. Returns when the follower took over, or None."""
    f = rig(1, train=train)
    f.m.start(now_ms=0)
    f.m.handle(hello(2, ready=True), now_ms=1)
    t, step, takeover_at, due = 2.0, 0, None, []
    end = round_every_ms * (rounds - 1) + then_silent_ms
    while t <= end and takeover_at is None:
        if step < rounds and t >= 2.0 + step * round_every_ms:
            f.m.handle(round_msg(2, step, assign={1: 0}, shares={1: 2}), now_ms=t)
            step += 1
        f.m.handle(beat(2, step=max(0, step - 1), term=1), now_ms=t)
        for c in f.computes(f.drain()):
            due.append((t + compute_ms, c.token))
        for when, token in [d for d in due if d[0] <= t]:
            due.remove((when, token))
            f.m.bucket_ready(token, 1.0, to_vector([0.0] * 4), now_ms=t)
        f.m.on_timer(now_ms=t)
        if f.m.counters["takeover"]:
            takeover_at = t
        t += 100.0
    return takeover_at


def test_with_local_steps_the_takeover_window_grows_by_the_observed_round_period():
    # rounds every 6 s (H inner steps of a slow rank) are slower than the 3.2 s takeover window
    assert _follow_slow_rounds(TrainConfig(), 6000.0, 4, then_silent_ms=4000.0) is not None
    assert _follow_slow_rounds(NESTEROV, 6000.0, 4, then_silent_ms=9000.0) is None
    # a leader that stops sending rounds is still replaced: one round period past the window
    t = _follow_slow_rounds(NESTEROV, 6000.0, 4, then_silent_ms=20000.0)
    last_round = 2.0 + 3 * 6000.0
    assert t is not None and last_round + 3200 + 6000 < t <= last_round + 3200 + 6000 + 1000, t
    # before a second round, the follower's own H steps tell how long a round takes
    assert _follow_slow_rounds(NESTEROV, 6000.0, 2, then_silent_ms=4000.0, compute_ms=5000.0) is None
