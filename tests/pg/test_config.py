"""Configuration is validated, and every error names its variable, before any socket opens."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tabcohort.errors import ConfigError
from tabcohort.pg import init_process_group, init_process_group_sync, load_config

PEERS2 = "127.0.0.1:29500,127.0.0.1:29501"


@pytest.fixture
def no_sockets(monkeypatch):
    """Any socket creation (or event loop, which opens a self-pipe) fails the test.

    A loop is set first: pytest-asyncio asks the policy for one around each test, and its
    self-pipe must not count (otherwise the first test of a run fails when it is this file's).
    """
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    def boom(*a, **k):
        raise AssertionError("a socket was opened before validation finished")

    monkeypatch.setattr(socket, "socket", boom)
    monkeypatch.setattr(socket, "socketpair", boom)
    monkeypatch.setattr(socket, "create_connection", boom)
    yield
    monkeypatch.undo()
    asyncio.set_event_loop(None)
    loop.close()


CASES = [
    ({"RANK": "x", "WORLD": "2", "PEERS": PEERS2}, "RANK"),
    ({"RANK": "1.5", "WORLD": "2", "PEERS": PEERS2}, "RANK"),
    ({"RANK": "2", "WORLD": "2", "PEERS": PEERS2}, "RANK"),
    ({"RANK": "-1", "WORLD": "2", "PEERS": PEERS2}, "RANK"),
    ({"RANK": "0", "WORLD": "two", "PEERS": PEERS2}, "WORLD"),
    ({"RANK": "0", "WORLD": "0", "PEERS": PEERS2}, "WORLD"),
    ({"RANK": "0", "PEERS": PEERS2}, "WORLD"),
    ({"WORLD": "2", "PEERS": PEERS2}, "RANK"),
    ({"RANK": "0", "WORLD": "3", "PEERS": PEERS2}, "PEERS"),
    ({"RANK": "0", "WORLD": "2", "PEERS": "127.0.0.1:29500"}, "PEERS"),
    ({"RANK": "0", "WORLD": "2"}, "PEERS"),
    ({"RANK": "0", "WORLD": "2", "PEERS": "127.0.0.1:29500,127.0.0.1"}, "PEERS"),
    ({"RANK": "0", "WORLD": "2", "PEERS": "127.0.0.1:29500,127.0.0.1:http"}, "PEERS"),
    ({"RANK": "0", "WORLD": "2", "PEERS": "127.0.0.1:29500,127.0.0.1:70000"}, "PEERS"),
    ({"RANK": "0", "WORLD": "2", "PEERS": "127.0.0.1:29500,no-such-host.invalid:29501"}, "PEERS"),
    ({"RANK": "0", "WORLD": "2", "PEERS": PEERS2, "TOPOLOGY": "ring"}, "TOPOLOGY"),
    ({"RANK": "0", "WORLD": "3", "PEERS": PEERS2, "TOPOLOGY": "star"}, "PEERS"),
    ({"RANK": "0", "WORLD": "2", "PEERS": PEERS2, "PG_TIMEOUT_S": "0"}, "PG_TIMEOUT_S"),
    ({"RANK": "0", "WORLD": "2", "PEERS": PEERS2, "PG_TIMEOUT_S": "soon"}, "PG_TIMEOUT_S"),
    ({"RANK": "0", "WORLD": "2", "PEERS": PEERS2, "MAX_MEMORY_BYTES": "1e6"}, "MAX_MEMORY_BYTES"),
    ({"RANK": "0", "WORLD": "2", "PEERS": PEERS2, "DISCOVERY": "dns"}, "DISCOVERY"),
    ({"RANK": "0", "WORLD": "2", "DISCOVERY": "mdns"}, "PG_GROUP"),
    # discovery
    ({"RANK": "0", "WORLD": "2", "DISCOVERY": "mdns", "PG_GROUP": "a b"}, "PG_GROUP"),
    ({"RANK": "0", "WORLD": "2", "DISCOVERY": "mdns", "PG_GROUP": "x" * 41}, "PG_GROUP"),
    ({"RANK": "0", "WORLD": "2", "DISCOVERY": "mdns:10.0.0.1", "PG_GROUP": "g"}, "DISCOVERY"),
    ({"RANK": "0", "WORLD": "2", "DISCOVERY": "unicast", "PG_GROUP": "g", "TOPOLOGY": "star"}, "DISCOVERY"),
    ({"RANK": "0", "WORLD": "2", "DISCOVERY": "unicast:10.0.0.1", "PG_GROUP": "g"}, "DISCOVERY"),
    ({"RANK": "1", "WORLD": "2", "DISCOVERY": "unicast:no-such-host.invalid", "PG_GROUP": "g", "TOPOLOGY": "star"},
     "DISCOVERY"),
    ({"RANK": "1", "WORLD": "2", "DISCOVERY": "unicast:10.0.0.1:99999", "PG_GROUP": "g", "TOPOLOGY": "star"},
     "DISCOVERY"),
    ({"RANK": "0", "WORLD": "2", "DISCOVERY": "mdns", "PG_GROUP": "g", "PEERS": PEERS2}, "PEERS"),
    ({"RANK": "0", "WORLD": "2", "DISCOVERY": "mdns", "PG_GROUP": "g", "PG_DISCOVERY_INTERFACES": "lo"},
     "PG_DISCOVERY_INTERFACES"),
    ({"RANK": "0", "WORLD": "2", "PEERS": PEERS2, "PG_DISCOVERY_INTERFACES": "127.0.0.1"}, "PG_DISCOVERY_INTERFACES"),
    ({"RANK": "0", "WORLD": "2", "DISCOVERY": "mdns", "PG_GROUP": "g", "PG_LISTEN_PORT": "http"}, "PG_LISTEN_PORT"),
    ({"RANK": "0", "WORLD": "2", "DISCOVERY": "mdns", "PG_GROUP": "g", "PG_LISTEN_HOST": "myhost"}, "PG_LISTEN_HOST"),
    ({"RANK": "0", "WORLD": "2", "PEERS": PEERS2, "PG_LISTEN_PORT": "29500"}, "PG_LISTEN_PORT"),
    # a server: WebRTC links
    ({"RANK": "0", "WORLD": "2", "PG_SERVER": "http://127.0.0.1:8080"}, "PG_ROOM"),
    ({"RANK": "0", "WORLD": "2", "PG_SERVER": "127.0.0.1:8080", "PG_ROOM": "r"}, "PG_SERVER"),
    ({"RANK": "0", "WORLD": "2", "PG_SERVER": "http://127.0.0.1:port", "PG_ROOM": "r"}, "PG_SERVER"),
    ({"RANK": "0", "WORLD": "2", "PG_SERVER": "http://no-such-host.invalid:1", "PG_ROOM": "r"}, "PG_SERVER"),
    ({"RANK": "0", "WORLD": "2", "PG_SERVER": "http://127.0.0.1:8080", "PG_ROOM": "a/b"}, "PG_ROOM"),
    ({"RANK": "0", "WORLD": "2", "PG_SERVER": "http://127.0.0.1:8080", "PG_ROOM": "r", "PEERS": PEERS2}, "PEERS"),
    ({"RANK": "0", "WORLD": "2", "PG_SERVER": "http://127.0.0.1:8080", "PG_ROOM": "r", "DISCOVERY": "mdns",
      "PG_GROUP": "g"}, "DISCOVERY"),
    ({"RANK": "0", "WORLD": "2", "PG_SERVER": "http://127.0.0.1:8080", "PG_ROOM": "r", "PG_RTC_HOSTS": "localhost"},
     "PG_RTC_HOSTS"),
    ({"RANK": "0", "WORLD": "2", "PG_SERVER": "http://127.0.0.1:8080", "PG_ROOM": "r",
      "PG_ICE_SERVERS": "http://stun.example"}, "PG_ICE_SERVERS"),
    ({"RANK": "0", "WORLD": "2", "PEERS": PEERS2, "PG_ROOM": "r"}, "PG_ROOM"),
    ({"RANK": "0", "WORLD": "2", "PEERS": PEERS2, "PG_RTC_HOSTS": "127.0.0.1"}, "PG_RTC_HOSTS"),
    # one address twice in a mesh: rank 0 waited PG_CONNECT_TIMEOUT_S for a rank that cannot listen
    ({"RANK": "0", "WORLD": "2", "PEERS": "127.0.0.1:29500,127.0.0.1:29500"}, "PEERS"),
]


@pytest.mark.parametrize("env,variable", CASES, ids=[f"{v}:{e.get(v)}" for e, v in CASES])
def test_bad_variable_is_named_before_any_socket(no_sockets, env, variable):
    with pytest.raises(ConfigError) as ei:
        init_process_group_sync(env=env)
    assert ei.value.variable == variable
    assert variable in str(ei.value)


def test_arguments_are_named_and_win_over_the_environment(no_sockets):
    env = {"RANK": "0", "WORLD": "2", "PEERS": PEERS2}
    with pytest.raises(ConfigError) as ei:
        init_process_group_sync(env=env, rank=5)
    assert ei.value.variable == "rank" and ei.value.value == 5
    with pytest.raises(ConfigError) as ei:
        init_process_group_sync(env=env, topology="torus")
    assert ei.value.variable == "topology"
    with pytest.raises(ConfigError) as ei:
        init_process_group_sync(env=env, wrold=2)
    assert ei.value.variable == "wrold"


@pytest.mark.needs_loop
def test_async_bring_up_validates_before_the_transport(monkeypatch):
    import tabcohort.pg.group as group

    def boom(*a, **k):
        raise AssertionError("transport constructed before validation")

    monkeypatch.setattr(group, "TcpBus", boom)
    with pytest.raises(ConfigError) as ei:
        asyncio.run(init_process_group(env={"RANK": "0", "WORLD": "2", "PEERS": PEERS2, "TOPOLOGY": "bus"}))
    assert ei.value.variable == "TOPOLOGY"


def test_a_star_may_repeat_an_address_its_workers_do_not_listen_at():
    cfg = load_config(env={"RANK": "1", "WORLD": "2", "PEERS": "127.0.0.1:29500,127.0.0.1:29500", "TOPOLOGY": "star"},
                      resolve=False)
    assert cfg.topology == "star"


def test_good_config_and_star_needs_only_the_hub():
    cfg = load_config(env={"RANK": "2", "WORLD": "4", "PEERS": "localhost:29500", "TOPOLOGY": "star",
                           "MAX_MEMORY_BYTES": "1000000", "PG_TIMEOUT_S": "2.5"})
    assert (cfg.rank, cfg.world, cfg.topology, cfg.max_memory_bytes, cfg.timeout_s) == (2, 4, "star", 10**6, 2.5)
    assert not cfg.listens and cfg.peers == (("localhost", 29500),)
    cfg = load_config(env={"WORLD_SIZE": "2", "RANK": "1", "PEERS": "[::1]:1,[::1]:2"}, resolve=False)
    assert cfg.peers == (("::1", 1), ("::1", 2)) and cfg.listens and cfg.listen_port == 2


def test_discovery_and_server_configs():
    cfg = load_config(env={"RANK": "1", "WORLD": "3", "TOPOLOGY": "star", "DISCOVERY": "unicast:127.0.0.1:5354",
                           "PG_GROUP": "lab-1"})
    assert (cfg.discovery, cfg.discovery_host, cfg.discovery_port, cfg.group) == ("unicast", "127.0.0.1", 5354, "lab-1")
    assert not cfg.listens and cfg.peers == () and cfg.transport == "tcp"
    cfg = load_config(env={"RANK": "0", "WORLD": "3", "DISCOVERY": "MDNS", "PG_GROUP": "g",
                           "PG_DISCOVERY_INTERFACES": "127.0.0.1", "PG_LISTEN_HOST": "127.0.0.1"})
    assert cfg.discovery == "mdns" and cfg.discovery_interfaces == ("127.0.0.1",) and cfg.listens
    assert (cfg.listen_host, cfg.listen_port) == ("127.0.0.1", 0)
    cfg = load_config(env={"RANK": "0", "WORLD": "3", "DISCOVERY": "mdns", "PG_GROUP": "g"})
    assert cfg.listen_host == "0.0.0.0"   # IPv4 only: what discovery advertises
    cfg = load_config(env={"RANK": "0", "WORLD": "2", "PG_SERVER": "http://localhost:8080", "PG_ROOM": "r",
                           "PG_RTC_HOSTS": "127.0.0.1", "PG_TOKEN": "s3cret"})
    assert cfg.transport == "rtc" and not cfg.listens and cfg.rtc_host_addresses == ("127.0.0.1",)
    assert (cfg.server, cfg.room, cfg.token, cfg.ice_servers) == ("http://localhost:8080", "r", "s3cret", ())
