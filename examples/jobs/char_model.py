"""A small character-level sequence model on a generated corpus (a tabcohort job: README
"Write your own job"; the worker contract is docs/PROTOCOL.md, "Worker contract").

The corpus is made by :func:`corpus` from a tiny seeded grammar ("the quick fox sees a small
bird."), so it needs no download. The model predicts the next character from the previous
``CONTEXT`` characters (Bengio et al. 2003, "A Neural Probabilistic Language Model"): a shared
character embedding of ``EMBED`` values, concatenated, a tanh hidden layer of ``HIDDEN``, a
softmax over the alphabet. Two paths compute the same function: numpy and pure Python (tabs
without numpy). Parameters, one flat float32 vector: embedding ``(V, E)``, hidden weights
``(K*E, H)``, hidden bias ``(H,)``, output weights ``(H, V)``, output bias ``(V,)``, row-major.

    tabcohort serve --job examples/jobs/char_model.py --lr 0.5
"""

import math
import random
from array import array
from operator import mul

ALPHABET = " .abcdefghijklmnopqrstuvwxyz"
CONTEXT, EMBED, HIDDEN = 6, 8, 32
V = len(ALPHABET)
SPEC = {"name": f"charlm-k{CONTEXT}-e{EMBED}-h{HIDDEN}", "alphabet": ALPHABET, "context": CONTEXT,
        "embed": EMBED, "hidden": HIDDEN}
N_IN = CONTEXT * EMBED
BUCKET_LEN = V * EMBED + N_IN * HIDDEN + HIDDEN + HIDDEN * V + V

WORDS = {"det": ["the", "a", "one", "every"], "adj": ["quick", "small", "red", "lazy", "old", "bright"],
         "noun": ["fox", "dog", "bird", "cat", "horse", "child"],
         "verb": ["sees", "follows", "meets", "likes", "chases"]}


