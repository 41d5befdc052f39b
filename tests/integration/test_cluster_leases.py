"""The cluster's pure lease logic (server/tabcohort_server/cluster.py: LeaseBook, claim_rank,
check_redis_url) with explicit time, and the client's 4012 URL rewrite."""

from __future__ import annotations

import pytest

from tabcohort.bus.room import moved_ws_url
from tabcohort.errors import ConfigError

from tabcohort_server import cluster
T = cluster.ClusterTiming(lease_ms=2000, tick_ms=400, takeover_ms=2000, stagger_ms=1000)


def test_a_new_room_is_claimed_at_once_by_the_least_loaded_node_and_later_by_the_others():
    b = cluster.LeaseBook("B", T)
    b.observe("r", None, now_ms=0.0)
    assert b.should_claim("r", now_ms=0.0, rank=0)
    assert not b.should_claim("r", now_ms=999.0, rank=1) and b.should_claim("r", now_ms=1000.0, rank=1)


def test_a_room_another_node_owned_waits_for_the_takeover_period_after_its_lease_lapsed():
    b = cluster.LeaseBook("B", T)
    b.observe("r", "A", now_ms=0.0)
    assert not b.should_claim("r", now_ms=0.0)
    b.observe("r", None, now_ms=1000.0)                      # the lease is gone from here on
    assert not b.should_claim("r", now_ms=2999.0)
    assert b.should_claim("r", now_ms=3000.0)
    assert not b.should_claim("r", now_ms=3999.0, rank=1) and b.should_claim("r", now_ms=4000.0, rank=1)
    b.observe("r", "A", now_ms=3500.0)                       # A came back first
    assert not b.should_claim("r", now_ms=10_000.0)


def test_a_redis_outage_does_not_count_as_absence_and_keeps_held_rooms():
    a, b = cluster.LeaseBook("A", T), cluster.LeaseBook("B", T)
    a.acquired("r", sent_ms=0.0)
    b.observe("r", "A", now_ms=0.0)
    b.observe("r", None, now_ms=100.0)
    b.redis_failed()                                          # the absence seen before is void
    a.redis_failed()
    assert a.holds("r") and a.unconfirmed("r", now_ms=2001.0) and not a.unconfirmed("r", now_ms=1999.0)
    b.observe("r", None, now_ms=12_000.0)                     # Redis back, empty (restarted)
    assert not b.should_claim("r", now_ms=13_000.0)           # B remembers A owned it: A goes first
    assert b.should_claim("r", now_ms=14_000.0)
    a.acquired("r", sent_ms=12_100.0)
    assert not a.unconfirmed("r", now_ms=14_000.0)


def test_a_room_this_node_owned_last_is_reasserted_at_once_and_a_lost_one_is_dropped():
    a = cluster.LeaseBook("A", T)
    a.acquired("r", sent_ms=0.0)
    assert not a.should_claim("r", now_ms=0.0)                # held: renew, never claim
    assert a.lost("r", "B") and not a.holds("r") and a.last_owner["r"] == "B"
    a.observe("r", None, now_ms=5000.0, recorded_owner="A")
    assert not a.should_claim("r", now_ms=5000.0)             # B was seen last: wait
    a2 = cluster.LeaseBook("A", T)
    a2.observe("r", None, now_ms=0.0, recorded_owner="A")
    assert a2.should_claim("r", now_ms=0.0)


def test_claim_rank_orders_eligible_live_nodes_by_load_then_id():
    loads = {"A": (3.0, ["r"]), "B": (1.0, ["r"]), "C": (1.0, ["r", "s"]), "D": (0.0, ["s"])}
    assert cluster.claim_rank("B", loads, "r", 1.0) == 0
    assert cluster.claim_rank("C", loads, "r", 1.0) == 1     # same load as B, higher id
    assert cluster.claim_rank("A", loads, "r", 3.0) == 2     # D cannot host r
    assert cluster.claim_rank("C", loads, "s", 1.0) == 1


def test_failover_bound_is_lease_tick_takeover_and_stagger():
    assert T.failover_bound_ms(2) == 2000 + 400 + 2000 + 1000
    assert T.failover_bound_ms(1) == 4400


@pytest.mark.parametrize("url", ["", "http://h:6379/0", "redis://:6379/0", "redis://h:99999/0", "redis://h/x",
                                 "unix://", "redis://[::1"])
def test_bad_redis_urls_name_the_flag(url):
    with pytest.raises(ConfigError) as e:
        cluster.check_redis_url(url, "--redis")
    assert e.value.variable == "--redis"


def test_a_bad_redis_url_s_password_is_not_echoed():
    with pytest.raises(ConfigError) as e:
        cluster.check_redis_url("redis://:s3cret@h/x", "--redis")
    assert "s3cret" not in str(e.value) and "redis://:***@h/x" in str(e.value), str(e.value)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "redis://h", "rediss://u:p@h:1/15", "unix:///run/r.sock"])
def test_good_redis_urls_pass(url):
    assert cluster.check_redis_url(url) == url


@pytest.mark.parametrize("field, value", [("lease_ms", 50), ("tick_ms", 1000), ("takeover_ms", -1)])
def test_bad_timing_names_the_flag(field, value):
    t = cluster.ClusterTiming(**{field: value, **({"lease_ms": 2000} if field == "tick_ms" else {})})
    with pytest.raises(ConfigError) as e:
        t.validate()
    assert e.value.variable == "--cluster-" + field.replace("_", "-")


@pytest.mark.parametrize("field, value, says", [
    ("lease_ms", -5, "[100, 3600000]"), ("lease_ms", 50, "[100, 3600000]"), ("lease_ms", 99.9, "[100, 3600000]"),
    ("lease_ms", 4_000_000, "[100, 3600000]"), ("tick_ms", -1, "[10, --cluster-lease-ms / 3 = 1666.67]"),
    ("tick_ms", 5, "[10, --cluster-lease-ms / 3 = 1666.67]"), ("takeover_ms", -1, "[0, 3600000]")])
def test_a_bad_timing_message_states_the_range_the_check_enforces(field, value, says):
    # (a lease of 50 ms was refused as "must be >= 100", and one of -5 as "in [0, 3600000]")
    with pytest.raises(ConfigError) as e:
        cluster.ClusterTiming(**{field: value}).validate()
    assert e.value.reason == f"must be milliseconds in {says}", e.value.reason
    cluster.ClusterTiming(lease_ms=100, tick_ms=10, takeover_ms=0).validate()     # both ends are valid
    cluster.ClusterTiming(lease_ms=3_600_000, tick_ms=1_200_000, takeover_ms=3_600_000).validate()


def test_a_4012_reason_becomes_the_owners_socket_url_and_anything_else_is_refused():
    cur = "ws://10.0.0.2:8080/api/rooms/digits/ws"
    assert moved_ws_url(cur, "http://10.0.0.1:8081") == "ws://10.0.0.1:8081/api/rooms/digits/ws"
    assert moved_ws_url(cur, "https://n1.example.org") == "wss://n1.example.org/api/rooms/digits/ws"
    for bad in ("", "javascript:alert(1)", "ftp://h", "http://h/x", "http://h:99999", "http:///", "http://h?q=1"):
        assert moved_ws_url(cur, bad) is None, bad
