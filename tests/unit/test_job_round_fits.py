"""A job whose round cannot cross the wire is refused before anything starts
(tabcohort.jobs.check_round_fits): a 20M-parameter job passed every check, trained on its
leader alone (every follower dropped every 80 MB round: WireLimits.max_frame_bytes is 64 MiB)
and `simulate` ended "bit-identical parameters: NO" with no reason."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tabcohort.jobs import JobError, check_round_fits
from tabcohort.wire.limits import WireLimits

JOB = SimpleNamespace(source=SimpleNamespace(ref="big.py"))


def test_a_round_larger_than_a_frame_is_refused_naming_the_largest_that_fits():
    check_round_fits(JOB, 16_000_000)                     # 61 MiB: fits
    with pytest.raises(JobError) as e:
        check_round_fits(JOB, 20_000_000)
    assert "20,000,000" in e.value.reason and "64 MiB" in e.value.reason and "at most 16,515,072" in e.value.reason
    assert 4 * 16_515_072 <= WireLimits().max_frame_bytes


def test_the_optimizer_state_the_round_carries_counts():
    check_round_fits(JOB, 9_000_000)                      # parameters alone: fits
    with pytest.raises(JobError) as e:
        check_round_fits(JOB, 9_000_000, 9_000_000)       # with Nesterov's momentum: does not
    assert "optimizer state" in e.value.reason and "8,257,536" in e.value.reason
