"""``tabcohort serve``: run the app until SIGINT/SIGTERM, printing the URL it listens on."""

from __future__ import annotations

import asyncio
import signal
from typing import Callable

from .config import ServerConfig


async def serve_async(config: ServerConfig, *, host: str, port: int,
                      progress: Callable[[str], None] = print, advertise: bool = False,
                      advertise_interfaces: list[str] | None = None) -> None:
    from aiohttp import web

    from .app import create_app

    app = create_app(config)  # ConfigError before listening
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    actual = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else port
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{actual}"
    for name, job in config.rooms.items():
        progress(f"tabcohort serve: {url}  room {name} (dataset {job.dataset}, {job.topology})")
        progress(f"  join: tabcohort rank --server {url} --room {name}"
                 f"{' --token ...' if job.token else ''}")
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


def serve(config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8080,
          progress: Callable[[str], None] = print, advertise: bool = False,
          advertise_interfaces: list[str] | None = None) -> int:
    config.validate()
    asyncio.run(serve_async(config, host=host, port=port, progress=progress, advertise=advertise,
                            advertise_interfaces=advertise_interfaces))
    return 0
