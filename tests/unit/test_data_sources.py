"""Datasets: determinism, the held-out split, the content hash and the portable form
(tabcohort.model.data). Runs without numpy except where marked."""

from __future__ import annotations

from array import array
import sys

import pytest

from tabcohort._compat import np
from tabcohort.errors import ConfigError
from tabcohort.model import sources
from tabcohort.model.data import Dataset, load_dataset


# Golden hash of load_dataset("synthetic", seed=0): generated with the stdlib only, so every
# platform (CPython 3.11, Pyodide 3.14, with or without numpy) must reproduce it bit for bit.
SYNTHETIC_SEED0_SHA256 = "18451faafcf3e9628f3790f28911b51d50e59be101c8e7fd87a8fa4db0b32a15"


@pytest.fixture(scope="module")
def synth() -> Dataset:
    return load_dataset("synthetic", seed=0)


def test_synthetic_shape_and_split(synth):
    assert (synth.n_features, synth.n_classes) == (16, 4)
    assert (synth.train_len, synth.test_len) == (1600, 400)
    assert len(synth.x_train) == 1600 * 16 and len(synth.x_test) == 400 * 16
    assert set(synth.y_train) == {0, 1, 2, 3}
    assert synth.name == "synthetic" and synth.seed == 0


def test_synthetic_golden_hash(synth):
    # Pins the generator and the shuffle across Python versions and platforms.
    assert synth.content_hash() == SYNTHETIC_SEED0_SHA256


def test_same_seed_same_data_other_seed_other_data(synth):
    again = load_dataset("synthetic", seed=0)
    assert again.content_hash() == synth.content_hash()
    assert again.x_train == synth.x_train and again.y_test == synth.y_test
    other = load_dataset("synthetic", seed=1)
    assert other.content_hash() != synth.content_hash()


def test_split_is_disjoint_and_offsets_reach_only_train():
    # Tag each sample with a unique value in feature 0 to identify it after the shuffle.
    from array import array
    n, f = 50, 2
    x = array("f", [v for i in range(n) for v in (float(i), 0.5)])
    y = array("i", [i % 3 for i in range(n)])
    ds = Dataset.from_rows("tagged", x, y, f, 3, seed=7, test_fraction=0.2)
    assert (ds.train_len, ds.test_len) == (40, 10)
    train_tags = {ds.row(i)[0][0] for i in range(ds.train_len)}
    test_tags = {ds.row(i, split="test")[0][0] for i in range(ds.test_len)}
    assert train_tags.isdisjoint(test_tags)
    assert train_tags | test_tags == {float(i) for i in range(n)}
    # Every offset, however large, lands on a training row.
    for off in (0, 39, 40, 41, 2**32 - 1, 10**12 + 3):
        assert ds.row(off)[0][0] in train_tags
        assert ds.row(off) == ds.row(ds.train_index(off))
    # The shuffle is seeded: a different seed gives a different order.
    other = Dataset.from_rows("tagged", x, y, f, 3, seed=8, test_fraction=0.2)
    assert [other.row(i)[0][0] for i in range(40)] != [ds.row(i)[0][0] for i in range(40)]


def test_row_accessors(synth):
    xs, label = synth.row(3)
    assert len(xs) == 16 and isinstance(label, int)
    assert list(synth.x_train[3 * 16:4 * 16]) == xs and label == synth.y_train[3]
    with pytest.raises(IndexError):
        synth.row(synth.test_len, split="test")
    with pytest.raises(ValueError):
        synth.row(0, split="valid")


@pytest.mark.parametrize("fraction", [0, 1, 1.5, -0.1, "0.2"])
def test_bad_test_fraction(fraction):
    with pytest.raises(ConfigError, match="test_fraction"):
        load_dataset("synthetic", test_fraction=fraction)


def test_test_fraction_rounds_up():
    ds = load_dataset("synthetic", n_samples=1797, test_fraction=0.2)
    assert (ds.train_len, ds.test_len) == (1437, 360)


