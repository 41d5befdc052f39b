"""Workers and datasets (PROTOCOL.md, "Worker contract"; docs/INTERFACES.md, "Worker").

A worker computes gradients of one model over one shared dataset:

- ``batch``: samples per bucket; ``bucket_len``: number of float32 parameters;
  ``model``: name such as ``"mlp-64x32x10"``; ``backend``: ``"numpy"`` or ``"python"``.
- ``await grads(offset, samples=None) -> (loss, g)``: mean loss and mean gradient (float32, shape
  ``(bucket_len,)``) over training rows ``(offset + k) % train_len`` for ``k < batch``;
  yields to the event loop between slices. ``grads_sync(offset, samples=None)``: the same, not awaited.
- ``apply(avg, lr)``: ``params = float32(params - lr * avg)`` (run by the leader only).
- ``params()`` (a copy), ``set_params(vec)``, ``evaluate()`` (held-out accuracy in [0, 1]),
  ``evaluate_loss()``, ``spec()`` (fields for the job hash).

Vectors are numpy float32 arrays on the numpy backend and ``array('f')`` on the Python backend;
every method that takes a vector accepts either, or a list of floats.
"""

from __future__ import annotations

from typing import Any

from .._compat import np
from ..errors import ConfigError
from .backend_py import PythonMLPWorker
from .data import Dataset, load_dataset
from .mlp import MLPSpec, MLPWorker, init_params

__all__ = ["Dataset", "MLPSpec", "MLPWorker", "PythonMLPWorker", "NumpyMLPWorker",
           "init_params", "load_dataset", "make_worker", "DIGITS_DEFAULTS"]

#: Single-process SGD settings found for ``digits`` (tests/unit/test_model_train.py): held-out
#: accuracy first reached 95 % after 70-180 steps over 3 data seeds x 3 init seeds (checked
#: every 10 steps; about 90 with seed 0); ``steps`` is the bound the test allows.
DIGITS_DEFAULTS = {"hidden": (32,), "activation": "relu", "batch": 128, "lr": 0.5, "steps": 300}

BACKENDS = ("auto", "numpy", "python")


def make_worker(dataset: Dataset, *, hidden: Any = (32,), batch: int = 32, seed: int = 0,
                backend: str = "auto", activation: str = "relu") -> MLPWorker:
    """Build the MLP worker for ``dataset``.

    Args:
        dataset: the shared :class:`Dataset` (from :func:`load_dataset`).
        hidden: hidden layer widths, e.g. ``(32,)``; ``()`` is softmax regression.
        batch: samples per bucket.
        seed: init seed; the same seed gives bit-identical parameters on every rank and backend.
        backend: ``"numpy"``, ``"python"``, or ``"auto"`` (numpy if importable, else python).
        activation: hidden activation, ``"relu"`` or ``"tanh"``.

    Returns:
        A :class:`NumpyMLPWorker` or :class:`PythonMLPWorker`.

    Raises:
        ConfigError: unknown backend, ``"numpy"`` without numpy, or bad model arguments.
    """
    if backend not in BACKENDS:
        raise ConfigError("backend", backend, f"expected one of {BACKENDS}")
    if backend == "auto":
        backend = "numpy" if np is not None else "python"
    if backend == "numpy":
        if np is None:
            raise ConfigError("backend", "numpy", "numpy is not importable in this process "
                              "(use backend='python' or 'auto')")
        from .backend_np import NumpyMLPWorker
        cls: type[MLPWorker] = NumpyMLPWorker
    else:
        cls = PythonMLPWorker
    return cls(dataset, hidden=hidden, activation=activation, batch=batch, seed=seed)


def __getattr__(name: str) -> Any:
    if name == "NumpyMLPWorker":  # imported lazily: the module needs numpy
        from .backend_np import NumpyMLPWorker
        return NumpyMLPWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
