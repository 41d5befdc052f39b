"""Timing defaults and the cohort-size policy (PROTOCOL.md, "Timing and the cohort-size policy")."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

#: aggregation rules a room may choose (PROTOCOL.md "Untrusted ranks"; "mean": the plain
#: sample-weighted mean, for trusted groups); configuration, so it lives with the timing
AGGREGATES = ("clip", "trimmed-mean", "mean")


@dataclass(frozen=True)
class Timing:
    """Base protocol periods in milliseconds (PROTOCOL.md defaults). Configurable per rank.

    Raises:
        ConfigError: a period that is not a positive finite number.
    """

    beat_ms: float = 400.0
    drop_ms: float = 1600.0
    collect_ms: float = 2000.0
    takeover_ms: float = 3200.0
    #: how long a member that is neither seen nor known to have left still counts in the
    #: membership that a majority is taken of (PROTOCOL.md, "Membership and majority")
    forget_ms: float = 60000.0

    def __post_init__(self) -> None:
        for name in ("beat_ms", "drop_ms", "collect_ms", "takeover_ms", "forget_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(name, v, "must be a positive number of milliseconds")


@dataclass(frozen=True)
class Policy:
    """The policy in force for a cohort of ``n`` ranks (live peers + self)."""

    n: int
    beat_ms: float
    quorum: int
    drop_ms: float
    takeover_ms: float
    collect_ms: float
    forget_ms: float = 60000.0


def _round_half_even(x: float) -> int:
    return int(round(x))


def policy(n: int, timing: Timing = Timing()) -> Policy:
    """Compute ``policy(n)`` exactly as PROTOCOL.md specifies.

    Args:
        n: cohort size, live peers + self (>= 1).
        timing: the base periods.

    Returns:
        The stretched beat, quorum, drop, takeover and collect windows (milliseconds).
    """
    n = max(1, int(n))
    beat = float(_round_half_even(timing.beat_ms * max(1.0, n / 4)))
    quorum = n if n <= 3 else max(2, math.ceil(0.6 * n))
    drop = max(timing.drop_ms, 4 * beat)
    takeover = max(timing.takeover_ms, 8 * beat)
    collect = min(3 * timing.collect_ms, float(_round_half_even(timing.collect_ms * (1 + n / 16))))
    forget = max(timing.forget_ms, 4 * takeover)
    return Policy(n=n, beat_ms=beat, quorum=quorum, drop_ms=drop, takeover_ms=takeover, collect_ms=collect,
                  forget_ms=forget)
