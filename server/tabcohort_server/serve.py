"""``tabcohort serve``: run the app until SIGINT (an ordered stop of the rooms: see
:func:`drain_rooms`) or SIGTERM (sockets closed, ranks resume on a restarted server), printing the
URL it listens on."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import time
from typing import Any, Callable

from .config import ServerConfig

#: seconds after the first stop signal during which a signal *of another kind* is the same stop,
#: not "at once" (as a rank's: tabcohort.runtime.native.SIGNAL_REPEAT_GRACE_S): a terminal's
#: hangup reaches the demo script and the server together, and the script passes it on (SIGINT)
SIGNAL_REPEAT_GRACE_S = 1.0


class MalformedRequests(logging.Filter):
    """On aiohttp's ``aiohttp.server`` logger: a request aiohttp could not parse (a bad URL, a bad
    header: it already answered 400; a body it could not inflate) is counted in ``refused`` (``malformed_http``, in /metrics)
    and logged in one line at most every ``every_s`` seconds, not as an 11-line traceback each:
    anyone could fill the log with them, without a token."""

    def __init__(self, refused: Any, every_s: float = 10.0, clock: Callable[[], float] | None = None) -> None:
        super().__init__()
        self.refused = refused
        self.every_s = every_s
        self.clock = clock or __import__("time").monotonic
        self._last = -float("inf")
        self._since = 0

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import BadHttpMessage
        from aiohttp.web_protocol import RequestPayloadError

        exc = record.exc_info[1] if record.exc_info else None
        # (a body aiohttp could not inflate, read after the answer to drain it: a bad request too)
        if not isinstance(exc, (BadHttpMessage, RequestPayloadError)):
            return True
        self.refused["malformed_http"] += 1
        self._since += 1
        now = self.clock()
        if now - self._last < self.every_s:
            return False
        why = " ".join(str(getattr(exc, "message", "") or exc).split())[:200]
        record.msg = "refused %d malformed HTTP request(s) (400, counted in /metrics as malformed_http); the last: %s"
        record.args = (self._since, why)
        record.exc_info = None
        record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        self._last, self._since = now, 0
        return True


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
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequests) for f in server_log.filters):
        server_log.addFilter(MalformedRequests(app[REFUSED]))
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
                      advertise_interfaces: list[str] | None = None, drain_timeout_s: float = 10.0) -> int:
    """Serve until SIGINT, SIGTERM or SIGHUP (SIGHUP as SIGINT). Returns the exit status: 0; 130 when a second signal cut
    the ordered stop short (as a rank's forced stop exits); 1 when the ordered stop's
    ``drain_timeout_s`` passed with ranks still connected and a room without its final
    checkpoint."""
    from aiohttp import web

    import json

    from tabcohort._urls import redact_url

    from .app import ASSETS, OPERATOR_TOKEN, ROOMS, TRAINER_TOKEN, create_app
    from .static import missing_page_assets

    for name, job in config.rooms.items():
        if job.job:   # (it checked for up to two minutes with nothing said: a new-user trial)
            from .assets import job_check_bounds
            data_s, probe_s = job_check_bounds()
            progress(f"tabcohort serve: checking the job {job.job} of room {name} (its import, load_data() "
                     f"within {data_s:g} s, a first bucket and evaluate() within {probe_s:g} s)...")
    app = create_app(config)  # ConfigError before listening
    runner, site, actual = await start_site(app, host, port)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{actual}"
    if config.cluster is not None:   # Redis answered at setup; now claim what nobody holds
        from .cluster_web import start as start_cluster
        node = await start_cluster(app, url)
    if host in ("0.0.0.0", "::"):
        # (the links said http://0.0.0.0:PORT/..., which no other machine can open, and a page
        # there is no secure context: a new-user trial) the address that routes out, or loopback
        here = _routable_address()
        url = f"http://{here}:{actual}"
        progress(f"tabcohort serve: listening on every interface ({host}); the links below use {here}, "
                 + ("this machine's address on its network (another machine on it opens them as they are)"
                    if not here.startswith("127.") else "as this machine has no route to a network (loopback only)"))
    if config.cluster is not None:
        owned = sorted(node.book.owned)
        progress(f"cluster: node {node.config.node_id} at {redact_url(node.config.advertise_url)} (Redis "
                 f"{redact_url(node.config.redis_url)}); owns {', '.join(owned) if owned else 'no room yet'}; lease "
                 f"{node.timing.lease_ms:g} ms, failover within {node.timing.failover_bound_ms() / 1000:g} s")
    for name, job in config.rooms.items():
        assets = app[ASSETS].get(name)
        if assets is not None:
            info = json.loads(assets.job_json)["job_info"]
            what = f"job {info['name']}" if job.job else f"built-in job {info['name']} over {job.dataset}"
            progress(f"tabcohort serve: {url}  room {name} ({what}: code {info['code_bytes']} bytes "
                     f"sha256 {info['code_sha256'][:16]}, data {info['data_bytes']} bytes sha256 "
                     f"{info['data_sha256'][:16]}; backends {', '.join(b for b in info.get('accepts') or info['backends'] if b != 'auto')}; "
                     f"{job.topology})")
        else:
            progress(f"tabcohort serve: {url}  room {name} (dataset {job.dataset}, {job.topology})")
        # what training runs with (a new-user trial could not see H, the inner lr or the options)
        train = (f"  training: lr {job.lr:g}, global batch {job.global_batch or 'the ranks batches'}, "
                 f"eval every {job.eval_every or 'never'}")
        # (and when it stops: a new-user trial did not see its --steps limit)
        stops = ([f"step {job.steps}"] if job.steps else []) + \
            ([f"held-out accuracy {job.target_accuracy:g}"] if job.target_accuracy else []) + \
            ([f"{job.duration_s:g} s after the first rank joins"] if job.duration_s else [])
        train += f"; stops at {' or '.join(stops)}" if stops else "; no stop condition (Ctrl-C stops it)"
        if job.local_steps > 1:
            train += (f"; local steps {job.local_steps} (inner {job.inner_optimizer} lr {job.inner_lr:g}, outer "
                      f"{job.outer_optimizer}" + (f" momentum {job.outer_momentum:g}" if job.outer_optimizer == "nesterov"
                                                  else "") + ")")
        if job.job_options:
            train += "; job options " + ", ".join(f"{k}={v!r}" for k, v in sorted(job.job_options.items()))
        progress(train)
        if assets is not None and assets.global_batch_note:
            progress(f"  warning: {assets.global_batch_note}")
        lead = "" if config.any_rank_may_lead else " --trainer-token ..."
        # a module job's code is run natively only when the user says so (README "Trust model for job code")
        trust = " --trust-job (or --job YOUR_COPY)" if job.job else ""
        progress(f"  join: tabcohort rank --server {url} --room {name}"
                 f"{' --token ...' if job.token else ''}{lead}{trust}")
        # a tab joins from the page; a token room's page needs the token in its link
        progress(f"  tabs: {url}/?room={name}" + ("&token=... (the room token: give tabs this link with it)"
                                                   if job.token else ""))
        if name == next(iter(config.rooms)) and (missing := missing_page_assets()) is not None:
            progress(f"  warning: {missing}")        # (once: it is the server's, not a room's)
        if name == next(iter(config.rooms)) and not config.checkpoint_dir:
            # (a new-user trial: a restart lost 6,563 steps, and the ranks were refused, unwarned)
            progress("  warning: no --checkpoint-dir: no checkpoint is kept; a restarted server starts its rooms "
                     "from scratch and does not know their ranks (give --checkpoint-dir DIR to keep them)")
        room = app[ROOMS].get(name)
        if room is not None and room.resumed_from is not None and not room.stopped:
            r = room.resumed_from
            if config.cluster is not None:
                # (a node that does not own the room resumes nothing: it said so of every room)
                progress(f"  room {name}: its newest checkpoint is {r['id']} at step {r['step']} "
                         f"({config.checkpoint_dir}); the node that owns the room goes on from there")
            else:
                progress(f"  room {name} resumes from its checkpoint {r['id']} at step {r['step']} "
                         f"({config.checkpoint_dir}); a fresh --checkpoint-dir starts from scratch")
        elif room is not None and room.store is not None and room.store.n_refused:
            # (it said they were "left as they are", and this room's first checkpoint replaced
            # ROOM.ckpt, the other job's newest: it is now kept in the history first)
            kept = room.store.refused_kept
            progress(f"  room {name} starts from scratch: the {room.store.n_refused} checkpoint(s) in "
                     f"{config.checkpoint_dir} (newest at step {room.store.refused_step}) are of another job "
                     f"(another model, data or training setting, e.g. --hidden); they are kept in "
                     f"{os.path.dirname(kept) if kept else config.checkpoint_dir}"
                     + (f" (the newest: {os.path.basename(kept)})" if kept else "")
                     + f", and {name}.ckpt becomes this job's newest checkpoint; the other job resumes "
                     f"from them when it is served on this directory again")
        if room is not None and room.resumed_from is None and not (room.store is not None and room.store.n_refused) \
                and config.checkpoint_dir and config.cluster is None \
                and (others := _other_rooms_checkpoints(config.checkpoint_dir, config.rooms)):
            # (serve --job my_job.py once named its room "digits": a directory of such a run holds
            # digits.ckpt, and the room, now named after the module, started from scratch unsaid)
            progress(f"  room {name} starts from scratch: {config.checkpoint_dir} holds checkpoints of "
                     f"{', '.join(others[:5])}{' ...' if len(others) > 5 else ''}, not of {name}; "
                     f"--room {others[0]} resumes that room (with the job it was trained with)")
        if room is not None and room.store is not None and room.store.unreadable:
            bad = room.store.unreadable
            progress(f"  room {name}: {len(bad)} checkpoint file(s) in {config.checkpoint_dir} could not be read "
                     f"(truncated or damaged; not resumed from, and a newer upload may replace them): "
                     + ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""))
        if room is not None and room.stopped:
            progress(f"  room {name} is already finished ({room.stop_reason}): ranks that join are told "
                     f"to stop; raise --steps or use a fresh --checkpoint-dir to train on")
        progress(f"  operate: {url}/operator?room={name}#operator=" + app[OPERATOR_TOKEN])
        if room is not None and not room.stopped:
            room.on_stop.append(lambda r: _say_stopped(r, progress))
        if room is not None:
            room.on_final_checkpoint.append(lambda r, m: _say_final_checkpoint(r, m, progress))
            room.on_fault.append(lambda r, k, fault: _say_fault(r, k, fault, progress))
            room.on_membership.append(lambda r, p, event: _say_membership(r, p, event, progress))
    if config.any_rank_may_lead:
        progress("roles: any rank may lead (--any-rank-may-lead: for trusted groups only)")
    else:
        where = (f"; also in {config.checkpoint_dir}/.trainer-token" if config.checkpoint_dir and
                 config.trainer_token is None else "")
        progress("roles: only ranks with the trainer token may lead; tabs and other ranks contribute buckets")
        if config.trainer_token is None:
            progress(f"trainer token (give native ranks --trainer-token or TABCOHORT_TRAINER_TOKEN{where}): "
                     + app[TRAINER_TOKEN])
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
    # SIGINT (Ctrl-C: the operator ends the run) stops the rooms in order: the ranks are told to
    # stop, and the server waits (bounded) for the final checkpoint. SIGTERM (a service manager's
    # restart or shutdown: docker stop, systemd) only closes the sockets (GOING_AWAY): the ranks
    # train on and resume their ids when a server on the same --checkpoint-dir is back. SIGHUP
    # (the terminal closed: an ssh session dropped) is Ctrl-C's ordered stop: no one restarts
    # this server, and without it the final checkpoints were lost.
    stop = asyncio.Event()
    force = asyncio.Event()
    drain = []
    loop = asyncio.get_running_loop()

    hup = getattr(signal, "SIGHUP", None)
    first: list[tuple[float, signal.Signals]] = []

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            # a second signal stops at once, but a hangup (it comes from the kernel and the shell
            # both), or another kind within SIGNAL_REPEAT_GRACE_S (a script passing the stop on:
            # the demo's trap sends SIGINT after the terminal's SIGHUP) is the same stop
            if sig != hup and not (sig != first[0][1] and time.monotonic() - first[0][0] < SIGNAL_REPEAT_GRACE_S):
                force.set()
            return
        first.append((time.monotonic(), sig))
        drain.append(sig != signal.SIGTERM)
        stop.set()
    sigs = [signal.SIGINT, signal.SIGTERM]
    if hup is not None and signal.getsignal(hup) is not signal.SIG_IGN:   # (nohup: the hangup is to pass)
        sigs.append(hup)
    for sig in sigs:
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError):  # pragma: no cover
            pass
    try:
        await stop.wait()
        if drain and drain[0]:
            missing = await drain_rooms(app, timeout_s=drain_timeout_s, progress=progress, force=force)
            if missing and not force.is_set():
                return 1   # (a script that chains on serve's status must not take the stop as whole)
        return 130 if force.is_set() else 0
    finally:
        progress("tabcohort serve: shutting down")
        if adv is not None:
            await adv.stop()
        await runner.cleanup()  # on_shutdown closes sockets with GOING_AWAY
        say_unsaid(app, progress)


def say_unsaid(app: Any, progress: Callable[[str], None]) -> None:
    """At exit, one line for each room whose joins, leaves or faults went past the console's line
    budget (``MEMBERSHIP_LINES_PER_MINUTE``, the fault lines' own) since its last line: a mass
    leave at the stop left the console's count short, with nothing after it to say the rest."""
    from .app import ROOMS

    for room in list(app[ROOMS].rooms.values()):
        parts = [f"{n} {what}" for n, what in ((room.membership_unsaid, "joins and leaves"),
                                               (room.faults_unsaid, "faults")) if n]
        if parts:
            room.membership_unsaid = room.faults_unsaid = 0
            try:
                progress(f"tabcohort serve: room {room.name}: {' and '.join(parts)} since its last line not shown")
            except Exception:   # (the output may be gone: the exit goes on)
                pass


def _say_final_checkpoint(room: Any, meta: dict, progress: Callable[[str], None]) -> None:
    """One line when a room's final checkpoint is stored (the stop line said one would follow;
    it was said only on Ctrl-C, not after an operator's stop or a stop condition)."""
    if room.final_checkpoint_said:
        return
    step = meta.get("step")
    # (at its --steps limit the room is finished even before the report that stops it arrives:
    # the leader's final upload can overtake that report)
    at_limit = bool(room.job.steps) and isinstance(step, int) and step >= room.job.steps
    if not (room.stopped or at_limit):
        # a leader that left on its own (Ctrl-C on its rank) uploads its last model as final, and
        # the room trains on under the next leader: "final checkpoint" here misled a new user
        line = (f"tabcohort serve: room {room.name}: checkpoint at step {step}, uploaded by its leader as it "
                f"left; the room has not stopped (a rank that may lead takes over, if one is connected)")
    else:
        room.final_checkpoint_said = True
        line = f"tabcohort serve: room {room.name}: final checkpoint at step {step}"
    try:
        progress(line)
    except Exception:
        logging.getLogger("tabcohort.server").warning("%s", line)


def _say_stopped(room: Any, progress: Callable[[str], None]) -> None:
    """One line when a room stops while the server runs: at its ``--steps`` limit (with the
    final step), or for another reason (target accuracy, duration, diverged, the operator)."""
    step = room.step()
    if room.job.steps and step >= room.job.steps:
        line = (f"tabcohort serve: room {room.name} reached its step limit (--steps {room.job.steps}) at "
                f"step {step}; its ranks are told to stop")
    else:
        # (the step the stop was decided at: the ranks finish the rounds in flight, so the final
        # checkpoint, said on its own line, can be a few rounds later)
        line = (f"tabcohort serve: room {room.name} stopping (last reported step {step}): {room.stop_reason}; its "
                f"ranks are told to stop and finish the rounds in flight (the final checkpoint, with its step, "
                f"follows if a rank that may lead uploads one)")
    try:
        progress(line)
    except Exception:    # (an output gone away must not fail the report that stopped the room)
        logging.getLogger("tabcohort.server").warning("%s", line)


#: the most characters of a rank's fault the console shows (the operator view has all of it)
FAULT_LINE_MAX_CHARS = 300


def _say_fault(room: Any, rank_id: int, fault: str, progress: Callable[[str], None]) -> None:
    """One line when a rank reports a new fault (its job failed, its updates diverged): the
    console said nothing, and a newcomer whose job raised saw the ranks leave without a word
    here. ``fault`` is the rank's untrusted text: control characters (a terminal's escape
    sequences) become ``?``, and it is cut to :data:`FAULT_LINE_MAX_CHARS`."""
    text = "".join(c if c.isprintable() else "?" for c in fault[:FAULT_LINE_MAX_CHARS])
    more = " ..." if len(fault) > FAULT_LINE_MAX_CHARS else ""
    unsaid, room.faults_unsaid = room.faults_unsaid, 0
    also = f" ({unsaid} more since the last line not shown: the operator view has them)" if unsaid else ""
    line = f"tabcohort serve: room {room.name}: rank {rank_id:08x} reports a fault: {text}{more}{also}"
    try:
        progress(line)
    except Exception:    # (as _say_stopped: the report that carried it must not fail)
        logging.getLogger("tabcohort.server").warning("%s", line)


def _routable_address() -> str:
    """This machine's IPv4 address on the network its default route leads to (a UDP socket's
    connect sends nothing), or ``127.0.0.1`` when there is none (a machine on loopback only)."""
    import socket
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))     # (TEST-NET-1, RFC 5737: never answered, never sent to)
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _say_membership(room: Any, p: Any, event: str, progress: Callable[[str], None]) -> None:
    """One line when a rank joins a room, takes its seat again or leaves, with the room's count
    of connected ranks (``Room.on_membership``; the operator view has each rank's report)."""
    n = len(room.connected)
    unsaid, room.membership_unsaid = room.membership_unsaid, 0
    also = f"; {unsaid} more joins and leaves since the last line not shown" if unsaid else ""
    if event == "joined":
        what = f"joined ({'may lead' if p.may_lead else 'contributes buckets'}; {n} connected{also})"
    elif event == "resumed":
        what = f"is back on its seat ({n} connected{also})"
    elif event == "sent_away":   # (Room.evict_all: this cluster node no longer owns the room)
        what = f"was sent away: this node no longer owns the room ({n} connected{also})"
    else:
        held = (f"; its seat is held {room.limits.resume_grace_s:g} s for it to resume"
                if not room.stopped else "")
        what = f"left ({n} connected{held}{also})"
    line = f"tabcohort serve: room {room.name}: rank {p.id:08x} {what}"
    try:
        progress(line)
    except Exception:    # (as _say_fault: the registration or close that said it must not fail)
        logging.getLogger("tabcohort.server").warning("%s", line)


