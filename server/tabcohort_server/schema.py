"""Validation of every JSON control a rank sends the server (docs/PROTOCOL.md, "State report";
``tabcohort.bus.room`` for the control messages), at the boundary, before the room reads a field.

A control is untrusted input exactly like a frame: :func:`parse_control` returns either the
validated object or a drop reason (a short stable string the room counts in ``Room.drops``, shown
in ``/api/rooms/ROOM`` and ``/metrics``); it never raises. The schemas are JSON Schema (draft
2020-12) checked with the ``jsonschema`` library; what JSON Schema cannot say (no NaN or Infinity
anywhere, a bounded nesting depth) is checked by the parser here.

Bounds (all checked): ints are JSON integers in their wire range (a step is ``0 <= step < 2**63``,
ids are uint32), floats are finite, strings are at most 256 characters (an SDP 16 KiB), maps at
most 64 entries of short keys, lists at most 1024 items.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any, Callable

from jsonschema import Draft202012Validator, validators

from tabcohort._json import within_depth

#: Nesting depth a control may have (a report is at most 3 deep); anything deeper is dropped
#: (``too_deep``) before the JSON parser recurses.
MAX_DEPTH = 8

U32 = {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}
U63 = {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}
NUM = {"type": "number"}          # finite: the parser refuses NaN and Infinity literals, and
                                  # _Validator what overflows a double (1e999)
NUM_OR_NULL = {"type": ["number", "null"]}
STR = {"type": "string", "maxLength": 256}
STR_OR_NULL = {"type": ["string", "null"], "maxLength": 256}
BOOL = {"type": "boolean"}
KEY = {"maxLength": 64}
#: a string holding a line break: JSON Schema's ``pattern`` is a search, and ``$`` also matches
#: before a final newline, so ``^...$`` alone let ``"server\n"`` pass as an identifier
_NEWLINE = {"pattern": "\n"}
#: keys of counters by reason (they become metric labels): short identifiers
REASON = {"pattern": "^[A-Za-z0-9_.-]{1,64}$", "not": _NEWLINE}


def _map(values: dict, keys: dict = KEY) -> dict:
    return {"type": "object", "maxProperties": 64, "propertyNames": keys, "additionalProperties": values}


#: a rank id as 8 lowercase hex digits (how reports key per-rank maps)
RANK_HEX = {"type": "string", "pattern": "^[0-9a-f]{8}$", "maxLength": 8}


def _ranks_map(values: dict) -> dict:
    """A per-rank map (one entry per cohort member: as many as a room's seats)."""
    return {"type": "object", "maxProperties": 4096, "propertyNames": RANK_HEX, "additionalProperties": values}


def _links_map(values: dict) -> dict:
    """A per-path map: one entry per peer (``%08x``) and the server's (``server``). Why not
    :func:`_map`'s 64: 64 idle sockets from one address (the per-address seat limit) made every
    honest rank's report too long, and the server dropped them all (its view of the room froze)."""
    return {"type": "object", "maxProperties": 4097,
            "propertyNames": {"pattern": "^([0-9a-f]{8}|server)$", "not": _NEWLINE}, "additionalProperties": values}


#: The state report a rank sends about once a second (``{"type": "report", "state": {...}}``).
#: Only these fields are kept; unknown fields are ignored (a newer client may send more).
REPORT_STATE = {
    "type": "object",
    "maxProperties": 128,
    "propertyNames": KEY,
    "properties": {
        "id": U32, "leader": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**32 - 1},
        "is_leader": BOOL, "ready": BOOL, "running": BOOL, "joining": BOOL, "final": BOOL,
        "step": U63, "start_step": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1},
        "cohort": U32, "bucket_len": U32, "batch": U32,
        "loss": NUM_OR_NULL, "first_loss": NUM_OR_NULL, "lr": NUM_OR_NULL,
        "accuracy": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "steps_per_s": NUM_OR_NULL, "samples_per_s": NUM_OR_NULL, "wire_bytes_per_s": NUM_OR_NULL,
        "model": STR_OR_NULL, "backend": STR_OR_NULL, "precision": STR_OR_NULL, "fault": STR_OR_NULL,
        "digest": STR_OR_NULL, "transport": STR_OR_NULL,
        # a tab's compute backend: why it is not the one asked for (a fallback), and the GPU adapter
        "backend_note": STR_OR_NULL, "adapter": STR_OR_NULL,
        "pid": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1},
        # the leaders a rank has followed: [leader id, wall time of its first round, step]
        "leaders": {"type": "array", "maxItems": 64,
                    "items": {"type": "array", "maxItems": 4, "items": {"type": "number", "minimum": 0}}},
        "policy": {"type": "object", "maxProperties": 16, "propertyNames": KEY,
                   "additionalProperties": {"type": ["number", "string", "boolean", "null"], "maxLength": 64}},
        # drop and event counters by reason: non-negative integers
        "drops": _map(U63, REASON), "wire_drops": _map(U63, REASON), "counters": _map(U63, REASON),
        "gaps": _map(NUM), "links": _links_map(STR), "link_bytes": _map(U63),
        "kind": {"enum": ["native", "tab"]},
        # per peer: chunk bytes on its own channel (rtc, tcp) and through the relay
        "pair_bytes": _ranks_map({"type": "object", "maxProperties": 4, "propertyNames": KEY,
                                  "additionalProperties": U63}),
        # lineage, majority and shares (docs/PROTOCOL.md, "Lineage and terms", "Shares")
        "term": U63, "members": U32, "majority": BOOL, "diverged": U63, "rejoins": U63,
        "global_batch": {"type": ["integer", "null"], "minimum": 1, "maximum": 2**32 - 1},
        "samples_assigned": U63, "epoch": NUM_OR_NULL,
        "shares": _ranks_map(U32), "speeds": _ranks_map(NUM), "lateness_ms": _ranks_map(NUM), "held_ms": _ranks_map(NUM), "flaps": _ranks_map(U63),
        "applied": _ranks_map(U63),
        "probation": {"type": "array", "maxItems": 4096, "items": RANK_HEX},
        # untrusted ranks (docs/PROTOCOL.md, "Untrusted ranks"): the rank's role, the leader's
        # aggregation rule, buckets clipped by rank, quarantined ranks (seconds left), silent ranks
        "may_lead": BOOL, "aggregate": STR_OR_NULL, "clipped": _ranks_map(U63),
        # local steps and the outer optimizer (docs/PROTOCOL.md, "Local steps and optimizer state")
        "local_steps": U32, "outer_optimizer": STR_OR_NULL,
        "quarantined": _ranks_map(NUM), "silent": {"type": "array", "maxItems": 4096, "items": RANK_HEX},
        # a tab's page inbox: wake-ups, items, pauses while behind the round rate
        "page_inbox": _map(U63),
        # gaps between rounds a rank received: count, median, the largest [gap ms, wall time]
        "round_gaps": {"type": "object", "maxProperties": 4, "properties": {
            "n": U63, "p50_ms": NUM_OR_NULL,
            "largest": {"type": "array", "maxItems": 16,
                        "items": {"type": "array", "maxItems": 2, "items": {"type": "number", "minimum": 0}}}}},
    },
}

