"""Untrusted controls and relay traffic against the room bookkeeping (no sockets): malformed and
forged state reports, deep JSON, drop reasons from ranks, a flooding sender, per-address seats,
names and tokens. Whatever one rank sends, the room's JSON and metrics render and the other
ranks' reports and stop checks go on."""

from __future__ import annotations

import json
import logging
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from tabcohort.errors import ConfigError
from tabcohort.wire import FrameWriter
from tabcohort_server.config import JobConfig, ServerConfig, ServerLimits
from tabcohort_server.metrics import RoomCollector
from tabcohort_server.rooms import (CLOSE_ADDRESS_FULL, CLOSE_RATE_LIMITED, Room, RoomError, RoomRegistry)
from tabcohort_server.schema import parse_control

pytestmark = pytest.mark.integration


def make_room(steps: int = 0, **lim) -> tuple[Room, list[float]]:
    clock = [0.0]
    r = Room("r", JobConfig(dataset="synthetic", steps=steps), ServerLimits(**lim), clock=lambda: clock[0])
    return r, clock


def drain(p) -> list:
    out = []
    while p.queue:
        out.append(p.pop())
    return out


def report(p, **state) -> str:
    return json.dumps({"type": "report", "state": state})


def renders(r: Room) -> str:
    """The room's JSON (as the app serves it: strict JSON) and its Prometheus text."""
    json.dumps(r.summary(1.0), allow_nan=False)
    rooms = RoomRegistry({}, r.limits)
    rooms.rooms[r.name] = r
    reg = CollectorRegistry()
    reg.register(RoomCollector(rooms))
    return generate_latest(reg).decode()


ATTACKS = [
    ({"type": "report", "state": {}}, None),                      # no step at all: valid, ignored fields
    ({"type": "report", "state": {"step": None}}, "bad_report.step"),
    ({"type": "report", "state": {"step": -1}}, "bad_report.step"),
    ({"type": "report", "state": {"step": 2**63}}, "bad_report.step"),
    ({"type": "report", "state": {"step": 1.5}}, "bad_report.step"),
    ({"type": "report", "state": {"step": True}}, "bad_report.step"),
    ({"type": "report", "state": {"step": "7"}}, "bad_report.step"),
    ({"type": "report", "state": {"loss": "x"}}, "bad_report.loss"),
    ({"type": "report", "state": {"accuracy": 7.0}}, "bad_report.accuracy"),
    ({"type": "report", "state": {"leader": -3}}, "bad_report.leader"),
    ({"type": "report", "state": {"backend": "x" * 300}}, "bad_report.backend"),
    ({"type": "report", "state": {"drops": {"pretender": -1}}}, "bad_report.drops"),
    ({"type": "report", "state": {"drops": {"<script>": 1}}}, "bad_report.drops"),
    # JSON Schema's pattern is a search and "$" matches before a final newline (a hostile trial)
    ({"type": "report", "state": {"drops": {"a\n": 1}}}, "bad_report.drops"),
    ({"type": "report", "state": {"links": {"server\n": "relay"}}}, "bad_report.links"),
    ({"type": "report", "state": {"shares": {"0000000a\n": 3}}}, "bad_report.shares"),
    ({"type": "report", "state": {"held_ms": {"<b>x</b>": 1.0}}}, "bad_report.held_ms"),
    ({"type": "report", "state": {"held_ms": {"0000000a": "slow"}}}, "bad_report.held_ms"),
    ({"type": "report", "state": {"counters": {f"k{i}": 1 for i in range(100)}}}, "bad_report.counters"),
    ({"type": "report", "state": {"leaders": [[1, 2.0, 3]] * 100}}, "bad_report.leaders"),
    ({"type": "report", "state": {"leaders": [["x"]]}}, "bad_report.leaders"),
    ({"type": "report", "state": []}, "bad_report"),
    ({"type": "report"}, "bad_report"),
    ({"type": "backlog", "bytes": -1}, "bad_backlog"),
    ({"type": "relay_peers", "ids": ["a"]}, "bad_relay_peers"),
    ({"type": "signal", "to": True, "kind": "offer"}, "bad_signal"),
    ({"type": "signal", "to": 1, "kind": "offer", "sdp": "x" * 20000}, "bad_signal"),
    ({"type": "nope"}, "bad_control"),
    ([1, 2], "bad_control"),
]
RAW_ATTACKS = [
    ('{"type": "report", "state": {"step": NaN}}', "bad_json"),
    ('{"type": "report", "state": {"loss": Infinity}}', "bad_json"),
    ('{"type": "report", "state": {"step": 1e400}}', "bad_report.step"),
    ('{"type": "report", "state": {"loss": 1e999}}', "bad_report.loss"),      # inf after parsing
    ('{"type": "report", "state": {"loss": -1e999}}', "bad_report.loss"),
    ('{"type": "report", "state": {"loss": ' + "9" * 400 + "}}", "bad_report.loss"),  # no double holds it
    ('{"type": "report", "state": {"step": ' + "9" * 400 + "}}", "bad_report.step"),
    ('{"type": "report", "state": {"speeds": {"0000000a": 1e999}}}', "bad_report.speeds"),
    ('{"type": "report", "state": {"held_ms": {"0000000a": 1e999}}}', "bad_report.held_ms"),
    ('{"type": "report", "state": {"policy": {"lr": 1e999}}}', "bad_report.policy"),
    ('{"type": "report", "state": {"step": ' + "9" * 5000 + "}}", "bad_json"),
    ("[" * 30000 + "]" * 30000, "too_deep"),
    ('{"type": "report", "state": {"counters": ' + '{"a":' * 10000 + "1" + "}" * 10000 + "}}", "too_deep"),
    ("\udcff", "bad_json"),
]


