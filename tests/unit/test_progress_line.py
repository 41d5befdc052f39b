"""The native rank's progress line: what it says beyond the numbers."""
from __future__ import annotations

from tabcohort.runtime.native import _below_global_batch


def test_a_leader_whose_rounds_cover_less_than_the_global_batch_says_so():
    # a new user's two ranks with --batch 8 in a room of global batch 64 trained on 16 samples a
    # round with no word on it (rounds_below_global_batch rose in the report only)
    st = {"is_leader": True, "global_batch": 64, "shares": {"0000000a": 8, "0000000b": 8}}
    line = _below_global_batch(st)
    assert "rounds cover 16 of the global batch 64" in line and "--batch" in line
    assert _below_global_batch({**st, "shares": {"0000000a": 32, "0000000b": 32}}) == ""
    assert _below_global_batch({**st, "is_leader": False}) == ""          # only the leader plans
    assert _below_global_batch({**st, "global_batch": None}) == ""
