"""Member records and the derived sets (PROTOCOL.md, "Messages" and "Membership")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class Member:
    """What this rank knows of one peer. ``ready``/``running`` start False until a
    ``hello`` or ``beat`` says otherwise (PROTOCOL.md, "Messages")."""

    id: int
    seen_ms: float
    batch: int | None = None
    ready: bool = False
    running: bool = False
    step: int = 0
    backend: str = ""
    term: int = 0


#: Fields a message may carry that refresh the member record.
_RECORD_FIELDS = ("batch", "ready", "running", "step", "backend", "term")


@dataclass
class Roster:
    """The peers this rank has heard from, keyed by id."""

    members: dict[int, Member] = field(default_factory=dict)

    def refresh(self, msg: dict, now_ms: float) -> Member:
        """Refresh the sender's record from ``msg``: ``seen = now`` and each record field the
        message carries; fields it lacks keep their old values."""
        sender = msg["from"]
        m = self.members.get(sender)
        if m is None:
            m = self.members[sender] = Member(id=sender, seen_ms=now_ms)
        m.seen_ms = now_ms
        for key in _RECORD_FIELDS:
            if key in msg:
                setattr(m, key, msg[key])
        return m

    def prune(self, now_ms: float, drop_ms: float) -> list[int]:
        """Forget members not seen within ``drop_ms``; return the pruned ids."""
        gone = [k for k, m in self.members.items() if now_ms - m.seen_ms > drop_ms]
        for k in gone:
            del self.members[k]
        return gone

    def live(self, now_ms: float, drop_ms: float) -> Iterator[Member]:
        """Members seen within ``drop_ms`` (PROTOCOL.md: "live")."""
        for m in self.members.values():
            if now_ms - m.seen_ms <= drop_ms:
                yield m
