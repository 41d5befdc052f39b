"""Actions the rank machine emits; the driver executes them in order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Post:
    """Send ``msg`` on the bus (broadcast unless it has ``to``)."""

    msg: dict


@dataclass(frozen=True)
class Compute:
    """Compute a gradient bucket: ``worker.grads(offset, samples)``, then feed the result back
    with ``machine.bucket_ready(token, loss, g, now_ms=...)`` (or ``bucket_failed``).

    Attributes:
        token: identifies this request; pass it back unchanged.
        step: the round's step.
        offset: the assigned dataset offset (uint32).
        own: True for the leader's own bucket, False for a follower's contribution.
        samples: the share: how many consecutive samples from ``offset`` per inner step
            (PROTOCOL.md, "Shares").
        local_steps: H (PROTOCOL.md, "Local steps and optimizer state"): 1 asks for the mean
            gradient of the share (``worker.grads``); H > 1 for the pseudo-gradient of H inner
            steps over ``H * samples`` consecutive samples (``worker.local_grads``).
        inner_optimizer: ``sgd`` or ``adam`` (H > 1 only).
        inner_lr: the inner optimizer's learning rate (H > 1 only).
    """

    token: int
    step: int
    offset: int
    own: bool
    samples: int = 1
    local_steps: int = 1
    inner_optimizer: str = "sgd"
    inner_lr: float = 0.0


@dataclass(frozen=True)
class Report:
    """A state report (PROTOCOL.md, "State report") for the UI and logs."""

    state: dict = field(default_factory=dict)


Action = Post | Compute | Report
