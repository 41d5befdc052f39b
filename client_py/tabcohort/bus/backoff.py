"""Reconnect backoff with full jitter (M. Brooker, "Exponential Backoff and Jitter", AWS
Architecture Blog, 2015): the delay before attempt ``n`` is uniform in
``[0, min(cap, base * 2**n)]``.

After a server restart every rank notices the drop at the same moment; delays that only vary by
a factor around a common value (``d * uniform(0.5, 1.5)``) still land most first attempts in one
short window. Full jitter spreads attempt ``n`` evenly over its whole window, so ``N`` ranks'
first reconnects arrive at about ``N / base`` per second (tests/unit/test_backoff.py).
"""

from __future__ import annotations

import random

#: The first attempt's window and the largest window, seconds.
RECONNECT_BASE_S = 1.0
RECONNECT_CAP_S = 10.0


def full_jitter_s(attempt: int, rng: random.Random, *, base_s: float = RECONNECT_BASE_S,
                  cap_s: float = RECONNECT_CAP_S) -> float:
    """The delay before reconnect attempt ``attempt`` (0 = the first), seconds.

    Args:
        attempt: attempts made so far (>= 0).
        rng: this rank's own generator (independent across ranks).
        base_s: the first attempt's window; ``cap_s``: the largest window.

    Returns:
        ``rng.uniform(0, min(cap_s, base_s * 2 ** attempt))``.
    """
    return rng.uniform(0.0, min(cap_s, base_s * 2.0 ** min(attempt, 30)))