CONTROL_SCHEMAS: dict[str, dict] = {
    "report": {"type": "object", "required": ["state"], "properties": {"state": REPORT_STATE}},
    "backlog": {"type": "object", "required": ["bytes"], "properties": {"bytes": U63}},
    "relay_peers": {"type": "object", "required": ["ids"],
                    "properties": {"ids": {"type": "array", "maxItems": 4096, "items": U32}}},
    "signal": {"type": "object", "required": ["to", "kind"], "properties": {
        "to": U32, "kind": {"enum": ["offer", "answer", "candidate", "bye", "backlog", "direct"]},
        "sdp": {"type": "string", "maxLength": 16384}, "bytes": U63,
        "addr": {"type": "string", "maxLength": 64}, "key": {"type": "string", "maxLength": 64},
        "candidate": {"type": "object", "maxProperties": 8, "propertyNames": KEY,
                      "additionalProperties": {"type": ["string", "integer", "null"], "maxLength": 1024}}}},
}

#: The first message on a rank's socket (docs/PROTOCOL.md, "Server controls"): the room token,
#: the trainer credential (with it the server lets the rank lead: "Roles"), a resume.
REGISTER = {"type": "object", "required": ["type"], "properties": {
    "type": {"const": "register"}, "version": {"type": "integer", "minimum": 0, "maximum": 65535},
    "token": {"type": ["string", "null"], "maxLength": 256},
    "trainer_token": {"type": ["string", "null"], "maxLength": 256},
    "resume": {"type": "object", "required": ["id", "secret"],
               "properties": {"id": U32, "secret": {"type": "string", "maxLength": 256}}}}}

