"""Bus conformance agent: the tab's worker runs this instead of the rank (page ``?mode=conformance``).

It lets the bus conformance battery (``tests/conformance``) drive real browser buses
(:func:`~tabcohort.bus.page.page_star_bus`, :func:`~tabcohort.bus.page.page_mesh_bus`)
living in this worker, through the page's own sockets and peer connections (``web/app.js``).
The native side is ``tests/browser/page_harness.py``: each harness call becomes one request.

Requests arrive as page messages ``{k: "conf", text}`` (``text``: JSON ``{id, op, ...}``) through
the worker's :class:`~tabcohort.bus.page.PortHub` (``on_other``); each reply goes back as
``{k: "conf-reply", text}`` (JSON ``{id, ok, result}`` or ``{id, ok: false, error}``). Values that
JSON would change (int dict keys, tuples, sets, ``array``, bytes) travel tagged (:func:`encode` /
:func:`decode`); floats are exact (JSON float text is the shortest round-trip form).

Ops: ``ping``; ``make`` (``kind``: ``star`` | ``rtc-star`` | ``mesh``, ``url``, ``n``, bus keyword args):
``n`` connected buses, returned when every live bus sees all others (and ``others``, ids of
buses in other pages) (mesh: every pair on an
open data channel), bounded; ``call`` (``h``: bus handle, ``m``: method, ``a``: args): one bus
method; ``snap``: what the harness needs to decide the network is quiet; ``take``: the
messages each bus received since the last ``take`` (held here, delivered by the harness's
``settle``); ``paths``: mesh bytes by path; ``reset``: close every bus.
"""

from __future__ import annotations

import asyncio
import json
import traceback
from array import array
from typing import Any

#: Bus methods the harness may call (``call`` op).
METHODS = {"post", "bytes", "total_bytes", "pressure", "queued_bytes", "drops", "quantize", "close",
           "stall", "transport_bytes", "paths"}
#: Bus attributes the harness may read (``call`` op, no args).
ATTRS = {"peers", "closed", "precision"}
MAKE_TIMEOUT_S = 30.0


