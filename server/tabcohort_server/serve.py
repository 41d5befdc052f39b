"""``tabcohort serve``: run the app until SIGINT/SIGTERM, printing the URL it listens on."""

from __future__ import annotations

import asyncio
import signal
from typing import Callable

from .config import ServerConfig


async def serve_async(config: ServerConfig, *, host: str, port: int,
                      progress: Callable[[str], None] = print) -> None:
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
        await runner.cleanup()  # on_shutdown closes sockets with GOING_AWAY


def serve(config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8080,
          progress: Callable[[str], None] = print) -> int:
    config.validate()
    asyncio.run(serve_async(config, host=host, port=port, progress=progress))
    return 0
