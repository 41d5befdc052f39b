"""One error tree for the project (STYLE.md, "Names, docs, errors").

- :class:`ConfigError`: bad local configuration; names the variable and its value and is
  raised before any network activity.
- :class:`RemoteProtocolError`: bad bytes or a bad message from a peer. Caught at the
  boundary (the frame reader, the rank machine), counted by ``reason`` and never fatal.
- :class:`LocalProtocolError`: misuse of an API by local code (a bug in the caller).
"""

from __future__ import annotations


class TabcohortError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(TabcohortError, ValueError):
    """A configuration value is invalid.

    Args:
        variable: the argument or environment variable name, e.g. ``"TABCOHORT_BATCH"``.
        value: the offending value as given.
        reason: what is wrong and what is expected.
        head: what the message starts with instead of ``variable=value`` (for a setting that
            was not given, where ``--trust-job=False`` reads as if the user had typed it).
    """

    def __init__(self, variable: str, value: object, reason: str, *, head: str | None = None) -> None:
        self.variable = variable
        self.value = value
        self.reason = reason
        super().__init__(f"{head if head is not None else f'{variable}={value!r}'}: {reason}")


class RemoteProtocolError(TabcohortError):
    """A peer sent something that breaks the wire format or the protocol.

    Args:
        reason: a short, stable drop-reason code used as a counter key, e.g. ``"truncated"``.
        detail: human-readable detail for logs.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class LocalProtocolError(TabcohortError):
    """Local code misused an API (for example encoding a message with a missing field)."""
