"""A native rank over a real transport: ``tabcohort rank --server URL --room NAME``.

Bring-up (PROTOCOL.md, "Native bring-up"): configuration from arguments or the environment
(``TABCOHORT_SERVER``, ``TABCOHORT_ROOM``, ``TABCOHORT_TOKEN``, ``TABCOHORT_BATCH``,
``TABCOHORT_LINK``) is validated, and the server's host resolved, before any connection; then the
rank fetches the job and its data (verifying the data's sha256 and the job hash itself; the
job's code is the rank's own or a trusted one: README "Trust model for job code"), loads the room's latest checkpoint if there is one (every rank does, so whichever rank
bootstraps drives from it), joins over the star relay, reports its state every
``report_interval_s``, uploads checkpoints while it leads, and stops when the server says so.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import random
import signal
import socket
import sys
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .._urls import redact_url
from ..errors import ConfigError, TabcohortError
from .session import (LEAD_CHECK_S, RankSession, check_topology, checkpoint_upload, finished_room_message,
                      make_module_worker, parse_room_summary, path_report, trusted_job_source)

LINKS = ("ws", "rtc")
ENV = {"server": "TABCOHORT_SERVER", "room": "TABCOHORT_ROOM", "token": "TABCOHORT_TOKEN",
       "trainer_token": "TABCOHORT_TRAINER_TOKEN",
       "batch": "TABCOHORT_BATCH", "link": "TABCOHORT_LINK", "ice_servers": "TABCOHORT_ICE_SERVERS",
       "rtc_hosts": "TABCOHORT_RTC_HOSTS", "rtc_timeout": "TABCOHORT_RTC_TIMEOUT",
       "direct": "TABCOHORT_DIRECT", "direct_host": "TABCOHORT_DIRECT_HOST",
       "direct_announce": "TABCOHORT_DIRECT_ANNOUNCE",
       "discover": "TABCOHORT_DISCOVER", "discover_host": "TABCOHORT_DISCOVER_HOST",
       "discover_timeout": "TABCOHORT_DISCOVER_TIMEOUT", "discover_interfaces": "TABCOHORT_DISCOVER_INTERFACES",
       "trust_job": "TABCOHORT_TRUST_JOB", "job": "TABCOHORT_JOB"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def valid_room_name(name: str) -> bool:
    """Whether ``name`` is a room name: 1..64 characters of ``[A-Za-z0-9._-]``, not ``.`` or ``..``
    (the server's rule, ``check_room_name`` in ``tabcohort_server.config``)."""
    return (0 < len(name) <= 64 and name not in (".", "..")
            and all(c.isascii() and (c.isalnum() or c in "-_.") for c in name))


#: what a rank whose trainer token the server refused (``bad_trainer_token``) is told
TRAINER_TOKEN_REFUSED = (
    "the server refused the trainer token: give the one `tabcohort serve` printed at start (also in "
    "the server's CHECKPOINT_DIR/.trainer-token, or its --trainer-token / TABCOHORT_TRAINER_TOKEN), or "
    "none to join as a rank that only contributes; a server run with --any-rank-may-lead lets any "
    "rank lead without one")

#: said of a token's environment variable that is set but empty (README "Trust model": an
#: unset variable means no token; an empty one is taken for a mistake, as ``--trainer-token=""``)
EMPTY_TOKEN_VARIABLE = ("is set but empty (e.g. the shell's \"$(cat ckpt/.trainer-token)\" of a file that "
                        "does not exist)")

#: redirects followed per request (a cluster node sends a rank to its room's owner: one hop)
_MAX_REDIRECTS = 4


#: the ranks running in this process that asked to stop on a signal (:func:`stop_on_signals`),
#: and the handlers that were installed before the first of them
_STOPPING: list["_StopOnSignal"] = []
_SAVED_HANDLERS: dict[int, Any] = {}

#: seconds after the first stop signal during which another signal *of the other kind* is the
#: same stop, not "at once": a terminal's Ctrl-C (SIGINT) reaches the whole process group, so a
#: script that started the rank (the demo) and passes the stop on (SIGTERM) delivers a second
#: signal milliseconds after the first. A second Ctrl-C is always "at once", however quick.
SIGNAL_REPEAT_GRACE_S = 1.0


class _StopOnSignal:
    """One rank's ordered stop, asked for through its loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_stop: Callable[[str], None]) -> None:
        self.loop, self.request_stop = loop, request_stop

    def ask(self, name: str) -> None:
        try:
            self.loop.call_soon_threadsafe(self.request_stop, f"signal {name}")
        except RuntimeError:                     # (its loop has closed: nothing left to stop)
            pass


#: the signals that ask a rank for the ordered stop: Ctrl-C, a service manager's stop, and the
#: terminal's hangup (an ssh session that dropped: without it the rank died mid-round, and a
#: leader took its final checkpoint with it)
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, n))

#: seconds a forced stop waits for the bus to close its socket (RankRun.run)
BUS_CLOSE_BOUND_S = 1.0


def _on_stop_signal(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    first = getattr(_on_stop_signal, "seen", None)          # (when, which) of the first signal
    if first is not None:
        if signum != first[1] and time.monotonic() - first[0] < SIGNAL_REPEAT_GRACE_S:
            return                               # the same stop, passed on by a script
        if signum == getattr(signal, "SIGHUP", None):   # (a hangup reaches a rank from the kernel
            return                               # and its shell both: never a person's "again")
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)
    _on_stop_signal.seen = (time.monotonic(), signum)       # type: ignore[attr-defined]
    try:
        os.write(2, f"tabcohort rank: {name}: stopping in order (again to stop at once)\n".encode())
    except OSError:                              # (a hung-up terminal: the stop goes on unsaid)
        pass
    for r in list(_STOPPING):
        r.ask(name)


def stop_on_signals(loop: asyncio.AbstractEventLoop, request_stop: Callable[[str], None]) -> Callable[[], None]:
    """SIGINT, SIGTERM and SIGHUP ask for the ordered stop: ``request_stop("signal SIGINT")`` runs in
    ``loop`` once it turns (for every rank of the process that asked). A second signal before
    the process ends (the same signal again, or the other one more than
    :data:`SIGNAL_REPEAT_GRACE_S` after the first) stops it at once (``KeyboardInterrupt`` for
    SIGINT, ``SystemExit(143)`` for SIGTERM; a repeated SIGHUP is the same stop), raised where the main thread is: a job whose
    compute never returns holds the loop, and the ordered stop with it, so without this only
    SIGKILL ended such a rank. Python-level handlers (``signal.signal``), not the loop's: those
    run only when the loop turns.

    Returns:
        A function that ends this rank's part; the handlers from before the first rank are back
        once the last one's ends, in whatever order they end (a no-op off the main thread,
        where none are installed).
    """
    me = _StopOnSignal(loop, request_stop)
    if not _STOPPING:
        _on_stop_signal.seen = None              # type: ignore[attr-defined]
        for sig in STOP_SIGNALS:
            if sig == getattr(signal, "SIGHUP", None) and signal.getsignal(sig) is signal.SIG_IGN:
                continue                         # (started under nohup: the hangup is meant to pass)
            try:
                _SAVED_HANDLERS[sig] = signal.signal(sig, _on_stop_signal)
            except (ValueError, OSError):         # (not the main thread; a platform without it)
                pass
    _STOPPING.append(me)

    def restore() -> None:
        if me in _STOPPING:
            _STOPPING.remove(me)
        if not _STOPPING:
            for sig, h in list(_SAVED_HANDLERS.items()):
                signal.signal(sig, h)
            _SAVED_HANDLERS.clear()
    return restore


@dataclass
class RankConfig:
    """A native rank's settings. Build with :meth:`from_sources`, then :meth:`validate`."""

    server: str = ""
    room: str = ""
    token: str | None = None
    #: the room's trainer credential (``serve --trainer-token``): with it this rank may lead
    #: (docs/PROTOCOL.md, "Roles"); without it, in a room that requires it, it contributes only
    trainer_token: str | None = None
    batch: int | None = None
    link: str = "ws"
    backend: str = "auto"
    #: WebRTC (mesh rooms, or ``link="rtc"`` in star rooms): STUN/TURN URLs (comma-separated;
    #: none by default), ICE host addresses (``None`` = aioice's list; ``127.0.0.1`` for a
    #: loopback-only host) and the bound in seconds on a channel coming up before the relay is used.
    ice_servers: str | None = None
    rtc_hosts: str | None = None
    rtc_timeout: Any = 5.0
    #: direct TCP paths to the room's other native ranks (star rooms, ``link="ws"``; README
    #: "Direct paths"): on by default; where to listen (an IP address; ``None`` = the local
    #: address that routes to the server); ``IP:PORT`` to announce instead (a port forward).
    direct: Any = True
    direct_host: str | None = None
    direct_announce: str | None = None
    #: LAN discovery instead of a server URL: an mDNS browse (``discover``), or unicast DNS-SD
    #: queries to ``discover_host``'s mDNS port; bounded by ``discover_timeout`` seconds.
    discover: Any = False
    discover_host: str | None = None
    discover_timeout: Any = 5.0
    discover_interfaces: str | None = None
    #: a room that runs a module job (README "Write your own job", "Trust model"): run the code
    #: the server serves only with ``trust_job``, or a local copy ``job`` whose hash must match
    trust_job: Any = False
    job: str | None = None
    sources: dict[str, str] | None = None  # setting -> the variable it came from (for errors)

    @classmethod
    def from_sources(cls, args: Mapping[str, Any], env: Mapping[str, str] | None = None) -> "RankConfig":
        """Arguments win over environment variables. Nothing is validated here.

        Args:
            args: ``server``, ``room``, ``token``, ``batch`` (str or int), ``link``, ``backend``;
                ``None`` = not given.
            env: the environment (default ``os.environ``).
        """
        env = os.environ if env is None else env
        vals: dict[str, Any] = {}
        src: dict[str, str] = {}
        for key, var in ENV.items():
            if args.get(key) is not None:
                vals[key], src[key] = args[key], "--" + key.replace("_", "-")
            elif env.get(var) not in (None, ""):
                vals[key], src[key] = env[var], var
            elif key == "trainer_token" and env.get(var) == "":
                # (set but empty: a shell's "$(cat ckpt/.trainer-token)" of a missing file, which
                # was taken as no token and the rank never led; validate() refuses it)
                vals[key], src[key] = "", var
        cfg = cls(server=vals.get("server", ""), room=vals.get("room", ""), token=vals.get("token"),
                  link=vals.get("link", "ws"), backend=args.get("backend") or "auto", sources=src)
        cfg.batch = vals.get("batch")  # validated (int) in validate()
        cfg.trainer_token = vals.get("trainer_token")
        cfg.ice_servers = vals.get("ice_servers")
        cfg.rtc_hosts = vals.get("rtc_hosts")
        cfg.rtc_timeout = vals.get("rtc_timeout", 5.0)
        cfg.direct = vals.get("direct", True)
        cfg.direct_host = vals.get("direct_host")
        cfg.direct_announce = vals.get("direct_announce")
        cfg.discover = vals.get("discover", False)
        cfg.discover_host = vals.get("discover_host")
        cfg.discover_timeout = vals.get("discover_timeout", 5.0)
        cfg.discover_interfaces = vals.get("discover_interfaces")
        cfg.trust_job = vals.get("trust_job", False)
        cfg.job = vals.get("job")
        return cfg

    def _name(self, key: str) -> str:
        return (self.sources or {}).get(key, "--" + key.replace("_", "-"))

    def validate(self, *, resolve: bool = True) -> None:
        """Check every setting and resolve the server's host (getaddrinfo), before any connection.

        Raises:
            ConfigError: naming the variable (``--batch`` or ``TABCOHORT_BATCH``...) and its value.
        """
        t = self.trust_job
        if not isinstance(t, bool):
            v = str(t).strip().lower()
            if v not in _TRUE + _FALSE:
                raise ConfigError(self._name("trust_job"), t, "expected 1/0, true/false, yes/no or on/off")
            self.trust_job = v in _TRUE
        if self.job is not None and not str(self.job).strip():
            raise ConfigError(self._name("job"), self.job, "expected the path of your local copy of the room's job")
        if self.job is not None:
            # a local copy given as a path that is not there is named before any connection (a
            # module name is resolved later: finding it imports its parent packages)
            ref = str(self.job)
            path = ref if os.path.exists(ref) else ref.rsplit(":", 1)[0]
            if (path.endswith(".py") or os.sep in path) and not os.path.exists(path):
                raise ConfigError(self._name("job"), self.job, "no such file or package directory")
        from ..model import BACKENDS
        if self.backend not in BACKENDS:
            raise ConfigError(self._name("backend"), self.backend, f"expected one of {', '.join(BACKENDS)}")
        if self._validate_discovery(resolve=resolve):
            return  # the server is found later (discover_server), then validated again
        if not self.server:
            raise ConfigError("--server", self.server, "a server URL is needed: give --server URL or set "
                              "TABCOHORT_SERVER, or use LAN discovery (--discover / --discover-host)")
        try:   # (urlsplit and .hostname raise ValueError on a bad bracketed host: "http://[::1")
            u = urllib.parse.urlsplit(str(self.server))
            host = u.hostname
        except ValueError as e:
            raise ConfigError(self._name("server"), redact_url(self.server),
                              f"not a valid URL ({e}); expected e.g. http://127.0.0.1:8080 or http://[::1]:8080") from None
        if u.scheme not in ("http", "https", "ws", "wss") or not host:
            raise ConfigError(self._name("server"), redact_url(self.server),
                              "expected an http, https, ws or wss URL with a host, e.g. http://127.0.0.1:8080")
        try:
            given = u.port
        except ValueError:
            given = -1
        if given is not None and not 1 <= given <= 65535:   # (":0" was taken as no port: 80)
            raise ConfigError(self._name("server"), redact_url(self.server), "the port must be a number in 1..65535")
        port = given or (443 if u.scheme in ("https", "wss") else 80)
        if u.path.strip("/") or u.query or u.fragment:
            # (every endpoint is at the server's root, /api/...: a path was silently dropped)
            raise ConfigError(self._name("server"), redact_url(self.server),
                              f"give the server's root URL, without a path or query "
                              f"(e.g. {redact_url(f'{u.scheme}://{u.netloc}')}): ranks reach /api/rooms/... at its root")
        # (no room given: the rank takes the server's only room at its first request, or names
        # --room with the server's rooms: choose_room)
        if self.room and not valid_room_name(self.room):
            raise ConfigError(self._name("room"), self.room,
                              "a room name of 1..64 characters [A-Za-z0-9._-] is needed")
        if self.batch is not None:
            b = self.batch
            try:
                b = int(b) if not isinstance(b, bool) and str(b).strip().lstrip("-").isdigit() else None
            except ValueError:
                b = None
            if b is None or b < 0 or b > 2**24:
                # (a u32 on the wire; `serve` bounds a room's batch the same way)
                raise ConfigError(self._name("batch"), self.batch, f"must be an integer in [0, {2**24}] "
                                  "(0: the room's, as with `serve --batch 0`)")
            self.batch = b or None     # (0 was refused, while serve's --batch 0 meant the default)
        if self.link not in LINKS:
            raise ConfigError(self._name("link"), self.link, f"unknown link kind; expected one of {LINKS}")
        if self.token:            # ("" is no token, as the request headers treat it)
            t = self.token
            # (the server would refuse it after the job download, as "the server rejected the
            # room token"; a room token is 16..256 printable ASCII characters, serve --token)
            if not isinstance(t, str) or not 16 <= len(t) <= 256 or not all(33 <= ord(c) < 127 for c in t):
                raise ConfigError(self._name("token"), "<hidden>",
                                  "must be 16..256 printable ASCII characters (the room token serve was "
                                  "started with, --token)")
        if self.trainer_token == "" and self._name("trainer_token") == ENV["trainer_token"]:
            raise ConfigError(ENV["trainer_token"], "", EMPTY_TOKEN_VARIABLE + "; give the trainer token serve "
                              f"printed at start, or unset {ENV['trainer_token']} to join as a rank that only "
                              "contributes")
        if self.trainer_token is not None:
            t = self.trainer_token
            if not isinstance(t, str) or not 16 <= len(t) <= 256 or not all(33 <= ord(c) < 127 for c in t):
                raise ConfigError(self._name("trainer_token"), "<hidden>",
                                  "must be 16..256 printable ASCII characters (the one serve printed or "
                                  "wrote to its checkpoint directory's .trainer-token)")
        from ..bus.rtc_util import parse_ice_servers, set_host_addresses  # noqa: F401
        parse_ice_servers(self.ice_servers, self._name("ice_servers"))
        if self.rtc_hosts is not None:
            import ipaddress
            for a in str(self.rtc_hosts).split(","):
                try:
                    ipaddress.ip_address(a.strip())
                except ValueError:
                    raise ConfigError(self._name("rtc_hosts"), self.rtc_hosts,
                                      "expected comma-separated IP addresses, e.g. 127.0.0.1") from None
        try:
            t = float(self.rtc_timeout)
        except (TypeError, ValueError):
            t = math.nan
        if not (0 < t <= 600):
            raise ConfigError(self._name("rtc_timeout"), self.rtc_timeout, "must be seconds in (0, 600]")
        self.rtc_timeout = t
        self._validate_direct()
        if resolve:
            try:
                infos = socket.getaddrinfo(u.hostname, port, type=socket.SOCK_STREAM)
            except (socket.gaierror, UnicodeError) as e:
                raise ConfigError(self._name("server"), redact_url(self.server),
                                  f"host {u.hostname!r} does not resolve: {e}") from None
            if not infos:
                raise ConfigError(self._name("server"), redact_url(self.server), f"host {u.hostname!r} resolves to nothing")

    def _validate_direct(self) -> None:
        """Check the direct-path settings (an IP literal to listen on, ``IP:PORT`` to announce)."""
        import ipaddress

        from ..bus.direct import parse_addr

        d = self.direct
        if not isinstance(d, bool):
            v = str(d).strip().lower()
            if v not in _TRUE + _FALSE:
                raise ConfigError(self._name("direct"), d, "expected 1/0, true/false, yes/no or on/off")
            self.direct = v in _TRUE
        if self.direct_host is not None:
            try:
                ip = ipaddress.ip_address(str(self.direct_host).strip())
            except ValueError:
                raise ConfigError(self._name("direct_host"), self.direct_host,
                                  "expected an IP address to listen on, e.g. 127.0.0.1 or 192.0.2.7") from None
            if ip.is_multicast:
                raise ConfigError(self._name("direct_host"), self.direct_host, "a multicast address cannot listen")
            if ip.is_unspecified and self.direct_announce is None:
                raise ConfigError(self._name("direct_host"), self.direct_host,
                                  "listens on every interface but is no address a peer can dial: give this "
                                  "machine's address, or add --direct-announce IP:PORT")
            try:   # (a local bind, no traffic: an address of another machine fails here, not in every retry)
                with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET) as probe:
                    probe.bind((str(ip), 0))
            except OSError as e:
                raise ConfigError(self._name("direct_host"), self.direct_host,
                                  f"not an address of this machine, cannot listen on it ({e.strerror})") from None
            self.direct_host = str(ip)
        if self.direct_announce is not None and parse_addr(self.direct_announce) is None:
            raise ConfigError(self._name("direct_announce"), self.direct_announce,
                              "expected IP:PORT (an IP literal, a port 1..65535), e.g. 192.0.2.7:40100")
        if not self.direct:
            off = self._name("direct")
            off = "--no-direct" if off == "--direct" else off
            for key in ("direct_host", "direct_announce"):
                if getattr(self, key) is not None:
                    raise ConfigError(self._name(key), getattr(self, key),
                                      f"has no effect with direct paths off ({off})")

    def _validate_discovery(self, *, resolve: bool) -> bool:
        """Check the discovery settings; True if the server is to be discovered."""
        d = self.discover
        if not isinstance(d, bool):
            v = str(d).strip().lower()
            if v not in _TRUE + _FALSE:
                raise ConfigError(self._name("discover"), d, "expected 1/0, true/false, yes/no or on/off")
            d = v in _TRUE
        self.discover = d or self.discover_host is not None
        # (checked with or without discovery: a bad one was accepted in silence when unused)
        try:
            t = float(self.discover_timeout)
        except (TypeError, ValueError):
            t = math.nan
        if not (0 < t <= 600):
            raise ConfigError(self._name("discover_timeout"), self.discover_timeout, "must be seconds in (0, 600]")
        self.discover_timeout = t
        if not self.discover:
            return False
        if self.server:
            raise ConfigError(self._name("server"), redact_url(self.server), "give either a server URL or discovery "
                              f"({self._name('discover_host' if self.discover_host is not None else 'discover')}), not both")
        if self.room and (not all(c.isalnum() or c in "-_." for c in self.room) or len(self.room) > 64):
            raise ConfigError(self._name("room"), self.room, "a room name of 1..64 characters [A-Za-z0-9._-] is needed")
        if self.discover_interfaces is not None:
            import ipaddress
            for a in str(self.discover_interfaces).split(","):
                try:
                    if ipaddress.ip_address(a.strip()).version != 4:
                        raise ValueError
                except ValueError:
                    raise ConfigError(self._name("discover_interfaces"), self.discover_interfaces,
                                      "expected comma-separated IPv4 interface addresses, e.g. 127.0.0.1") from None
        if self.discover_host is not None:
            h = str(self.discover_host).strip()
            if not h or "/" in h or ":" in h:
                raise ConfigError(self._name("discover_host"), self.discover_host,
                                  "expected a host name or IPv4 address (no scheme or port)")
            if resolve:
                try:
                    socket.getaddrinfo(h, 5353, socket.AF_INET, socket.SOCK_DGRAM)
                except (socket.gaierror, UnicodeError) as e:
                    raise ConfigError(self._name("discover_host"), self.discover_host,
                                      f"host does not resolve to an IPv4 address: {e}") from None
        try:
            import zeroconf  # noqa: F401
        except ImportError as e:
            raise ConfigError(self._name("discover_host" if self.discover_host is not None else "discover"),
                              self.discover_host or self.discover,
                              f"LAN discovery needs the zeroconf package (pip install 'tabcohort[lan]'): {e}") from None
        return True

    def discover_server(self, progress: Callable[[str], None] | None = None) -> Any:
        """Find the server on the LAN (bounded), set ``server`` (and ``room`` if the server has
        exactly one and none was given), then validate as for a given URL.

        Raises:
            DiscoveryError: nothing answered within ``discover_timeout``.
        """
        from ..discovery import discover
        ifaces = None if self.discover_interfaces is None else \
            [a.strip() for a in str(self.discover_interfaces).split(",") if a.strip()]
        found = discover(room=self.room or None, host=self.discover_host, timeout_s=self.discover_timeout,
                         interfaces=ifaces)
        if progress:
            how = f"unicast query to {self.discover_host}" if self.discover_host else "mDNS"
            progress(f"discovered {found.name} at {found.url} by {how} (rooms {','.join(found.rooms)}, "
                     f"version {found.version or '?'})")
        self.server = found.url
        self.sources = dict(self.sources or {}, server="discovered server")
        if not self.room:
            if len(found.rooms) != 1:
                raise ConfigError("TABCOHORT_ROOM", self.room, f"the discovered server has rooms {found.rooms}; "
                                  "choose one with --room or TABCOHORT_ROOM")
            self.room = found.rooms[0]
        self.discover = False
        self.discover_host = None
        self.validate()
        return found

    @property
    def base_url(self) -> str:
        u = urllib.parse.urlsplit(self.server)
        scheme = {"ws": "http", "wss": "https"}.get(u.scheme, u.scheme)
        return f"{scheme}://{u.netloc}"

    @property
    def shown_url(self) -> str:
        """:attr:`base_url` as printed: its password, if any, hidden (``http://user:***@...``)."""
        return redact_url(self.base_url)