#: What the server sends a rank (documentation and the server's own tests; ranks validate what
#: they read field by field): ``welcome`` and ``peer`` carry the roles the server bound.
SERVER_CONTROL_SCHEMAS: dict[str, dict] = {
    "welcome": {"type": "object", "required": ["type", "id", "secret", "peers", "may_lead", "lead_peers"],
                "properties": {"id": U32, "secret": STR, "room": STR, "topology": {"enum": ["star", "mesh"]},
                               "resumed": BOOL, "stopped": BOOL, "may_lead": BOOL,
                               "peers": {"type": "array", "items": U32}, "lead_peers": {"type": "array", "items": U32},
                               "checkpoint": {"type": ["object", "null"], "properties": {
                                   "id": STR, "step": U63, "accuracy": NUM_OR_NULL}},
                               "high_water_bytes": U63, "max_message_bytes": U63}},
    "peer": {"type": "object", "required": ["type", "id", "up", "may_lead"],
             "properties": {"id": U32, "up": BOOL, "may_lead": BOOL}},
    "pressure": {"type": "object", "required": ["type", "p"], "properties": {"p": {"type": "number", "minimum": 0}}},
    "stop": {"type": "object", "required": ["type", "reason"], "properties": {"reason": STR_OR_NULL}},
    "lr": {"type": "object", "required": ["type", "lr"],
           "properties": {"lr": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e6}}},
}


def _finite(instance: Any) -> bool:
    """Whether a JSON number is finite as a double: ``json.loads`` turns a literal too large for
    one (``1e999``) into an infinity, and keeps an integer literal of up to 4300 digits exact,
    one no double holds (the room's ``float`` of it overflows)."""
    return math.isfinite(instance) if isinstance(instance, float) else -_FLOAT_MAX <= instance <= _FLOAT_MAX


_FLOAT_MAX = int(sys.float_info.max)
_BASE_TYPES = Draft202012Validator.TYPE_CHECKER
#: Draft 2020-12 whose "number" and "integer" are finite as doubles (:func:`_finite`): a field
#: holding anything else has the wrong type like any other (``bad_report.<field>``), never a
#: value the room keeps. (Both: the range keywords skip what is not a "number".)
_Validator = validators.extend(Draft202012Validator, type_checker=_BASE_TYPES.redefine_many({
    "number": lambda _c, x: _BASE_TYPES.is_type(x, "number") and _finite(x),
    "integer": lambda _c, x: _BASE_TYPES.is_type(x, "integer") and _finite(x)}))


# ---------------------------------------------------------------------------- compiled checks
# The controls a rank sends are checked by closures compiled once from the schemas above, not by
# ``jsonschema``'s generic walk: that walk cost ~13 us per entry of a per-rank map, and one 61 KB
# report (1,400 ``pair_bytes`` entries) held the event loop 54 ms, a 53 KB one (4,096 ``shares``)
# 261 ms; 40 sockets sending one a second stalled the server and its honest ranks gave up.
# Each schema compiles to a predicate (valid or not: C-level ``all(map(...))`` over a map's
# keys and values, a type-exact fast path for the usual ints, floats and strings) and, for an
# invalid control only, a walk that finds the path of the first error: the same keywords in the
# same order as ``jsonschema``, so the drop reason is the one it gave
# (tests/unit/test_schema_compiled.py compares them). A keyword with no compiled check fails at
# import, never passes unchecked.

_Pred = Callable[[Any], bool]
_Check = Callable[[Any], "tuple | None"]
#: keywords whose subschemas put a key or an index on the error path
_NESTING_KEYWORDS = ("properties", "additionalProperties", "items")


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and _finite(x)


