"""Direct TCP paths between native ranks (README "Direct paths", docs/PROTOCOL.md "Direct TCP
path"): ``tabcohort serve`` + ``tabcohort rank`` subprocesses in a star room. Every wait is a
bounded poll of the server's JSON; nothing sleeps to wait.

The fallback case blocks one rank's address with a firewall rule (``iptables`` REJECT, so a
connection to or from it is refused), which needs root in a private network namespace: the
integration tier runs there (scripts/test.sh).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request

import pytest

from .conftest import wait_for

pytestmark = pytest.mark.integration

#: the direct path's bound on coming up (tabcohort.bus.aio.DIRECT_CONNECT_TIMEOUT_S) + report slack
FALLBACK_BOUND_S = 3.0 + 2.0
#: a refused pair's retries while blocked (10 s, 20 s, then 40 s apart: at most two in the test's
#: time before the firewall is lifted) + the connect bound + report slack
RETRY_BOUND_S = 40.0 + 3.0 + 5.0


def _pairs(reports: list[dict]) -> dict[tuple[str, str], str]:
    """(rank, peer) -> the path the rank's report names."""
    return {(f"{r['id']:08x}", peer): kind for r in reports for peer, kind in (r.get("links") or {}).items()}


def _final_digests(cluster, n: int) -> set[str]:
    cluster.post(f"/api/rooms/{cluster.room}/stop")
    finals = wait_for(lambda: (fs := [r for r in cluster.reports(connected_only=False) if r.get("final")])
                      and len(fs) == n and fs, 30, f"final reports of {n} ranks")
    return {r["digest"] for r in finals}


def test_three_native_ranks_pair_up_directly_relay_carries_no_data_bit_identical(cluster):
    cluster.serve()
    for _ in range(3):
        cluster.rank("--direct-host", "127.0.0.1")
    # every pair on its direct path, from both ends, and training past step 30
    st = wait_for(lambda: (rs := cluster.reports()) and len(rs) == 3
                  and len(p := _pairs(rs)) == 6 and set(p.values()) == {"tcp"}
                  and min(r["step"] for r in rs) > 30 and rs, 60, "3 ranks, every pair on tcp, step > 30")
    for r in st:
        assert set(r["link_bytes"]) == {"tcp", "relay"} and r["link_bytes"]["tcp"] > 0, r["link_bytes"]
    # the relay carried no data for any pair once direct: bytes through it stay where they were
    # (a pair's first frames take the relay while its path comes up)
    before = {(f"{r['id']:08x}", k): v["relay"] for r in st for k, v in r["pair_bytes"].items()}
    steps0 = max(r["step"] for r in st)
    rs = wait_for(lambda: (rs := cluster.reports()) and min(r["step"] for r in rs) > steps0 + 20 and rs,
                  60, "20 more steps")
    grew = {(f"{r['id']:08x}", k): (before[(f"{r['id']:08x}", k)], v["relay"])
            for r in rs for k, v in r["pair_bytes"].items() if v["relay"] != before[(f"{r['id']:08x}", k)]}
    assert not grew, f"relay bytes grew on direct pairs: {grew}"
    assert all(v["tcp"] > 0 for r in rs for v in r["pair_bytes"].values())
    # the server relayed no data chunk either: its relayed byte count stands still
    m1 = _relayed(cluster)
    s1 = cluster.state()["step"]
    wait_for(lambda: cluster.state()["step"] > s1 + 10, 30, "10 more steps")
    assert _relayed(cluster) == m1
    assert len(_final_digests(cluster, 3)) == 1
    # the room's stop closes every direct path: a peer closing its connection is no alarm (a new
    # user saw a WARNING "... uses the relay: direct connection closed by the peer" from every rank
    # at every stop; a reset, when a peer left with bytes unread, is still a warning)
    procs = [p for p in cluster.procs if p is not cluster.server]
    for p in procs:
        p.p.wait(30)
    warned = [ln for p in procs for ln in p.text().splitlines() if "warning" in ln.lower() and "closed by the peer" in ln]
    assert not warned, warned


