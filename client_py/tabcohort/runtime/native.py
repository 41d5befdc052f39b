"""A native rank over a real transport: ``tabcohort rank --server URL --room NAME``.

Bring-up (PROTOCOL.md, "Native bring-up"): configuration from arguments or the environment
(``TABCOHORT_SERVER``, ``TABCOHORT_ROOM``, ``TABCOHORT_TOKEN``, ``TABCOHORT_BATCH``,
``TABCOHORT_LINK``) is validated, and the server's host resolved, before any connection; then the
rank fetches the job and the dataset (verifying the dataset's content hash and the job hash
itself), loads the room's latest checkpoint if there is one (every rank does, so whichever rank
bootstraps drives from it), joins over the star relay, reports its state every
``report_interval_s``, uploads checkpoints while it leads, and stops when the server says so.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import signal
import socket
import sys
import time
import urllib.parse
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import ConfigError, TabcohortError

LINKS = ("ws", "rtc")
ENV = {"server": "TABCOHORT_SERVER", "room": "TABCOHORT_ROOM", "token": "TABCOHORT_TOKEN",
       "batch": "TABCOHORT_BATCH", "link": "TABCOHORT_LINK", "ice_servers": "TABCOHORT_ICE_SERVERS",
       "rtc_hosts": "TABCOHORT_RTC_HOSTS", "rtc_timeout": "TABCOHORT_RTC_TIMEOUT",
       "discover": "TABCOHORT_DISCOVER", "discover_host": "TABCOHORT_DISCOVER_HOST",
       "discover_timeout": "TABCOHORT_DISCOVER_TIMEOUT", "discover_interfaces": "TABCOHORT_DISCOVER_INTERFACES"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass
class RankConfig:
    """A native rank's settings. Build with :meth:`from_sources`, then :meth:`validate`."""

    server: str = ""
    room: str = ""
    token: str | None = None
    batch: int | None = None
    link: str = "ws"
    backend: str = "auto"
    #: WebRTC (mesh rooms, or ``link="rtc"`` in star rooms): STUN/TURN URLs (comma-separated;
    #: none by default), ICE host addresses (``None`` = aioice's list; ``127.0.0.1`` for a
    #: loopback-only host) and the bound in seconds on a channel coming up before the relay is used.
    ice_servers: str | None = None
    rtc_hosts: str | None = None
    rtc_timeout: Any = 5.0
    #: LAN discovery instead of a server URL: an mDNS browse (``discover``), or unicast DNS-SD
    #: queries to ``discover_host``'s mDNS port; bounded by ``discover_timeout`` seconds.
    discover: Any = False
    discover_host: str | None = None
    discover_timeout: Any = 5.0
    discover_interfaces: str | None = None
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
                vals[key], src[key] = args[key], f"--{key}"
            elif env.get(var) not in (None, ""):
                vals[key], src[key] = env[var], var
        cfg = cls(server=vals.get("server", ""), room=vals.get("room", ""), token=vals.get("token"),
                  link=vals.get("link", "ws"), backend=args.get("backend") or "auto", sources=src)
        cfg.batch = vals.get("batch")  # validated (int) in validate()
        cfg.ice_servers = vals.get("ice_servers")
        cfg.rtc_hosts = vals.get("rtc_hosts")
        cfg.rtc_timeout = vals.get("rtc_timeout", 5.0)
        cfg.discover = vals.get("discover", False)
        cfg.discover_host = vals.get("discover_host")
        cfg.discover_timeout = vals.get("discover_timeout", 5.0)
        cfg.discover_interfaces = vals.get("discover_interfaces")
        return cfg

    def _name(self, key: str) -> str:
        return (self.sources or {}).get(key, f"--{key}")

    def validate(self, *, resolve: bool = True) -> None:
        """Check every setting and resolve the server's host (getaddrinfo), before any connection.

        Raises:
            ConfigError: naming the variable (``--batch`` or ``TABCOHORT_BATCH``...) and its value.
        """
        if self._validate_discovery(resolve=resolve):
            return  # the server is found later (discover_server), then validated again
        if not self.server:
            raise ConfigError("--server", self.server, "a server URL is needed: give --server URL or set "
                              "TABCOHORT_SERVER, or use LAN discovery (--discover / --discover-host)")
        u = urllib.parse.urlsplit(str(self.server))
        if u.scheme not in ("http", "https", "ws", "wss") or not u.hostname:
            raise ConfigError(self._name("server"), self.server,
                              "expected a URL with scheme and host, e.g. http://127.0.0.1:8080")
        try:
            port = u.port or (443 if u.scheme in ("https", "wss") else 80)
        except ValueError:
            raise ConfigError(self._name("server"), self.server, "the port is not a number in 0..65535") from None
        if not self.room or not all(c.isalnum() or c in "-_." for c in self.room) or len(self.room) > 64:
            if not self.room:
                raise ConfigError("--room", self.room, "a room name is needed: give --room NAME or set "
                                  "TABCOHORT_ROOM (1..64 characters [A-Za-z0-9._-])")
            raise ConfigError(self._name("room"), self.room,
                              "a room name of 1..64 characters [A-Za-z0-9._-] is needed")
        if self.batch is not None:
            b = self.batch
            try:
                b = int(b) if not isinstance(b, bool) and str(b).strip().lstrip("-").isdigit() else None
            except ValueError:
                b = None
            if b is None or b < 1:
                raise ConfigError(self._name("batch"), self.batch, "must be an integer >= 1")
            self.batch = b
        if self.link not in LINKS:
            raise ConfigError(self._name("link"), self.link, f"unknown link kind; expected one of {LINKS}")
        from ..bus.rtc_util import parse_ice_servers, set_host_addresses  # noqa: F401
        parse_ice_servers(self.ice_servers)
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
        if resolve:
            try:
                infos = socket.getaddrinfo(u.hostname, port, type=socket.SOCK_STREAM)
            except (socket.gaierror, UnicodeError) as e:
                raise ConfigError(self._name("server"), self.server,
                                  f"host {u.hostname!r} does not resolve: {e}") from None
            if not infos:
                raise ConfigError(self._name("server"), self.server, f"host {u.hostname!r} resolves to nothing")

    def _validate_discovery(self, *, resolve: bool) -> bool:
        """Check the discovery settings; True if the server is to be discovered."""
        d = self.discover
        if not isinstance(d, bool):
            v = str(d).strip().lower()
            if v not in _TRUE + _FALSE:
                raise ConfigError(self._name("discover"), d, "expected 1/0, true/false, yes/no or on/off")
            d = v in _TRUE
        self.discover = d or self.discover_host is not None
        if not self.discover:
            return False
        if self.server:
            raise ConfigError(self._name("server"), self.server, "give either a server URL or discovery "
                              f"({self._name('discover_host' if self.discover_host is not None else 'discover')}), not both")
        try:
            t = float(self.discover_timeout)
        except (TypeError, ValueError):
            t = math.nan
        if not (0 < t <= 600):
            raise ConfigError(self._name("discover_timeout"), self.discover_timeout, "must be seconds in (0, 600]")
        self.discover_timeout = t
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


