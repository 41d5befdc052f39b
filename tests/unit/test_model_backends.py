"""The numpy backend against the pure-Python one and against finite differences (needs numpy)."""

from __future__ import annotations

import pytest

from tabcohort._compat import np
from tabcohort.errors import ConfigError, LocalProtocolError
from tabcohort.model import PythonMLPWorker, load_dataset, make_worker

from ._drive import drive

pytestmark = pytest.mark.needs_numpy


@pytest.fixture(scope="module")
def synth():
    return load_dataset("synthetic", seed=0)


@pytest.fixture(scope="module")
def small():
    return load_dataset("synthetic", seed=1, n_samples=60, n_features=5, n_classes=3)


def _pair(ds, **kw):
    from tabcohort.model import NumpyMLPWorker
    return NumpyMLPWorker(ds, **kw), PythonMLPWorker(ds, **kw)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("act,hidden", [("relu", (32,)), ("tanh", (16, 8)), ("relu", ())])
def test_backends_agree(synth, act, hidden):
    wn, wp = _pair(synth, hidden=hidden, activation=act, batch=24, seed=3)
    assert wn.model == wp.model and wn.bucket_len == wp.bucket_len
    assert wn.spec() == wp.spec()
    assert np.array_equal(wn.params(), np.asarray(wp.params()))  # identical init
    for offset in (0, 1590, 2**32 - 1):
        (ln, gn), (lp, gp) = wn.grads_sync(offset), wp.grads_sync(offset)
        assert gn.dtype == np.float32 and gn.shape == (wn.bucket_len,)
        assert abs(ln - lp) <= 1e-5 * abs(lp)
        assert _rel(gn, gp) <= 1e-5
        wn.apply(gn, 0.5)
        wp.apply(gn, 0.5)
        assert np.array_equal(wn.params(), np.asarray(wp.params()))
    assert wn.evaluate() == wp.evaluate()
    assert wn.evaluate_loss() == pytest.approx(wp.evaluate_loss(), rel=1e-9)


def test_apply_is_bit_identical_across_backends(synth):
    wn, wp = _pair(synth, seed=1)
    avg = np.random.default_rng(0).normal(size=wn.bucket_len).astype(np.float32)
    for lr in (0.5, 1e-3, 3.0):
        wn.apply(avg, lr)
        wp.apply(avg, lr)
        assert np.array_equal(wn.params(), np.asarray(wp.params()))
    p = wn.params()
    expect = (p.astype(np.float64) - 0.25 * avg.astype(np.float64)).astype(np.float32)
    wn.apply(avg, 0.25)
    assert np.array_equal(wn.params(), expect)


@pytest.mark.parametrize("act", ["relu", "tanh"])
def test_numpy_gradient_matches_central_differences(small, act):
    from tabcohort.model.backend_np import loss_and_grad
    wn = make_worker(small, hidden=(4, 3), activation=act, batch=7, seed=2, backend="numpy")
    p = wn.params().astype(np.float64)
    X = small.numpy()[0][:7]
    y = small.numpy()[1][:7]
    loss, g = loss_and_grad(wn.mlp, p, X, y)
    eps = 1e-6
    fd = np.empty_like(p)
    for i in range(len(p)):
        d = np.zeros_like(p)
        d[i] = eps
        fd[i] = (loss_and_grad(wn.mlp, p + d, X, y)[0] -
                 loss_and_grad(wn.mlp, p - d, X, y)[0]) / (2 * eps)
    assert _rel(g, fd) < 1e-6
    wl, wg = wn.grads_sync(0)
    assert wl == pytest.approx(loss, rel=1e-12)
    assert _rel(wg, fd) < 1e-5


def test_numpy_slices_a_large_model_by_multiply_accumulates_not_by_samples(synth):
    # PROTOCOL.md "Worker contract": beats must go out while a bucket is computed; a slice of
    # 1024 samples of a 1.1M-parameter MLP held the event loop for seconds on a loaded machine
    from tabcohort.model import NumpyMLPWorker
    from tabcohort.model.backend_np import CHUNK_SAMPLES, SLICE_MACS
    small = NumpyMLPWorker(synth, batch=10)
    assert small.chunk == CHUNK_SAMPLES                      # a small model: as before
    big = NumpyMLPWorker(synth, hidden=(1024, 1024), batch=10)
    assert 1 <= big.chunk < CHUNK_SAMPLES and big.chunk * big.mlp.macs_per_sample <= SLICE_MACS
    assert (big.chunk + 1) * big.mlp.macs_per_sample > SLICE_MACS
    (_, g), n_yields = drive(big.grads(0, 3 * big.chunk))
    assert n_yields == 2 and g.shape == (big.bucket_len,)


def test_numpy_grads_slices_by_chunk(synth):
    from tabcohort.model import NumpyMLPWorker
    w = NumpyMLPWorker(synth, batch=10, chunk=4)
    (loss, g), n_yields = drive(w.grads(5))
    assert n_yields == 2
    coro = w.grads(5)
    coro.send(None)
    w.apply(np.ones(w.bucket_len, np.float32), 1.0)  # between slices: must not leak in
    (l2, g2), _ = drive(coro)
    assert l2 == loss and np.array_equal(g2, g)
    whole = NumpyMLPWorker(synth, batch=10)
    (loss1, g1), n1 = drive(whole.grads(5))
    assert n1 == 0
    assert loss == pytest.approx(loss1, rel=1e-12) and _rel(g, g1) < 1e-6


def test_numpy_worker_contract(synth):
    w = make_worker(synth, batch=8, backend="numpy")
    assert w.backend == "numpy" and make_worker(synth).backend == "numpy"  # auto
    p = w.params()
    p[0] += 1
    assert w.params()[0] != p[0]
    w.set_params([0.5] * w.bucket_len)
    assert w.params().dtype == np.float32 and (w.params() == 0.5).all()
    from array import array
    w.set_params(array("f", [0.25] * w.bucket_len))
    assert (w.params() == 0.25).all()
    with pytest.raises(LocalProtocolError, match="length"):
        w.set_params(np.zeros(3, np.float32))
    with pytest.raises(LocalProtocolError, match="length"):
        w.apply(np.zeros(w.bucket_len + 1), 0.1)
    (l1, g1), (l2, g2) = w.grads_sync(3), w.grads_sync(3 + 5 * synth.train_len)
    assert l1 == l2 and np.array_equal(g1, g2)
    from tabcohort.model import NumpyMLPWorker
    with pytest.raises(ConfigError, match="chunk"):
        NumpyMLPWorker(synth, chunk=0)


def test_a_tab_backend_asked_for_and_not_available_says_where_it_went_first_and_once(synth, monkeypatch):
    # a new-user trial: ?backend=numpy in a tab without it read "numpy was asked for but ...;
    # using js; usin" (said twice, and cut at the report's 256 characters before the end)
    from tabcohort.model import backend_js
    from tabcohort.runtime.tab import _fit
    if np is not None:
        monkeypatch.setattr("tabcohort.model.np", None)      # as in a tab without numpy
    w, _ = drive(backend_js.make_tab_worker(synth, backend="numpy", hidden=(8,), batch=4))
    note = w.backend_note
    assert note.startswith(f"using {w.backend}: numpy was asked for but numpy: numpy is not importable"), note
    assert note.count(f"using {w.backend}") == 1, note
    cut = _fit(note + " x" * 200, 256)
    assert len(cut) <= 256 and cut.startswith(f"using {w.backend}:") and cut.endswith("…"), cut
