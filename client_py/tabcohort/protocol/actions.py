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
        samples: the share: how many consecutive samples from ``offset`` (PROTOCOL.md, "Shares").
    """

    token: int
    step: int
    offset: int
    own: bool
    samples: int = 1


@dataclass(frozen=True)
class Report:
    """A state report (PROTOCOL.md, "State report") for the UI and logs."""

    state: dict = field(default_factory=dict)


Action = Post | Compute | Report
