"""Room bookkeeping without aiohttp: ids, routing, spoofing, slow consumers, stop conditions."""

from __future__ import annotations

import json

import pytest

from tabcohort.wire import FrameWriter
from tabcohort_server.config import JobConfig, ServerConfig, ServerLimits
from tabcohort_server.rooms import CLOSE_SLOW_CONSUMER, CLOSE_UNKNOWN_ID, Room, RoomError
from tabcohort.errors import ConfigError


def beat() -> dict:
    return {"t": "beat", "batch": 4, "ready": True, "running": True, "term": 1, "step": 1, "backend": "py"}


def room(**lim) -> Room:
    clock = [0.0]
    r = Room("r", JobConfig(dataset="synthetic", steps=10), ServerLimits(**lim), clock=lambda: clock[0])
    r._clock = clock
    return r


def drain(p) -> list:
    out = []
    while p.queue:
        out.append(p.pop())
    return out


def test_ids_are_unique_uint32_and_resume_needs_the_secret():
    r = room()
    ps = [r.register(now=0) for _ in range(300)]  # >= 200 ranks per room
    assert len({p.id for p in ps}) == 300 and all(0 < p.id < 2**32 for p in ps)
    a = ps[0]
    r.disconnect(a, 1.0)
    with pytest.raises(RoomError) as e:
        r.register(now=2.0, resume_id=a.id, resume_secret="wrong")
    assert e.value.code == CLOSE_UNKNOWN_ID
    assert r.register(now=2.0, resume_id=a.id, resume_secret=a.secret) is a and a.connected
    r.disconnect(a, 3.0)
    assert a.id in r.expire(3.0 + r.limits.resume_grace_s + 1)
    with pytest.raises(RoomError):
        r.register(now=50.0, resume_id=a.id, resume_secret=a.secret)


def test_a_room_remembers_a_bounded_number_of_released_ids_and_never_draws_one(monkeypatch):
    # an adversarial trial: every expired rank's id was kept for good (20,000 register /
    # disconnect / expire cycles: 20,000 ids; about 0.5 GB a day at the registration limit)
    import tabcohort_server.rooms as rooms
    monkeypatch.setattr(rooms, "RELEASED_IDS_KEPT", 8)
    r = room()
    r.secret_key = b"k" * 32
    t = 0.0
    gone = []
    for _ in range(20):
        p = r.register(now=t)
        r.disconnect(p, t)
        t += r.limits.resume_grace_s + 1
        gone += r.expire(t)
    assert len(gone) == 20 and list(r._released) == gone[-8:]
    newest = gone[-1]                        # still remembered: its owner cannot take it back
    with pytest.raises(RoomError):
        r.register(now=t, resume_id=newest, resume_secret=r._secret(newest))
    draws = iter([newest, 12345])            # and a new rank never gets it
    monkeypatch.setattr(r.rng, "getrandbits", lambda bits: next(draws))
    assert r.register(now=t).id == 12345


def test_a_star_rank_that_declares_relay_peers_is_relayed_to_those_only():
    """Direct TCP paths (docs/PROTOCOL.md): a star rank's broadcast goes to every peer until it
    declares ``relay_peers``, then to those only; a reconnect forgets the declaration."""
    r = room()
    a, b, c = (r.register(now=0) for _ in range(3))
    for p in (a, b, c):
        drain(p)
    chunk = FrameWriter(a.id).write(beat())[0]
    r.relay(a, chunk)
    assert drain(b) == [chunk] and drain(c) == [chunk]
    r.control(a, json.dumps({"type": "relay_peers", "ids": [c.id]}), now=0.5)
    r.relay(a, chunk)
    assert drain(b) == [] and drain(c) == [chunk]
    r.control(a, json.dumps({"type": "relay_peers", "ids": []}), now=0.6)
    r.relay(a, chunk)
    assert drain(b) == [] and drain(c) == []
    r.disconnect(a, 1.0)
    assert r.register(now=1.5, resume_id=a.id, resume_secret=a.secret) is a and a.relay_peers is None
    for p in (b, c):
        drain(p)
    r.relay(a, chunk)
    assert drain(b) == [chunk] and drain(c) == [chunk]


