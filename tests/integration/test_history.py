"""The room's curves since it started (server/tabcohort_server/history.py), what the operator
view draws on load: bounded, whole-run, served at GET /api/rooms/ROOM/history (token-checked)."""

from __future__ import annotations

import json

import pytest

from tabcohort_server import JobConfig, ServerConfig, create_app
from tabcohort_server.app import ROOMS, sample_history
from tabcohort_server.history import RoomHistory

pytestmark = pytest.mark.integration


def test_history_keeps_the_whole_run_within_its_bound():
    h = RoomHistory(max_points=16)
    for step in range(1, 1001):
        h.add(float(step), step, 1.0 / step, None if step < 10 else 0.5)
    steps = [p[1] for p in h.points]
    assert len(h.points) < 32                      # bounded: at most 2 * max_points
    assert steps[0] == 1 and steps[-1] == 1000     # the start and the latest point are kept
    assert steps == sorted(steps)
    assert not h.add(1001.0, 1000, 0.1, 0.5)       # the same step again is not a new point
    assert not h.add(1001.0, "x", 0.1, 0.5) and not h.add(1001.0, True, 0.1, 0.5)   # bad input dropped
    h.add(1002.0, 5, float("nan"), None)           # a lower step: a new run, the history restarts
    assert h.points == [[0.0, 5, None, None]]


@pytest.mark.asyncio
async def test_history_endpoint_serves_the_leaders_reports_and_checks_the_token(aiohttp_client):
    cfg = ServerConfig(rooms={"t": JobConfig(dataset="synthetic", token="s3-history-room-token")})
    app = create_app(cfg)
    client = await aiohttp_client(app)
    assert (await client.get("/api/rooms/t/history")).status == 403
    room = app[ROOMS].get("t")
    peer = room.register(now=0.0, trainer=True)   # the leader may lead: its reports count
    for step in (1, 2, 3):
        room.control(peer, json.dumps({"type": "report", "state": {"is_leader": True, "id": peer.id, "leader": peer.id, "step": step,
                                                                   "loss": 0.5 / step, "accuracy": None}}), now=step)
        sample_history(app, float(step))               # what the server's ticker does once a second
    r = await client.get("/api/rooms/t/history?token=s3-history-room-token")
    assert r.status == 200
    body = await r.json()
    assert body["fields"] == ["t_s", "step", "loss", "accuracy"]
    assert [p[1] for p in body["points"]] == [1, 2, 3] and body["points"][2][2] == pytest.approx(0.5 / 3)


@pytest.mark.asyncio
async def test_a_final_report_just_before_the_ranks_leave_ends_the_history(aiohttp_client):
    # the final step was reported, then every rank left before the ticker's next sample: the
    # curves ended up to a second short of the run (a new-user trial: 7 points, the last at step
    # 3460 of a room stopped at 4000)
    app = create_app(ServerConfig(rooms={"t": JobConfig(dataset="synthetic", steps=40)}))
    client = await aiohttp_client(app)
    room = app[ROOMS].get("t")
    peer = room.register(now=0.0, trainer=True)
    for step, now in ((10, 1.0), (40, 1.5)):
        room.control(peer, json.dumps({"type": "report", "state": {"is_leader": True, "leader": peer.id,
                                                                   "step": step, "loss": 1.0 / step}}), now=now)
        if step == 10:
            sample_history(app, now)
    room.disconnect(peer, now=1.6)
    sample_history(app, 2.0)
    body = await (await client.get("/api/rooms/t/history")).json()
    assert room.stopped and [p[1] for p in body["points"]] == [10, 40], body
