"""The room client core (tabcohort.bus.room): the relay protocol's rank side, stepped with
plain controls and a number for the clock (docs/INTERFACES.md, "Bus" and "Close codes")."""

from __future__ import annotations

import asyncio
import random

import pytest

from tabcohort.bus.base import LinkBytes
from tabcohort.bus.room import (MAX_ALTERNATES, CLOSE_BAD_TOKEN, CLOSE_MOVED, CLOSE_RETRY_LATER, CLOSE_TRY_AGAIN, CLOSE_UNKNOWN_ID,
                                MAX_MOVES, LinkFailed, RoomClient, http_base)
from tabcohort.bus.star import StarBus
from tabcohort.errors import ConfigError


def joined(**kw) -> RoomClient:
    rc = RoomClient(rng=random.Random(7), **kw)
    assert rc.control({"type": "welcome", "id": 5, "secret": "s", "peers": [3, 5, 9]}) is not None
    return rc


def test_register_then_welcome_learns_id_secret_and_peers():
    rc = RoomClient(token="t")
    assert rc.register() == {"type": "register", "version": 1, "token": "t"}
    assert not rc.connected
    rc.control({"type": "welcome", "id": 5, "secret": "s", "peers": [3, 5, 9]})
    assert (rc.id, rc.secret, rc.peers, rc.connected) == (5, "s", {3, 9}, True)


@pytest.mark.parametrize("bad", [
    {"type": "welcome", "id": "5", "secret": "s"}, {"type": "welcome", "id": 5},
    {"type": "welcome", "id": True, "secret": "s"}, {"type": "welcome", "id": 5, "secret": "s", "peers": ["x"]},
    {"type": "peer", "id": "3", "up": True}, {"type": "peer", "id": False, "up": True},
    {"type": "pressure", "p": "high"}, {"type": "pressure", "p": True}, ["not", "a", "dict"]])
def test_a_malformed_control_is_dropped_and_counted(bad):
    rc = joined()
    before = (rc.id, set(rc.peers), rc.relay_pressure)
    assert rc.control(bad) is None
    assert rc.drops == {"bad_control": 1}
    assert (rc.id, rc.peers, rc.relay_pressure) == before


@pytest.mark.parametrize("local", [{"type": "unreachable", "ids": [3, 9]}, {"type": "unreachable", "ids": [{}]},
                                   {"type": "failed", "reason": "x", "rejoin": True}])
def test_a_bus_local_control_from_the_server_is_dropped(local):
    # ``unreachable`` and ``failed`` are the bus's own word to its owner (docs/INTERFACES.md):
    # one arriving over the wire is no server control (it would take the peers out of the
    # machine's view, or end the seat; an ``ids`` of unhashables raised in the mesh's handler)
    rc = joined()
    assert rc.control(local) is None and rc.drops == {"bad_control": 1}


def test_peer_pressure_and_stop_controls():
    rc = joined()
    rc.control({"type": "peer", "id": 4, "up": True})
    rc.control({"type": "peer", "id": 3, "up": False})
    rc.control({"type": "peer", "id": 5, "up": False})   # this rank itself: not a peer
    assert rc.peers == {4, 9}
    rc.control({"type": "pressure", "p": 0.75})
    assert rc.pressure(0) == 0.75 and rc.pressure(rc.high_water_bytes * 2) == 2.0
    rc.control({"type": "stop", "reason": "operator"})
    assert rc.stopped_reason == "operator"


def test_byte_counts_a_broadcast_once_per_known_peer():
    rc = joined()
    rc.count_sent(None, 100)
    rc.count_sent(9, 10)
    rc.count_received(3, 7)
    assert rc.bytes() == {3: LinkBytes(100, 7), 9: LinkBytes(110, 0)}


def test_admission_drops_while_disconnected_and_beyond_the_queue_bound():
    rc = RoomClient(max_queue_bytes=1000)
    assert not rc.admit(10, 0) and rc.drops == {"disconnected": 1}
    rc.control({"type": "welcome", "id": 1, "secret": "s", "peers": []})
    assert rc.admit(500, 500)
    assert not rc.admit(501, 500) and rc.drops["send_overflow"] == 1