def test_broadcast_to_others_addressed_to_one_spoofed_dropped():
    r = room()
    a, b, c = (r.register(now=0) for _ in range(3))
    for p in (a, b, c):
        drain(p)
    chunk = FrameWriter(a.id).write(beat())[0]
    r.relay(a, chunk)
    assert drain(a) == [] and drain(b) == [chunk] and drain(c) == [chunk]
    to_c = FrameWriter(a.id).write({**beat(), "t": "grad", "term": 1, "step": 1, "loss": 0.1, "samples": 1, "g": [1.0],
                                    "to": c.id})[0]
    r.relay(a, to_c)
    assert drain(b) == [] and drain(c) == [to_c]
    r.relay(b, chunk)  # b sends a chunk claiming to be from a
    assert r.drops == {"spoofed": 1} and drain(a) == drain(c) == []
    r.relay(a, b"\x01garbage")
    assert r.drops["truncated"] == 1


def test_a_consumer_that_does_not_read_is_dropped_not_waited_for():
    r = room(queue_high_water_bytes=1000, queue_max_bytes=5000, write_stall_s=5.0)
    a, b, c = (r.register(now=0) for _ in range(3))
    kicked = []
    b.kick = lambda code, reason: kicked.append(code)
    chunk = FrameWriter(a.id).write({"t": "grad", "term": 1, "step": 1, "loss": 0.1, "samples": 1, "g": [0.5] * 120})[0]
    r.writing(b, now=0.0)       # the socket layer began a write to b that never completes
    for _ in range(12):
        r.relay(a, chunk)
        drain(c)  # c keeps up, b never reads
    assert b.connected and b.queued_bytes <= 5000 and r.drops["fair_share"] > 0   # bounded, shed
    assert r.check_stalls(4.9) == [] and kicked == []
    assert r.check_stalls(5.1) == [b.id]
    assert kicked == [CLOSE_SLOW_CONSUMER] and not b.connected and r.drops["slow_consumer"] == 1
    assert r.pressure() < 1.0
    texts = [json.loads(x) for x in drain(a) if isinstance(x, str)]
    assert {"type": "peer", "id": b.id, "up": False, "may_lead": False} in texts
    assert any(t["type"] == "pressure" and t["p"] > 1 for t in texts)


def test_a_backlog_signal_to_a_peer_is_clamped_like_the_backlog_control():
    # a rank of any role sent a peer {"kind": "backlog", "bytes": 2**62}: forwarded unchanged,
    # it lifted the recipient's pressure far over 1 and stalled the room's leader
    r = room(queue_high_water_bytes=1000, queue_max_bytes=50_000)
    a, b = r.register(now=0), r.register(now=0)
    drain(a), drain(b)
    r.control(b, json.dumps({"type": "signal", "to": a.id, "kind": "backlog", "bytes": 2**62}), now=0)
    got = [json.loads(x) for x in drain(a) if isinstance(x, str)]
    assert {"type": "signal", "to": a.id, "from": b.id, "kind": "backlog", "bytes": 1000} in got, got
    assert r.drops["backlog_clamped"] == 1 and b.charged["backlog_clamped"] == 1
    r.control(b, json.dumps({"type": "signal", "to": a.id, "kind": "backlog", "bytes": 300}), now=0)
    assert {"type": "signal", "to": a.id, "from": b.id, "kind": "backlog", "bytes": 300} in [
        json.loads(x) for x in drain(a) if isinstance(x, str)]
    r.control(b, json.dumps({"type": "signal", "to": a.id, "kind": "backlog", "bytes": -5}), now=0)
    assert not [x for x in drain(a) if isinstance(x, str) and '"backlog"' in x]
    assert b.charged["bad_signal"] >= 1


