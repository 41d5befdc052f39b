"""A rank that resumed its id on a server restarted with another job stops, and its checkpoint
uploads name its job (tabcohort.runtime.session): before, it trained on with the old job's model
in the new job's room, and a leader's upload of the same length was stored as the new job's
checkpoint (README "Resuming": checkpoints of another job are never resumed from)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tabcohort.runtime.session import RankSession, upload_headers


def test_a_welcome_of_another_job_stops_the_rank_naming_both_hashes():
    s = RankSession()
    s.job_hash = "a" * 32                                    # (what seat() sets)
    s.on_control({"type": "welcome", "id": 1, "secret": "x", "peers": [], "job_hash": "a" * 32})
    assert s.stop_reason is None and s.failed is None         # the same job: trains on
    s.on_control({"type": "welcome", "id": 1, "secret": "x", "peers": [], "job_hash": "b" * 32})
    assert s.failed is not None and "b" * 32 in s.failed and "a" * 32 in s.failed
    assert s.stop_reason is not None and "start the rank again" in s.stop_reason


def test_a_welcome_without_a_job_hash_changes_nothing():
    s = RankSession()
    s.job_hash = "a" * 32
    s.on_control({"type": "welcome", "id": 1, "secret": "x", "peers": []})   # (an older server)
    assert s.stop_reason is None and s.failed is None


def test_an_upload_names_the_job_its_model_was_trained_on():
    m = SimpleNamespace(job="c" * 32, step=7, checkpoint_cursor=0, loss=0.5, accuracy_now=None)
    h = upload_headers(m, SimpleNamespace(id=3, secret="s"), "d" * 64, final=False)
    assert h["X-Tabcohort-Job"] == "c" * 32


@pytest.mark.needs_loop
def test_a_first_welcome_of_another_job_stops_the_seat_built_after_it():
    # the first welcome comes while the bus connects, before seat() knows the rank's job: a
    # server restarted with another job between the rank's job fetch and its link (a review)
    import asyncio

    from .machine_helpers import seat_after

    async def both():
        welcome = {"type": "welcome", "id": 1, "secret": "x", "peers": []}
        return (await seat_after({**welcome, "job_hash": "b" * 32}, "a" * 32))[0], \
            (await seat_after({**welcome, "job_hash": "a" * 32}, "a" * 32))[0]

    other, same = asyncio.run(both())
    assert other.failed is not None and "b" * 32 in other.failed and other.stop_reason is not None
    assert same.failed is None and same.stop_reason is None