def test_a_lost_socket_retries_at_full_jitter_deadlines_then_resumes():
    rc = joined(reconnect_max_s=30.0)
    at0 = rc.lost(1006, now_ms=1000.0)
    assert at0 is not None and 1000.0 <= at0 <= 2000.0           # attempt 0: uniform(0, 1 s)
    assert not rc.connected and rc.register()["resume"] == {"id": 5, "secret": "s"}
    at1 = rc.lost(None, now_ms=at0)                                # the attempt failed (network)
    assert at1 is not None and at0 <= at1 <= at0 + 2000.0          # attempt 1: uniform(0, 2 s)
    at2 = rc.lost(CLOSE_RETRY_LATER, now_ms=at1)                   # rate-limited: retried too
    assert at2 is not None and at1 <= at2 <= at1 + 4000.0
    rc.control({"type": "welcome", "id": 5, "secret": "s2", "peers": [3]})
    assert rc.connected and rc.n_reconnects == 1 and not rc.resuming and "resume" not in rc.register()


def _attempts(at, failed) -> list[float]:
    """Every attempt's deadline (ms) until the client gives up; each attempt fails at once
    (``failed(t)`` returns the next deadline, or None)."""
    t, out = 0.0, []
    while at is not None:
        assert t <= at <= 30_000.0
        out.append(at)
        t = at
        at = failed(t)
    return out


def test_reconnecting_gives_up_after_reconnect_max_s_with_a_last_attempt_near_the_bound():
    # one last attempt within the bound's final 2 s, whatever the draws: a rank gave up at 22 s of
    # a 30 s bound when its next draw passed it, and ranks whose server came back at 25 s exited;
    # spread (not at the bound itself), or every rank of a crashed server comes back at one instant
    from tabcohort.bus.room import LAST_ATTEMPT_SPREAD_MS
    lasts = []
    for seed in range(40):
        rc = joined(reconnect_max_s=30.0)
        rc.rng.seed(seed)
        attempts = _attempts(rc.lost(1006, now_ms=0.0), lambda t: rc.lost(None, now_ms=t))
        t = attempts[-1]
        assert attempts[-1] >= 30_000.0 - LAST_ATTEMPT_SPREAD_MS, attempts
        lasts.append(attempts[-1])
        want = f"gave up reconnecting after {t / 1000.0:.0f} s without the server (the 30 s bound)"
        assert rc.failed == want and not rc.rejoin
    assert len(set(lasts)) == len(lasts)                  # (spread: no two at one instant)
    assert rc.fail("ignored") == {"type": "failed", "reason": want, "rejoin": False}


def test_a_refused_first_registration_also_gets_a_last_attempt_near_the_bound():
    # (a server admitting registrations at a bounded rate: 4029 / 1013)
    from tabcohort.bus.room import LAST_ATTEMPT_SPREAD_MS, RoomClient
    for seed in range(40):
        rc = RoomClient(rng=random.Random(seed), reconnect_max_s=30.0)
        attempts = _attempts(rc.refused(4029, now_ms=0.0), lambda t: rc.refused(4029, now_ms=t))
        assert attempts[-1] >= 30_000.0 - LAST_ATTEMPT_SPREAD_MS, attempts


@pytest.mark.parametrize("code", [4000, 4001, 4009])
def test_fatal_close_codes_end_the_bus(code):
    rc = joined()
    assert rc.lost(code, now_ms=0.0) is None
    assert rc.failed == f"server closed the link: code {code}" and not rc.rejoin


def test_a_refused_resume_ends_the_bus_with_rejoin():
    rc = joined()
    assert rc.lost(1001, now_ms=0.0) is not None                   # server shutdown: reconnect
    assert rc.lost(CLOSE_UNKNOWN_ID, now_ms=500.0) is None          # the resume is refused
    assert rc.failed == "server closed the link: code 4004" and rc.rejoin


