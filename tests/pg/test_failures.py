"""Failures over real processes: a peer that dies mid-collective, one that never calls, a
length mismatch and a memory bound each give a clear error on the ranks that survive, within a
bound, and break the group (the next call raises too)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.needs_numpy, pytest.mark.timeout(120)]

TIMEOUT_S = 10.0


@pytest.mark.parametrize("topology,dead,before_send", [("mesh", 2, False), ("mesh", 0, True),
                                                       ("star", 2, True), ("star", 0, True)])
def test_peer_dies_mid_all_reduce(run_group, topology, dead, before_send):
    """Mesh: the dead rank sent its shards, then died (before the all-gather). Star: a worker
    (or the hub) dies while the others are inside the all_reduce; the hub reports a dead worker
    to the other workers."""
    env = {"PG_TIMEOUT_S": str(TIMEOUT_S), "PG_TEST_DIE_RANK": str(dead)}
    if before_send:
        env["PG_TEST_DIE_BEFORE_SEND"] = "1"
    res = run_group(3, topology, "die", extra_env=env)
    assert res[dead]["rc"] == 3
    for item in res:
        if item["rank"] == dead:
            continue
        assert item["rc"] == 0, item["log"][-2000:]
        assert item["error"] == "PeerLostError", item
        assert item["lost_rank"] == dead
        assert item["elapsed_s"] < TIMEOUT_S / 2  # the closed socket, not the timeout
        assert item["later"] == "PeerLostError"


@pytest.mark.parametrize("topology", ["mesh", "star"])
def test_peer_that_never_calls_times_out(run_group, topology):
    res = run_group(3, topology, "hang", extra_env={"PG_TIMEOUT_S": "1.5"})
    for item in res[:2]:
        assert item["error"] in ("CollectiveTimeoutError",), item
        assert 1.0 < item["elapsed_s"] < 1.5 + 3.0


@pytest.mark.parametrize("topology", ["mesh", "star"])
def test_length_mismatch_errors_on_every_rank(run_group, topology):
    res = run_group(3, topology, "mismatch")
    for item in res:
        assert item["rc"] == 0, item["log"][-2000:]
        assert item["error"] == "CollectiveMismatchError", item
        assert item["later"] == "CollectiveMismatchError"
        # (a later call raised the same text and nothing said the group was broken)
        assert any("create a new group" in n for n in item["later_notes"]), item
    assert any("n=1001" in item["message"] and "n=1000" in item["message"] for item in res)


def test_memory_bound_is_a_clear_error_on_every_rank(run_group):
    # the hub buffers world x n x 4 bytes; 4 KB is far below 3 x 1000 x 4
    res = run_group(3, "star", "memory", per_rank_env={0: {"MAX_MEMORY_BYTES": "4096"}})
    for item in res:
        assert item["error"] == "MemoryBoundError", item
    assert "MAX_MEMORY_BYTES=4096" in res[0]["message"]
