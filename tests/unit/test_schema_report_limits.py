"""The bounds on a link's state reports (``rooms.REPORTS_PER_INTERVAL``, ``schema.over_members``):
reports past a few per report interval are dropped and counted before they are checked, and a
per-rank map or list longer than the room's seats is a malformed report. The other ranks'
reports, the room's JSON and its stop checks go on (no sockets: the room's bookkeeping)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tabcohort_server")   # (the server never runs in a tab)
from tabcohort_server import schema  # noqa: E402
from tabcohort_server import rooms  # noqa: E402
from tabcohort_server.config import JobConfig, ServerLimits  # noqa: E402
from tabcohort_server.rooms import LARGE_CONTROL_BYTES, REPORT_BURST, REPORTS_PER_INTERVAL, Room  # noqa: E402
from tabcohort_server.schema import RANK_FIELDS, check_control, over_members, parse_control  # noqa: E402


def ids(n: int) -> list[str]:
    return [f"{i:08x}" for i in range(n)]


def report(**state) -> dict:
    return {"type": "report", "state": state}


@pytest.mark.parametrize("field", [f for f in RANK_FIELDS if f != "links"])
def test_a_per_rank_field_longer_than_the_room_holds_is_a_bad_report(field):
    value = schema.REPORT_STATE["properties"][field]
    one = {"relay": 1} if field == "pair_bytes" else 1
    make = (lambda n: ids(n)) if value.get("type") == "array" else (lambda n: {k: one for k in ids(n)})
    assert check_control(report(**{field: make(200)}), max_ranks=200) is None
    assert check_control(report(**{field: make(201)}), max_ranks=200) == f"bad_report.{field}"
    assert check_control(report(**{field: make(201)})) is None          # (no room: the schema's 4096)
    assert over_members(report(**{field: make(201)}), 200) == f"bad_report.{field}"


def test_links_hold_the_members_and_the_servers_path():
    links = {k: "rtc" for k in ids(200)} | {"server": "ws"}
    assert check_control(report(links=links), max_ranks=200) is None
    links["000000c8"] = "rtc"
    assert check_control(report(links=links), max_ranks=200) == "bad_report.links"


def test_relay_peers_longer_than_the_room_holds_are_dropped():
    assert check_control({"type": "relay_peers", "ids": list(range(200))}, max_ranks=200) is None
    assert check_control({"type": "relay_peers", "ids": list(range(201))}, max_ranks=200) == "bad_relay_peers"


def test_the_member_cap_counts_only_and_leaves_other_reasons_alone():
    assert over_members(report(shares="not a map"), 1) is None        # the schema says why
    assert check_control(report(shares="x"), max_ranks=1) == "bad_report.shares"
    assert over_members({"type": "report", "state": [1, 2]}, 1) is None
    assert parse_control(json.dumps(report(step=3, shares={"00000001": 1})), max_ranks=200) == (
        report(step=3, shares={"00000001": 1}), None)


def make_room(interval: float = 1.0, **lim) -> tuple[Room, list[float]]:
    clock = [0.0]
    r = Room("r", JobConfig(dataset="synthetic", report_interval_s=interval), ServerLimits(**lim),
             clock=lambda: clock[0])
    return r, clock


def test_reports_past_a_few_per_interval_are_dropped_before_the_check_and_charged():
    r, clock = make_room(interval=1.0)
    flood, honest = r.register(now=0), r.register(now=0)
    big = json.dumps(report(step=1, pair_bytes={k: {"relay": 2**62} for k in ids(150)}))
    for _ in range(50):
        r.control(flood, big, now=0.0)
    assert r.drops == {"report_rate_limited": 50 - REPORT_BURST}
    assert flood.charged == {"report_rate_limited": 50 - REPORT_BURST}
    # a malformed one over the rate is not checked either: counted as over the rate
    r.control(flood, json.dumps(report(step=-1)), now=0.0)
    assert r.drops == {"report_rate_limited": 51 - REPORT_BURST}
    # the honest rank, one report an interval, is never touched; nor are other controls
    for t in range(20):
        r.control(honest, json.dumps(report(step=t)), now=float(t))
        r.control(flood, json.dumps({"type": "relay_peers", "ids": [honest.id]}), now=float(t))
    assert honest.report["step"] == 19 and "report_rate_limited" not in honest.charged
    assert flood.relay_peers == {honest.id}
    # the flooder's budget refills at REPORTS_PER_INTERVAL per interval
    before = r.drops["report_rate_limited"]
    for i in range(40):
        r.control(flood, big, now=100.0 + i * 0.1)        # 10 a second for 4 s
    kept = 40 - (r.drops["report_rate_limited"] - before)
    assert kept <= REPORT_BURST + REPORTS_PER_INTERVAL * 4 + 1
    assert json.dumps(r.summary(200.0), allow_nan=False)


def test_the_report_rate_follows_the_jobs_interval_and_a_final_report_gets_through():
    r, clock = make_room(interval=0.1)
    p = r.register(now=0)
    for i in range(100):                                   # one every report interval: all kept
        r.control(p, json.dumps(report(step=i)), now=i * 0.1)
    r.control(p, json.dumps(report(step=100, final=True)), now=9.9)   # right after the last one
    assert r.drops == {} and p.report["final"] is True


def test_reports_from_a_room_of_its_size_pass_and_one_more_entry_is_dropped():
    r, clock = make_room(max_ranks_per_room=200)
    p = r.register(now=0)
    r.control(p, json.dumps(report(step=1, shares={k: 1 for k in ids(200)})), now=0)
    assert r.drops == {} and len(p.report["shares"]) == 200
    r.control(p, json.dumps(report(step=2, shares={k: 1 for k in ids(201)})), now=1)
    assert r.drops == {"bad_report.shares": 1} and p.report["step"] == 1


def test_a_large_control_over_the_report_rate_is_dropped_before_it_is_parsed(monkeypatch):
    r, clock = make_room()
    p = r.register(now=0)
    parsed = []
    real = rooms.parse_json
    monkeypatch.setattr(rooms, "parse_json", lambda text: parsed.append(len(text)) or real(text))
    big = json.dumps(report(step=1, pair_bytes={k: {"relay": 2**62} for k in ids(1000)}))
    junk = json.dumps({"type": "nope", "x": "y" * LARGE_CONTROL_BYTES})     # large: spends it too
    assert len(big) > LARGE_CONTROL_BYTES
    for _ in range(10):
        r.control(p, big, now=0.0)
    r.control(p, junk, now=0.0)
    assert len(parsed) == REPORT_BURST and r.drops == {"report_rate_limited": 11 - REPORT_BURST}
    # small controls are parsed (a signal's SDP, a backlog), and a small report spends after
    r.control(p, json.dumps({"type": "backlog", "bytes": 5}), now=0.0)
    r.control(p, json.dumps(report(step=2)), now=0.0)
    assert p.rx_backlog == 5 and p.report["step"] == 1 and r.drops["report_rate_limited"] == 12 - REPORT_BURST
    # junk nested too deep is called so, budget or not (a bracket scan, no parse)
    r.control(p, "[" * 30000 + "]" * 30000, now=0.0)
    assert r.drops["too_deep"] == 1 and len(parsed) == REPORT_BURST + 2


@pytest.mark.parametrize("key", ["<img src=x onerror=alert(1)>", "zz_7", "x" * 64])
def test_a_drop_reason_never_names_a_field_the_rank_chose(key):
    # an unknown field is ignored, but a non-finite one fails the whole report: the reason (a
    # counter key in the room's JSON and a /metrics label) names no key the rank chose, so a
    # rank cannot grow the room's drops with a new key per report
    text = '{"type": "report", "state": {"step": 1, ' + json.dumps(key) + ': 1e999}}'
    assert parse_control(text)[1] == "bad_report.unknown_field"
    assert parse_control('{"type": "report", "state": {"loss": 1e999}}')[1] == "bad_report.loss"
