"""Dataset sources for :func:`tabcohort.model.data.load_dataset`.

Each source returns ``(name, x, y, n_features, n_classes)`` with ``x`` an ``array('f')``
(flat, row-major, unshuffled) and ``y`` an int32 ``array``. Shuffling and the held-out split
happen in :meth:`tabcohort.model.data.Dataset.from_rows`.
"""

from __future__ import annotations

import math
import os
import random
from array import array
from typing import Any, Iterable

from .._compat import np
from ..errors import ConfigError

_INT32 = "i" if array("i").itemsize == 4 else "l"
_INT32_MAX = 2**31 - 1

Source = tuple[str, array, array, int, int]


def reject_opts(source: str, opts: dict[str, Any], allowed: Iterable[str]) -> None:
    """Raise ConfigError for an option the source does not take."""
    allowed = set(allowed)
    for k in opts:
        if k not in allowed:
            raise ConfigError(k, opts[k], f"not an option of dataset {source!r} "
                              f"(options: {', '.join(sorted(allowed)) or 'none'})")


def digits() -> Source:
    """scikit-learn's handwritten digits (the UCI optical digits test set).

    Returns 1797 samples of 64 features (8x8 pixel intensities 0..16, divided by 16 so they lie
    in [0, 1]; exact in float32) and 10 classes.

    The data file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``, the one
    ``sklearn.datasets.load_digits`` parses) is read directly: importing ``sklearn.datasets``
    costs about 2 s of CPU (it imports scipy), which every ``serve`` (and ``simulate``) process
    paid at start (ranks never load the data: they fetch it from the server).
    A file that is missing or not the expected 1797 x 65 table of integers falls back to
    ``load_digits``; both give the same values (a unit test compares them).

    Raises:
        ConfigError: scikit-learn is not installed.
    """
    rows = _digits_file()
    if rows is None:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise ConfigError("dataset", "digits", "the digits dataset needs scikit-learn: "
                              "pip install scikit-learn") from None
        bunch = load_digits()
        rows = [[int(v) for v in r] + [int(t)] for r, t in zip(bunch.data.tolist(), bunch.target.tolist())]
    x = array("f", [v / 16.0 for r in rows for v in r[:_DIGITS_FEATURES]])
    y = array(_INT32, [r[_DIGITS_FEATURES] for r in rows])
    return "digits", x, y, _DIGITS_FEATURES, 10


_DIGITS_ROWS, _DIGITS_FEATURES = 1797, 64


def _digits_file() -> list[list[int]] | None:
    """The rows of scikit-learn's ``digits.csv.gz`` (64 pixels 0..16, then the class 0..9), found
    without importing scikit-learn; None when the file is missing or not that table."""
    import gzip
    import importlib.util
    import zlib
    try:
        spec = importlib.util.find_spec("sklearn")
        where = spec.submodule_search_locations if spec is not None else None
        if not where:
            return None
        with gzip.open(os.path.join(list(where)[0], "datasets", "data", "digits.csv.gz"), "rt",
                       encoding="ascii") as f:
            rows = [[int(v) for v in line.split(",")] for line in f.read().splitlines() if line]
    except (OSError, ValueError, EOFError, ImportError, TypeError, zlib.error):   # (a corrupt
        return None                                              # deflate stream: zlib.error)
    ok = (len(rows) == _DIGITS_ROWS
          and all(len(r) == _DIGITS_FEATURES + 1 and 0 <= min(r) and max(r[:-1]) <= 16 and r[-1] <= 9
                  for r in rows))
    return rows if ok else None