def test_a_token_refused_on_reconnect_says_the_server_changed_and_what_to_do():
    rc = joined()
    assert rc.lost(None, now_ms=0.0) is not None                    # the server went away
    assert rc.lost(CLOSE_BAD_TOKEN, now_ms=500.0, reason="bad trainer token") is None
    assert rc.failed.startswith("server closed the link: code 4001 (bad trainer token); the token was "
                                "accepted before") and "--trainer-token" in rc.failed and not rc.rejoin
    rc = joined()                                                   # refused on a live link: no guess
    assert rc.lost(CLOSE_BAD_TOKEN, now_ms=0.0, reason="bad trainer token") is None
    assert rc.failed == "server closed the link: code 4001 (bad trainer token)"


def test_a_first_registration_is_retried_only_when_rate_limited_and_within_the_bound():
    rc = RoomClient(reconnect_max_s=2.0, rng=random.Random(1))
    assert rc.refused(4001, now_ms=0.0) is None
    at = rc.refused(CLOSE_RETRY_LATER, now_ms=0.0)
    assert at is not None and 0.0 <= at <= 1000.0
    rc2 = RoomClient(reconnect_max_s=0.0)
    assert rc2.refused(CLOSE_RETRY_LATER, now_ms=0.0) is None       # no time left to wait


def test_backlog_is_reported_when_it_moves_by_an_eighth_of_the_high_water_mark_or_to_zero():
    rc = joined(high_water_bytes=800)
    assert rc.backlog(0) is None
    assert rc.backlog(10) == {"type": "backlog", "bytes": 10}      # from 0
    assert rc.backlog(109) is None                                  # moved 99 < 100
    assert rc.backlog(110) == {"type": "backlog", "bytes": 110}
    assert rc.backlog(0) == {"type": "backlog", "bytes": 0}         # back to 0


@pytest.mark.parametrize("kw", [{"high_water_bytes": 0}, {"max_queue_bytes": -1}, {"high_water_bytes": True},
                                {"reconnect_max_s": -1}])
def test_bad_bounds_name_the_setting(kw):
    with pytest.raises(ConfigError) as e:
        RoomClient(**kw)
    assert next(iter(kw)) in str(e.value)


def test_register_carries_the_trainer_token_and_welcome_and_peer_bind_the_roles():
    rc = RoomClient(token="t", trainer_token="x" * 16)
    assert rc.register() == {"type": "register", "version": 1, "token": "t", "trainer_token": "x" * 16}
    rc.control({"type": "welcome", "id": 5, "secret": "s", "peers": [3, 9], "may_lead": True, "lead_peers": [9, True]})
    assert rc.may_lead is True and rc.lead_roles == {3: False, 9: True}
    rc.control({"type": "peer", "id": 4, "up": True, "may_lead": 1})     # only True says "may lead"
    rc.control({"type": "peer", "id": 3, "up": True, "may_lead": True})
    rc.control({"type": "peer", "id": 9, "up": False})
    assert rc.lead_roles == {3: True, 4: False}
    rc2 = joined()   # a welcome without roles: this rank does not lead
    assert rc2.may_lead is False and rc2.lead_roles == {3: False, 9: False}


def test_a_cluster_redirect_is_followed_then_a_dead_owner_sends_the_attempt_back_to_the_entry_url():
    entry = "ws://a:8080/api/rooms/r/ws?x=1"
    rc = RoomClient(entry)
    assert rc.new_attempt() == entry
    # the entry node does not own the room: 4012 with the owner's base URL, followed at once
    assert rc.redirect(CLOSE_MOVED, "http://b:8081", reached=True) == ("ws://b:8081/api/rooms/r/ws?x=1", CLOSE_MOVED)
    assert rc.n_moves == 1
    # the owner does not answer (it died): the same attempt asks the entry node again ...
    assert rc.redirect(None, "connection refused", reached=False) == (entry, None)
    # ... which still names the dead owner: try again later (1013), not a loop
    assert rc.redirect(CLOSE_MOVED, "http://b:8081", reached=True) == (None, CLOSE_TRY_AGAIN)
    # the next attempt starts afresh; a reason that is not an http(s) base URL is not followed
    rc.new_attempt()
    for bad in ("ftp://b:1", "http://b:8081/path", "http://b:99999", "javascript:alert(1)", ""):
        assert rc.redirect(CLOSE_MOVED, bad, reached=True) == (None, CLOSE_MOVED), bad
    assert rc.url == entry


