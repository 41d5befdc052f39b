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
    """Any socket creation (or event loop, which opens a self-pipe) fails the test."""

    def boom(*a, **k):
        raise AssertionError("a socket was opened before validation finished")

    monkeypatch.setattr(socket, "socket", boom)
    monkeypatch.setattr(socket, "socketpair", boom)
    monkeypatch.setattr(socket, "create_connection", boom)


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
    ({"RANK": "0", "WORLD": "2", "DISCOVERY": "mdns"}, "DISCOVERY"),
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


def test_good_config_and_star_needs_only_the_hub():
    cfg = load_config(env={"RANK": "2", "WORLD": "4", "PEERS": "localhost:29500", "TOPOLOGY": "star",
                           "MAX_MEMORY_BYTES": "1000000", "PG_TIMEOUT_S": "2.5"})
    assert (cfg.rank, cfg.world, cfg.topology, cfg.max_memory_bytes, cfg.timeout_s) == (2, 4, "star", 10**6, 2.5)
    assert not cfg.listens and cfg.peers == (("localhost", 29500),)
    cfg = load_config(env={"WORLD_SIZE": "2", "RANK": "1", "PEERS": "[::1]:1,[::1]:2"}, resolve=False)
    assert cfg.peers == (("::1", 1), ("::1", 2)) and cfg.listens and cfg.listen_port == 2
