"""The MLP model shared by both backends: its shape, its parameter layout, its seeded init, and
the worker base class that implements the worker contract (PROTOCOL.md, "Worker contract").

Parameters are ONE flat float32 vector (``bucket_len`` = number of parameters), laid out layer
by layer: the weight matrix ``W_l`` of shape ``(n_in, n_out)`` row-major, then the bias ``b_l``
of shape ``(n_out,)``. Hidden layers use ReLU or tanh; the output layer feeds a softmax
cross-entropy loss. Both backends compute in float64 and round results to float32 once, so they
agree to float32 rounding (and :meth:`MLPWorker.apply` is bit-identical across backends).
"""

from __future__ import annotations

import asyncio
import math
import operator
import random
from array import array
from dataclasses import dataclass
from typing import Any, Generator

from .._compat import np
from ..errors import ConfigError, LocalProtocolError
from .data import Dataset

ACTIVATIONS = ("relu", "tanh")


@dataclass(frozen=True)
class MLPSpec:
    """The shape of an MLP.

    Attributes:
        layers: layer widths ``(n_features, *hidden, n_classes)``.
        activation: hidden activation, ``"relu"`` or ``"tanh"``.
    """

    layers: tuple[int, ...]
    activation: str = "relu"

    @classmethod
    def build(cls, n_features: int, hidden: Any, n_classes: int,
              activation: str = "relu") -> "MLPSpec":
        """Validate and build a spec.

        Raises:
            ConfigError: ``hidden`` is not a sequence of positive ints, or an unknown activation.
        """
        if isinstance(hidden, int) and not isinstance(hidden, bool):
            hidden = (hidden,)
        try:
            hidden = tuple(hidden)
        except TypeError:
            raise ConfigError("hidden", hidden, "expected a sequence of layer widths, "
                              "e.g. (32,)") from None
        for h in hidden:
            if not isinstance(h, int) or isinstance(h, bool) or h < 1:
                raise ConfigError("hidden", hidden, "every layer width must be an integer >= 1")
        if activation not in ACTIVATIONS:
            raise ConfigError("activation", activation, f"expected one of {ACTIVATIONS}")
        return cls((int(n_features), *hidden, int(n_classes)), activation)

    @property
    def name(self) -> str:
        """E.g. ``"mlp-64x32x10"`` (ReLU) or ``"mlp-64x32x10-tanh"``."""
        base = "mlp-" + "x".join(str(n) for n in self.layers)
        return base if self.activation == "relu" else f"{base}-{self.activation}"

    @property
    def param_count(self) -> int:
        """Number of parameters (the bucket length)."""
        return sum(a * b + b for a, b in zip(self.layers, self.layers[1:]))

    @property
    def macs_per_sample(self) -> int:
        """Multiply-adds of one forward pass (a backward pass costs about twice that)."""
        return sum(a * b for a, b in zip(self.layers, self.layers[1:]))

    def offsets(self) -> list[tuple[int, int, int, int]]:
        """Per layer ``(w_offset, b_offset, n_in, n_out)`` into the flat parameter vector."""
        out, off = [], 0
        for n_in, n_out in zip(self.layers, self.layers[1:]):
            out.append((off, off + n_in * n_out, n_in, n_out))
            off += n_in * n_out + n_out
        return out


def init_params(spec: MLPSpec, seed: int) -> array:
    """Seeded initial parameters, bit-identical on every rank and backend.

    Weights are uniform in ``[-a, a]``: ``a = sqrt(6 / n_in)`` (He) for a ReLU layer's input,
    ``a = sqrt(6 / (n_in + n_out))`` (Glorot) for tanh and for the output layer. Biases are 0.
    Values come from ``random.Random(seed)`` in layout order (only ``random()``, ``*``, ``-``
    and the correctly rounded ``sqrt``), computed in float64 and stored as float32.

    Returns:
        ``array('f')`` of length ``spec.param_count``.
    """
    rng = random.Random(seed)
    rand = rng.random
    out = array("f")
    last = len(spec.layers) - 2
    for k, (_, _, n_in, n_out) in enumerate(spec.offsets()):
        if spec.activation == "relu" and k < last:
            a = math.sqrt(6.0 / n_in)
        else:
            a = math.sqrt(6.0 / (n_in + n_out))
        out.extend([(2.0 * rand() - 1.0) * a for _ in range(n_in * n_out)])
        out.extend([0.0] * n_out)
    return out


