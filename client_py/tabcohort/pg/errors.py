"""Errors of the fixed-world process group (a branch of :mod:`tabcohort.errors`).

Every collective error *breaks the group*: the failing call raises on every rank that can
know (all ranks for a mismatch, a lost peer or a memory bound in the same call; see
:mod:`tabcohort.pg.group`), and every later call on a broken group raises the same error.
Create a new group to continue (as with an aborted NCCL communicator).
"""

from __future__ import annotations

from ..errors import TabcohortError


class PGError(TabcohortError):
    """Base of every process-group runtime error."""


class PeerLostError(PGError):
    """A peer's connection closed (crash, kill, network) or it left the group.

    Args:
        rank: the rank that was lost.
        detail: how it was noticed.
    """

    def __init__(self, rank: int, detail: str = "") -> None:
        self.rank = rank
        self.detail = detail
        super().__init__(f"peer rank {rank} lost" + (f": {detail}" if detail else ""))


class CollectiveTimeoutError(PGError):
    """A collective did not complete within the group's timeout.

    Args:
        seq: the collective's sequence number.
        missing: ranks this rank was still waiting for.
        timeout_s: the bound, seconds.
    """

    def __init__(self, seq: int, missing: list[int], timeout_s: float) -> None:
        self.seq = seq
        self.missing = missing
        self.timeout_s = timeout_s
        super().__init__(f"collective #{seq} timed out after {timeout_s:g} s waiting for rank(s) {missing}")


class CollectiveMismatchError(PGError):
    """Ranks called different collectives, or the same one with different shapes/arguments,
    at the same sequence number (collectives must be called in the same order everywhere)."""


class MemoryBoundError(PGError):
    """A collective would buffer more than ``MAX_MEMORY_BYTES`` on some rank."""


class GroupSetupError(PGError):
    """Bring-up failed: a peer never answered, or answered for a different group."""
