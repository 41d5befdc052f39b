"""Process-group configuration: from arguments or the environment, validated before any
network activity (STYLE.md, "Names, docs, errors"; PROTOCOL.md, "Native bring-up").

Variables (an argument of :func:`tabcohort.pg.init_process_group` wins over the variable):

===========================  ========================  ========================================
variable                     argument                  meaning
===========================  ========================  ========================================
``RANK``                     ``rank``                  this process's rank, integer in [0, WORLD)
``WORLD``                    ``world``                 number of ranks (``WORLD_SIZE`` also read)
``PEERS``                    ``peers``                 ``host:port,...`` in rank order (mesh: one
                                                       per rank; star: the hub's, or one per rank)
``TOPOLOGY``                 ``topology``              ``mesh`` (default) or ``star`` (rank 0 hub)
``DISCOVERY``                ``discovery``             ``static`` (default: PEERS), ``mdns`` or
                                                       ``unicast:HOST[:PORT]`` (see below)
``PG_GROUP``                 ``group``                 group name, 1..40 of [A-Za-z0-9_-]; needed
                                                       with discovery (two groups on a LAN, or
                                                       in one room, never mix)
``PG_DISCOVERY_INTERFACES``  ``discovery_interfaces``  IPv4 addresses of the interfaces mDNS uses
                                                       (default all), e.g. ``127.0.0.1``
``PG_SERVER``                ``server``                ``http(s)://host:port`` of a ``tabcohort
                                                       serve``: links become WebRTC data channels
``PG_ROOM``                  ``room``                  the server room (needed with PG_SERVER)
``PG_TOKEN``                 ``token``                 the room token, if the room has one
``PG_RTC_HOSTS``             ``rtc_host_addresses``    ICE host candidate IPs (e.g. ``127.0.0.1``
                                                       on a loopback-only host; default: aioice's)
``PG_ICE_SERVERS``           ``ice_servers``           STUN/TURN URLs (default none)
``PG_TIMEOUT_S``             ``timeout_s``             collective timeout, seconds (default 10)
``PG_CONNECT_TIMEOUT_S``     ``connect_timeout_s``     bring-up bound (discovery, links), seconds
                                                       (default 60)
``MAX_MEMORY_BYTES``         ``max_memory_bytes``      per-rank bound on buffered bytes (default
                                                       none)
``PG_LISTEN_HOST``           ``listen_host``           address to bind (default: from PEERS[rank];
                                                       with discovery 0.0.0.0, every IPv4 interface)
``PG_LISTEN_PORT``           ``listen_port``           port to bind with discovery (default 0:
                                                       any free port, which is advertised)
===========================  ========================  ========================================

Links: exactly one source of peers. ``PEERS`` (static TCP), ``DISCOVERY=mdns`` (TCP; every rank
that listens advertises ``<PG_GROUP>-r<RANK>._tabcohort-pg._tcp.local.``), ``DISCOVERY=unicast:
HOST`` (TCP; star only: a worker behind NAT asks the hub's host's mDNS responder by unicast and
dials out, needing no inbound port), or ``PG_SERVER`` + ``PG_ROOM`` (WebRTC data channels,
signalled through the server). Giving two of them is a ConfigError.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import math
import os
import socket
import urllib.parse
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ConfigError

TOPOLOGIES = ("mesh", "star")
DISCOVERIES = ("static", "mdns", "unicast")
MDNS_PORT = 5353
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclass(frozen=True)
class PGConfig:
    """A validated process-group configuration.

    Attributes:
        rank: this rank, in [0, world).
        world: number of ranks, >= 1.
        peers: (host, port) per rank in rank order; in star only ``peers[0]`` (the hub) is
            dialled. Empty with discovery or a server (found at bring-up).
        topology: ``mesh`` or ``star``.
        discovery: ``static``, ``mdns`` or ``unicast``.
        discovery_host, discovery_port: the responder a ``unicast`` query goes to.
        discovery_interfaces: IPv4 addresses mDNS uses (empty = every interface).
        group: the group name (``""`` = none; needed with discovery).
        server, room, token: the tabcohort server whose room signals WebRTC links (``""`` =
            no server: TCP links).
        rtc_host_addresses: ICE host candidate addresses (``None`` = aioice's own list).
        ice_servers: STUN/TURN URLs.
        timeout_s: bound on one collective, seconds.
        connect_timeout_s: bound on bring-up, seconds.
        max_memory_bytes: bound on bytes a collective may buffer on this rank, or ``None``.
        listen_host: address the listener binds (mesh: every rank; star: rank 0 only).
        listen_port: port the listener binds.
    """

    rank: int
    world: int
    peers: tuple[tuple[str, int], ...]
    topology: str = "mesh"
    discovery: str = "static"
    timeout_s: float = 10.0
    connect_timeout_s: float = 60.0
    max_memory_bytes: int | None = None
    listen_host: str = ""
    listen_port: int = 0
    discovery_host: str = ""
    discovery_port: int = MDNS_PORT
    discovery_interfaces: tuple[str, ...] = ()
    group: str = ""
    server: str = ""
    room: str = ""
    token: str | None = None
    rtc_host_addresses: tuple[str, ...] | None = None
    ice_servers: tuple[str, ...] = ()

    @property
    def listens(self) -> bool:
        """Whether this rank accepts inbound TCP links (every mesh rank; the star hub)."""
        return self.world > 1 and not self.server and (self.topology == "mesh" or self.rank == 0)

    @property
    def transport(self) -> str:
        """``"rtc"`` (a server is given) or ``"tcp"``."""
        return "rtc" if self.server else "tcp"


def _pick(args: dict, env: Mapping[str, str], arg: str, *names: str) -> tuple[str, Any]:
    if args.get(arg) is not None:
        return arg, args[arg]
    for n in names:
        if env.get(n, "") != "":
            return n, env[n]
    return names[0], None


def _int(var: str, v: Any, *, lo: int) -> int:
    if isinstance(v, bool):
        raise ConfigError(var, v, "must be an integer")
    if isinstance(v, int):
        out = v
    else:
        try:
            out = int(str(v).strip(), 10)
        except ValueError:
            raise ConfigError(var, v, "must be an integer") from None
    if out < lo:
        raise ConfigError(var, v, f"must be an integer >= {lo}")
    return out


def _seconds(var: str, v: Any) -> float:
    try:
        out = float(v)
    except (TypeError, ValueError):
        raise ConfigError(var, v, "must be a number of seconds") from None
    if not math.isfinite(out) or out <= 0:
        raise ConfigError(var, v, "must be a finite number of seconds > 0")
    return out


def parse_peer(var: str, whole: Any, item: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); raises ConfigError naming ``var``."""
    s = item.strip()
    if s.startswith("["):
        host, sep, rest = s[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ConfigError(var, whole, f"peer {item!r} is not [ipv6]:port")
        port_s = rest[1:]
    else:
        host, sep, port_s = s.rpartition(":")
        if not sep or not host:
            raise ConfigError(var, whole, f"peer {item!r} is not host:port")
    try:
        port = int(port_s, 10)
    except ValueError:
        raise ConfigError(var, whole, f"peer {item!r}: port {port_s!r} is not an integer") from None
    if not 1 <= port <= 65535:
        raise ConfigError(var, whole, f"peer {item!r}: port {port} not in [1, 65535]")
    return host, port


def load_config(*, env: Mapping[str, str] | None = None, resolve: bool = True, **args: Any) -> PGConfig:
    """Build and validate a :class:`PGConfig` from keyword arguments and the environment.

    Nothing here opens a socket; with ``resolve`` each static peer host is checked with
    ``getaddrinfo`` (a name lookup, the only outside call).

    Args:
        env: the environment (default ``os.environ``).
        resolve: check that every peer host resolves to an address.
        **args: ``rank``, ``world``, ``peers`` (str ``"h:p,h:p"`` or a sequence of
            ``"h:p"`` / ``(host, port)``), ``topology``, ``discovery``, ``group``,
            ``discovery_interfaces``, ``server``, ``room``, ``token``, ``rtc_host_addresses``,
            ``ice_servers``, ``timeout_s``, ``connect_timeout_s``, ``max_memory_bytes``,
            ``listen_host``, ``listen_port`` (see the module table); ``None`` = unset.

    Raises:
        ConfigError: naming the argument or variable and its value (non-integer rank, rank >=
            world, unknown topology, mesh whose peer list length differs from the world size, a
            peer that resolves to no address, discovery without a group name, unicast discovery
            in a mesh, a server URL without a room, two sources of peers, ...).
    """
    env = os.environ if env is None else env
    known = {"rank", "world", "peers", "topology", "discovery", "timeout_s", "connect_timeout_s",
             "max_memory_bytes", "listen_host", "listen_port", "group", "discovery_interfaces", "server", "room",
             "token", "rtc_host_addresses", "ice_servers"}
    for k in args:
        if k not in known:
            raise ConfigError(k, args[k], f"unknown process-group option (known: {sorted(known)})")

    var, v = _pick(args, env, "world", "WORLD", "WORLD_SIZE")
    if v is None:
        raise ConfigError("WORLD", None, "not set: pass world= or set WORLD")
    world = _int(var, v, lo=1)
    if world > 65535:
        raise ConfigError(var, v, "must be <= 65535")
    var, v = _pick(args, env, "rank", "RANK")
    if v is None:
        raise ConfigError("RANK", None, "not set: pass rank= or set RANK")
    rank = _int(var, v, lo=0)
    if rank >= world:
        raise ConfigError(var, v, f"must be < world size {world}")

    var, v = _pick(args, env, "topology", "TOPOLOGY")
    topology = "mesh" if v is None else str(v).strip().lower()
    if topology not in TOPOLOGIES:
        raise ConfigError(var, v, f"unknown topology; expected one of {TOPOLOGIES}")
    dvar, dv = _pick(args, env, "discovery", "DISCOVERY")
    discovery, dhost, dport = _discovery(dvar, dv, topology, resolve=resolve)
    var, v = _pick(args, env, "group", "PG_GROUP")
    group = "" if v is None else str(v)
    if v is not None and not (1 <= len(group) <= 40 and set(group) <= _NAME_CHARS):
        raise ConfigError(var, v, "a group name is 1..40 characters of [A-Za-z0-9_-]")
    if discovery != "static" and not group:
        raise ConfigError("PG_GROUP", None, f"not set: discovery ({dvar}={dv!r}) needs a group name, so two "
                                            "groups on one LAN never mix (pass group= or set PG_GROUP)")
    var, v = _pick(args, env, "discovery_interfaces", "PG_DISCOVERY_INTERFACES")
    interfaces = _ip_list(var, v, v4_only=True)
    if interfaces and discovery == "static":
        raise ConfigError(var, v, "only used with DISCOVERY=mdns or unicast:HOST")
    server, room, token, rtc_hosts, ice = _server_settings(args, env, resolve=resolve)
    if server and discovery != "static":
        raise ConfigError(dvar, dv, "give either a server (PG_SERVER: WebRTC links) or discovery (TCP links), "
                                    "not both")
    if discovery != "static" and importlib.util.find_spec("zeroconf") is None:
        raise ConfigError(dvar, dv, "discovery needs the zeroconf package (pip install 'tabcohort[lan]')")

    var, v = _pick(args, env, "timeout_s", "PG_TIMEOUT_S")
    timeout_s = 10.0 if v is None else _seconds(var, v)
    var, v = _pick(args, env, "connect_timeout_s", "PG_CONNECT_TIMEOUT_S")
    connect_timeout_s = 60.0 if v is None else _seconds(var, v)
    var, v = _pick(args, env, "max_memory_bytes", "MAX_MEMORY_BYTES")
    max_memory_bytes = None if v is None else _int(var, v, lo=1)

    pvar, pv = _pick(args, env, "peers", "PEERS")
    peers: list[tuple[str, int]] = []
    if pv is not None:
        items = [p for p in pv.split(",") if p.strip()] if isinstance(pv, str) else list(pv)
        for item in items:
            if isinstance(item, tuple):
                h, p = item
                peers.append(parse_peer(pvar, pv, f"{h}:{p}" if ":" not in str(h) else f"[{h}]:{p}"))
            else:
                peers.append(parse_peer(pvar, pv, str(item)))
    if peers and (discovery != "static" or server):
        raise ConfigError(pvar, pv, f"give either PEERS or {'PG_SERVER' if server else dvar + '=' + repr(dv)}, "
                                    "not both")
    if discovery == "static" and not server and world > 1:
        if not peers:
            raise ConfigError(pvar, pv, "not set: a static group of more than one rank needs PEERS=host:port,...")
        if topology == "mesh" and len(peers) != world:
            raise ConfigError(pvar, pv, f"mesh needs one peer per rank: {len(peers)} given, world size {world}")
        if topology == "mesh" and len(set(peers)) != len(peers):
            # (each mesh rank listens at its own entry: a repeated one left a rank waiting for
            # PG_CONNECT_TIMEOUT_S, then "rank(s) [1] did not connect")
            dup = next(p for i, p in enumerate(peers) if p in peers[:i])
            raise ConfigError(pvar, pv, f"{dup[0]}:{dup[1]} is given twice: every mesh rank listens at an address "
                                        "and port of its own")
        if topology == "star" and len(peers) not in (1, world):
            raise ConfigError(pvar, pv, f"star needs the hub's address or one per rank: {len(peers)} given, "
                                        f"world size {world}")
    if resolve:
        for i, (h, p) in enumerate(peers):
            try:
                socket.getaddrinfo(h, p, type=socket.SOCK_STREAM)
            except (socket.gaierror, UnicodeError) as e:
                raise ConfigError(pvar, pv, f"peer {i} host {h!r} resolves to no address ({e})") from None

    var, v = _pick(args, env, "listen_host", "PG_LISTEN_HOST")
    me = peers[rank] if topology == "mesh" and len(peers) == world else (peers[0] if peers else ("", 0))
    listen_host = str(v) if v is not None else me[0]
    if v is None and discovery != "static":
        # every IPv4 interface: discovery advertises IPv4 addresses, and an unspecified host
        # would bind IPv4 and IPv6 on two different free ports
        listen_host = "0.0.0.0"
    if v is not None and discovery != "static" and listen_host:
        try:
            if ipaddress.ip_address(listen_host).version != 4:
                raise ValueError
        except ValueError:
            raise ConfigError(var, v, "with discovery, an IPv4 address literal (it is advertised)") from None
    var, v = _pick(args, env, "listen_port", "PG_LISTEN_PORT")
    listen_port = me[1]
    if v is not None:
        if discovery == "static":
            raise ConfigError(var, v, "only used with discovery (with PEERS the port is PEERS[RANK]'s)")
        listen_port = _int(var, v, lo=0)
        if listen_port > 65535:
            raise ConfigError(var, v, "must be a port in [0, 65535]")
    return PGConfig(rank=rank, world=world, peers=tuple(peers), topology=topology, discovery=discovery,
                    timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                    max_memory_bytes=max_memory_bytes, listen_host=listen_host, listen_port=listen_port,
                    discovery_host=dhost, discovery_port=dport, discovery_interfaces=interfaces, group=group,
                    server=server, room=room, token=token, rtc_host_addresses=rtc_hosts, ice_servers=ice)


def _discovery(var: str, v: Any, topology: str, *, resolve: bool) -> tuple[str, str, int]:
    """``DISCOVERY`` -> (kind, unicast host, unicast port)."""
    if v is None:
        return "static", "", MDNS_PORT
    s = str(v).strip()
    kind, sep, rest = s.partition(":")
    kind = kind.lower()
    if kind not in DISCOVERIES or (kind != "unicast" and sep):
        raise ConfigError(var, v, "expected static, mdns or unicast:HOST[:PORT]")
    if kind != "unicast":
        return kind, "", MDNS_PORT
    if not rest.strip():
        raise ConfigError(var, v, "unicast needs the responder's host: unicast:HOST[:PORT]")
    if topology != "star":
        raise ConfigError(var, v, "unicast discovery reaches one host's responder, so it finds the hub only: "
                                  "use it with TOPOLOGY=star (workers dial the hub and need no inbound port), "
                                  "or DISCOVERY=mdns for a mesh")
    host, port = parse_peer(var, v, rest) if rest.count(":") == 1 or rest.startswith("[") else (rest, MDNS_PORT)
    if ":" in host:
        raise ConfigError(var, v, "unicast discovery is IPv4 only")
    if resolve:
        try:
            socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
        except (socket.gaierror, UnicodeError) as e:
            raise ConfigError(var, v, f"host {host!r} resolves to no IPv4 address ({e})") from None
    return "unicast", host.strip(), port


def _ip_list(var: str, v: Any, *, v4_only: bool = False) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [x.strip() for x in v.split(",")] if isinstance(v, str) else [str(x).strip() for x in v]
    items = [x for x in items if x]
    for a in items:
        try:
            ip = ipaddress.ip_address(a)
        except ValueError:
            raise ConfigError(var, v, f"{a!r} is not an IP address literal") from None
        if v4_only and ip.version != 4:
            raise ConfigError(var, v, f"{a!r}: IPv4 addresses only")
    return tuple(items)


def _server_settings(args: dict, env: Mapping[str, str], *, resolve: bool) -> tuple:
    """(server, room, token, rtc host addresses, ice servers), validated."""
    svar, sv = _pick(args, env, "server", "PG_SERVER")
    rvar, rv = _pick(args, env, "room", "PG_ROOM")
    tvar, tv = _pick(args, env, "token", "PG_TOKEN")
    hvar, hv = _pick(args, env, "rtc_host_addresses", "PG_RTC_HOSTS")
    ivar, iv = _pick(args, env, "ice_servers", "PG_ICE_SERVERS")
    if sv is None:
        for var, v in ((rvar, rv), (tvar, tv), (hvar, hv), (ivar, iv)):
            if v is not None:
                raise ConfigError(var, v, "only used with a server (PG_SERVER=http://host:port)")
        return "", "", None, None, ()
    server = str(sv).strip()
    u = urllib.parse.urlsplit(server)
    if u.scheme not in ("http", "https", "ws", "wss") or not u.hostname:
        raise ConfigError(svar, sv, "expected http://host:port (or https://, ws://, wss://)")
    try:
        port = u.port
    except ValueError:
        raise ConfigError(svar, sv, "the port must be a number in 1..65535") from None
    if rv is None:
        raise ConfigError("PG_ROOM", None, "not set: a server needs the room to signal in (pass room= or set "
                                           "PG_ROOM)")
    room = str(rv)
    if not (1 <= len(room) <= 64 and all(c.isalnum() or c in "-_." for c in room)):
        raise ConfigError(rvar, rv, "a room name is 1..64 characters of [A-Za-z0-9._-]")
    hosts = _ip_list(hvar, hv) if hv is not None else None
    from ..bus.rtc_util import parse_ice_servers
    try:
        ice = tuple(parse_ice_servers(iv))
    except ConfigError as e:
        raise ConfigError(ivar, iv, str(e)) from None
    if importlib.util.find_spec("aiortc") is None:
        raise ConfigError(svar, sv, "WebRTC links need aiortc (pip install 'tabcohort[rtc]')")
    if resolve:
        try:
            socket.getaddrinfo(u.hostname, port or 80, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise ConfigError(svar, sv, f"host {u.hostname!r} resolves to no address ({e})") from None
    return server, room, (None if tv is None else str(tv)), hosts, ice
