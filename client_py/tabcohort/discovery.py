"""LAN discovery of a ``tabcohort serve`` over mDNS / DNS-SD (PROTOCOL.md, "Native bring-up").

The server advertises ``<instance>._tabcohort._tcp.local.`` with TXT records ``rooms`` (comma-
separated room names), ``path`` (the app's base path) and ``version``. A rank finds it either by
an mDNS browse (multicast, on the LAN) or, when it cannot hear multicast (behind NAT, another
subnet), by **unicast** DNS-SD queries sent straight to a named host's mDNS port (5353): the
queries leave from an ephemeral port, so the responder answers the sender directly (RFC 6762
section 6.7, "legacy unicast") and nothing here joins a multicast group.

``zeroconf`` is an optional dependency (the ``lan`` extra); it is imported only when discovery or
advertising is used, so the client package stays importable without it.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .errors import ConfigError, TabcohortError

SERVICE_TYPE = "_tabcohort._tcp.local."
MDNS_PORT = 5353


class DiscoveryError(TabcohortError):
    """No server answered within the bound (or none with the wanted room)."""


@dataclass
class Found:
    """One advertised server."""

    name: str
    addresses: list[str]
    port: int
    rooms: list[str] = field(default_factory=list)
    path: str = "/"
    version: str = ""
    #: every TXT record (decoded), for services other than the server's
    properties: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        a = self.addresses[0]
        host = f"[{a}]" if ":" in a else a
        path = self.path.rstrip("/")
        return f"http://{host}:{self.port}{path}"


def _zeroconf(var: str = "TABCOHORT_DISCOVER", value: Any = "1") -> Any:
    try:
        import zeroconf
    except ImportError as exc:
        raise ConfigError(var, value,
                          f"LAN discovery needs the zeroconf package (pip install 'tabcohort[lan]'): {exc}") from None
    return zeroconf


def txt_properties(rooms: Sequence[str], *, path: str = "/", version: str = "") -> dict[str, str]:
    return {"rooms": ",".join(rooms), "path": path or "/", "version": version}


def _decode(props: dict) -> dict[str, str]:
    out = {}
    for k, v in (props or {}).items():
        k = k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k)
        v = v.decode("utf-8", "replace") if isinstance(v, bytes) else ("" if v is None else str(v))
        out[k] = v
    return out


def interfaces_arg(interfaces: Sequence[str] | None) -> Any:
    """``None`` = every interface; else a list of IPv4 interface addresses (e.g. ``127.0.0.1``)."""
    zc = _zeroconf()
    return zc.InterfaceChoice.All if not interfaces else list(interfaces)


def discover(*, room: str | None = None, host: str | None = None, timeout_s: float = 5.0,
             interfaces: Sequence[str] | None = None) -> Found:
    """Find a server advertising ``room`` (any room if ``None``) within ``timeout_s``.

    Args:
        host: query this host's mDNS port by unicast instead of browsing by multicast.
        interfaces: IPv4 addresses of the interfaces to browse on (default all).

    Raises:
        DiscoveryError: nothing (suitable) answered in time; the message says what was tried.
    """
    def accept(f: Found) -> str | None:
        return None if room is None or room in f.rooms else f"rooms {f.rooms}"

    found, rejected, how = browse(SERVICE_TYPE, accept=accept, host=host, timeout_s=timeout_s,
                                  interfaces=interfaces)
    if found:
        return found[0]
    want = f" with room {room!r}" if room else ""
    extra = f"; seen but not usable: {rejected}" if rejected else ""
    raise DiscoveryError(f"no tabcohort server{want} found within {timeout_s:g} s by {how} "
                         f"(service {SERVICE_TYPE}){extra}")


def browse(service_type: str, *, accept: Callable[[Found], str | None] | None = None,
           enough: Callable[[list[Found]], bool] | None = None, host: str | None = None,
           port: int = MDNS_PORT, timeout_s: float = 5.0, interfaces: Sequence[str] | None = None,
           var: str = "TABCOHORT_DISCOVER") -> tuple[list[Found], dict[str, str], str]:
    """Collect instances of ``service_type`` until ``enough(found)`` or ``timeout_s`` (blocking).

    Each instance is resolved once (SRV, TXT, A); its TXT records are in ``Found.properties``
    (and ``rooms``/``path``/``version`` for the server's service).

    Args:
        accept: returns ``None`` to keep an instance, or why it is not usable (kept in
            ``rejected``). Default: keep every instance.
        enough: stop as soon as this is true of the kept instances (default: one kept).
        host: query this host's mDNS responder by unicast (legacy unicast DNS-SD, from an
            ephemeral port) instead of browsing by multicast.
        port: the responder's port for ``host`` (default 5353; another one behind a port mapping).
        timeout_s: the bound, seconds.
        interfaces: IPv4 addresses of the interfaces to browse on (default all).
        var: the setting named by a ConfigError when zeroconf is missing.

    Returns:
        ``(found, rejected, how)``: the kept instances in the order they resolved, the others by
        name with the reason, and a phrase saying how the search was made (for error messages).

    Raises:
        ConfigError: zeroconf is not installed (naming ``var``).
        OSError: ``host`` does not resolve.
    """
    zc_mod = _zeroconf(var)
    ipv = zc_mod.IPVersion.V4Only
    accept = accept or (lambda f: None)
    enough = enough or (lambda found: bool(found))
    addr = None
    if host is not None:
        addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        zc = zc_mod.Zeroconf(interfaces=interfaces_arg(interfaces) if interfaces else zc_mod.InterfaceChoice.Default,
                             unicast=True, ip_version=ipv)
        how = f"a unicast DNS-SD query to {host} ({addr}) port {port}"
    else:
        zc = zc_mod.Zeroconf(interfaces=interfaces_arg(interfaces), ip_version=ipv)
        how = f"an mDNS browse on {', '.join(interfaces) if interfaces else 'all interfaces'}"
    names: list[str] = []
    seen = threading.Condition()

    def on_change(zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        if state_change is not zc_mod.ServiceStateChange.Removed:
            with seen:
                if name not in names:
                    names.append(name)
                seen.notify_all()

    end = time.monotonic() + timeout_s
    found: list[Found] = []
    rejected: dict[str, str] = {}
    kw: dict[str, Any] = {} if addr is None else {"addr": addr, "port": port}
    browser = zc_mod.ServiceBrowser(zc, service_type, handlers=[on_change], **kw)
    # Unicast: zeroconf's browser asks at ~0.1 s, 1.1 s and 5.1 s (its startup schedule), so
    # within a 5 s bound a responder that missed or answered late the first two queries (a
    # loaded host) was never asked again. Ask again ourselves with backoff (0.25 s doubling,
    # at most 1 s apart) until the bound; answers land in the cache the browser watches.
    retry_at, retry_gap = time.monotonic() + 0.25, 0.25
    try:
        done = 0
        while not (found and enough(found)):
            with seen:
                while done >= len(names):
                    now = time.monotonic()
                    left = end - now
                    if left <= 0:
                        break
                    if addr is not None and now >= retry_at:
                        _unicast_ptr_query(zc_mod, zc, service_type, addr, port)
                        retry_gap = min(2 * retry_gap, 1.0)
                        retry_at = now + retry_gap
                    seen.wait(min(left, 0.25, max(0.01, retry_at - now) if addr is not None else 0.25))
                todo = names[done:]
            if not todo and time.monotonic() >= end:
                break
            for name in todo:
                done += 1
                info = zc_mod.ServiceInfo(service_type, name)
                left_ms = max(200, int((end - time.monotonic()) * 1000))
                if not info.request(zc, left_ms, **kw):
                    rejected[name] = "did not resolve"
                    continue
                props = _decode(info.properties)
                rooms = [r for r in props.get("rooms", "").split(",") if r]
                addrs = info.parsed_addresses(ipv)
                if not addrs or not info.port:
                    rejected[name] = "no IPv4 address or port"
                    continue
                if addr is not None and addr in addrs:  # the host we asked is the one to reach
                    addrs = [addr] + [a for a in addrs if a != addr]
                f = Found(name=name, addresses=addrs, port=int(info.port), rooms=rooms,
                          path=props.get("path", "/") or "/", version=props.get("version", ""), properties=props)
                why = accept(f)
                if why is not None:
                    rejected[name] = why
                    continue
                if len(addrs) > 1:  # a multi-homed host: the first address that accepts a connection
                    f.addresses = _reachable_first(addrs, f.port, min(1.0, max(0.2, end - time.monotonic())))
                found.append(f)
                rejected.pop(name, None)
                if enough(found):
                    break
    finally:
        browser.cancel()
        zc.close()
    return found, rejected, how


def _unicast_ptr_query(zc_mod: Any, zc: Any, service_type: str, addr: str, port: int) -> None:
    """Send one legacy unicast PTR query for ``service_type`` to ``addr:port`` (RFC 6762
    section 6.7: from our ephemeral port, so the responder answers us directly)."""
    from zeroconf.const import _CLASS_IN, _FLAGS_QR_QUERY, _TYPE_PTR
    out = zc_mod.DNSOutgoing(_FLAGS_QR_QUERY, multicast=False)
    q = zc_mod.DNSQuestion(service_type, _TYPE_PTR, _CLASS_IN)
    q.unicast = True  # QU: a responder never drops it as a duplicate of a recent query
    out.add_question(q)
    zc.send(out, addr, port)


def _reachable_first(addrs: list[str], port: int, timeout_s: float) -> list[str]:
    for a in addrs:
        try:
            with socket.create_connection((a, port), timeout=timeout_s / len(addrs)):
                return [a] + [b for b in addrs if b != a]
        except OSError:
            continue
    return addrs


class Advertiser:
    """Register a service on start, unregister on stop (asyncio API).

    By default the server's ``_tabcohort._tcp`` service with its ``rooms``/``path``/``version``
    TXT records; ``service_type`` and ``properties`` advertise another service (the process
    group's ranks). With ``allow_name_change=False`` a name that another live responder already
    answers for raises zeroconf's ``NonUniqueNameException`` from :meth:`start`.
    """

    def __init__(self, *, port: int, rooms: Sequence[str] = (), addresses: Sequence[str], path: str = "/",
                 version: str = "", interfaces: Sequence[str] | None = None, instance: str | None = None,
                 service_type: str = SERVICE_TYPE, properties: dict[str, str] | None = None,
                 allow_name_change: bool = True) -> None:
        self.port, self.rooms, self.addresses = port, list(rooms), list(addresses)
        self.path, self.version, self.interfaces = path, version, interfaces
        self.service_type, self.properties, self.allow_name_change = service_type, properties, allow_name_change
        host = socket.gethostname().split(".")[0] or "tabcohort"
        self.instance = instance or f"tabcohort-{host}-{port}"
        self.hostname = f"{host}.local."
        self._azc: Any = None
        self.info: Any = None

    async def start(self) -> None:
        zc_mod = _zeroconf()
        from zeroconf.asyncio import AsyncZeroconf
        self._azc = AsyncZeroconf(interfaces=interfaces_arg(self.interfaces), ip_version=zc_mod.IPVersion.V4Only)
        props = self.properties if self.properties is not None else \
            txt_properties(self.rooms, path=self.path, version=self.version)
        self.info = zc_mod.ServiceInfo(
            self.service_type, f"{self.instance}.{self.service_type}", port=self.port, server=self.hostname,
            addresses=[socket.inet_aton(a) for a in self.addresses], properties=props)
        # allow_name_change: two servers on one host/port-less instance name do not collide
        try:
            # returns once probing is done and the records are registered: queries are answered
            # from then on (the announcements go out in the background)
            await self._azc.async_register_service(self.info, allow_name_change=self.allow_name_change)
        except BaseException:
            await self._azc.async_close()
            self._azc = None
            raise

    async def stop(self) -> None:
        if self._azc is None:
            return
        try:
            if self.info is not None:
                await self._azc.async_unregister_service(self.info)
        finally:
            await self._azc.async_close()
            self._azc = None


def local_ipv4_addresses(bind_host: str) -> list[str]:
    """The addresses to advertise for a server listening on ``bind_host``."""
    import ipaddress
    try:
        ip = ipaddress.ip_address(bind_host)
    except ValueError:
        ip = None
    if ip is not None and ip.version == 4 and not ip.is_unspecified:
        return [str(ip)]
    if ip is None and bind_host not in ("", "localhost"):
        return sorted({i[4][0] for i in socket.getaddrinfo(bind_host, None, socket.AF_INET)})
    if bind_host == "localhost":
        return ["127.0.0.1"]
    try:
        import ifaddr  # a zeroconf dependency
        out = [a.ip for ad in ifaddr.get_adapters() for a in ad.ips
               if isinstance(a.ip, str) and not a.ip.startswith("127.")]
        return out or ["127.0.0.1"]
    except ImportError:  # pragma: no cover
        return ["127.0.0.1"]