def test_unknown_name_and_bad_options():
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_dataset("mnist")
    with pytest.raises(ConfigError, match="not an option of dataset 'synthetic'"):
        load_dataset("synthetic", n_classess=3)
    with pytest.raises(ConfigError, match="n_classes"):
        load_dataset("synthetic", n_classes=1)
    with pytest.raises(ConfigError, match="separation"):
        load_dataset("synthetic", separation=float("nan"))
    with pytest.raises(ConfigError, match="seed"):
        load_dataset("synthetic", seed="0")


def test_the_built_in_jobs_data_round_trips_and_bad_data_is_refused(synth):
    """The built-in job's data (an .npz every rank downloads) rebuilds the same dataset, and data
    that is not a dataset (labels out of range, NaN, shapes that disagree) is refused, named."""
    from tabcohort.jobs import JobData
    from tabcohort.jobs.arrays import NdArray, write_npz
    from tabcohort.jobs.builtin_mlp import dataset_of, to_arrays
    opts = {"dataset": "synthetic", "data_seed": synth.seed}
    arrays = to_arrays(synth)
    back = dataset_of(JobData.from_npz(write_npz(arrays)), opts)
    assert back.content_hash() == synth.content_hash() and back.name == synth.name
    assert (back.train_len, back.test_len, back.n_classes) == (synth.train_len, synth.test_len, synth.n_classes)

    def with_(key, a):
        return JobData.from_npz(write_npz({**arrays, key: a}))
    y = arrays["y_test"]
    with pytest.raises(ConfigError, match="label 7 outside"):
        dataset_of(with_("y_test", NdArray(y.descr, y.shape, array(y.data.typecode, [7] * len(y.data)))), opts)
    x = arrays["x_train"]
    with pytest.raises(ConfigError, match="NaN or infinity"):
        dataset_of(with_("x_train", NdArray(x.descr, x.shape, array("f", [float("nan")] * len(x.data)))), opts)
    with pytest.raises(ConfigError, match="rows or features do not match"):
        dataset_of(with_("y_train", NdArray(y.descr, (2,), array(y.data.typecode, [0, 1]))), opts)
    with pytest.raises(ConfigError, match="data.x_test"):
        dataset_of(with_("x_test", NdArray("<f8", x.shape, array("d", x.data))), opts)


@pytest.mark.needs_numpy
def test_numpy_views_share_the_canonical_bytes(synth):
    import hashlib
    import struct
    xtr, ytr, xte, yte = synth.numpy()
    assert xtr.dtype == np.float32 and xtr.shape == (1600, 16)
    assert ytr.dtype == np.int32 and yte.shape == (400,)
    assert not xtr.flags.writeable
    h = hashlib.sha256(b"tabcohort-dataset-v1\x00" + struct.pack("<4I", 16, 4, 1600, 400))
    for a, dt in ((xtr, "<f4"), (ytr, "<i4"), (xte, "<f4"), (yte, "<i4")):
        h.update(a.astype(dt).tobytes())
    assert h.hexdigest() == synth.content_hash()


def test_numpy_accessor_without_numpy(synth, monkeypatch):
    import tabcohort.model.data as data
    monkeypatch.setattr(data, "np", None)
    fresh = Dataset(synth.name, synth.n_features, synth.n_classes, synth.seed, synth.x_train, synth.y_train,
                    synth.x_test, synth.y_test)
    with pytest.raises(ConfigError, match="numpy"):
        fresh.numpy()


# -- digits ------------------------------------------------------------------------------

def test_digits_loads_scaled_and_split():
    pytest.importorskip("sklearn")
    ds = load_dataset("digits", seed=0)
    assert (ds.n_features, ds.n_classes, ds.train_len, ds.test_len) == (64, 10, 1437, 360)
    assert min(ds.x_train) == 0.0 and max(ds.x_train) == 1.0
    assert set(ds.y_test) <= set(range(10))
    assert load_dataset("digits", seed=0).content_hash() == ds.content_hash()
    assert load_dataset("digits", seed=1).content_hash() != ds.content_hash()


