"""The room's public summary (``GET /api/rooms/ROOM``) as a rank reads it before it fetches the
job's data and the checkpoint (README "Resuming": a finished room's ranks are told to stop).
The summary is untrusted input, from a misconfigured or hostile server or proxy: anything but a
JSON object that says ``"stopped": true`` is unknown, and the rank goes on; a rank never raises
on it, and what it repeats of it is plain text."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tabcohort.runtime.native import RankConfig, RankRun
from tabcohort.runtime.session import STOP_REASON_SHOWN_LEN, finished_room_message, parse_room_summary

from ._drive import drive

MARKUP = "<img src=x onerror=alert(1)>"

#: bodies that are no JSON object: the rank takes the summary for unknown
NOT_AN_OBJECT = [
    b"", b"<html><body>502 Bad Gateway</body></html>", MARKUP.encode(), b"{\"stopped\": true",   # not JSON
    b"[{\"stopped\": true}]", b"\"stopped\"", b"true", b"null", b"1e999", b"NaN",                 # not an object
    b"1" * 5000,                      # an integer too long to convert (ValueError since Python 3.11)
    # nested deep: in Pyodide, 20,000 brackets overflowed the JavaScript stack inside json.loads
    # (a fatal error of the runtime); in CPython, 100,000 are a RecursionError
    b"[" * 20_000 + b"]" * 20_000, b'{"a":' * 20_000 + b"1" + b"}" * 20_000, b"[" * 100_000,
    b'{"stopped": true, "x": ' + b"[" * 65 + b"]" * 65 + b"}",
    b"\xff\xfe\x00{\"stopped\": true}", b"\x80\x81\x82",                                          # not UTF-8
    "[1, 2]", None,
]


@pytest.mark.parametrize("body", NOT_AN_OBJECT, ids=range(len(NOT_AN_OBJECT)))
def test_a_body_that_is_no_json_object_is_no_summary(body):
    assert parse_room_summary(body) is None
    assert finished_room_message(parse_room_summary(body)) is None


def test_a_json_object_is_the_summary_whatever_its_fields():
    body = json.dumps({"stopped": True, "stop_reason": "steps 5 reached", "ranks": [{"x": [1, {}]}]}).encode()
    assert parse_room_summary(body)["stop_reason"] == "steps 5 reached"
    assert parse_room_summary('{"step": NaN, "loss": 1e999}')["loss"] == math.inf


def test_the_depth_bound_counts_arrays_and_objects_not_brackets_in_strings():
    from tabcohort.runtime.session import ROOM_SUMMARY_MAX_DEPTH as D
    deep = lambda n: "[" * n + "]" * n   # noqa: E731
    assert parse_room_summary('{"x": ' + deep(D - 1) + "}") is not None
    assert parse_room_summary('{"x": ' + deep(D) + "}") is None
    # brackets inside strings, after escaped quotes and escaped backslashes, are text
    for obj in ({"stopped": True, "r": "[{" * 5000}, {"r": "\\", "s": '"[[[[' * 100},
                {"r": '\\"' + "[" * 100, "s": "\\" * 7 + "{" * 100}):
        text = json.dumps(obj)
        assert parse_room_summary(text) == obj and parse_room_summary(text.encode()) == obj, text
    # ... and a string that ends in an escaped backslash ends there: the brackets after it count
    assert parse_room_summary('{"r": "\\\\", "x": ' + deep(D) + "}") is None
    assert parse_room_summary('{"r": "\\\\", "x": ' + deep(3) + "}") == {"r": "\\", "x": [[[]]]}


#: summaries whose ``stopped`` is not the JSON ``true``: the room may run, the rank goes on
NOT_STOPPED = [
    None, [], [{"stopped": True}], "stopped", 1, math.nan, True,
    {}, {"stopped": False}, {"stopped": "true"}, {"stopped": "True"}, {"stopped": 1}, {"stopped": 1.0},
    {"stopped": math.nan}, {"stopped": math.inf}, {"stopped": 10 ** 5000}, {"stopped": None},
    {"stopped": [True]}, {"stopped": {"stopped": True}}, {"stopped": MARKUP, "stop_reason": MARKUP},
    {"Stopped": True}, {"room": {"stopped": True}},
]


@pytest.mark.parametrize("summary", NOT_STOPPED, ids=range(len(NOT_STOPPED)))
def test_a_summary_that_does_not_say_stopped_true_lets_the_rank_go_on(summary):
    assert finished_room_message(summary) is None


NO_TEXT = [None, 10 ** 5000, -(10 ** 5000), math.nan, math.inf, 1e308, True, 0,
           {"why": MARKUP}, [MARKUP], {"a": {"b": {"c": [1, 2, {}]}}}, "", "   "]


@pytest.mark.parametrize("reason", NO_TEXT, ids=range(len(NO_TEXT)))
def test_a_stop_reason_that_is_no_text_is_left_out(reason):
    # (str() of a 5,000-digit integer raises ValueError: a rank that said str(reason) exited with
    # a traceback; and a nested object is the server's structure, not a reason to repeat)
    msg = finished_room_message({"stopped": True, "stop_reason": reason})
    assert msg == "stopped before joining the cohort: the room has finished; nothing was fetched"


def test_a_finished_room_names_the_servers_reason():
    msg = finished_room_message({"stopped": True, "stop_reason": "steps 305 reached (checkpoint at step 305)",
                                 "step": "305", "ranks": "none"})
    assert msg == ("stopped (server: steps 305 reached (checkpoint at step 305)) before joining the cohort: the "
                   "room has finished; nothing was fetched")


@pytest.mark.parametrize("reason", [MARKUP, f"diverged at step 9: {MARKUP}", "<script>alert(1)</script>",
                                    "\x1b[2J\x1b]0;owned\x07cleared", "a\nb\rc\u2028d\x00e", "<" * 10_000])
def test_a_stop_reason_is_repeated_as_plain_text_never_markup_or_terminal_codes(reason):
    msg = finished_room_message({"stopped": True, "stop_reason": reason})
    assert msg is not None and msg.startswith("stopped (server: ")
    assert "<" not in msg and ">" not in msg and msg.isprintable(), msg
    assert len(msg) <= STOP_REASON_SHOWN_LEN + 100


def test_a_huge_stop_reason_is_cut():
    msg = finished_room_message({"stopped": True, "stop_reason": "x" * 1_000_000})
    assert "x" * STOP_REASON_SHOWN_LEN in msg and "x" * (STOP_REASON_SHOWN_LEN + 1) not in msg


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(alphabet=st.sampled_from("<>/=\"' abc\x00\x1b\n\u2028é"), max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.sampled_from(["stopped", "stop_reason", "x"]),
                                                              kids, max_size=3),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(JSON, JSON)
def test_any_json_shaped_summary_gives_none_or_plain_text(stopped, reason):
    for summary in ({"stopped": stopped, "stop_reason": reason}, stopped, {"stopped": True, "stop_reason": reason}):
        msg = finished_room_message(summary)
        assert msg is None or ("<" not in msg and ">" not in msg and msg.isprintable())
        assert (msg is not None) == (isinstance(summary, dict) and summary.get("stopped") is True)


# ---------------------------------------------------------------- the native rank's read of it
class _Response:
    def __init__(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self.status, self.body, self.headers = status, body, headers or {}
        self.released = False

    async def read(self) -> bytes:
        if isinstance(self.body, BaseException):
            raise self.body
        return self.body

    def release(self) -> None:
        self.released = True

    async def __aenter__(self) -> "_Response":
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


class _Http:
    """An aiohttp.ClientSession's ``get`` that answers each request with the next response."""

    def __init__(self, *answers) -> None:
        self.answers, self.asked = list(answers), []

    async def get(self, url: str, *, headers: dict, allow_redirects: bool) -> _Response:
        self.asked.append((url, dict(headers)))
        a = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(a, BaseException):
            raise a
        return a


