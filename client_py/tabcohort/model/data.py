"""Datasets shared by every rank of a cohort (PROTOCOL.md, "Worker contract").

Every rank must compute gradients over the *same* samples in the *same* order: the assignment
offset of a ``round`` indexes the training split modulo its length. A :class:`Dataset` is
therefore built deterministically from a source and a seed (part of the job), stored as
canonical float32 / int32 data, and carries a :meth:`Dataset.content_hash` that every rank can
compare. The stdlib representation (``array('f')`` flat row-major features, ``array('i')``
labels) is always present; numpy views of the same bytes are built on demand.

Sources (:func:`load_dataset`): ``"digits"`` (scikit-learn's handwritten digits),
``"synthetic"`` (seeded Gaussian blobs, stdlib only) and a path to a user's ``.npz`` file.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import struct
import sys
from array import array
from typing import Any

from .._compat import np
from ..errors import ConfigError

__all__ = ["Dataset", "load_dataset"]

_HASH_MAGIC = b"tabcohort-dataset-v1\x00"
_INT32 = "i" if array("i").itemsize == 4 else "l"  # array typecode of a 4-byte signed int
_LITTLE = sys.byteorder == "little"


def _le_bytes(a: array) -> bytes:
    """The little-endian bytes of a 4-byte ``array`` (float32 or int32)."""
    if _LITTLE:
        return a.tobytes()
    b = array(a.typecode, a)  # pragma: no cover - big-endian hosts only
    b.byteswap()  # pragma: no cover
    return b.tobytes()  # pragma: no cover


def _permutation(n: int, rng: random.Random) -> list[int]:
    """A Fisher-Yates permutation of ``range(n)`` drawn only through ``getrandbits``.

    Spelled out (rather than ``random.shuffle``) so the order depends on nothing but the
    Mersenne Twister stream, which is identical on every Python version and platform.
    """
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        bound = i + 1
        k = bound.bit_length()
        r = rng.getrandbits(k)
        while r >= bound:
            r = rng.getrandbits(k)
        perm[i], perm[r] = perm[r], perm[i]
    return perm


class Dataset:
    """A classification dataset with a seeded train / held-out split, identical on every rank.

    Features are float32, stored flat and row-major; labels are int32 in ``[0, n_classes)``.
    Training sample ``k`` of an assignment at ``offset`` is row ``(offset + k) % train_len`` of
    the training split; no offset reaches the held-out split.

    Attributes:
        name: the source's name (``"digits"``, ``"synthetic"``, ``"npz:<file name>"``).
        n_features: features per sample.
        n_classes: number of classes.
        train_len: number of training samples.
        test_len: number of held-out samples.
        seed: the seed of the shuffle and split (part of the job).
        x_train: ``array('f')``, length ``train_len * n_features``, row-major. Read-only by
            convention, like the other three arrays.
        y_train: ``array`` of int32 labels, length ``train_len``.
        x_test: ``array('f')``, length ``test_len * n_features``.
        y_test: ``array`` of int32 labels, length ``test_len``.
    """

    def __init__(self, name: str, n_features: int, n_classes: int, seed: int,
                 x_train: array, y_train: array, x_test: array, y_test: array) -> None:
        self.name = name
        self.n_features = int(n_features)
        self.n_classes = int(n_classes)
        self.seed = int(seed)
        self.x_train, self.y_train = x_train, y_train
        self.x_test, self.y_test = x_test, y_test
        self.train_len = len(y_train)
        self.test_len = len(y_test)
        self._np_cache: tuple | None = None
        self._hash: str | None = None
        if len(x_train) != self.train_len * self.n_features or \
                len(x_test) != self.test_len * self.n_features:
            raise ConfigError("dataset", name, "feature array length does not match "
                              "rows x n_features")

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_rows(cls, name: str, x: array, y: array, n_features: int, n_classes: int, *,
                  seed: int = 0, test_fraction: float = 0.2) -> "Dataset":
        """Shuffle ``n`` samples with ``seed`` and split off a held-out fraction.

        Args:
            name: the dataset's name.
            x: ``array('f')`` of length ``n * n_features``, row-major, finite.
            y: int32 ``array`` of length ``n``, values in ``[0, n_classes)``.
            n_features: features per sample (>= 1).
            n_classes: number of classes (>= 2 and > max label).
            seed: seed of the permutation; the first ``ceil(n * test_fraction)`` permuted
                samples form the held-out split, the rest (in permuted order) the training split.
            test_fraction: held-out fraction, strictly between 0 and 1.

        Raises:
            ConfigError: bad ``test_fraction`` or too few samples for both splits.
        """
        n = len(y)
        if not isinstance(test_fraction, (int, float)) or not 0.0 < test_fraction < 1.0:
            raise ConfigError("test_fraction", test_fraction, "must be strictly between 0 and 1")
        n_test = math.ceil(round(n * test_fraction, 6))
        if n_test < 1 or n - n_test < 1:
            raise ConfigError("dataset", name, f"{n} samples are too few for a train split and "
                              f"a held-out split of fraction {test_fraction}")
        perm = _permutation(n, random.Random(f"tabcohort/split/{int(seed)}"))
        f = n_features

        def take(idx: list[int]) -> tuple[array, array]:
            xs, ys = array("f"), array(_INT32)
            for i in idx:
                xs.extend(x[i * f:(i + 1) * f])
                ys.append(y[i])
            return xs, ys

        x_te, y_te = take(perm[:n_test])
        x_tr, y_tr = take(perm[n_test:])
        return cls(name, n_features, n_classes, seed, x_tr, y_tr, x_te, y_te)

    # -- access ---------------------------------------------------------------------------

    def train_index(self, offset: int) -> int:
        """The training row an assignment offset (or offset + k) refers to: ``offset % train_len``."""
        return int(offset) % self.train_len

    def row(self, index: int, *, split: str = "train") -> tuple[list[float], int]:
        """One sample as ``(features, label)``.

        Args:
            index: row index; for ``split="train"`` taken modulo ``train_len`` (an offset).
            split: ``"train"`` or ``"test"``.

        Returns:
            A list of ``n_features`` floats (float32 values) and the int label.

        Raises:
            IndexError: ``index`` out of range for the test split.
            ValueError: unknown ``split``.
        """
        f = self.n_features
        if split == "train":
            i = index % self.train_len
            return self.x_train[i * f:(i + 1) * f].tolist(), int(self.y_train[i])
        if split == "test":
            if not 0 <= index < self.test_len:
                raise IndexError(f"test row {index} out of range [0, {self.test_len})")
            return self.x_test[index * f:(index + 1) * f].tolist(), int(self.y_test[index])
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")

    def numpy(self) -> tuple[Any, Any, Any, Any]:
        """numpy views of the data: ``(x_train, y_train, x_test, y_test)``.

        Returns:
            ``x_*``: float32, shape ``(len, n_features)``; ``y_*``: int32, shape ``(len,)``.
            Read-only views sharing memory with the stdlib arrays (built once, cached).

        Raises:
            ConfigError: numpy is not importable.
        """
        if np is None:
            raise ConfigError("backend", "numpy", "numpy is not importable in this process")
        if self._np_cache is None:
            f = self.n_features

            def view(a: array, dtype: Any, shape: tuple) -> Any:
                v = np.frombuffer(a, dtype=dtype).reshape(shape)
                v.flags.writeable = False
                return v

            self._np_cache = (view(self.x_train, np.float32, (self.train_len, f)),
                              view(self.y_train, np.int32, (self.train_len,)),
                              view(self.x_test, np.float32, (self.test_len, f)),
                              view(self.y_test, np.int32, (self.test_len,)))
        return self._np_cache

    # -- identity and transport -----------------------------------------------------------

    def content_hash(self) -> str:
        """SHA-256 hex digest of the canonical serialization of the data.

        The serialization is ``b"tabcohort-dataset-v1\\0"``, then ``n_features``,
        ``n_classes``, ``train_len``, ``test_len`` as little-endian uint32, then the float32
        little-endian training features (row-major), the int32 little-endian training labels,
        and the same two for the held-out split. It covers the shuffle (hence the seed) but not
        the name. Computed from the stdlib arrays, so it is the same with or without numpy.
        """
        if self._hash is None:
            h = hashlib.sha256(_HASH_MAGIC)
            h.update(struct.pack("<4I", self.n_features, self.n_classes,
                                 self.train_len, self.test_len))
            for a in (self.x_train, self.y_train, self.x_test, self.y_test):
                h.update(_le_bytes(a))
            self._hash = h.hexdigest()
        return self._hash

    @classmethod
    def checked(cls, name: str, n_features: int, n_classes: int, seed: int, x_train: array, y_train: array,
                x_test: array, y_test: array) -> "Dataset":
        """A dataset from arrays that crossed a network (a job's data, README "Write your own
        job"), checked: sizes, finite features, labels in ``[0, n_classes)``.

        Raises:
            ConfigError: a size that is not a positive integer (``n_classes`` >= 2), array
                lengths that do not match the sizes, NaN or infinity in the features, a label
                out of range.
        """
        for key, v, lo in (("n_features", n_features, 1), ("n_classes", n_classes, 2)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ConfigError(f"dataset.{key}", v, f"expected an integer >= {lo}")
        ds = cls(name, n_features, n_classes, seed, x_train, y_train, x_test, y_test)
        if ds.train_len < 1 or ds.test_len < 1:
            raise ConfigError("dataset", name, "both splits need at least one sample")
        _check_values(name, ds.x_train, ds.y_train, n_classes)
        _check_values(name, ds.x_test, ds.y_test, n_classes)
        return ds

    def __repr__(self) -> str:
        return (f"Dataset({self.name!r}, n_features={self.n_features}, "
                f"n_classes={self.n_classes}, train_len={self.train_len}, "
                f"test_len={self.test_len}, seed={self.seed})")


def _check_values(name: str, x: array, y: array, n_classes: int) -> None:
    isfinite = math.isfinite
    for v in x:
        if not isfinite(v):
            raise ConfigError("dataset", name, "features contain NaN or infinity")
    for v in y:
        if not 0 <= v < n_classes:
            raise ConfigError("dataset", name, f"label {v} outside [0, {n_classes})")


#: the reason a dataset name that is neither built in nor a file is refused (simulate and serve)
UNKNOWN_DATASET = "unknown dataset: expected 'digits', 'synthetic' or a path to an .npz file"


def load_dataset(name_or_path: str, *, seed: int = 0, test_fraction: float = 0.2,
                 **opts: Any) -> Dataset:
    """Load a dataset by name or from an ``.npz`` file, shuffled and split with ``seed``.

    Args:
        name_or_path: ``"digits"`` (scikit-learn's 8x8 handwritten digits: 1797 samples, 64
            features scaled to [0, 1], 10 classes), ``"synthetic"`` (see
            :func:`tabcohort.model.sources.synthetic`; opts ``n_samples``, ``n_features``,
            ``n_classes``, ``separation``) or a path to an ``.npz`` file with ``X`` (2-D,
            float or integer) and ``y`` (1-D non-negative integer labels); opt ``n_classes``
            (default ``max(y) + 1``).
        seed: seed of the shuffle and the held-out split (and of synthetic data).
        test_fraction: held-out fraction, strictly between 0 and 1 (default 20 %).
        **opts: source-specific options, above.

    Returns:
        The :class:`Dataset`.

    Raises:
        ConfigError: unknown name, missing optional dependency (scikit-learn for digits,
            numpy for npz), a bad file, or bad options.
    """
    from . import sources

    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError("seed", seed, "expected an integer")
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ConfigError("dataset", name_or_path, "expected a dataset name or a file path")
    key = os.fspath(name_or_path)
    if key == "digits":
        sources.reject_opts("digits", opts, ())
        name, x, y, f, c = sources.digits()
    elif key == "synthetic":
        sources.reject_opts("synthetic", opts,
                            ("n_samples", "n_features", "n_classes", "separation"))
        name, x, y, f, c = sources.synthetic(seed=seed, **opts)
    elif key.endswith(".npz") or os.path.sep in key or os.path.exists(key):
        sources.reject_opts("npz", opts, ("n_classes",))
        name, x, y, f, c = sources.npz(key, **opts)
    else:
        raise ConfigError("dataset", key, UNKNOWN_DATASET)
    return Dataset.from_rows(name, x, y, f, c, seed=seed, test_fraction=test_fraction)
