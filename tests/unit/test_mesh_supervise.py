"""The mesh bus's supervise tick (tabcohort.bus.mesh.MeshBus.supervise), stepped with a number
for the clock: the connect bound moves a pair to the relay, and the lower id tries its channel
again after the backoff, on a late tick too (docs/PROTOCOL.md "Direct TCP path", Retry)."""

from __future__ import annotations

import pytest

from tabcohort.bus.mesh import MeshBus
from tabcohort.bus.path import RETRY_BASE_MS, PathState
from tabcohort.bus.star import StarBus


class _Socket:
    """Records the controls the relay would send (the bus is never connected to a server)."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send_text(self, text: str) -> None:
        self.sent.append(text)


class _Channel:
    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def buffered_bytes(self) -> int:
        return 0

    def send(self, chunks) -> bool:
        return False


class _Connector:
    """Channels that never open: every offer is recorded."""
    can_pause = False
    ice_servers: list[str] = []

    def __init__(self) -> None:
        self.drops: dict[str, int] = {}
        self.opened: list[int] = []

    def check(self) -> None:
        pass

    def open(self, peer, listener, *, offer_sdp=None):
        self.opened.append(peer)
        return _Channel(peer)

    async def aclose(self) -> None:
        pass


def _mesh(me: int, peer: int):
    t = [0.0]
    relay = StarBus(_Socket(), "ws://127.0.0.1:1/api/rooms/r/ws")
    connector = _Connector()
    bus = MeshBus(relay, connector, connect_timeout_s=3.0, clock_ms=lambda: t[0])
    relay.room.control({"type": "welcome", "id": me, "secret": "s", "peers": [me, peer]})
    bus._on_control({"type": "peer", "id": peer, "up": True})
    return bus, connector, t


def test_the_lower_id_retries_a_relayed_pair_after_the_backoff_even_on_a_late_tick():
    bus, connector, t = _mesh(1, 2)
    assert connector.opened == [2] and bus.path(2).state is PathState.CONNECTING
    t[0] = 3001.0
    bus.supervise(t[0])                                   # the connect bound passed
    p = bus.path(2)
    assert p.state is PathState.RELAY and p.n_fallbacks == 1 and bus.fallbacks[-1][0] == 2
    t[0] = p.retry_at_ms - 1
    bus.supervise(t[0], late=True)
    assert connector.opened == [2]                        # not yet due
    t[0] = 3001.0 + RETRY_BASE_MS
    bus.supervise(t[0], late=True)                        # due, on a late tick (a busy tab's loop)
    assert connector.opened == [2, 2] and p.state is PathState.CONNECTING and p.retrying
    assert bus.n_supervise_ticks == 3 and bus.n_late_ticks == 2


def test_the_higher_id_never_offers_again_it_waits_for_the_lower_ids_offer():
    bus, connector, t = _mesh(5, 2)
    assert connector.opened == []                         # the lower id (2) offers
    t[0] = 3001.0
    bus.supervise(t[0])
    assert bus.path(2).state is PathState.RELAY
    t[0] += 10 * RETRY_BASE_MS
    bus.supervise(t[0])
    assert connector.opened == [] and bus.path(2).state is PathState.RELAY


def test_a_late_tick_gives_no_idle_verdict():
    bus, connector, t = _mesh(1, 2)
    bus.channel_open(bus.channel_of[2], 65536)
    assert bus.path(2).state is PathState.DIRECT
    t[0] = 60_000.0                                       # no bytes from the peer for 60 s
    bus.supervise(t[0], late=True)                        # but this loop was blocked
    assert bus.path(2).state is PathState.DIRECT
    bus.supervise(t[0] + 250.0)
    assert bus.path(2).state is PathState.RELAY and "no bytes from the peer" in bus.path(2).why


def test_a_direct_path_silent_for_the_silence_bound_moves_to_the_relay():
    # docs/PROTOCOL.md "Direct TCP path", "Silence": the session sets policy.drop_ms
    bus, connector, t = _mesh(1, 2)
    bus.set_silence_bound_ms(1600.0)
    bus.channel_open(bus.channel_of[2], 65536)
    t[0] = 1500.0
    bus.supervise(t[0])
    assert bus.path(2).state is PathState.DIRECT
    t[0] = 1700.0
    bus.supervise(t[0])
    assert bus.path(2).state is PathState.RELAY and "no bytes from the peer for 1.6 s" in bus.path(2).why


def test_a_peers_backlog_claim_alone_never_paces_this_rank():
    # any rank could send {"kind": "backlog", "bytes": 2**62}: counted up to the queue bound,
    # it lifted the pressure far over 1 and the leader paced (the room stalled)
    bus, connector, t = _mesh(1, 2)
    bus._on_signal({"type": "signal", "from": 2, "kind": "backlog", "bytes": 2**62})
    p = bus.path(2)
    assert p.remote_backlog == bus.high_water_bytes
    assert p.buffered(bus.channel_buffered(2)) / bus.high_water_bytes <= 1.0   # its part of pressure()


def test_the_backlog_cap_is_a_checked_knob():
    # a test battery whose stalled page must pace its sender raises it, as the server's own
    # ServerLimits.backlog_max_pressure; a bad value names itself before any network activity
    from tabcohort.errors import ConfigError

    for bad in (-1, float("nan"), float("inf"), True, "4"):
        with pytest.raises(ConfigError, match="backlog_max_pressure"):
            MeshBus(StarBus(_Socket(), "ws://127.0.0.1:1/api/rooms/r/ws"), _Connector(), backlog_max_pressure=bad)
    relay = StarBus(_Socket(), "ws://127.0.0.1:1/api/rooms/r/ws")
    bus = MeshBus(relay, _Connector(), high_water_bytes=1000, backlog_max_pressure=4, clock_ms=lambda: 0.0)
    relay.room.control({"type": "welcome", "id": 1, "secret": "s", "peers": [1, 2]})
    bus._on_control({"type": "peer", "id": 2, "up": True})
    bus._on_signal({"type": "signal", "from": 2, "kind": "backlog", "bytes": 2**62})
    assert bus.path(2).remote_backlog == 4000


def test_offers_are_taken_at_most_once_per_connect_bound():
    # a hostile trial: a lower-id member sent 200 offers 10 ms apart; each replaced the channel
    # and opened a connection (PROTOCOL.md "Direct TCP path", Retry)
    bus, connector, t = _mesh(5, 2)
    for i in range(200):
        t[0] = 10.0 * i
        bus._on_signal({"type": "signal", "from": 2, "kind": "offer", "sdp": "v=0"})
    assert connector.opened == [2] and bus.drops()["offer_too_soon"] == 199
    from tabcohort.bus.mesh import OFFER_MIN_INTERVAL_MS
    t[0] = OFFER_MIN_INTERVAL_MS                         # past the bound of the one taken at 0
    bus._on_signal({"type": "signal", "from": 2, "kind": "offer", "sdp": "v=0"})
    assert connector.opened == [2, 2]
    # a peer that reconnects to the server gets a fresh try at once
    bus._on_control({"type": "peer", "id": 2, "up": False})
    bus._on_control({"type": "peer", "id": 2, "up": True})
    bus._on_signal({"type": "signal", "from": 2, "kind": "offer", "sdp": "v=0"})
    assert connector.opened == [2, 2, 2]


def test_a_channel_its_peer_closed_is_logged_without_alarm_and_a_failed_one_warns(caplog):
    # (a peer leaving closes its channels: every rank at a room's stop; README "Direct paths")
    import logging

    from tabcohort.bus.path import CHANNEL_CLOSED
    broken = "direct connection lost (BrokenPipeError(32, 'Broken pipe'))"
    for why, level, stopped in ((CHANNEL_CLOSED, logging.INFO, False), ("ICE connection failed", logging.WARNING, False),
                                (broken, logging.WARNING, False), (broken, logging.INFO, True)):
        bus, _connector, _t = _mesh(1, 2)
        if stopped:   # (the server stopped the room: a peer that left first broke the pipe)
            bus.relay.room.control({"type": "stop", "reason": "stopped by the operator"})
        ch = bus.channel_of[2]
        bus.channel_open(ch, 1 << 16)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tabcohort.bus.mesh"):
            bus.channel_down(ch, why)
        recs = [r for r in caplog.records if "uses the relay" in r.getMessage()]
        assert [r.levelno for r in recs] == [level], (why, [r.getMessage() for r in recs])


def test_the_byte_totals_keep_a_peers_bytes_after_it_left():
    # a new-user trial: a peer that left took its bytes out of the total, and the leader's state
    # report showed a negative wire_bytes_per_s
    bus, _, _t = _mesh(1, 2)
    p = bus.path_of[2]
    p.sent, p.received = 700, 300
    before, kinds = bus.total_bytes(), bus.transport_bytes()
    assert before == 1000
    bus._on_control({"type": "peer", "id": 2, "up": False})
    assert 2 not in bus.path_of
    assert bus.total_bytes() == before and bus.transport_bytes() == kinds