@pytest.mark.parametrize("attack,reason", ATTACKS + RAW_ATTACKS,
                         ids=[f"{i}-{why}" for i, (_, why) in enumerate(ATTACKS + RAW_ATTACKS)])
def test_a_malformed_control_is_dropped_by_reason_and_the_room_goes_on(attack, reason, caplog):
    caplog.set_level(logging.DEBUG)
    r, clock = make_room(steps=50)
    lead, bad = r.register(now=0, trainer=True), r.register(now=0)
    text = attack if isinstance(attack, str) else json.dumps(attack)
    r.control(bad, text, now=0.5)
    if reason is not None:
        assert r.drops.get(reason) == 1 and bad.charged.get(reason) == 1, r.drops
    renders(r)
    # the honest leader's reports still count and stop the room at its step
    for step in (10, 50):
        r.control(lead, report(lead, step=step, leader=lead.id, is_leader=True, loss=0.5, accuracy=0.5), now=1)
    assert r.stopped and r.step() == 50
    assert "RecursionError" not in caplog.text and bad.connected


def test_a_report_with_a_number_no_double_holds_is_dropped_and_counted_like_any_bad_field():
    """A loss of 1e999 (an infinity once parsed) or of 400 digits is not kept (once shown as null),
    nor the rest of that report: counted as ``bad_report.loss`` in the room's drops, /metrics and
    the rank's charges, and the rank's previous report stands."""
    r, _ = make_room()
    lead = r.register(now=0, trainer=True)
    r.control(lead, report(lead, step=3, leader=lead.id, is_leader=True, loss=0.25), now=1)
    for i, big in enumerate(("1e999", "-1e999", "9" * 400), start=1):
        r.control(lead, '{"type": "report", "state": {"step": 4, "is_leader": true, "leader": %d, "loss": %s}}'
                  % (lead.id, big), now=1 + i)
        assert r.drops == {"bad_report.loss": i} and lead.charged == {"bad_report.loss": i}
    assert lead.report["loss"] == 0.25 and lead.report["step"] == 3
    s = r.summary(5.0)
    assert s["loss"] == 0.25 and s["drops"] == {"bad_report.loss": 3}
    assert 'tabcohort_drops_total{reason="bad_report.loss",room="r"} 3.0' in renders(r)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["step", "leader", "is_leader", "loss", "accuracy", "cohort", "drops",
                                        "wire_drops", "counters", "links", "backend", "pid", "policy",
                                        "leaders", "gaps", "start_step", "x"]),
                       st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
                                    | st.text(max_size=300),
                                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=70), c,
                                                                                       max_size=4),
                                    max_leaves=12)))
def test_fuzzed_reports_never_break_the_json_metrics_or_the_stop_check(state):
    r, clock = make_room(steps=5)
    lead, bad = r.register(now=0, trainer=True), r.register(now=0)
    r.control(bad, json.dumps({"type": "report", "state": state}), now=0.5)
    renders(r)
    r.control(lead, report(lead, step=5, leader=lead.id, is_leader=True), now=1)
    renders(r)
    assert r.stopped or r.step() < 5  # a forged report (bad claims to lead) may at most hold the stop back
    assert sum(r.drops.values()) <= 1


