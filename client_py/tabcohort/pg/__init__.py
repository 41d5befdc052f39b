"""Fixed-world process group: classic collectives over direct TCP links or WebRTC data
channels (README, "Fixed-world process group").

One-call bring-up, like ``torch.distributed.init_process_group``; the peers come from one of::

    # RANK=0 WORLD=2 PEERS=127.0.0.1:29500,127.0.0.1:29501 (TOPOLOGY=mesh|star)   static, TCP
    # RANK=0 WORLD=3 DISCOVERY=mdns PG_GROUP=lab                                  LAN mDNS, TCP
    # RANK=1 WORLD=3 TOPOLOGY=star DISCOVERY=unicast:hub.example PG_GROUP=lab     behind NAT, TCP
    # RANK=0 WORLD=3 PG_SERVER=http://host:8080 PG_ROOM=pg                        WebRTC via a server
    from tabcohort.pg import init_process_group
    pg = await init_process_group()                       # or rank=, world=, peers=, ...
    y = await pg.all_reduce(x, op="sum")                   # x: float32 numpy or array('f')
    y = await pg.all_reduce(x, op="mean", precision="int8")
    z = await pg.broadcast(x, root=0)
    await pg.barrier()
    avg = await pg.federated_average(x, weight=n_samples)
    await pg.close()

or synchronously with :func:`init_process_group_sync` (same methods, no ``await``).
Configuration: :mod:`tabcohort.pg.config`; semantics: :mod:`tabcohort.pg.group`; transports:
:mod:`tabcohort.pg.tcp`, :mod:`tabcohort.pg.rtc`; discovery: :mod:`tabcohort.pg.discovery`;
errors: :mod:`tabcohort.pg.errors`.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine, Mapping

from .._alloc import hold_allocator
from .config import PGConfig, load_config
from .errors import (CollectiveMismatchError, CollectiveTimeoutError, GroupSetupError, MemoryBoundError,
                     PeerLostError, PGError)
from .group import ProcessGroup
from .tcp import TcpBus


async def init_process_group(*, env: Mapping[str, str] | None = None, **options: Any) -> ProcessGroup:
    """Validate the configuration, then connect the group (asyncio).

    Args:
        env: environment to read (default ``os.environ``).
        **options: ``rank``, ``world``, ``peers``, ``topology``, ``discovery``, ``group``,
            ``discovery_interfaces``, ``server``, ``room``, ``token``, ``rtc_host_addresses``,
            ``ice_servers``, ``timeout_s``, ``connect_timeout_s``, ``max_memory_bytes``,
            ``listen_host``, ``listen_port``; each overrides its environment variable (the table
            in :mod:`tabcohort.pg.config`).

    Returns:
        A connected :class:`ProcessGroup`.

    Raises:
        ConfigError: a bad option or variable, named, before any socket is opened.
        GroupSetupError: discovery did not find the ranks it needs (the message names those
            found and those missing), the server refused, or peers did not connect, all within
            ``connect_timeout_s``; or another process claims this rank.
    """
    cfg = load_config(env=env, **options)
    hold_allocator(env)
    return await ProcessGroup.connect(cfg)


class SyncProcessGroup:
    """Blocking wrapper: the same collectives without ``await``, on a private event loop.

    TCP: the loop runs only inside calls, so a peer's loss is noticed at the next call (at once:
    the closed socket is already readable). WebRTC: the loop runs in a daemon thread for the
    group's life (the server's WebSocket heartbeat, ICE consent checks and SCTP must keep
    running between calls); each call waits for its coroutine there.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, group: ProcessGroup,
                 thread: threading.Thread | None = None) -> None:
        self._loop, self.group, self._thread = loop, group, thread
        self.rank, self.world, self.topology = group.rank, group.world, group.topology

    def _run(self, coro: Coroutine) -> Any:
        if self._thread is None:
            return self._loop.run_until_complete(coro)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def all_reduce(self, x: Any, op: str = "sum", *, precision: str = "f32") -> Any:
        """See :meth:`ProcessGroup.all_reduce`."""
        return self._run(self.group.all_reduce(x, op, precision=precision))

    def broadcast(self, x: Any, root: int = 0) -> Any:
        """See :meth:`ProcessGroup.broadcast`."""
        return self._run(self.group.broadcast(x, root))

    def barrier(self) -> None:
        """See :meth:`ProcessGroup.barrier`."""
        self._run(self.group.barrier())

    def federated_average(self, x: Any, weight: float) -> Any:
        """See :meth:`ProcessGroup.federated_average`."""
        return self._run(self.group.federated_average(x, weight))

    def close(self) -> None:
        """Leave the group and close the loop (idempotent)."""
        if self._loop.is_closed():
            return
        self._run(self.group.close())
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    def __enter__(self) -> "SyncProcessGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def init_process_group_sync(*, env: Mapping[str, str] | None = None, **options: Any) -> SyncProcessGroup:
    """Blocking :func:`init_process_group`; returns a :class:`SyncProcessGroup`."""
    cfg = load_config(env=env, **options)  # before the loop exists: no network activity
    hold_allocator(env)
    loop = asyncio.new_event_loop()
    if cfg.transport == "rtc":
        thread = threading.Thread(target=loop.run_forever, name=f"tabcohort-pg-{cfg.rank}", daemon=True)
        thread.start()
        try:
            group = asyncio.run_coroutine_threadsafe(ProcessGroup.connect(cfg), loop).result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            raise
        return SyncProcessGroup(loop, group, thread)
    try:
        group = loop.run_until_complete(ProcessGroup.connect(cfg))
    except BaseException:
        loop.close()
        raise
    return SyncProcessGroup(loop, group)


__all__ = [
    "CollectiveMismatchError", "CollectiveTimeoutError", "GroupSetupError", "MemoryBoundError", "PGConfig",
    "PGError", "PeerLostError", "ProcessGroup", "SyncProcessGroup", "TcpBus", "init_process_group",
    "init_process_group_sync", "load_config",
]
