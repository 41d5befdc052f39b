"""A user's .npz dataset: loading and every kind of bad file (tabcohort.model.sources.npz)."""

from __future__ import annotations

import pytest

from tabcohort._compat import np
from tabcohort.errors import ConfigError
from tabcohort.model.data import load_dataset



def _save(tmp_path, name="d.npz", **arrays):
    path = tmp_path / name
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)
    return str(path)


@pytest.mark.needs_numpy
def test_npz_loads_and_matches_the_data(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(100, 3))
    y = np.arange(100) % 4
    path = _save(tmp_path, X=X, y=y)
    ds = load_dataset(path, seed=3)
    assert ds.name == "npz:d.npz"
    assert (ds.n_features, ds.n_classes, ds.train_len, ds.test_len) == (3, 4, 80, 20)
    xtr, ytr, xte, yte = ds.numpy()
    # Every row of both splits is a row of the file, rounded to float32, with its label.
    rows = {tuple(r): int(c) for r, c in zip(X.astype(np.float32).tolist(), y)}
    for xs, ys in ((xtr, ytr), (xte, yte)):
        for r, c in zip(xs.tolist(), ys):
            assert rows[tuple(r)] == c
    assert load_dataset(path, seed=3).content_hash() == ds.content_hash()
    assert load_dataset(path, n_classes=6).n_classes == 6


@pytest.mark.needs_numpy
def test_npz_integer_features_are_accepted(tmp_path):
    path = _save(tmp_path, X=np.arange(20).reshape(10, 2), y=np.arange(10) % 2)
    assert load_dataset(path).n_features == 2


BAD = [
    ("missing y", dict(X=np.zeros((4, 2))) if np else {}, "missing key.*y"),
    ("X 1-D", dict(X=np.zeros(4), y=np.zeros(4, int)) if np else {}, "X must be 2-D"),
    ("y 2-D", dict(X=np.zeros((4, 2)), y=np.zeros((4, 1), int)) if np else {}, "y must be 1-D"),
    ("y float", dict(X=np.zeros((4, 2)), y=np.zeros(4)) if np else {}, "integer dtype"),
    ("X strings", dict(X=np.array([["a", "b"]] * 4), y=np.zeros(4, int)) if np else {},
     "float or integer dtype"),
    ("X complex", dict(X=np.zeros((4, 2), complex), y=np.zeros(4, int)) if np else {},
     "float or integer dtype"),
    ("length", dict(X=np.zeros((4, 2)), y=np.zeros(5, int)) if np else {}, "length mismatch"),
    ("nan", dict(X=np.array([[0.0, np.nan]] * 4), y=np.zeros(4, int)) if np else {},
     "NaN or infinity"),
    ("overflow", dict(X=np.array([[0.0, 1e300]] * 4), y=np.zeros(4, int)) if np else {},
     "NaN or infinity"),
    ("negative", dict(X=np.zeros((4, 2)), y=np.array([0, 1, -1, 0])) if np else {},
     "negative labels"),
    ("one sample", dict(X=np.zeros((1, 2)), y=np.zeros(1, int)) if np else {},
     "at least 2 samples"),
    # (ids as labels: a 66M-parameter model built in silence until memory ran out)
    ("label ids", dict(X=np.zeros((4, 2)), y=np.array([0, 7, 2_000_000, 3])) if np else {},
     "2,000,001 classes for 4 samples"),
]


@pytest.mark.needs_numpy
@pytest.mark.parametrize("case,arrays,message", BAD, ids=[b[0] for b in BAD])
def test_bad_npz_names_file_and_problem(tmp_path, case, arrays, message):
    path = _save(tmp_path, **arrays)
    with pytest.raises(ConfigError, match=message) as info:
        load_dataset(path)
    assert path in str(info.value)


@pytest.mark.needs_numpy
def test_not_an_npz(tmp_path):
    path = tmp_path / "junk.npz"
    path.write_bytes(b"this is not a zip archive")
    with pytest.raises(ConfigError, match="not a readable .npz") as info:
        load_dataset(str(path))
    assert str(path) in str(info.value)
    npy = tmp_path / "single.npy"
    np.save(npy, np.zeros(3))
    with pytest.raises(ConfigError, match="not an .npz archive"):
        load_dataset(str(npy))


@pytest.mark.needs_numpy
def test_missing_file_and_bad_n_classes(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_dataset(str(tmp_path / "absent.npz"))
    path = _save(tmp_path, X=np.zeros((4, 2)), y=np.array([0, 1, 2, 0]))
    with pytest.raises(ConfigError, match="not below n_classes=2"):
        load_dataset(path, n_classes=2)
    with pytest.raises(ConfigError, match="not an option of dataset 'npz'"):
        load_dataset(path, separation=2.0)


def test_npz_without_numpy_says_so(tmp_path, monkeypatch):
    import tabcohort.model.sources as sources
    monkeypatch.setattr(sources, "np", None)
    with pytest.raises(ConfigError, match="needs numpy") as info:
        load_dataset(str(tmp_path / "d.npz"))
    assert "d.npz" in str(info.value)
