"""A native rank's driver (``reads_first``, as the rank session runs it) yields to its due
deadlines through a timer due at once, not ``call_soon``: asyncio queues the callbacks of sockets that became readable before the timers
that came due, so what a protocol callback receives while the rank computed (the direct TCP
path's: a follower's bucket, a beat) is read before its next compute. Behind ``call_soon`` a leader computing 2 ms per round read a
follower's bucket two rounds late and measured its turnaround as 10 ms (PROTOCOL.md "Shares":
the turnaround is what a rank's share is planned by)."""

from __future__ import annotations

import asyncio
import socket

from tabcohort.bus.memory import MemoryNetwork
from tabcohort.model.toy import ToyWorker
from tabcohort.protocol import RankMachine
from tabcohort.runtime.driver import RankDriver
from tabcohort.sched import AsyncioScheduler


class Busy(ToyWorker):
    """Computes synchronously (no await, as numpy does) and, in its first computes, makes a
    socket readable, as a peer's bucket arriving while this rank computes does."""

    def __init__(self, peer: socket.socket, events: list) -> None:
        super().__init__(bucket_len=4, batch=2)
        self.peer, self.events, self.n = peer, events, 0

    async def grads(self, offset, samples=None):
        self.n += 1
        self.events.append(("compute", self.n))
        if self.n in (3, 6, 9):
            self.peer.send(b"x")
        return self.grads_sync(offset, samples)


def test_what_arrives_during_a_compute_is_read_before_the_next_compute():
    async def run() -> list:
        loop = asyncio.get_running_loop()
        mine, peer = socket.socketpair()
        mine.setblocking(False)
        events: list = []
        loop.add_reader(mine, lambda: (mine.recv(16), events.append(("read", None))))
        net = MemoryNetwork(AsyncioScheduler(loop), seed=1)
        w = Busy(peer, events)
        bus = net.attach(1)
        m = RankMachine(1, w, bus, job="t", now_ms=RankDriver.clock_ms(loop), lr=0.05)
        d = RankDriver(m, w, bus, reads_first=True)
        d.start()
        try:
            end = loop.time() + 20
            while w.n < 12:
                assert loop.time() < end, events
                await asyncio.sleep(0.005)
        finally:
            await d.close()
            loop.remove_reader(mine)
            mine.close()
            peer.close()
        return events
    events = asyncio.run(run())
    for k in (3, 6, 9):      # the byte written in compute k is read before compute k + 1
        i = events.index(("compute", k))
        assert events[i + 1] == ("read", None), events[i - 2:i + 4]
