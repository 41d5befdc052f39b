"""A small convolutional network on scikit-learn's digits as 8x8 images (a tabcohort job:
README "Write your own job"; the worker contract is docs/PROTOCOL.md, "Worker contract").

Model: one 3x3 convolution with ``CHANNELS`` filters (valid padding: 6x6 outputs), ReLU, then a
dense layer to 10 classes and softmax cross-entropy. Two paths compute the same function: numpy
(im2col, matrix products) and pure Python (tabs without numpy). Parameters are one flat float32
vector: conv weights ``(9, C)`` row-major, conv bias ``(C,)``, dense weights ``(36*C, 10)``
row-major (feature ``p*C + c`` for output position ``p`` and channel ``c``), dense bias ``(10,)``.

    tabcohort serve --job examples/jobs/cnn_digits.py --lr 0.3
"""

import math
import random
from array import array
from operator import mul

CHANNELS = 6
SPEC = {"name": "cnn-digits-3x3x6", "channels": CHANNELS, "kernel": 3, "image": [8, 8], "classes": 10}
N_POS, N_FEAT, N_CLS = 36, 36 * CHANNELS, 10
BUCKET_LEN = 9 * CHANNELS + CHANNELS + N_FEAT * N_CLS + N_CLS


def load_data():
    """Server side only: digits (1797 images, values 0..16 scaled to [0, 1]), a seeded 80/20 split."""
    import numpy as np
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    n_test = len(y) // 5
    test, train = order[:n_test], order[n_test:]
    return {"x_train": x[train], "y_train": y[train], "x_test": x[test], "y_test": y[test]}


def init_params(seed):
    rng = random.Random(seed)
    a1, a2 = math.sqrt(6.0 / 9), math.sqrt(6.0 / (N_FEAT + N_CLS))
    p = [(2 * rng.random() - 1) * a1 for _ in range(9 * CHANNELS)] + [0.0] * CHANNELS
    p += [(2 * rng.random() - 1) * a2 for _ in range(N_FEAT * N_CLS)] + [0.0] * N_CLS
    return array("f", p)


def patches_of(img):
    """The 36 3x3 patches (each 9 values, row-major) of one 8x8 image given flat."""
    return [[img[(r + i) * 8 + c + j] for i in range(3) for j in range(3)] for r in range(6) for c in range(6)]