def test_a_forged_step_from_a_non_leader_neither_stops_the_room_nor_shows():
    r, clock = make_room(steps=1000)
    r.job.target_accuracy = 0.99
    a, b, forger = r.register(now=0, trainer=True), r.register(now=0, trainer=True), r.register(now=0)
    leader = min(a.id, b.id)
    for p in (a, b):
        r.control(p, report(p, step=20, leader=leader, is_leader=p.id == leader, accuracy=0.5), now=1)
    r.control(forger, report(forger, step=10**15, leader=forger.id, is_leader=True, accuracy=1.0), now=1)
    assert not r.stopped and r.step() == 20 and r.drops["lead_claim_refused"] == 1
    s = r.summary(1.0)
    assert s["step"] == 20 and s["accuracy"] == 0.5 and s["leader"] == leader
    for p in (a, b):
        r.control(p, report(p, step=1000, leader=leader, is_leader=p.id == leader, accuracy=0.5), now=2)
    assert r.stopped and r.stop_reason == "steps 1000 reached"


def test_a_lead_claim_without_the_role_never_counts_whatever_its_term():
    r, clock = make_room(steps=1000)
    honest, forger = r.register(now=0, trainer=True), r.register(now=0)
    r.control(honest, report(honest, step=30, leader=honest.id, is_leader=True, term=1), now=1)
    r.control(forger, report(forger, step=10**15, leader=forger.id, is_leader=True, term=2**62), now=1)
    assert not r.stopped and r.step() == 30 and r.leader_peer() is honest
    assert r.drops["lead_claim_refused"] == 1 and forger.charged["lead_claim_refused"] == 1
    # in a trusted-group room the same claim makes it the leader, but its step jump is refused
    t, _ = make_room(steps=1000)
    t.any_rank_may_lead = True
    honest, forger = t.register(now=0), t.register(now=0)
    t.control(honest, report(honest, step=30, leader=honest.id, is_leader=True, term=1), now=1)
    t.control(forger, report(forger, step=10**15, leader=forger.id, is_leader=True, term=2**62), now=1)
    assert not t.stopped and t.step() == 30 and t.drops["report_step_jump"] == 1


def test_rank_drop_reasons_reach_the_room_json_and_metrics():
    r, _ = make_room()
    a, b = r.register(now=0, trainer=True), r.register(now=0, trainer=True)
    r.control(a, report(a, step=1, leader=a.id, drops={"pretender": 2, "stale_round": 1},
                        wire_drops={"reassembly_timeout": 4}), now=1)
    r.control(b, report(b, step=1, leader=a.id, drops={"grad_non_finite": 3, "stale_round": 2}), now=1)
    # a rank of no role: its reasons are its own (its row), never the room's sum or labels
    c = r.register(now=0)
    r.control(c, report(c, step=1, leader=a.id, drops={"invented": 2**62, "stale_round": 2**62}), now=1)
    assert c.report["drops"]["invented"] == 2**62
    rd = r.summary(1.0)["rank_drops"]
    assert rd == {"protocol": {"pretender": 2, "stale_round": 3, "grad_non_finite": 3},
                  "wire": {"reassembly_timeout": 4}}
    text = renders(r)
    assert 'tabcohort_rank_drops{layer="protocol",reason="stale_round",room="r"} 3.0' in text
    assert 'tabcohort_rank_drops{layer="wire",reason="reassembly_timeout",room="r"} 4.0' in text


def test_pids_are_for_the_operator_only():
    r, _ = make_room()
    a = r.register(now=0)
    r.control(a, report(a, step=1, leader=a.id, pid=4242), now=1)
    assert "pid" not in r.summary(1.0)["ranks"][0]["report"]
    assert r.summary(1.0, operator=True)["ranks"][0]["report"]["pid"] == 4242


_WRITERS: dict[int, FrameWriter] = {}


def _tiny(sender: int, i: int, to: int | None = None) -> bytes:
    """A one-chunk beat frame (a fresh frame id each call)."""
    m = {"t": "beat", "term": 1, "batch": 1, "ready": True, "running": True, "step": i, "backend": "x"}
    if to is not None:
        m["to"] = to
    w = _WRITERS.setdefault(sender, FrameWriter(sender))
    return w.write(m)[0]


