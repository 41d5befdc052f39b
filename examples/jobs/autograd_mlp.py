"""An MLP on digits whose gradients come from ``autograd`` (pip install 'tabcohort[jobs]'):
the job writes only the forward pass and the loss in plain numpy; ``autograd.grad`` derives the
gradient (Maclaurin, Duvenaud and Adams, "Autograd: Effortless gradients in numpy"). A numpy
job only: a tab runs it where Pyodide has numpy (autograd installs there as a pure-Python wheel).

    tabcohort serve --job examples/jobs/autograd_mlp.py --lr 0.5
"""

import math
import random

SIZES = (64, 32, 10)
SPEC = {"name": "autograd-mlp-64x32x10", "sizes": list(SIZES)}
SHAPES = [(a, b) for a, b in zip(SIZES, SIZES[1:])]
BUCKET_LEN = sum(a * b + b for a, b in SHAPES)
#: the factory's backends: numpy only (autograd differentiates numpy code); said here, so the
#: server does not ask for a pure-Python worker and warn that the factory refused one
BACKENDS = ("numpy",)


def load_data():
    import numpy as np
    from sklearn.datasets import load_digits
    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    x, y = (d.data / 16.0).astype(np.float32)[order], d.target.astype(np.int32)[order]
    n = len(y) // 5
    return {"x_train": x[n:], "y_train": y[n:], "x_test": x[:n], "y_test": y[:n]}


class AutogradMLP:
    backend = "numpy"

    def __init__(self, data, batch, seed):
        import autograd.numpy as anp
        from autograd import grad
        import numpy as np
        self.np, self.batch, self.bucket_len = np, batch, BUCKET_LEN
        self.x, self.y = data["x_train"].numpy().astype(np.float64), data["y_train"].numpy()
        self.xt, self.yt = data["x_test"].numpy().astype(np.float64), data["y_test"].numpy()
        rng = random.Random(seed)
        p = []
        for a, b in SHAPES:
            lim = math.sqrt(6.0 / a)
            p += [(2 * rng.random() - 1) * lim for _ in range(a * b)] + [0.0] * b
        self.p = np.array(p, dtype=np.float32)

        def logits(p, x):
            o = 0
            for k, (a, b) in enumerate(SHAPES):
                w, bias = anp.reshape(p[o:o + a * b], (a, b)), p[o + a * b:o + a * b + b]
                o += a * b + b
                x = anp.dot(x, w) + bias
                if k < len(SHAPES) - 1:
                    x = anp.maximum(x, 0.0)
            return x

        def loss(p, x, y):
            z = logits(p, x)
            z = z - anp.max(z, axis=1, keepdims=True)
            logp = z - anp.log(anp.sum(anp.exp(z), axis=1, keepdims=True))
            return -anp.mean(logp[anp.arange(len(y)), y])

        self._logits, self._loss, self._grad = logits, loss, grad(loss)

    def params(self):
        return self.p.copy()

    def set_params(self, v):
        self.p = self.np.array(v, dtype=self.np.float32)

    def grads(self, offset, samples):
        rows = (offset + self.np.arange(samples)) % len(self.y)
        p = self.p.astype(self.np.float64)
        x, y = self.x[rows], self.y[rows]
        return float(self._loss(p, x, y)), self._grad(p, x, y).astype(self.np.float32)

    def evaluate(self):
        z = self._logits(self.p.astype(self.np.float64), self.xt)
        return float((z.argmax(axis=1) == self.yt).mean())

    def evaluate_loss(self):
        return float(self._loss(self.p.astype(self.np.float64), self.xt, self.yt))


def make_worker(data, *, batch, seed, backend):
    if backend != "numpy":
        raise ValueError("this job needs numpy (autograd differentiates numpy code)")
    return AutogradMLP(data, batch, seed)
