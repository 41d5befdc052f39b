"""The mesh bus on a resumed ``welcome`` (tabcohort.bus.mesh.MeshBus): the welcome's roll call
is its peer table. A rank that joined while this one was away (a tab that moved to the cluster
node that took the room over and joined before this native rank resumed there) never gets a
``peer`` control: the bus must make its path from the welcome, declare it in ``relay_peers``
(else the server relays nothing to it in a star room) and take its chunks; a peer the welcome
omits left meanwhile and loses its path (docs/PROTOCOL.md "Membership and majority", "Direct TCP
path")."""

from __future__ import annotations

import json

from tabcohort.bus.mesh import MeshBus
from tabcohort.bus.path import PathState
from tabcohort.bus.star import StarBus
from tabcohort.wire import FrameWriter

from .test_mesh_supervise import _Connector, _Socket

BEAT = {"t": "beat", "batch": 1, "ready": False, "running": True, "term": 0, "step": 0, "backend": "py"}


def _relay_peers(sock: _Socket) -> list[list[int]]:
    return [m["ids"] for m in map(json.loads, sock.sent) if m.get("type") == "relay_peers"]


def test_a_resumed_welcome_makes_paths_for_ranks_that_joined_meanwhile_and_drops_those_that_left():
    sock, connector, t = _Socket(), _Connector(), [0.0]
    relay = StarBus(sock, "ws://127.0.0.1:1/api/rooms/r/ws")
    bus = MeshBus(relay, connector, connect_timeout_s=3.0, clock_ms=lambda: t[0], relay_while_connecting=True)
    relay.on_text(json.dumps({"type": "welcome", "id": 5, "secret": "s", "peers": [2]}))
    bus.writer = FrameWriter(5)                   # (as connect() does after the first welcome)
    for k in sorted(relay.peers):
        bus._ensure_path(k)
    bus._declare_relay()
    assert bus.peers == {2} and _relay_peers(sock)[-1] == [2]
    got: list[dict] = []
    bus.on_message = got.append

    # the link is lost (the node died); rank 2 left and rank 3 (a tab: it takes no direct path)
    # joined at the node that took the room over, before this rank resumed there
    relay.room.lost(None, now_ms=t[0])
    relay.on_text(json.dumps({"type": "welcome", "id": 5, "secret": "s", "peers": [3], "resumed": True}))
    assert bus.peers == {3} and bus.path(2) is None
    assert bus.path(3).state is PathState.CONNECTING and connector.opened == []   # (the lower id offers)
    assert _relay_peers(sock)[-1] == [3]          # the server relays this rank's broadcasts to 3
    relay.on_chunk(FrameWriter(3).write(BEAT)[0])
    assert [m["from"] for m in got] == [3] and "unknown_sender" not in bus.drops()
    assert bus.path(3).received > 0


def test_a_resumed_welcome_keeps_the_paths_of_ranks_it_lists():
    sock, connector, t = _Socket(), _Connector(), [0.0]
    relay = StarBus(sock, "ws://127.0.0.1:1/api/rooms/r/ws")
    bus = MeshBus(relay, connector, connect_timeout_s=3.0, clock_ms=lambda: t[0], relay_while_connecting=True)
    relay.on_text(json.dumps({"type": "welcome", "id": 1, "secret": "s", "peers": [2]}))
    bus.writer = FrameWriter(1)
    bus._ensure_path(2)
    ch = bus.channel_of[2]
    bus.channel_open(ch, 1 << 20)                 # a direct path of the pair's own: not on the relay
    assert bus.path(2).state is PathState.DIRECT
    relay.room.lost(None, now_ms=t[0])
    relay.on_text(json.dumps({"type": "welcome", "id": 1, "secret": "s", "peers": [2, 3], "resumed": True}))
    assert bus.path(2).state is PathState.DIRECT and bus.channel_of[2] is ch and not ch.closed
    assert connector.opened == [2, 3] and _relay_peers(sock)[-1] == [3]


def test_a_partial_welcome_keeps_the_paths_of_ranks_not_back_yet_and_the_roll_call_drops_them():
    # a restarted server lists only the ranks back so far (docs/PROTOCOL.md "Membership and
    # majority"): the direct path to rank 2, up all along, must survive; rank 3 never came back
    sock, connector, t = _Socket(), _Connector(), [0.0]
    relay = StarBus(sock, "ws://127.0.0.1:1/api/rooms/r/ws")
    bus = MeshBus(relay, connector, connect_timeout_s=3.0, clock_ms=lambda: t[0], relay_while_connecting=True)
    relay.on_text(json.dumps({"type": "welcome", "id": 1, "secret": "s", "peers": [2, 3]}))
    bus.writer = FrameWriter(1)
    for k in (2, 3):
        bus._ensure_path(k)
    bus.channel_open(bus.channel_of[2], 1 << 20)
    relay.room.lost(None, now_ms=t[0])
    relay.on_text(json.dumps({"type": "welcome", "id": 1, "secret": "s", "peers": [], "resumed": True,
                              "partial": True}))
    assert bus.path(2).state is PathState.DIRECT and bus.path(3) is not None
    relay.on_text(json.dumps({"type": "roll_call", "peers": [1, 2]}))
    assert bus.path(2).state is PathState.DIRECT and bus.path(3) is None
    assert bus.peers == {2}


def _mesh_of_three():
    """Rank 1's mesh bus with paths to 2 and 3 (not open yet): ``(relay, bus, controls seen, t)``."""
    sock, connector, t = _Socket(), _Connector(), [0.0]
    relay = StarBus(sock, "ws://127.0.0.1:1/api/rooms/r/ws")
    seen: list[dict] = []
    bus = MeshBus(relay, connector, connect_timeout_s=3.0, clock_ms=lambda: t[0], relay_while_connecting=True,
                  on_control=seen.append)
    relay.on_text(json.dumps({"type": "welcome", "id": 1, "secret": "s", "peers": [2, 3]}))
    bus.writer = FrameWriter(1)
    for k in (2, 3):
        bus._ensure_path(k)
    return relay, bus, seen, t


def test_when_the_relay_s_link_closes_only_peers_without_a_direct_path_are_unreachable():
    # docs/PROTOCOL.md "Membership and majority": the relay's ``unreachable`` names every peer;
    # the mesh passes on only those it cannot reach another way
    relay, bus, seen, t = _mesh_of_three()
    bus.channel_open(bus.channel_of[2], 1 << 20)
    seen.clear()
    relay.on_control({"type": "unreachable", "ids": [2, 3]})
    assert seen == [{"type": "unreachable", "ids": [3]}]
    bus.channel_open(bus.channel_of[3], 1 << 20)
    relay.on_control({"type": "unreachable", "ids": [2, 3]})
    assert len(seen) == 1                          # every peer on a direct path: nothing to say


def test_a_direct_path_that_closes_while_the_relay_is_down_makes_its_peer_unreachable():
    # docs/PROTOCOL.md "Membership and majority": the relay's link closed first (the peer on a
    # direct path stayed in reach), then that path closed too: nothing carries the pair now
    relay, bus, seen, t = _mesh_of_three()
    bus.channel_open(bus.channel_of[2], 1 << 20)
    bus.channel_open(bus.channel_of[3], 1 << 20)
    bus.channel_down(bus.channel_of[3], "connection reset")   # the relay is up: 3 is still in reach
    relay.room.lost(None, now_ms=t[0])
    seen.clear()
    bus.channel_down(bus.channel_of[2], "connection reset")
    assert {"type": "unreachable", "ids": [2]} in seen
