"""Local steps: H inner steps from the round's parameters, and their pseudo-gradient
(docs/PROTOCOL.md, "Local steps and optimizer state"; DiLoCo, Douillard et al. 2023).

The inner steps run on a *scratch* worker (another instance of the same model over the same
dataset), never on the rank's own parameters: those stay the round's until the next round is
adopted, so a round adopted while the inner steps run is never mixed into them, and a leader's
own bucket leaves its parameters alone until the outer step. Work is sliced: the caller gets
control back between slices of every inner step (the heartbeat keeps beating; a tab does not
go silent for H steps), and may abandon the work between inner steps (a superseded round).

Stdlib only, numpy when importable (a tab's Pyodide may have no numpy).
"""

from __future__ import annotations

import math
from array import array
from typing import Any, Callable, Generator

from .._compat import np
from ..errors import LocalProtocolError

#: the inner optimizers (the room's ``inner_optimizer``, ``tabcohort.protocol.optim``)
INNER_OPTIMIZERS = ("sgd", "adam")
#: Adam's constants (Kingma and Ba 2015, Algorithm 1: the paper's defaults)
ADAM_BETA1 = 0.9
ADAM_BETA2 = 0.999
ADAM_EPS = 1e-8

#: what :func:`local_slices` returns when it was abandoned (``should_stop()`` became true)
ABANDONED = None


class InnerOptimizer:
    """The inner optimizer of one round (fresh state every round).

    ``sgd``: ``p = float32(p - lr * g)``. ``adam``: Kingma and Ba (2015), Algorithm 1, with
    bias correction, moments in float64, parameters rounded to float32 after each step.

    Args:
        name: ``sgd`` or ``adam``.
        lr: learning rate (> 0).
        n: number of parameters.

    Raises:
        LocalProtocolError: an unknown name or a bad lr.
    """

    def __init__(self, name: str, lr: float, n: int) -> None:
        if name not in INNER_OPTIMIZERS:
            raise LocalProtocolError(f"inner optimizer must be one of {INNER_OPTIMIZERS}, got {name!r}")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise LocalProtocolError(f"inner lr must be a positive finite number, got {lr!r}")
        self.name = name
        self.lr = float(lr)
        self.t = 0
        self.m: Any = None
        self.v: Any = None
        self.n = int(n)

    def step(self, p: Any, g: Any) -> Any:
        """One inner step: returns the new float32 parameters (this process's vector type)."""
        self.t += 1
        lr = self.lr
        if np is not None:
            p64 = np.asarray(p, dtype=np.float64).reshape(-1)
            g64 = np.asarray(g, dtype=np.float64).reshape(-1)
            if self.name == "sgd":
                return (p64 - lr * g64).astype(np.float32)
            if self.m is None:
                self.m = np.zeros(self.n)
                self.v = np.zeros(self.n)
            self.m = ADAM_BETA1 * self.m + (1.0 - ADAM_BETA1) * g64
            self.v = ADAM_BETA2 * self.v + (1.0 - ADAM_BETA2) * g64 * g64
            mhat = self.m / (1.0 - ADAM_BETA1 ** self.t)
            vhat = self.v / (1.0 - ADAM_BETA2 ** self.t)
            return (p64 - lr * mhat / (np.sqrt(vhat) + ADAM_EPS)).astype(np.float32)
        ps = [float(x) for x in p]
        gs = [float(x) for x in g]
        if self.name == "sgd":
            return array("f", [ps[i] - lr * gs[i] for i in range(self.n)])
        if self.m is None:
            self.m = [0.0] * self.n
            self.v = [0.0] * self.n
        m, v = self.m, self.v
        c1 = 1.0 - ADAM_BETA1 ** self.t
        c2 = 1.0 - ADAM_BETA2 ** self.t
        out = array("f", bytes(4 * self.n))
        sqrt = math.sqrt
        for i in range(self.n):
            gi = gs[i]
            m[i] = ADAM_BETA1 * m[i] + (1.0 - ADAM_BETA1) * gi
            v[i] = ADAM_BETA2 * v[i] + (1.0 - ADAM_BETA2) * gi * gi
            out[i] = ps[i] - lr * (m[i] / c1) / (sqrt(v[i] / c2) + ADAM_EPS)
        return out


def pseudo_gradient(p0: Any, p_end: Any) -> Any:
    """``float32(p0 - p_end)`` computed in float64: what a rank sends after its inner steps."""
    if np is not None:
        return (np.asarray(p0, dtype=np.float64).reshape(-1)
                - np.asarray(p_end, dtype=np.float64).reshape(-1)).astype(np.float32)
    return array("f", [float(a) - float(b) for a, b in zip(p0, p_end)])


def check_steps(steps: Any) -> int:
    """H as a positive int.

    Raises:
        LocalProtocolError: not an integer >= 1.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise LocalProtocolError(f"local steps must be an integer >= 1, got {steps!r}")
    return steps


def local_slices(scratch: Any, p0: Any, offset: int, share: int, steps: int, optimizer: str, lr: float,
                 grad_slices: Callable[[Any, int, int], Generator[None, None, tuple[float, Any]]],
                 should_stop: Callable[[], bool] | None = None
                 ) -> Generator[None, None, tuple[float, Any] | None]:
    """H inner steps on ``scratch`` from ``p0``, as a generator of slices.

    Inner step ``i`` covers samples ``offset + i * share .. offset + (i + 1) * share - 1``
    (modulo the training set): the round's window of ``H * share`` samples, in order.

    Args:
        scratch: the worker the steps run on (its parameters are overwritten).
        p0: float32 vector, shape (bucket_len,): the round's parameters.
        offset: the window's first sample (uint32).
        share: samples per inner step, >= 1.
        steps: H, >= 1.
        optimizer, lr: the inner optimizer (:class:`InnerOptimizer`).
        grad_slices: ``grad_slices(scratch, offset, n)``: the scratch's gradient slices.
        should_stop: checked between inner steps; when it returns True the work is abandoned.

    Returns:
        ``(mean inner loss, pseudo-gradient float32 of shape (bucket_len,))``, or
        :data:`ABANDONED` (None).
    """
    opt = InnerOptimizer(optimizer, lr, len(p0))
    scratch.set_params(p0)
    p = scratch.params()
    total = 0.0
    for i in range(steps):
        if i:
            yield
            if should_stop is not None and should_stop():
                return ABANDONED
        loss, g = yield from grad_slices(scratch, (offset + i * share) % (1 << 32), share)
        total += float(loss)
        p = opt.step(p, g)
        scratch.set_params(p)
    return total / steps, pseudo_gradient(p0, scratch.params())
