"""Schedulers: the one seam through which time-dependent code that is not the rank machine
(the in-memory bus's link delays) gets a clock and delayed callbacks.

Two implementations: :class:`AsyncioScheduler` (real or virtual asyncio time) and
:class:`SimScheduler` (a seeded discrete-event queue for simulations). Times are
milliseconds; asyncio speaks seconds, and the conversion happens here only.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Protocol


class Scheduler(Protocol):
    """What a component needs from a clock."""

    def now_ms(self) -> float:
        """Current time in milliseconds."""

    def call_later(self, delay_ms: float, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` after ``delay_ms`` (>= 0). Returns a handle with ``cancel()``.

        Callbacks due at the same time run in the order they were scheduled (FIFO).
        """


class AsyncioScheduler:
    """Scheduler over an asyncio event loop (``loop.time()`` seconds -> milliseconds)."""

    def __init__(self, loop: Any = None) -> None:
        import asyncio

        self._loop = loop or asyncio.get_event_loop()

    def now_ms(self) -> float:
        return self._loop.time() * 1000.0

    def call_later(self, delay_ms: float, fn: Callable[..., Any], *args: Any) -> Any:
        if delay_ms <= 0:
            return self._loop.call_soon(fn, *args)
        return self._loop.call_later(delay_ms / 1000.0, fn, *args)


class _SimHandle:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class SimScheduler:
    """A discrete-event scheduler: virtual milliseconds, FIFO among equal times.

    ``run_until(t_ms)`` executes every event due at or before ``t_ms`` in time order and
    leaves the clock at ``t_ms``.
    """

    def __init__(self, start_ms: float = 0.0) -> None:
        self._now = float(start_ms)
        self._queue: list[tuple[float, int, _SimHandle, Callable[..., Any], tuple]] = []
        self._seq = itertools.count()

    def now_ms(self) -> float:
        return self._now

    def call_later(self, delay_ms: float, fn: Callable[..., Any], *args: Any) -> _SimHandle:
        h = _SimHandle()
        heapq.heappush(self._queue, (self._now + max(0.0, delay_ms), next(self._seq), h, fn, args))
        return h

    def call_at(self, when_ms: float, fn: Callable[..., Any], *args: Any) -> _SimHandle:
        return self.call_later(when_ms - self._now, fn, *args)

    def next_event_ms(self) -> float | None:
        while self._queue and self._queue[0][2].cancelled:
            heapq.heappop(self._queue)
        return self._queue[0][0] if self._queue else None

    def run_until(self, t_ms: float, *, max_events: int = 10_000_000) -> int:
        """Run events due at or before ``t_ms``; return how many ran.

        Raises:
            RuntimeError: more than ``max_events`` events (a livelock in the simulated system).
        """
        n = 0
        while self._queue and self._queue[0][0] <= t_ms:
            when, _, h, fn, args = heapq.heappop(self._queue)
            if h.cancelled:
                continue
            self._now = max(self._now, when)
            fn(*args)
            n += 1
            if n > max_events:
                raise RuntimeError(f"more than {max_events} events before t={t_ms} ms")
        self._now = max(self._now, t_ms)
        return n