class PythonCNN:
    backend = "python"

    def __init__(self, data, batch, seed):
        self.batch, self.bucket_len = batch, BUCKET_LEN
        xt, xe = data["x_train"], data["x_test"]
        self.train = [patches_of(xt.data[i * 64:(i + 1) * 64]) for i in range(xt.shape[0])]
        self.test = [patches_of(xe.data[i * 64:(i + 1) * 64]) for i in range(xe.shape[0])]
        self.y_train, self.y_test = list(data["y_train"].data), list(data["y_test"].data)
        self.set_params(init_params(seed))

    def set_params(self, v):
        self.p = array("f", v)
        p, C = list(self.p), CHANNELS
        self.wc = [p[c:9 * C:C] for c in range(C)]                # per channel, 9 weights
        self.bc = p[9 * C:10 * C]
        o = 10 * C
        self.w2 = [p[o + f * N_CLS:o + (f + 1) * N_CLS] for f in range(N_FEAT)]   # per feature
        self.w2c = [p[o + j:o + N_FEAT * N_CLS:N_CLS] for j in range(N_CLS)]       # per class
        self.b2 = p[o + N_FEAT * N_CLS:]

    def params(self):
        return array("f", self.p)

    def _forward(self, pats):
        h = [max(0.0, b + sum(map(mul, pt, w))) for pt in pats for w, b in zip(self.wc, self.bc)]
        z = [b + sum(map(mul, h, w)) for w, b in zip(self.w2c, self.b2)]
        m = max(z)
        e = [math.exp(v - m) for v in z]
        s = sum(e)
        return h, [v / s for v in e]

    def grads(self, offset, samples):
        C, n = CHANNELS, len(self.train)
        gwc = [[0.0] * 9 for _ in range(C)]
        gbc = [0.0] * C
        gw2c = [[0.0] * N_FEAT for _ in range(N_CLS)]
        gb2 = [0.0] * N_CLS
        loss = 0.0
        for k in range(samples):
            i = (offset + k) % n
            pats, y = self.train[i], self.y_train[i]
            h, pr = self._forward(pats)
            loss -= math.log(max(pr[y], 1e-300))
            d = pr[:]
            d[y] -= 1.0
            for j in range(N_CLS):
                dj = d[j]
                gb2[j] += dj
                gw2c[j] = [g + dj * hv for g, hv in zip(gw2c[j], h)]
            for f, hv in enumerate(h):
                if hv > 0.0:
                    dh = sum(map(mul, d, self.w2[f]))
                    c = f % C
                    gbc[c] += dh
                    gwc[c] = [g + dh * x for g, x in zip(gwc[c], pats[f // C])]
        s = 1.0 / samples
        g = [gwc[c][k] * s for k in range(9) for c in range(C)] + [v * s for v in gbc]
        g += [gw2c[j][f] * s for f in range(N_FEAT) for j in range(N_CLS)] + [v * s for v in gb2]
        return loss * s, array("f", g)

    def evaluate(self):
        ok = 0
        for pats, y in zip(self.test, self.y_test):
            pr = self._forward(pats)[1]
            ok += pr.index(max(pr)) == y
        return ok / len(self.test)

    def evaluate_loss(self):
        return sum(-math.log(max(self._forward(p)[1][y], 1e-300)) for p, y in zip(self.test, self.y_test)) / len(self.test)


class NumpyCNN:
    backend = "numpy"

    def __init__(self, data, batch, seed):
        import numpy as np
        self.np = np
        self.batch, self.bucket_len = batch, BUCKET_LEN
        idx = np.array([[(r + i) * 8 + c + j for i in range(3) for j in range(3)] for r in range(6) for c in range(6)])
        self.train = data["x_train"].numpy().reshape(-1, 64)[:, idx].astype(np.float64)   # (n, 36, 9)
        self.test = data["x_test"].numpy().reshape(-1, 64)[:, idx].astype(np.float64)
        self.y_train = data["y_train"].numpy().astype(np.int64)
        self.y_test = data["y_test"].numpy().astype(np.int64)
        self.set_params(init_params(seed))

    def set_params(self, v):
        np, C = self.np, CHANNELS
        self.p = np.array(v, dtype=np.float32)
        p = self.p.astype(np.float64)
        self.wc, self.bc = p[:9 * C].reshape(9, C), p[9 * C:10 * C]
        o = 10 * C
        self.w2, self.b2 = p[o:o + N_FEAT * N_CLS].reshape(N_FEAT, N_CLS), p[o + N_FEAT * N_CLS:]

    def params(self):
        return self.p.copy()

    def _forward(self, x):
        np = self.np
        a = x @ self.wc + self.bc                          # (n, 36, C)
        h = np.maximum(a, 0.0).reshape(len(x), N_FEAT)
        z = h @ self.w2 + self.b2
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return a, h, e / e.sum(axis=1, keepdims=True)

    def grads(self, offset, samples):
        np = self.np
        rows = (offset + np.arange(samples)) % len(self.train)
        x, y = self.train[rows], self.y_train[rows]
        a, h, pr = self._forward(x)
        loss = -np.log(np.maximum(pr[np.arange(samples), y], 1e-300)).mean()
        d = pr.copy()
        d[np.arange(samples), y] -= 1.0
        d /= samples
        gw2, gb2 = h.T @ d, d.sum(axis=0)
        dh = (d @ self.w2.T).reshape(samples, N_POS, CHANNELS) * (a > 0)
        gwc = np.einsum("npk,npc->kc", x, dh)
        gbc = dh.sum(axis=(0, 1))
        g = np.concatenate([gwc.ravel(), gbc, gw2.ravel(), gb2])
        return float(loss), g.astype(np.float32)

    def evaluate(self):
        return float((self._forward(self.test)[2].argmax(axis=1) == self.y_test).mean())

    def evaluate_loss(self):
        pr = self._forward(self.test)[2]
        return float(-self.np.log(self.np.maximum(pr[self.np.arange(len(pr)), self.y_test], 1e-300)).mean())


def make_worker(data, *, batch, seed, backend):
    return (NumpyCNN if backend == "numpy" else PythonCNN)(data, batch, seed)
