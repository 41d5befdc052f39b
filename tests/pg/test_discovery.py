"""Bring-up by discovery (tabcohort.pg.discovery), real processes: an mDNS browse on 127.0.0.1
(two groups at once, which must not mix), a roll call that comes up short, and a worker that
cannot hear multicast finding the hub by a unicast DNS-SD query across a veth link between two
network namespaces of our own (as tests/integration/test_discovery.py does for the cohort)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from .conftest import collect, start
from .test_collectives import check_every_collective

pytestmark = [pytest.mark.integration, pytest.mark.needs_numpy, pytest.mark.timeout(120)]
pytest.importorskip("zeroconf")

LOOPBACK = {"DISCOVERY": "mdns", "PG_DISCOVERY_INTERFACES": "127.0.0.1", "PG_LISTEN_HOST": "127.0.0.1"}


def _group(tag: str) -> str:
    return f"t{tag}-{os.getpid()}-{time.monotonic_ns() % 10**6}"


def test_mdns_brings_up_two_groups_at_once_without_mixing_them(tmp_path):
    """A 3-rank mesh and a 2-rank star, both browsing 127.0.0.1 at the same time, each under its
    own PG_GROUP: every collective of each is right (a rank of the other group joining would
    change the sums or fail bring-up)."""
    t0 = time.monotonic()
    # the mesh binds the default listen host (a new user saw an unspecified host bind IPv6 and
    # IPv4 on two different ports and the IPv6 port advertised: ConnectionRefused on IPv4)
    default_host = {"DISCOVERY": "mdns"}   # default interfaces and listen host
    a = start(tmp_path, 3, "mesh", extra_env=dict(default_host, PG_GROUP=_group("a")), static=False, tag="a")
    b = start(tmp_path, 2, "star", extra_env=dict(LOOPBACK, PG_GROUP=_group("b")), static=False, tag="b")
    res_a, res_b = collect(tmp_path, a), collect(tmp_path, b)
    check_every_collective(res_a, 3)
    check_every_collective(res_b, 2)
    print(f"\nmDNS bring-up (2 groups, 5 processes at once on 2 cores): mesh of 3 in "
          f"{max(r['connect_s'] for r in res_a):.2f} s, star of 2 in {max(r['connect_s'] for r in res_b):.2f} s "
          f"(from the call; all collectives done {time.monotonic() - t0:.1f} s after launch)")


def test_a_roll_call_that_comes_up_short_names_what_it_found(tmp_path):
    """WORLD=3 but only ranks 0 and 1 start: both give up within the bound, naming the ranks
    they found and the one missing."""
    env = dict(LOOPBACK, PG_GROUP=_group("short"), PG_CONNECT_TIMEOUT_S="2")
    res = collect(tmp_path, start(tmp_path, 3, "mesh", "all", extra_env=env, static=False, ranks=[0, 1]))
    for r in (0, 1):
        item = res[r]
        assert item["rc"] == 2 and item["error"] == "GroupSetupError", item["log"][-2000:]
        msg = item["message"]
        assert "did not find the 2 other ranks of 3" in msg and "missing ranks [2]" in msg, msg
        assert f"found {{{1 - r}: '127.0.0.1:" in msg and "mDNS browse on 127.0.0.1" in msg, msg
        assert "PG_CONNECT_TIMEOUT_S" in msg
        assert item["elapsed_s"] < 2 + 10, item  # from before the call: imports and mDNS probing too


# --- a worker that cannot hear multicast: the hub's namespace (10.231.9.1) and the workers'
# (10.231.9.2) joined by a veth pair, multicast dropped in the workers'.

def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    tag = f"{os.getpid() % 100000}"
    a, b, va, vb = f"pghub{tag}", f"pgwrk{tag}", f"pgva{tag}", f"pgvb{tag}"
    made: list[str] = []
    try:
        for ns in (a, b):
            r = _ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"cannot make a network namespace: {r.stderr.strip()}")
            made.append(ns)
        steps = [("link", "add", va, "type", "veth", "peer", "name", vb), ("link", "set", va, "netns", a),
                 ("link", "set", vb, "netns", b), ("-n", a, "addr", "add", "10.231.9.1/30", "dev", va),
                 ("-n", b, "addr", "add", "10.231.9.2/30", "dev", vb), ("-n", a, "link", "set", va, "up"),
                 ("-n", b, "link", "set", vb, "up"), ("-n", a, "link", "set", "lo", "up"),
                 ("-n", b, "link", "set", "lo", "up")]
        for s in steps:
            r = _ip(*s)
            if r.returncode != 0:
                pytest.skip(f"ip {' '.join(s)}: {r.stderr.strip()}")
        for chain in ("INPUT", "OUTPUT"):
            r = subprocess.run(["ip", "netns", "exec", b, "iptables", "-A", chain, "-d", "224.0.0.0/4", "-j", "DROP"],
                               capture_output=True, text=True, timeout=20)
            if r.returncode != 0:
                pytest.skip(f"iptables in the namespace: {r.stderr.strip()}")
        yield a, b
    finally:
        for ns in made:
            _ip("netns", "del", ns)


def test_workers_that_cannot_hear_multicast_find_the_hub_by_unicast_query(two_hosts, tmp_path):
    hub_ns, wrk_ns = two_hosts
    group = _group("nat")
    hub = {"DISCOVERY": "mdns", "PG_GROUP": group, "PG_LISTEN_HOST": "10.231.9.1"}
    at = {r: ["ip", "netns", "exec", hub_ns if r == 0 else wrk_ns] for r in range(3)}
    t0 = time.monotonic()
    # the hub (rank 0) and, first, a rank 1 that browses by multicast: it hears nothing
    hub_p = start(tmp_path, 3, "star", extra_env=hub, static=False, prefix=at, ranks=[0])
    browse = collect(tmp_path, start(tmp_path, 3, "star", extra_env={"DISCOVERY": "mdns", "PG_GROUP": group,
                                                                     "PG_CONNECT_TIMEOUT_S": "2"},
                                     static=False, prefix=at, ranks=[1], tag="browse"))[0]
    assert browse["error"] == "GroupSetupError", browse["log"][-2000:]
    msg = browse["message"]
    assert "did not find the hub (rank 0)" in msg and "mDNS browse on all interfaces" in msg, msg
    # workers 1 and 2 ask the hub's host directly, and every collective goes over the veth link
    t1 = time.monotonic()
    unicast = {"DISCOVERY": "unicast:10.231.9.1", "PG_GROUP": group}
    res = collect(tmp_path, hub_p + start(tmp_path, 3, "star", extra_env=unicast, static=False, prefix=at,
                                          ranks=[1, 2]))
    check_every_collective(res, 3)
    print(f"\nbehind a multicast-dropping namespace: browse gave up in {t1 - t0:.1f} s; unicast query, bring-up "
          f"of 2 workers in {max(r['connect_s'] for r in res[1:]):.2f} s and every collective "
          f"{time.monotonic() - t1:.1f} s after they started")
