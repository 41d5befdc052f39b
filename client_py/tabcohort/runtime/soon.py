"""Immediate callbacks for Pyodide's event loop with at most one host task pending.

Pyodide's ``WebLoop`` runs every ``call_soon`` (and every ``call_later`` of at most 2 ms) as a
host task of its own: it posts one message on a shared ``MessageChannel`` per callback, and each
message runs *every* callback queued when it arrives. A turn that queues two callbacks (a round's
next tick and a task woken by a page message, say) leaves one message with nothing of its own
to run, and while the leader loop keeps one callback queued, such surplus messages are never
drained: the worker's queue of posted messages grows by one for every callback queued beside
the loop's own. Chromium serves a worker's tasks in the order they were queued, so a timer that
falls due, a ``fetch`` that completes and a message from the page all wait behind that backlog.
Measured in a tab leading two native ranks (tests/browser/test_tab_lead_natives.py): timers of
the worker ran up to 6 s late, a checkpoint upload took 6 s, and the leader's state reports
reached the server with gaps of up to 6 s, growing with the run.

:class:`SoonQueue` keeps the ready callbacks in a FIFO of its own and posts at most one host
task (a *pump*) at a time; a pump runs the callbacks that were ready when it started, and posts
the next pump if more came meanwhile. Anything else the worker has to do waits for at most one
pump. The order of callbacks is the order of ``call_soon`` (asyncio's rule, and the FIFO yield of
docs/PROTOCOL.md "The leader loop"). :func:`install` puts it under a running ``WebLoop``
(``tabcohort.runtime.tab.run_tab``); natively nothing uses it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Callable

#: Pyodide runs a ``call_later`` of at most this delay as an immediate task (``scheduleCallback``)
IMMEDIATE_DELAY_S = 0.002


class SoonQueue:
    """A FIFO of ready callbacks drained by one pending host task at a time. Sans-I/O: the host's
    task queue is the ``post`` it is given.

    Args:
        post: runs ``fn()`` once, later, as a task of the host (Pyodide: the loop's own
            ``call_later(0, fn)``).
    """

    def __init__(self, post: Callable[[Callable[[], None]], Any]) -> None:
        self._post = post
        self._ready: deque[asyncio.Handle] = deque()
        self._pending = False
        #: host tasks posted, and callbacks run (a pump runs many when many were ready)
        self.n_pumps = 0
        self.n_run = 0
        #: the most callbacks that were ready at once
        self.max_ready_len = 0

    def push(self, handle: asyncio.Handle) -> None:
        """Queue ``handle`` to run after every handle queued before it."""
        self._ready.append(handle)
        self.max_ready_len = max(self.max_ready_len, len(self._ready))
        self._ensure_pump()

    def pending(self) -> bool:
        """Whether a pump is posted and has not run yet (at most one ever is)."""
        return self._pending

    def pump(self) -> None:
        """Run the handles that are ready now (not those they queue: the next pump's)."""
        self._pending = False
        try:
            n = len(self._ready)
            while n and self._ready:   # (a handle run here may itself run a pump: never pop an empty queue)
                n -= 1
                h = self._ready.popleft()
                if not h.cancelled():
                    self.n_run += 1
                    h._run()
        finally:   # (SystemExit out of a handle: the rest still run, in the next pump)
            if self._ready:
                self._ensure_pump()

    def _ensure_pump(self) -> None:
        if not self._pending:
            self._pending = True
            self.n_pumps += 1
            self._post(self.pump)


def install(loop: asyncio.AbstractEventLoop) -> SoonQueue:
    """Route ``loop``'s immediate callbacks (``call_soon``, ``call_soon_threadsafe``, and
    ``call_later`` of at most :data:`IMMEDIATE_DELAY_S`) through a :class:`SoonQueue` whose
    pumps are posted with the loop's own ``call_later(0, ...)``. For Pyodide's ``WebLoop``;
    installing twice on one loop returns the first queue.

    Returns:
        the queue (its counters show the pumps).
    """
    got = getattr(loop, "_tabcohort_soon", None)
    if got is not None:
        return got
    host_call_later = loop.call_later
    queue = SoonQueue(lambda fn: host_call_later(0, fn))

    def call_soon(callback: Callable[..., Any], *args: Any, context: Any = None) -> asyncio.Handle:
        h = asyncio.Handle(callback, args, loop, context=context)
        queue.push(h)
        return h

    def call_later(delay: float, callback: Callable[..., Any], *args: Any, context: Any = None) -> Any:
        if 0 <= delay <= IMMEDIATE_DELAY_S:
            return call_soon(callback, *args, context=context)
        return host_call_later(delay, callback, *args, context=context)

    loop.call_soon = call_soon                 # type: ignore[method-assign]
    loop.call_soon_threadsafe = call_soon      # type: ignore[method-assign]
    loop.call_later = call_later               # type: ignore[method-assign]
    loop._tabcohort_soon = queue               # type: ignore[attr-defined]
    return queue
