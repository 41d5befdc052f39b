"""A restarted server re-seats ranks resuming their ids (resume secrets are HMAC(key, room:id),
the key kept in the checkpoint directory); and the client stays importable without zeroconf."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tabcohort_server.app import _secret_key
from tabcohort_server.config import JobConfig, ServerLimits
from tabcohort_server.rooms import CLOSE_UNKNOWN_ID, Room, RoomError

from .conftest import ROOT, _env


def room(key: bytes | None) -> Room:
    r = Room("r", JobConfig(dataset="synthetic", steps=10), ServerLimits())
    r.secret_key = key
    return r


def test_a_damaged_resume_key_is_a_configuration_error_naming_the_file(tmp_path):
    # a 3-byte .resume-key was read back and used as the HMAC key of every resume secret, unsaid
    from tabcohort.errors import ConfigError
    (tmp_path / ".resume-key").write_bytes(b"zz\n")
    with pytest.raises(ConfigError, match=r"--checkpoint-dir.*\.resume-key holds 3 bytes, not a resume key"):
        _secret_key(str(tmp_path))
    assert (tmp_path / ".resume-key").read_bytes() == b"zz\n"   # (nothing replaced behind the operator)


def test_generated_tokens_never_start_with_a_dash(monkeypatch):
    # 1 in 64 did: `--operator-token -x...` is read as an option (the demo's server failed in CI)
    import secrets

    from tabcohort_server.config import check_token, new_token
    draws = iter(["-" + "a" * 31, "b" * 32])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: next(draws))
    assert new_token() == "b" * 32
    monkeypatch.undo()
    toks = [new_token() for _ in range(500)]
    assert not [t for t in toks if t.startswith("-")] and len(set(toks)) == 500
    for t in toks[:5]:
        check_token("--trainer-token", t)


def test_a_restarted_room_with_the_same_key_reseats_a_resuming_id(tmp_path):
    key = _secret_key(str(tmp_path))
    assert _secret_key(str(tmp_path)) == key and len(key) == 32  # persisted
    assert oct(os.stat(tmp_path / ".resume-key").st_mode & 0o777) == "0o600"
    before = room(key)
    a = before.register(now=0)
    after = room(_secret_key(str(tmp_path)))               # the server restarted on the same dir
    p = after.register(now=1, resume_id=a.id, resume_secret=a.secret)
    assert p.id == a.id and p.connected and after.welcome(p, resumed=True)["id"] == a.id
    for k, s in ((a.id, "0" * 32), (a.id + 1, a.secret)):  # a wrong secret, another id
        with pytest.raises(RoomError) as e:
            room(key).register(now=1, resume_id=k, resume_secret=s)
        assert e.value.code == CLOSE_UNKNOWN_ID
    with pytest.raises(RoomError):                          # another key (no checkpoint dir)
        room(_secret_key(None)).register(now=1, resume_id=a.id, resume_secret=a.secret)


def test_an_id_expired_in_this_process_is_not_reseated():
    r = room(b"k" * 32)
    a = r.register(now=0)
    r.disconnect(a, 1.0)
    assert a.id in r.expire(1.0 + r.limits.resume_grace_s + 1)
    with pytest.raises(RoomError):
        r.register(now=100.0, resume_id=a.id, resume_secret=a.secret)


def test_client_imports_and_names_the_variable_without_zeroconf():
    code = ("import sys; sys.modules['zeroconf'] = None\n"
            "import tabcohort, tabcohort.cli, tabcohort.discovery, tabcohort.runtime.native as n\n"
            "from tabcohort.errors import ConfigError\n"
            "c = n.RankConfig.from_sources({}, {'TABCOHORT_DISCOVER': '1'})\n"
            "try:\n    c.validate()\nexcept ConfigError as e:\n    print('ERR', e.variable)\n")
    r = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=str(ROOT), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "ERR TABCOHORT_DISCOVER" in r.stdout, r.stderr


def test_a_restarted_rooms_roll_call_is_partial_until_the_grace_then_told_whole():
    """PROTOCOL.md "Membership and majority", the roll call: ranks of the room's previous life
    come back one by one, so a ``welcome`` within ``resume_grace_s`` of the restart says its
    ``peers`` may not be all (``partial``); then every connected rank is told the whole list."""
    clock = [100.0]
    r = Room("r", JobConfig(dataset="synthetic", steps=10), ServerLimits(), clock=lambda: clock[0])
    r.secret_key = b"k" * 32
    fresh = r.register(now=clock[0])
    assert "partial" not in r.welcome(fresh, resumed=False)          # a first start: complete
    r.expect_returning_ranks(clock[0])
    a = r.register(now=clock[0])
    assert r.welcome(a, resumed=True)["partial"] is True
    r.flush_roll_call(clock[0] + 1.0)
    clock[0] += r.limits.resume_grace_s - 0.5
    b = r.register(now=clock[0])
    assert r.welcome(b, resumed=True)["partial"] is True
    for p in (fresh, a, b):
        while p.queue:
            p.pop()
    r.flush_roll_call(clock[0])                                      # (still within the grace)
    assert not a.queue
    clock[0] += 1.0
    r.flush_roll_call(clock[0])
    r.flush_roll_call(clock[0] + 5.0)                                # told once
    for p in (fresh, a, b):
        told = [json.loads(x) for x in iter(lambda: p.pop() if p.queue else None, None)]
        assert told == [{"type": "roll_call", "peers": sorted((fresh.id, a.id, b.id))}], told
    assert "partial" not in r.welcome(r.register(now=clock[0]), resumed=False)


def test_the_partial_window_is_at_least_the_ranks_reconnect_bound_whatever_the_grace():
    # (serve --grace 1: a rank back 2 s after the restart was told the others had left)
    from tabcohort.bus.room import RECONNECT_MAX_S
    from tabcohort_server.rooms import RANK_RECONNECT_MAX_S
    assert RANK_RECONNECT_MAX_S == RECONNECT_MAX_S
    r = Room("r", JobConfig(dataset="synthetic", steps=10), ServerLimits(resume_grace_s=1.0), clock=lambda: 0.0)
    r.expect_returning_ranks(0.0)
    assert r.roll_call_partial(2.0) and r.roll_call_partial(RECONNECT_MAX_S - 0.1)
    assert not r.roll_call_partial(RECONNECT_MAX_S)


def test_serve_roll_call_sets_the_windows_reconnect_part_never_below_the_ranks_largest_delay():
    # (serve --roll-call: the window the roll call stays partial, the longer of it and --grace;
    # below the ranks' largest delay between two reconnect attempts a rank whose server is back
    # could come after it and be taken for gone)
    from tabcohort.bus.backoff import RECONNECT_CAP_S
    from tabcohort.errors import ConfigError
    from tabcohort_server.rooms import RANK_RECONNECT_MAX_S
    assert ServerLimits().roll_call_s == RANK_RECONNECT_MAX_S
    for grace, until in ((1.0, 12.0), (20.0, 20.0)):
        r = Room("r", JobConfig(dataset="synthetic", steps=10),
                 ServerLimits(resume_grace_s=grace, roll_call_s=12.0), clock=lambda: 0.0)
        r.expect_returning_ranks(0.0)
        assert r.roll_call_partial(until - 0.1) and not r.roll_call_partial(until), (grace, until)
    ServerLimits(roll_call_s=RECONNECT_CAP_S)
    with pytest.raises(ConfigError) as e:
        ServerLimits(roll_call_s=RECONNECT_CAP_S - 1)
    assert e.value.variable == "roll_call_s"
