"""Wire precision names (docs/PROTOCOL.md, "Wire precision"), apart from the codecs: what a
configuration checks. The server validates a room's precision here, so it never imports a codec
(docs/INTERFACES.md: the server never decodes parameters)."""

from __future__ import annotations

from ..errors import ConfigError

#: every wire precision a frame may carry (one codec each in :mod:`tabcohort.wire.codecs`)
PRECISIONS = ("bf16", "f16", "f32", "int8")


def check_precision(name: object) -> str:
    """``name`` when it is a wire precision.

    Raises:
        ConfigError: naming ``precision`` and the value, with the accepted names.
    """
    if not isinstance(name, str) or name not in PRECISIONS:
        raise ConfigError("precision", name, f"expected one of {sorted(PRECISIONS)}")
    return name
