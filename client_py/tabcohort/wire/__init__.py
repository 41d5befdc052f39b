"""Wire format: frames, chunks and precision codecs (layout in docs/INTERFACES.md, "Wire").

Stdlib-only on import; numpy is used where importable, and both paths give identical bytes.
"""

from .chunk import (
    CHUNK_HEADER,
    DATA_CHANNEL_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    WIRE_VERSION,
    Route,
    negotiate_max_message_bytes,
    parse_route,
    rechunk,
    split_frame,
)
from .codecs import CODECS, FLAG_F32_FALLBACK, Codec, get_codec
from .frame import MSG_TYPES, SCHEMAS, decode_body, encode_body
from .limits import DROP_REASONS, WireLimits
from .reader import FrameReader
from .vec import resolve_numpy
from .writer import FrameWriter

__all__ = [
    "CHUNK_HEADER", "CODECS", "Codec", "DATA_CHANNEL_MAX_MESSAGE_BYTES", "DEFAULT_MAX_MESSAGE_BYTES",
    "DROP_REASONS", "FLAG_F32_FALLBACK", "FrameReader", "FrameWriter", "MSG_TYPES", "Route", "SCHEMAS",
    "WIRE_VERSION", "WireLimits", "decode_body", "encode_body", "get_codec",
    "negotiate_max_message_bytes", "parse_route", "rechunk", "resolve_numpy", "split_frame",
]
