"""``tabcohort serve``: run the app until SIGINT/SIGTERM, printing the URL it listens on."""

from __future__ import annotations

import asyncio
import signal
from typing import Callable

from .config import ServerConfig


async def start_site(app, host: str, port: int):
    """Run ``app`` on ``host:port`` with the server's connection bounds: aiohttp's
    ``keepalive_timeout`` set to ``limits.header_timeout_s`` (a connection that has not sent a
    complete request head by then is closed: slowloris), and at most
    ``limits.max_connections_per_address`` open connections per client address
    (:class:`~.guard.ConnectionGuard`).

    Returns:
        ``(runner, site, port)``, the port actually bound.
    """
    from aiohttp import web

    from .app import CONFIG, REFUSED
    from .guard import ConnectionGuard

    limits = app[CONFIG].limits
    runner = web.AppRunner(app, handle_signals=False, keepalive_timeout=limits.header_timeout_s)
    await runner.setup()
    ConnectionGuard(limits.max_connections_per_address, app[REFUSED]).install(runner.server)
    site = web.TCPSite(runner, host, port)
    await site.start()
    actual = port
    for addr in runner.addresses:
        if isinstance(addr, (tuple, list)) and len(addr) >= 2:
            actual = addr[1]
            break
    return runner, site, actual


async def serve_async(config: ServerConfig, *, host: str, port: int,
                      progress: Callable[[str], None] = print, advertise: bool = False,
                      advertise_interfaces: list[str] | None = None) -> None:
    from .app import OPERATOR_TOKEN, ROOMS, create_app

    app = create_app(config)  # ConfigError before listening
    runner, site, actual = await start_site(app, host, port)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{actual}"
    for name, job in config.rooms.items():
        progress(f"tabcohort serve: {url}  room {name} (dataset {job.dataset}, {job.topology})")
        progress(f"  join: tabcohort rank --server {url} --room {name}"
                 f"{' --token ...' if job.token else ''}")
        room = app[ROOMS].get(name)
        if room is not None and room.stopped:
            progress(f"  room {name} is already finished ({room.stop_reason}): ranks that join are told "
                     f"to stop; raise --steps or use a fresh --checkpoint-dir to train on")
        progress(f"  operate: {url}/operator?room={name}#operator=" + app[OPERATOR_TOKEN])
    if config.operator_token is None:
        progress("operator token (generated; set --operator-token or TABCOHORT_OPERATOR_TOKEN to keep one): "
                 + app[OPERATOR_TOKEN])
    adv = None
    if advertise:
        from tabcohort import __version__
        from tabcohort.discovery import Advertiser, local_ipv4_addresses
        addrs = local_ipv4_addresses(host)
        ifaces = advertise_interfaces
        if ifaces is None and addrs and all(a.startswith("127.") for a in addrs):
            ifaces = addrs  # a loopback server is only reachable (and announced) on loopback
        adv = Advertiser(port=actual, rooms=list(config.rooms), addresses=addrs, path="/",
                         version=__version__, interfaces=ifaces)
        await adv.start()
        progress(f"advertising {adv.info.name} on {', '.join(ifaces) if ifaces else 'all interfaces'} "
                 f"(addresses {', '.join(addrs)}; rooms {', '.join(config.rooms)})")
    progress(f"URL {url}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover
            pass
    try:
        await stop.wait()
    finally:
        progress("tabcohort serve: shutting down")
        if adv is not None:
            await adv.stop()
        await runner.cleanup()  # on_shutdown closes sockets with GOING_AWAY


def _check_listen(host: str, port: int, checkpoint_dir: str | None) -> None:
    """Raise ConfigError (naming the option) for a host that resolves to nothing, a port that
    cannot be bound, or a checkpoint directory that cannot be written, before serving."""
    import os
    import socket

    from tabcohort.errors import ConfigError

    if checkpoint_dir:
        try:
            os.makedirs(checkpoint_dir, exist_ok=True)
            probe = os.path.join(checkpoint_dir, ".write-test")
            with open(probe, "wb"):
                pass
            os.remove(probe)
        except OSError as exc:
            raise ConfigError("--checkpoint-dir", checkpoint_dir, f"not a writable directory ({exc.strerror})") from None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError("--host", host, f"resolves to no address ({exc.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise ConfigError("--port", port, f"cannot listen on {host}:{port} ({exc.strerror})") from None


def serve(config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8080,
          progress: Callable[[str], None] = print, advertise: bool = False,
          advertise_interfaces: list[str] | None = None) -> int:
    config.validate()
    _check_listen(host, port, config.checkpoint_dir)
    asyncio.run(serve_async(config, host=host, port=port, progress=progress, advertise=advertise,
                            advertise_interfaces=advertise_interfaces))
    return 0
