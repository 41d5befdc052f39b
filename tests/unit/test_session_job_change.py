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
    m = SimpleNamespace(job="c" * 32, step=7, checkpoint_cursor=0, loss=0.5, accuracy=None)
    h = upload_headers(m, SimpleNamespace(id=3, secret="s"), "d" * 64, final=False)
    assert h["X-Tabcohort-Job"] == "c" * 32


@pytest.mark.needs_loop
def test_a_first_welcome_of_another_job_stops_the_seat_built_after_it():
    # the first welcome comes while the bus connects, before seat() knows the rank's job: a
    # server restarted with another job between the rank's job fetch and its link (a review)
    import asyncio

    from tabcohort.model.toy import ToyWorker
    from tabcohort.protocol import Timing as Tm

    class Bus:
        id, may_lead, lead_roles = 1, True, {}
        on_message = None

        def post(self, msg):
            pass

        def pressure(self):
            return 0.0

        def quantize(self, params):
            return None

        def total_bytes(self):
            return 0

    job = {"timing": {k: getattr(Tm(), k) for k in ("beat_ms", "drop_ms", "collect_ms", "takeover_ms", "forget_ms")},
           "lr": 0.1, "eval_every": 10, "precision": "f32"}

    async def seat(room_job):
        s = RankSession()
        s.on_control({"type": "welcome", "id": 1, "secret": "x", "peers": [], "job_hash": room_job})
        _m, d = s.seat(Bus(), ToyWorker(bucket_len=4, batch=2), job, "a" * 32)
        await d.close()
        return s

    async def both():
        return await seat("b" * 32), await seat("a" * 32)

    other, same = asyncio.run(both())
    assert other.failed is not None and "b" * 32 in other.failed and other.stop_reason is not None
    assert same.failed is None and same.stop_reason is None