def test_a_reported_receive_backlog_counts_in_the_pressure_every_sender_sees():
    # a tab cannot pause reading its socket: what its stalled worker holds it reports, and the
    # room counts it as it counts its own queue (PROTOCOL.md "Bus contract": pressure)
    r = room(queue_high_water_bytes=1000, queue_max_bytes=50_000)
    a, b = r.register(now=0), r.register(now=0)
    drain(a), drain(b)
    r.control(b, json.dumps({"type": "backlog", "bytes": 700}), now=0)
    assert 0.7 <= r.pressure() < 0.8   # (+ the pressure control now queued for b itself)
    assert {"type": "pressure", "p": 0.7} in [json.loads(x) for x in drain(a) if isinstance(x, str)]
    drain(b)
    r._clock[0] = 1.0                # a change below 1 is told at most every pressure_report_s
    r.control(b, json.dumps({"type": "backlog", "bytes": 0}), now=0)
    assert {"type": "pressure", "p": 0.0} in [json.loads(x) for x in drain(a) if isinstance(x, str)]
    drain(b)
    assert r.pressure() == 0
    for bad in (-1, "x", True, None):
        r.control(b, json.dumps({"type": "backlog", "bytes": bad}), now=0)
    drain(a), drain(b)
    assert r.drops["bad_backlog"] == 4 and r.pressure() == 0
    r.control(b, json.dumps({"type": "backlog", "bytes": 10**12}), now=0)
    # a claim alone never lifts the pressure over backlog_max_pressure (1: no leader paces on it)
    assert r.drops["backlog_clamped"] == 1 and b.charged["backlog_clamped"] == 1
    drain(b)
    assert r.pressure() == 1.0
    r._enqueue(b, b"x" * 300)        # with bytes queued for b the claim still lifts it to 1 at most
    assert r.pressure() == 1.0
    r._enqueue(b, b"x" * 900)        # the server's own queue counts whole
    assert r.pressure() == 1.2
    drain(b)
    r.disconnect(b, now=1)
    drain(a)
    assert r.pressure() == 0   # a gone rank's backlog no longer counts


def test_pressure_is_the_max_load_over_connected_ranks_under_any_interleaving():
    # the room keeps the max in a lazy heap (no scan per frame); check it against a scan
    import random

    rng = random.Random(7)
    r = room(queue_high_water_bytes=1000, queue_max_bytes=10**9, queue_max_items=10**6)
    peers = [r.register(now=0) for _ in range(12)]
    for i in range(3000):
        p = rng.choice(peers)
        op = rng.random()
        if op < 0.45 and p.connected:
            r._enqueue(p, b"x" * rng.randint(1, 300))
        elif op < 0.8 and p.queue:
            item = p.pop()
            if rng.random() < 0.5:
                r.sent(p, item)          # the socket layer reports it; or not (pop alone)
        elif op < 0.9:
            r.control(p, json.dumps({"type": "backlog", "bytes": rng.randint(0, 2000)}), now=0)
        elif op < 0.95 and p.connected:
            r.disconnect(p, now=i)
        elif not p.connected:
            q = r.register(now=i)
            peers[peers.index(p)] = q
        scan = max((q.load_bytes for q in r.connected.values()), default=0) / 1000
        assert r.pressure() == scan, (i, op)


def test_reports_drive_the_stop_condition():
    r = room()
    a = r.register(now=0, trainer=True)
    drain(a)
    r.control(a, json.dumps({"type": "report", "state": {"step": 5, "is_leader": True, "leader": a.id,
                                                         "junk": 1}}), now=1)
    assert not r.stopped and "junk" not in a.report
    r.control(a, "not json", now=1)
    r.control(a, json.dumps({"type": "report", "state": {"step": 10, "is_leader": True, "leader": a.id}}), now=2)
    assert r.stopped and r.drops["bad_json"] == 1
    assert json.loads(drain(a)[-1]) == {"type": "stop", "reason": "steps 10 reached"}


