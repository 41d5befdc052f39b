"""A shaped TCP link for the benchmarks: a proxy between one rank and the server whose every
direction has a rate (bytes/s) and a one-way delay, as the simulator's ``MemoryNetwork`` link
knob has (``tabcohort.bus.memory``: bytes are serialised onto the link at ``size / rate``, then
arrive ``delay`` later).

Each accepted connection gets an upstream connection to ``target``; each direction reads what
arrives, holds the reader until the link has had time to carry it (so a fast sender sees the
link's back-pressure through TCP, as on a real slow link) and delivers it ``delay_ms`` later, in
order. Bench tooling only: waiting in it *is* the link; tests never use it.
"""

from __future__ import annotations

import asyncio
from typing import Any

READ_BYTES = 16384


class ShapedProxy:
    """One shaped link: ``127.0.0.1:port`` -> ``target``.

    Args:
        target: ``(host, port)`` of the real server.
        rate_bytes_per_s: each direction's rate.
        delay_ms: each direction's one-way delay.
    """

    def __init__(self, target: tuple[str, int], *, rate_bytes_per_s: float, delay_ms: float) -> None:
        if not rate_bytes_per_s > 0 or not delay_ms >= 0:
            raise ValueError(f"rate_bytes_per_s={rate_bytes_per_s!r} must be > 0, delay_ms={delay_ms!r} >= 0")
        self.target = target
        self.rate = float(rate_bytes_per_s)
        self.delay_s = float(delay_ms) / 1000.0
        self.port = 0
        self.carried_bytes = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(*self.target)
        except OSError:
            w.close()
            return
        for src, dst in ((r, uw), (ur, w)):
            t = asyncio.ensure_future(self._direction(src, dst))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _direction(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        inflight: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await inflight.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    dst.close()
                    return
                dst.write(data)
                await dst.drain()

        out = asyncio.ensure_future(deliver())
        free_at = loop.time()
        try:
            while data := await src.read(READ_BYTES):
                now = loop.time()
                free_at = max(now, free_at) + len(data) / self.rate
                self.carried_bytes += len(data)
                inflight.put_nowait((free_at + self.delay_s, data))
                if free_at > now:
                    await asyncio.sleep(free_at - now)   # the link is busy until then
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            inflight.put_nowait((free_at + self.delay_s, None))
            try:
                await out
            except (OSError, ConnectionError):
                pass


async def shaped_links(target: tuple[str, int], n: int, **kw: Any) -> list[ShapedProxy]:
    """``n`` started proxies to ``target`` (one per rank)."""
    out = [ShapedProxy(target, **kw) for _ in range(n)]
    for p in out:
        await p.start()
    return out
