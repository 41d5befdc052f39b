"""The numpy backend of the MLP.

Computes in float64 on views of one flat float64 copy of the parameters and rounds results to
float32 once, so it agrees with the pure-Python backend to float32 rounding. Only import this
module when numpy is importable (:data:`tabcohort._compat.np` is not ``None``).
"""

from __future__ import annotations

from typing import Any, Generator

from .._compat import np
from ..errors import ConfigError
from .mlp import MLPSpec, MLPWorker, check_len

#: Samples per slice of :meth:`NumpyMLPWorker.grads` between yields to the event loop, at most.
CHUNK_SAMPLES = 1024
#: Multiply-accumulates per slice, at most (forward; the backward pass costs about twice that).
#: For a 1.1M-parameter MLP: 238 samples, about 18 ms here (1024 samples: 69 ms quiet, seconds
#: on a loaded machine, when no beat went out and a joining rank took the room for leaderless:
#: PROTOCOL.md, "Worker contract"); fewer samples per slice cost more in all (14: 4x the time
#: of 1024, each slice reading every weight again), 238 about 6 % more.
SLICE_MACS = 1 << 28


def unpack(spec: MLPSpec, flat: Any) -> list[tuple[Any, Any]]:
    """Per-layer ``(W, b)`` views of a flat float64 array: W shape (n_in, n_out), b (n_out,)."""
    return [(flat[w:w + n_in * n_out].reshape(n_in, n_out), flat[b:b + n_out])
            for w, b, n_in, n_out in spec.offsets()]


def _forward(layers: list, relu: bool, X: Any) -> list:
    """Activations ``[X, H_1, ..., logits]``, each float64 of shape (n, width)."""
    acts = [X]
    H = X
    last = len(layers) - 1
    for k, (W, b) in enumerate(layers):
        Z = H @ W + b
        if k < last:
            Z = np.maximum(Z, 0.0) if relu else np.tanh(Z)
        acts.append(Z)
        H = Z
    return acts


def _log_softmax(Z: Any) -> Any:
    Z = Z - Z.max(axis=1, keepdims=True)
    return Z - np.log(np.exp(Z).sum(axis=1, keepdims=True))


def _loss_grad_sums(spec: MLPSpec, layers: list, X: Any, y: Any) -> tuple[float, Any]:
    """Summed (not averaged) loss and gradient over the rows of ``X`` (float64)."""
    relu = spec.activation == "relu"
    acts = _forward(layers, relu, X)
    logp = _log_softmax(acts[-1])
    rows = np.arange(len(y))
    loss_sum = float(-logp[rows, y].sum())
    delta = np.exp(logp)
    delta[rows, y] -= 1.0
    parts = []
    for k in range(len(layers) - 1, -1, -1):
        W, _ = layers[k]
        H = acts[k]
        parts.append(delta.sum(axis=0))
        parts.append((H.T @ delta).ravel())
        if k > 0:
            dH = delta @ W.T
            delta = dH * (H > 0.0) if relu else dH * (1.0 - H * H)
    return loss_sum, np.concatenate(parts[::-1])


def loss_and_grad(spec: MLPSpec, params: Any, X: Any, y: Any) -> tuple[float, Any]:
    """Mean loss and mean gradient in float64 (for finite-difference checks).

    Args:
        spec: the model shape.
        params: flat parameters, any float dtype, shape (param_count,); not rounded to float32.
        X: samples, shape (n, n_features).
        y: integer labels, shape (n,).

    Returns:
        ``(loss, grad)``: float, and float64 array of shape (param_count,).
    """
    flat = np.asarray(params, dtype=np.float64)
    s, g = _loss_grad_sums(spec, unpack(spec, flat), np.asarray(X, dtype=np.float64),
                           np.asarray(y))
    return s / len(y), g / len(y)