def test_a_report_with_a_path_to_every_one_of_hundreds_of_peers_is_kept_and_kind_is_checked():
    # 64 idle sockets from one address made every honest rank's `links` longer than 64 entries,
    # and the server dropped each of its reports (its view of the room froze); `kind` was kept
    # whatever it held (a 60,000-character string went into every public room JSON)
    r = room()
    a = r.register(now=0, trainer=True)
    drain(a)
    links = {"server": "ws", **{f"{k:08x}": "relay" for k in range(1, 200)}}
    r.control(a, json.dumps({"type": "report", "state": {"step": 5, "is_leader": True, "leader": a.id,
                                                         "links": links, "kind": "native"}}), now=1)
    assert a.report["step"] == 5 and len(a.report["links"]) == 200 and a.report["kind"] == "native"
    r.control(a, json.dumps({"type": "report", "state": {"step": 6, "is_leader": True, "leader": a.id,
                                                         "kind": "x" * 60_000}}), now=2)
    assert a.report["step"] == 5 and r.drops["bad_report.kind"] == 1, r.drops


def test_config_errors_name_the_setting():
    with pytest.raises(ConfigError, match="topology.*ring"):
        ServerConfig(rooms={"r": JobConfig(topology="ring")}).validate()
    ServerConfig(rooms={"r": JobConfig(topology="mesh")}).validate()  # mesh is implemented
    with pytest.raises(ConfigError, match="max_ranks_per_room"):
        ServerLimits(max_ranks_per_room=100)
    # an lr above the bound names the lr the user set (it named lr_max, which they had not)
    with pytest.raises(ConfigError, match=r"lr=20.0: above the room's lr_max \(10\)") as e:
        ServerConfig(rooms={"r": JobConfig(lr=20.0)}).validate()
    with pytest.raises(ConfigError, match="lr_max"):
        ServerConfig(rooms={"r": JobConfig(lr_max=0.0)}).validate()
    # a rank's cap above the global batch could never apply (serve --batch 128 with the default
    # --global-batch 64 was taken silently); equal, or 0 (= the global batch), is fine
    with pytest.raises(ConfigError, match=r"batch=128: .* at most the global batch \(serve's --global-batch, "
                                          r"a rooms file's global_batch: 64\); raise that"):
        ServerConfig(rooms={"r": JobConfig(batch=128, global_batch=64)}).validate()
    ServerConfig(rooms={"r": JobConfig(batch=64, global_batch=64)}).validate()
    ServerConfig(rooms={"r": JobConfig(batch=0, global_batch=64)}).validate()


@pytest.mark.parametrize("content", [b"abc def ghi jkl mno pqr\n", b"x", b"", b"\xff" * 20])
def test_a_trainer_token_file_no_rank_would_accept_is_a_configuration_error(tmp_path, content):
    # serve printed a token with spaces as the trainer token (every rank refused it, so none
    # could lead) and silently replaced a short one the operator had written
    from tabcohort_server.app import create_app
    (tmp_path / ".trainer-token").write_bytes(content)
    with pytest.raises(ConfigError) as e:
        create_app(ServerConfig(rooms={"r": JobConfig(dataset="synthetic")}, checkpoint_dir=str(tmp_path)))
    assert e.value.variable == str(tmp_path / ".trainer-token") and "16..256" in e.value.reason
    assert "abc" not in str(e.value) and (tmp_path / ".trainer-token").read_bytes() == content


def test_a_rank_that_stopped_reading_does_not_pace_the_room():
    # a frozen tab or a stopped process: its socket accepts no write; after pressure_stall_s it
    # no longer counts in the pressure every leader paces on (the others keep their rate)
    r = room(queue_high_water_bytes=1000, queue_max_bytes=50_000, pressure_stall_s=1.0)
    a, b, c = r.register(now=0), r.register(now=0), r.register(now=0)
    drain(a), drain(b), drain(c)
    chunk = FrameWriter(a.id).write({"t": "grad", "term": 1, "step": 1, "loss": 0.1, "samples": 1,
                                     "g": [0.5] * 1000, "to": c.id})[0]
    r.relay(a, chunk)
    r.writing(c, now=0.0)                      # a write to c began and never completes
    assert r.pressure() > 1                    # c is merely slow so far: the leader paces
    r._clock[0] = 1.5
    assert r.pressure() < 0.1                  # c stopped reading: it no longer paces the room
    r.sent(c, c.pop())                         # c reads again: it counts again
    r.relay(a, chunk)
    assert r.pressure() > 1