def _check_int(name: str, value: Any, lo: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ConfigError(name, value, f"expected an integer >= {lo}")
    return value


def synthetic(*, seed: int = 0, n_samples: int = 2000, n_features: int = 16,
              n_classes: int = 4, separation: float = 2.0) -> Source:
    """Seeded Gaussian blobs, generated with the stdlib only.

    Class ``c`` has a centre drawn uniformly from ``[-separation, separation]^n_features``;
    sample ``i`` has class ``i % n_classes`` and features ``centre + noise`` with unit-variance
    noise (a sum of 12 uniforms minus 6). Only ``+ - *`` on ``random.random()`` draws are used,
    so every platform (CPython, Pyodide) produces bit-identical data. With the defaults a
    linear model reaches about 99 % held-out accuracy.

    Args:
        seed: generation seed (the same seed also drives the shuffle, in ``from_rows``).
        n_samples: number of samples (>= 2).
        n_features: features per sample (>= 1).
        n_classes: number of classes (>= 2).
        separation: half-width of the centre cube, in noise standard deviations (> 0).

    Raises:
        ConfigError: an option out of range.
    """
    _check_int("n_samples", n_samples, 2)
    _check_int("n_features", n_features, 1)
    _check_int("n_classes", n_classes, 2)
    if not isinstance(separation, (int, float)) or not math.isfinite(separation) \
            or separation <= 0:
        raise ConfigError("separation", separation, "expected a finite number > 0")
    rng = random.Random(f"tabcohort/synthetic/{int(seed)}")
    rand = rng.random
    s = float(separation)
    centres = [[(2.0 * rand() - 1.0) * s for _ in range(n_features)] for _ in range(n_classes)]
    x, y = array("f"), array(_INT32)
    row = [0.0] * n_features
    for i in range(n_samples):
        c = i % n_classes
        centre = centres[c]
        for j in range(n_features):
            z = -6.0
            for _ in range(12):
                z += rand()
            row[j] = centre[j] + z
        x.extend(row)
        y.append(c)
    name = "synthetic" if (n_samples, n_features, n_classes, separation) == \
        (2000, 16, 4, 2.0) else \
        f"synthetic-{n_samples}x{n_features}-c{n_classes}-s{separation:g}"
    return name, x, y, n_features, n_classes


def npz(path: str, *, n_classes: int | None = None) -> Source:
    """A user's ``.npz`` archive with ``X`` (float or integer, shape (n, n_features)) and
    ``y`` (integer labels, shape (n,)).

    Args:
        path: file path.
        n_classes: number of classes; default ``max(y) + 1``. Must exceed every label.

    Raises:
        ConfigError: numpy missing, the file missing or not an npz archive, a missing key,
            wrong shapes or dtypes, a length mismatch, NaN or infinity in ``X`` (also after
            conversion to float32), negative or too-large labels, fewer than two samples.
            The message names the file and the problem.
    """
    var = "dataset"

    def bad(reason: str) -> ConfigError:
        return ConfigError(var, path, reason)

    if np is None:
        raise bad("loading an .npz dataset needs numpy, which is not importable here "
                  "(pip install numpy; ranks get the data from the server, which loads it)")
    if not os.path.isfile(path):
        raise bad("no such file (the built-in datasets are 'digits' and 'synthetic'; a file is an .npz "
                  "with X and y)")
    try:
        archive = np.load(path, allow_pickle=False)
    except Exception as e:  # numpy raises ValueError, OSError, zipfile errors...
        detail = "not a zip archive of .npy arrays" if "pickle" in str(e) else f"{type(e).__name__}: {e}"
        raise bad(f"not a readable .npz archive ({detail}; pickled objects are never loaded)") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise bad("not an .npz archive (a single .npy array?); expected keys 'X' and 'y'")
    with archive:
        missing = [k for k in ("X", "y") if k not in archive.files]
        if missing:
            raise bad(f"missing key(s) {', '.join(missing)}; the archive has "
                      f"{', '.join(archive.files) or 'no arrays'}")
        try:
            X, Y = archive["X"], archive["y"]
        except Exception as e:
            raise bad(f"cannot read arrays ({type(e).__name__}: {e})") from None
    if X.ndim != 2:
        raise bad(f"X must be 2-D (samples, features), got shape {X.shape}")
    if Y.ndim != 1:
        raise bad(f"y must be 1-D (samples,), got shape {Y.shape}")
    if X.dtype.kind not in "fiu":
        raise bad(f"X must have a float or integer dtype, got {X.dtype}")
    if Y.dtype.kind not in "iu":
        raise bad(f"y must have an integer dtype, got {Y.dtype}")
    n, f = X.shape
    if len(Y) != n:
        raise bad(f"length mismatch: X has {n} rows but y has {len(Y)} labels")
    if n < 2 or f < 1:
        raise bad(f"need at least 2 samples and 1 feature, got X of shape {X.shape}")
    with np.errstate(over="ignore", invalid="ignore"):
        X32 = X.astype(np.float32)
    if not np.isfinite(X32).all():
        raise bad("X contains NaN or infinity (or values beyond float32 range)")
    if (Y < 0).any():
        raise bad(f"y contains negative labels (min {int(Y.min())})")
    top = int(Y.max())
    if top > _INT32_MAX - 1:
        raise bad(f"label {top} too large")
    if n_classes is None:
        n_classes = max(2, top + 1)
        if n_classes > n:
            # (labels up to 2,000,000 on a few thousand rows built a 66M-parameter model and ran
            # out of memory without a word: labels are class indices, not ids)
            raise bad(f"labels go up to {top}, so {n_classes:,} classes for {n:,} samples: labels must be "
                      f"class indices 0..K-1 (remap them, e.g. numpy.unique(y, return_inverse=True)[1])")
    elif not isinstance(n_classes, int) or isinstance(n_classes, bool) or n_classes < 2:
        raise ConfigError("n_classes", n_classes, "expected an integer >= 2")
    if top >= n_classes:
        raise bad(f"label {top} is not below n_classes={n_classes}")
    x = array("f")
    x.frombytes(np.ascontiguousarray(X32).astype("=f4").tobytes())
    y = array(_INT32)
    y.frombytes(Y.astype("=i4").tobytes())
    return f"npz:{os.path.basename(path)}", x, y, f, n_classes
