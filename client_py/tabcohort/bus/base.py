"""The bus contract (PROTOCOL.md, "Bus contract"; INTERFACES.md, "Bus").

Every transport (in-memory, the server's room over a WebSocket or a data channel, a WebRTC
mesh, TCP) implements :class:`Bus` and passes the shared conformance battery in
``tests/conformance``. :class:`RoomBus` is what the rank runtimes use on top of it when the
bus belongs to a server room (docs/INTERFACES.md, "Bus").
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, NamedTuple, Protocol


class LinkBytes(NamedTuple):
    """Encoded bytes exchanged with one peer, chunk headers and chunking included.

    Attributes:
        sent: bytes this bus put on the wire to the peer.
        received: bytes this bus took off the wire from the peer.
    """

    sent: int
    received: int


class Bus(Protocol):
    """What the runtime driver and the rank machine need from a transport."""

    id: int
    #: Set by the owner; called once per decoded message addressed to this rank.
    on_message: Callable[[dict], None] | None

    def post(self, msg: dict) -> None:
        """Send ``msg`` to every other rank, or only to ``msg["to"]`` when set.

        Raises:
            LocalProtocolError: the message cannot be encoded.
        """

    def bytes(self) -> dict[int, LinkBytes]:
        """Encoded bytes per peer id (a broadcast to n-1 peers counts on n-1 peers)."""

    def total_bytes(self) -> int:
        """Sum of sent and received bytes over all peers."""

    def pressure(self) -> float:
        """Queued (not yet on the wire) bytes over the high-water mark, max over paths."""

    def quantize(self, params: Any) -> Any:
        """``params`` exactly as a receiver decodes them, or ``None`` at f32."""

    def close(self) -> None:
        """Stop delivery both ways; idempotent."""

    def drops(self) -> dict[str, int]:
        """Wire-level drops by reason (reader drops plus transport-level ones)."""


class RoomBus(Bus, Protocol):
    """A bus in a server room (star or mesh): everything the rank runtimes use on it.

    A *path* is how this rank's chunks reach one peer: in a star the one peer is the server
    (id 0) and its path is ``ws`` or ``rtc``; in a mesh each peer's path is ``connecting``,
    ``rtc`` (a data channel of its own) or ``relay`` (through the server).
    """

    #: ``ws-star``, ``rtc-star`` or ``rtc-mesh`` (what the tab shows and reports).
    transport: str
    #: the room secret that resumes this id, from ``welcome`` (``None`` before).
    secret: str | None
    #: ``True`` while the socket to the server is up.
    connected: bool
    #: why the bus gave up for good (``None`` while it is alive).
    failed: str | None
    #: the server's ``stop`` reason, once one arrived.
    stopped_reason: str | None
    #: reconnects that resumed this id.
    n_reconnects: int
    #: raw socket and channel bytes, controls included, each way.
    uplink_bytes: int
    downlink_bytes: int
    #: the role the server bound to this link, and each peer's (id -> may lead), from
    #: ``welcome`` and ``peer`` (docs/PROTOCOL.md, "Roles").
    may_lead: bool
    lead_roles: dict[int, bool]
    #: ``http(s)://host:port`` of the node the bus is linked to (a cluster moves it: 4012).
    server_base: str
    #: cluster redirects followed (4012; docs/INTERFACES.md, "Close codes").
    n_moves: int

    async def connect(self, timeout_s: float = 10.0) -> "RoomBus":
        """Register with the server and learn ``id`` (then bring up the paths).

        Raises:
            LinkFailed: the server refused the registration or did not answer.
        """

    async def aclose(self) -> None:
        """:meth:`close`, then wait for the sockets and peer connections to be gone."""

    def send_control(self, obj: dict) -> None:
        """Queue a JSON control (e.g. ``report``) to the server; dropped while disconnected."""

    def queued_bytes(self) -> int:
        """Bytes handed to this bus and not yet on the wire."""

    def paths(self) -> dict[int, str]:
        """Each peer's path (0 = the server in a star): ``ws`` | ``rtc`` | ``relay`` | ``connecting``."""

    def transport_bytes(self) -> dict[str, int]:
        """Chunk bytes (sent + received) by path kind: ``rtc`` and ``ws`` (star) or ``relay`` (mesh)."""

    def pair_bytes(self) -> dict[int, dict[str, int]] | None:
        """Per peer, chunk bytes (sent + received) by path kind, e.g. ``{"tcp": n, "relay": 0}``
        (a mesh); ``None`` on a star, whose one path is the server's."""

    def supervise_ticks(self) -> dict[str, int] | None:
        """A mesh's path-supervision ticks and those late (its loop blocked for > 1 s), as
        ``{"ticks": n, "late": n}``; ``None`` on a star, which supervises no paths."""

    def set_silence_bound_ms(self, bound_ms: float) -> None:
        """A direct path with no bytes from its peer for ``bound_ms`` milliseconds moves to the
        relay (a mesh; a star has no paths of its own and ignores it). The session sets the
        machine's ``policy.drop_ms`` (docs/PROTOCOL.md "Direct TCP path", "Silence").

        Raises:
            ValueError: ``bound_ms`` is not a positive finite number.
        """

    def set_precision(self, precision: str) -> None:
        """Send at ``precision`` from now on.

        Raises:
            ConfigError: an unknown precision.
        """


class ByteCounts:
    """Per-peer chunk byte counters (what :meth:`Bus.bytes` returns), shared by the buses."""

    __slots__ = ("sent", "received")

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}

    def add_sent(self, peers: Iterable[int], size: int) -> None:
        for p in peers:
            self.sent[p] = self.sent.get(p, 0) + size

    def add_received(self, peer: int, size: int) -> None:
        self.received[peer] = self.received.get(peer, 0) + size

    def links(self) -> dict[int, LinkBytes]:
        peers = set(self.sent) | set(self.received)
        return {p: LinkBytes(self.sent.get(p, 0), self.received.get(p, 0)) for p in sorted(peers)}

    def total(self) -> int:
        return sum(self.sent.values()) + sum(self.received.values())


def delegated(owner: str, name: str) -> property:
    """A read-only attribute that is ``self.<owner>.<name>`` (a bus composed of parts)."""
    return property(lambda self: getattr(getattr(self, owner), name), doc=f"``{owner}.{name}``")


def merge_counts(*sources: dict[str, int]) -> dict[str, int]:
    """The sum of drop-count dicts (reason -> count)."""
    out: dict[str, int] = {}
    for src in sources:
        for k, v in src.items():
            out[k] = out.get(k, 0) + v
    return out


def sum_link_bytes(links: dict[int, LinkBytes]) -> int:
    """Total of sent + received over a :meth:`Bus.bytes` result."""
    return sum(lb.sent + lb.received for lb in links.values())


def check_bound_ms(bound_ms: float) -> float:
    """``bound_ms`` as a float, or ValueError naming it (``RoomBus.set_silence_bound_ms``)."""
    if isinstance(bound_ms, bool) or not isinstance(bound_ms, (int, float)) or not math.isfinite(bound_ms) \
            or bound_ms <= 0:
        raise ValueError(f"silence bound must be a positive number of milliseconds, got {bound_ms!r}")
    return float(bound_ms)
