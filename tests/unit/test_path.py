"""The path core (tabcohort.bus.path): one peer's route, queue and counters, stepped with a
number for the clock (docs/INTERFACES.md, "Bus"; PROTOCOL.md, "Bus contract")."""

from __future__ import annotations

from tabcohort.bus.path import RETRY_BASE_MS, RETRY_CAP_MS, URGENT_MAX_BYTES, Path, PathState

BIG = 1 << 30


def test_a_small_frame_overtakes_queued_bulk_chunks_behind_earlier_small_ones():
    p = Path(7, now_ms=0.0)
    bulk = [b"B" * 5000, b"C" * 5000]
    assert p.enqueue(bulk, 10000, max_queue_bytes=BIG)
    assert p.enqueue([b"s1"], 2, max_queue_bytes=BIG)
    assert p.enqueue([b"s2"], 2, max_queue_bytes=BIG)
    assert p.enqueue([b"x" * (URGENT_MAX_BYTES + 1)], URGENT_MAX_BYTES + 1, max_queue_bytes=BIG)  # not small
    assert list(p.queue)[:4] == [b"s1", b"s2", bulk[0], bulk[1]]
    assert p.queued_bytes == 10004 + URGENT_MAX_BYTES + 1 and p.sent == p.queued_bytes and p.direct_sent == 0


def test_nothing_leaves_the_queue_before_the_channel_opens_then_flow_control_bounds_it():
    p = Path(7, now_ms=100.0)
    for _ in range(4):
        p.enqueue([b"x" * 3000], 3000, max_queue_bytes=BIG)
    assert p.take(0, 1 << 20) == []                                 # still connecting
    assert p.opened(65536, now_ms=350.0) == 0
    assert p.state is PathState.DIRECT and p.up_after_ms == 250.0 and p.direct_sent == 12000
    assert len(p.take(0, 5000)) == 2                                # 0 -> 3000 -> 6000 >= 5000
    assert len(p.take(4999, 5000)) == 1 and p.take(5000, 5000) == []
    assert p.queued_bytes == 3000


class _Channel:
    """A channel's flow-control face: what a send leaves buffered and whether it took the chunks."""

    def __init__(self, keeps: bool, takes: bool = True) -> None:
        self.keeps, self.takes = keeps, takes
        self.buffered, self.sends = 0, []

    def buffered_bytes(self) -> int:
        return self.buffered

    def send(self, chunks) -> bool:
        self.sends.append(len(chunks))
        if self.takes and self.keeps:
            self.buffered += sum(map(len, chunks))
        return self.takes


def test_pump_hands_a_write_through_channel_the_whole_queue_and_others_one_high_water_mark():
    def path() -> Path:
        p = Path(7, now_ms=0.0)
        for _ in range(10):
            p.enqueue([b"x" * 1000], 1000, max_queue_bytes=BIG)
        p.opened(65536, now_ms=1.0)
        return p
    p, through = path(), _Channel(keeps=False)            # a TCP path whose kernel takes it all
    p.pump(through, 2500)
    assert through.sends == [3, 3, 3, 1] and p.queued_bytes == 0
    p, buffering = path(), _Channel(keeps=True)           # a data channel: bufferedAmount grows
    p.pump(buffering, 2500)
    assert buffering.sends == [3] and p.queued_bytes == 7000
    p, dead = path(), _Channel(keeps=False, takes=False)  # closing, or its send deferred
    p.pump(dead, 2500)
    assert dead.sends == [3] and p.queued_bytes == 7000   # the rest stays for the relay


def test_opening_with_a_smaller_message_size_drops_what_was_cut_for_a_larger_one():
    p = Path(7, now_ms=0.0)
    p.enqueue([b"x" * 20000], 20000, max_queue_bytes=BIG)
    p.enqueue([b"y" * 100], 100, max_queue_bytes=BIG)
    assert p.opened(16384, now_ms=10.0) == 2
    assert (p.queued_bytes, p.sent, p.direct_sent, list(p.queue)) == (0, 0, 0, [])
    assert p.opened(16384, now_ms=20.0) == 0                        # once only