class RankRun:
    """One native rank's life: fetch job, data, checkpoint; join; report; stop."""

    def __init__(self, cfg: RankConfig, *, progress: Callable[[str], None] | None = None,
                 print_every_s: float = 0.0) -> None:
        self.cfg = cfg
        self.progress = progress or (lambda line: None)
        self.print_every_s = float(print_every_s)   # progress lines at most this often (0: every report)
        self._printed_at = -math.inf
        self.stop_event: asyncio.Event | None = None
        self.stop_reason: str | None = None
        self.failed: str | None = None
        self.leaders: list[list] = []       # [leader id, wall time of its first round here, step]
        self.first_loss: float | None = None
        self.publish_seen = False
        self.start_step = 0
        self.driver: Any = None
        self.rejoin = False
        self.n_rejoins = 0
        self.round_gaps = RoundGaps()     # between rounds received from the rank this rank follows

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.cfg.token}"} if self.cfg.token else {}

    async def _get(self, http: Any, path: str) -> Any:
        url = f"{self.cfg.base_url}/api/rooms/{self.cfg.room}{path}"
        async with http.get(url, headers=self._headers()) as r:
            if r.status == 403:
                if not self.cfg.token:
                    raise ConfigError(self.cfg._name("token"), "", "this room needs a token "
                                      "(--token or TABCOHORT_TOKEN)")
                raise ConfigError(self.cfg._name("token"), "<hidden>", "the server rejected the room token")
            if r.status == 404 and path != "/checkpoint":
                raise ConfigError(self.cfg._name("room"), self.cfg.room, "no such room on the server")
            if r.status == 404:
                return None
            if r.status != 200:
                raise TabcohortError(f"GET {url}: HTTP {r.status}")
            if path == "/checkpoint":
                return dict(r.headers), await r.read()
            return await r.json()

    async def _first_get(self, http: Any, path: str, *, wait_s: float = 30.0) -> Any:
        """The first request: a server that is still starting (connection refused) is retried
        with jittered exponential backoff for at most ``wait_s`` seconds, with a progress line."""
        import aiohttp

        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        delay = 0.25
        while True:
            try:
                return await self._get(http, path)
            except aiohttp.ClientConnectionError as exc:
                if loop.time() + delay > deadline:
                    raise TabcohortError(f"server {self.cfg.base_url} unreachable for {wait_s:g} s: {exc}") from None
                self.progress(f"waiting for the server at {self.cfg.base_url} ({type(exc).__name__})")
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, 4.0)

    async def run(self) -> int:
        import aiohttp

        from ..bus.ws import WsBus, ws_url
        from ..model import Dataset, make_worker
        from ..protocol import RankMachine, Timing, job_hash
        from ..vec import digest
        from .driver import RankDriver

        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self.stop_event = asyncio.Event()
        async with aiohttp.ClientSession() as http:
            job = await self._first_get(http, "/job")
            if job.get("topology") not in ("star", "mesh"):
                raise ConfigError("topology", job.get("topology"), "this rank supports the star and mesh topologies")
            portable = await self._get(http, "/dataset")
            ds = Dataset.from_portable(portable)  # verifies the embedded sha256 against the content
            want = job["dataset_info"]["sha256"]
            if ds.content_hash() != want:
                raise TabcohortError(f"dataset content hash {ds.content_hash()} != the job's {want}")
            m = job["model"]
            worker = make_worker(ds, hidden=tuple(job["hidden"]), batch=cfg.batch or job["batch"],
                                 seed=job["seed"], backend=cfg.backend, activation=job["activation"])
            jh = job_hash(worker.spec(), ds.content_hash(), worker.bucket_len)
            if jh != job["job_hash"] or m.get("bucket_len") != worker.bucket_len:
                raise TabcohortError(f"job hash {jh} != the server's {job['job_hash']}: different model code?")
            got = await self._get(http, "/checkpoint")
            if got is not None:
                headers, data = got
                import hashlib
                if len(data) != 4 * worker.bucket_len or hashlib.sha256(data).hexdigest() != headers.get(
                        "X-Tabcohort-Digest"):
                    raise TabcohortError("the server's checkpoint is corrupt (length or digest mismatch)")
                v = array("f")
                v.frombytes(data)
                worker.set_params(v)
                self.start_step = int(headers.get("X-Tabcohort-Step", "0"))
                self.progress(f"loaded checkpoint at step {self.start_step} ({headers.get('X-Tabcohort-Digest', '')[:12]})")

            while True:  # one pass per seat: a refused resume joins again as a new rank
                bus = self._make_bus(job, ws_url(cfg.base_url, cfg.room))
                await bus.connect()
                if bus.stopped_reason is not None or self.stop_event.is_set():
                    self.progress(f"room already stopped: {bus.stopped_reason}")
                    await bus.aclose()
                    return 0
                timing = Timing(**job["timing"])
                machine = RankMachine(bus.id, worker, bus, job=jh, now_ms=RankDriver.clock_ms(loop), timing=timing,
                                      lr=job["lr"], eval_every=job["eval_every"], precision=job["precision"],
                                      collect_rule=job.get("collect_rule", "quorum"),
                                      global_batch=job.get("global_batch"), step_limit=_step_limit(job))
                if self.start_step:
                    machine.step = self.start_step

                def at_limit(_state: dict, machine: Any = machine) -> None:  # stopped at the job's step limit
                    if machine.at_step_limit and not machine.running:
                        self._request_stop(f"step limit {machine.step_limit} reached")
                driver = self.driver = RankDriver(machine, worker, bus, on_report=at_limit)
                inner = bus.on_message

                def tap(msg: dict) -> None:
                    if msg.get("t") == "round":
                        k = msg["from"]
                        if msg.get("assign"):
                            self.round_gaps.record(time.monotonic(), time.time())
                        if not self.leaders or self.leaders[-1][0] != k:
                            self.leaders.append([k, time.time(), int(msg["step"])])
                            del self.leaders[:-20]
                        loss = msg.get("loss")
                        if self.first_loss is None and isinstance(loss, float) and math.isfinite(loss):
                            self.first_loss = loss
                        if not msg.get("assign"):
                            self.publish_seen = True
                    inner(msg)
                bus.on_message = tap
                for sig in (signal.SIGTERM, signal.SIGINT):
                    try:
                        loop.add_signal_handler(sig, self._request_stop, f"signal {sig.name}")
                    except (NotImplementedError, RuntimeError):  # pragma: no cover
                        pass
                self.progress(f"rank {bus.id:08x} joined room {cfg.room} ({worker.backend}, batch {worker.batch}, "
                              f"bucket_len {worker.bucket_len})")
                driver.start(job["lr"])
                t0 = time.monotonic()
                next_ckpt = time.monotonic() + job["checkpoint_interval_s"]
                period = job["report_interval_s"]
                while not self.stop_event.is_set():
                    try:
                        await asyncio.wait_for(self.stop_event.wait(), period)
                    except asyncio.TimeoutError:
                        pass
                    st = self._state(driver, digest)
                    bus.send_control({"type": "report", "state": st})
                    if time.monotonic() - self._printed_at >= self.print_every_s:
                        self._printed_at = time.monotonic()
                        self._print(time.monotonic() - t0, st)
                    if machine.looping and time.monotonic() >= next_ckpt:
                        next_ckpt = time.monotonic() + job["checkpoint_interval_s"]
                        await self._upload(http, bus, machine, worker, digest, final=False)
                if not self.rejoin:
                    break
                # the server no longer knows this id (it restarted without its checkpoint
                # directory, or the grace period ran out): join again as a new rank, keeping the
                # worker's parameters and the step; the next round (or, when no rank is ready,
                # the bootstrap: PROTOCOL.md "Joining") syncs it
                self.rejoin = False
                self.stop_event.clear()
                self.start_step = machine.step
                self.n_rejoins += 1
                await driver.close()
                await bus.aclose()
                self.progress(f"rank {bus.id:08x}: the server refused its resume; rejoining as a new rank "
                              f"at step {self.start_step}")
            # stop: leave the cohort; the leader publishes, the others wait (bounded) for it
            # (a leader that stopped at the job's step limit has published: it uploads the final
            # checkpoint; a follower at the limit holds that publication already)
            was_leader = machine.looping or machine.is_leader(driver.now_ms()) or (
                machine.at_step_limit and machine.counters.get("published", 0) > 0)
            # a follower waits for the leader's publication *after* this stop (PROTOCOL.md,
            # "Controls": a stopping leader publishes); one seen earlier does not count
            self.publish_seen = False
            driver.stop()
            end = time.monotonic() + 5.0
            # (a rank that never became ready follows nobody: nothing to wait for)
            while time.monotonic() < end and (machine.looping if was_leader else
                                                     machine.ready and not self.publish_seen and not machine.at_step_limit):
                await asyncio.sleep(0.02)
            if was_leader and not bus.failed:
                await self._upload(http, bus, machine, worker, digest, final=True)
            st = self._state(driver, digest)
            st["final"] = True
            bus.send_control({"type": "report", "state": st})
            end = time.monotonic() + 2.0
            while bus.queued_bytes() and bus.connected and time.monotonic() < end:
                await asyncio.sleep(0.01)
            self._print(time.monotonic() - t0, st)
            self.progress(f"stopped ({self.stop_reason}); step {machine.step}, digest {st['digest'][:16]}")
            await driver.close()
            await bus.aclose()
        return 1 if self.failed else 0

    def _make_bus(self, job: dict, url: str) -> Any:
        """The room decides the topology; in a star the rank picks its link (ws | rtc)."""
        cfg = self.cfg
        common = dict(token=cfg.token, precision=job["precision"], on_control=self._on_control)
        if job.get("topology") == "star" and cfg.link == "ws":
            from ..bus.ws import WsBus
            return WsBus(url, **common)
        from ..bus.rtc import RtcMeshBus, RtcStarBus
        hosts = None if cfg.rtc_hosts is None else [a.strip() for a in str(cfg.rtc_hosts).split(",") if a.strip()]
        rtc = dict(ice_servers=cfg.ice_servers, host_addresses=hosts, connect_timeout_s=cfg.rtc_timeout)
        if job.get("topology") == "mesh":
            # idle bound: a few beats' worth (beats go out every policy.beat while a rank runs)
            beat_s = float(job["timing"].get("beat_ms", 400.0)) / 1000.0
            return RtcMeshBus(url, idle_timeout_s=max(5.0, 10 * beat_s), **rtc, **common)
        return RtcStarBus(url, **rtc, **common)

    def _on_control(self, obj: dict) -> None:
        t = obj.get("type")
        if t == "peer" and obj.get("up") is False:
            # the server saw the rank's link close: it left (PROTOCOL.md, "Membership and majority")
            k = obj.get("id")
            if isinstance(k, int) and not isinstance(k, bool) and self.driver is not None:
                self.driver.peer_left(k)
        elif t == "stop":
            reason = str(obj.get("reason"))
            if reason.startswith("diverged"):   # the room ended because training diverged
                self.failed = reason
            self._request_stop(f"server: {reason}")
        elif t == "failed" and obj.get("rejoin") and self.stop_reason is None:
            self.rejoin = True              # the resume was refused: run() joins again
            if self.stop_event is not None:
                self.stop_event.set()
        elif t == "failed":
            self.failed = str(obj.get("reason"))
            self._request_stop(f"link failed: {self.failed}")

    def _request_stop(self, why: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = why
        if self.stop_event is not None:
            self.stop_event.set()

    def _state(self, driver: Any, digest: Callable[[Any], str]) -> dict:
        st = driver.state()
        st.pop("peers", None)
        st["digest"] = digest(driver.worker.params())
        st["pid"] = os.getpid()
        st["kind"] = "native"
        st["leaders"] = self.leaders
        st["first_loss"] = self.first_loss
        st["start_step"] = self.start_step
        st["rejoins"] = self.n_rejoins
        st["round_gaps"] = self.round_gaps.report()
        bus = driver.bus
        if hasattr(bus, "links"):
            st["links"] = {("server" if k == 0 else f"{k:08x}"): v for k, v in bus.links().items()}
            st["link_bytes"] = bus.transport_bytes()
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in st.items()}

    def _print(self, t: float, st: dict) -> None:
        lead = st.get("leader")
        loss = st.get("loss")
        acc = st.get("accuracy")
        self.progress(f"[{t:6.1f}s] step {st['step']:6d}  leader {'-' if lead is None else f'{lead:08x}'}"
                      f"{' (me)' if st.get('is_leader') else '     '}  cohort {st['cohort']}  "
                      f"loss {'n/a' if loss is None else f'{loss:.4f}'}  "
                      f"acc {_acc_text(acc, st)}  {st['steps_per_s']:6.1f} steps/s"
                      + (f"  DIVERGED x{st['diverged']}: {st.get('fault')}" if st.get("diverged") else ""))

    async def _upload(self, http: Any, bus: Any, machine: Any, worker: Any, digest: Callable, *, final: bool) -> None:
        from ..vec import all_finite

        p = worker.params()
        if not all_finite(p):
            # never store a diverged model (the server refuses it too: HTTP 422)
            self.progress(f"checkpoint upload skipped: the parameters at step {machine.step} are not finite "
                          "(training diverged)")
            return
        data = array("f", p).tobytes() if not hasattr(p, "astype") else p.astype("<f4").tobytes()
        h = dict(self._headers())
        h.update({"X-Tabcohort-Rank": str(bus.id), "X-Tabcohort-Secret": bus.secret or "",
                  "X-Tabcohort-Step": str(machine.step), "X-Tabcohort-Digest": digest(p),
                  "X-Tabcohort-Loss": repr(float(machine.loss))})
        if final:
            h["X-Tabcohort-Final"] = "1"
        url = f"{self.cfg.base_url}/api/rooms/{self.cfg.room}/checkpoint"
        try:
            async with http.put(url, data=data, headers=h) as r:
                if r.status not in (200, 409):
                    self.progress(f"checkpoint upload: HTTP {r.status} {await r.text()}")
        except Exception as e:  # a failed upload must not stop training
            print(f"checkpoint upload failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def _acc_text(acc: float | None, st: dict) -> str:
    """Held-out accuracy for a progress line; a follower says why it has none (only the leader
    evaluates held-out accuracy: PROTOCOL.md, "State report")."""
    if acc is not None:
        return f"{acc * 100:5.1f}%"
    return "n/a (evaluated by the leader)" if st.get("ready") and not st.get("is_leader") else "n/a"


def cfg_links() -> tuple[str, ...]:
    return LINKS


async def run_rank(cfg: RankConfig, *, progress: Callable[[str], None] | None = None,
                   print_every_s: float = 0.0) -> int:
    """Run one native rank until the room stops, the rank is signalled, or its link fails.

    Args:
        print_every_s: a progress line at most every this many seconds (0: at every report).
    """
    return await RankRun(cfg, progress=progress, print_every_s=print_every_s).run()


def _step_limit(job: dict) -> int | None:
    """The job's exact step limit for the machine (docs/PROTOCOL-NOTES.md, note 13); None = none."""
    steps = job.get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None
