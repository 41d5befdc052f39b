"""aiortc helpers shared by the mesh bus, the WebRTC star link and the server's terminator.

aiortc is imported inside the functions, so importing this module never needs it.

- :func:`set_host_addresses`: aioice never offers 127.0.0.1 as a host candidate; a loopback-only
  host (CI, a private network namespace) needs the host address list set explicitly. This is a
  process-wide override of ``aioice.ice.get_host_addresses`` (aioice looks that function up at
  every gather), off by default (``None`` = aioice's own list).
- :func:`configuration`: ``RTCConfiguration`` with the given ICE servers and *no* default STUN
  server (aiortc adds a public one when ``iceServers`` is left unset).
- :func:`negotiated_max_message_bytes`: the chunk limit of a connected peer connection.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import ConfigError
from ..wire import DATA_CHANNEL_MAX_MESSAGE_BYTES, negotiate_max_message_bytes

_host_override: list[str] | None = None
_patched = False

#: The data channel label every tabcohort link uses.
CHANNEL_LABEL = "tabcohort"


def set_host_addresses(addresses: Sequence[str] | None) -> None:
    """Use exactly ``addresses`` as ICE host candidates in this process (``None`` = aioice's list).

    Raises:
        ConfigError: an address that is not an IP literal.
    """
    global _host_override, _patched
    import ipaddress

    if addresses is not None:
        addresses = list(addresses)
        for a in addresses:
            try:
                ipaddress.ip_address(a)
            except ValueError:
                raise ConfigError("rtc host address", a, "must be an IP address literal, e.g. 127.0.0.1") from None
    _host_override = addresses
    if addresses is not None and not _patched:
        import aioice.ice

        original = aioice.ice.get_host_addresses

        def get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
            if _host_override is None:
                return original(use_ipv4=use_ipv4, use_ipv6=use_ipv6)
            return [a for a in _host_override if (":" in a and use_ipv6) or (":" not in a and use_ipv4)]

        aioice.ice.get_host_addresses = get_host_addresses
        _patched = True


def parse_ice_servers(urls: Sequence[str] | str | None, name: str = "ice server") -> list[str]:
    """``"stun:h:3478,turn:u:p@h:3478"`` or a list -> validated URL list (empty = none).

    A TURN URL may carry credentials as ``turn:user:password@host:port``.

    Raises:
        ConfigError: a URL whose scheme is not stun/stuns/turn/turns (naming ``name``, the
            option or variable it came from).
    """
    if urls is None:
        return []
    if isinstance(urls, str):
        urls = [u.strip() for u in urls.split(",") if u.strip()]
    out = []
    for u in urls:
        if u.split(":", 1)[0] not in ("stun", "stuns", "turn", "turns"):
            raise ConfigError(name, u, "expected stun:, stuns:, turn: or turns: URL")
        out.append(u)
    return out


def ice_server_dicts(ice_servers: Sequence[str] = ()) -> list[dict]:
    """The W3C ``RTCIceServer`` dictionaries (``urls``, ``username``, ``credential``) of the URLs
    from :func:`parse_ice_servers`: what a browser's ``RTCPeerConnection`` takes."""
    servers = []
    for u in ice_servers:
        scheme, rest = u.split(":", 1)
        if scheme.startswith("turn") and "@" in rest:
            cred, host = rest.rsplit("@", 1)
            user, _, pw = cred.partition(":")
            servers.append({"urls": f"{scheme}:{host}", "username": user, "credential": pw})
        else:
            servers.append({"urls": u})
    return servers


def configuration(ice_servers: Sequence[str] = ()) -> Any:
    """An ``RTCConfiguration`` with exactly these ICE servers (none by default)."""
    from aiortc import RTCConfiguration, RTCIceServer

    return RTCConfiguration(iceServers=[RTCIceServer(**d) for d in ice_server_dicts(ice_servers)])


def negotiated_max_message_bytes(pc: Any) -> int:
    """The smaller of ours (256 KiB) and the remote's ``a=max-message-size`` (none -> 64 KiB)."""
    sctp = getattr(pc, "sctp", None)
    remote = getattr(sctp, "_remote_max_message_size", None) if sctp is not None else None
    return negotiate_max_message_bytes(DATA_CHANNEL_MAX_MESSAGE_BYTES, remote or None)


def gate_receive(pc: Any, gate: Any) -> None:
    """Tests: make ``pc`` stop reading datagrams while ``gate`` (an asyncio.Event) is clear.

    Datagrams wait in aioice's queue, so nothing is lost; the sender sees no SCTP acks and its
    ``bufferedAmount`` grows, as with a real stalled receiver.
    """
    ice = pc.sctp.transport.transport
    if getattr(ice, "_tabcohort_gated", False):
        ice._tabcohort_gate = gate
        return
    inner = ice._recv

    async def gated_recv() -> bytes:
        await ice._tabcohort_gate.wait()
        return await inner()
    ice._tabcohort_gate = gate
    ice._tabcohort_gated = True
    ice._recv = gated_recv


#: remote ICE candidates taken per peer connection (a browser trickles a handful: host, srflx,
#: relay per interface). Each one costs aioice a sort of its whole check list and connectivity
#: checks for good: 12,000 of them from one rank held the server's event loop for 52 s (a
#: hostile trial), and each named address is sent STUN requests.
MAX_REMOTE_CANDIDATES = 32


#: :func:`parse_candidate`'s answer for the end of a peer's candidates (an empty candidate)
END_OF_CANDIDATES = object()
#: the longest candidate line taken from a peer (RFC 8839 section 5.1's grammar; real ones are
#: about 100 characters)
MAX_CANDIDATE_CHARS = 1024


def parse_candidate(cand: Any) -> Any:
    """A peer's trickled candidate (``{candidate, sdpMid, sdpMLineIndex}``, as a page sends
    it) as an aiortc ``RTCIceCandidate``, or :data:`END_OF_CANDIDATES` for an empty one.

    Raises:
        ValueError: not a candidate (untrusted input, checked here: aiortc's parser met a
            short line with an ``assert``, which ``python -O`` removes, and with IndexError or
            ValueError otherwise): not a dict, a line that is no string, longer than
            :data:`MAX_CANDIDATE_CHARS` or of fewer than the 8 fields RFC 8839 section 5.1
            requires, a field of the wrong type, or one aiortc does not parse.
    """
    from aiortc.sdp import candidate_from_sdp

    if not isinstance(cand, dict):
        raise ValueError("not an object")
    text = cand.get("candidate") or ""
    mid, index = cand.get("sdpMid"), cand.get("sdpMLineIndex")
    if not isinstance(text, str) or len(text) > MAX_CANDIDATE_CHARS:
        raise ValueError("the candidate is no string of at most %d characters" % MAX_CANDIDATE_CHARS)
    if not (mid is None or isinstance(mid, str) and len(mid) <= 64) or not (
            index is None or isinstance(index, int) and not isinstance(index, bool) and 0 <= index <= 0xFFFF):
        raise ValueError("sdpMid or sdpMLineIndex of the wrong type")
    if not text:
        return END_OF_CANDIDATES
    if text.startswith("candidate:"):
        text = text[len("candidate:"):]
    if len(text.split()) < 8:
        raise ValueError("a candidate line has at least 8 fields (RFC 8839 section 5.1)")
    try:
        c = candidate_from_sdp(text)
    except (AssertionError, ValueError, IndexError, KeyError) as e:
        raise ValueError(f"not a candidate line: {type(e).__name__}") from None
    c.sdpMid = mid
    c.sdpMLineIndex = index
    return c


async def add_candidate(pc: Any, cand: Any) -> None:
    """Add a candidate :func:`parse_candidate` made (:data:`END_OF_CANDIDATES`: the end)."""
    await pc.addIceCandidate(None if cand is END_OF_CANDIDATES else cand)
