"""The leader's reduce and the numpy worker's update are computed in blocks (no full-length
float64 temporaries) and must stay bit-identical to one full-length float64 accumulation
(docs/PROTOCOL.md, "Leader: driving one round", steps 7-8)."""

from __future__ import annotations

import pytest

np = pytest.importorskip("numpy")
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

from tabcohort import vec  # noqa: E402


def reference_mean(vectors, weights):
    if len(vectors) == 1 and weights[0] == 1.0:       # one bucket: itself, bit for bit
        return np.array(vectors[0], dtype=np.float32)
    acc = np.zeros(len(vectors[0]), dtype=np.float64)
    for w, v in zip(weights, vectors):
        acc += float(w) * np.asarray(v, dtype=np.float64)
    return acc.astype(np.float32)


def hostile_values(rng, n):
    """float32 values across the range: normal, tiny, subnormal, huge, signed zeros."""
    scale = rng.choice(np.array([1e-38, 1e-42, 1e-3, 1.0, 1e20, 3e38], dtype=np.float64), n)
    v = (rng.standard_normal(n) * scale).astype(np.float32)
    v[rng.random(n) < 0.01] = -0.0
    v[rng.random(n) < 0.01] = 0.0
    return v


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [1, 3, vec.BLOCK - 1, vec.BLOCK, vec.BLOCK + 1, 3 * vec.BLOCK + 17])
def test_blocked_weighted_mean_is_bit_identical_to_one_float64_accumulation(seed, n):
    rng = np.random.default_rng(seed * 1000 + n)
    k = int(rng.integers(1, 6))
    vectors = [hostile_values(rng, n) for _ in range(k)]
    samples = rng.integers(1, 1000, k)
    weights = [s / samples.sum() for s in samples]
    got = vec.weighted_mean(vectors, weights)
    want = reference_mean(vectors, weights)
    assert got.dtype == np.float32 and got.shape == (n,)
    assert got.tobytes() == want.tobytes()   # bit for bit, signed zeros and infinities included


def test_a_sum_that_overflows_float32_is_inf_in_both():
    v = np.full(vec.BLOCK + 5, 3e38, dtype=np.float32)
    got = vec.weighted_mean([v, v], [1.0, 1.0])
    assert got.tobytes() == reference_mean([v, v], [1.0, 1.0]).tobytes() and np.isinf(got).all()


@pytest.mark.parametrize("where", [0, vec.BLOCK - 1, vec.BLOCK, 2 * vec.BLOCK + 3])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_blocked_all_finite_finds_a_non_finite_in_any_block(where, bad):
    v = np.ones(2 * vec.BLOCK + 4, dtype=np.float32)
    assert vec.all_finite(v)
    v[where] = bad
    assert not vec.all_finite(v)


@pytest.mark.parametrize("seed", range(3))
def test_numpy_worker_apply_is_bit_identical_to_the_float64_update(seed):
    from tabcohort.model import load_dataset, make_worker

    ds = load_dataset("digits", seed=seed)
    w = make_worker(ds, hidden=(1100,), batch=8, seed=seed, backend="numpy")
    rng = np.random.default_rng(seed)
    p0 = w.params()
    g = hostile_values(rng, w.bucket_len) * np.float32(1e-30)
    g[:100] = rng.standard_normal(100).astype(np.float32)
    lr = float(rng.uniform(0.01, 2.0))
    w.apply(g, lr)
    want = (p0.astype(np.float64) - lr * g.astype(np.float64)).astype(np.float32)
    assert w.bucket_len > vec.BLOCK
    assert w.params().tobytes() == want.tobytes()