def corpus(seed, n_sentences):
    """Seeded sentences ``det adj noun verb det noun.`` (stdlib ``random`` only)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        w = [rng.choice(WORDS[k]) for k in ("det", "adj", "noun", "verb", "det")]
        out.append(" ".join(w + [rng.choice(WORDS["noun"]) + "."]))
    return " ".join(out) + " "


def windows(text):
    ids = [ALPHABET.index(ch) for ch in text]
    xs = [ids[i:i + CONTEXT] for i in range(len(ids) - CONTEXT)]
    return xs, ids[CONTEXT:]


def load_data():
    """Server side only: 600 training and 150 held-out sentences, as (context, next) windows."""
    import numpy as np
    out = {}
    for part, seed, n in (("train", 1, 600), ("test", 2, 150)):
        xs, ys = windows(corpus(seed, n))
        out[f"x_{part}"] = np.array(xs, dtype=np.int32)
        out[f"y_{part}"] = np.array(ys, dtype=np.int32)
    return out


def init_params(seed):
    rng = random.Random(seed)
    u = lambda n, a: [(2 * rng.random() - 1) * a for _ in range(n)]  # noqa: E731
    p = u(V * EMBED, 1.0) + u(N_IN * HIDDEN, math.sqrt(6.0 / (N_IN + HIDDEN))) + [0.0] * HIDDEN
    return array("f", p + u(HIDDEN * V, math.sqrt(6.0 / (HIDDEN + V))) + [0.0] * V)


def _rows(a):
    k = a.shape[1]
    return [list(a.data[i * k:(i + 1) * k]) for i in range(a.shape[0])]


class PythonChar:
    backend = "python"

    def __init__(self, data, batch, seed):
        self.batch, self.bucket_len = batch, BUCKET_LEN
        self.x_train, self.y_train = _rows(data["x_train"]), list(data["y_train"].data)
        self.x_test, self.y_test = _rows(data["x_test"]), list(data["y_test"].data)
        self.set_params(init_params(seed))

    def set_params(self, v):
        self.p = array("f", v)
        p = list(self.p)
        o1 = V * EMBED
        o2 = o1 + N_IN * HIDDEN
        o3 = o2 + HIDDEN
        self.emb = [p[c * EMBED:(c + 1) * EMBED] for c in range(V)]
        self.w1c = [p[o1 + h:o2:HIDDEN] for h in range(HIDDEN)]          # per hidden unit
        self.w1 = [p[o1 + i * HIDDEN:o1 + (i + 1) * HIDDEN] for i in range(N_IN)]
        self.b1 = p[o2:o3]
        self.w2c = [p[o3 + v:o3 + HIDDEN * V:V] for v in range(V)]         # per output class
        self.w2 = [p[o3 + h * V:o3 + (h + 1) * V] for h in range(HIDDEN)]
        self.b2 = p[o3 + HIDDEN * V:]

    def params(self):
        return array("f", self.p)

    def _forward(self, ctx):
        e = [x for c in ctx for x in self.emb[c]]
        h = [math.tanh(b + sum(map(mul, e, w))) for w, b in zip(self.w1c, self.b1)]
        z = [b + sum(map(mul, h, w)) for w, b in zip(self.w2c, self.b2)]
        m = max(z)
        ex = [math.exp(v - m) for v in z]
        s = sum(ex)
        return e, h, [v / s for v in ex]

    def grads(self, offset, samples):
        n = len(self.x_train)
        gemb = [[0.0] * EMBED for _ in range(V)]
        gw1 = [[0.0] * HIDDEN for _ in range(N_IN)]
        gb1 = [0.0] * HIDDEN
        gw2 = [[0.0] * V for _ in range(HIDDEN)]
        gb2 = [0.0] * V
        loss = 0.0
        for k in range(samples):
            i = (offset + k) % n
            ctx, y = self.x_train[i], self.y_train[i]
            e, h, pr = self._forward(ctx)
            loss -= math.log(max(pr[y], 1e-300))
            d = pr[:]
            d[y] -= 1.0
            gb2 = [g + x for g, x in zip(gb2, d)]
            for j, hv in enumerate(h):
                gw2[j] = [g + hv * x for g, x in zip(gw2[j], d)]
            dz = [(1.0 - hv * hv) * sum(map(mul, d, w)) for hv, w in zip(h, self.w2)]
            gb1 = [g + x for g, x in zip(gb1, dz)]
            for i_in, ev in enumerate(e):
                gw1[i_in] = [g + ev * x for g, x in zip(gw1[i_in], dz)]
            for pos, c in enumerate(ctx):
                ge = gemb[c]
                for q in range(EMBED):
                    ge[q] += sum(map(mul, dz, self.w1[pos * EMBED + q]))
        s = 1.0 / samples
        g = [x * s for row in gemb for x in row] + [x * s for row in gw1 for x in row] + [x * s for x in gb1]
        g += [x * s for row in gw2 for x in row] + [x * s for x in gb2]
        return loss * s, array("f", g)

    def _scores(self):
        ok, loss = 0, 0.0
        for ctx, y in zip(self.x_test, self.y_test):
            pr = self._forward(ctx)[2]
            ok += pr.index(max(pr)) == y
            loss -= math.log(max(pr[y], 1e-300))
        return ok / len(self.y_test), loss / len(self.y_test)

    def evaluate(self):
        return self._scores()[0]

    def evaluate_loss(self):
        return self._scores()[1]


class NumpyChar:
    backend = "numpy"

    def __init__(self, data, batch, seed):
        import numpy as np
        self.np = np
        self.batch, self.bucket_len = batch, BUCKET_LEN
        self.x_train, self.y_train = data["x_train"].numpy().astype(np.int64), data["y_train"].numpy().astype(np.int64)
        self.x_test, self.y_test = data["x_test"].numpy().astype(np.int64), data["y_test"].numpy().astype(np.int64)
        self.set_params(init_params(seed))

    def set_params(self, v):
        np = self.np
        self.p = np.array(v, dtype=np.float32)
        p = self.p.astype(np.float64)
        o1 = V * EMBED
        o2 = o1 + N_IN * HIDDEN
        o3 = o2 + HIDDEN
        self.emb, self.w1, self.b1 = p[:o1].reshape(V, EMBED), p[o1:o2].reshape(N_IN, HIDDEN), p[o2:o3]
        self.w2, self.b2 = p[o3:o3 + HIDDEN * V].reshape(HIDDEN, V), p[o3 + HIDDEN * V:]

    def params(self):
        return self.p.copy()

    def _forward(self, x):
        np = self.np
        e = self.emb[x].reshape(len(x), N_IN)
        h = np.tanh(e @ self.w1 + self.b1)
        z = h @ self.w2 + self.b2
        z -= z.max(axis=1, keepdims=True)
        ex = np.exp(z)
        return e, h, ex / ex.sum(axis=1, keepdims=True)

    def grads(self, offset, samples):
        np = self.np
        rows = (offset + np.arange(samples)) % len(self.x_train)
        x, y = self.x_train[rows], self.y_train[rows]
        e, h, pr = self._forward(x)
        loss = -np.log(np.maximum(pr[np.arange(samples), y], 1e-300)).mean()
        d = pr.copy()
        d[np.arange(samples), y] -= 1.0
        d /= samples
        dz = (d @ self.w2.T) * (1.0 - h * h)
        de = (dz @ self.w1.T).reshape(samples, CONTEXT, EMBED)
        gemb = np.zeros((V, EMBED))
        np.add.at(gemb, x, de)
        g = np.concatenate([gemb.ravel(), (e.T @ dz).ravel(), dz.sum(axis=0), (h.T @ d).ravel(), d.sum(axis=0)])
        return float(loss), g.astype(np.float32)

    def evaluate(self):
        return float((self._forward(self.x_test)[2].argmax(axis=1) == self.y_test).mean())

    def evaluate_loss(self):
        pr = self._forward(self.x_test)[2]
        return float(-self.np.log(self.np.maximum(pr[self.np.arange(len(pr)), self.y_test], 1e-300)).mean())


def make_worker(data, *, batch, seed, backend):
    return (NumpyChar if backend == "numpy" else PythonChar)(data, batch, seed)