def test_digits_read_from_the_file_equal_sklearn_s_load_digits():
    """The data file is read without importing scikit-learn (2 s of CPU per serve start): in a
    fresh interpreter neither sklearn nor scipy is imported, and the values are load_digits's,
    bit for bit."""
    pytest.importorskip("sklearn")
    import subprocess
    code = ("import sys; from tabcohort.model import sources; s = sources.digits(); "
            "print(s[3], s[4], len(s[1]), len(s[2]), 'sklearn' in sys.modules, 'scipy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["64", "10", str(1797 * 64), "1797", "False", "False"], out.stderr[-2000:]
    from sklearn.datasets import load_digits
    rows = sources._digits_file()
    assert rows is not None
    bunch = load_digits()
    want_x = (bunch.data / 16.0).astype("=f4").tobytes()
    assert array("f", [v / 16.0 for r in rows for v in r[:64]]).tobytes() == want_x
    assert [r[64] for r in rows] == bunch.target.tolist()
    _, x, y, f, c = sources.digits()
    assert (f, c) == (64, 10) and x.tobytes() == want_x and list(y) == bunch.target.tolist()


def _fake_sklearn(tmp_path, monkeypatch, text: str) -> None:
    """``find_spec("sklearn")`` points at a directory whose digits file holds ``text``."""
    import gzip
    import importlib.machinery
    import importlib.util
    (tmp_path / "sklearn" / "datasets" / "data").mkdir(parents=True)
    with gzip.open(tmp_path / "sklearn" / "datasets" / "data" / "digits.csv.gz", "wt") as f:
        f.write(text)
    spec = importlib.machinery.ModuleSpec("sklearn", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path / "sklearn")]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "sklearn" else real(name, *a))


_ROW = "0," * 64 + "3\n"


def test_a_digits_file_that_is_the_table_is_read(tmp_path, monkeypatch):
    _fake_sklearn(tmp_path, monkeypatch, _ROW.replace("\n", "\r\n") * 1797 + "\n")
    rows = sources._digits_file()
    assert rows is not None and len(rows) == 1797 and rows[0] == [0] * 64 + [3]


@pytest.mark.parametrize("text", ["", _ROW * 1796, "1,2,3\n" * 1797, "0," * 63 + "7,7,3\n" * 1797,
                                  ("0," * 64 + "10\n") * 1797, ("0," * 63 + "17,1\n") * 1797,
                                  ("-1," + "0," * 63 + "1\n") * 1797, ("0," * 64 + "x\n") * 1797,
                                  ("0," * 64 + "\u0663\n") * 1797],
                         ids=["empty", "1796-rows", "short-rows", "66-columns", "class-10", "pixel-17",
                              "negative", "not-a-number", "not-ascii"])
def test_a_digits_file_that_is_not_the_table_falls_back_to_load_digits(tmp_path, monkeypatch, text):
    _fake_sklearn(tmp_path, monkeypatch, text)
    assert sources._digits_file() is None
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        return
    _, x, y, _, _ = sources.digits()         # (the fallback: load_digits's values)
    assert x.tobytes() == (load_digits().data / 16.0).astype("=f4").tobytes()


def test_a_corrupt_digits_file_falls_back(tmp_path, monkeypatch):
    _fake_sklearn(tmp_path, monkeypatch, _ROW * 1797)
    f = tmp_path / "sklearn" / "datasets" / "data" / "digits.csv.gz"
    data = bytearray(f.read_bytes())
    data[20:40] = b"\xff" * 20              # (inside the deflate stream)
    f.write_bytes(bytes(data))
    assert sources._digits_file() is None


def test_digits_without_sklearn_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ConfigError, match="digits.*pip install scikit-learn"):
        load_dataset("digits")
