"""Single-process sanity training: the defaults in DIGITS_DEFAULTS reach 95 % held-out accuracy
on digits within the stated number of steps (plain SGD, no cohort)."""

from __future__ import annotations

import time

import pytest

from tabcohort.model import DIGITS_DEFAULTS, load_dataset, make_worker



@pytest.mark.needs_numpy
@pytest.mark.parametrize("seed", [0, 1])
def test_digits_reaches_95_percent(seed):
    pytest.importorskip("sklearn")
    d = DIGITS_DEFAULTS
    ds = load_dataset("digits", seed=seed)
    w = make_worker(ds, hidden=d["hidden"], batch=d["batch"], seed=seed, backend="numpy")
    t0 = time.perf_counter()
    reached = None
    for step in range(d["steps"]):
        _, g = w.grads_sync(step * w.batch)
        w.apply(g, d["lr"])
        if step % 10 == 9 and w.evaluate() >= 0.95:
            reached = step + 1
            break
    assert reached is not None, f"accuracy {w.evaluate():.3f} after {d['steps']} steps"
    assert time.perf_counter() - t0 < 10.0


def test_python_backend_learns_synthetic():
    ds = load_dataset("synthetic", seed=0)
    w = make_worker(ds, hidden=(16,), batch=32, backend="python")
    for step in range(80):
        _, g = w.grads_sync(step * w.batch)
        w.apply(g, 0.5)
    assert w.evaluate() >= 0.95
