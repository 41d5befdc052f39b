"""Reconnect backoff with full jitter (tabcohort.bus.backoff; Brooker, "Exponential Backoff and
Jitter"): after a server restart, many ranks' reconnect attempts spread over each window
instead of landing together."""

from __future__ import annotations

import random

from tabcohort.bus.backoff import RECONNECT_BASE_S, RECONNECT_CAP_S, full_jitter_s


def _max_share_in_window(times: list[float], window_s: float) -> float:
    """The largest fraction of ``times`` inside any window of ``window_s`` seconds."""
    ts = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(ts):
        while ts[j] < t - window_s:
            j += 1
        best = max(best, i - j + 1)
    return best / len(ts)


def test_200_ranks_first_reconnects_spread_over_the_first_window():
    rngs = [random.Random(1000 + k) for k in range(200)]        # one generator per rank
    first = [full_jitter_s(0, r) for r in rngs]
    assert all(0.0 <= d <= RECONNECT_BASE_S for d in first)
    # evenly spread: ~10 % per 100 ms window (the issue saw 84 % in one window)
    assert _max_share_in_window(first, 0.1) <= 0.2, _max_share_in_window(first, 0.1)
    deciles = {int(d / (RECONNECT_BASE_S / 10)) for d in first}
    assert len(deciles) >= 10
    # the old scheme (0.1 s x uniform(0.5, 1.5)) would have put every first attempt in one window
    old = [0.1 * r.uniform(0.5, 1.5) for r in rngs]
    assert _max_share_in_window(old, 0.1) == 1.0


def test_later_attempts_spread_over_windows_that_double_up_to_the_cap():
    rngs = [random.Random(k) for k in range(500)]
    for attempt in range(8):
        window = min(RECONNECT_CAP_S, RECONNECT_BASE_S * 2 ** attempt)
        ds = [full_jitter_s(attempt, r) for r in rngs]
        assert max(ds) <= window and min(ds) >= 0.0
        assert max(ds) > 0.9 * window and min(ds) < 0.1 * window   # the whole window is used
        mean = sum(ds) / len(ds)
        assert 0.4 * window < mean < 0.6 * window
    # ranks with independent generators do not move in lockstep: the cumulative time of each
    # rank's 5th attempt (what a server sees after 4 refusals) is spread over seconds
    totals = [sum(full_jitter_s(a, random.Random(7000 + k)) for a in range(5)) for k in range(200)]
    assert _max_share_in_window(totals, 0.1) <= 0.1
    assert full_jitter_s(10_000, random.Random(0)) <= RECONNECT_CAP_S
