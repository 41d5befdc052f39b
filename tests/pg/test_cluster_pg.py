"""``tabcohort.pg`` in a cluster (README "Cluster"): two ``tabcohort serve --redis`` nodes with a
mesh room and a real ``redis-server``; node A owns the room. A 2-rank process group pointed at
node B (``PG_SERVER``) is sent to A (the WebSocket refusal 4012 names the owner) and brings up
its data channels there: every collective right, every link a data channel."""

from __future__ import annotations

import pytest

from tests.integration.test_cluster import ROOM, _owner, start_a_then_b
from tests.integration.test_cluster import redis_server  # noqa: F401  (the fixture)
from tests.integration.conftest import wait_for

from .conftest import collect, start
from .test_collectives import check_every_collective

pytestmark = [pytest.mark.integration, pytest.mark.needs_numpy, pytest.mark.timeout(180)]
pytest.importorskip("aiortc")


def test_a_group_pointed_at_a_node_that_does_not_own_the_room_comes_up_at_the_owner(redis_server, tmp_path):
    procs = []
    try:
        a, b = start_a_then_b(tmp_path, redis_server.url, procs, "--topology", "mesh")
        wait_for(lambda: _owner(b) == "A", 10, "node B to list the room with owner A")
        env = {"PG_SERVER": b.url, "PG_ROOM": ROOM, "PG_RTC_HOSTS": "127.0.0.1"}
        res = collect(tmp_path, start(tmp_path, 2, "mesh", extra_env=env, static=False))
        check_every_collective(res, 2)
        for item in res:
            assert set(item["links"].values()) == {"rtc"} and len(item["links"]) == 1, item["links"]
        sent_on = [v for k, v in b.metrics().items() if 'event="redirects"' in k]
        assert sent_on and sent_on[0] >= 2, b.metrics()          # both ranks were sent on by B
    finally:
        for p in procs:
            p.kill()
