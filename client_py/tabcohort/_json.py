"""A bound on untrusted JSON's nesting, checked before the (recursive) parser sees it: in
Pyodide a body of 20,000 brackets overflowed the JavaScript stack inside ``json.loads``, a
fatal error of the whole runtime, not a RecursionError. Shared by the ranks (a room's public
summary) and the server (every control message, ``tabcohort_server.schema``)."""

from __future__ import annotations

import re

_NESTING = re.compile(r'[\\"\[\]{}]')


def within_depth(text: str, limit: int) -> bool:
    """True when JSON ``text`` nests arrays and objects at most ``limit`` deep (brackets inside
    strings, escapes included, do not count); linear in ``len(text)``, stops at the first
    bracket past ``limit``. Says nothing of whether ``text`` is valid JSON."""
    depth = 0
    in_string, escaped_at = False, -1
    for m in _NESTING.finditer(text):
        i, c = m.start(), m.group()
        if i == escaped_at:
            continue
        if in_string:
            if c == "\\":
                escaped_at = i + 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            if depth > limit:
                return False
        elif c in "]}":
            depth -= 1
    return True
