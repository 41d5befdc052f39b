"""The pure-Python backend of the MLP (for a tab without numpy).

Plain indexed loops over lists of floats (the fastest style under Pyodide, which runs them about
1.75x slower than native CPython). Weights are unpacked from the flat float32 vector into a list
of rows per layer (``W[i][j]`` = input ``i`` to output ``j``) once per parameter update.
Arithmetic is float64 (Python floats); results are rounded to float32 once.
"""

from __future__ import annotations

from array import array
from math import exp, log, tanh
from typing import Any, Generator, Sequence

from ..errors import ConfigError
from .mlp import MLPSpec, MLPWorker, as_float_list, check_len

Layers = list[tuple[list[list[float]], list[float]]]

#: Multiply-adds of forward + backward work per slice of :meth:`PythonMLPWorker.grads`
#: (about 1.7 ms on native CPython, about 3 ms under Pyodide, for the digits model).
SLICE_MACS = 25_000


def unpack(spec: MLPSpec, flat: Sequence[float]) -> Layers:
    """Split a flat parameter sequence into per-layer ``(rows of W, b)`` lists of floats."""
    layers = []
    for w_off, b_off, n_in, n_out in spec.offsets():
        rows = [list(flat[w_off + i * n_out:w_off + (i + 1) * n_out]) for i in range(n_in)]
        layers.append((rows, list(flat[b_off:b_off + n_out])))
    return layers


def _forward(layers: Layers, relu: bool, x: list[float]) -> list[list[float]]:
    """Activations of every layer for one sample: ``[x, h_1, ..., logits]``."""
    acts = [x]
    h = x
    last = len(layers) - 1
    for k in range(len(layers)):
        rows, b = layers[k]
        z = b[:]
        n_out = len(z)
        for i in range(len(h)):
            hi = h[i]
            if hi != 0.0:
                row = rows[i]
                for j in range(n_out):
                    z[j] += hi * row[j]
        if k < last:
            if relu:
                for j in range(n_out):
                    if z[j] < 0.0:
                        z[j] = 0.0
            else:
                for j in range(n_out):
                    z[j] = tanh(z[j])
        acts.append(z)
        h = z
    return acts


def _accumulate(layers: Layers, relu: bool, x: list[float], label: int,
                g_layers: Layers) -> float:
    """Forward and backward for one sample; add its gradient into ``g_layers``; return its loss."""
    acts = _forward(layers, relu, x)
    z = acts[-1]
    n = len(z)
    m = max(z)
    e = [0.0] * n
    s = 0.0
    for j in range(n):
        v = exp(z[j] - m)
        e[j] = v
        s += v
    loss = log(s) - (z[label] - m)
    delta = [0.0] * n
    for j in range(n):
        delta[j] = e[j] / s
    delta[label] -= 1.0
    for k in range(len(layers) - 1, -1, -1):
        rows, _ = layers[k]
        g_rows, g_b = g_layers[k]
        h = acts[k]
        n_out = len(delta)
        for j in range(n_out):
            g_b[j] += delta[j]
        need_dh = k > 0
        dh = [0.0] * len(h) if need_dh else delta
        for i in range(len(h)):
            hi = h[i]
            if hi != 0.0:
                g_row = g_rows[i]
                for j in range(n_out):
                    g_row[j] += hi * delta[j]
            elif relu:
                continue  # ReLU output 0: no weight gradient, no gradient to pass down
            if need_dh:
                row = rows[i]
                acc = 0.0
                for j in range(n_out):
                    acc += row[j] * delta[j]
                dh[i] = acc if relu else acc * (1.0 - hi * hi)
        delta = dh
    return loss


def _zeros_like(layers: Layers) -> Layers:
    return [([[0.0] * len(b) for _ in rows], [0.0] * len(b)) for rows, b in layers]


def _flatten(g_layers: Layers, scale: float) -> array:
    out = array("f")
    for g_rows, g_b in g_layers:
        for g_row in g_rows:
            out.extend([v / scale for v in g_row])
        out.extend([v / scale for v in g_b])
    return out