def test_a_flooding_sender_is_rate_limited_then_closed_and_honest_ranks_are_not_touched():
    r, clock = make_room(sender_max_msgs_per_s=1000, rate_limit_close_s=2.0)
    honest_a, honest_b, flood = (r.register(now=0) for _ in range(3))
    kicked = {}
    for p in (honest_a, honest_b, flood):
        p.kick = lambda code, reason, p=p: kicked.setdefault(p.id, code)
    w_a = FrameWriter(honest_a.id)
    got_b = 0
    for ms in range(0, 3000):                      # 3 s of virtual time
        clock[0] = ms / 1000
        if flood.connected:
            for _ in range(200):                   # 200,000 frames/s
                r.relay(flood, _tiny(flood.id, ms))
        r.relay(honest_a, w_a.write({"t": "beat", "term": 1, "batch": 1, "ready": True, "running": True, "step": ms,
                                     "backend": "x"})[0])       # 1,000 frames/s: at its rate, never over
        got_b += sum(1 for x in drain(honest_b) if isinstance(x, bytes) and x[2:6] == honest_a.id.to_bytes(4, "little"))
        drain(honest_a)
    assert kicked == {flood.id: CLOSE_RATE_LIMITED}, kicked
    assert honest_a.connected and honest_b.connected and "slow_consumer" not in r.drops
    assert got_b == 3000                            # every honest frame relayed
    assert r.drops["rate_limited"] > 1000 and flood.charged["rate_limited"] == r.drops["rate_limited"]
    assert honest_a.charged == {}


def test_a_link_over_its_byte_budget_is_told_how_long_to_wait_not_dropped():
    r, clock = make_room(sender_max_bytes_per_s=1000, contributor_max_bytes_per_s=1000)
    p = r.register(now=0)
    assert r.byte_wait_s(p, 600, 0.0) == 0.0                 # within the burst (1 s worth)
    assert r.admit(p, 600, 0.0)
    assert r.byte_wait_s(p, 600, 0.0) == 0.2                 # 200 bytes short at 1000 bytes/s
    assert r.byte_wait_s(p, 600, 0.1) == 0.1 and r.byte_wait_s(p, 600, 0.2) == 0.0
    assert r.byte_wait_s(p, 5000, 0.2) == 0.4                # more than a burst: waits for a full one
    assert r.byte_paced == 3 and abs(r.byte_paced_s - 0.7) < 1e-9 and not r.drops


def test_a_contributor_has_the_smaller_byte_budget_and_a_rank_that_may_lead_the_larger():
    r, clock = make_room(sender_max_bytes_per_s=10_000, contributor_max_bytes_per_s=1000)
    contributor, trainer = r.register(now=0), r.register(now=0, trainer=True)
    assert not contributor.may_lead and trainer.may_lead
    assert r.admit(contributor, 600, 0.0) and r.admit(trainer, 600, 0.0)
    assert r.byte_wait_s(contributor, 600, 0.0) == 0.2       # 200 bytes short at its 1000 bytes/s
    assert r.byte_wait_s(trainer, 600, 0.0) == 0.0


def test_a_full_queue_sheds_the_heaviest_senders_frames_not_the_receiver():
    # rate limits high: only the fair queue is in play
    r, clock = make_room(queue_high_water_bytes=4000, queue_max_bytes=20_000, queue_max_items=100,
                         sender_max_msgs_per_s=1e9, sender_max_bytes_per_s=1e12, contributor_max_bytes_per_s=1e12)
    leader, recv, flood = (r.register(now=0) for _ in range(3))
    for p in (leader, recv, flood):
        drain(p)
    kicked = []
    recv.kick = lambda code, reason: kicked.append(code)
    lw = FrameWriter(leader.id, max_message_bytes=1000)
    for i in range(5000):                            # the flooder's frames to recv pile up
        r.relay(flood, _tiny(flood.id, i, to=recv.id))
    assert recv.queue.items_of(flood.id) <= 100 and kicked == []
    round_chunks = lw.write({"t": "grad", "term": 1, "step": 1, "loss": 0.1, "samples": 1, "g": [0.5] * 1000, "to": recv.id})
    for ch in round_chunks:
        r.relay(leader, ch)
    r.send_control(recv, {"type": "pressure", "p": 0.5})
    out = drain(recv)
    assert kicked == [] and recv.connected
    assert isinstance(out[0], str)                   # the server's control first
    assert [x for x in out if isinstance(x, bytes) and x[2:6] == leader.id.to_bytes(4, "little")] == round_chunks
    assert flood.charged["fair_share"] > 4000 and "fair_share" not in leader.charged
    # served round-robin: the leader's chunks are not behind the flooder's backlog
    chunks = [x for x in out if isinstance(x, bytes)]
    assert all(isinstance(x, str) for x in out[:len(out) - len(chunks)])   # every control before any chunk
    first_leader = next(i for i, x in enumerate(chunks) if x[2:6] == leader.id.to_bytes(4, "little"))
    assert first_leader <= 1


