"""Process-group configuration: from arguments or the environment, validated before any
network activity (STYLE.md, "Names, docs, errors"; PROTOCOL.md, "Native bring-up").

Variables (an argument of :func:`tabcohort.pg.init_process_group` wins over the variable):

========================  =======================  ===========================================
variable                  argument                 meaning
========================  =======================  ===========================================
``RANK``                  ``rank``                 this process's rank, integer in [0, WORLD)
``WORLD``                 ``world``                number of ranks (``WORLD_SIZE`` also read)
``PEERS``                 ``peers``                ``host:port,...`` in rank order (mesh: one
                                                   per rank; star: the hub's, or one per rank)
``TOPOLOGY``              ``topology``             ``mesh`` (default) or ``star`` (rank 0 hub)
``DISCOVERY``             ``discovery``            ``static`` (default); ``mdns`` is reserved
                                                   (rejected: not implemented yet)
``PG_TIMEOUT_S``          ``timeout_s``            collective timeout, seconds (default 10)
``PG_CONNECT_TIMEOUT_S``  ``connect_timeout_s``    bring-up bound, seconds (default 60)
``MAX_MEMORY_BYTES``      ``max_memory_bytes``     per-rank bound on buffered bytes (default
                                                   none)
``PG_LISTEN_HOST``        ``listen_host``          address to bind (default: from PEERS[rank])
========================  =======================  ===========================================
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ConfigError

TOPOLOGIES = ("mesh", "star")
DISCOVERIES = ("static", "mdns")


@dataclass(frozen=True)
class PGConfig:
    """A validated process-group configuration.

    Attributes:
        rank: this rank, in [0, world).
        world: number of ranks, >= 1.
        peers: (host, port) per rank in rank order; in star only ``peers[0]`` (the hub) is
            dialled. Empty with mDNS discovery until resolved.
        topology: ``mesh`` or ``star``.
        discovery: ``static`` or ``mdns``.
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

    @property
    def listens(self) -> bool:
        """Whether this rank accepts inbound links (every mesh rank; the star hub)."""
        return self.world > 1 and (self.topology == "mesh" or self.rank == 0)


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
            ``"h:p"`` / ``(host, port)``), ``topology``, ``discovery``, ``timeout_s``,
            ``connect_timeout_s``, ``max_memory_bytes``, ``listen_host``; ``None`` = unset.

    Raises:
        ConfigError: naming the argument or variable and its value (non-integer rank, rank >=
            world, unknown topology, mesh whose peer list length differs from the world size, a
            peer that resolves to no address, ...).
    """
    env = os.environ if env is None else env
    known = {"rank", "world", "peers", "topology", "discovery", "timeout_s", "connect_timeout_s",
             "max_memory_bytes", "listen_host"}
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
    var, v = _pick(args, env, "discovery", "DISCOVERY")
    discovery = "static" if v is None else str(v).strip().lower()
    if discovery not in DISCOVERIES:
        raise ConfigError(var, v, f"unknown discovery; expected one of {DISCOVERIES}")
    if discovery == "mdns":
        raise ConfigError(var, v, "mDNS discovery is not implemented yet; give PEERS=host:port,...")

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
    if discovery == "static" and world > 1:
        if not peers:
            raise ConfigError(pvar, pv, "not set: a static group of more than one rank needs PEERS=host:port,...")
        if topology == "mesh" and len(peers) != world:
            raise ConfigError(pvar, pv, f"mesh needs one peer per rank: {len(peers)} given, world size {world}")
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
    listen_port = me[1]
    return PGConfig(rank=rank, world=world, peers=tuple(peers), topology=topology, discovery=discovery,
                    timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                    max_memory_bytes=max_memory_bytes, listen_host=listen_host, listen_port=listen_port)