def _is_int(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return -_FLOAT_MAX <= x <= _FLOAT_MAX
    return isinstance(x, float) and x.is_integer()   # (an infinity or NaN is not an integer)


_TYPE_TESTS: dict[str, _Pred] = {
    "null": lambda x: x is None, "boolean": lambda x: isinstance(x, bool),
    "string": lambda x: isinstance(x, str), "object": lambda x: isinstance(x, dict),
    "array": lambda x: isinstance(x, list), "number": _is_num, "integer": _is_int}


def _type_pred(types: str | list) -> _Pred:
    if isinstance(types, str):
        return _TYPE_TESTS[types]
    tests = tuple(_TYPE_TESTS[t] for t in types)
    return lambda x: any(t(x) for t in tests)


def _json_equal(a: Any, b: Any) -> bool:
    """``jsonschema``'s equality for ``enum`` and ``const`` over the scalars they hold here (a
    bool is never equal to a number)."""
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _key_pred(schema: dict) -> _Pred:
    """A ``propertyNames`` schema as one predicate: length, the precompiled pattern's
    ``search`` (as ``jsonschema``'s), no line break. (A key that is not a string passes all
    three, as in ``jsonschema``; only ``"type": "string"`` refuses it.)"""
    if (not set(schema) <= {"pattern", "maxLength", "not", "type"} or schema.get("not", _NEWLINE) != _NEWLINE
            or schema.get("type", "string") != "string"):
        return _pred(schema)
    m = schema.get("maxLength", math.inf)
    search = re.compile(schema.get("pattern", "")).search
    typed, no_nl = "type" in schema, "not" in schema

    def ok(k: Any) -> bool:
        if k.__class__ is not str and not isinstance(k, str):
            return not typed
        return len(k) <= m and search(k) is not None and not (no_nl and "\n" in k)
    return ok


def _leaf_test(k: str, v: Any, schema: dict) -> _Pred:
    """One keyword that fails at the instance itself (no error path) as a predicate."""
    if k == "type":
        return _type_pred(v)
    if k == "minimum":
        return lambda x: not _is_num(x) or x >= v
    if k == "maximum":
        return lambda x: not _is_num(x) or x <= v
    if k == "exclusiveMinimum":
        return lambda x: not _is_num(x) or x > v
    if k == "maxLength":
        return lambda x: not isinstance(x, str) or len(x) <= v
    if k == "pattern":
        search = re.compile(v).search
        return lambda x: not isinstance(x, str) or search(x) is not None
    if k == "maxProperties":
        return lambda x: not isinstance(x, dict) or len(x) <= v
    if k == "maxItems":
        return lambda x: not isinstance(x, list) or len(x) <= v
    if k == "required":
        req = tuple(v)
        return lambda x: not isinstance(x, dict) or all(r in x for r in req)
    if k == "enum":
        vals = tuple(v)
        return lambda x: any(_json_equal(e, x) for e in vals)
    if k == "const":
        return lambda x: _json_equal(v, x)
    if k == "not":
        p = _pred(v)
        return lambda x: not p(x)
    if k == "propertyNames":
        kp = _key_pred(v)
        return lambda x: not isinstance(x, dict) or all(map(kp, x))
    if k == "properties":
        subs = {name: _pred(sub) for name, sub in v.items()}

        def props(x: Any) -> bool:
            if isinstance(x, dict):
                for name, val in x.items():
                    p = subs.get(name)
                    if p is not None and not p(val):
                        return False
            return True
        return props
    if k == "additionalProperties":
        if not isinstance(v, dict):
            raise ValueError("additionalProperties: only a schema has a compiled check")
        sub, known = _pred(v), frozenset(schema.get("properties", ()))
        if not known:
            return lambda x: not isinstance(x, dict) or all(map(sub, x.values()))
        return lambda x: not isinstance(x, dict) or all(sub(val) for name, val in x.items() if name not in known)
    if k == "items":
        if not isinstance(v, dict):
            raise ValueError("items: only a schema has a compiled check")
        sub = _pred(v)
        return lambda x: not isinstance(x, list) or all(map(sub, x))
    raise ValueError(f"schema keyword {k!r} has no compiled check")


def _all(tests: list[_Pred]) -> _Pred:
    n = len(tests)
    if n == 0:
        return lambda x: True
    if n == 1:
        return tests[0]
    if n == 2:
        a, b = tests
        return lambda x: a(x) and b(x)
    if n == 3:
        a, b, c = tests
        return lambda x: a(x) and b(x) and c(x)
    if n == 4:
        a, b, c, d = tests
        return lambda x: a(x) and b(x) and c(x) and d(x)
    ts = tuple(tests)
    return lambda x: all(t(x) for t in ts)


def _pred(schema: dict) -> _Pred:
    """Whether an instance is valid against ``schema``. The usual leaves (an int in a range, a
    finite float, a bounded string) take a type-exact fast path first; anything else (a float
    that is an integer, ``None`` where it may be, a wrong type) is decided by the keywords."""
    slow = _all([_leaf_test(k, v, schema) for k, v in schema.items()])
    t, keys = schema.get("type"), set(schema)
    types = {t} if isinstance(t, str) else set(t or ())
    if "integer" in types and keys <= {"type", "minimum", "maximum"}:
        lo, hi = schema.get("minimum", -_FLOAT_MAX), schema.get("maximum", _FLOAT_MAX)
        lo, hi = max(lo, -_FLOAT_MAX), min(hi, _FLOAT_MAX)
        return lambda x: (x.__class__ is int and lo <= x <= hi) or slow(x)
    if "number" in types and keys <= {"type", "minimum", "maximum"}:
        lo, hi = schema.get("minimum", -math.inf), schema.get("maximum", math.inf)
        isfinite = math.isfinite
        return lambda x: (x.__class__ is float and isfinite(x) and lo <= x <= hi) or slow(x)
    if types == {"string"} and keys <= {"type", "maxLength"}:
        m = schema.get("maxLength", math.inf)
        return lambda x: (x.__class__ is str and len(x) <= m) or slow(x)
    return slow


def _compile(schema: dict) -> _Check:
    """``schema`` as a check: ``None`` when an instance is valid, else the path (keys and list
    indexes) of its first error, the error ``jsonschema``'s ``iter_errors`` yields first. The
    predicate decides; the walk runs only for an invalid instance."""
    ok = _pred(schema)
    if not any(k in schema for k in _NESTING_KEYWORDS):
        return lambda x: None if ok(x) else ()
    # the walk: keywords in schema order, as jsonschema applies them
    walk: list[tuple[str, Any]] = []
    for k, v in schema.items():
        if k == "properties":
            walk.append((k, {name: _compile(sub) for name, sub in v.items()}))
        elif k in ("additionalProperties", "items"):
            walk.append((k, _compile(v)))
        else:
            walk.append((k, _leaf_test(k, v, schema)))
    known = frozenset(schema.get("properties", ()))

    def first_error(x: Any) -> tuple | None:
        for k, f in walk:
            if k == "properties":
                if isinstance(x, dict):
                    for name, sub in f.items():
                        if name in x and (e := sub(x[name])) is not None:
                            return (name, *e)
            elif k == "additionalProperties":
                if isinstance(x, dict):
                    # (jsonschema visits the extras in set order: any one of them can be the
                    # first error, and each gives the same reason, the field the map is)
                    for name, val in x.items():
                        if name not in known and (e := f(val)) is not None:
                            return (name, *e)
            elif k == "items":
                if isinstance(x, list):
                    for i, val in enumerate(x):
                        if (e := f(val)) is not None:
                            return (i, *e)
            elif not f(x):
                return ()
        return ()    # (the predicate said invalid: never reached while the two agree)

    return lambda x: None if ok(x) else first_error(x)


_REGISTER = _Validator(REGISTER)
#: the compiled checks of the controls a rank sends (``CONTROL_SCHEMAS``)
_CHECKS = {t: _compile(sch) for t, sch in CONTROL_SCHEMAS.items()}
_SERVER_VALIDATORS = {t: _Validator(s) for t, s in SERVER_CONTROL_SCHEMAS.items()}
_VALIDATORS = {t: _Validator(s) for t, s in CONTROL_SCHEMAS.items()}
for _v in _VALIDATORS.values():
    Draft202012Validator.check_schema(_v.schema)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def too_deep(text: str, max_depth: int = MAX_DEPTH) -> bool:
    """Whether ``text`` nests deeper than ``max_depth`` (``parse_json``'s ``too_deep``), without
    parsing it: a count of brackets, then the C-speed scan (0.3 ms for 61 KB)."""
    return text.count("[") + text.count("{") > max_depth and not within_depth(text, max_depth)


def parse_json(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> tuple[Any, str | None]:
    """Parse untrusted JSON: ``(obj, None)`` or ``(None, reason)``; never raises.

    Reasons: ``too_deep`` (nesting beyond ``max_depth``), ``bad_json`` (not JSON, or NaN /
    Infinity, or an integer of more than 4300 digits).
    """
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            return None, "bad_json"
    # cheap pre-check: a deep document is refused before the (recursive) parser sees it
    if too_deep(text, max_depth):
        return None, "too_deep"
    try:
        return json.loads(text, parse_constant=_reject_constant), None
    except (ValueError, RecursionError):
        return None, "bad_json"


#: The report fields keyed or listed by rank id (``%08x``): one entry per member at most, and a
#: room has at most ``max_ranks_per_room`` (``links``: those plus the server's path).
RANK_FIELDS = tuple(name for name, sch in REPORT_STATE["properties"].items()
                    if sch.get("propertyNames") is RANK_HEX or sch.get("items") is RANK_HEX) + ("links",)


def over_members(obj: dict, max_ranks: int) -> str | None:
    """The drop reason when a control lists more ranks than a room of ``max_ranks`` holds:
    ``bad_report.<field>`` for a per-rank map or list of a report (``links``: one more, the
    server's path), ``bad_relay_peers`` for its ``ids``; ``None`` otherwise. Counts only (no
    entry is read): checked before the schema, so a report's work is bounded by the room's size
    and not only by the 64 KiB control limit (~5,000 ids)."""
    t = obj.get("type")
    if t == "report":
        st = obj.get("state")
        if isinstance(st, dict):
            for f in RANK_FIELDS:
                v = st.get(f)
                if isinstance(v, (dict, list)) and len(v) > max_ranks + (f == "links"):
                    return f"bad_report.{f}"
    elif t == "relay_peers":
        ids = obj.get("ids")
        if isinstance(ids, list) and len(ids) > max_ranks:
            return "bad_relay_peers"
    return None


def check_control(obj: Any, *, max_ranks: int | None = None) -> str | None:
    """The drop reason for a parsed control message, or ``None`` when it is valid.

    Reasons: ``bad_control`` (not an object, or an unknown ``type``), ``bad_<type>`` or
    ``bad_report.<field>`` (a field of the wrong type, out of range or too long; with
    ``max_ranks``, a per-rank map or list longer than a room of that many ranks holds:
    :func:`over_members`).
    """
    if not isinstance(obj, dict):
        return "bad_control"
    t = obj.get("type")
    check = _CHECKS.get(t) if isinstance(t, str) else None
    if check is None:
        return "bad_control"
    if max_ranks is not None and (why := over_members(obj, max_ranks)) is not None:
        return why
    err = check(obj)
    if err is None:
        return None
    path = [p for p in err if isinstance(p, str)]
    if t == "report" and len(path) >= 2:
        return f"bad_report.{path[1]}"
    return f"bad_{t}"


def check_register(obj: Any) -> str | None:
    """``None`` when ``obj`` is a valid ``register`` (``REGISTER``), else ``bad_register``."""
    return None if _REGISTER.is_valid(obj) else "bad_register"


def check_server_control(obj: Any) -> str | None:
    """The first schema error of a control the server sends (``SERVER_CONTROL_SCHEMAS``), or None."""
    v = _SERVER_VALIDATORS.get(obj.get("type")) if isinstance(obj, dict) else None
    if v is None:
        return "unknown server control"
    err = next(iter(v.iter_errors(obj)), None)
    return None if err is None else err.message


def parse_control(text: str | bytes, *, max_depth: int = MAX_DEPTH,
                  max_ranks: int | None = None) -> tuple[dict | None, str | None]:
    """:func:`parse_json` then :func:`check_control`: ``(obj, None)`` or ``(None, reason)``."""
    obj, why = parse_json(text, max_depth=max_depth)
    if why is None:
        why = check_control(obj, max_ranks=max_ranks)
    return (obj, None) if why is None else (None, why)