class NumpyMLPWorker(MLPWorker):
    """The MLP worker on numpy: vectors are ``np.ndarray`` of dtype float32.

    Args:
        dataset: the shared dataset.
        hidden: hidden layer widths, e.g. ``(32,)``.
        activation: ``"relu"`` or ``"tanh"``.
        batch: samples per bucket.
        seed: init seed (:func:`~tabcohort.model.mlp.init_params`).
        chunk: samples per slice of :meth:`grads` between yields to the event loop (default:
            as many as :data:`SLICE_MACS` allows, at most :data:`CHUNK_SAMPLES`).

    Raises:
        ConfigError: numpy is not importable, or bad arguments.
    """

    backend = "numpy"

    def __init__(self, dataset, *, hidden=(32,), activation="relu", batch=32, seed=0,
                 chunk: int | None = None) -> None:
        if np is None:
            raise ConfigError("backend", "numpy", "numpy is not importable in this process")
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ConfigError("chunk", chunk, "expected an integer >= 1")
        super().__init__(dataset, hidden=hidden, activation=activation, batch=batch, seed=seed)
        self.chunk = chunk if chunk is not None else \
            max(1, min(CHUNK_SAMPLES, SLICE_MACS // max(1, self.mlp.macs_per_sample)))
        self._X, self._y, self._X_test, self._y_test = dataset.numpy()

    def _set(self, vec: Any) -> None:
        self._p = np.array(vec, dtype=np.float32).reshape(-1)
        self._p64 = self._p.astype(np.float64)
        self._layers = unpack(self.mlp, self._p64)

    def params(self) -> Any:
        """A copy of the parameters: float32 array of shape (bucket_len,)."""
        return self._p.copy()

    def apply(self, avg: Any, lr: float) -> None:
        """One SGD step: ``params = float32(params - lr * avg)``, computed in float64.

        Args:
            avg: the averaged gradient, any vector type, length ``bucket_len``.
            lr: learning rate.

        Raises:
            LocalProtocolError: wrong length.
        """
        check_len("avg", avg, self.bucket_len)
        # blocked: the same operations per element as float32(p64 - lr * float64(avg)), without
        # full-length float64 temporaries; new arrays (a gradient being computed between its
        # slices keeps reading the parameters it started with)
        g = np.asarray(avg).reshape(-1)
        p64, lr = self._p64, float(lr)
        n, blk = len(p64), 1 << 16
        out = np.empty(n, dtype=np.float32)
        tmp = np.empty(min(n, blk), dtype=np.float64)
        for a in range(0, n, blk):
            b = min(n, a + blk)
            t = tmp[:b - a]
            t[...] = g[a:b]
            t *= lr
            np.subtract(p64[a:b], t, out=t)
            out[a:b] = t
        self._p = out
        self._p64 = out.astype(np.float64)
        self._layers = unpack(self.mlp, self._p64)

    def _grad_slices(self, offset: int, n: int) -> Generator[None, None, tuple[float, Any]]:
        n_train = self.dataset.train_len
        start = offset % n_train
        layers = self._layers  # captured: an apply() between slices must not mix versions
        total, g = 0.0, None
        for lo in range(0, n, self.chunk):
            if lo:
                yield
            hi = min(n, lo + self.chunk)
            idx = (start + np.arange(lo, hi)) % n_train
            s, gs = _loss_grad_sums(self.mlp, layers,
                                    self._X[idx].astype(np.float64), self._y[idx])
            total += s
            g = gs if g is None else g + gs
        return total / n, (g / n).astype(np.float32)

    def _test_logits(self) -> Any:
        relu = self.mlp.activation == "relu"
        return _forward(self._layers, relu, self._X_test.astype(np.float64))[-1]

    def evaluate(self) -> float:
        """Accuracy in [0, 1] of the current parameters on the held-out split (argmax, first
        maximum on ties)."""
        pred = self._test_logits().argmax(axis=1)
        return float((pred == self._y_test).mean())

    def evaluate_loss(self) -> float:
        """Mean softmax cross-entropy (nats) on the held-out split."""
        logp = _log_softmax(self._test_logits())
        return float(-logp[np.arange(self.dataset.test_len), self._y_test].mean())
