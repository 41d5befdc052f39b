"""A rank that begins to lead reports at once (docs/PROTOCOL.md, "Roles"): the runtimes' report
loops ask :meth:`RankSession.lead_began` at each turn (natively every ``LEAD_CHECK_S``, a tab at
each page update) and send the report when it says so, not at the next ``report_interval_s``. The end-to-end case (a takeover, then the final
checkpoint stored) is tests/integration/test_partition_heal.py."""

from __future__ import annotations

from types import SimpleNamespace

from tabcohort.runtime.session import LEAD_CHECK_S, RankSession


def test_lead_began_says_each_start_of_a_lead_once():
    s = RankSession()
    m = SimpleNamespace(looping=False, leading=False)
    m.is_leader = lambda now_ms: m.leading
    d = SimpleNamespace(now_ms=lambda: 0.0)
    seen = []
    # following, then a bootstrap (is_leader), leading on, a lost lead, a takeover (looping first)
    for leading, looping in [(False, False), (True, False), (True, True), (True, True),
                             (False, False), (False, False), (False, True), (True, True)]:
        m.leading, m.looping = leading, looping
        seen.append(s.lead_began(m, d))
    assert seen == [False, True, False, False, False, False, True, False]
    assert 0 < LEAD_CHECK_S <= 0.1     # (the report's delay after a takeover, at most)
