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
import sys
from typing import Any, Callable

import fastjsonschema
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


# ---------------------------------------------------------------------------- fast checks
# The controls a rank sends are checked with ``fastjsonschema`` (the same schemas, compiled once
# to Python code), not ``jsonschema``'s generic walk: that walk cost ~13 us per entry of a
# per-rank map, and one 61 KB report (1,400 ``pair_bytes`` entries) held the event loop 54 ms, a
# 53 KB one (4,096 ``shares``) 261 ms; 40 sockets sending one a second stalled the server and its
# honest ranks gave up. The schemas use draft 2020-12 keywords that draft 7 has too (checked at
# import), and "number" and "integer" must be finite doubles here (:func:`_finite`), which
# fastjsonschema's types are not: its copy of each schema bounds every number to the double range
# (an integer no double holds fails it), and a document it accepts must also dump as JSON without
# NaN or infinity. ``jsonschema`` stays the reference (tests/unit/test_schema_compiled.py).

#: the keywords the schemas may use: those fastjsonschema's draft 7 gives the same meaning
_FAST_KEYWORDS = frozenset({"type", "properties", "additionalProperties", "items", "required", "enum", "const",
                            "not", "pattern", "maxLength", "maxItems", "maxProperties", "propertyNames",
                            "minimum", "maximum", "exclusiveMinimum"})
_DOUBLE_MAX = sys.float_info.max


def _bounded(schema: Any) -> Any:
    """A copy of ``schema`` for fastjsonschema: every subschema that admits numbers is bounded to
    the double range (unless it bounds them itself); a keyword outside :data:`_FAST_KEYWORDS`
    is an error at import, never a rule left unchecked."""
    if isinstance(schema, list):
        return [_bounded(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    unknown = set(schema) - _FAST_KEYWORDS
    if unknown:
        raise ValueError(f"schema keywords without a fast check: {sorted(unknown)}")
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "properties":
            out[k] = {name: _bounded(sub) for name, sub in v.items()}
        elif k in ("additionalProperties", "items", "not", "propertyNames"):
            out[k] = _bounded(v)
        else:
            out[k] = v
    types = schema.get("type", ())
    types = {types} if isinstance(types, str) else set(types)
    if types & {"number", "integer"}:
        out.setdefault("minimum", -_DOUBLE_MAX)
        out.setdefault("maximum", _DOUBLE_MAX)
    return out


def _fast(schema: dict) -> Callable[[Any], tuple | None]:
    """``schema`` as a check: ``None`` when an instance is valid, else the path of an error
    (keys and list indexes below the instance). fastjsonschema stops at its first error, which
    need not be the first that ``jsonschema`` would name: both are errors of the instance."""
    validate = fastjsonschema.compile(_bounded(schema))

    def check(x: Any) -> tuple | None:
        try:
            validate(x)
        except fastjsonschema.JsonSchemaValueException as e:
            return tuple(e.path[1:])
        try:                        # finite: no NaN, no infinity (the range bounds pass NaN)
            json.dumps(x, allow_nan=False)
        except (ValueError, TypeError, RecursionError):
            return _not_finite_at(x)
        return None
    return check


def _not_finite_at(x: Any) -> tuple:
    """The path down to the first value of ``x`` that does not dump as finite JSON (a fast check
    passed it), by dumping each member in turn."""
    path: list[Any] = []
    while isinstance(x, (dict, list)):
        items = x.items() if isinstance(x, dict) else enumerate(x)
        for k, v in items:
            try:
                json.dumps(v, allow_nan=False)
            except (ValueError, TypeError, RecursionError):
                path.append(k)
                x = v
                break
        else:
            break
    return tuple(path)


_REGISTER = _Validator(REGISTER)
#: the fast checks of the controls a rank sends (``CONTROL_SCHEMAS``)
_CHECKS = {t: _fast(sch) for t, sch in CONTROL_SCHEMAS.items()}
_SERVER_VALIDATORS = {t: _Validator(s) for t, s in SERVER_CONTROL_SCHEMAS.items()}
_VALIDATORS = {t: _Validator(s) for t, s in CONTROL_SCHEMAS.items()}
# (that every schema here is itself a valid draft 2020-12 schema is a unit test's check, not a
# cost of every server start: it took 0.1 s of the start's CPU)


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
        # a reason is a counter key shown in the room's JSON and a /metrics label: only a field the
        # schema names, never a key the rank chose (an unknown field holding 1e999 named it)
        return f"bad_report.{path[1]}" if path[1] in REPORT_STATE["properties"] else "bad_report.unknown_field"
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
