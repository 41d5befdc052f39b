"""The tabcohort server: rooms, the WebSocket star relay, job (code and data)/checkpoint HTTP, metrics.

``create_app(config)`` builds the aiohttp application; ``rooms`` holds the bookkeeping as plain
Python (no aiohttp), so it is tested without a server.
"""

from .config import JobConfig, ServerConfig, ServerLimits

__all__ = ["JobConfig", "ServerConfig", "ServerLimits", "create_app"]


def __getattr__(name: str):
    if name == "create_app":  # aiohttp is imported only when the app is built
        from .app import create_app
        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
