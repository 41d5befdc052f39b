"""The star bus (tabcohort.bus.star.StarBus) sends nothing the relay has no one to deliver to
(docs/PROTOCOL.md, "Bus contract": a broadcast with no peer is encoded, not sent)."""

from __future__ import annotations

import json

import pytest

from tabcohort.bus.star import StarBus
from tabcohort.errors import LocalProtocolError
from tabcohort.wire import FrameWriter

BEAT = {"t": "beat", "batch": 1, "ready": False, "running": True, "term": 0, "step": 0, "backend": "py"}


class _Socket:
    """Records what the bus puts on its link to the server (never connected to one)."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.chunks: list[bytes] = []

    def send_text(self, text: str) -> None:
        self.texts.append(text)

    def send_chunks(self, chunks: list[bytes]) -> None:
        self.chunks.extend(chunks)

    def queued_bytes(self) -> int:
        return 0


def _bus(peers: list[int]) -> tuple[StarBus, _Socket]:
    sock = _Socket()
    bus = StarBus(sock, "ws://127.0.0.1:1/api/rooms/r/ws")
    bus.on_text(json.dumps({"type": "welcome", "id": 5, "secret": "s", "peers": peers}))
    bus.writer = FrameWriter(5)                   # (as connect() does after the first welcome)
    return bus, sock


def test_a_lone_rank_s_broadcast_is_not_sent_and_a_peer_s_arrival_makes_it_sent():
    bus, sock = _bus([])
    bus.post({**BEAT, "from": 5})
    assert sock.chunks == [] and bus.uplink_bytes == 0 and bus.drops() == {}
    bus.post({**BEAT, "from": 5, "to": 2})        # addressed: the relay decides
    assert len(sock.chunks) == 1
    bus.on_text(json.dumps({"type": "peer", "id": 2, "up": True}))
    bus.post({**BEAT, "from": 5})
    assert len(sock.chunks) == 2 and bus.bytes()[2].sent > 0
    bus.on_text(json.dumps({"type": "peer", "id": 2, "up": False}))
    bus.post({**BEAT, "from": 5})
    assert len(sock.chunks) == 2                  # it left: nobody to deliver to again


def test_a_lone_rank_s_malformed_broadcast_still_raises():
    bus, _sock = _bus([])
    with pytest.raises(LocalProtocolError):
        bus.post({**BEAT, "from": 5, "step": -1})


@pytest.mark.needs_loop
def test_a_linked_socket_that_closes_makes_every_peer_unreachable_once():
    # docs/PROTOCOL.md "Membership and majority": the bus tells its owner at once that the
    # peers this link carried are out of reach (a leader must not go on committing alone)
    import asyncio

    async def main():
        bus, sock = _bus([3, 2])
        bus._loop = asyncio.get_running_loop()    # (as connect() does)
        sock.discard = lambda: 0
        sock.close = lambda: None
        seen = []
        bus.on_control = seen.append
        bus.on_closed(1006, "")
        assert seen == [{"type": "unreachable", "ids": [2, 3]}] and not bus.connected
        bus.on_closed(None, "no welcome within 5 s")   # a failed reconnect attempt: said once
        assert [o for o in seen if o["type"] == "unreachable"] == [seen[0]]
        bus.close()

    asyncio.run(main())
