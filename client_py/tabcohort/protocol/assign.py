"""Shard assignment (PROTOCOL.md, "Leader: driving one round", step 2)."""

from __future__ import annotations

from typing import Mapping, Sequence

_U32 = 1 << 32


def windows(shares: Mapping[int, int], cursor: int) -> dict[int, int]:
    """Consecutive, non-overlapping windows of the shared dataset (PROTOCOL.md, "Shares").

    Walking the ids in ascending order, ``assign[k] = (cursor + offset) mod 2**32``, then
    ``offset += shares[k]``, so every sample index of a round is assigned exactly once and the
    next round starts where this one ended (``cursor + sum(shares)``).

    Args:
        shares: samples per rank for this round, each >= 1.
        cursor: samples assigned before this round (a non-negative integer).

    Returns:
        ``{id: offset}`` with offsets in ``[0, 2**32)``.
    """
    out: dict[int, int] = {}
    offset = 0
    for k in sorted(shares):
        out[k] = (cursor + offset) % _U32
        offset += int(shares[k])
    return out


def assignment(ids: Sequence[int], batches: Mapping[int, int], step: int) -> dict[int, int]:
    """Consecutive, non-overlapping windows of the shared dataset.

    Walking ``ids`` in ascending order, ``assign[k] = (step * total + offset) mod 2**32``,
    then ``offset += batch[k]``, where ``total`` is the sum of the batches.

    Args:
        ids: cohort ids (any order; they are sorted here).
        batches: samples per bucket for each id.
        step: the round's step.

    Returns:
        ``{id: offset}`` with offsets in ``[0, 2**32)``.
    """
    order = sorted(ids)
    total = sum(int(batches[k]) for k in order)
    base = step * total
    out: dict[int, int] = {}
    offset = 0
    for k in order:
        out[k] = (base + offset) % _U32
        offset += int(batches[k])
    return out
