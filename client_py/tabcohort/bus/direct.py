"""The direct TCP path's sans-I/O parts (docs/PROTOCOL.md, "Direct TCP path"): the announced
address, the handshake that authenticates a connection, and the stream's chunk framing.

No event loop, socket or clock here; :class:`tabcohort.bus.aio.TcpConnector` does the I/O.

- **Offer.** The lower id of a pair listens and sends the other, through the server (a
  ``signal`` of kind ``direct``, ``from`` bound by the server to the sender's link), its
  address ``addr`` (an IP literal and a port, :func:`format_addr`) and a fresh 32-byte key
  ``key`` (hex) for this pair and this offer only. Both are untrusted: :func:`parse_addr` takes
  only an IP literal (no name to resolve) and a port in 1..65535, at most
  :data:`MAX_ADDR_CHARS` characters; :func:`parse_key` exactly 64 hex digits.
- **Handshake.** The dialler sends :data:`HELLO` (60 bytes): magic ``TCD1``, the listener's
  id, its own id, a 16-byte nonce and ``HMAC-SHA256(key, "dial" | ids | nonce)`` (RFC 2104).
  The listener checks the ids name a pending offer, the MAC (constant time), and answers
  ``HMAC-SHA256(key, "accept" | ids | nonce)`` (32 bytes), which the dialler checks. A third
  party without the key can neither join a pair nor pose as the listener; an offer's key is
  used for one connection (a replayed hello finds no pending offer). The stream itself is not
  encrypted (as ``ws://`` is not): use it on networks you trust with the parameters.
- **Framing.** After the handshake each chunk (exactly as :class:`~tabcohort.wire.FrameWriter`
  cuts it) is sent as ``u32`` little-endian length, then the chunk; :class:`ChunkStream`
  splits the byte stream (each chunk read into a buffer of its own) and refuses a length of 0
  or above its bound.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import struct

from .._compat import np
from ..wire import CHUNK_HEADER
from ..wire.frame import BODY_ALIGN_PAD

MAGIC = b"TCD1"
NONCE_BYTES = 16
KEY_BYTES = 32
#: the dialler's first message: magic, listener id, dialler id, nonce, MAC
HELLO = struct.Struct("<4sII16s32s")
ACCEPT_BYTES = 32
#: an announced address longer than this is refused (``[v6]:port`` fits in 47)
MAX_ADDR_CHARS = 64
LEN = struct.Struct("<I")
#: the chunk size on a direct path (docs/PROTOCOL.md "Direct TCP path", Framing): a frame of up
#: to 4 MiB (a model of 1M float32 parameters) crosses in one chunk, read into a buffer of its
#: own whose vectors the wire reader decodes as views (:class:`ChunkStream`): no reassembly
#: copy. With 1 MiB chunks, ``bench/bench_anchors.py``'s leader at N = 4 spent 1.2 ms of a
#: 14 ms round copying three 4 MB buckets out of their chunks. Not more: a beat queued behind
#: a chunk waits for all of it (335 ms at 100 Mbit/s for 4 MiB, under one beat interval).
DIRECT_MAX_MESSAGE_BYTES = 4 << 20


def format_addr(host: str, port: int) -> str:
    """``host:port`` (``[host]:port`` for IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_addr(addr: object) -> tuple[str, int] | None:
    """An announced ``host:port`` -> ``(host, port)``, or ``None`` for anything else (not a str,
    too long, a host that is not an IP literal, a port outside 1..65535)."""
    if not isinstance(addr, str) or not 0 < len(addr) <= MAX_ADDR_CHARS or not addr.isascii():
        return None
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or len(port) > 5:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if "%" in host or ":" not in host:
            return None
    elif ":" in host:
        return None   # an IPv6 host must be bracketed (RFC 3986 section 3.2.2)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_unspecified or ip.is_multicast:
        return None
    n = int(port)
    return (str(ip), n) if 0 < n < 65536 else None


def parse_key(key: object) -> bytes | None:
    """An announced key (64 hex digits) -> 32 bytes, or ``None``."""
    if not isinstance(key, str) or len(key) != 2 * KEY_BYTES:
        return None
    try:
        return bytes.fromhex(key)
    except ValueError:
        return None


def _mac(key: bytes, label: bytes, listener: int, dialler: int, nonce: bytes) -> bytes:
    return hmac.new(key, label + struct.pack("<II", listener, dialler) + nonce, hashlib.sha256).digest()


def dial_hello(key: bytes, listener: int, dialler: int, nonce: bytes) -> bytes:
    """The dialler's :data:`HELLO` (``nonce``: :data:`NONCE_BYTES` fresh random bytes)."""
    return HELLO.pack(MAGIC, listener, dialler, nonce, _mac(key, b"dial", listener, dialler, nonce))


def read_hello(data: bytes) -> tuple[int, int, bytes, bytes] | None:
    """``(listener, dialler, nonce, mac)`` of a :data:`HELLO`, or ``None`` (wrong size or magic)."""
    if len(data) != HELLO.size:
        return None
    magic, listener, dialler, nonce, mac = HELLO.unpack(data)
    return (listener, dialler, nonce, mac) if magic == MAGIC else None


def hello_valid(key: bytes, listener: int, dialler: int, nonce: bytes, mac: bytes) -> bool:
    """Whether ``mac`` proves the dialler holds ``key`` (constant-time compare)."""
    return hmac.compare_digest(mac, _mac(key, b"dial", listener, dialler, nonce))


def accept_mac(key: bytes, listener: int, dialler: int, nonce: bytes) -> bytes:
    """The listener's answer: proof it holds ``key``, bound to the dialler's nonce."""
    return _mac(key, b"accept", listener, dialler, nonce)


#: bytes of the buffer a direct path reads into between chunks: a read there takes in every
#: length prefix and short chunk the socket holds (beats, controls, a small model's round),
#: where reading each prefix into a buffer of 4 bytes cost a loop turn per prefix and per chunk:
#: behind a leader's 2 ms computes, a 77 KB bucket reached it 12-20 ms after it was sent
SCRATCH_BYTES = 256 << 10


class ChunkStream:
    """Splits a direct path's byte stream into chunks (``u32`` LE length, then the chunk): a
    socket fills :meth:`buffer` and reports how much with :meth:`advance`
    (``asyncio.BufferedProtocol``). Between chunks the stream reads into a scratch buffer of
    :data:`SCRATCH_BYTES`, so one read takes in every complete chunk it holds; a chunk longer
    than what arrived gets a buffer of its own length, the bytes it has copied in, and the rest
    is read straight into it (a 4 MB bucket is copied for its first 256 KiB at most).

    Args:
        max_chunk_bytes: the largest length accepted.

    Attributes:
        error: why the stream is unusable (a length of 0 or above the bound), else ``None``;
            once set, nothing more is returned (the connection must be closed).
    """

    __slots__ = ("max_chunk_bytes", "target", "filled", "in_chunk", "error", "scratch", "held")

    def __init__(self, max_chunk_bytes: int) -> None:
        self.max_chunk_bytes = max_chunk_bytes
        self.scratch = bytearray(SCRATCH_BYTES)
        self.held = 0                  # bytes of the scratch buffer not yet taken
        self.target: bytearray | memoryview = self.scratch
        self.filled = 0                # bytes of ``target`` filled while in a chunk
        self.in_chunk = False
        self.error: str | None = None

    def buffer(self) -> memoryview:
        """Where the next bytes of the stream go (at least one byte)."""
        if self.in_chunk:
            return memoryview(self.target)[self.filled:]
        if self.error is not None:
            return memoryview(self.scratch)
        return memoryview(self.scratch)[self.held:]

    def advance(self, n: int) -> list[bytearray | memoryview]:
        """``n`` bytes were written into :meth:`buffer`: the chunks they complete, in order,
        each in a writable buffer of its own (bytes-like; possibly none)."""
        if self.error is not None:
            return []
        if self.in_chunk:
            self.filled += n
            if self.filled < len(self.target):
                return []
            data = self.target
            self.in_chunk, self.target, self.filled = False, self.scratch, 0
            return [data]
        self.held += n
        out: list[bytearray | memoryview] = []
        buf, end, pos = memoryview(self.scratch), self.held, 0
        while end - pos >= LEN.size:
            (k,) = LEN.unpack_from(buf, pos)
            if not 0 < k <= self.max_chunk_bytes:
                self.error = f"a chunk length of {k} bytes (bound {self.max_chunk_bytes})"
                self.held = 0          # (what still arrives is read into the scratch and discarded)
                buf.release()
                return out
            pos += LEN.size
            chunk = _uninitialized(k)
            got = min(k, end - pos)
            chunk[:got] = buf[pos:pos + got]
            pos += got
            if got < k:               # the rest straight into the chunk's own buffer
                self.in_chunk, self.target, self.filled = True, chunk, got
                break
            out.append(chunk)
        if pos:                       # keep an incomplete length prefix at the start
            rest = end - pos
            buf[:rest] = bytes(buf[pos:end])
            self.held = rest
        buf.release()
        return out

    def feed(self, data: bytes) -> list[bytes]:
        """The complete chunks ``data`` finishes, in order (:meth:`buffer` / :meth:`advance`
        over a buffer already in hand)."""
        out: list[bytes] = []
        mv, pos = memoryview(data), 0
        while pos < len(data) and self.error is None:
            buf = self.buffer()
            k = min(len(buf), len(data) - pos)
            buf[:k] = mv[pos:pos + k]
            pos += k
            out += [bytes(c) for c in self.advance(k)]
        return out

    def pending_bytes(self) -> int:
        """Bytes of an incomplete length or chunk held."""
        return self.held + (self.filled + LEN.size if self.in_chunk else 0)


#: bytes skipped at the start of a chunk's buffer so that its frame body lands where a wire
#: reader puts a body it reassembles (``BODY_ALIGN_PAD`` past a 4-aligned address): the
#: float32 vectors of a frame carried whole then sit 4-aligned and decode as views
_CHUNK_PAD = (BODY_ALIGN_PAD - CHUNK_HEADER.size) % 4


def _uninitialized(k: int) -> bytearray | memoryview:
    """A writable buffer of ``k`` bytes whose contents are not set: with numpy, not zeroed first
    (a ``bytearray`` is, and zeroing each 1 MiB chunk before the socket overwrote it cost a
    leader receiving three 4 MB buckets 0.5 ms of a 15 ms round in ``bench/bench_anchors.py``),
    and aligned as :data:`_CHUNK_PAD` says (numpy's buffers start 16-aligned)."""
    if np is not None:
        return memoryview(np.empty(_CHUNK_PAD + k, dtype=np.uint8)).cast("B")[_CHUNK_PAD:]
    return bytearray(k)


def frame(chunks: list[bytes]) -> bytes:
    """``chunks`` as one write on a direct path (each prefixed by its length)."""
    parts: list[bytes] = []
    for c in chunks:
        parts.append(LEN.pack(len(c)))
        parts.append(c)
    return b"".join(parts)
