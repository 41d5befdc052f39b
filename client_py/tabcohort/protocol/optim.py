"""Local steps and the leader's optimizer (docs/PROTOCOL.md, "Local steps and optimizer state").

Pure: no I/O, no clock. :class:`TrainConfig` is the room's setting (validated here, so the CLI,
the server and the machine share one set of errors); :func:`outer_step` is the leader's outer
update with its state, computed in float64 and rounded to float32 once, so every leader (numpy
or not) computes the same bits from the same inputs.

With ``local_steps`` H > 1 a round's bucket is a *pseudo-gradient*: the round's parameters
minus the rank's parameters after H inner steps (DiLoCo, Douillard et al. 2023). The outer
optimizer treats it as a gradient: ``sgd`` is ``p - lr * d``; ``nesterov`` is SGD with Nesterov
momentum as in PyTorch's ``torch.optim.SGD(nesterov=True)`` (Sutskever et al. 2013):
``m = mu * m + d``, ``p = p - lr * (d + mu * m)``, ``m`` starting at zero.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any

from .._compat import np
from ..errors import ConfigError

INNER_OPTIMIZERS = ("sgd", "adam")
OUTER_OPTIMIZERS = ("sgd", "nesterov")
#: DiLoCo's outer optimizer (Douillard et al. 2023, section 3): Nesterov, lr 0.7, momentum 0.9
DILOCO_OUTER_LR = 0.7
DILOCO_OUTER_MOMENTUM = 0.9
#: the most inner steps one round may ask for (a round must end well within the takeover
#: window of a slow rank, and a larger H is outside what the DiLoCo papers measured)
MAX_LOCAL_STEPS = 4096


#: the room settings of :class:`TrainConfig` (job keys; CLI options ``--local-steps`` etc.)
FIELDS = ("local_steps", "inner_optimizer", "inner_lr", "outer_optimizer", "outer_momentum")


@dataclass(frozen=True)
class TrainConfig:
    """How a round trains: local steps and the optimizers.

    Attributes:
        local_steps: H, inner steps per round (1: a round is one synchronous step, as before
            local steps existed; its bucket is the mean gradient).
        inner_optimizer: ``sgd`` or ``adam``: what each rank runs for its H inner steps
            (fresh state every round). Unused when H = 1.
        inner_lr: the inner optimizer's learning rate. Unused when H = 1.
        outer_optimizer: ``sgd`` or ``nesterov``: what the leader applies to the reduced
            bucket, with the round's ``lr`` (the outer learning rate).
        outer_momentum: Nesterov's momentum ``mu`` in [0, 1).

    Raises:
        ConfigError: naming the option (``--local-steps`` etc.) and the value.
    """

    local_steps: int = 1
    inner_optimizer: str = "sgd"
    inner_lr: float = 0.1
    outer_optimizer: str = "sgd"
    outer_momentum: float = DILOCO_OUTER_MOMENTUM

    def __post_init__(self) -> None:
        h = self.local_steps
        if isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= MAX_LOCAL_STEPS:
            raise ConfigError("--local-steps", h, f"must be an integer in [1, {MAX_LOCAL_STEPS}]")
        if self.inner_optimizer not in INNER_OPTIMIZERS:
            raise ConfigError("--inner-optimizer", self.inner_optimizer, f"expected one of {INNER_OPTIMIZERS}")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ConfigError("--outer-optimizer", self.outer_optimizer, f"expected one of {OUTER_OPTIMIZERS}")
        if not _number_in(self.inner_lr, 0.0, 1e6) or self.inner_lr <= 0:
            raise ConfigError("--inner-lr", self.inner_lr, "must be a finite number in (0, 1e6]")
        if not _number_in(self.outer_momentum, 0.0, 1.0) or self.outer_momentum >= 1.0:
            raise ConfigError("--outer-momentum", self.outer_momentum, "must be a number in [0, 1)")

    @property
    def stateful(self) -> bool:
        """True when the leader's optimizer has state that must travel with the round."""
        return self.outer_optimizer == "nesterov"

    def state_len(self, bucket_len: int) -> int:
        """float32 values of optimizer state the round carries: ``bucket_len`` for Nesterov's
        momentum, 0 for SGD."""
        return int(bucket_len) if self.stateful else 0

    def spec(self) -> dict[str, Any] | None:
        """The fields that go into the job hash; None for the default (so a room without local
        steps keeps the job hash it had before they existed)."""
        if self == TrainConfig():
            return None
        return {"local_steps": self.local_steps, "inner_optimizer": self.inner_optimizer,
                "inner_lr": float(self.inner_lr), "outer_optimizer": self.outer_optimizer,
                "outer_momentum": float(self.outer_momentum)}

    @classmethod
    def from_job(cls, job: Any) -> "TrainConfig":
        """The room's setting from a job (the server's ``/job`` dict, or an object with the
        same attributes); absent keys: defaults."""
        get = job.get if isinstance(job, dict) else (lambda k: getattr(job, k, None))
        return cls(**{k: get(k) for k in FIELDS if get(k) is not None})


