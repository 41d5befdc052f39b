"""The MLP worker contract on the pure-Python backend (runs without numpy and without an event
loop: coroutines are driven by hand, see _drive.py). PROTOCOL.md, "Worker contract"."""

from __future__ import annotations

import asyncio
import hashlib
import math
from array import array

import pytest

from tabcohort.errors import ConfigError, LocalProtocolError
from tabcohort.model import PythonMLPWorker, load_dataset, make_worker
from tabcohort.model.backend_py import loss_and_grad
from tabcohort.model.mlp import MLPSpec, init_params

from ._drive import drive

# sha256 of the float32 bytes of init_params(MLPSpec((64, 32, 10), act), seed=0): pins the init
# across Python versions and platforms (it uses only random.random, +, -, * and sqrt).
INIT_SHA256 = {
    "relu": "11c71d940cb2d49e2282a5657cef11be95786e0bf5c4d2f999ee9071dfd6090b",
    "tanh": "f305216279cc5e080900e313509c1adeeccd6d2aeece2107e290a61fa9010e7b",
}


@pytest.fixture(scope="module")
def small() -> object:
    """A tiny dataset: 5 features, 3 classes (finite differences over every parameter)."""
    return load_dataset("synthetic", seed=1, n_samples=60, n_features=5, n_classes=3)


@pytest.fixture(scope="module")
def synth() -> object:
    return load_dataset("synthetic", seed=0)


def _rel(a, b) -> float:
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    den = math.sqrt(sum(y * y for y in b))
    return num / den


# -- model shape and init -------------------------------------------------------------------

def test_spec_name_and_bucket_len(synth):
    w = PythonMLPWorker(synth, hidden=(32,), batch=8)
    assert w.backend == "python" and w.batch == 8
    assert w.model == "mlp-16x32x4"
    assert w.bucket_len == 16 * 32 + 32 + 32 * 4 + 4 == len(w.params())
    spec = w.spec()
    assert spec["layers"] == [16, 32, 4] and spec["activation"] == "relu"
    assert spec["bucket_len"] == w.bucket_len and spec["name"] == w.model
    t = PythonMLPWorker(synth, hidden=(8, 6), activation="tanh")
    assert t.model == "mlp-16x8x6x4-tanh" and t.spec()["activation"] == "tanh"
    assert PythonMLPWorker(synth, hidden=()).model == "mlp-16x4"


@pytest.mark.parametrize("act", ["relu", "tanh"])
def test_init_is_pinned_and_seeded(act):
    spec = MLPSpec((64, 32, 10), act)
    p = init_params(spec, 0)
    assert p.typecode == "f" and len(p) == spec.param_count == 2410
    assert hashlib.sha256(p.tobytes()).hexdigest() == INIT_SHA256[act]
    assert init_params(spec, 0) == p
    assert init_params(spec, 1) != p
    # Biases start at zero; weights within the He / Glorot bound.
    w_off, b_off, n_in, n_out = spec.offsets()[0]
    assert list(p[b_off:b_off + n_out]) == [0.0] * n_out
    bound = math.sqrt(6 / n_in) if act == "relu" else math.sqrt(6 / (n_in + n_out))
    assert max(abs(v) for v in p[w_off:b_off]) <= bound


def test_workers_with_one_seed_hold_identical_params(synth):
    a = make_worker(synth, seed=5, backend="python")
    b = make_worker(synth, seed=5, backend="python", batch=3)
    assert a.params() == b.params()
    assert make_worker(synth, seed=6, backend="python").params() != a.params()


# -- grads ----------------------------------------------------------------------------------

def test_grads_yields_in_slices_and_equals_grads_sync(synth):
    w = PythonMLPWorker(synth, batch=10, yield_every=3)
    (loss, g), n_yields = drive(w.grads(17))
    assert n_yields == 3  # slices of 3, 3, 3, 1 samples: a yield between each
    loss2, g2 = w.grads_sync(17)
    assert loss == loss2 and g == g2
    assert isinstance(g, array) and g.typecode == "f" and len(g) == w.bucket_len
    assert isinstance(loss, float) and loss > 0


def test_grads_uses_the_params_it_started_with(synth):
    w = PythonMLPWorker(synth, batch=6, yield_every=2)
    expected = w.grads_sync(4)
    coro = w.grads(4)
    coro.send(None)  # first slice done
    w.set_params([0.0] * w.bucket_len)
    (result, _) = drive(coro)
    assert result == expected


def test_default_slice_is_a_few_samples_for_digits_sized_model(synth):
    from tabcohort.model.data import Dataset
    ds = Dataset("d", 64, 10, 0, array("f", [0.0] * 64 * 2), array("i", [0, 1]),
                 array("f", [0.0] * 64), array("i", [0]))
    w = PythonMLPWorker(ds, hidden=(32,), batch=32)
    assert 1 <= w.yield_every <= 5
    _, n_yields = drive(w.grads(0))
    assert n_yields == math.ceil(32 / w.yield_every) - 1


@pytest.mark.needs_loop
def test_grads_runs_under_an_event_loop(synth):
    w = PythonMLPWorker(synth, batch=6, yield_every=2)
    loss, g = asyncio.run(w.grads(0))
    assert (loss, g) == w.grads_sync(0)