def test_seats_per_address_are_bounded_and_reserved_seats_count():
    r, clock = make_room(max_ranks_per_address=3, resume_grace_s=30)
    ps = [r.register(now=0, address="10.0.0.9") for _ in range(3)]
    with pytest.raises(RoomError) as e:
        r.register(now=0, address="10.0.0.9")
    assert e.value.code == CLOSE_ADDRESS_FULL
    assert r.register(now=0, address="10.0.0.10").connected      # another address is not affected
    r.disconnect(ps[0], now=1)
    with pytest.raises(RoomError):                               # its seat is still reserved
        r.register(now=2, address="10.0.0.9")
    assert r.register(now=2, resume_id=ps[0].id, resume_secret=ps[0].secret, address="10.0.0.9") is ps[0]
    r.disconnect(ps[1], now=3)
    assert r.register(now=40, address="10.0.0.9").connected      # after the grace, the seat is free


@pytest.mark.parametrize("name", ["dígïts", "数字", ".", "..", "a/b", "", "x" * 65, "a b", "a\x00"])
def test_room_names_are_strict_ascii(name):
    with pytest.raises(ConfigError, match="room"):
        ServerConfig(rooms={name: JobConfig(dataset="synthetic")}).validate()


def test_room_name_ok_and_tokens_need_a_sane_length():
    ServerConfig(rooms={"a.b-c_9": JobConfig(dataset="synthetic")}).validate()
    with pytest.raises(ConfigError, match="r.token"):
        ServerConfig(rooms={"r": JobConfig(dataset="synthetic", token="x")}).validate()
    with pytest.raises(ConfigError, match="operator_token"):
        ServerConfig(rooms={"r": JobConfig(dataset="synthetic")}, operator_token="short").validate()
    with pytest.raises(ConfigError, match="r.token"):
        ServerConfig(rooms={"r": JobConfig(dataset="synthetic", token="sixteen chars ok")}).validate()  # spaces
    ServerConfig(rooms={"r": JobConfig(dataset="synthetic", token="a" * 16)}, operator_token="b" * 16).validate()


def test_parse_control_never_raises_on_random_text():
    rng = random.Random(3)
    alphabet = '{}[]":,0123456789.-eEtruefalsnNI\\ abcxyz\u00e9'
    for _ in range(20_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        obj, why = parse_control(text)
        assert (obj is None) != (why is None)


@pytest.mark.parametrize("args,env,named", [
    (["--token", "x"], {}, "--token"),
    (["--operator-token", "short"], {}, "--operator-token"),
    ([], {"TABCOHORT_OPERATOR_TOKEN": "short"}, "TABCOHORT_OPERATOR_TOKEN"),
    (["--room", "dígïts"], {}, "--room"),
    (["--room", ".."], {}, "--room"),
    (["--allow-origin", "evil"], {}, "--allow-origin"),
    (["--max-ranks-per-address", "0"], {}, "--max-ranks-per-address"),
    (["--trainer-token", "short"], {}, "--trainer-token"),
    ([], {"TABCOHORT_TRAINER_TOKEN": "short"}, "TABCOHORT_TRAINER_TOKEN"),
    (["--checkpoint-keep", "0"], {}, "--checkpoint-keep"),
])
def test_serve_refuses_bad_security_settings_naming_them_before_listening(args, env, named):
    import os
    import subprocess
    import sys

    from .conftest import ROOT, _env
    r = subprocess.run([sys.executable, "-m", "tabcohort", "serve", "--port", "0", "--dataset", "synthetic", *args],
                       capture_output=True, text=True, timeout=60, env={**_env(), **env}, cwd=ROOT)
    assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "URL " not in r.stdout
