"""A rank's reported fault reaches the server's console (``tabcohort serve`` prints a line when
a rank's ``fault`` changes, ``rooms.FAULT_SAY_INTERVAL_S`` apart at the most per rank): a
newcomer whose job raised in grads() saw the ranks leave with nothing said where the server
runs. The text is the rank's, untrusted: no terminal control characters pass, and it is cut."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tabcohort_server")   # (the server never runs in a tab)
from tabcohort_server.config import JobConfig, ServerLimits  # noqa: E402
from tabcohort_server.rooms import FAULT_SAY_INTERVAL_S, Room  # noqa: E402
from tabcohort_server.serve import FAULT_LINE_MAX_CHARS, _say_fault  # noqa: E402


def report(**state) -> str:
    return json.dumps({"type": "report", "state": state})


def test_a_new_fault_is_said_once_and_a_changing_one_at_most_once_per_interval():
    r = Room("r", JobConfig(dataset="synthetic", report_interval_s=0.1), ServerLimits(), clock=lambda: 0.0)
    said: list[tuple[int, str]] = []
    r.on_fault.append(lambda room, k, fault: said.append((k, fault)))
    p, q = r.register(now=0), r.register(now=0)
    r.control(p, report(step=1), now=0.0)
    assert said == []                                           # no fault: nothing said
    r.control(p, report(step=2, fault="job failed: boom"), now=1.0)
    r.control(p, report(step=3, fault="job failed: boom"), now=2.0)   # the same: said once
    assert said == [(p.id, "job failed: boom")]
    r.control(p, report(step=4, fault="diverged at step 4"), now=3.0)
    assert len(said) == 1                                       # another, within the interval: not yet
    r.control(q, report(step=4, fault="evaluate() raised"), now=3.0)
    assert said[-1] == (q.id, "evaluate() raised")              # (per rank)
    r.control(p, report(step=9, fault="diverged at step 9"), now=1.0 + FAULT_SAY_INTERVAL_S)
    assert said[-1] == (p.id, "diverged at step 9") and len(said) == 3
    # one held back by the interval is said as the rank leaves (a reviewer's point: a job that
    # failed right after another fault left with the fault it left for never said)
    r.control(p, report(step=10, fault="job failed: boom in grads"), now=2.0 + FAULT_SAY_INTERVAL_S)
    assert len(said) == 3
    r.disconnect(p, now=3.0 + FAULT_SAY_INTERVAL_S)
    assert said[-1] == (p.id, "job failed: boom in grads") and len(said) == 4
    # ... or at the next report once the interval passed, though the same text is reported again
    r.control(q, report(step=5, fault="evaluate() raised again"), now=4.0)
    r.control(q, report(step=6, fault="evaluate() raised again"), now=3.0 + FAULT_SAY_INTERVAL_S)
    assert said[-1] == (q.id, "evaluate() raised again") and len(said) == 5


def test_the_line_names_room_and_rank_and_shows_no_control_characters():
    r = Room("digits", JobConfig(dataset="synthetic"), ServerLimits(), clock=lambda: 0.0)
    lines: list[str] = []
    _say_fault(r, 0xAB, "job failed: \x1b[2J\x1b]0;owned\x07boom\nnext line\u202e", lines.append)
    assert lines == ["tabcohort serve: room digits: rank 000000ab reports a fault: "
                     "job failed: ?[2J?]0;owned?boom?next line?"]
    _say_fault(r, 1, "x" * (FAULT_LINE_MAX_CHARS + 50), lines.append)
    assert lines[-1].endswith("x" * FAULT_LINE_MAX_CHARS + " ...")


def test_an_output_that_fails_does_not_fail_the_report():
    r = Room("r", JobConfig(dataset="synthetic", report_interval_s=0.1), ServerLimits(), clock=lambda: 0.0)

    def gone(line: str) -> None:
        raise BrokenPipeError

    r.on_fault.append(lambda room, k, fault: _say_fault(room, k, fault, gone))
    p = r.register(now=0)
    r.control(p, report(step=2, fault="job failed: boom"), now=1.0)
    assert p.report["fault"] == "job failed: boom"


def test_a_room_of_many_faulty_seats_says_a_bounded_number_of_lines_and_counts_the_rest():
    from tabcohort_server.rooms import FAULT_LINES_BURST, FAULT_LINES_PER_MINUTE
    r = Room("digits", JobConfig(dataset="synthetic", report_interval_s=0.1), ServerLimits(), clock=lambda: 0.0)
    lines: list[str] = []
    r.on_fault.append(lambda room, k, fault: _say_fault(room, k, fault, lines.append))
    seats = [r.register(now=0) for _ in range(50)]
    for p in seats:
        r.control(p, report(step=1, fault="job failed: the same bug everywhere"), now=1.0)
    assert len(lines) == FAULT_LINES_BURST and r.faults_unsaid == 50 - FAULT_LINES_BURST
    r.control(seats[0], report(step=2, fault="job failed: another"), now=1.0 + 60.0 / FAULT_LINES_PER_MINUTE
              + FAULT_SAY_INTERVAL_S)
    assert lines[-1].endswith(f"({50 - int(FAULT_LINES_BURST)} more since the last line not shown: the operator "
                              "view has them)"), lines[-1]
    assert r.faults_unsaid == 0
