"""Per-client bounds in front of the handlers (README "Limits"): open connections per address,
failed token checks per address, and the Origin of browser requests.

- :class:`ConnectionGuard` hooks an aiohttp :class:`~aiohttp.web.Server` (``runner.server``)
  and aborts a new TCP connection from an address that already holds
  ``max_connections_per_address``. (The header timeout itself is aiohttp's: a connection
  that has not sent a complete request head within ``keepalive_timeout`` is closed, and
  ``serve`` sets that to ``header_timeout_s``.)
- :class:`AuthLimiter` counts failed token checks per address in a sliding window.
- :func:`origin_allowed` is the same-origin rule (RFC 6454) with an allow-list.

Refusals are counted in a ``collections.Counter`` the app exposes (``/metrics``
``tabcohort_server_refused_total{reason}``). "An address" is :func:`client_key`'s: an IPv4
address, or an IPv6 /64.
"""

from __future__ import annotations

import asyncio
import ipaddress

from collections import Counter, deque
from typing import Any, Iterable
from urllib.parse import urlsplit


def client_key(addr: str | None) -> str:
    """The client a per-address bound is kept for: an IPv4 address as it is (an IPv4-mapped
    IPv6 one as its IPv4), an IPv6 address as its /64 network (RFC 4291 2.5.4: one host's
    interface prefix; one host may send from any address in it, and each would otherwise get a
    fresh budget), anything else (a Unix socket, None) as the string given or ``""``."""
    if not addr:
        return ""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return addr
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)


class ConnectionGuard:
    """Bounds open connections per client address on one aiohttp ``web.Server``.

    Args:
        max_per_address: open connections one address may hold.
        counters: where refusals are counted (``connections_per_address``).
    """

    def __init__(self, max_per_address: int, counters: Counter) -> None:
        self.max_per_address = max_per_address
        self.counters = counters
        self.open: Counter = Counter()
        self._admitted: dict[Any, str] = {}

    def install(self, server: Any) -> None:
        """Wrap ``server.connection_made`` / ``connection_lost`` (called by every request
        handler of that server with itself and its transport)."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: Any) -> None:
            peer = transport.get_extra_info("peername")
            addr = client_key(peer[0] if isinstance(peer, (tuple, list)) and peer else str(peer))
            made(handler, transport)
            if self.open[addr] >= self.max_per_address:
                self.counters["connections_per_address"] += 1
                # aborted once the handler's task has started (aborted here, the connection was
                # lost before the task began, and each refusal logged an AssertionError traceback
                # from aiohttp: "Task exception was never retrieved")
                loop = asyncio.get_running_loop()
                loop.call_soon(loop.call_soon, transport.abort)
                return
            self.open[addr] += 1
            self._admitted[handler] = addr

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            addr = self._admitted.pop(handler, None)
            if addr is not None:
                self.open[addr] -= 1
                if self.open[addr] <= 0:
                    del self.open[addr]
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost


class AuthLimiter:
    """At most ``max_failures`` failed token checks per address per ``window_s`` seconds.

    Memory is bounded: at most ``max_addresses`` addresses are tracked (the stalest is
    forgotten first).
    """

    def __init__(self, max_failures: int, window_s: float, max_addresses: int = 65536) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_addresses = max_addresses
        self._fails: dict[str, deque[float]] = {}

    def blocked(self, addr: str | None, now: float) -> bool:
        """True when ``addr`` used up its failures in the window (its requests get 429)."""
        d = self._fails.get(client_key(addr))
        return d is not None and len(d) >= self.max_failures and now - d[0] < self.window_s

    def fail(self, addr: str | None, now: float) -> None:
        key = client_key(addr)
        d = self._fails.pop(key, None)
        if d is None:
            d = deque(maxlen=self.max_failures)
            if len(self._fails) >= self.max_addresses:
                del self._fails[next(iter(self._fails))]    # the least recently failed
        d.append(now)
        self._fails[key] = d                                # most recent last

    def retry_after_s(self, addr: str | None, now: float) -> float:
        d = self._fails.get(client_key(addr))
        return 0.0 if not d else max(0.0, self.window_s - (now - d[0]))


def origin_allowed(origin: str | None, host: str | None, allowed: Iterable[str]) -> bool:
    """The same-origin rule for a browser request (RFC 6454): no ``Origin`` header (not a
    browser: native ranks, curl) is allowed; ``null`` never is; otherwise the origin's host
    and port must equal the request's ``Host`` or be in ``allowed`` (``*``: any origin).
    """
    if origin is None:
        return True
    allowed = tuple(allowed)
    if "*" in allowed:
        return True
    origin = origin.strip()
    if origin == "null" or not origin:
        return False
    if origin.rstrip("/") in allowed:
        return True
    try:
        u = urlsplit(origin)
    except ValueError:
        return False
    if u.scheme not in ("http", "https") or not u.netloc or not host:
        return False
    default = {"http": "80", "https": "443"}[u.scheme]

    def norm(netloc: str) -> str:
        netloc = netloc.lower()
        return netloc if netloc.rsplit("]", 1)[-1].count(":") else f"{netloc}:{default}"
    return norm(u.netloc) == norm(host)
