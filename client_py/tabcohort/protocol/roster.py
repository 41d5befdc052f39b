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
    #: when its announced ``(term, step)`` last moved forward (-inf: not seen to move yet), and
    #: whether any message gave its term yet (a ``hello`` carries none)
    advanced_ms: float = float("-inf")
    term_known: bool = False


#: Fields a message may carry that refresh the member record.
_RECORD_FIELDS = ("batch", "ready", "running", "step", "backend", "term")


@dataclass
class Roster:
    """The peers this rank has heard from, keyed by id."""

    members: dict[int, Member] = field(default_factory=dict)

    def refresh(self, msg: dict, now_ms: float, live_ms: float = float("inf")) -> Member:
        """Refresh the sender's record from ``msg``: ``seen = now`` and each record field the
        message carries; fields it lacks keep their old values; ``advanced = now`` when its
        ``(term, step)`` moved forward since it was last seen, within ``live_ms``."""
        sender = msg["from"]
        m = self.members.get(sender)
        live = m is not None and now_ms - m.seen_ms <= live_ms
        if m is None:
            m = self.members[sender] = Member(id=sender, seen_ms=now_ms)
        m.seen_ms = now_ms
        term, step = msg.get("term"), msg.get("step")
        if live and ((term is not None and m.term_known and term > m.term)
                     or (step is not None and step > m.step and (term is None or term == m.term))):
            # (a first message, or the first after ``live_ms`` of silence, says where it is,
            # not that it moves)
            m.advanced_ms = now_ms
        if term is not None:
            m.term_known = True
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
