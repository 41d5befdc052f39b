"""Fair relay queues and per-sender rate limits (README "Limits"): one flooding rank cannot fill
another rank's queue or delay the server's controls to it.

- :class:`FairQueue` is one receiver's relay queue: a FIFO per sender, served round-robin one
  item at a time, with the server's own controls (``SERVER``) always first. Items of one sender
  keep their order (a frame's chunks stay in order); items of different senders interleave,
  which the receiver's reassembly (per sender) allows.
- :class:`TokenBucket` bounds what one link may send per second (messages and bytes).

Both are plain Python with time passed in (seconds), tested without a server.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator

#: The sender key of the server's own control messages in a :class:`FairQueue`.
SERVER = -1


class FairQueue:
    """One receiver's relay queue: per-sender FIFOs served round-robin, server controls first.

    ``n_bytes`` / ``n_items`` are the totals; ``bytes_of(s)`` / ``items_of(s)`` one sender's.
    """

    __slots__ = ("_subs", "_bytes", "_ring", "n_bytes", "n_items")

    def __init__(self) -> None:
        self._subs: dict[int, deque[bytes | str]] = {}
        self._bytes: dict[int, int] = {}
        self._ring: deque[int] = deque()   # senders (not SERVER) with queued items, in service order
        self.n_bytes = 0
        self.n_items = 0

    def __len__(self) -> int:
        return self.n_items

    def __bool__(self) -> bool:
        return self.n_items > 0

    def __iter__(self) -> Iterator[bytes | str]:
        for q in self._subs.values():
            yield from q

    def push(self, sender: int, item: bytes | str) -> None:
        q = self._subs.get(sender)
        if q is None:
            q = self._subs[sender] = deque()
            self._bytes[sender] = 0
            if sender != SERVER:
                self._ring.append(sender)
        q.append(item)
        self._bytes[sender] += len(item)
        self.n_bytes += len(item)
        self.n_items += 1

    def pop(self) -> bytes | str:
        """The next item: a server control if any, else the next sender's oldest item.

        Raises:
            IndexError: the queue is empty.
        """
        if SERVER in self._subs:
            return self._take(SERVER)
        if not self._ring:
            raise IndexError("pop from an empty FairQueue")
        s = self._ring.popleft()
        item = self._take(s, in_ring=False)
        if s in self._subs:
            self._ring.append(s)
        return item

    def _take(self, s: int, *, tail: bool = False, in_ring: bool = True) -> bytes | str:
        q = self._subs[s]
        item = q.pop() if tail else q.popleft()
        self._bytes[s] -= len(item)
        self.n_bytes -= len(item)
        self.n_items -= 1
        if not q:
            del self._subs[s]
            del self._bytes[s]
            if s != SERVER and in_ring:
                self._ring.remove(s)
        return item

    def bytes_of(self, sender: int) -> int:
        return self._bytes.get(sender, 0)

    def items_of(self, sender: int) -> int:
        q = self._subs.get(sender)
        return 0 if q is None else len(q)

    def senders(self) -> list[int]:
        """Senders with queued items (``SERVER`` included when controls are queued)."""
        return list(self._subs)

    def n_senders(self) -> int:
        """Senders with queued items (the server's controls count as one)."""
        return len(self._subs)

    def evict_tail(self, sender: int) -> bytes | str:
        """Remove and return ``sender``'s newest item (load shedding)."""
        return self._take(sender, tail=True)

    def clear(self) -> None:
        self._subs.clear()
        self._bytes.clear()
        self._ring.clear()
        self.n_bytes = self.n_items = 0


class TokenBucket:
    """A token bucket (RFC 2697's committed rate and burst): ``rate`` tokens per second up to
    ``burst``; :meth:`take` spends ``n`` tokens or reports that the sender is over its rate.

    Args:
        rate: tokens added per second (> 0).
        burst: bucket size, tokens (>= the largest single ``n``).
        now: the time it starts full at, seconds.
    """

    __slots__ = ("rate", "burst", "tokens", "at")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = float(rate)
        self.burst = float(burst)
        self.tokens = float(burst)
        self.at = now

    def take(self, n: float, now: float) -> bool:
        """Spend ``n`` tokens at time ``now`` (seconds); False (nothing spent) when short."""
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    def wait_s(self, n: float, now: float) -> float:
        """Seconds from ``now`` until the bucket holds ``n`` tokens (0.0: it does now; nothing
        is spent). ``n`` above ``burst`` is taken as ``burst``."""
        missing = min(n, self.burst) - min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
        return max(0.0, missing / self.rate)