def test_offset_indexes_train_modulo_its_length(synth):
    w = PythonMLPWorker(synth, batch=5)
    n = synth.train_len
    assert w.grads_sync(3) == w.grads_sync(3 + n) == w.grads_sync(3 + 7 * n)
    # A window that wraps: the mean of the rows at the end and at the start.
    xs, ys = zip(*(synth.row(i) for i in (n - 2, n - 1, 0, 1, 2)))
    loss, g = loss_and_grad(w.mlp, w.params().tolist(), xs, ys)
    wl, wg = w.grads_sync(n - 2)
    assert wl == pytest.approx(loss, rel=1e-12)
    assert wg == array("f", g)
    with pytest.raises(LocalProtocolError, match="offset"):
        w.grads_sync(1.5)


def test_grads_is_the_mean_over_the_window(synth):
    w = PythonMLPWorker(synth, batch=4)
    parts = [PythonMLPWorker(synth, batch=1).grads_sync(k) for k in range(10, 14)]
    loss, g = w.grads_sync(10)
    assert loss == pytest.approx(sum(p[0] for p in parts) / 4, rel=1e-12)
    mean = [sum(p[1][i] for p in parts) / 4 for i in range(w.bucket_len)]
    assert _rel(g, mean) < 1e-6


@pytest.mark.parametrize("act", ["relu", "tanh"])
def test_python_gradient_matches_central_differences(small, act):
    """Central differences in float64 over every parameter of a 2-hidden-layer net."""
    w = PythonMLPWorker(small, hidden=(4, 3), activation=act, batch=7, seed=2)
    p = w.params().tolist()
    xs, ys = zip(*(small.row(k) for k in range(7)))
    loss, g = loss_and_grad(w.mlp, p, xs, ys)
    eps = 1e-6
    fd = []
    for i in range(len(p)):
        hi, lo = p[:], p[:]
        hi[i] += eps
        lo[i] -= eps
        fd.append((loss_and_grad(w.mlp, hi, xs, ys)[0] -
                   loss_and_grad(w.mlp, lo, xs, ys)[0]) / (2 * eps))
    assert _rel(g, fd) < 1e-6
    wl, wg = w.grads_sync(0)
    assert wl == pytest.approx(loss, rel=1e-12)
    assert _rel(wg, fd) < 1e-5  # float32 rounding of the bucket


# -- apply / params / set_params --------------------------------------------------------------

def test_apply_is_float32_of_float64_sgd(synth):
    w = PythonMLPWorker(synth)
    p0 = w.params()
    avg = array("f", [((i * 7919) % 13 - 6) / 7.0 for i in range(w.bucket_len)])
    w.apply(avg, 0.3)
    expected = array("f", [a - 0.3 * b for a, b in zip(p0.tolist(), avg.tolist())])
    assert w.params() == expected
    # A list or array('d') is accepted as the averaged gradient.
    w.set_params(p0)
    w.apply(list(avg), 0.3)
    assert w.params() == expected
    w.set_params(p0)
    w.apply(array("d", avg), 0.3)
    assert w.params() == expected
    w.apply(avg, 0.0)
    assert w.params() == expected


def test_apply_changes_the_gradient(synth):
    w = PythonMLPWorker(synth, batch=16)
    loss0, g = w.grads_sync(0)
    w.apply(g, 0.5)
    loss1, _ = w.grads_sync(0)
    assert loss1 < loss0


def test_params_is_a_copy_and_set_params_validates(synth):
    w = PythonMLPWorker(synth)
    p = w.params()
    p[0] += 1.0
    assert w.params()[0] != p[0]
    w.set_params(p)
    assert w.params() == p
    w.set_params([0.25] * w.bucket_len)
    assert w.params() == array("f", [0.25] * w.bucket_len)
    w.set_params(array("d", [0.1] * w.bucket_len))
    assert w.params() == array("f", [0.1] * w.bucket_len)
    with pytest.raises(LocalProtocolError, match=f"length {w.bucket_len - 1}.*{w.bucket_len}"):
        w.set_params([0.0] * (w.bucket_len - 1))
    with pytest.raises(LocalProtocolError, match="avg has length 3"):
        w.apply([0.0] * 3, 0.1)
    with pytest.raises(LocalProtocolError, match="vector"):
        w.set_params(None)


# -- evaluate / factory -----------------------------------------------------------------------

def test_evaluate_is_an_accuracy_and_training_improves_it(synth):
    w = PythonMLPWorker(synth, hidden=(8,), batch=32, seed=0)
    acc0, loss0 = w.evaluate(), w.evaluate_loss()
    assert 0.0 <= acc0 <= 1.0 and loss0 > 0
    for step in range(60):
        _, g = w.grads_sync(step * 32)
        w.apply(g, 0.3)
    assert w.evaluate() >= 0.9
    assert w.evaluate_loss() < loss0


def test_make_worker_validates(synth):
    assert make_worker(synth, backend="python").backend == "python"
    with pytest.raises(ConfigError, match="backend"):
        make_worker(synth, backend="torch")
    with pytest.raises(ConfigError, match="batch"):
        make_worker(synth, batch=0, backend="python")
    with pytest.raises(ConfigError, match="hidden"):
        make_worker(synth, hidden=(0,), backend="python")
    with pytest.raises(ConfigError, match="hidden"):
        make_worker(synth, hidden="32", backend="python")
    with pytest.raises(ConfigError, match="activation"):
        make_worker(synth, activation="gelu", backend="python")
    with pytest.raises(ConfigError, match="yield_every"):
        PythonMLPWorker(synth, yield_every=0)
    with pytest.raises(ConfigError, match="dataset"):
        make_worker("digits", backend="python")


def test_make_worker_auto_and_numpy_without_numpy(synth, monkeypatch):
    import tabcohort.model as model
    monkeypatch.setattr(model, "np", None)
    assert make_worker(synth).backend == "python"
    with pytest.raises(ConfigError, match="numpy is not importable"):
        make_worker(synth, backend="numpy")
