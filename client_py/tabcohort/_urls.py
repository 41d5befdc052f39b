"""URLs as printed: a URL's user information (``user:password@``) is never echoed."""

from __future__ import annotations

import re

# scheme://, then the authority up to its last "@" before the path (urlsplit's rule); a regex,
# not urlsplit, so that a URL urlsplit refuses (``http://u:pw@[::1``) is redacted too
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*://)([^/?#]*)@")


def redact_url(url: object) -> str:
    """``url`` as text with its password hidden: ``http://user:pw@host`` -> ``http://user:***@host``;
    a user name alone (it may be a token) -> ``http://***@host``; other text as it is."""
    s = str(url)
    m = _USERINFO.match(s)
    if m is None:
        return s
    user, sep, _ = m.group(2).partition(":")
    return f"{m.group(1)}{user + ':***' if sep else '***'}@{s[m.end():]}"