def _summary(http: _Http, server: str = "http://127.0.0.1:23200") -> dict | None:
    run = RankRun(RankConfig.from_sources({"server": server, "room": "digits"}, {}))
    return drive(run._room_summary(http))[0]   # (no event loop: the Pyodide tier has none)


@pytest.mark.parametrize("body", [b for b in NOT_AN_OBJECT if isinstance(b, bytes)],
                         ids=range(sum(isinstance(b, bytes) for b in NOT_AN_OBJECT)))
def test_the_native_rank_reads_a_hostile_body_as_no_summary(body):
    http = _Http(_Response(200, body, {"Content-Type": "application/json"}))
    assert _summary(http) is None
    # asked of the room, without any Authorization (README "Limits": it would spend the auth budget)
    assert http.asked == [("http://127.0.0.1:23200/api/rooms/digits", {})]


@pytest.mark.parametrize("answer", [
    _Response(500, b'{"stopped": true}'), _Response(403, b'{"stopped": true}'),
    _Response(200, ConnectionResetError("reset while reading")), OSError("connection refused"),
    asyncio.TimeoutError(),
    # a redirect out of https: refused (the credentials would go in clear), not followed
    _Response(307, b"", {"Location": "http://elsewhere/api/rooms/digits"}),
    # a redirect loop: bounded, and its last answer is no summary
    _Response(307, b"", {"Location": "/api/rooms/digits"}),
], ids=["500", "403", "read-fails", "refused", "timeout", "https-to-http", "redirect-loop"])
def test_the_native_rank_takes_a_failed_request_for_no_summary(answer):
    server = "https://127.0.0.1:23200" if getattr(answer, "headers", {}).get("Location", "").startswith("http:") \
        else "http://127.0.0.1:23200"
    assert _summary(_Http(answer), server) is None


def test_the_native_rank_reads_a_finished_rooms_summary():
    http = _Http(_Response(200, json.dumps({"stopped": True, "stop_reason": MARKUP}).encode()))
    summary = _summary(http)
    assert summary == {"stopped": True, "stop_reason": MARKUP}
    assert finished_room_message(summary) == (
        "stopped (server: ?img src=x onerror=alert(1)?) before joining the cohort: the room has finished; nothing "
        "was fetched")
