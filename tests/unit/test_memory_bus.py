"""In-memory bus fault knobs and bookkeeping (beyond the conformance battery)."""

from __future__ import annotations

import pytest

from tabcohort.bus import MemoryNetwork
from tabcohort.errors import ConfigError
from tabcohort.sched import SimScheduler


def beat(step: int) -> dict:
    return {"t": "beat", "batch": 1, "ready": True, "running": True, "term": 1, "step": step, "backend": "py"}


def rig(n: int = 3, **kw):
    s = SimScheduler()
    net = MemoryNetwork(s, **kw)
    buses = [net.attach(i + 1) for i in range(n)]
    box = {b.id: [] for b in buses}
    for b in buses:
        b.on_message = box[b.id].append
    return s, net, buses, box


def steps(box_list):
    return [m["step"] for m in box_list]


def test_delivery_is_never_synchronous_and_respects_delay():
    s, net, (a, b, _), box = rig()
    net.set_link(a.id, b.id, delay_ms=10.0, symmetric=False)
    a.post(beat(1))
    assert box[b.id] == [] and box[3] == []  # zero delay still goes through the scheduler
    s.run_until(0)
    assert steps(box[3]) == [1] and box[b.id] == []
    s.run_until(9.9)
    assert box[b.id] == []
    s.run_until(10)
    assert steps(box[b.id]) == [1]
    assert [(d.time_ms, d.sender, d.recipient) for d in net.log] == [(0, 1, 3), (10, 1, 2)]


def test_loss_duplicate_reorder_are_seeded():
    def run(seed):
        s, net, (a, b), box = rig(2, seed=seed)
        net.set_default_link(delay_ms=1.0, loss=0.2, duplicate=0.2, reorder=0.2)
        for i in range(200):
            a.post(beat(i))
            s.run_until(s.now_ms() + 0.5)
        s.run_until(1000)
        return steps(box[b.id]), dict(net.drops)

    got, drops = run(5)
    assert run(5) == (got, drops)
    assert drops["loss"] > 10
    assert len(got) != len(set(got))  # duplicates
    assert got != sorted(got)  # reordering
    assert len(set(got)) == 200 - drops["loss"]


def test_partition_and_heal():
    s, net, (a, b, c), box = rig()
    net.partition([[a.id, b.id], [c.id]])
    a.post(beat(1))
    c.post(beat(2))
    s.run_until(1)
    assert steps(box[b.id]) == [1] and box[c.id] == [] and steps(box[a.id]) == []
    assert net.drops["partition"] == 3
    net.heal()
    c.post(beat(3))
    s.run_until(2)
    assert steps(box[a.id]) == [3] and steps(box[b.id]) == [1, 3]


def test_partition_loses_frames_in_flight():
    s, net, (a, b), box = rig(2)
    net.set_default_link(delay_ms=5.0)
    a.post(beat(1))
    net.partition([[a.id], [b.id]])
    s.run_until(10)
    assert box[b.id] == [] and net.drops["partition"] == 1
    assert a.pressure() == 0.0


def test_stall_holds_and_releases_in_order():
    s, net, (a, b), box = rig(2, high_water_bytes=100)
    net.stall(b.id, True)
    for i in range(5):
        a.post(beat(i))
    s.run_until(5)
    assert box[b.id] == [] and a.pressure() > 1.0
    net.stall(b.id, False)
    assert box[b.id] == []
    s.run_until(6)
    assert steps(box[b.id]) == [0, 1, 2, 3, 4] and a.pressure() == 0.0


def test_unknown_recipient_and_reattach():
    s, net, (a, b), box = rig(2)
    a.post({**beat(1), "to": 99})
    assert net.drops == {"no_route": 1} and a.drops()["no_route"] == 1
    with pytest.raises(ConfigError):
        net.attach(b.id)
    b.close()
    b2 = net.attach(b.id)
    got = []
    b2.on_message = got.append
    a.post(beat(2))
    s.run_until(1)
    assert steps(got) == [2] and box[b.id] == []


def test_chunked_frames_are_counted_and_logged_independently():
    s, net, (a, b), box = rig(2, max_message_bytes=256, precision="bf16")
    a.post({"t": "grad", "term": 1, "step": 1, "loss": 0.0, "samples": 1, "g": [0.5] * 1000, "to": b.id})
    s.run_until(1)
    (m,) = box[b.id]
    assert m["to"] == b.id and len(m["g"]) == 1000
    assert a.writer.n_chunks > 1 and a.bytes()[b.id].sent == a.writer.n_bytes
    (d,) = net.log
    assert d.msg is not m and list(d.msg["g"]) == list(m["g"])


def test_bad_config_is_a_config_error():
    with pytest.raises(ConfigError):
        MemoryNetwork(SimScheduler(), precision="fp4")
    with pytest.raises(ConfigError):
        MemoryNetwork(SimScheduler(), high_water_bytes=0)


def test_bandwidth_serialises_frames_on_a_link_after_its_delay():
    s, net, (a, b, c), box = rig(high_water_bytes=1000)
    net.set_link(a.id, b.id, symmetric=False, delay_ms=50.0, bandwidth_bytes_per_s=10_000.0)
    msg = {"t": "grad", "step": 1, "term": 1, "loss": 0.5, "samples": 1, "g": [0.0] * 2000}
    size = sum(map(len, a.writer.write(dict(msg, **{"from": a.id}))))
    tx_ms = 1000.0 * size / 10_000.0
    a.post(dict(msg, to=b.id))
    a.post(dict(msg, to=b.id))
    a.post(dict(msg, to=c.id))                    # another link: not slowed by a -> b
    s.run_until(1)
    assert len(box[c.id]) == 1 and box[b.id] == []
    assert a.pressure() > 1                        # two frames still on the link
    s.run_until(tx_ms + 50 - 0.01)
    assert box[b.id] == []
    s.run_until(tx_ms + 50)
    assert len(box[b.id]) == 1                     # the first after its transmission and the delay
    s.run_until(2 * tx_ms + 50 - 0.01)
    assert len(box[b.id]) == 1
    s.run_until(2 * tx_ms + 50)
    assert len(box[b.id]) == 2 and a.pressure() == 0   # the second waited for the first


def test_nothing_is_delivered_from_the_cut_on():
    # a run bounded in time (simulate --max-seconds) cuts the network: what is in flight then and
    # what is posted after is dropped unread, so a flooded event loop drains and the run can stop
    s, net, (a, b, _), box = rig()
    net.set_default_link(delay_ms=10.0)
    a.post(beat(1))                  # arrives at 10
    s.run_until(5)
    a.post(beat(2))                  # arrives at 15
    net.cut_at_ms = 12.0
    s.run_until(11)
    assert steps(box[b.id]) == [1]
    s.run_until(100)
    a.post(beat(3))
    s.run_until(200)
    assert steps(box[b.id]) == [1] and net.drops["cut"] == 2 + 1   # beat 2 to 2 ranks, then beat 3's post
    assert net.pending() == 0
