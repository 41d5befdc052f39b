"""Reader bounds and drop reasons (docs/INTERFACES.md, "Wire").

Every bound is checked against header-declared sizes *before* anything is allocated, so a
hostile peer can make a reader hold at most ``max_incomplete_bytes_per_sender`` of partial frames
(all peers together ``max_incomplete_bytes``) plus one frame of ``max_frame_bytes`` being decoded.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

# Drop reasons: short stable strings, used as counter keys in ``FrameReader.drops``.
TRUNCATED = "truncated"  #: bytes end inside the chunk header or a fixed field
BAD_VERSION = "bad_version"  #: chunk wire version is not ours
UNKNOWN_TYPE = "unknown_type"  #: frame type byte names no message
LENGTH_MISMATCH = "length_mismatch"  #: bytes disagree with a declared length
ABSURD_SIZE = "absurd_size"  #: a declared size exceeds a limit
INVALID_UTF8 = "invalid_utf8"  #: a text field is not UTF-8
BAD_CHUNK = "bad_chunk"  #: chunk index/count/flags invalid or inconsistent within a frame
DUPLICATE_CHUNK = "duplicate_chunk"  #: a chunk index arrived twice for one incomplete frame
REASSEMBLY_OVERFLOW = "reassembly_overflow"  #: an incomplete frame evicted to respect a bound
REASSEMBLY_TIMEOUT = "reassembly_timeout"  #: an incomplete frame older than the timeout
BAD_VALUE = "bad_value"  #: a field value no encoder produces (bool 2, int8 -128, codec id...)

DROP_REASONS = (
    TRUNCATED,
    BAD_VERSION,
    UNKNOWN_TYPE,
    LENGTH_MISMATCH,
    ABSURD_SIZE,
    INVALID_UTF8,
    BAD_CHUNK,
    DUPLICATE_CHUNK,
    REASSEMBLY_OVERFLOW,
    REASSEMBLY_TIMEOUT,
    BAD_VALUE,
)


@dataclass(frozen=True)
class WireLimits:
    """Bounds a :class:`~tabcohort.wire.FrameReader` enforces on untrusted bytes.

    Attributes:
        max_frame_bytes: largest reassembled frame, bytes (default 64 MiB).
        max_incomplete_frames_per_sender: partial frames held per sender; a new one evicts the
            oldest (counted ``reassembly_overflow``).
        max_incomplete_bytes: partial-frame bytes held over all senders (default 256 MiB); when
            it is reached, the sender holding the most loses its oldest partial frame.
        max_incomplete_bytes_per_sender: partial-frame bytes held for one sender (``None``, the
            default: ``max_frame_bytes``, one largest frame); a sender's chunk beyond it evicts
            that sender's oldest partial frame (``reassembly_overflow``), never another's.
        reassembly_timeout_ms: a partial frame older than this is dropped, milliseconds.
        max_vector_len: largest ``params``/``g`` element count (default 16 Mi elements).
        max_assign: largest number of entries in a ``round``'s assignment.
        max_int8_block: largest int8 block size accepted from a peer.
    """

    max_frame_bytes: int = 64 * 2**20
    max_incomplete_frames_per_sender: int = 4
    max_incomplete_bytes: int = 256 * 2**20
    reassembly_timeout_ms: float = 10_000.0
    max_vector_len: int = 16 * 2**20
    max_assign: int = 65_536
    max_int8_block: int = 2**20
    max_incomplete_bytes_per_sender: int | None = None

    @property
    def sender_budget_bytes(self) -> int:
        """Partial-frame bytes one sender may make a reader hold."""
        v = self.max_incomplete_bytes_per_sender
        return self.max_frame_bytes if v is None else v

    def __post_init__(self) -> None:
        for name in ("max_frame_bytes", "max_incomplete_frames_per_sender", "max_incomplete_bytes",
                     "max_vector_len", "max_assign", "max_int8_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(name, v, "must be a positive integer")
        v = self.max_incomplete_bytes_per_sender
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError("max_incomplete_bytes_per_sender", v, "must be a positive integer or None")
        if not self.reassembly_timeout_ms > 0:
            raise ConfigError("reassembly_timeout_ms", self.reassembly_timeout_ms, "must be > 0")