def check_offset(offset: Any) -> int:
    """An assignment offset as an int (PROTOCOL.md: a uint32, indexing the dataset modulo).

    Raises:
        LocalProtocolError: not an integer.
    """
    try:
        return operator.index(offset)
    except TypeError:
        raise LocalProtocolError(f"offset must be an integer, got {offset!r}") from None


def check_len(what: str, vec: Any, bucket_len: int) -> None:
    """Raise LocalProtocolError unless ``len(vec) == bucket_len``."""
    try:
        n = len(vec)
    except TypeError:
        raise LocalProtocolError(f"{what} must be a float vector, got "
                                 f"{type(vec).__name__}") from None
    if n != bucket_len:
        raise LocalProtocolError(f"{what} has length {n}, expected bucket_len={bucket_len}")


def run_slices(slices: Generator[None, None, Any]) -> Any:
    """Run a slice generator to completion without yielding; return its value."""
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value


class MLPWorker:
    """Base of the MLP workers (the worker contract; see :mod:`tabcohort.model`).

    Subclasses store the parameters in their own vector type and implement ``_grad_slices``,
    ``_set``, ``params``, ``apply``, ``evaluate`` and ``evaluate_loss``.

    Attributes:
        dataset: the shared :class:`~tabcohort.model.data.Dataset`.
        batch: samples per bucket.
        bucket_len: number of float32 parameters (= gradient length).
        model: the model name, e.g. ``"mlp-64x32x10"``.
        backend: ``"numpy"`` or ``"python"``.
        mlp: the :class:`MLPSpec`.
        seed: the init seed.
    """

    backend = ""

    def __init__(self, dataset: Dataset, *, hidden: Any = (32,), activation: str = "relu",
                 batch: int = 32, seed: int = 0) -> None:
        if not isinstance(dataset, Dataset):
            raise ConfigError("dataset", dataset, "expected a tabcohort.model.data.Dataset")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ConfigError("batch", batch, "expected an integer >= 1")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError("seed", seed, "expected an integer")
        self.dataset = dataset
        self.mlp = MLPSpec.build(dataset.n_features, hidden, dataset.n_classes, activation)
        self.batch = batch
        self.seed = seed
        self.bucket_len = self.mlp.param_count
        self.model = self.mlp.name
        self._set(init_params(self.mlp, seed))

    def spec(self) -> dict[str, Any]:
        """The fields that describe the model, for the job hash.

        Returns:
            ``{"kind": "mlp", "name", "layers": [...], "activation", "loss": "softmax_xent",
            "dtype": "float32", "bucket_len", "init_seed"}``. The backend is not included: both
            backends compute the same model.
        """
        return {"kind": "mlp", "name": self.model, "layers": list(self.mlp.layers),
                "activation": self.mlp.activation, "loss": "softmax_xent",
                "dtype": "float32", "bucket_len": self.bucket_len, "init_seed": self.seed}

    async def grads(self, offset: int, samples: int | None = None) -> tuple[float, Any]:
        """Mean loss and mean gradient over ``samples`` training samples (default ``batch``: the
        rank's share, PROTOCOL.md "Shares"), yielding between slices.

        Sample ``k`` is training row ``(offset + k) % train_len``. Between slices of work the
        coroutine awaits ``asyncio.sleep(0)`` so the event loop (heartbeats) keeps running.
        The parameters are captured when the call starts: an ``apply`` or ``set_params``
        while it is suspended does not affect this result.

        Args:
            offset: the assignment offset (an int, normally a uint32).
            samples: the share: how many consecutive samples, >= 1.

        Returns:
            ``(loss, g)``: the mean softmax cross-entropy (float, nats) and the mean gradient,
            float32, shape ``(bucket_len,)`` in this backend's vector type.

        Raises:
            LocalProtocolError: ``offset`` is not an integer, or ``samples`` is not >= 1.
        """
        slices = self._grad_slices(check_offset(offset), _check_samples(samples, self.batch))
        while True:
            try:
                next(slices)
            except StopIteration as done:
                return done.value
            await asyncio.sleep(0)

    def grads_sync(self, offset: int, samples: int | None = None) -> tuple[float, Any]:
        """:meth:`grads` without yielding to the event loop (same result)."""
        return run_slices(self._grad_slices(check_offset(offset), _check_samples(samples, self.batch)))

    async def local_grads(self, offset: int, samples: int, steps: int, optimizer: str = "sgd",
                          lr: float = 0.1, should_stop: Any = None) -> tuple[float, Any] | None:
        """H inner steps from the current parameters and their pseudo-gradient, yielding to the
        event loop between slices (docs/PROTOCOL.md, "Local steps and optimizer state").

        The steps run on a scratch copy of the model (:mod:`tabcohort.model.local`): this
        worker's parameters are captured when the call starts and never changed by it.

        Args:
            offset: the window's first sample (an int, normally a uint32).
            samples: samples per inner step (the share), >= 1; the window is ``steps * samples``.
            steps: H, >= 1.
            optimizer: ``sgd`` or ``adam``; lr: its learning rate.
            should_stop: optional callable checked between inner steps; True abandons the work.

        Returns:
            ``(mean inner loss, pseudo-gradient)``: float32, shape ``(bucket_len,)``: the captured
            parameters minus the parameters after the H steps; or None when abandoned.

        Raises:
            LocalProtocolError: a bad offset, share, H, optimizer or lr.
        """
        slices = self._local(offset, samples, steps, optimizer, lr, should_stop)
        while True:
            try:
                next(slices)
            except StopIteration as done:
                return done.value
            await asyncio.sleep(0)

    def local_grads_sync(self, offset: int, samples: int, steps: int, optimizer: str = "sgd",
                         lr: float = 0.1) -> tuple[float, Any]:
        """:meth:`local_grads` without yielding (same result)."""
        return run_slices(self._local(offset, samples, steps, optimizer, lr, None))

    def _local(self, offset: Any, samples: Any, steps: Any, optimizer: str, lr: float,
               should_stop: Any) -> Generator[None, None, Any]:
        from .local import check_steps, local_slices

        off, n, h = check_offset(offset), _check_samples(samples, self.batch), check_steps(steps)
        scratch = self._take_scratch()
        try:
            return (yield from local_slices(scratch, self.params(), off, n, h, optimizer, lr,
                                            lambda w, o, k: w._grad_slices(o, k), should_stop))
        finally:
            self._scratch_pool.append(scratch)

    def _take_scratch(self) -> "MLPWorker":
        """A scratch worker of the same model (one per concurrent local computation)."""
        pool = self.__dict__.setdefault("_scratch_pool", [])
        return pool.pop() if pool else self._scratch_worker()

    def _scratch_worker(self) -> "MLPWorker":
        """A new instance of this model over the same dataset (overridden where the
        constructor needs more, e.g. the js kernels)."""
        return type(self)(self.dataset, hidden=self.mlp.layers[1:-1], activation=self.mlp.activation,
                          batch=self.batch, seed=self.seed)

    def set_params(self, vec: Any) -> None:
        """Replace the parameters (a copy is stored, rounded to float32).

        Args:
            vec: numpy array, ``array.array('f'|'d')`` or list of floats, length ``bucket_len``.

        Raises:
            LocalProtocolError: wrong length or not a vector.
        """
        check_len("params", vec, self.bucket_len)
        self._set(vec)

    def evaluate(self) -> float:  # pragma: no cover - abstract
        """Accuracy in [0, 1] of the current parameters on the held-out split."""
        raise NotImplementedError

    def _set(self, vec: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _grad_slices(self, offset: int, n: int) -> Generator[None, None, tuple[float, Any]]:
        raise NotImplementedError  # pragma: no cover - abstract

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(model={self.model!r}, batch={self.batch}, "
                f"bucket_len={self.bucket_len}, dataset={self.dataset.name!r})")


def _check_samples(samples: Any, default: int) -> int:
    """A share as a positive int (``None``: the worker's batch)."""
    if samples is None:
        return default
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise LocalProtocolError(f"samples must be an integer >= 1, got {samples!r}")
    return samples


def as_float_list(vec: Any) -> list[float]:
    """Any vector (numpy array, ``array``, list) as a list of Python floats."""
    if np is not None and isinstance(vec, np.ndarray):
        return vec.astype(np.float64).ravel().tolist()
    if isinstance(vec, array):
        return vec.tolist()
    return [float(v) for v in vec]