class RoundGaps:
    """Inter-arrival times of the rounds this rank receives (ms, monotonic clock): a count, the
    largest gaps with their wall times, and a log-spaced histogram (bins 2**(k/8) ms, about 9 %
    wide) for the median. Bounded memory, so it can live in every state report."""

    _BINS_PER_OCTAVE = 8
    _KEEP = 8

    def __init__(self) -> None:
        self.n = 0
        self._last_s: float | None = None
        self._hist: dict[int, int] = {}
        self.largest: list[tuple[float, float]] = []     # (gap_ms, wall time at its end), largest first

    def record(self, now_s: float, wall_s: float) -> None:
        if self._last_s is not None:
            gap_ms = max(0.0, (now_s - self._last_s) * 1000.0)
            self.n += 1
            k = -1000 if gap_ms <= 0 else math.floor(math.log2(gap_ms) * self._BINS_PER_OCTAVE)
            self._hist[k] = self._hist.get(k, 0) + 1
            if len(self.largest) < self._KEEP or gap_ms > self.largest[-1][0]:
                self.largest.append((gap_ms, wall_s))
                self.largest.sort(key=lambda g: -g[0])
                del self.largest[self._KEEP:]
        self._last_s = now_s

    def median_ms(self) -> float | None:
        """The median gap, to the upper edge of its histogram bin (within about 9 %)."""
        if not self.n:
            return None
        seen = 0
        for k in sorted(self._hist):
            seen += self._hist[k]
            if 2 * seen >= self.n:
                return 0.0 if k == -1000 else 2.0 ** ((k + 1) / self._BINS_PER_OCTAVE)
        return None  # pragma: no cover

    def report(self) -> dict:
        med = self.median_ms()
        return {"n": self.n, "p50_ms": None if med is None else round(med, 3),
                "largest": [[round(g, 1), round(t, 3)] for g, t in self.largest]}


