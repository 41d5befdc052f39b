"""Finding a group's TCP peers on the LAN (``DISCOVERY=mdns`` or ``unicast:HOST[:PORT]``).

Built on :mod:`tabcohort.discovery` (python-zeroconf), the code the cohort uses to find a server.

Records: every rank that listens (every mesh rank; the star hub) advertises, once its listener is
bound, the DNS-SD instance ``<PG_GROUP>-r<RANK>._tabcohort-pg._tcp.local.`` with its address and
port, and TXT records ``group``, ``rank``, ``world``, ``topology`` and ``version``. The name is
fixed per (group, rank): a second live process claiming the same rank in the same group fails
its registration (mDNS probing), which is a :class:`~tabcohort.pg.errors.GroupSetupError`. The
record is withdrawn (an mDNS goodbye) when the group closes.

Who looks for whom:

- mesh, ``mdns``: every rank browses until it has the records of all ``WORLD - 1`` others (a
  roll call: a missing rank is named on every rank), then dials the ranks below it.
- star, ``mdns``: a worker browses for the hub's record (rank 0); the hub browses for nothing
  (workers dial it; its bring-up error names the workers that never connected).
- star, ``unicast:HOST[:PORT]``: a worker sends DNS-SD queries straight to HOST's responder
  (legacy unicast, RFC 6762 section 6.7; default port 5353) and so finds the hub across NAT or
  another subnet where multicast does not pass. The hub advertises as with ``mdns``.

A record of another group is ignored; a record of this group with another world size or
topology is reported (it means two launches share a group name).
"""

from __future__ import annotations

import asyncio
from typing import Any

from .config import PGConfig
from .errors import GroupSetupError
from .tcp import PG_VERSION

SERVICE_TYPE = "_tabcohort-pg._tcp.local."


def instance(group: str, rank: int) -> str:
    """The DNS-SD instance label of ``rank`` in ``group`` (at most 40 + 7 characters)."""
    return f"{group}-r{rank}"


def properties(cfg: PGConfig) -> dict[str, str]:
    """The TXT records this rank advertises."""
    return {"group": cfg.group, "rank": str(cfg.rank), "world": str(cfg.world), "topology": cfg.topology,
            "version": str(PG_VERSION)}


def needs(cfg: PGConfig) -> set[int]:
    """The ranks whose records this rank waits for (see the module docstring)."""
    if cfg.topology == "mesh":
        return set(range(cfg.world)) - {cfg.rank}
    return set() if cfg.rank == 0 else {0}


def _advertised_addresses(host: str) -> list[str]:
    from ..discovery import local_ipv4_addresses

    return local_ipv4_addresses(host)


async def advertise(cfg: PGConfig, port: int) -> Any:
    """Register this rank's record for the listener bound at ``port``; returns the
    :class:`~tabcohort.discovery.Advertiser` (stop it on close).

    Raises:
        GroupSetupError: another live process already advertises this group and rank.
    """
    from ..discovery import Advertiser

    ifaces = list(cfg.discovery_interfaces) or None
    addrs = _advertised_addresses(cfg.listen_host)
    if ifaces is None and addrs and all(a.startswith("127.") for a in addrs):
        ifaces = addrs  # a loopback listener is only reachable (and announced) on loopback
    adv = Advertiser(port=port, addresses=addrs, interfaces=ifaces, instance=instance(cfg.group, cfg.rank),
                     service_type=SERVICE_TYPE, properties=properties(cfg), allow_name_change=False)
    try:
        await adv.start()
    except Exception as e:  # zeroconf's NonUniqueNameException, or a socket error
        if type(e).__name__ == "NonUniqueNameException":
            raise GroupSetupError(f"rank {cfg.rank} of group {cfg.group!r} is already advertised on the LAN "
                                  f"(another process with the same RANK and PG_GROUP?)") from None
        raise GroupSetupError(f"rank {cfg.rank}: cannot advertise on mDNS: {e!r}") from e
    return adv


def find(cfg: PGConfig, timeout_s: float) -> dict[int, tuple[str, int]]:
    """Browse (or query by unicast) until every rank of :func:`needs` is found (blocking; run
    it in an executor).

    Returns:
        ``{rank: (address, port)}`` for the needed ranks.

    Raises:
        GroupSetupError: not all found within ``timeout_s``; the message names the ranks found
            (with their addresses), the ranks missing, how the search was made, and records seen
            but not usable (another world size or topology under this group name).
    """
    from ..discovery import browse

    want = needs(cfg)
    if not want:
        return {}
    by_rank: dict[int, Any] = {}

    def accept(f: Any) -> str | None:
        p = f.properties
        if p.get("group") != cfg.group:
            return f"another group ({p.get('group')!r})"
        try:
            rank, world = int(p.get("rank", "")), int(p.get("world", ""))
        except ValueError:
            return f"bad TXT records {p}"
        if world != cfg.world or p.get("topology") != cfg.topology:
            return f"rank {rank} of a world of {world} in {p.get('topology')!r} (this rank: {cfg.world} in " \
                   f"{cfg.topology!r})"
        if rank == cfg.rank or not 0 <= rank < cfg.world:
            return f"claims rank {rank}"
        by_rank[rank] = f
        return None

    host = cfg.discovery_host or None
    _, rejected, how = browse(SERVICE_TYPE, accept=accept, enough=lambda _: want <= set(by_rank), host=host,
                                  port=cfg.discovery_port, timeout_s=timeout_s,
                                  interfaces=list(cfg.discovery_interfaces) or None, var="DISCOVERY")
    if want <= set(by_rank):
        return {r: (by_rank[r].addresses[0], by_rank[r].port) for r in sorted(want)}
    got = {r: f"{f.addresses[0]}:{f.port}" for r, f in sorted(by_rank.items())}
    others = {k: v for k, v in rejected.items() if not v.startswith("another group")}
    n_other = len(rejected) - len(others)
    what = "the hub (rank 0)" if want == {0} else f"the {len(want)} other ranks of {cfg.world}"
    raise GroupSetupError(
        f"rank {cfg.rank}: discovery did not find {what} in group {cfg.group!r} within {timeout_s:g} s "
        f"(PG_CONNECT_TIMEOUT_S) by {how} (service {SERVICE_TYPE}): found {got or 'none'}, missing ranks "
        f"{sorted(want - set(by_rank))}" + (f"; not usable: {others}" if others else "")
        + (f"; ignored {n_other} record(s) of other groups" if n_other else ""))


async def find_async(cfg: PGConfig, timeout_s: float) -> dict[int, tuple[str, int]]:
    """:func:`find` in the loop's default executor (the browse blocks)."""
    return await asyncio.get_running_loop().run_in_executor(None, find, cfg, timeout_s)