def test_when_the_entry_node_is_the_owner_that_died_the_other_nodes_of_the_welcome_are_asked():
    # a new-user trial: a rank whose --server was the owner kept no other node to ask; it trained
    # alone until it gave up reconnecting (30 s), a second model beside the room's
    entry = "ws://a:8080/api/rooms/r/ws"
    rc = RoomClient(entry)
    rc.new_attempt()
    rc.control({"type": "welcome", "id": 5, "secret": "s", "peers": [],
                "nodes": ["http://b:8081", "https://c.example", "ftp://x", 7, "http://a:8080"]})
    assert rc.alternates == ["ws://b:8081/api/rooms/r/ws", "wss://c.example/api/rooms/r/ws"]
    rc.new_attempt()                          # the socket to a (the owner) is gone: a reconnect
    assert rc.redirect(None, "connection refused", reached=False) == ("ws://b:8081/api/rooms/r/ws", None)
    assert rc.redirect(None, "connection refused", reached=False) == ("wss://c.example/api/rooms/r/ws", None)
    assert rc.redirect(None, "connection refused", reached=False) == (None, None)   # each once an attempt
    assert rc.new_attempt() == "wss://c.example/api/rooms/r/ws"


def test_the_nodes_a_rank_may_ask_are_all_it_was_told_of_not_the_last_welcomes_alone():
    # a new-user trial: after a failover the survivor's welcome named only itself; the rank kept
    # that alone, and when the survivor died too it gave up although the first owner, restarted,
    # had taken the room back
    a, b = "ws://a:8080/api/rooms/r/ws", "ws://b:8081/api/rooms/r/ws"
    rc = RoomClient(a)
    rc.new_attempt()
    rc.control({"type": "welcome", "id": 5, "secret": "s", "peers": [], "nodes": ["http://a:8080", "http://b:8081"]})
    assert rc.alternates == [b]
    rc.new_attempt()                                   # a died: b takes the room
    assert rc.redirect(None, "connection refused", reached=False) == (b, None)
    rc.control({"type": "welcome", "id": 5, "secret": "s", "peers": [], "nodes": ["http://b:8081"]})
    assert rc.alternates == [a]                        # a is still a node to ask
    rc.new_attempt()                                   # b died: a, restarted, is asked
    assert rc.redirect(None, "connection refused", reached=False) == (a, None)
    # bounded however many nodes the welcomes name
    for i in range(3 * MAX_ALTERNATES):
        rc.control({"type": "welcome", "id": 5, "secret": "s", "peers": [], "nodes": [f"http://n{i}:1"]})
    assert len(rc.alternates) == MAX_ALTERNATES and rc.alternates[0] == "ws://n47:1/api/rooms/r/ws"


def test_redirects_are_bounded_per_attempt_and_a_linked_socket_moved_keeps_the_owner():
    rc = RoomClient("ws://a:1/api/rooms/r/ws")
    rc.new_attempt()
    for i in range(MAX_MOVES):
        assert rc.redirect(CLOSE_MOVED, f"http://n{i}:1", reached=True)[0] == f"ws://n{i}:1/api/rooms/r/ws"
    assert rc.redirect(CLOSE_MOVED, "http://m:1", reached=True) == (None, CLOSE_TRY_AGAIN)
    rc.moved("https://owner.example.org")
    assert rc.url == "wss://owner.example.org/api/rooms/r/ws" and http_base(rc.url) == "https://owner.example.org"
    assert rc.new_attempt() == rc.url   # the next attempt goes to the owner, not the entry node