def encode(v: Any) -> Any:
    """A JSON-able form of ``v`` that :func:`decode` turns back into an equal value, bit for bit."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict):
        if all(isinstance(k, str) for k in v) and "__t" not in v:
            return {k: encode(x) for k, x in v.items()}
        return {"__t": "dict", "v": [[encode(k), encode(x)] for k, x in v.items()]}
    if isinstance(v, list):
        return [encode(x) for x in v]
    if isinstance(v, tuple):
        return {"__t": "tuple", "v": [encode(x) for x in v]}
    if isinstance(v, (set, frozenset)):
        return {"__t": "set", "v": [encode(x) for x in sorted(v)]}
    if isinstance(v, array):
        return {"__t": "array", "tc": v.typecode, "v": v.tolist()}
    if isinstance(v, (bytes, bytearray)):
        return {"__t": "bytes", "v": bytes(v).hex()}
    if hasattr(v, "tolist") and hasattr(v, "dtype"):  # numpy (natively, or a tab with numpy)
        return {"__t": "array", "tc": "f" if str(v.dtype) == "float32" else "d", "v": v.tolist()}
    raise TypeError(f"cannot encode {type(v).__name__}")


def decode(v: Any) -> Any:
    if isinstance(v, list):
        return [decode(x) for x in v]
    if isinstance(v, dict):
        t = v.get("__t")
        if t is None:
            return {k: decode(x) for k, x in v.items()}
        if t == "dict":
            return {decode(k): decode(x) for k, x in v["v"]}
        if t == "tuple":
            return tuple(decode(x) for x in v["v"])
        if t == "set":
            return {decode(x) for x in v["v"]}
        if t == "array":
            return array(v["tc"], v["v"])
        if t == "bytes":
            return bytes.fromhex(v["v"])
        raise ValueError(f"unknown tag {t!r}")
    return v


def dumps(v: Any) -> str:
    return json.dumps(encode(v), separators=(",", ":"))


def loads(s: str) -> Any:
    return decode(json.loads(s))


class Agent:
    """The buses of one worker, and the messages they received (see the module docstring)."""

    def __init__(self, hub: Any, reply: Any) -> None:
        self.hub = hub
        self.reply = reply
        self.buses: dict[int, Any] = {}
        self.kinds: dict[int, str] = {}
        self.inbox: dict[int, list[dict]] = {}
        self._next = 1
        self._tasks: set[asyncio.Task] = set()

    def on_other(self, it: dict) -> None:
        if it.get("k") != "conf":
            return
        req = json.loads(it["text"])
        t = asyncio.get_running_loop().create_task(self._handle(req))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _handle(self, req: dict) -> None:
        try:
            args = decode(req.get("a", {}))
            out = {"id": req["id"], "ok": True, "result": await getattr(self, "op_" + req["op"])(**args)}
        except Exception as e:
            out = {"id": req["id"], "ok": False, "error": f"{type(e).__name__}: {e}",
                   "tb": traceback.format_exc()[-3000:]}
        self.reply(dumps(out))

    # ------------------------------------------------------------------ ops
    async def op_ping(self) -> str:
        return "pong"

    async def op_make(self, kind: str, url: str, n: int, kw: dict, others: list | None = None) -> list[dict]:
        from ..bus.page import page_mesh_bus, page_star_bus

        new = []
        for _ in range(n):
            if kind == "mesh":
                b = page_mesh_bus(self.hub, url, idle_timeout_s=None, connect_timeout_s=20.0, **kw)
            elif kind == "rtc-star":
                b = page_star_bus(self.hub, url, link="rtc", connect_timeout_s=20.0, **kw)
            else:
                b = page_star_bus(self.hub, url, **kw)
            await b.connect()
            h, self._next = self._next, self._next + 1
            self.buses[h], self.kinds[h], self.inbox[h] = b, kind, []
            b.on_message = self.inbox[h].append
            new.append({"h": h, "id": b.id})
        live = [b for b in self.buses.values() if not b.closed]
        ids = {b.id for b in live} | set(others or ())  # others: buses of other pages, in the same room
        if kind == "mesh":
            def ready() -> bool:
                return all(set(b.paths()) == ids - {b.id} and set(b.paths().values()) <= {"rtc"} for b in live)
        else:
            def ready() -> bool:
                return all(b.peers == ids - {b.id} and (kind != "rtc-star" or b.paths()[0] == "rtc") for b in live)
        loop = asyncio.get_running_loop()
        end = loop.time() + MAKE_TIMEOUT_S
        while not ready():
            if loop.time() > end:
                state = {b.id: (b.paths() if kind == "mesh" else sorted(b.peers)) for b in live}
                raise TimeoutError(f"{kind}: buses not connected to each other within {MAKE_TIMEOUT_S} s: {state}")
            await asyncio.sleep(0.005)
        if kind == "mesh":  # the chunk limit: each channel's negotiated max message size
            for d in new:
                d["max_message_bytes"] = min((p.max_message_bytes for p in self.buses[d["h"]].path_of.values()),
                                             default=0)
        return new

    async def op_call(self, h: int, m: str, a: list) -> Any:
        b = self.buses[h]
        if m in ATTRS:
            return getattr(b, m)
        if m not in METHODS:
            raise ValueError(f"no such bus method: {m}")
        out = getattr(b, m)(*a)
        if m == "bytes":
            return {p: [lb.sent, lb.received] for p, lb in out.items()}
        if m == "close":
            self.inbox[h].clear()
        return out

    async def op_snap(self) -> list[dict]:
        """Per bus: counters that move while anything is in flight, and whether it is quiet."""
        out = []
        live = {b.id: b for b in self.buses.values() if not b.closed}
        for h, b in self.buses.items():
            if b.closed:
                continue
            d: dict[str, Any] = {"h": h, "id": b.id, "inbox": len(self.inbox[h])}
            if self.kinds[h] == "mesh":
                ws = b.relay
                d["links"] = [[p, path.state.value, path.sent, path.received, path.queued_bytes,
                               None if b.channel_of.get(p) is None else b.channel_buffered(p)]
                              for p, path in sorted(b.path_of.items())]
                d["quiet"] = _mesh_quiet(b, live)
            else:
                ws = b
            d["stalled"] = b.stalled
            # chunks a stalled bus took off the wire and holds (a receiver that applies
            # back-pressure instead holds none: it stops reading)
            d["held"] = b.held_bytes()
            # the relay counts what follows the register message
            d["ws"] = [ws.n_sent, ws.n_received, ws.queued_bytes(), ws.relay_pressure, ws.stalled]
            out.append(d)
        return out

    async def op_paths(self) -> list[dict]:
        """Mesh buses: bytes by path, and relay bytes on links between open buses (should be 0)."""
        live = {b.id for b in self.buses.values() if not b.closed}
        out = []
        for h, b in self.buses.items():
            if b.closed or self.kinds[h] == "star":
                continue
            if self.kinds[h] == "rtc-star":   # the link to the server: chunk bytes by path
                out.append({"id": b.id, **b.transport_bytes(), "links": b.paths(), "relay_live": 0})
                continue
            ln = {p: path for p, path in b.path_of.items() if p in live}
            out.append({"id": b.id, **b.transport_bytes(), "links": {p: path.state.value for p, path in ln.items()},
                        "relay_live": sum(x.sent + x.received - x.direct_sent - x.direct_received for x in ln.values())})
        return out

    async def op_take(self) -> dict:
        got = {}
        for h, box in self.inbox.items():
            if box:
                got[h], box[:] = list(box), []
        return got

    async def op_reset(self) -> int:
        n = 0
        for b in self.buses.values():
            if not b.closed:
                n += 1
            await b.aclose()
        self.buses.clear()
        self.kinds.clear()
        self.inbox.clear()
        return n


def _mesh_quiet(a: Any, live: dict) -> bool:
    """As ``tests/conformance/rtc_harness.py``: every link to a live peer is a data channel with
    nothing queued or buffered, and the peer took off it every byte put on it (unless stalled)."""
    for p, path in a.path_of.items():
        b = live.get(p)
        if b is None:
            continue
        if path.state.value != "rtc":
            return False
        if b.stalled:
            continue
        if path.queued_bytes or a.channel_of.get(p) is None or a.channel_buffered(p):
            return False
        if b.path(a.id).received != path.sent:
            return False
    return True


async def run_agent() -> None:
    """Serve requests until the worker goes away (started by ``web/rank-worker.js``)."""
    import js
    from pyodide.ffi import to_js

    from ..bus.page import JsPort, PortHub

    port = JsPort()

    def reply(text: str) -> None:
        js.tcPost(to_js({"k": "conf-reply", "text": text}, dict_converter=js.Object.fromEntries))

    hub = PortHub(port)
    agent = Agent(hub, reply)
    hub.on_other = agent.on_other
    hub.start()
    port.post_json({"k": "progress", "text": "bus conformance agent ready"})
    await asyncio.Event().wait()