def test_pressure_below_1_is_told_at_most_once_per_report_period_and_crossing_1_at_once():
    # a queue that fills and empties with every round must not send two controls per round to
    # every rank (ServerLimits.pressure_report_s); leaders pace above 1, so crossing it is told
    # at once (PROTOCOL.md "Bus contract": pressure)
    r = room(queue_high_water_bytes=1000, queue_max_bytes=50_000, pressure_report_s=0.25)
    a, b = r.register(now=0), r.register(now=0)
    drain(a), drain(b)

    def told() -> list[float]:
        return [json.loads(x)["p"] for x in drain(a) if isinstance(x, str) and '"pressure"' in x]

    def empty_b() -> None:
        while b.queue:
            r.sent(b, b.pop())

    r.control(b, json.dumps({"type": "backlog", "bytes": 500}), now=0)
    assert told() == [0.5]
    for i in range(200):                      # 200 fill/drain swings within one period
        r._clock[0] = 0.001 * (i + 1)
        r.control(b, json.dumps({"type": "backlog", "bytes": 0 if i % 2 == 0 else 500}), now=0)
    empty_b()
    assert told() == [] and r.n_pressure_coalesced > 0
    big = FrameWriter(a.id).write({"t": "grad", "term": 1, "step": 1, "loss": 0.1, "samples": 1,
                                   "g": [0.5] * 400})[0]
    r.relay(a, big)                           # b's relay queue over the high-water mark
    assert [p > 1 for p in told()] == [True]  # crossing 1: at once, inside the period
    empty_b()                                 # and back below it, at once
    assert [p <= 1 for p in told()] == [True]
    r.control(b, json.dumps({"type": "backlog", "bytes": 300}), now=0)
    empty_b()
    assert told() == []                       # held back ...
    r._clock[0] = 1.0
    r.flush_pressure()
    assert told() == [0.3]                    # ... and told by the periodic flush

def report(r, p, now, **state):
    r.control(p, json.dumps({"type": "report", "state": state}), now=now)


def test_roles_are_bound_by_the_server_and_announced_never_self_declared():
    r = room()
    t = r.register(now=0, trainer=True)
    v = r.register(now=0)
    assert t.may_lead and not v.may_lead
    w = r.welcome(v, resumed=False)
    assert w["may_lead"] is False and w["lead_peers"] == [t.id]
    assert r.welcome(t, resumed=False)["may_lead"] is True
    assert {"type": "peer", "id": v.id, "up": True, "may_lead": False} in [
        json.loads(x) for x in (r.announce(v, True), drain(t))[1] if isinstance(x, str)]
    from tabcohort_server.schema import check_register, check_server_control
    assert check_server_control(w) is None and check_server_control(r.welcome(t, resumed=True)) is None
    assert check_server_control({"type": "peer", "id": v.id, "up": True, "may_lead": False}) is None
    assert check_server_control({"type": "peer", "id": v.id, "up": True}) is not None
    assert check_register({"type": "register", "trainer_token": "x" * 20}) is None
    assert check_register({"type": "register", "trainer_token": 5}) == "bad_register"
    assert check_register({"type": "register", "resume": {"id": "1", "secret": "s"}}) == "bad_register"
    trusted = Room("r", JobConfig(dataset="synthetic"), ServerLimits(), any_rank_may_lead=True)
    assert trusted.register(now=0).may_lead
    # a rank without the role that claims to lead is shown, counted, and never trusted
    report(r, v, 1, step=10, is_leader=True, leader=v.id, term=99, accuracy=1.0)
    assert r.drops["lead_claim_refused"] == 1 and r.leader_peer() is None and r.step() == 0
    assert not r.stopped and not r.may_upload(v)
    report(r, t, 1, step=3, is_leader=True, leader=t.id, term=1)
    assert r.leader_peer() is t and r.step() == 3 and r.may_upload(t)
    s = r.summary(1.0)
    assert {x["id"]: x["role"] for x in s["ranks"]} == {t.id: "may lead", v.id: "contributes"}
    assert s["lead_policy"] == "trainer credential"


