"""The bus contract (PROTOCOL.md, "Bus contract"; INTERFACES.md, "Bus").

Every transport (in-memory, WebSocket relay, aiortc, browser) implements :class:`Bus` and
passes the shared conformance battery in ``tests/conformance``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol


class LinkBytes(NamedTuple):
    """Encoded bytes on one link, chunk headers and chunking included.

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
        """Encoded bytes per peer id (a broadcast to n-1 peers counts on n-1 links)."""

    def total_bytes(self) -> int:
        """Sum of sent and received bytes over all links."""

    def pressure(self) -> float:
        """Queued (not yet on the wire) bytes over the high-water mark, max over links."""

    def quantize(self, params: Any) -> Any:
        """``params`` exactly as a receiver decodes them, or ``None`` at f32."""

    def close(self) -> None:
        """Stop delivery both ways; idempotent."""

    def drops(self) -> dict[str, int]:
        """Wire-level drops by reason (reader drops plus transport-level ones)."""


def sum_link_bytes(links: dict[int, LinkBytes]) -> int:
    """Total of sent + received over a :meth:`Bus.bytes` result."""
    return sum(lb.sent + lb.received for lb in links.values())
