"""The aiohttp side of a cluster node (``tabcohort serve --redis``): wiring of
:class:`~.cluster.ClusterNode` into the app, and where requests for a room owned elsewhere go.

- The API and the pages (``/api/rooms/{room}...``, ``/?room=``, ``/operator?room=``) of a room
  another node owns answer **307** with ``Location`` at the owner (RFC 9110 section 15.4.8: the
  method and body are kept, so a checkpoint upload follows too).
- The rank WebSocket of such a room is accepted and closed at once with **4012** and the owner's
  base URL as the reason (a browser's WebSocket cannot follow a redirect, but it reads a close
  code); while no node owns the room (a failover in progress), **1013** "try again later".
- ``GET /api/rooms`` lists every room of the cluster with its owner.
- On acquiring a room the node loads the room's latest checkpoint from the shared
  ``--checkpoint-dir`` (:func:`~.checkpoint.load`); on losing it, its ranks are closed with 4012.
"""

from __future__ import annotations

import time
import urllib.parse
from typing import Any, AsyncIterator

from aiohttp import web

from tabcohort.errors import ConfigError

from .config import ROOM_NAME
from .cluster import CLOSE_MOVED, CLOSE_TRY_AGAIN, ClusterConfig, ClusterNode

CLUSTER = web.AppKey("cluster", ClusterNode)


def install(app: web.Application, config: ClusterConfig) -> ClusterNode:
    """Attach a cluster node to ``app`` (before it starts): the owner middleware, the Redis
    connection check at startup (a ConfigError naming ``--redis`` before anything listens) and
    the release of this node's leases at shutdown. The first tick runs in :func:`start`."""
    from .app import ASSETS, ROOMS

    rooms = app[ROOMS]

    def record(name: str) -> dict:
        r = rooms.rooms[name]
        return {"stopped": r.stopped, "token": r.job.token is not None, "n_connected": len(r.connected),
                "step": r.step(), "job_hash": app[ASSETS][name].job_hash}

    node = ClusterNode(config, {name: (lambda name=name: record(name)) for name in rooms.rooms},
                       on_acquire=lambda name, held_before: _acquire(app, name, held_before),
                       on_release=lambda name, url: _release(app, name, url),
                       load=lambda: float(sum(len(r.connected) for r in rooms.rooms.values())))
    app[CLUSTER] = node
    for name, room in rooms.rooms.items():
        # a welcome names the other nodes that can host the room: a rank whose --server is the
        # owner that dies asks them (README "Cluster")
        room.other_nodes = lambda name=name: list(node.hosts.get(name, ()))
    app.middlewares.append(_owner_middleware)
    app.cleanup_ctx.append(_lifecycle)
    return node


async def start(app: web.Application, advertise_url: str) -> ClusterNode:
    """After the site listens: set the advertised URL (if not configured) and run the first tick
    (claims rooms nobody holds), then tick in the background."""
    node = app[CLUSTER]
    if not node.config.advertise_url:
        host = urllib.parse.urlsplit(advertise_url).hostname or ""
        if host in ("0.0.0.0", "::"):
            # (the other nodes sent ranks and pages to http://0.0.0.0:PORT: a new-user trial)
            raise ConfigError("--advertise-url", None, f"needed with --host {host}: other nodes send ranks "
                              "and pages to this node's URL, and an unspecified address reaches no one")
        node.config.advertise_url = advertise_url.rstrip("/")
    await node.start()
    return node


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    node = app[CLUSTER]
    await node.connect()     # ConfigError("--redis", ...) before the site listens
    yield
    await node.aclose(release=True)


def _acquire(app: web.Application, name: str, held_before: bool = True) -> None:
    from .app import ASSETS, CONFIG, ROOMS, load_room_checkpoint

    directory = app[CONFIG].checkpoint_dir
    if directory:
        room = app[ROOMS].rooms[name]
        load_room_checkpoint(room, app[ASSETS][name], directory, keep=app[CONFIG].checkpoint_keep)
        if held_before:   # the owner's ranks move here one by one (a room no node held has none:
            # its first ranks waited out the 30 s roll call with nothing said: a new-user trial)
            room.expect_returning_ranks(room.clock())


def _release(app: web.Application, name: str, url: str | None) -> None:
    from .app import ROOMS

    room = app[ROOMS].rooms[name]
    if url:
        room.evict_all(CLOSE_MOVED, url, time.monotonic())
    else:
        room.evict_all(CLOSE_TRY_AGAIN, "no node owns the room; retry", time.monotonic())


