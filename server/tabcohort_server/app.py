"""The aiohttp application: ``create_app(config) -> web.Application``.

Endpoints (room-scoped ones need the room token, if the room has one, or the operator token,
as ``?token=`` or ``Authorization: Bearer``):

- ``GET /healthz``, ``GET /metrics`` (Prometheus; a token room's series only with its token or
  the operator token), ``GET /api/rooms``
- ``GET /api/rooms/{room}``: the room, ``trusted_id`` (the rank whose reports it trusts) and its
  ranks' last state reports (JSON); with the operator token every report whole, the ranks' pids
  and the kept checkpoints; without it the trusted rank's report and a few scalars of the others'
  (``rooms.PUBLIC_REPORT_FIELDS``)
- ``GET /api/rooms/{room}/job``: the job (JSON), with ``bucket_len``, ``state_len`` and ``job_hash``;
  with ``X-Tabcohort-Trainer-Token``, a wrong trainer credential is a 403 (a native rank checks it
  there, before any download)
- ``GET /api/rooms/{room}/job/code``, ``.../job/data``: the job's code bundle (zip) and
  data (``.npz``), with ``X-Tabcohort-Sha256`` (the built-in job's too: it is a job like any other)
- ``GET /api/rooms/{room}/history``: the room's curves since it started (``history.RoomHistory``)
- ``GET /api/rooms/{room}/ws``: the star relay (see ``tabcohort.bus.star`` for the wire)
- ``GET /api/rooms/{room}/checkpoint``: the newest checkpoint's float32 LE
  parameters, then the leader's optimizer state (``state_len`` values; none for a stateless
  optimizer: docs/PROTOCOL.md "Local steps and optimizer state"); 404 if none
- ``GET /api/rooms/{room}/model``: the same as a model export, ``.npz`` with ``params.npy`` (the parameters only) and
  ``job.json`` (:func:`get_model`)
- ``PUT /api/rooms/{room}/checkpoint``: upload by the room's current leader (its id and secret;
  ``Room.may_upload``), a step above the newest stored one, finite, of the job's bucket length
  plus state length (the server reads the state's bit patterns only, never its values)
- ``GET /api/rooms/{room}/checkpoints``: the kept checkpoints (newest first; the operator token)
- ``GET /api/rooms/{room}/checkpoints/{id}``: one of them (float32 LE; the operator token)
- ``POST /api/rooms/{room}/stop``: stop the room now (the **operator token** only: the room
  token lets one join, not operate)
- ``POST /api/rooms/{room}/lr`` (JSON ``{"lr": x}``, ``0 < x <= min(1e6, lr_max)``, the room's
  ``lr_max``: serve ``--lr-max``, 10 by default): the room's learning rate
  from now on (the operator token only): an ``lr`` control to every rank; its leader applies it
  and its rounds carry it to the followers

Browser requests that change state (any method but GET/HEAD/OPTIONS) and WebSocket upgrades
must come from the server's own origin or one in ``ServerConfig.allowed_origins``; failed token
checks are limited per address (README "Limits").
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import secrets
import time
import weakref
from collections import Counter
from typing import Any, AsyncIterator

from aiohttp import WSCloseCode, WSMsgType, web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tabcohort.errors import ConfigError

from . import checkpoint as ckpt
from .config import ServerConfig, new_token, same_secret
from .guard import AuthLimiter, origin_allowed
from .metrics import RoomCollector
from .rooms import (CLOSE_BAD_REGISTER, CLOSE_BAD_TOKEN, CLOSE_RATE_LIMITED, CLOSE_RETRY_LATER, RANK_RECONNECT_MAX_S,
                    Peer, Room, RoomError, RoomRegistry)
from .assets import RoomAssets, npy_header
from .schema import check_register, parse_json

log = logging.getLogger("tabcohort.server")


CONFIG = web.AppKey("config", ServerConfig)
ROOMS = web.AppKey("rooms", RoomRegistry)
ASSETS = web.AppKey("assets", dict)
SOCKETS = web.AppKey("sockets", weakref.WeakSet)
RTC = web.AppKey("rtc", object)
#: the operator's token (``ServerConfig.operator_token`` or generated at start)
OPERATOR_TOKEN = web.AppKey("operator_token", str)
#: the trainer credential (``ServerConfig.trainer_token``, the state directory's, or generated)
TRAINER_TOKEN = web.AppKey("trainer_token", str)
#: server-wide refusals by reason (origin, auth, connections per address)
REFUSED = web.AppKey("refused", Counter)
AUTH = web.AppKey("auth", AuthLimiter)


def create_app(config: ServerConfig | None = None) -> web.Application:
    """Build the server application.

    Raises:
        ConfigError: a bad room or limit (before anything listens).
    """
    config = config or ServerConfig()
    config.validate()
    limits = config.limits
    # bodies are small JSON everywhere but the checkpoint upload, which streams (put_checkpoint)
    app = web.Application(client_max_size=1 << 20, middlewares=[_encoding_middleware, _origin_middleware])
    app[CONFIG] = config
    app[OPERATOR_TOKEN] = config.operator_token or new_token()
    app[TRAINER_TOKEN] = config.trainer_token or _trainer_token(config.checkpoint_dir)
    app[REFUSED] = Counter()
    app[AUTH] = AuthLimiter(limits.max_auth_failures, limits.auth_window_s)
    rooms = app[ROOMS] = RoomRegistry(config.rooms, limits, seed=config.seed,
                                      any_rank_may_lead=config.any_rank_may_lead)
    assets: dict[str, RoomAssets] = {}
    for name, room in rooms.rooms.items():
        a = assets[name] = RoomAssets(room)
        if a.checkpoint_bytes > limits.max_checkpoint_bytes:   # its checkpoints could never be stored
            raise ConfigError(f"{name}.job", room.job.job or "built-in", f"its parameters and optimizer state are "
                              f"{a.checkpoint_bytes:,} bytes; a checkpoint is at most "
                              f"{limits.max_checkpoint_bytes:,} (max_checkpoint_bytes)")
        load_room_checkpoint(room, a, config.checkpoint_dir, keep=config.checkpoint_keep)
        room.loss_ceiling = a.loss_ceiling
    app[ASSETS] = assets
    # a resume key already in the directory re-seats the ranks of the server that ran before
    returning = bool(config.checkpoint_dir) and os.path.exists(os.path.join(config.checkpoint_dir, ".resume-key"))
    key = _secret_key(config.checkpoint_dir)
    for room in rooms.rooms.values():
        room.secret_key = key
        if returning and _ranks_may_return(config.checkpoint_dir, room.name):
            room.expect_returning_ranks(room.clock())
    from .rtc_relay import RtcTerminator
    rtc = app[RTC] = RtcTerminator(config.rtc_ice_servers, config.rtc_host_addresses)
    for room in rooms.rooms.values():
        if room.job.topology == "star":
            rtc.attach(room)
    app[SOCKETS] = weakref.WeakSet()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/api/rooms", list_rooms)
    app.router.add_get("/api/rooms/{room}", room_state)
    app.router.add_get("/api/rooms/{room}/job", room_job)
    app.router.add_get("/api/rooms/{room}/job/code", room_job_code)
    app.router.add_get("/api/rooms/{room}/job/data", room_job_data)
    app.router.add_get("/api/rooms/{room}/history", room_history)
    app.router.add_get("/api/rooms/{room}/ws", room_ws)
    app.router.add_get("/api/rooms/{room}/checkpoint", get_checkpoint)
    app.router.add_get("/api/rooms/{room}/model", get_model)
    app.router.add_put("/api/rooms/{room}/checkpoint", put_checkpoint)
    app.router.add_post("/api/rooms/{room}/checkpoint", put_checkpoint)
    app.router.add_get("/api/rooms/{room}/checkpoints", list_checkpoints)
    app.router.add_get("/api/rooms/{room}/checkpoints/{id}", get_checkpoint_by_id)
    app.router.add_post("/api/rooms/{room}/stop", stop_room)
    app.router.add_post("/api/rooms/{room}/lr", set_room_lr)
    from .static import setup_static
    setup_static(app)  # the page, Pyodide, the client wheel (static.py)
    app.cleanup_ctx.append(_ticker)
    app.on_shutdown.append(_close_sockets)
    app.on_cleanup.append(_close_rtc)
    if config.cluster is not None:   # one of several nodes (README "Cluster"); else nothing changes
        from . import cluster_web
        cluster_web.install(app, config.cluster)
    return app


def _trainer_token(directory: str | None) -> str:
    """The trainer credential when none is configured: read from the state directory
    (``DIR/.trainer-token``, mode 0600) or generated (and written there, so a restarted server
    and the operator's scripts use the same one); tabs never carry it."""
    import os
    from .config import check_token
    if directory:
        path = os.path.join(directory, ".trainer-token")
        try:
            with open(path, "rb") as f:
                tok = f.read().decode("utf-8", "replace").strip()
        except FileNotFoundError:
            pass
        else:
            # (one an operator wrote must be one a rank accepts, or no rank could ever lead; it
            # was served as given, or silently replaced when short)
            check_token(path, tok)
            return tok
    tok = new_token()
    if directory:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(tok + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    return tok


def load_room_checkpoint(room: Room, assets: RoomAssets, directory: str | None, *, keep: int = 5) -> bool:
    """(Re)read ``room``'s checkpoint history from ``directory`` (:class:`.checkpoint.CheckpointStore`:
    only files of this job, of its parameter count and finite) and resume from the newest valid
    one, unless what the room holds is newer; a room whose checkpoint reached ``steps`` is
    stopped. Called at start, and by a cluster node when it acquires the room (the directory is
    shared by the nodes).

    Returns:
        True if a checkpoint was loaded.
    """
    def fits(meta: dict, data: bytes, a: RoomAssets = assets) -> bool:   # this job's, and finite
        return (meta.get("n") == a.bucket_len and meta.get("job_hash") == a.job_hash
                and len(data) == a.checkpoint_bytes and ckpt.non_finite_f32(data)[0] == 0)
    room.store = ckpt.CheckpointStore(directory, room.name, keep=keep, accept=fits)
    got = room.store.latest()
    if got is None:
        return False
    if room.checkpoint is not None and int(got[0].get("step") or 0) < int(room.checkpoint.get("step") or 0):
        return False      # what this node holds is newer
    room.checkpoint, assets.checkpoint_data = got
    step = int(room.checkpoint.get("step") or 0)
    room.resumed_from_step = step
    room.resumed_from = {"id": got[0]["id"], "step": step, "accuracy": got[0].get("accuracy")}
    # the ranks trained on from that checkpoint while no server held the room (native ranks over
    # their direct paths, up to their reconnect bound), and it was up to one interval old: a
    # baseline taken now refused the honest leader's first reports (``report_step_jump``) and
    # checkpoints (``step_implausible``) after most restarts (a fault campaign: 7 of 10 SIGTERM
    # restarts at 4,000 steps/s). Credit the checkpoint's age, at most an interval and that bound.
    t = got[0].get("time")
    age = time.time() - t if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) else 0.0
    credit = min(max(0.0, age), float(room.job.checkpoint_interval_s) + RANK_RECONNECT_MAX_S)
    room.trust_step(step, time.monotonic() - credit)
    if room.job.steps and step >= room.job.steps and not room.stopped:  # already done: do not train on
        room.stop(f"steps {room.job.steps} reached (checkpoint at step {step})")
    return True


def _secret_key(directory: str | None) -> bytes:
    """The key of the ranks' resume secrets: kept in the checkpoint directory (mode 0600) so a
    server restarted on it re-seats ranks that resume with their ids; random otherwise.

    Raises:
        ConfigError: ``.resume-key`` there is shorter than 32 bytes (damaged or edited)."""
    import os
    import secrets
    if not directory:
        return secrets.token_bytes(32)
    path = os.path.join(directory, ".resume-key")
    try:
        with open(path, "rb") as f:
            key = f.read()
        if len(key) >= 32:
            return key
    except FileNotFoundError:
        pass
    os.makedirs(directory, exist_ok=True)
    key = secrets.token_bytes(32)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    try:   # link, not replace: on a directory shared by cluster nodes the first key wins
        os.link(tmp, path)
    except FileExistsError:
        with open(path, "rb") as f:
            key = f.read()
        if len(key) < 32:   # (a damaged or edited file: a 3-byte one was the HMAC key, unsaid)
            raise ConfigError("--checkpoint-dir", directory,
                              f"{path} holds {len(key)} bytes, not a resume key (32 or more random bytes): "
                              f"damaged or edited; delete it (ranks of the previous run then join as new ranks)")
    except OSError:   # a file system without hard links: the last writer wins, as before
        os.replace(tmp, path)
        return key
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return key


async def _close_rtc(app: web.Application) -> None:
    await app[RTC].aclose()


async def _ticker(app: web.Application) -> AsyncIterator[None]:
    """Background, once a second: release expired ids, check duration stop conditions, and
    sample each room's leader report into its history."""
    async def run() -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                now = time.monotonic()
                app[ROOMS].tick(now)
                sample_history(app, now)
            except Exception:  # pragma: no cover - keep ticking, but say so
                log.exception("room tick failed")
    task = asyncio.create_task(run())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def sample_history(app: web.Application, now_s: float) -> None:
    """Add each room's leader report (step, loss, accuracy) to its history (the operator view's
    curves since the room started); called once a second by the ticker. After its leader left,
    the last report the room trusted: a run's final step, reported just before its ranks left,
    was never in its history (the curves ended up to a second short of it)."""
    for name, room in app[ROOMS].rooms.items():
        lead = room.last_trusted_report()
        if lead is not None:
            app[ASSETS][name].history.add(now_s, lead.get("step"), lead.get("loss"), lead.get("accuracy"))


def _shutdown_roll_path(directory: str, room: str) -> str:
    import os
    return os.path.join(directory, f".connected-at-shutdown-{room}.json")


def _ranks_may_return(directory: str, room: str) -> bool:
    """Whether ranks of the server that ran on ``directory`` before may come back to ``room``:
    unknown (True) unless it stopped gracefully and recorded that no rank was connected then
    (:func:`_close_sockets`); the record is read once. Why: a cohort killed before its server
    was stopped has no rank to come back, and the roll call's partial window made the fresh
    ranks of a restart wait 30 s before one could bootstrap (PROTOCOL.md "Joining")."""
    import os
    path = _shutdown_roll_path(directory, room)
    try:
        with open(path, encoding="utf-8") as f:
            ids = json.load(f).get("ids")
    except (OSError, ValueError, AttributeError):
        return True
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return not (isinstance(ids, list) and not ids)


async def _close_sockets(app: web.Application) -> None:
    """Graceful shutdown: record which ranks were connected to each room (a server restarted on
    the checkpoint directory knows whether any may come back: :func:`_ranks_may_return`), then
    close every open WebSocket with GOING_AWAY (bounded)."""
    config = app[CONFIG]
    directory = config.checkpoint_dir
    if directory and config.cluster is None:   # (a cluster's nodes share the directory)
        for room in app[ROOMS].rooms.values():
            path = _shutdown_roll_path(directory, room.name)
            try:
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump({"ids": sorted(room.connected)}, f)
                os.replace(tmp, path)
            except OSError as e:
                log.warning("room %s: could not record the ranks connected at shutdown: %s", room.name, e)
    socks = list(app[SOCKETS])
    t = app[CONFIG].limits.close_timeout_s

    async def close(ws: web.WebSocketResponse) -> None:
        try:
            await asyncio.wait_for(ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown"), t)
        except (asyncio.TimeoutError, ConnectionError):
            pass
    await asyncio.gather(*(close(ws) for ws in socks), return_exceptions=True)


# ---------------------------------------------------------------------- helpers
def _room(request: web.Request) -> Room:
    room = request.app[ROOMS].get(request.match_info["room"])
    if room is None:
        raise web.HTTPNotFound(text=json.dumps({"error": "no such room"}), content_type="application/json")
    return room


_same = same_secret


def _token_ok(room: Room, given: str | None, operator: str | None = None) -> bool:
    """The room token (any token for an open room), or the operator token."""
    want = room.job.token
    return want is None or _same(want, given) or (operator is not None and _same(operator, given))


def _bearer_token(request: web.Request) -> str | None:
    """The token of an ``Authorization: Bearer`` header, or None."""
    auth = request.headers.get("Authorization", "")
    return auth[7:] if auth[:7].lower() == "bearer " else None   # (case-insensitive: RFC 7235, 2.1)


def _request_token(request: web.Request) -> str | None:
    bearer = _bearer_token(request)
    return bearer if bearer is not None else request.query.get("token")


def _is_operator(request: web.Request) -> bool:
    """The request carries the operator token in ``Authorization: Bearer`` (never a ``?token=``:
    a URL lands in logs and browser history, and the token stops a room and sets its learning
    rate; the operator page sends the header)."""
    return _same(request.app[OPERATOR_TOKEN], _bearer_token(request))


def _refuse_auth(request: web.Request, what: str) -> web.HTTPException:
    """Count a failed token check against the client's address; the error to raise."""
    request.app[AUTH].fail(request.remote, time.monotonic())
    request.app[REFUSED]["auth_failed"] += 1
    return web.HTTPForbidden(text=json.dumps({"error": f"bad or missing {what}"}),
                             content_type="application/json")


def _check_auth_rate(request: web.Request) -> None:
    """429 while the client's address is over its failed-auth budget (README "Limits")."""
    lim, now = request.app[AUTH], time.monotonic()
    if lim.blocked(request.remote, now):
        request.app[REFUSED]["auth_rate_limited"] += 1
        raise web.HTTPTooManyRequests(
            text=json.dumps({"error": "too many failed token checks from this address"}),
            content_type="application/json",
            headers={"Retry-After": str(max(1, math.ceil(lim.retry_after_s(request.remote, now))))})


def _authorized_room(request: web.Request) -> Room:
    room = _room(request)
    if room.job.token is None:
        return room
    _check_auth_rate(request)
    if not _token_ok(room, _request_token(request), request.app[OPERATOR_TOKEN]):
        raise _refuse_auth(request, "room token")
    return room


def _operator_room(request: web.Request) -> Room:
    room = _room(request)
    _check_auth_rate(request)
    if not _is_operator(request):
        raise _refuse_auth(request, "operator token (printed by tabcohort serve at start)")
    return room


_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


@web.middleware
async def _encoding_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Refuse (415, counted in ``refused`` as ``content_encoding``) a request whose body is
    compressed: no client of ours compresses one, and aiohttp would inflate it as it is read (a
    body that says gzip and is not answered 500 with a traceback where a handler read it)."""
    enc = request.headers.get("Content-Encoding", "").strip().lower()
    if enc and enc != "identity":
        request.app[REFUSED]["content_encoding"] += 1
        raise web.HTTPUnsupportedMediaType(
            text=json.dumps({"error": f"request bodies are not compressed here (Content-Encoding: {enc[:40]})"}),
            content_type="application/json")
    return await handler(request)


@web.middleware
async def _origin_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Refuse (403) a browser's state-changing request or WebSocket upgrade from a foreign
    origin (no CORS is offered, so foreign pages cannot read anything either)."""
    changes = request.method not in _SAFE_METHODS or request.headers.get("Upgrade", "").lower() == "websocket"
    if changes and not origin_allowed(request.headers.get("Origin"), request.host,
                                      request.app[CONFIG].allowed_origins):
        request.app[REFUSED]["origin"] += 1
        raise web.HTTPForbidden(text=json.dumps({"error": "origin not allowed (see --allow-origin)"}),
                                content_type="application/json")
    return await handler(request)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(obj, allow_nan=False, default=_nan_none), status=status,
                        content_type="application/json")


def _nan_none(o: Any) -> Any:  # pragma: no cover - json only calls this for unknown types
    return None


def _clean(o: Any) -> Any:
    """Replace non-finite floats by None so the JSON is standard."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


# ---------------------------------------------------------------------- HTTP
async def healthz(request: web.Request) -> web.Response:
    return _json({"ok": True, "rooms": len(request.app[ROOMS].rooms)})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text: server-wide series, and each room's series when the room is open or
    the request carries its token or the operator token. A token that opens nothing is a failed
    token check like any other (README "Limits": failed checks per address): which rooms'
    series came back answered each guess, and /metrics was a token oracle without a limit."""
    given = _request_token(request)
    op = request.app[OPERATOR_TOKEN]
    rooms = request.app[ROOMS]
    if given is not None:
        _check_auth_rate(request)
    visible = {n for n, r in rooms.rooms.items() if _token_ok(r, given, op)}
    if given is not None and not _same(op, given) and not any(
            r.job.token is not None and _same(r.job.token, given) for r in rooms.rooms.values()):
        request.app[AUTH].fail(request.remote, time.monotonic())
        request.app[REFUSED]["auth_failed"] += 1
    reg = CollectorRegistry()
    reg.register(RoomCollector(rooms, visible=visible, refused=request.app[REFUSED]))
    from .cluster_web import CLUSTER
    if CLUSTER in request.app:
        reg.register(request.app[CLUSTER].collector())
    body = generate_latest(reg)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def list_rooms(request: web.Request) -> web.Response:
    from .cluster_web import CLUSTER, list_rooms as cluster_rooms
    if CLUSTER in request.app:   # every room of the cluster, with its owner
        return await cluster_rooms(request)
    rooms = request.app[ROOMS].rooms
    return _json({"rooms": [{"room": r.name, "stopped": r.stopped, "token": r.job.token is not None,
                             **({"n_connected": len(r.connected)} if r.job.token is None else {})}
                            for r in rooms.values()]})


async def room_state(request: web.Request) -> web.Response:
    """The room's summary; the operator's (all reports, checkpoints) for the operator token.

    An open room takes any room token, so there a ``?token=`` is ignored (a tab's link may carry
    one) and only ``Authorization`` claims the operator's view: a wrong one is a 403 and a
    failed token check (README "Limits"). Answered 200, a guess of the operator token told
    itself apart by the answer, without a limit; counted but answered 200, a stale operator page
    polling every second locked its whole address out of every token check."""
    room = _authorized_room(request)
    if room.job.token is not None:
        operator = _is_operator(request)
    else:
        operator = False
        if "Authorization" in request.headers:
            _check_auth_rate(request)
            operator = _same(request.app[OPERATOR_TOKEN], _bearer_token(request))
            if not operator:
                raise _refuse_auth(request, "operator token (an open room needs no other)")
    out = room.summary(time.monotonic(), operator=operator)
    if operator and room.job.token is not None:
        # the operator view's "Join this room" link: the operate: link `serve` prints carries
        # no room token, and a tab opened from a join link without it is refused
        out["join_token"] = room.job.token
    return _json(_clean(out))


#: the header a native rank sends its trainer credential in with its first request (``GET .../job``)
TRAINER_TOKEN_HEADER = "X-Tabcohort-Trainer-Token"


async def room_job(request: web.Request) -> web.Response:
    """The room's job (JSON). With :data:`TRAINER_TOKEN_HEADER`, the trainer credential is
    checked too: a wrong one is a 403 (``bad trainer token``) before the rank downloads the job's
    code, data and checkpoint, where it was refused only at its register, after all of them."""
    room = _authorized_room(request)
    given = request.headers.get(TRAINER_TOKEN_HEADER)
    if given is not None:
        _check_auth_rate(request)    # (an open room checks no room token: this is a token check)
    if given is not None and not _same(request.app[TRAINER_TOKEN], given):
        room.drop("bad_trainer_token")
        raise _refuse_auth(request, "trainer token")
    return web.Response(body=request.app[ASSETS][room.name].job_json, content_type="application/json")


async def room_job_code(request: web.Request) -> web.Response:
    """The job's code bundle (``tabcohort.jobs.source_bundle``: a zip)."""
    return await _job_blob(request, "job_code", "application/zip", "job.zip")


async def room_job_data(request: web.Request) -> web.Response:
    """The job's data (``.npz``, ``tabcohort.jobs.arrays``)."""
    return await _job_blob(request, "job_data", "application/octet-stream", "data.npz")


async def _job_blob(request: web.Request, attr: str, ctype: str, filename: str) -> web.StreamResponse:
    room = _authorized_room(request)
    a = request.app[ASSETS][room.name]
    return await _send(request, getattr(a, attr), content_type=ctype, headers={
        "X-Tabcohort-Sha256": a.job_sha256[attr], "Cache-Control": "no-cache",
        "Content-Disposition": f'attachment; filename="{room.name}-{filename}"'})


async def room_history(request: web.Request) -> web.Response:
    room = _authorized_room(request)
    return _json(request.app[ASSETS][room.name].history.to_json())


async def stop_room(request: web.Request) -> web.Response:
    room = _operator_room(request)
    room.stop("stopped by the operator")
    return _json({"stopped": True})


#: bounds of a learning rate the operator sets (JobConfig.lr's)
MAX_LR = 1e6


async def set_room_lr(request: web.Request) -> web.Response:
    """Set the room's learning rate (the operator token only; README "Trust model"): broadcast an
    ``lr`` control; the leader applies it (``RankMachine.set_lr``) and its rounds carry it."""
    room = _operator_room(request)
    if room.stopped:     # (it answered 200, and no rank was left to apply it)
        return _json({"error": f"the room has stopped ({room.stop_reason}); its learning rate no longer "
                               "applies"}, status=409)
    # (the bytes: a body that is not UTF-8, or names an unknown charset, is a bad body, not a 500)
    try:
        raw = await request.read()
    except (ConnectionError, asyncio.IncompleteReadError):   # the operator's client went away
        room.drop("bad_lr")
        return _json({"error": "the connection closed mid-body"}, status=400)
    body, why = parse_json(raw)
    if not isinstance(body, dict):   # (it said "lr must be a number" for a body of `garbage`)
        room.drop("bad_lr")
        what = {"bad_json": "it is not JSON", "too_deep": "it is nested too deep"}.get(
            why or "", f"it is a JSON {type(body).__name__}")
        return _json({"error": f'the body must be a JSON object {{"lr": x}} ({what})'}, status=400)
    extra = sorted(str(k)[:40] for k in body)
    extra = [k for k in extra if k != "lr"]
    if extra:          # (a typo such as {"lr": 0.1, "momentum": 0.9} must not pass as applied)
        room.drop("bad_lr")
        return _json({"error": f"unknown field(s) {', '.join(map(repr, extra[:8]))}: the body is "
                               '{"lr": x}'}, status=400)
    lr = body.get("lr") if isinstance(body, dict) else None
    # above the room's lr_max every follower drops the leader's rounds (PROTOCOL.md "Untrusted
    # ranks"): this answered 200 and the learning rate silently stayed as it was
    top = min(MAX_LR, room.job.lr_max)
    # (an int of 400 digits, which JSON allows, is no float: math.isfinite of it raised, a 500)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or (isinstance(lr, int) and not 0 < lr <= top) \
            or not math.isfinite(lr) or not 0 < lr <= top:
        room.drop("bad_lr")
        return _json({"error": f"lr must be a number in (0, {top:g}] (the room's lr_max: serve --lr-max)"},
                     status=400)
    room.job.lr = room.operator_lr = float(lr)
    room.broadcast_control({"type": "lr", "lr": float(lr)})
    return _json({"lr": float(lr)})


async def get_checkpoint(request: web.Request) -> web.Response:
    """The newest checkpoint's parameters (float32 LE), with its id, step and digest."""
    room = _authorized_room(request)
    data = request.app[ASSETS][room.name].checkpoint_data
    meta = room.checkpoint
    if data is None or meta is None:
        return _json({"error": "no checkpoint yet"}, status=404)
    return await _checkpoint_response(request, room, meta, data)


async def get_model(request: web.Request) -> web.Response:
    """The newest checkpoint as a model export (README "Export and evaluate"): an ``.npz`` with
    ``params.npy`` (float32, shape ``(bucket_len,)``: the stored bytes behind an ``.npy`` header,
    never decoded here) and ``job.json`` (the job as ``GET .../job`` gives it, plus ``checkpoint``:
    step, digest, accuracy). 404 if there is no checkpoint yet."""
    import io
    import zipfile

    room = _authorized_room(request)
    a: RoomAssets = request.app[ASSETS][room.name]
    data, meta = a.checkpoint_data, room.checkpoint
    if data is None or meta is None:
        return _json({"error": "no checkpoint yet"}, status=404)
    # built once per checkpoint and shared by every request for it (each built its own copy,
    # twice: 250 requests for a 4.5 MB model held 1.4 GiB, an adversarial trial)
    key = (meta.get("id"), meta.get("step"), meta.get("digest"), meta.get("final"))
    if a.model_export is None or a.model_export[0] != key:
        job = json.loads(a.job_json)
        job["checkpoint"] = {k: meta.get(k) for k in ("id", "step", "digest", "accuracy", "final")}
        buf = io.BytesIO()
        date = (1980, 1, 1, 0, 0, 0)
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
            params = data[:4 * a.bucket_len]          # the optimizer state after them stays out
            z.writestr(zipfile.ZipInfo("params.npy", date), npy_header("<f4", (a.bucket_len,)) + params)
            z.writestr(zipfile.ZipInfo("job.json", date), json.dumps(_clean(job), indent=1).encode())
        a.model_export = (key, buf.getvalue())
    return await _send(request, a.model_export[1], content_type="application/octet-stream", headers={
        "X-Tabcohort-Step": str(meta["step"]), "X-Tabcohort-Digest": meta["digest"],
        "Content-Disposition": f'attachment; filename="{room.name}-step{meta["step"]}.npz"'})


#: large bodies (checkpoints, model exports, job code and data) are written in chunks of this
#: many bytes, each after the last has drained
SEND_CHUNK_BYTES = 256 * 1024


async def _send(request: web.Request, body: bytes, *, content_type: str,
                headers: dict[str, str]) -> web.StreamResponse:
    """``body`` written in chunks of :data:`SEND_CHUNK_BYTES`, each once the last has drained, so
    a client that does not read holds at most a chunk of the server's memory. Why: a
    ``web.Response`` hands the whole body to the transport, which copies what the socket does
    not take at once: 250 requests for a 4.5 MB model export that were never read held 1.4 GiB
    and stalled the loop for 10 s (an adversarial trial), and a job's data can be 100 MB."""
    if request.method == "HEAD" or len(body) <= SEND_CHUNK_BYTES:
        return web.Response(body=body, content_type=content_type, headers=headers)
    resp = web.StreamResponse(headers=headers)
    resp.content_type = content_type
    resp.content_length = len(body)
    await resp.prepare(request)
    view = memoryview(body)
    try:
        for i in range(0, len(body), SEND_CHUNK_BYTES):
            await resp.write(view[i:i + SEND_CHUNK_BYTES])      # (drains: over aiohttp's 64 KiB)
        await resp.write_eof()
    except ConnectionError:
        # the client went away mid-body: nothing to answer, and no traceback (aiohttp logged
        # one per dropped download once the write moved into the handler); counted as a client
        # that left is (gone_before_handshake)
        request.app[REFUSED]["download_abandoned"] += 1
    return resp


async def _checkpoint_response(request: web.Request, room: Room, meta: dict, data: bytes) -> web.StreamResponse:
    term = meta.get("term")   # its leader's term: a rank starting from it starts terms above it
    return await _send(request, data, content_type="application/octet-stream", headers={
        "X-Tabcohort-Step": str(meta["step"]), "X-Tabcohort-Digest": meta["digest"],
        "X-Tabcohort-Checkpoint": str(meta.get("id", "")),
        "X-Tabcohort-Term": str(term if isinstance(term, int) and not isinstance(term, bool) and term >= 0 else 0),
        **({"X-Tabcohort-Cursor": str(meta["cursor"])} if isinstance(meta.get("cursor"), int) else {}),
        "Content-Disposition": f'attachment; filename="{room.name}-step{meta["step"]}.f32"'})


async def list_checkpoints(request: web.Request) -> web.Response:
    """The room's kept checkpoints, newest first (``CheckpointStore.list``; the operator token)."""
    room = _operator_room(request)
    best = room.store.best_meta()
    return _json(_clean({"room": room.name, "keep": room.store.keep,
                         "best": None if best is None else best["id"], "checkpoints": room.store.list()}))


async def get_checkpoint_by_id(request: web.Request) -> web.Response:
    """One kept checkpoint's parameters (float32 LE) by id (the operator token); 404 if none."""
    room = _operator_room(request)
    cid = request.match_info["id"]
    got = room.store.get(cid) if ckpt.ID_RE.match(cid) else None
    if got is None:
        return _json({"error": "no such checkpoint (GET .../checkpoints lists them)"}, status=404)
    return await _checkpoint_response(request, room, *got)


#: a checkpoint body must make progress: at least CHECKPOINT_BODY_PROGRESS_BYTES (or the rest of
#: it) in every CHECKPOINT_BODY_WINDOW_S seconds (a slow uplink is fine; a stalled one is cut)
CHECKPOINT_BODY_WINDOW_S = 10.0
CHECKPOINT_BODY_PROGRESS_BYTES = 64 << 10
_DECIMAL = re.compile(r"[0-9]{1,19}")


def _refuse_upload(room: Room, reason: str, exc: type[web.HTTPException], text: str) -> web.HTTPException:
    """Count a refused checkpoint upload (``checkpoint_<reason>`` in the room's drops)."""
    room.drop(f"checkpoint_{reason}")
    return exc(text=text)


async def put_checkpoint(request: web.Request) -> web.Response:
    """Store the room's leader's parameters (float32 LE) with step and digest; atomic on disk.

    Accepted only from the room's current leader (``Room.may_upload``: a rank that may lead and
    reports that it leads), with a step ``0 <= step < 2**63`` above the newest stored one (an
    upload of the newest step and digest with ``X-Tabcohort-Final`` only marks it final),
    exactly ``4 x (bucket_len + state_len)`` bytes (the parameters, then the optimizer state), every value finite, and the digest it names. Each refusal is
    counted in the room's drops (``checkpoint_*``) and /metrics.
    """
    room = _authorized_room(request)
    a: RoomAssets = request.app[ASSETS][room.name]
    h = request.headers
    rank_s, step_s = h.get("X-Tabcohort-Rank", ""), h.get("X-Tabcohort-Step", "")
    if not (_DECIMAL.fullmatch(rank_s) and _DECIMAL.fullmatch(step_s)):
        # (int() took " 12 ", "1_1", "+13" and other scripts' digits)
        raise _refuse_upload(room, "bad_step", web.HTTPBadRequest,
                             "X-Tabcohort-Rank and X-Tabcohort-Step must be decimal integers (ASCII digits)")
    rank, step = int(rank_s), int(step_s)
    if not 0 <= step < 1 << 63:
        raise _refuse_upload(room, "bad_step", web.HTTPBadRequest,
                             f"X-Tabcohort-Step must be in [0, 2**63), got {step}")
    peer = room.peers.get(rank)
    if peer is None or not _same(peer.secret, h.get("X-Tabcohort-Secret", "")):
        room.drop("checkpoint_bad_rank")
        raise _refuse_auth(request, "rank id and secret (only a registered rank may upload)")
    if not room.may_upload(peer):
        raise _refuse_upload(room, "not_leader", web.HTTPForbidden,
                             "only the room's current leader (a rank that may lead and reports that it "
                             "leads) may store a checkpoint")
    if not room.plausible_step(step, time.monotonic()):
        raise _refuse_upload(room, "step_implausible", web.HTTPConflict,
                             f"step {step} is far ahead of the room's step {room.step()}")
    job = h.get("X-Tabcohort-Job")
    if job is not None and job != a.job_hash:
        # a rank still on the job this server ran before a restart with another one
        raise _refuse_upload(room, "other_job", web.HTTPConflict,
                             f"the checkpoint is of job {job[:64]}; the room trains job {a.job_hash}")
    final = h.get("X-Tabcohort-Final") == "1"
    newest = room.store.latest_meta()
    if newest is not None and step < newest["step"]:
        raise _refuse_upload(room, "stale", web.HTTPConflict,
                             f"step {step} does not follow the stored checkpoint's {newest['step']}")
    want = a.checkpoint_bytes
    limit = min(want, request.app[CONFIG].limits.max_checkpoint_bytes)
    if request.content_length is not None and request.content_length != want:
        # checked before one byte of the body is read
        room.drop("checkpoint_bad_length")
        text = f"expected {want} bytes (bucket_len + state_len float32), Content-Length is {request.content_length}"
        if request.content_length > want:
            raise web.HTTPRequestEntityTooLarge(limit, request.content_length, text=text)
        raise web.HTTPBadRequest(text=text)
    if a.upload_lock.locked():
        raise _refuse_upload(room, "busy", web.HTTPConflict, "another checkpoint upload of this room is in progress")
    async with a.upload_lock:
        buf = bytearray()
        sha = hashlib.sha256()
        # the body must make progress (a stalled uploader held the room's upload lock, and
        # every later leader's upload got 409, until the kernel dropped the dead connection)
        window_s, loop_time = CHECKPOINT_BODY_WINDOW_S, asyncio.get_running_loop().time
        try:
            async with asyncio.timeout(window_s) as deadline:
                in_window = 0
                async for part in request.content.iter_chunked(1 << 16):   # streamed, capped at the size
                    if len(buf) + len(part) > limit:
                        room.drop("checkpoint_bad_length")
                        raise web.HTTPRequestEntityTooLarge(
                            limit, len(buf) + len(part), text=f"expected {want} bytes (bucket_len + state_len float32)")
                    buf += part
                    sha.update(part)
                    in_window += len(part)
                    if in_window >= CHECKPOINT_BODY_PROGRESS_BYTES:
                        in_window = 0
                        deadline.reschedule(loop_time() + window_s)
        except TimeoutError:
            raise _refuse_upload(room, "body_timeout", web.HTTPRequestTimeout,
                                 f"the body stalled: less than {CHECKPOINT_BODY_PROGRESS_BYTES >> 10} KiB in "
                                 f"{window_s:g} s") from None
        except (ConnectionError, asyncio.IncompleteReadError):
            # the uploader went away mid-body (a full traceback at ERROR per request before)
            raise _refuse_upload(room, "body_lost", web.HTTPBadRequest, "the connection closed mid-body") from None
        except asyncio.CancelledError:
            room.drop("checkpoint_body_lost")   # (aiohttp cancels the handler of a lost connection)
            raise
        data = bytes(buf)
        del buf
        if len(data) != want:
            raise _refuse_upload(room, "bad_length", web.HTTPBadRequest,
                                 f"expected {want} bytes (bucket_len + state_len float32), got {len(data)}")
        n_bad, first_bad = ckpt.non_finite_f32(data)
        if n_bad:  # a diverged model is never stored or served (README, "Checkpoints")
            raise _refuse_upload(room, "non_finite", web.HTTPUnprocessableEntity,
                                 f"refused: {n_bad} of {a.bucket_len + a.state_len} parameters and state values are not finite "
                                 f"(NaN or inf, first at index {first_bad}); training diverged; nothing was stored")
        digest = sha.hexdigest()
        if digest != h.get("X-Tabcohort-Digest"):
            raise _refuse_upload(room, "bad_digest", web.HTTPBadRequest, f"digest mismatch: content is {digest}")
        loop = asyncio.get_running_loop()
        newest = room.store.latest_meta()         # (again: an upload may have landed meanwhile)
        if newest is not None and step <= newest["step"]:
            if step == newest["step"] and digest == newest["digest"]:
                if final and not newest.get("final"):  # the same model, now the run's final one
                    m = await loop.run_in_executor(None, room.store.mark_final, newest["id"])
                    room.checkpoint = m
                    room.stored_final(m)
                elif final and room.stopped:
                    # the same model a leader that left stored as final, now the stopped room's
                    # (a takeover and a stop before any new round): serve still says it, once
                    room.stored_final(newest)
                return _json({"stored": False, "reason": "already stored", "id": newest["id"],
                              "step": step})
            raise _refuse_upload(room, "stale", web.HTTPConflict,
                                 f"step {step} does not follow the stored checkpoint's {newest['step']}")
        try:
            loss = float(h.get("X-Tabcohort-Loss", "nan"))
        except ValueError:
            loss = math.nan
        # the leader's own held-out evaluation: the server never decodes parameters
        # (docs/INTERFACES.md); absent or out of [0, 1]: stored without an accuracy
        accuracy = _header_fraction(h.get("X-Tabcohort-Accuracy"))
        if h.get("X-Tabcohort-Accuracy") is not None and accuracy is None:
            room.drop("bad_accuracy_header")
        rep = peer.report or {}
        term = rep.get("term")
        cursor = h.get("X-Tabcohort-Cursor", "")
        meta = {"step": step, "digest": digest, "n": a.bucket_len, "job_hash": a.job_hash, "rank": rank,
                "term": term if isinstance(term, int) and not isinstance(term, bool) else None,
                # the samples assigned before the step: a resumed cohort goes on from there
                # (PROTOCOL.md, "Leader: driving one round"); an unreadable one is not stored
                "cursor": int(cursor) if _DECIMAL.fullmatch(cursor) and int(cursor) < 1 << 63 else None,
                "loss": loss if math.isfinite(loss) else None, "final": final,
                "time": time.time(), "accuracy": accuracy}
        meta = await loop.run_in_executor(None, room.store.add, meta, data)
    room.checkpoint, a.checkpoint_data = meta, data
    if final:
        room.stored_final(meta)
    return _json({"stored": True, "id": meta["id"], "step": step, "accuracy": meta["accuracy"]})


def _header_fraction(v: str | None) -> float | None:
    """A header's number in [0, 1] (an accuracy), or None: absent, not a number, out of range."""
    if v is None or len(v) > 32:
        return None
    try:
        x = float(v)
    except ValueError:
        return None
    return x if math.isfinite(x) and 0.0 <= x <= 1.0 else None


def _json_num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


# ---------------------------------------------------------------------- WebSocket relay
async def _moved_while_registering(request: web.Request, ws: web.WebSocketResponse, room: Room) -> bool:
    """A cluster node that lost the room while this socket waited for its register (a lease
    handover) sends it on as the middleware does at connect (4012 with the owner's URL, 1013
    while none owns it); True when it did. A register sent late was seated at a node that no
    longer owned the room, in a copy of it no other rank reached (a hostile trial)."""
    from .cluster import CLOSE_MOVED, CLOSE_TRY_AGAIN
    from .cluster_web import CLUSTER

    node = request.app[CLUSTER] if CLUSTER in request.app else None
    if node is None or node.owns(room.name):
        return False
    room.drop("register_moved")
    url = await node.lookup_owner(room.name)
    if url is None or url.rstrip("/") == node.config.advertise_url.rstrip("/"):
        await ws.close(code=CLOSE_TRY_AGAIN, message=b"no node owns the room right now; retry")
    else:
        await ws.close(code=CLOSE_MOVED, message=url.encode()[:120])
    return True


async def room_ws(request: web.Request) -> web.StreamResponse:
    """The star relay for one rank: register (first text message), then chunks and controls."""
    room = _room(request)
    limits = request.app[CONFIG].limits
    # compress=False: a browser offers permessage-deflate (RFC 7692) on every WebSocket and
    # aiohttp accepts it by default; then each chunk to and from a tab would go through zlib at
    # both ends. Chunks are float vectors (deflate barely shrinks them) and short controls, so
    # it would only spend the relay's and the tab's CPU.
    ws = web.WebSocketResponse(heartbeat=limits.heartbeat_s, max_msg_size=limits.max_ws_message_bytes,
                               compress=False)
    try:
        await ws.prepare(request)
    except ConnectionError:
        # the client left before the handshake's answer (a rank that gave up on a loaded server):
        # counted, not a traceback per rank in the log (aiohttp ends the request quietly)
        request.app[REFUSED]["gone_before_handshake"] += 1
        return web.Response(status=400)   # (its write fails too, quietly: an unprepared socket raised)
    request.app[SOCKETS].add(ws)
    auth = request.app[AUTH]
    if room.job.token is not None and auth.blocked(request.remote, time.monotonic()):
        request.app[REFUSED]["auth_rate_limited"] += 1
        await ws.close(code=CLOSE_RATE_LIMITED, message=b"too many failed token checks from this address")
        return ws
    try:
        first = await asyncio.wait_for(ws.receive(), limits.register_timeout_s)
    except asyncio.TimeoutError:
        await ws.close(code=CLOSE_BAD_REGISTER, message=b"register timeout")
        return ws
    reg = None
    if first.type == WSMsgType.TEXT and len(first.data) <= limits.max_control_bytes:
        reg, _why = parse_json(first.data)   # (a bad register is counted below)
    if not isinstance(reg, dict) or reg.get("type") != "register" or check_register(reg) is not None:
        room.drop("bad_register")
        await ws.close(code=CLOSE_BAD_REGISTER, message=b"first message must be a register")
        return ws
    if await _moved_while_registering(request, ws, room):
        return ws
    if not _token_ok(room, reg.get("token") or request.query.get("token")):
        room.drop("bad_token")
        auth.fail(request.remote, time.monotonic())
        request.app[REFUSED]["auth_failed"] += 1
        await ws.close(code=CLOSE_BAD_TOKEN, message=b"bad or missing room token")
        return ws
    given = reg.get("trainer_token")
    if given is not None and room.job.token is None and auth.blocked(request.remote, time.monotonic()):
        # a trainer token is a token check in an open room too (a token room's was gated above)
        request.app[REFUSED]["auth_rate_limited"] += 1
        await ws.close(code=CLOSE_RATE_LIMITED, message=b"too many failed token checks from this address")
        return ws
    trainer = given is not None and _same(request.app[TRAINER_TOKEN], given)
    if given is not None and not trainer:   # a wrong credential is a configuration error: say so
        room.drop("bad_trainer_token")
        auth.fail(request.remote, time.monotonic())
        request.app[REFUSED]["auth_failed"] += 1
        await ws.close(code=CLOSE_BAD_TOKEN, message=b"bad trainer token")
        return ws
    resume = reg.get("resume")
    now = time.monotonic()
    if not request.app[ROOMS].admit(request.remote, now):  # the admission rate limits (token buckets)
        room.drop("register_deferred")
        await ws.close(code=CLOSE_RETRY_LATER, message=b"too many registrations; retry later")
        return ws
    try:
        if isinstance(resume, dict):
            rid = resume.get("id")
            if isinstance(rid, bool) or not isinstance(rid, int):
                raise RoomError(CLOSE_BAD_REGISTER, "resume.id must be an integer")
            peer = room.register(now=now, resume_id=rid, resume_secret=resume.get("secret"),
                                 address=request.remote, trainer=trainer)
        else:
            peer = room.register(now=now, address=request.remote, trainer=trainer)
    except RoomError as e:
        room.drop("register_refused")
        await ws.close(code=e.code, message=e.reason.encode()[:120])
        return ws
    await _serve_peer(request, ws, room, peer, resumed=isinstance(resume, dict))
    return ws


async def _serve_peer(request: web.Request, ws: web.WebSocketResponse, room: Room, peer: Peer,
                      *, resumed: bool) -> None:
    limits = request.app[CONFIG].limits
    wake = asyncio.Event()
    peer.wake = wake.set
    kicked: list[tuple[int, str]] = []
    tasks: list[asyncio.Task] = []

    def kick(code: int, reason: str) -> None:
        kicked.append((code, reason))
        for t in tasks:  # a blocked send must not hold the consumer's seat
            t.cancel()
    peer.kick = kick

    async def writer() -> None:
        while True:
            await wake.wait()
            wake.clear()
            while peer.queue and peer.connected:
                item = peer.pop()
                room.writing(peer, time.monotonic())   # the write-stall clock (slow consumer)
                if isinstance(item, bytes):
                    link = peer.rtc
                    # re-cut for the rank's channel (on either path: one frame, one cut)
                    for piece in (item,) if link is None else link.fit(item):
                        if link is None or not link.up or not await link.send(piece):
                            await ws.send_bytes(piece)
                        room.sent(peer, piece)   # counts what went on the wire
                else:
                    await ws.send_str(item)
                    room.sent(peer, item)

    # (with the job's hash: a rank resuming on a server restarted with another job stops)
    room.send_control(peer, {**room.welcome(peer, resumed=resumed),
                             "job_hash": request.app[ASSETS][room.name].job_hash})
    if room.stopped:  # a rank that joins a stopped room is told at once, as the others were
        room.send_control(peer, {"type": "stop", "reason": room.stop_reason})
    room.announce(peer, True)
    wtask = asyncio.create_task(writer())
    rtask = asyncio.create_task(_reader(ws, room, peer))
    tasks += (wtask, rtask)
    try:
        await asyncio.wait({wtask, rtask}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (wtask, rtask):
            t.cancel()
        res = await asyncio.gather(wtask, rtask, return_exceptions=True)
        if peer.kick is kick or not peer.connected:
            # this link still holds the seat (or nobody does): a resume that took the seat over
            # re-seated the same Peer on its new link, which this cleanup must not end
            room.disconnect(peer, time.monotonic())
            request.app[RTC].detach(peer)
        code, reason = kicked[0] if kicked else (WSCloseCode.OK, "bye")
        if not ws.closed:
            try:
                await asyncio.wait_for(ws.close(code=code, message=reason.encode()[:120]), limits.close_timeout_s)
            except (asyncio.TimeoutError, ConnectionError):
                tr = request.transport
                if tr is not None:
                    tr.abort()
        for r in res:
            if isinstance(r, Exception) and not isinstance(r, (ConnectionError, asyncio.CancelledError)):
                log.warning("relay task for %08x failed: %r", peer.id, r)


async def _reader(ws: web.WebSocketResponse, room: Room, peer: Peer) -> None:
    async for msg in ws:
        if msg.type in (WSMsgType.BINARY, WSMsgType.TEXT):
            wait_s = room.byte_wait_s(peer, len(msg.data))
            if wait_s > 0.0:
                # over its byte rate: not read meanwhile, so TCP slows the sender (Room.byte_wait_s)
                await asyncio.sleep(wait_s + 1e-4)
        if msg.type == WSMsgType.BINARY:
            room.relay(peer, msg.data)
        elif msg.type == WSMsgType.TEXT:
            room.control(peer, msg.data, now=time.monotonic())
        elif msg.type == WSMsgType.ERROR:
            room.drop("ws_error")
            return