async def drain_rooms(app: Any, *, timeout_s: float, progress: Callable[[str], None],
                      force: asyncio.Event | None = None) -> list[str]:
    """An ordered stop: tell every room with connected ranks to stop (the ``stop`` control,
    PROTOCOL.md "Controls": the leader publishes and uploads its final checkpoint), then wait
    until those ranks have left, at most ``timeout_s`` seconds (or until ``force`` is set).

    Returns:
        The names of the rooms whose ranks did not all leave in time and that hold no final
        checkpoint (empty: every room stopped whole; a follower tab slow to leave after its
        leader's final upload is not a missing checkpoint).
    """
    from .app import ROOMS

    rooms = [r for r in app[ROOMS].rooms.values() if r.connected]
    if not rooms:
        return []
    n = sum(len(r.connected) for r in rooms)
    progress(f"tabcohort serve: stopping {n} connected rank{'s' if n != 1 else ''}; waiting up to "
             f"{timeout_s:g} s for the final checkpoint (Ctrl-C again to stop at once)")
    for r in rooms:
        if r.stopped:   # already stopping (its stop condition): tell any rank that missed it
            r.broadcast_control({"type": "stop", "reason": r.stop_reason})
        else:
            r.stop("the server is shutting down")
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while any(r.connected for r in rooms):
        if loop.time() >= end or (force is not None and force.is_set()):
            left = sum(len(r.connected) for r in rooms)
            missing = [r.name for r in rooms if r.connected and not (r.checkpoint or {}).get("final")]
            why = "" if force is not None and force.is_set() else f" after {timeout_s:g} s"
            progress(f"tabcohort serve: {left} rank{'s' if left != 1 else ''} still connected; stopping anyway{why} "
                     + (f"(no final checkpoint of room {', '.join(missing)})" if missing else
                        "(the final checkpoint is stored)"))
            return missing
        await asyncio.sleep(0.05)
    for r in rooms:
        ck = r.checkpoint
        if ck is not None and not (ck.get("final") and r.final_checkpoint_said):
            progress(f"tabcohort serve: room {r.name}: {'final' if ck.get('final') else 'last'} checkpoint "
                     f"at step {ck.get('step')}")
    return []


