"""LAN discovery (docs/LAN.md): ``tabcohort serve --advertise`` announces ``_tabcohort._tcp.local.``
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
    p = Proc(["rank", "--room", cluster.room, *args], cluster.tmp / f"rank{n}.log",
             env={"TABCOHORT_TRAINER_TOKEN": cluster.trainer_token})   # the operator's ranks may lead
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


# --- a rank that cannot hear multicast: two network namespaces of our own joined by a veth pair
# (10.231.7.1 = the server's host, 10.231.7.2 = the rank's), multicast dropped in the rank's.

def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    tag = f"{os.getpid() % 100000}"
    a, b, va, vb = f"tcsrv{tag}", f"tcrank{tag}", f"tcva{tag}", f"tcvb{tag}"
    made: list[str] = []
    try:
        for ns in (a, b):
            r = _ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"cannot make a network namespace: {r.stderr.strip()}")
            made.append(ns)
        steps = [("link", "add", va, "type", "veth", "peer", "name", vb), ("link", "set", va, "netns", a),
                 ("link", "set", vb, "netns", b), ("-n", a, "addr", "add", "10.231.7.1/30", "dev", va),
                 ("-n", b, "addr", "add", "10.231.7.2/30", "dev", vb), ("-n", a, "link", "set", va, "up"),
                 ("-n", b, "link", "set", vb, "up"), ("-n", a, "link", "set", "lo", "up"),
                 ("-n", b, "link", "set", "lo", "up")]
        for s in steps:
            r = _ip(*s)
            if r.returncode != 0:
                pytest.skip(f"ip {' '.join(s)}: {r.stderr.strip()}")
        for chain, flag in (("INPUT", "-d"), ("OUTPUT", "-d")):
            r = subprocess.run(["ip", "netns", "exec", b, "iptables", "-A", chain, flag, "224.0.0.0/4", "-j", "DROP"],
                               capture_output=True, text=True, timeout=20)
            if r.returncode != 0:
                pytest.skip(f"iptables in the namespace: {r.stderr.strip()}")
        yield a, b
    finally:
        for ns in made:
            _ip("netns", "del", ns)


def _ns_proc(ns: str, args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "tabcohort.cli", *args],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=_env(), cwd=str(ROOT))


def test_rank_that_cannot_hear_multicast_finds_the_server_by_unicast_query(two_hosts, tmp_path):
    srv_ns, rank_ns = two_hosts
    room = _room("nat")
    logs = {k: tmp_path / f"{k}.log" for k in ("serve", "browse", "rank")}
    # the operator's rank carries the trainer credential, so it may lead (README "Trust model")
    tok = "trainer-token-for-the-unicast-test"
    procs = [_ns_proc(srv_ns, ["serve", "--host", "10.231.7.1", "--port", "0", "--room", room, "--advertise",
                               "--trainer-token", tok],
                      logs["serve"])]
    try:
        wait_for(lambda: "advertising" in logs["serve"].read_text(), 30, "the server to advertise")
        # multicast is dropped in the rank's namespace: a browse finds nothing, within its bound
        r = subprocess.run(["ip", "netns", "exec", rank_ns, sys.executable, "-m", "tabcohort.cli", "rank",
                            "--room", room, "--discover", "--discover-timeout", "2"], env=_env(), cwd=str(ROOT),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "no tabcohort server" in r.stderr, r.stderr
        # a unicast query to the server's host finds it, and the rank trains over the veth link
        t0 = time.monotonic()
        procs.append(_ns_proc(rank_ns, ["rank", "--room", room, "--discover-host", "10.231.7.1",
                                        "--trainer-token", tok], logs["rank"]))

        def steps() -> int:
            import re
            got = [int(m) for m in re.findall(r"\] step +(\d+) ", logs["rank"].read_text())]
            if procs[-1].poll() is not None:
                raise AssertionError("rank exited:\n" + logs["rank"].read_text())
            return max(got, default=0) >= 20
        wait_for(steps, 45, "the unicast-discovered rank to train 20 steps")
        text = logs["rank"].read_text()
        assert "by unicast query to 10.231.7.1" in text and "http://10.231.7.1:" in text, text
        print(f"\nbehind a multicast-dropping namespace: browse failed in 2 s; unicast discovery and 20 steps "
              f"in {time.monotonic() - t0:.1f} s")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