def loss_and_grad(spec: MLPSpec, params: Sequence[float], xs: Sequence[list[float]],
                  ys: Sequence[int]) -> tuple[float, list[float]]:
    """Mean loss and mean gradient in float64 (for finite-difference checks).

    Args:
        spec: the model shape.
        params: flat parameters (any floats; not rounded to float32), length ``param_count``.
        xs: samples, each a list of ``n_features`` floats.
        ys: integer labels.

    Returns:
        ``(loss, grad)``: float, and a list of ``param_count`` floats.
    """
    layers = unpack(spec, list(params))
    g = _zeros_like(layers)
    relu = spec.activation == "relu"
    total = 0.0
    for x, y in zip(xs, ys):
        total += _accumulate(layers, relu, list(x), int(y), g)
    n = len(ys)
    flat: list[float] = []
    for g_rows, g_b in g:
        for g_row in g_rows:
            flat.extend(v / n for v in g_row)
        flat.extend(v / n for v in g_b)
    return total / n, flat


class PythonMLPWorker(MLPWorker):
    """The MLP worker in pure Python: vectors are ``array('f')``.

    Args:
        dataset: the shared dataset.
        hidden: hidden layer widths, e.g. ``(32,)``.
        activation: ``"relu"`` or ``"tanh"``.
        batch: samples per bucket.
        seed: init seed (:func:`~tabcohort.model.mlp.init_params`).
        yield_every: samples per slice of :meth:`grads` between yields to the event loop;
            default ``max(1, SLICE_MACS // (3 * macs_per_sample))`` (3 for the digits model).

    Raises:
        ConfigError: bad arguments.
    """

    backend = "python"

    def __init__(self, dataset, *, hidden=(32,), activation="relu", batch=32, seed=0,
                 yield_every: int | None = None) -> None:
        super().__init__(dataset, hidden=hidden, activation=activation, batch=batch, seed=seed)
        if yield_every is None:
            yield_every = max(1, SLICE_MACS // (3 * self.mlp.macs_per_sample))
        if not isinstance(yield_every, int) or isinstance(yield_every, bool) or yield_every < 1:
            raise ConfigError("yield_every", yield_every, "expected an integer >= 1")
        self.yield_every = yield_every

    def _set(self, vec: Any) -> None:
        if isinstance(vec, array) and vec.typecode == "f":
            self._p = array("f", vec)
        else:
            self._p = array("f", as_float_list(vec))
        self._layers = unpack(self.mlp, self._p.tolist())

    def params(self) -> array:
        """A copy of the parameters: ``array('f')`` of length ``bucket_len``."""
        return array("f", self._p)

    def apply(self, avg: Any, lr: float) -> None:
        """One SGD step: ``params = float32(params - lr * avg)``, computed in float64.

        Args:
            avg: the averaged gradient, any vector type, length ``bucket_len``.
            lr: learning rate.

        Raises:
            LocalProtocolError: wrong length.
        """
        check_len("avg", avg, self.bucket_len)
        g = as_float_list(avg)
        p = self._p.tolist()
        lr = float(lr)
        for i in range(len(p)):
            p[i] -= lr * g[i]
        self._p = array("f", p)
        self._layers = unpack(self.mlp, self._p.tolist())

    def _grad_slices(self, offset: int, n: int) -> Generator[None, None, tuple[float, array]]:
        ds = self.dataset
        f, n_train = ds.n_features, ds.train_len
        x_all, y_all = ds.x_train, ds.y_train
        layers, relu = self._layers, self.mlp.activation == "relu"
        g = _zeros_like(layers)
        total = 0.0
        start = offset % n_train
        every = self.yield_every
        for k in range(n):
            if k and k % every == 0:
                yield
            i = (start + k) % n_train
            total += _accumulate(layers, relu, x_all[i * f:(i + 1) * f].tolist(), y_all[i], g)
        return total / n, _flatten(g, float(n))

    def _test_logits(self):
        ds = self.dataset
        f = ds.n_features
        layers, relu = self._layers, self.mlp.activation == "relu"
        x_all = ds.x_test
        for i in range(ds.test_len):
            yield _forward(layers, relu, x_all[i * f:(i + 1) * f].tolist())[-1], ds.y_test[i]

    def evaluate(self) -> float:
        """Accuracy in [0, 1] of the current parameters on the held-out split (argmax, first
        maximum on ties)."""
        correct = 0
        for z, y in self._test_logits():
            if z.index(max(z)) == y:
                correct += 1
        return correct / self.dataset.test_len

    def evaluate_loss(self) -> float:
        """Mean softmax cross-entropy (nats) on the held-out split."""
        total = 0.0
        for z, y in self._test_logits():
            m = max(z)
            s = 0.0
            for v in z:
                s += exp(v - m)
            total += log(s) - (z[y] - m)
        return total / self.dataset.test_len