def test_fallback_drops_the_queue_takes_back_its_count_and_happens_once():
    p = Path(7, now_ms=0.0)
    p.opened(65536, now_ms=1.0)
    p.enqueue([b"a" * 100], 100, max_queue_bytes=BIG)
    p.take(0, 1 << 20)                                              # on the wire
    p.enqueue([b"b" * 50, b"c" * 50], 100, max_queue_bytes=BIG)
    assert p.fallback("data channel closed") == 2
    assert p.state is PathState.RELAY and p.why == "data channel closed"
    assert (p.sent, p.direct_sent, p.queued_bytes) == (100, 100, 0)
    assert p.fallback("again") is None and p.why == "data channel closed"
    assert p.take(0, 1 << 20) == []


def test_the_queue_bound_refuses_a_frame_whole():
    p = Path(7, now_ms=0.0)
    assert p.enqueue([b"x" * 600], 600, max_queue_bytes=1000)
    assert not p.enqueue([b"y" * 300, b"z" * 200], 500, max_queue_bytes=1000)
    assert p.queued_bytes == 600 and len(p.queue) == 1


def test_connect_and_idle_bounds_expire_exactly():
    p = Path(7, now_ms=1000.0)
    assert p.expired(now_ms=6000.0, connect_timeout_ms=5000.0, idle_timeout_ms=None) is None
    assert p.expired(now_ms=6000.5, connect_timeout_ms=5000.0, idle_timeout_ms=None) == "channel not open within 5 s"
    p.opened(65536, now_ms=2000.0)
    p.received_chunk(10, direct=True, now_ms=3000.0)
    assert p.expired(now_ms=13000.0, connect_timeout_ms=5000.0, idle_timeout_ms=10000.0) is None
    assert p.expired(now_ms=13001.0, connect_timeout_ms=5000.0, idle_timeout_ms=None) is None   # no bound
    assert p.expired(now_ms=13001.0, connect_timeout_ms=5000.0,
                     idle_timeout_ms=10000.0) == "no bytes from the peer for 10 s"
    p.received_chunk(5, direct=False, now_ms=20000.0)               # relayed bytes do not prove the channel
    assert p.last_rx_ms == 3000.0 and (p.received, p.direct_received) == (15, 10)


def test_backlog_signals_and_the_peers_backlog_count_as_buffered():
    p = Path(7, now_ms=0.0)
    assert p.backlog_to_report(800) is None
    p.hold(50)
    assert p.backlog_to_report(800) == 50
    p.hold(99)
    assert p.backlog_to_report(800) is None
    p.release()
    assert p.backlog_to_report(800) == 0
    assert not p.set_remote_backlog(True, 1000) and not p.set_remote_backlog(-1, 1000)
    assert not p.set_remote_backlog("5", 1000)
    assert p.set_remote_backlog(5000, 1000) and p.remote_backlog == 1000
    p.enqueue([b"x" * 10], 10, max_queue_bytes=BIG)
    assert p.buffered(channel_buffered=90) == 1100


def test_a_path_on_the_relay_retries_after_a_doubling_backoff_and_relays_while_it_comes_up():
    p = Path(7, now_ms=0.0)
    p.fallback("channel not open within 5 s", now_ms=5000.0)
    assert p.retry_at_ms == 5000.0 + RETRY_BASE_MS
    assert not p.retry_due(5000.0 + RETRY_BASE_MS - 1) and p.retry_due(5000.0 + RETRY_BASE_MS)
    p.retry(now_ms=20000.0)
    assert p.state is PathState.CONNECTING and p.retrying and p.label == "relay"
    assert not p.retry_due(10 ** 9)                                  # not on the relay now
    assert p.expired(now_ms=25001.0, connect_timeout_ms=5000.0, idle_timeout_ms=None) is not None  # bound from the retry
    p.fallback("channel not open within 5 s", now_ms=25001.0)       # the try failed: twice the delay
    assert p.retry_at_ms == 25001.0 + 2 * RETRY_BASE_MS and not p.retrying
    for i in range(10):
        p.retry(now_ms=0.0)
        p.fallback("again", now_ms=0.0)
    assert p.retry_at_ms == RETRY_CAP_MS                             # capped
    p.retry(now_ms=1.0)
    assert p.opened(65536, now_ms=2.0) == 0
    assert p.state is PathState.DIRECT and not p.retrying and p.label == "rtc"
    p.fallback("data channel closed", now_ms=100.0)                  # an opened channel resets the backoff
    assert p.retry_at_ms == 100.0 + RETRY_BASE_MS
