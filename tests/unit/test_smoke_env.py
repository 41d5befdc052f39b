"""Smoke tests that every tier runs (native, no-numpy native, Pyodide): the package imports,
the error tree formats, and SimScheduler (tabcohort.sched) keeps its ordering contract."""

from __future__ import annotations

import sys

import pytest

import tabcohort
from tabcohort import _compat
from tabcohort.errors import ConfigError, TabcohortError
from tabcohort.sched import SimScheduler


def test_package_imports_and_reports_tier() -> None:
    assert tabcohort.__version__
    assert isinstance(tabcohort.PROTOCOL_VERSION, int)
    assert _compat.HAVE_NUMPY == (_compat.np is not None)
    if sys.platform == "emscripten":
        assert sys.version_info[:2] == (3, 14)
        assert _compat.np is None  # no numpy in Pyodide core


def test_numpy_truly_unimportable_when_compat_says_so() -> None:
    """In the no-numpy and Pyodide tiers numpy must fail to import, not just be ignored."""
    if _compat.np is not None:
        pytest.skip("numpy is importable in this tier")
    import os

    if os.environ.get("TABCOHORT_NO_NUMPY") in ("1", "true", "yes"):
        pytest.skip("numpy disabled by TABCOHORT_NO_NUMPY only")
    with pytest.raises(ImportError):
        import numpy  # noqa: F401


def test_config_error_formats_variable_value_reason() -> None:
    e = ConfigError("VAR", "x", "reason")
    assert str(e) == "VAR='x': reason"
    assert (e.variable, e.value, e.reason) == ("VAR", "x", "reason")
    assert isinstance(e, TabcohortError) and isinstance(e, ValueError)


def test_sim_scheduler_runs_in_time_order_fifo_among_equal_times() -> None:
    s = SimScheduler()
    ran: list[tuple[str, float]] = []

    def rec(tag: str) -> None:
        ran.append((tag, s.now_ms()))

    s.call_later(30, rec, "c")
    s.call_later(10, rec, "a1")
    s.call_later(20, rec, "b")
    s.call_later(10, rec, "a2")
    s.call_later(10, rec, "a3")
    assert s.next_event_ms() == 10
    assert s.run_until(100) == 5
    assert ran == [("a1", 10), ("a2", 10), ("a3", 10), ("b", 20), ("c", 30)]
    assert s.now_ms() == 100
    assert s.next_event_ms() is None


def test_sim_scheduler_events_scheduled_while_running_keep_order() -> None:
    s = SimScheduler()
    ran: list[tuple[str, float]] = []

    def first() -> None:
        ran.append(("first", s.now_ms()))
        s.call_later(0, lambda: ran.append(("zero-delay", s.now_ms())))
        s.call_later(5, lambda: ran.append(("later", s.now_ms())))

    s.call_later(10, first)
    s.call_later(10, lambda: ran.append(("same-time", s.now_ms())))
    s.run_until(12)
    # The zero-delay child joins the back of the t=10 queue: after "same-time".
    assert ran == [("first", 10), ("same-time", 10), ("zero-delay", 10)]
    s.run_until(15)
    assert ran[-1] == ("later", 15)


def test_sim_scheduler_cancel() -> None:
    s = SimScheduler()
    ran: list[str] = []
    h1 = s.call_later(5, ran.append, "cancelled")
    s.call_later(5, ran.append, "kept")
    h3 = s.call_later(1, ran.append, "also cancelled")
    h1.cancel()
    h3.cancel()
    assert s.next_event_ms() == 5  # cancelled heads are skipped
    assert s.run_until(10) == 1
    assert ran == ["kept"]


def test_sim_scheduler_run_until_advances_clock_and_stops_at_boundary() -> None:
    s = SimScheduler(start_ms=100.0)
    ran: list[float] = []
    s.call_later(50, lambda: ran.append(s.now_ms()))
    s.call_at(200, lambda: ran.append(s.now_ms()))
    s.call_at(201, lambda: ran.append(s.now_ms()))
    assert s.run_until(120) == 0
    assert s.now_ms() == 120  # clock advances with no events
    assert s.run_until(200) == 2  # inclusive boundary
    assert ran == [150, 200] and s.now_ms() == 200
    s.run_until(190)  # never goes backwards
    assert s.now_ms() == 200
    assert s.run_until(1000) == 1 and ran[-1] == 201 and s.now_ms() == 1000


def test_sim_scheduler_livelock_guard() -> None:
    s = SimScheduler()

    def again() -> None:
        s.call_later(0, again)

    s.call_later(0, again)
    with pytest.raises(RuntimeError):
        s.run_until(0, max_events=100)