def _relayed(cluster) -> float:
    req = urllib.request.Request(f"{cluster.url}/metrics",
                                 headers={"Authorization": f"Bearer {cluster.operator_token}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("tabcohort_bytes_relayed_total{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no tabcohort_bytes_relayed_total in /metrics")


BLOCKED = "127.0.0.9"


@pytest.fixture
def blocked_address():
    """Refuse every TCP connection to or from :data:`BLOCKED` (this namespace only)."""
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        pytest.fail("the fallback case needs root and iptables (scripts/install.sh installs it; "
                    "scripts/test.sh runs this tier in a private network namespace)")
    rules = [["INPUT", "-p", "tcp", "-s", BLOCKED, "-j", "REJECT"],
             ["INPUT", "-p", "tcp", "-d", BLOCKED, "-j", "REJECT"]]
    # only inside a private namespace (loopback alone): never touch the host's firewall
    with open("/proc/net/dev") as f:
        ifaces = {ln.split(":")[0].strip() for ln in f.read().splitlines()[2:]}
    if ifaces != {"lo"}:
        pytest.fail(f"run this in a private network namespace (interfaces here: {sorted(ifaces)})")
    for r in rules:
        subprocess.run(["iptables", "-A", *r], check=True)
    blocked = [True]

    def unblock() -> None:
        if blocked[0]:
            blocked[0] = False
            for r in rules:
                subprocess.run(["iptables", "-D", *r], check=False)
    yield BLOCKED, unblock
    unblock()


def test_a_pair_whose_direct_connection_is_refused_falls_back_within_the_bound_and_trains(cluster,
                                                                                         blocked_address):
    blocked_address, unblock = blocked_address
    cluster.serve()
    good = [cluster.rank("--direct-host", "127.0.0.1"), cluster.rank("--direct-host", "127.0.0.2")]
    bad = cluster.rank("--direct-host", blocked_address)   # its TCP connections are all refused
    seen = wait_for(lambda: any(r["pid"] == bad.p.pid for r in cluster.reports()) and time.monotonic(),
                    30, "the blocked rank's first report")

    def settled():
        rs = cluster.reports()
        if len(rs) != 3 or any(len(r.get("links") or {}) != 2 for r in rs):
            return None
        p = _pairs(rs)
        return "connecting" not in p.values() and (rs, p)
    rs, pairs = wait_for(settled, 30, "3 ranks, every pair settled")
    # the refused pairs are on the relay within the bound of the blocked rank's joining (its
    # first report comes within a report interval, 1 s, of its joining)
    took = time.monotonic() - seen
    assert took <= FALLBACK_BOUND_S + 1.0, took
    bad_id = next(f"{r['id']:08x}" for r in rs if r["pid"] == bad.p.pid)
    for (a, b), kind in pairs.items():
        assert kind == ("relay" if bad_id in (a, b) else "tcp"), pairs
    # (warned by the pair's dialer, whose connection was refused; the other end saw no answer)
    logs = "".join(p.text() for p in (bad, *good))
    assert "uses the relay" in logs and "failed" in logs, logs[-2000:]
    # and the room still trains, every rank at the same parameters at the end
    s0 = cluster.state()["step"]
    wait_for(lambda: min(r["step"] for r in cluster.reports()) > s0 + 20, 60, "20 more steps on every rank")
    # the firewall lifted: the lower id of each refused pair tries again within its backoff
    # (tabcohort.bus.path.RETRY_BASE_MS doubling per failed try) and every pair ends on tcp
    unblock()
    wait_for(lambda: (rs := cluster.reports()) and len(p := _pairs(rs)) == 6 and set(p.values()) == {"tcp"},
             RETRY_BOUND_S, "every pair on tcp again once the firewall is lifted")
    s1 = cluster.state()["step"]
    wait_for(lambda: min(r["step"] for r in cluster.reports()) > s1 + 20, 60, "20 more steps on tcp")
    assert len(_final_digests(cluster, 3)) == 1



@pytest.fixture
def silence():
    """Drop (no reset: the connections stay open and carry nothing) every packet between two
    addresses, both ways, in this private namespace; undone at the end."""
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        pytest.fail("the silent-path case needs root and iptables (scripts/install-test.sh installs it)")
    with open("/proc/net/dev") as f:
        ifaces = {ln.split(":")[0].strip() for ln in f.read().splitlines()[2:]}
    if ifaces != {"lo"}:
        pytest.fail(f"run this in a private network namespace (interfaces here: {sorted(ifaces)})")
    rules: list[list[str]] = []

    def drop(a: str, b: str) -> None:
        for src, dst in ((a, b), (b, a)):
            r = ["OUTPUT", "-s", src, "-d", dst, "-j", "DROP"]
            subprocess.run(["iptables", "-A", *r], check=True)
            rules.append(r)

    def lift() -> None:
        while rules:
            subprocess.run(["iptables", "-D", *rules.pop()], check=False)
    yield drop, lift
    lift()


def test_a_leader_whose_direct_paths_go_silent_keeps_its_lead_over_the_relay_and_loses_no_step(cluster, silence):
    # docs/PROTOCOL.md "Direct TCP path", "Silence": with the idle bound at 5 s the followers
    # took over at 3.2 s and the leader's 1,600-6,400 steps since were thrown away (11 of 11 runs)
    from .test_partition_heal import StepLog, _one_leader
    drop, lift = silence
    cluster.serve("--report-interval", "0.25")
    hosts = ["127.0.0.10", "127.0.0.11", "127.0.0.12"]
    ranks = [cluster.rank("--direct-host", h) for h in hosts]
    log = StepLog(cluster)

    def all_tcp():
        rs = log.sample()
        lead = _one_leader(rs, 3)
        return lead and lead["step"] >= 200 and set(_pairs(rs).values()) == {"tcp"} and lead
    lead = wait_for(all_tcp, 60, "3 ranks on direct paths under one leader past step 200")
    mine = hosts[next(i for i, p in enumerate(ranks) if p.p.pid == lead["pid"])]
    for h in hosts:
        if h != mine:
            drop(mine, h)
    # the leader's pairs move to the relay at the silence bound, well before a takeover
    wait_for(lambda: (rs := log.sample()) and len(p := _pairs(rs)) == 6
             and all(k == "relay" for (a, b), k in p.items() if f"{lead['id']:08x}" in (a, b)), 15,
             "the leader's pairs on the relay")
    s0 = max(r["step"] for r in log.sample())
    wait_for(lambda: (ld := _one_leader(log.sample(), 3)) and ld["step"] > s0 + 200, 30,
             "200 more steps over the relay under one leader")
    lift()
    final = wait_for(lambda: _one_leader(log.sample(), 3), 10, "one leader")
    assert (final["id"], final["term"]) == (lead["id"], lead["term"]), (lead, final)
    assert not log.rewinds(), log.rewinds()
    assert len(_final_digests(cluster, 3)) == 1