def from_options(*, local_steps: Any = 1, inner_optimizer: str = "sgd", inner_lr: Any = None,
                 outer_optimizer: str | None = None, outer_lr: Any = None, outer_momentum: Any = None,
                 lr: Any = None, default_lr: float = 0.5) -> tuple[TrainConfig, float]:
    """The room's setting and learning rate from command-line options, with DiLoCo's defaults
    for H > 1 (Nesterov, outer lr 0.7, momentum 0.9) and today's for H = 1 (SGD at ``lr``).

    The outer learning rate is the round's ``lr`` (``--outer-lr``, else ``--lr``, else the
    default); the inner lr defaults to 0.1 for SGD and 0.001 for Adam.

    Returns:
        ``(TrainConfig, lr)``.

    Raises:
        ConfigError: naming the option (``--local-steps``, ``--outer-lr``, ...) and the value.
    """
    TrainConfig(local_steps=local_steps)               # H first: the defaults depend on it
    h = local_steps
    outer = outer_optimizer if outer_optimizer is not None else ("nesterov" if h > 1 else "sgd")
    if outer_lr is not None and lr is not None and outer_lr != lr:
        # (the round's lr under two names: --lr was silently ignored; a new-user trial)
        raise ConfigError("--outer-lr", outer_lr, f"and --lr {lr} both set the round's (the leader's) learning "
                                                  "rate: give one")
    if outer_lr is not None:
        name, the_lr = "--outer-lr", outer_lr
    else:
        name, the_lr = "--lr", (lr if lr is not None else (DILOCO_OUTER_LR if h > 1 else default_lr))
    if not _number_in(the_lr, 0.0, 1e6) or the_lr <= 0:
        raise ConfigError(name, the_lr, "must be a finite number in (0, 1e6]")
    # (each was accepted and silently did nothing: at H = 1 a bucket is the gradient itself, and
    # SGD has no momentum)
    if h == 1 and inner_optimizer != "sgd":
        raise ConfigError("--inner-optimizer", inner_optimizer, "applies only with --local-steps H > 1 (at H = 1 "
                                                                "the bucket is the gradient itself)")
    if h == 1 and inner_lr is not None:
        raise ConfigError("--inner-lr", inner_lr, "applies only with --local-steps H > 1 (at H = 1 the bucket is "
                                                  "the gradient itself; the step's lr is --lr)")
    if outer_momentum is not None and outer == "sgd":
        raise ConfigError("--outer-momentum", outer_momentum, "applies only with --outer-optimizer nesterov "
                                                              "(the default for --local-steps H > 1)")
    if inner_lr is None:
        inner_lr = 0.001 if inner_optimizer == "adam" else 0.1
    cfg = TrainConfig(local_steps=h, inner_optimizer=inner_optimizer, inner_lr=inner_lr, outer_optimizer=outer,
                      outer_momentum=DILOCO_OUTER_MOMENTUM if outer_momentum is None else outer_momentum)
    return cfg, float(the_lr)


def _number_in(v: Any, lo: float, hi: float) -> bool:
    return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            and lo <= v <= hi)


def zeros(n: int) -> Any:
    """A float32 vector of ``n`` zeros in this process's vector type."""
    if np is not None:
        return np.zeros(int(n), dtype=np.float32)
    return array("f", bytes(4 * int(n)))


def empty() -> Any:
    """The empty vector a round carries when there is no state to carry."""
    return zeros(0)


def outer_step(params: Any, avg: Any, lr: float, momentum_buf: Any, mu: float) -> tuple[Any, Any]:
    """One Nesterov outer step, in float64, rounded to float32 once per output.

    ``m' = float32(mu * m + avg)``; ``p' = float32(p - lr * (avg + mu * m'))`` (the rounded
    ``m'`` is what the round carries, so a new leader resuming from it computes the same bits).

    Args:
        params: float32 vector, shape (bucket_len,): the round's parameters.
        avg: float32 vector, shape (bucket_len,): the reduced bucket (gradient or pseudo-gradient).
        lr: the outer learning rate.
        momentum_buf: float32 vector, shape (bucket_len,), or None (zeros: the first step).
        mu: the momentum in [0, 1).

    Returns:
        ``(params', momentum')``: float32 vectors, shape (bucket_len,).
    """
    lr = float(lr)
    mu = float(mu)
    if np is not None:
        p = np.asarray(params, dtype=np.float64).reshape(-1)
        d = np.asarray(avg, dtype=np.float64).reshape(-1)
        m = (np.zeros_like(d) if momentum_buf is None or len(momentum_buf) == 0
             else np.asarray(momentum_buf, dtype=np.float64).reshape(-1))
        with np.errstate(over="ignore", invalid="ignore"):   # overflow is checked by the caller
            m2 = (mu * m + d).astype(np.float32)
            p2 = (p - lr * (d + mu * m2.astype(np.float64))).astype(np.float32)
        return p2, m2
    n = len(params)
    d = [float(x) for x in avg]
    m = [0.0] * n if momentum_buf is None or len(momentum_buf) == 0 else [float(x) for x in momentum_buf]
    m2 = array("f", [mu * m[i] + d[i] for i in range(n)])
    p2 = array("f", [float(params[i]) - lr * (d[i] + mu * m2[i]) for i in range(n)])
    return p2, m2
