"""LAN discovery (issue 4): ``tabcohort serve --advertise`` announces ``_tabcohort._tcp.local.``
over mDNS and ``tabcohort rank --discover`` / ``--discover-host`` finds it without a URL. All on
127.0.0.1 (mDNS bound to the loopback interface only); each test uses its own room name, so a
server another test advertises is never the one found."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tabcohort.errors import ConfigError
from tabcohort.runtime.native import RankConfig

from .conftest import ROOT, Proc, _env, wait_for

pytestmark = pytest.mark.integration
pytest.importorskip("zeroconf")

LO = ("--discover-interfaces", "127.0.0.1")


def _room(tag: str) -> str:
    return f"lan-{tag}-{os.getpid()}-{time.monotonic_ns() % 10**6}"


def _rank(cluster, *args: str) -> Proc:
    n = sum(1 for p in cluster.procs if p is not cluster.server)
    p = Proc(["rank", "--room", cluster.room, *args], cluster.tmp / f"rank{n}.log")
    cluster.procs.append(p)
    return p


def test_ranks_find_the_server_by_mdns_browse_and_by_unicast_query_and_train(cluster):
    cluster.room = _room("train")
    cluster.serve("--advertise")
    assert "advertising tabcohort-" in cluster.server.text()
    t0 = time.monotonic()
    browse = _rank(cluster, "--discover", *LO)
    unicast = _rank(cluster, "--discover-host", "127.0.0.1")
    st = wait_for(lambda: (s := cluster.state())["step"] >= 30
                  and len([r for r in s["ranks"] if r["connected"]]) == 2 and s, 60,
                  "2 discovered ranks to train 30 steps")
    print(f"\ndiscovery: 2 ranks joined without a URL; step {st['step']} {time.monotonic() - t0:.1f} s "
          "after they started")
    assert "discovered tabcohort-" in browse.text() and "by mDNS" in browse.text()
    assert "by unicast query to 127.0.0.1" in unicast.text()
    assert cluster.url in browse.text() and cluster.url in unicast.text()
    # the room stops; both exit cleanly
    cluster.post(f"/api/rooms/{cluster.room}/stop")
    for p in (browse, unicast):
        assert p.p.wait(30) == 0, p.text()


def test_discovery_gives_up_within_its_bound_with_a_clear_error():
    room = _room("none")
    for how in (["--discover", *LO], ["--discover-host", "127.0.0.1"]):
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "rank", "--room", room,
                            "--discover-timeout", "1.5", *how], env=_env(), cwd=str(ROOT),
                           capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        assert r.returncode == 1, r.stderr
        assert f"no tabcohort server with room {room!r} found within 1.5 s" in r.stderr, r.stderr
        assert ("unicast DNS-SD query to 127.0.0.1" if "--discover-host" in how else "mDNS browse") in r.stderr
        assert took < 1.5 + 8, took


def cfg(env: dict, **args) -> RankConfig:
    keys = ("server", "room", "token", "batch", "link", "discover", "discover_host", "discover_timeout",
            "discover_interfaces")
    return RankConfig.from_sources({k: None for k in keys} | args, env)


@pytest.mark.parametrize("env,var,value", [
    ({"TABCOHORT_DISCOVER": "maybe"}, "TABCOHORT_DISCOVER", "maybe"),
    ({"TABCOHORT_DISCOVER": "1", "TABCOHORT_SERVER": "http://127.0.0.1:1"}, "TABCOHORT_SERVER", "http://127.0.0.1:1"),
    ({"TABCOHORT_DISCOVER": "1", "TABCOHORT_DISCOVER_TIMEOUT": "soon"}, "TABCOHORT_DISCOVER_TIMEOUT", "soon"),
    ({"TABCOHORT_DISCOVER": "1", "TABCOHORT_DISCOVER_INTERFACES": "lo"}, "TABCOHORT_DISCOVER_INTERFACES", "lo"),
    ({"TABCOHORT_DISCOVER_HOST": "no-such-host.invalid"}, "TABCOHORT_DISCOVER_HOST", "no-such-host.invalid"),
    ({"TABCOHORT_DISCOVER_HOST": "10.0.0.1:5353"}, "TABCOHORT_DISCOVER_HOST", "10.0.0.1:5353"),
    ({"TABCOHORT_DISCOVER": "yes", "TABCOHORT_ROOM": "a/b"}, "TABCOHORT_ROOM", "a/b"),
])
def test_bad_discovery_settings_are_config_errors_naming_the_variable(env, var, value):
    with pytest.raises(ConfigError) as e:
        cfg(env).validate()
    assert e.value.variable == var and e.value.value == value


def test_discovery_without_a_server_url_validates():
    c = cfg({"TABCOHORT_DISCOVER": "1"})
    c.validate()
    assert c.discover and not c.server
    c = cfg({}, discover_host="127.0.0.1")
    c.validate()
    assert c.discover