def test_a_first_registration_is_retried_while_the_cluster_has_no_owner():
    rc = RoomClient(reconnect_max_s=5.0, rng=random.Random(3))
    assert rc.refused(CLOSE_TRY_AGAIN, now_ms=0.0) is not None
    assert rc.refused(4001, now_ms=0.0) is None


class _RefusingSocket:
    """A socket adapter whose server closes every attempt at once (``code``, ``reason``)."""

    can_pause = False

    def __init__(self, code: int, reason: str) -> None:
        self.code, self.reason = code, reason
        self.opened = self.aclosed = 0

    def open(self, url, listener) -> None:
        self.opened += 1
        asyncio.get_running_loop().call_soon(listener.on_closed, self.code, self.reason)

    def send_text(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        self.aclosed += 1


@pytest.mark.needs_loop
def test_a_bus_the_server_refuses_releases_its_socket_before_it_raises():
    # (a rank with a wrong trainer token printed aiohttp's "Unclosed client session" on exit:
    # connect gave up with the socket adapter's session still open)
    sock = _RefusingSocket(CLOSE_BAD_TOKEN, "bad trainer token")
    bus = StarBus(sock, "ws://127.0.0.1:1/api/rooms/r/ws", trainer_token="x" * 16)
    with pytest.raises(LinkFailed) as e:
        asyncio.run(asyncio.wait_for(bus.connect(timeout_s=5.0), 10.0))
    assert (e.value.code, e.value.reason) == (CLOSE_BAD_TOKEN, "bad trainer token")
    assert sock.opened == 1 and sock.aclosed == 1


def test_a_move_never_leaves_wss_for_plain_http():
    """A rank's register carries its tokens: a 4012 naming an http node, or a welcome listing
    one, is not followed from a wss link (a review), while ws -> http(s) and wss -> https are."""
    from tabcohort.bus.room import moved_ws_url

    assert moved_ws_url("wss://a.example/api/rooms/r/ws", "http://b.example:8080") is None
    assert moved_ws_url("wss://a.example/api/rooms/r/ws", "https://b.example") == "wss://b.example/api/rooms/r/ws"
    assert moved_ws_url("ws://a:1/api/rooms/r/ws?x=1", "http://b:2") == "ws://b:2/api/rooms/r/ws?x=1"
    assert moved_ws_url("ws://a:1/api/rooms/r/ws", "https://b:2") == "wss://b:2/api/rooms/r/ws"
    c = RoomClient("wss://a.example/api/rooms/r/ws")
    to, code = c.redirect(CLOSE_MOVED, "http://b.example:8080", reached=True)
    assert to is None and code == CLOSE_MOVED and c.url == "wss://a.example/api/rooms/r/ws"


def test_a_ranks_http_redirect_never_leaves_https_for_http():
    from tabcohort.runtime.native import node_redirect

    url = "https://a.example/api/rooms/r/job"
    with pytest.raises(ValueError, match="in clear"):
        node_redirect(url, "http://b.example:8080/api/rooms/r/job")
    assert node_redirect(url, "https://b.example/api/rooms/r/job") == "https://b.example/api/rooms/r/job"
    assert node_redirect("http://a/api/rooms/r/job", "https://b/api/rooms/r/job") == "https://b/api/rooms/r/job"
    assert node_redirect(url, "/elsewhere") is None and node_redirect(url, "ftp://b/api/rooms/r/job") is None


def test_a_roll_call_control_is_the_peer_table_and_a_malformed_one_is_dropped():
    rc = joined()
    assert rc.peers == {3, 9}
    assert rc.control({"type": "roll_call", "peers": [5, 9, 11]}) is not None
    assert rc.peers == {9, 11}
    for bad in ({"type": "roll_call"}, {"type": "roll_call", "peers": 7}):
        assert rc.control(bad) is None
    assert rc.drops["bad_control"] == 2 and rc.peers == {9, 11}