@pytest.mark.parametrize("seed", range(4))
def test_the_pure_python_reduce_and_finiteness_check_agree_with_numpy_bit_for_bit(seed, monkeypatch):
    """A tab without numpy reduces with list comprehensions and checks finiteness with one
    float64 sum (exact for float32 input: it cannot overflow); a numpy leader must get the same
    bits, signed zeros, overflow to infinity and NaN included."""
    from array import array
    rng = np.random.default_rng(seed)
    n = 2410
    k = 1 + seed % 3
    vectors = [hostile_values(rng, n) for _ in range(k)]
    if seed == 2:                                      # one bucket of all the samples
        vectors = vectors[:1]
    if seed == 3:
        vectors = [np.full(n, 3e38, dtype=np.float32)] * 2
        vectors[0][7] = -0.0
    samples = rng.integers(1, 1000, len(vectors))
    weights = [s / samples.sum() for s in samples]
    want = vec.weighted_mean(vectors, weights)
    monkeypatch.setattr(vec, "np", None)
    got = vec.weighted_mean([array("f", v.tobytes()) for v in vectors], weights)
    assert got.tobytes() == want.tobytes()
    for v in vectors:
        a = array("f", v.tobytes())
        assert vec.all_finite(a) == bool(np.isfinite(v).all())
        for bad in (float("nan"), float("inf"), float("-inf")):
            b = array("f", a)
            b[int(rng.integers(0, n))] = bad
            assert not vec.all_finite(b)
    assert vec.all_finite(array("f", [3e38] * 100_000))      # a sum past float32's range is still finite
    assert not vec.all_finite([1e308, 1e308, float("nan")]) and vec.all_finite([1e308, 1e308])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n", [vec.BLOCK - 1, vec.BLOCK + 1, 3 * vec.BLOCK + 17])
def test_a_mean_accumulated_as_buckets_arrive_is_bit_identical_to_the_reduce_at_the_end(seed, n):
    rng = np.random.default_rng(seed * 7919 + n)
    k = int(rng.integers(2, 6))
    vectors = [hostile_values(rng, n) for _ in range(k)]
    samples = rng.integers(1, 1000, k)
    weights = [s / samples.sum() for s in samples]
    run = vec.RunningMean()
    for _ in range(2):             # the buffers are reused by the next round
        run.reset()
        for i, (v, w) in enumerate(zip(vectors, weights)):
            run.add(v, w, last=i == k - 1 and seed % 2 == 0)   # the last folded in at the end, or not
        got = run.result(vectors, weights)
        assert got.dtype == np.float32 and got.shape == (n,)
        assert got.tobytes() == vec.weighted_mean(vectors, weights).tobytes()
        assert got.tobytes() == reference_mean(vectors, weights).tobytes()


def test_a_running_mean_answers_only_for_exactly_the_buckets_added():
    rng = np.random.default_rng(3)
    a, b, c = (hostile_values(rng, vec.BLOCK + 3) for _ in range(3))
    run = vec.RunningMean()
    run.add(a, 0.25)
    run.add(b, 0.75)
    assert run.result([a, b], [0.25, 0.75]) is not None
    assert run.result([b, a], [0.75, 0.25]) is None          # another order: another rounding
    assert run.result([a, b.copy()], [0.25, 0.75]) is None   # a clipped (replaced) bucket
    assert run.result([a, b], [0.25, 0.5]) is None           # other weights (a bucket missing)
    assert run.result([a, b, c], [0.2, 0.6, 0.2]) is None and run.result([a], [1.0]) is None
    run.reset()
    run.add(a, 0.25, last=True)                              # "last" was not: folded in at the next
    run.add(b, 0.75, last=True)
    assert run.result([a, b], [0.25, 0.75]).tobytes() == vec.weighted_mean([a, b], [0.25, 0.75]).tobytes()
    assert run.result([a, b], [0.25, 0.75]) is None          # the sum holds the last now: asked once
    run.reset()
    run.add(a, 0.25)
    run.add(np.ones(5, np.float32), 0.5)                     # a length that differs: stops
    assert run.result([a, b], [0.25, 0.75]) is None
    run.reset()
    assert run.result([], []) is None