def test_the_highest_term_leads_and_a_stopped_leader_may_still_upload_its_final_checkpoint():
    r = room()
    a, b = r.register(now=0, trainer=True), r.register(now=0, trainer=True)
    report(r, a, 1, step=5, is_leader=True, term=1)
    report(r, b, 1, step=2, is_leader=True, term=2)     # a takeover's new term wins
    assert r.leader_peer() is b and r.step() == 2
    report(r, a, 2, step=2, is_leader=False, term=2)    # a stood down and follows b
    report(r, b, 2, step=4, is_leader=False, term=2)    # stopped at the limit: reports so
    assert r.leader_peer() is None and r.may_upload(b) and not r.may_upload(a)


def test_an_implausible_step_jump_of_the_leader_is_dropped_and_counted():
    r = room()   # steps=10: a forged step would stop the room at once
    a = r.register(now=0, trainer=True)
    report(r, a, 1.0, step=1, is_leader=True, term=1)
    slack = r.limits.step_jump_slack
    report(r, a, 1.0, step=10**15, is_leader=True, term=1, accuracy=1.0)
    assert r.drops["report_step_jump"] == 1 and a.charged["report_step_jump"] == 1
    assert r.step() == 1 and not r.stopped and a.report["step"] == 1   # the report was dropped whole
    report(r, a, 1.0, step=1 + slack, is_leader=True, term=1)          # within the bound: taken
    assert r.step() == 1 + slack and r.stopped


def test_a_room_resumed_from_its_checkpoint_credits_the_checkpoints_age_to_the_leaders_step_bound(tmp_path):
    # A server restarted on its checkpoint directory: the ranks trained on from that checkpoint
    # while no server held the room (native ranks over their direct paths) and it was up to one
    # interval old. The bound on the leader's step counted only from the restart: the honest
    # leader's first reports were dropped (report_step_jump) and its checkpoints refused after 7
    # of 10 restarts (a fault campaign, 4,000 steps/s)
    import hashlib
    import struct
    import time
    from types import SimpleNamespace

    from tabcohort_server import checkpoint as ckpt
    from tabcohort_server.app import load_room_checkpoint

    def resumed(age_s: float) -> Room:
        d = tmp_path / f"ck{age_s:g}"
        d.mkdir()
        data = struct.pack("<2f", 0.5, -0.5)
        ckpt.save(str(d), "r", {"step": 1000, "digest": hashlib.sha256(data).hexdigest(), "n": 2, "job_hash": "h",
                                "term": 1, "time": time.time() - age_s}, data)
        r = Room("r", JobConfig(dataset="synthetic"), ServerLimits(), clock=time.monotonic)
        assets = SimpleNamespace(bucket_len=2, job_hash="h", checkpoint_bytes=len(data), checkpoint_data=None)
        assert load_room_checkpoint(r, assets, str(d)) and r.resumed_from_step == 1000
        return r

    lim = ServerLimits()
    r = resumed(4.0)     # stored 4 s before: the cohort went on at 10,000 steps/s meanwhile
    a = r.register(now=time.monotonic(), trainer=True)
    ahead = int(lim.step_jump_slack + 4.0 * 10_000)
    report(r, a, time.monotonic(), step=1000 + ahead, is_leader=True, term=1)
    assert "report_step_jump" not in r.drops and r.step() == 1000 + ahead
    # the credit is bounded (an interval and the ranks' reconnect bound), so an old checkpoint
    # does not lift the bound for ever
    old = resumed(3600.0)
    b = old.register(now=time.monotonic(), trainer=True)
    report(old, b, time.monotonic(), step=1000 + int(lim.max_steps_per_s * 600), is_leader=True, term=1)
    assert old.drops.get("report_step_jump") == 1