def _check_listen(host: str, port: int, checkpoint_dir: str | None) -> None:
    """Raise ConfigError (naming the option) for a host that resolves to nothing, a port that
    cannot be bound, or a checkpoint directory that cannot be written, before serving."""
    import os
    import socket

    from tabcohort.errors import ConfigError

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
            if exc.errno == errno.EADDRNOTAVAIL:   # the address is not this machine's: the host's fault
                raise ConfigError("--host", host, f"not an address of this machine, cannot listen on it "
                                                  f"({exc.strerror})") from None
            raise ConfigError("--port", port, f"cannot listen on {host}:{port} ({exc.strerror})") from None
    # (after the address: a port in use left an empty --checkpoint-dir behind, created for nothing)
    if checkpoint_dir:
        try:
            os.makedirs(checkpoint_dir, exist_ok=True)
            probe = os.path.join(checkpoint_dir, ".write-test")
            with open(probe, "wb"):
                pass
            os.remove(probe)
        except OSError as exc:
            raise ConfigError("--checkpoint-dir", checkpoint_dir, f"not a writable directory ({exc.strerror})") from None


def lock_checkpoint_dir(checkpoint_dir: str) -> Any:
    """Hold ``checkpoint_dir``'s lock (``.serve.lock``, an exclusive ``flock``) for this
    process's life; returns the open lock file (closing it releases the lock).

    Raises:
        ConfigError: another process holds it (its pid is named). Why: two servers that are not
            one cluster, on one directory, each overwrote the other's ``ROOM.ckpt`` and mixed
            two jobs' history (a new-user trial); a cluster's nodes share their directory by
            design and do not take this lock (README "Cluster")."""
    import fcntl
    import os

    from tabcohort.errors import ConfigError

    path = os.path.join(checkpoint_dir, ".serve.lock")
    try:
        fh = open(path, "a+")
    except OSError as exc:
        raise ConfigError("--checkpoint-dir", checkpoint_dir, f"cannot open {path} ({exc.strerror})") from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip()[:20] or "?"
        fh.close()
        raise ConfigError("--checkpoint-dir", checkpoint_dir,
                          f"another tabcohort serve (pid {holder}) uses this directory: give each server its own, "
                          f"or run them as one cluster (--redis, README \"Cluster\")") from None
    except OSError as exc:          # a file system without locks (NFS without lockd): say so
        fh.close()
        raise ConfigError("--checkpoint-dir", checkpoint_dir, f"cannot lock {path} ({exc.strerror}): "
                          f"put checkpoints on a local file system") from None
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
    except OSError as exc:
        fh.close()
        raise ConfigError("--checkpoint-dir", checkpoint_dir, f"cannot write {path} ({exc.strerror})") from None
    return fh


def _other_rooms_checkpoints(checkpoint_dir: str, rooms: Any) -> list[str]:
    """The room names of ``checkpoint_dir``'s ``ROOM.ckpt`` files other than ``rooms``'s, sorted
    (none when the directory cannot be listed)."""
    try:
        names = os.listdir(checkpoint_dir)
    except OSError:
        return []
    return sorted(n[:-5] for n in names if n.endswith(".ckpt") and not n.startswith(".") and n[:-5] not in rooms)


def serve(config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8080,
          progress: Callable[[str], None] = print, advertise: bool = False,
          advertise_interfaces: list[str] | None = None) -> int:
    config.validate()
    _check_listen(host, port, config.checkpoint_dir)
    lock = lock_checkpoint_dir(config.checkpoint_dir) if config.checkpoint_dir and config.cluster is None else None
    try:
        return asyncio.run(serve_async(config, host=host, port=port, progress=progress, advertise=advertise,
                                       advertise_interfaces=advertise_interfaces))
    finally:
        if lock is not None:
            lock.close()
