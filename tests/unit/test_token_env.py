"""A token's environment variable set but empty (README "Trust model"): the shell's
``TABCOHORT_TRAINER_TOKEN="$(cat ckpt/.trainer-token)"`` of a missing file was taken as no token
(the rank never led; serve read or generated another token), while ``--trainer-token=""`` was
refused. It is a configuration error naming the variable, exit 2, before any network activity."""

from __future__ import annotations

import socket

import pytest

from tabcohort.errors import ConfigError
from tabcohort.runtime.native import RankConfig


def _no_network(monkeypatch):
    def refused(*a, **k):
        raise AssertionError("network activity before the configuration was checked")
    monkeypatch.setattr(socket, "getaddrinfo", refused)
    monkeypatch.setattr(socket.socket, "connect", refused)


def test_an_empty_trainer_token_variable_is_refused_by_the_rank_naming_it():
    env = {"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d", "TABCOHORT_TRAINER_TOKEN": ""}
    cfg = RankConfig.from_sources({}, env)
    with pytest.raises(ConfigError) as e:
        cfg.validate(resolve=False)
    assert e.value.variable == "TABCOHORT_TRAINER_TOKEN" and "set but empty" in e.value.reason, e.value
    # the flag wins over the variable; unset is no token (a rank that only contributes)
    RankConfig.from_sources({"trainer_token": "a-long-enough-trainer-token"}, env).validate(resolve=False)
    unset = RankConfig.from_sources({}, {k: v for k, v in env.items() if k != "TABCOHORT_TRAINER_TOKEN"})
    unset.validate(resolve=False)
    assert unset.trainer_token is None


@pytest.mark.parametrize("command", [["serve", "--port", "0", "--dataset", "synthetic"],
                                     ["rank", "--server", "http://127.0.0.1:1", "--room", "d"]])
def test_an_empty_trainer_token_variable_exits_2_before_any_network_activity(command, monkeypatch, capsys):
    if command[0] == "serve":
        pytest.importorskip("tabcohort_server")
    from tabcohort.cli import main
    monkeypatch.setenv("TABCOHORT_TRAINER_TOKEN", "")
    monkeypatch.setenv("TABCOHORT_MALLOC_HOLD", "0")
    _no_network(monkeypatch)
    assert main(command) == 2
    err = capsys.readouterr().err
    assert "configuration error: TABCOHORT_TRAINER_TOKEN='': is set but empty" in err, err


def test_serve_takes_the_room_token_from_its_variable_as_a_rank_does(monkeypatch, capsys):
    # (a new-user trial: TABCOHORT_TOKEN exported once for serve and rank; the rank sent it and
    # serve ran an open room, unsaid)
    pytest.importorskip("tabcohort_server")
    import tabcohort_server.serve as serve_mod
    from tabcohort.cli import main
    monkeypatch.setenv("TABCOHORT_MALLOC_HOLD", "0")
    _no_network(monkeypatch)
    got = []
    monkeypatch.setattr(serve_mod, "serve", lambda cfg, **kw: got.append(cfg) or 0)
    monkeypatch.setenv("TABCOHORT_TOKEN", "a-room-token-of-some-length")
    assert main(["serve", "--port", "0", "--dataset", "synthetic", "--room", "r"]) == 0
    assert got[-1].rooms["r"].token == "a-room-token-of-some-length"
    # the flag wins; empty means none (docker-compose.yml sets it so by default)
    assert main(["serve", "--port", "0", "--dataset", "synthetic", "--room", "r", "--token", "another-long-room-token"]) == 0
    assert got[-1].rooms["r"].token == "another-long-room-token"
    monkeypatch.setenv("TABCOHORT_TOKEN", "")
    assert main(["serve", "--port", "0", "--dataset", "synthetic", "--room", "r"]) == 0
    assert got[-1].rooms["r"].token is None
    # a bad one is named as the variable, before anything listens
    monkeypatch.setenv("TABCOHORT_TOKEN", "short")
    assert main(["serve", "--port", "0", "--dataset", "synthetic", "--room", "r"]) == 2
    assert "configuration error: TABCOHORT_TOKEN=" in capsys.readouterr().err
    assert len(got) == 3
