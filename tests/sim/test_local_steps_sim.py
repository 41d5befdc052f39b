"""Local steps in the seeded simulation (docs/PROTOCOL.md, "Local steps and optimizer state"):
H = 16 inner steps, DiLoCo's Nesterov outer step, and leader kills. Invariants are read from
the in-memory network's own delivery log."""

from __future__ import annotations

import math

from tabcohort.model.toy import ToyWorker
from tabcohort.protocol.optim import TrainConfig
from tabcohort.runtime.sim import SimCohort
from tabcohort.vec import digest

H = 16
MU = 0.9
TRAIN = TrainConfig(local_steps=H, outer_optimizer="nesterov", outer_momentum=MU, inner_lr=0.05)
N_PARAMS = 6


def make(seed: int) -> SimCohort:
    sim = SimCohort(seed=seed)
    for k in range(1, 6):
        sim.add(k, ToyWorker(bucket_len=N_PARAMS, batch=4), compute_ms=5.0, ms_per_sample=0.2, lr=0.7,
                global_batch=16, train=TRAIN)
    return sim


def leader(sim):
    ls = [r for r in sim.alive() if r.machine.is_leader(sim.now_ms())]
    assert len(ls) == 1, [r.id for r in ls]
    return ls[0]


def rounds(sim):
    seen = {}
    for when, sender, _, msg in sim.network.log:
        if msg["t"] == "round":
            seen.setdefault((msg["term"], msg["step"], sender), (when, msg))
    return seen


def stop_and_settle(sim):
    for r in sim.alive():
        r.stop()
    sim.run_while(lambda: any(r.machine.looping for r in sim.alive()), limit_ms=sim.now_ms() + 10_000)
    sim.run_until(sim.now_ms() + 1000)


def test_h16_nesterov_with_leader_kills_carries_the_momentum_and_ends_bit_identical():
    sim = make(seed=3)
    sim.run_until(4000)
    steps = []
    for _ in range(2):
        steps.append(leader(sim).machine.step)
        leader(sim).kill()
        sim.run_until(sim.now_ms() + 8000)
    steps.append(leader(sim).machine.step)
    assert steps[0] > 20 and steps[1] > steps[0] + 20 and steps[2] > steps[1] + 20, steps
    stop_and_settle(sim)

    seen = rounds(sim)
    by_step: dict[int, list[dict]] = {}
    for (term, step, sender), (_, msg) in seen.items():
        by_step.setdefault(step, []).append(msg)
    terms = sorted({t for t, _, _ in seen})
    assert len(terms) == 3, terms
    # 1. a new term's first round resumes exactly from a round of the old term: the same
    #    parameters AND the same optimizer state (the momentum travelled with the round)
    for term in terms[1:]:
        first_step = min(s for t, s, _ in seen if t == term)
        first = next(m for (t, s, _), (_, m) in seen.items() if t == term and s == first_step)
        olds = [m for m in by_step[first_step] if m["term"] < term]
        assert any(digest(m["params"]) == digest(first["params"]) and digest(m["opt"]) == digest(first["opt"])
                   for m in olds), f"term {term} did not resume from a carried state"
        assert max(abs(float(x)) for x in first["opt"]) > 0
    # 2. every outer step, across leader changes included, is Nesterov from the previous
    #    round's carried state: m1 = mu m0 + d and p1 = p0 - lr (d + mu m1)
    checked = 0
    for step in sorted(by_step):
        for m1 in by_step[step]:
            for m0 in by_step.get(step - 1, []):
                if m0["term"] > m1["term"]:
                    continue
                d = [float(a) - MU * float(b) for a, b in zip(m1["opt"], m0["opt"])]
                want = [float(p) - m0["lr"] * (di + MU * float(m)) for p, di, m in zip(m0["params"], d, m1["opt"])]
                if all(abs(a - float(b)) <= 1e-5 for a, b in zip(want, m1["params"])):
                    checked += 1
                    break
            else:
                continue
            break
    assert checked >= steps[2] - 5, (checked, steps)
    # 3. a round's windows are H inner batches of each share; buckets cover H x share
    for (term, step, sender), (_, msg) in seen.items():
        if not msg["assign"]:
            continue
        off = msg["cursor"]
        for k in sorted(msg["assign"]):
            assert msg["assign"][k] == off % (1 << 32)
            off += H * msg["shares"][k]
    for _, sender, recipient, msg in sim.network.log:
        if msg["t"] == "grad":
            rd = seen.get((msg["term"], msg["step"], recipient))
            if rd is not None and sender in rd[1]["shares"]:
                assert msg["samples"] == H * rd[1]["shares"][sender]
    # 4. every survivor holds the same parameters and the same optimizer state
    alive = sim.alive()
    assert len({digest(r.worker.params()) for r in alive}) == 1
    assert len({digest(r.machine.optimizer_state()) for r in alive}) == 1
    # 5. and the run reaches the accuracy of an uninterrupted run of the same length
    calm = make(seed=3)
    calm.run_until(sim.now_ms())
    stop_and_settle(calm)
    acc = alive[0].worker.evaluate()
    calm_acc = calm.alive()[0].worker.evaluate()
    assert acc >= calm_acc - 0.01 and math.isfinite(acc), (acc, calm_acc)


def test_h1_default_rounds_carry_no_state():
    sim = SimCohort(seed=1)
    for k in (1, 2, 3):
        sim.add(k, ToyWorker(bucket_len=N_PARAMS, batch=4), lr=0.05, global_batch=12)
    sim.run_until(2000)
    msgs = [m for _, _, _, m in sim.network.log if m["t"] == "round"]
    assert msgs and all("opt" not in m for m in msgs)     # an empty state decodes as absent
    assert all(r.machine.optimizer_state() is None for r in sim.alive())


def test_adam_inner_steps_train_and_end_bit_identical():
    train = TrainConfig(local_steps=8, inner_optimizer="adam", inner_lr=0.01, outer_optimizer="nesterov")
    sim = SimCohort(seed=2)
    for k in (1, 2, 3):
        sim.add(k, ToyWorker(bucket_len=N_PARAMS, batch=4), compute_ms=5.0, lr=0.7, global_batch=12, train=train)
    sim.run_until(6000)
    start = ToyWorker(bucket_len=N_PARAMS, batch=4).evaluate()
    assert leader(sim).machine.step > 20
    stop_and_settle(sim)
    alive = sim.alive()
    assert len({digest(r.worker.params()) for r in alive}) == 1
    assert alive[0].worker.evaluate() > start + 0.2, (start, alive[0].worker.evaluate())