def _room_of(request: web.Request) -> str | None:
    """The room a request is about: ``/api/rooms/{room}[/...]``, or a page's ``?room=`` (the
    node's first room when the page names none)."""
    parts = request.path.split("/")
    if len(parts) >= 4 and parts[1] == "api" and parts[2] == "rooms" and parts[3]:
        return parts[3]
    if request.path in ("/", "/operator"):
        q = request.query.get("room")
        if q:
            return q
        from .app import ROOMS
        names = list(request.app[ROOMS].rooms)
        return names[0] if names else None
    return None


def _origin(url: str | None) -> str | None:
    if not url:
        return None
    u = urllib.parse.urlsplit(url)
    return f"{u.scheme}://{u.netloc}".lower() if u.scheme in ("http", "https") and u.netloc else None


def _failed_over(dead: str | None, owner_url: str | None) -> bool:
    """The page asks to wait here because the node it came from (``?failover=ORIGIN``) stopped
    answering, and Redis still names that node (or no node) as the room's owner."""
    gone = _origin(dead)
    return gone is not None and (owner_url is None or _origin(owner_url) == gone)


async def _alive(node: ClusterNode, url: str) -> bool:
    """Whether a node at ``url``'s origin still has its heartbeat record (Redis down: assume so)."""
    live = await node.nodes()
    return live is None or any(_origin(d.get("url")) == _origin(url) for d in live
                               if isinstance(d.get("url"), str))


@web.middleware
async def _owner_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    name = _room_of(request)
    node: ClusterNode = request.app[CLUSTER]
    if name is None or node.owns(name) or not ROOM_NAME.match(name):
        return await handler(request)     # (a name no room can have never reaches Redis)
    url = await node.lookup_owner(name)
    if url is not None and url.rstrip("/") == node.config.advertise_url.rstrip("/"):
        url = None           # Redis says we own it but we do not (yet): a tick will settle it
    local = name in node.local_rooms
    if url is None and not local:
        return await handler(request)   # no such room anywhere: the handler's 404
    if request.path == "/" and _failed_over(request.query.get("failover"), url) \
            and not await _alive(node, request.query["failover"]):
        # a tab whose node died (README "Cluster"): the page, served here, waits for the room's
        # new owner instead of being sent back to the dead one (a live one gets its page back)
        return await handler(request)
    ws = request.path.endswith("/ws") and request.headers.get("Upgrade", "").lower() == "websocket"
    node.counters["redirects"] += 1
    if ws:
        sock = web.WebSocketResponse(compress=False)   # (only a close follows)
        await sock.prepare(request)
        if url is None:
            await sock.close(code=CLOSE_TRY_AGAIN, message=b"no node owns the room right now; retry")
        else:
            await sock.close(code=CLOSE_MOVED, message=url.encode()[:120])
        return sock
    if url is None:
        raise web.HTTPServiceUnavailable(text='{"error": "no node owns the room right now; retry"}',
                                         content_type="application/json", headers={"Retry-After": "1"})
    raise web.HTTPTemporaryRedirect(url.rstrip("/") + request.path_qs)


async def list_rooms(request: web.Request) -> web.Response:
    """``GET /api/rooms`` of a cluster node: every room of the cluster with its owner (node id
    and URL) and the live nodes (``nodes``: id and URL); this node's own view, marked
    ``"cluster": "unavailable"``, while Redis is down.

    A page keeps the live nodes' URLs so that it can go to another node when its own dies
    (README "Cluster", a tab's failover).
    """
    from .app import ROOMS, _json

    node: ClusterNode = request.app[CLUSTER]
    got = await node.rooms()
    if got is None:
        rooms = request.app[ROOMS].rooms
        got = [{"room": r.name, "owner": node.config.node_id if node.owns(r.name) else None,
                "owner_url": node.owner_url(r.name), "stopped": r.stopped, "token": r.job.token is not None,
                "here": True} for r in rooms.values()]
        return _json({"rooms": got, "node": node.config.node_id, "cluster": "unavailable",
                      "nodes": [{"id": node.config.node_id, "url": node.config.advertise_url}]})
    live = await node.nodes() or []
    nodes = [{"id": str(d.get("id")), "url": d["url"]} for d in live
             if isinstance(d.get("url"), str) and _origin(d["url"]) is not None]
    return _json({"rooms": got, "node": node.config.node_id, "cluster": "ok", "nodes": nodes})
