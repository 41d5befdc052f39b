"""FrameWriter: messages in, chunks out, at the configured wire precision (docs/INTERFACES.md, "Wire")."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, LocalProtocolError
from .chunk import DEFAULT_MAX_MESSAGE_BYTES, MIN_MESSAGE_BYTES, split_frame
from .codecs import DEFAULT_INT8_BLOCK, get_codec
from .frame import encode_parts
from .vec import as_f32_np, as_f32_py, resolve_numpy


class FrameWriter:
    """Encode one sender's messages into chunks.

    Args:
        sender: this rank's id (uint32); every chunk's ``sender``.
        precision: wire precision of ``params``/``g``: ``f32``, ``f16``, ``bf16`` or ``int8``.
        max_message_bytes: the transport's largest message, chunk header included (negotiate
            it with :func:`tabcohort.wire.negotiate_max_message_bytes`).
        int8_block: int8 block size in elements (travels in the frame).
        use_numpy: ``None`` = numpy when importable. Both paths give identical bytes.

    Attributes:
        f16_fallbacks: vectors sent as f32 because a finite value would overflow f16/bf16.
        n_frames, n_chunks, n_bytes: totals written (bytes include chunk headers).

    Raises:
        ConfigError: a bad ``sender``, ``precision``, ``max_message_bytes`` or ``int8_block``.
    """

    def __init__(self, sender: int, *, precision: str = "f32",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 int8_block: int = DEFAULT_INT8_BLOCK, use_numpy: bool | None = None) -> None:
        if isinstance(sender, bool) or not isinstance(sender, int) or not 0 <= sender <= 0xFFFFFFFF:
            raise ConfigError("sender", sender, "must be a uint32 rank id")
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) \
                or max_message_bytes < MIN_MESSAGE_BYTES:
            raise ConfigError("max_message_bytes", max_message_bytes, f"must be an int >= {MIN_MESSAGE_BYTES}")
        if isinstance(int8_block, bool) or not isinstance(int8_block, int) or not 1 <= int8_block <= 2**20:
            raise ConfigError("int8_block", int8_block, "must be an int in [1, 2**20]")
        self.sender = sender
        self.codec = get_codec(precision)
        self.precision = precision
        self.max_message_bytes = max_message_bytes
        self.int8_block = int8_block
        self.use_numpy = resolve_numpy(use_numpy)
        self.f16_fallbacks = 0
        self.n_frames = self.n_chunks = self.n_bytes = 0
        self._next_id = 0

    def _fallback(self) -> None:
        self.f16_fallbacks += 1

    def _parts(self, msg: dict) -> list:
        frm = msg.get("from", self.sender)
        if frm != self.sender:
            raise LocalProtocolError(f"message from {frm!r} given to the writer of {self.sender}")
        return encode_parts(msg, codec=self.codec, block=self.int8_block, use_numpy=self.use_numpy,
                            on_fallback=self._fallback)

    def encode_body(self, msg: dict) -> bytes:
        """The frame body of ``msg`` (no chunk headers); see :mod:`tabcohort.wire.frame`."""
        return b"".join(self._parts(msg))

    def write(self, msg: dict) -> list[bytes]:
        """Encode ``msg`` as the chunks of one new frame.

        Args:
            msg: a message dict (INTERFACES.md); ``to`` (uint32 or ``None``) goes in each header.

        Returns:
            The chunks, each at most ``max_message_bytes`` bytes, in index order.

        Raises:
            LocalProtocolError: the message is malformed or too large to chunk.
        """
        to = msg.get("to")
        if to is not None and (isinstance(to, bool) or not isinstance(to, int) or not 0 <= to <= 0xFFFFFFFF):
            raise LocalProtocolError(f"to={to!r} is not a uint32 rank id")
        body = self._parts(msg)
        fid = self._next_id
        self._next_id = (fid + 1) & 0xFFFFFFFF
        try:
            chunks = split_frame(body, sender=self.sender, recipient=to, frame_id=fid,
                                 max_message_bytes=self.max_message_bytes)
        except OverflowError as e:
            raise LocalProtocolError(str(e)) from None
        self.n_frames += 1
        self.n_chunks += len(chunks)
        self.n_bytes += sum(map(len, chunks))
        return chunks

    def quantize(self, vec: Any) -> Any:
        """Exactly what a receiver decodes for ``vec`` at this precision, or ``None`` at f32.

        Args:
            vec: float32 data, shape (n,) (numpy array, ``array('f'|'d')`` or list).

        Returns:
            A float32 vector of the decoding path's type (numpy on the numpy path, else
            ``array('f')``), equal element for element to what a receiver decodes; ``None`` at
            f32, where decoding returns the input unchanged. ``quantize`` of its own output
            returns an equal vector (PROTOCOL.md, "Bus contract").

        Raises:
            LocalProtocolError: int8 and a non-finite value.
        """
        x = as_f32_np(vec) if self.use_numpy else as_f32_py(vec)
        return self.codec.quantize(x, use_numpy=self.use_numpy, block=self.int8_block)
