"""A room's loss, accuracy and term are the same in ``GET /api/rooms/ROOM`` and ``/metrics``
(``Room.headline``): after its ranks left, a stopped room's last values, where /metrics showed
NaN (a new-user trial: a dashboard on /metrics lost them exactly when training ended)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("tabcohort_server")   # (the server never runs in a tab)
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from tabcohort_server.config import JobConfig, ServerLimits  # noqa: E402
from tabcohort_server.metrics import RoomCollector  # noqa: E402
from tabcohort_server.rooms import Room, RoomRegistry  # noqa: E402


def _metrics(r: Room) -> dict[str, float]:
    rooms = RoomRegistry({}, r.limits)
    rooms.rooms[r.name] = r
    reg = CollectorRegistry()
    reg.register(RoomCollector(rooms))
    out = {}
    for line in generate_latest(reg).decode().splitlines():
        for name in ("tabcohort_loss", "tabcohort_accuracy", "tabcohort_term", "tabcohort_diverged_rounds",
                     "tabcohort_step"):
            if line.startswith(name + "{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_stopped_room_s_last_loss_accuracy_and_term_stay_in_the_metrics_after_its_ranks_left():
    r = Room("r", JobConfig(dataset="synthetic", steps=40), ServerLimits(), clock=lambda: 0.0)
    lead = r.register(now=0, trainer=True)
    state = {"step": 40, "leader": lead.id, "is_leader": True, "loss": 0.125, "accuracy": 0.75, "term": 3,
             "diverged": 0}
    r.control(lead, json.dumps({"type": "report", "state": state}), now=1)
    live = _metrics(r)
    assert r.stopped and live["tabcohort_loss"] == 0.125 and live["tabcohort_term"] == 3
    r.disconnect(lead, now=2)
    m, s = _metrics(r), r.summary(2.0)
    assert (m["tabcohort_loss"], m["tabcohort_accuracy"], m["tabcohort_term"], m["tabcohort_step"]) == \
        (0.125, 0.75, 3.0, 40.0), m
    assert (s["loss"], s["accuracy"], s["term"]) == (0.125, 0.75, 3)
    # (diverged is the current leader's count: none leads now)
    assert math.isnan(m["tabcohort_diverged_rounds"]) and s["diverged"] is None


def test_a_node_that_sent_its_ranks_to_the_room_s_owner_shows_no_stale_values():
    # the owner node reports the room from then on; this node kept its last trusted values
    r = Room("r", JobConfig(dataset="synthetic"), ServerLimits(), clock=lambda: 0.0)
    lead = r.register(now=0, trainer=True)
    r.control(lead, json.dumps({"type": "report", "state": {"step": 7, "leader": lead.id, "is_leader": True,
                                                            "loss": 0.5, "term": 2}}), now=1)
    r.evict_all(4012, "http://node-b:8080", now=2.0)
    m = _metrics(r)
    assert math.isnan(m["tabcohort_loss"]) and math.isnan(m["tabcohort_term"]), m