class RankRun(RankSession):
    """One native rank's life: fetch job, data, checkpoint; join; report; stop."""

    def __init__(self, cfg: RankConfig, *, progress: Callable[[str], None] | None = None,
                 print_every_s: float = 0.0) -> None:
        super().__init__()
        self.cfg = cfg
        self.progress = progress or (lambda line: None)
        self.print_every_s = float(print_every_s)   # a progress line this often (0: with every report)
        self._printed: tuple = ()                     # step, leader, diverged, fault of the last line
        self._diverged_shown = 0                      # the diverged count the progress lines have said
        self._no_share_said = False                   # why a follower has no share: said once
        self._cohort_seen: int | None = None          # the cohort on the last line while running
        #: the step of this rank's last checkpoint the server stored (None: none yet), and
        #: whether its final upload was tried and not stored (its stop line says so)
        self._stored_step: int | None = None
        self._final_not_stored = False
        self._lead_shown: int | None = None           # the leader the last line named
        self._unreachable_shown = False               # the last line said the server is unreachable
        # whether each of the last 2 x NO_SHARE_LINES progress lines had no share (running)
        self._no_share_lines: deque[bool] = deque(maxlen=2 * NO_SHARE_LINES)
        self._slow_call_said = False                  # the worker's slow_call note was printed
        self._slow_evaluate_said = False              # ... and its slow_evaluate note
        self._printed_at = -math.inf
        self._lr_shown: float | None = None           # the learning rate the last line had
        self.leaders: list[list] = []       # [leader id, wall time of its first round here, step]
        self.first_loss: float | None = None
        self.round_gaps = RoundGaps()     # between rounds received from the rank this rank follows

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.cfg.token}"} if self.cfg.token else {}

    async def _open(self, http: Any, path: str, headers: dict[str, str]) -> tuple[str, Any]:
        """``GET`` the room's ``path``, following a cluster node's redirect to the room's owner
        (307, the same path at another node: README "Cluster") with the same headers: aiohttp
        drops ``Authorization`` on a redirect to another origin, so a rank of a token room
        pointed at a node that does not own it was refused its own token. Returns the URL
        answered and the response (``async with`` it)."""
        url = f"{self.cfg.base_url}/api/rooms/{self.cfg.room}{path}"
        for _ in range(_MAX_REDIRECTS):
            r = await http.get(url, headers=headers, allow_redirects=False)
            loc = r.headers.get("Location")
            if r.status not in (301, 302, 303, 307, 308) or not loc:
                return url, r
            try:
                to = node_redirect(url, loc)
            except ValueError as e:
                r.release()
                raise ConfigError(self.cfg._name("server"), self.cfg.shown_url, str(e)) from None
            if to is None:
                return url, r     # not a node's redirect of this request: answered as it is
            r.release()
            url = to
        return url, await http.get(url, headers=headers, allow_redirects=False)

    async def _get(self, http: Any, path: str) -> Any:
        headers = self._headers()
        if path == "/job" and self.cfg.trainer_token:
            # checked first, before any download (the server answers 403 "bad trainer token")
            headers["X-Tabcohort-Trainer-Token"] = self.cfg.trainer_token
        url, r = await self._open(http, path, headers)
        async with r:
            if r.status == 403:
                if "X-Tabcohort-Trainer-Token" in headers and b"trainer token" in await r.read():
                    raise ConfigError(self.cfg._name("trainer_token"), "<hidden>", TRAINER_TOKEN_REFUSED)
                if not self.cfg.token:
                    raise ConfigError(self.cfg._name("token"), "", "this room needs a token "
                                      "(--token or TABCOHORT_TOKEN)")
                raise ConfigError(self.cfg._name("token"), "<hidden>", "the server rejected the room token")
            if r.status == 404 and path != "/checkpoint":
                body = await r.read()
                if r.content_type != "application/json" or b'"error"' not in body:
                    # not a tabcohort server's answer (its 404s are JSON: {"error": ...})
                    raise ConfigError(self.cfg._name("server"), self.cfg.shown_url,
                                      f"answered {redact_url(url)} with HTTP 404 and no tabcohort error: is this the URL "
                                      "`tabcohort serve` printed?")
                names = await self._room_names(http)
                raise ConfigError(self.cfg._name("room"), self.cfg.room, "no such room on the server"
                                  + (f" (its rooms: {', '.join(names[:10])}{', ...' if len(names) > 10 else ''})"
                                     if names else ""))
            if r.status == 404:
                return None
            _raise_unless_ok(url, r)
            if path == "/checkpoint":
                return dict(r.headers), await r.read()
            return await r.json()

    async def _room_summary(self, http: Any) -> dict | None:
        """The room's public summary (``GET /api/rooms/ROOM``), or None: only a hint, never an
        error, and asked only of an open room by a rank without a room token (an open room
        answers any ``Authorization`` but the operator's with a 403 counted against the
        address, and a token room one without it: either would spend the rank's auth budget).
        A body that is not a JSON object is None (:func:`~.session.parse_room_summary`)."""
        try:
            _, r = await self._open(http, "", {})
            async with r:
                return parse_room_summary(await r.read()) if r.status == 200 else None
        except Exception:
            return None

    async def _fetch_rooms(self, http: Any) -> tuple[int, list[dict] | None]:
        """``GET /api/rooms``: its HTTP status and the rooms it lists (each a dict with a string
        ``room``), or None when the answer is not such a list (the listing is untrusted). A
        connection error is raised as is."""
        import aiohttp

        async with await http.get(f"{self.cfg.base_url}/api/rooms", headers=self._headers(),
                                  allow_redirects=False) as r:
            try:
                listed = (await r.json()).get("rooms") if r.status == 200 else None
            except (aiohttp.ContentTypeError, aiohttp.ClientPayloadError, ValueError, AttributeError):
                listed = None
            if not isinstance(listed, list):
                return r.status, None
            return r.status, [x for x in listed if isinstance(x, dict) and isinstance(x.get("room"), str)]

    async def _rooms_listed(self, http: Any) -> list[dict]:
        """The rooms ``GET /api/rooms`` lists, or [] if that fails: only a hint."""
        try:
            return (await self._fetch_rooms(http))[1] or []
        except Exception:
            return []

    async def _room_is_open(self, http: Any) -> bool:
        """Whether the server lists this rank's room as one without a token (only a hint)."""
        return any(x["room"] == self.cfg.room and x.get("token") is False for x in await self._rooms_listed(http))

    async def _room_names(self, http: Any) -> list[str]:
        """The names the server lists (a typo'd ``--room`` is told them): only valid room names
        (the listing is untrusted: nothing else reaches the console)."""
        return [x["room"] for x in await self._rooms_listed(http) if valid_room_name(x["room"])]

    def _server_setting(self) -> str:
        """Where the server URL came from: ``--server``, ``TABCOHORT_SERVER`` or discovery."""
        src = (self.cfg.sources or {}).get("server")
        return src or ("found by discovery" if self.cfg.discover else "--server")

    async def _choose_room(self, http: Any) -> None:
        """With no ``--room`` given, take the server's only room (``GET /api/rooms``), with a
        line saying so; a server with none or several is a :class:`ConfigError` naming
        ``--room`` and the rooms. A name the server lists is untrusted: only a valid room name
        counts (:func:`valid_room_name`). A connection error is raised as is (the caller retries
        a server that is still starting)."""
        status, listed = await self._fetch_rooms(http)
        if listed is None:
            raise ConfigError("--room", "", f"a room name is needed: give --room NAME or set TABCOHORT_ROOM "
                                            f"({self.cfg.shown_url} answered GET /api/rooms with HTTP {status} and "
                                            f"no list of rooms: is this the URL `tabcohort serve` printed?)")
        names = [x["room"] for x in listed if valid_room_name(x["room"])]
        if len(names) != 1:
            shown = f"its rooms: {', '.join(names[:10])}{', ...' if len(names) > 10 else ''}" if names else "it has none"
            raise ConfigError("--room", "", f"a room name is needed: give --room NAME or set TABCOHORT_ROOM "
                                            f"(the server at {self.cfg.shown_url} has {len(names)} rooms; {shown})")
        self.cfg.room = names[0]
        self.progress(f"room {self.cfg.room}: the server's only room (no --room given)")

    async def _first_get(self, http: Any, path: str, *, wait_s: float = 30.0) -> Any:
        """The first request: a server that is still starting (connection refused) is retried
        with jittered exponential backoff for at most ``wait_s`` seconds, with a progress line."""
        import aiohttp

        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + wait_s
        delay = 0.25
        while True:
            try:
                if not self.cfg.room:
                    await self._choose_room(http)
                return await self._get(http, path)
            except aiohttp.ClientConnectionError as exc:
                if isinstance(exc, aiohttp.ClientSSLError):
                    # a TLS handshake that fails is no server still starting: retrying for 30 s
                    # only hid the cause (an https:// URL for an http server, a bad certificate)
                    why = str(getattr(exc, "os_error", None) or exc).replace(" ssl:default", "")
                    hint = (f"; the server may speak plain HTTP: try http://{self.cfg.shown_url.split('://', 1)[-1]}"
                            if self.cfg.shown_url.startswith("https://") else "")
                    raise TabcohortError(f"server {self.cfg.shown_url} ({self._server_setting()}): TLS handshake "
                                         f"failed: {why}{hint}") from None
                remaining = deadline - loop.time()
                if remaining <= 0:   # (the last try is at the bound: it gave up at 28 s saying 30)
                    why = str(getattr(exc, "os_error", None) or exc).replace(" ssl:default", "")
                    raise TabcohortError(f"server {self.cfg.shown_url} ({self._server_setting()}) unreachable for "
                                         f"{loop.time() - start:.0f} s: {why}; is it running, and is the URL "
                                         f"right?") from None
                # (the reason, not only the exception's class: "ClientConnectorError" said little)
                said = getattr(getattr(exc, "os_error", None), "strerror", None) or type(exc).__name__
                self.progress(f"waiting for the server at {self.cfg.shown_url} ({said})")
                await asyncio.sleep(min(remaining, delay * random.uniform(0.5, 1.0)))
                delay = min(delay * 2, 4.0)

    async def run(self) -> int:
        """Join the room and train until stopped; returns the exit status (0, or 1 on a
        failure). SIGINT, SIGTERM and SIGHUP ask for the ordered stop once the rank has a seat
        (:func:`stop_on_signals`), and the process's own handlers are back when this returns."""
        self._restore_signals: Callable[[], None] | None = None
        try:
            return await self._run()
        finally:
            if self._restore_signals is not None:
                self._restore_signals()
            if self.bus is not None:
                # a forced stop (a second signal) leaves through here as the loop cancels this
                # task: the bus's socket and its HTTP session were left open ("Unclosed client
                # session" on the console). Closed here, bounded (the normal path closed it already:
                # then this is a no-op)
                try:
                    await asyncio.wait_for(self.bus.aclose(), BUS_CLOSE_BOUND_S)
                except (asyncio.TimeoutError, asyncio.CancelledError, OSError):
                    pass

    async def _run(self) -> int:
        import aiohttp

        from ..bus.aio import ws_url
        from ..vec import digest

        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self.stop_event = asyncio.Event()
        async with aiohttp.ClientSession() as http:
            job = await self._first_get(http, "/job")
            check_topology(job, "this rank")
            # (a new-user trial: a rank joining a finished room fetched the job, its data and the
            # checkpoint before its welcome said so)
            finished = finished_room_message(await self._room_summary(http)) if not self.cfg.token else None
            if self.cfg.token and await self._room_is_open(http):
                # (a rank given a token for an open room joined without a word: its user took
                # the room for a protected one, a new-user trial)
                self.progress(f"note: room {self.cfg.room} is open (serve gave it no --token): the token given "
                              f"({self.cfg._name('token')}) is not checked, and anyone with the URL may join")
            if finished is not None:
                self.progress(finished)
                return 0
            # never the server's code without the user's say (README "Trust model for job code")
            worker, jh = await self._module_worker(http, job)
            got = await self._get(http, "/checkpoint")
            if got is not None:
                headers, data = got
                self.start_from_checkpoint(worker, job, headers, data)
                self.progress(f"loaded checkpoint {headers.get('X-Tabcohort-Checkpoint', '')} at step {self.start_step} "
                              f"({headers.get('X-Tabcohort-Digest', '')[:12]})")

            while True:  # one pass per seat: a refused resume joins again as a new rank
                bus = self.bus = self._make_bus(job, ws_url(cfg.base_url, cfg.room))
                await bus.connect()
                if bus.stopped_reason is not None or self.stop_event.is_set():
                    # (the room had stopped before this rank joined: told so with its welcome)
                    self.progress(f"stopped ({self.stop_reason or f'server: {bus.stopped_reason}'}) before "
                                  "joining the cohort")
                    await bus.aclose()
                    # (a rejoin's welcome can name another job: the run failed, as after a seat)
                    return 1 if self.failed else 0
                machine, driver = self.seat(bus, worker, job, jh)
                inner = bus.on_message

                def tap(msg: dict) -> None:
                    if msg.get("t") == "round":
                        k = msg["from"]
                        if msg.get("assign"):
                            self.round_gaps.record(time.monotonic(), time.time())
                        self.saw_round(msg)
                        if not self.leaders or self.leaders[-1][0] != k:
                            self.leaders.append([k, time.time(), int(msg["step"])])
                            del self.leaders[:-20]
                        loss = msg.get("loss")
                        if self.first_loss is None and isinstance(loss, float) and math.isfinite(loss):
                            self.first_loss = loss
                    inner(msg)
                bus.on_message = tap
                if self._restore_signals is None:
                    self._restore_signals = stop_on_signals(loop, self.request_stop)
                self.progress(f"rank {bus.id:08x} joined room {cfg.room} ({worker.backend}, batch {worker.batch}, "
                              f"bucket_len {worker.bucket_len}; role: "
                              f"{'may lead' if machine.may_lead else 'contributes only (no trainer token)'})")
                driver.start(self.job_lr(job))
                t0 = time.monotonic()
                next_ckpt = time.monotonic() + job["checkpoint_interval_s"]
                period = job["report_interval_s"]
                next_report = time.monotonic() + period
                # (the first line after one period, as the first report: a line at once showed
                # "leader -" and, on a contributor, the false "waiting for a rank that may lead")
                if self.print_every_s > 0:
                    self._printed_at = time.monotonic()
                while not self.stop_event.is_set():
                    try:
                        await asyncio.wait_for(self.stop_event.wait(), min(period, LEAD_CHECK_S))
                    except asyncio.TimeoutError:
                        pass
                    now = time.monotonic()
                    if machine.running:
                        # (the stop line says the cohort the rank trained in, as this rank saw it)
                        self._cohort_seen = len(machine.cohort_ids(driver.now_ms()))
                    # (a rank that began to lead reports at once: docs/PROTOCOL.md "Roles")
                    began = self.lead_began(machine, driver)
                    report_due = now >= next_report or began
                    # progress lines keep their own period: a room reporting every 30 s left a
                    # rank's console silent as long
                    print_due = (now - self._printed_at >= self.print_every_s if self.print_every_s > 0
                                 else report_due)
                    if report_due or print_due:
                        # (the parameters' digest, a hash of every value, only for a report)
                        st = self._state(driver, digest if report_due else None)
                        if report_due:
                            next_report = now + period
                            bus.send_control({"type": "report", "state": st})
                        if print_due:
                            self._printed_at = now
                            self._print(now - t0, st)
                    if getattr(worker, "slow_call", None) and not self._slow_call_said:
                        from ..jobs.worker import slow_call_note
                        self._slow_call_said = True
                        self.progress(f"warning: {slow_call_note(worker.slow_call)}")
                    if getattr(worker, "slow_evaluate", None) and not self._slow_evaluate_said:
                        from ..jobs.worker import is_builtin, slow_evaluate_note
                        self._slow_evaluate_said = True
                        # (the built-in job's user never wrote an evaluate() to make faster)
                        self.progress(f"warning: {slow_evaluate_note(worker.slow_evaluate, builtin=is_builtin(worker))}")
                    if machine.looping and time.monotonic() >= next_ckpt:
                        next_ckpt = time.monotonic() + job["checkpoint_interval_s"]
                        await self._upload(http, bus, machine, worker, digest, final=False)
                if not self.rejoin:
                    break
                # the server no longer knows this id (it restarted without its checkpoint
                # directory, or the grace period ran out): join again as a new rank, keeping the
                # worker's parameters and the step; the next round (or, when no rank is ready,
                # the bootstrap: PROTOCOL.md "Joining") syncs it
                self.rejoined(machine)
                self._stored_step = None            # (the server that refused the seat may not hold it)
                await driver.close()
                await bus.aclose()
                self.progress(f"rank {bus.id:08x}: the server refused its resume; rejoining as a new rank "
                              f"at step {self.start_step}")

            def final_report() -> dict:
                st = self._state(driver, digest)
                st["final"] = True
                bus.send_control({"type": "report", "state": st})
                return st
            st = await self.leave(machine, driver, bus, final_report=final_report,
                                  upload=lambda final: self._upload(http, bus, machine, worker, digest, final=final))
            # (the stop line says the cohort the rank trained in: the larger of what its roster held
            # when last read while it ran and what its last round said. A run shorter than
            # --print-every printed no line while running and said "cohort 0"; a follower's roster
            # may not yet hold a leader whose first beat it has not heard, nor a leader's round
            # count a follower whose first beat it has not heard)
            if machine.round_cohort:
                self._cohort_seen = max(machine.round_cohort, self._cohort_seen or 0)
            if self.final_upload_skipped:
                self._final_not_stored = True
            self._print(time.monotonic() - t0, st, unless_same=True)
            behind = behind_step_limit(machine.step, machine.step_limit, str(self.stop_reason))
            self.progress(f"stopped ({self.stop_reason}); step {machine.step}{behind}, digest {st['digest'][:16]}"
                          + self._not_stored_note(machine.step))
            await driver.close()
            await bus.aclose()
        return 1 if self.failed else 0

    async def _module_worker(self, http: Any, job: dict) -> tuple[Any, str]:
        """The job's worker: the local copy (``--job``, its hash checked first), the rank's own
        copy of the built-in job, or, with ``--trust-job``, the server's code; then the data
        (sha256 checked) and the job hash.

        Raises:
            ConfigError: neither option given, or the local copy's hash differs (before any
                code is fetched or run).
        """
        from ..jobs import load_bundle
        cfg = self.cfg
        info = job["job_info"]
        accepts, works = info.get("accepts"), info.get("backends")
        b = cfg.backend
        if b != "auto" and ((isinstance(accepts, list) and b not in accepts)
                            or (accepts is None and isinstance(works, list) and b not in works)):
            # (said after the job's data had downloaded, naming 'backend': a new-user trial)
            raise ConfigError(cfg._name("backend"), b, f"the room's job {info.get('name')!r} runs on "
                              f"{', '.join(map(str, accepts if isinstance(accepts, list) else works))}")
        src = trusted_job_source(info, trust=cfg.trust_job, local=cfg.job,
                                 trust_var=cfg._name("trust_job"), job_var=cfg._name("job"))
        if src is None:
            self.progress(f"fetching job {info['name']} from the server ({info['code_bytes']} bytes, "
                          f"sha256 {info['code_sha256'][:16]}; --trust-job)")
            src = load_bundle(await self._get_bytes(http, "/job/code"), expect_sha256=info["code_sha256"])
        self.progress(f"fetching the job's data ({info['data_bytes']} bytes, sha256 {info['data_sha256'][:16]})")
        raw = await self._get_bytes(http, "/job/data")
        return await make_module_worker(job, src, raw, batch=cfg.batch, backend=cfg.backend)

    async def _get_bytes(self, http: Any, path: str) -> bytes:
        url, r = await self._open(http, path, self._headers())
        async with r:
            _raise_unless_ok(url, r)
            return await r.read()

    def _make_bus(self, job: dict, url: str) -> Any:
        """The room decides the topology; in a star the rank picks its link (ws | rtc) and,
        over ws, direct TCP paths to the other native ranks (unless ``direct`` is off)."""
        from ..bus.aio import direct_bus, mesh_bus, star_bus

        cfg = self.cfg
        common = dict(token=cfg.token, trainer_token=cfg.trainer_token, precision=job["precision"],
                      on_control=self.on_control)
        hosts = None if cfg.rtc_hosts is None else [a.strip() for a in str(cfg.rtc_hosts).split(",") if a.strip()]
        rtc = dict(ice_servers=cfg.ice_servers, host_addresses=hosts, connect_timeout_s=cfg.rtc_timeout)
        if job.get("topology") == "mesh":
            # idle bound: a few beats' worth (beats go out every policy.beat while a rank runs)
            beat_s = float(job["timing"].get("beat_ms", 400.0)) / 1000.0
            return mesh_bus(url, idle_timeout_s=max(5.0, 10 * beat_s), **rtc, **common)
        if cfg.link == "ws" and cfg.direct:
            beat_s = float(job["timing"].get("beat_ms", 400.0)) / 1000.0
            return direct_bus(url, direct_host=cfg.direct_host, direct_announce=cfg.direct_announce,
                              idle_timeout_s=max(5.0, 10 * beat_s), **common)
        if cfg.link == "ws":
            return star_bus(url, **common)
        return star_bus(url, link="rtc", **rtc, **common)

    def _state(self, driver: Any, digest: Callable[[Any], str] | None) -> dict:
        st = driver.state()
        st.pop("peers", None)
        st["digest"] = None if digest is None else digest(driver.worker.params())
        st["pid"] = os.getpid()
        st["kind"] = "native"
        st["leaders"] = self.leaders
        st["first_loss"] = self.first_loss
        st["start_step"] = self.start_step
        st["rejoins"] = self.n_rejoins
        st["round_gaps"] = self.round_gaps.report()
        st.update(path_report(driver.bus))
        # (a bus that gave up, or was closed for good, is not reconnecting: its stop line says why)
        st["server_connected"] = bool(driver.bus.connected) or driver.bus.failed is not None
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in st.items()}

    def _print(self, t: float, st: dict, *, unless_same: bool = False) -> None:
        """A progress line; with ``unless_same``, none when the last one had the same step,
        leader, divergence count and fault (the stop's line after a periodic one)."""
        lead = st.get("leader")
        loss = st.get("loss")
        acc = st.get("accuracy")
        key = (st["step"], lead, st.get("diverged"), st.get("fault"))
        if unless_same and key == self._printed:
            return
        self._printed = key
        # refused rounds since the line before: a few NaN batches long ago put "DIVERGED x4" on
        # every line of a run that trained on (a new-user trial)
        n_div = st.get("diverged") or 0
        # (a count below the last one is a new seat's machine, counting from 0 again)
        new_div = n_div - self._diverged_shown if n_div >= self._diverged_shown else n_div
        self._diverged_shown = n_div
        me = bool(st.get("is_leader")) or (lead is not None and lead == st.get("id"))
        # a stopped rank is in no cohort: its stop line says the one it last trained in, not 0
        cohort = st["cohort"]
        if st.get("running", True):
            self._cohort_seen = cohort
        elif self._cohort_seen is not None:
            cohort = self._cohort_seen
        # a takeover and a server back are said, not only seen in the columns (a new-user trial:
        # "leader 39c374b2" became "leader 7e35d528 (me)" and the unreachable note just went away)
        was, self._lead_shown = self._lead_shown, lead if lead is not None else self._lead_shown
        changed = f"  (leader changed: was {was:08x})" if was is not None and lead is not None and lead != was else ""
        # (an operator's POST .../lr changed the rate with no word on any rank's console: a
        # new-user trial; the round carries it, so every rank of the cohort says it)
        lr = st.get("lr")
        lr_was, self._lr_shown = self._lr_shown, lr if isinstance(lr, (int, float)) else self._lr_shown
        lr_note = (f"  (learning rate now {lr:g}, was {lr_was:g})"
                   if isinstance(lr, (int, float)) and lr_was is not None and lr != lr_was else "")
        unreachable = st.get("server_connected") is False
        # (not on a stop line: a bus that gave up reconnecting counts as "connected" there)
        back = ("  (the server is reachable again)" if self._unreachable_shown and not unreachable
                and st.get("running", True) else "")
        self._unreachable_shown = unreachable
        # (a leader no longer heard is no leader: a contributor whose trainer had left named it on
        # every line while it said it waited for a rank that may lead, a new-user trial)
        # (but a stopped leader's own line names it: "leader - (me)" said no leader was heard)
        shown = None if st.get("leader_live") is False and not me else lead
        self.progress(f"[{t:6.1f}s] step {st['step']:6d}  leader {'-' if shown is None else f'{shown:08x}'}"
                      f"{' (me)' if me else '     '}"
                      f"  cohort {cohort}{_share_text(st)}  "
                      f"loss {'n/a' if loss is None else f'{loss:.4f}'}  "
                      f"acc {_acc_text(acc, st, me=me)}  {st['steps_per_s']:6.1f} steps/s"
                      + changed + lr_note + back
                      + ("  (server unreachable: reconnecting; the rank stops if it is not back within "
                         "the reconnect bound, README \"Stopping\")" if unreachable else "")
                      + self._no_share_note(st)
                      + (f"  DIVERGED x{new_div} since the last line ({n_div} in all): {st.get('fault')}"
                         if new_div > 0 else "")
                      + _below_global_batch(st)
                      + ("  (no majority of the room's members in view: no round commits until they are "
                         "back; docs/PROTOCOL.md \"Membership and majority\")"
                         if st.get("is_leader") and st.get("majority") is False else "")
                      + ("  (waiting for a rank that may lead: start one with --trainer-token, which "
                         "`tabcohort serve` prints at start, and keeps in CHECKPOINT_DIR/.trainer-token when "
                         "it has a --checkpoint-dir; README \"Roles\")"
                         if (lead is None or st.get("leader_live") is False) and st.get("may_lead") is False
                         else ""))

    def _no_share_note(self, st: dict) -> str:
        """Once per run, why a follower has no share on NO_SHARE_LINES of its last 2 x
        NO_SHARE_LINES progress lines (PROTOCOL.md "Shares"): it is not idle, the
        others finish the global batch before one bucket of it would arrive (a new-user trial
        read the demo's "share 0" as a rank doing nothing)."""
        zero = bool(st.get("running") and not st.get("is_leader") and _own_share(st) == 0)
        self._no_share_lines.append(zero)
        # (a rank just joined is not measured yet, and one quarantined or on probation has no
        # share for another reason: only lines without one again and again are this. Not in a
        # row: a slow rank's one-sample probes show as "share 1/64" on some of its lines, and a
        # new-user trial's pure-Python follower, none of whose samples was ever applied, was
        # never told)
        if self._no_share_said or sum(self._no_share_lines) < NO_SHARE_LINES:
            return ""
        self._no_share_said = True
        return ("  (no share: the other ranks finish the global batch before one bucket of this rank would "
                "reach the leader (its compute and its path there); it follows every round, is probed with a "
                "sample now and then, and gets a share when a round's compute outweighs that trip: a larger "
                "--global-batch or model)")

    def _not_stored_note(self, step: int) -> str:
        """What the stop line of a rank whose final checkpoint upload failed adds (a new-user
        trial: a server stopped mid-run, the rank trained alone for 30 s, and 13,168 steps were
        gone with no word); empty otherwise."""
        if not self._final_not_stored:
            return ""
        last = (f"the last this rank stored is of step {self._stored_step}" if self._stored_step is not None
                else "this rank stored no checkpoint")
        return (f"; its final checkpoint (step {step}) was NOT stored (the server was unreachable or refused "
                f"it); {last} (README \"Stopping\")")

    async def _upload(self, http: Any, bus: Any, machine: Any, worker: Any, digest: Callable, *, final: bool) -> None:
        up = checkpoint_upload(machine, worker, bus, self.progress, final=final)
        if up is None:
            return
        import aiohttp

        data, h = up[0], {**self._headers(), **up[1]}
        step = machine.step
        # the node the bus is linked to now (a cluster moves it to the room's owner): no redirect
        url = f"{bus.server_base}/api/rooms/{self.cfg.room}/checkpoint"
        status = 0      # (409: the room holds a newer checkpoint already, stored by another)
        try:
            async with http.put(url, data=data, headers=h) as r:
                status = r.status
                if r.status not in (200, 409):
                    self.progress(f"checkpoint upload: HTTP {r.status} {await r.text()}")
        except aiohttp.ClientSSLError as e:
            print(f"checkpoint upload failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            # (a new-user trial saw "ClientConnectorError: Cannot connect to host ... ssl:default")
            print(f"checkpoint upload failed: the server at {redact_url(bus.server_base)} is unreachable "
                  f"({type(e).__name__}); training goes on", file=sys.stderr, flush=True)
        except Exception as e:  # a failed upload must not stop training
            print(f"checkpoint upload failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if status == 200:
            self._stored_step = step
        if final:
            self._final_not_stored = status not in (200, 409)


def node_redirect(url: str, location: str) -> str | None:
    """Where a cluster node's redirect (README "Cluster") of a ``GET`` of ``url`` sends it: the
    same path at another node. ``None`` when ``location`` is not such a redirect (another path,
    another scheme than http/https): the response is then answered as it is.

    Raises:
        ValueError: the redirect leaves https for http. The rank re-sends its token and trainer
            token on a redirect (aiohttp drops them across origins), so it would send them in
            clear.
    """
    to = urllib.parse.urljoin(url, location)
    u, frm = urllib.parse.urlsplit(to), urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or u.path != frm.path:
        return None
    if frm.scheme == "https" and u.scheme == "http":
        raise ValueError(f"{redact_url(url)} redirected to {redact_url(to)}: refused, the room's credentials would go in clear "
                         "(give that node an https --advertise-url)")
    return to


def _raise_unless_ok(url: str, r: Any) -> None:
    """A GET's answer other than 200 as a TabcohortError; a 429 says it is the server's lockout
    after failed token checks (README "Limits") and when to try again."""
    if r.status == 429:
        raise TabcohortError(
            f"GET {redact_url(url)}: HTTP 429: the server refuses this address after too many failed token checks "
            f"from it (every rank on this host shares the address); try again in "
            f"{r.headers.get('Retry-After', 'a few')} s, with the right token")
    if r.status != 200:
        raise TabcohortError(f"GET {redact_url(url)}: HTTP {r.status}")


#: progress lines in a row with no share before a follower says why (about as many seconds)
NO_SHARE_LINES = 5


def _own_share(st: dict) -> int | None:
    """This rank's share of the last round in samples (0: none), or None before any round
    (PROTOCOL.md "Shares")."""
    shares = st.get("shares")
    if not st.get("global_batch") or not isinstance(shares, dict) or not shares or not isinstance(st.get("id"), int):
        return None
    mine = shares.get(f"{st['id']:08x}")
    return mine if isinstance(mine, int) else 0


def _share_text(st: dict) -> str:
    """``  share S/G`` for a progress line; empty before any round."""
    mine = _own_share(st)
    return "" if mine is None else f"  share {mine}/{st['global_batch']}"


def _below_global_batch(st: dict) -> str:
    """A leader's note when its last round covered less than the global batch (PROTOCOL.md
    "Shares": the ranks' caps, or ranks still being measured); empty otherwise."""
    gb, shares = st.get("global_batch"), st.get("shares") or {}
    if not st.get("is_leader") or not gb or not shares:
        return ""
    covered = sum(v for v in shares.values() if isinstance(v, int))
    if covered >= gb:
        return ""
    return (f"  (rounds cover {covered} of the global batch {gb}: the ranks' --batch caps sum to less, or "
            f"ranks are still being measured; README \"Shares\")")


def behind_step_limit(step: int, step_limit: int | None, reason: str) -> str:
    """What a rank's stop line adds when the room stopped at its step limit (the server's
    ``steps N reached``, or this rank's own ``step limit N reached``) and this rank's ``step``
    is short of it: its parameters are not the final checkpoint's. A trial's overloaded follower
    said "stopped (step limit 10 reached); step 7" and no more. Else ``""``."""
    if step_limit is None or step >= step_limit or not (
            "step limit" in reason or re.search(r"\bsteps \d+ reached", reason)):
        return ""
    return f" (behind the room's step limit {step_limit}: this rank's parameters are not the final checkpoint's)"


def _acc_text(acc: float | None, st: dict, *, me: bool = False) -> str:
    """Held-out accuracy for a progress line; a follower says why it has none (only the leader
    evaluates held-out accuracy: PROTOCOL.md, "State report"). ``me``: this rank leads, or led
    until it stopped (its stop line is not a follower's)."""
    if acc is not None and (me or st.get("is_leader") or not st.get("running", True)):
        return f"{acc * 100:5.1f}%"    # (a running follower's is its last lead's: stale)
    if (st.get("counters") or {}).get("evaluate_out_of_range"):
        # "Worker contract": the job's evaluate() gave a value that is no accuracy
        return "n/a (the job's evaluate() returned a value outside [0, 1]: fix the job)"
    return "n/a (evaluated by the leader)" if st.get("ready") and not st.get("is_leader") and not me else "n/a"


def cfg_links() -> tuple[str, ...]:
    return LINKS


async def run_rank(cfg: RankConfig, *, progress: Callable[[str], None] | None = None,
                   print_every_s: float = 0.0) -> int:
    """Run one native rank until the room stops, the rank is signalled, or its link fails.

    Args:
        print_every_s: a progress line every this many seconds (0: with every state report).
    """
    return await RankRun(cfg, progress=progress, print_every_s=print_every_s).run()

