"""Server and room configuration, validated before anything listens (STYLE.md, errors)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from tabcohort.errors import ConfigError
from tabcohort.protocol.policy import Timing
from tabcohort.wire.chunk import DATA_CHANNEL_MAX_MESSAGE_BYTES

TOPOLOGIES = ("star", "mesh")
LINKS = ("ws",)
#: Room names: 1..64 ASCII characters of ``[A-Za-z0-9._-]``, not ``.`` or ``..`` (they are
#: path segments of every room URL).
ROOM_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}\Z", re.ASCII)
#: Shortest room or operator token accepted (a guessable token is no protection).
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 256


def check_token(name: str, value: object) -> None:
    """Raises:
        ConfigError: ``value`` is not a string of MIN_TOKEN_CHARS..MAX_TOKEN_CHARS printable
            ASCII characters (naming ``name``, the option or field).
    """
    if (not isinstance(value, str) or not MIN_TOKEN_CHARS <= len(value) <= MAX_TOKEN_CHARS
            or not all(33 <= ord(c) < 127 for c in value)):
        shown = value if not isinstance(value, str) else f"<{len(value)} characters>"
        raise ConfigError(name, shown, f"must be {MIN_TOKEN_CHARS}..{MAX_TOKEN_CHARS} printable ASCII "
                                       f"characters without spaces (e.g. python -c 'import secrets; "
                                       f"print(secrets.token_urlsafe(24))')")


def check_room_name(name: object) -> None:
    """Raises:
        ConfigError: ``name`` is not 1..64 of ``[A-Za-z0-9._-]``, or is ``.`` / ``..``.
    """
    if not isinstance(name, str) or not ROOM_NAME.match(name) or name in (".", ".."):
        raise ConfigError("room", name, "room names are 1..64 characters of [A-Za-z0-9._-] (ASCII), "
                                        "not '.' or '..'")


@dataclass
class JobConfig:
    """What a room trains; served to ranks as JSON (``GET /api/rooms/{room}/job``).

    Attributes:
        dataset: dataset name (``digits``, ``synthetic``) or an ``.npz`` path on the server.
        hidden: hidden layer widths.
        activation: ``relu`` or ``tanh``.
        global_batch: the samples one round covers, split across the cohort by measured speed
            (docs/PROTOCOL.md, "Shares"); fixed, so joins and leaves do not change the effective
            batch.
        batch: the most samples one rank computes per round (its cap; a rank may set its own);
            0 = the global batch (any rank may compute a whole round).
        lr: learning rate.
        seed: dataset shuffle seed and init seed.
        precision: wire precision (``f32``, ``f16``, ``bf16``, ``int8``).
        timing: protocol base periods, milliseconds.
        topology: ``star`` (each rank links to the server, ``ws`` or ``rtc``, which relays) or
            ``mesh`` (a WebRTC data channel between every pair, negotiated through the server;
            a pair that cannot connect uses the relay).
        steps: stop after this step (0 = no step limit).
        target_accuracy: stop once the leader's held-out accuracy reaches this (0 = off).
        duration_s: stop this long after the first rank joined (0 = off).
        eval_every: the leader evaluates every this many steps.
        checkpoint_interval_s: the leader uploads parameters this often (and at stop).
        report_interval_s: ranks send their state report this often.
        token: optional room token (16..256 printable ASCII characters); ranks, tabs and
            readers of the room's data must present it. It lets one join, never operate (stop).
        collect_rule: how a leader ends a round's collection: ``quorum`` (PROTOCOL.md, the
            default) or ``grace`` (docs/PROTOCOL-NOTES.md note 7: a short window after the
            quorum keeps equally fast ranks' buckets); every rank of the room uses it.
    """

    dataset: str = "digits"
    hidden: tuple[int, ...] = (32,)
    activation: str = "relu"
    batch: int = 0
    global_batch: int = 64
    lr: float = 0.5
    seed: int = 0
    precision: str = "f32"
    timing: Timing = field(default_factory=Timing)
    topology: str = "star"
    steps: int = 0
    target_accuracy: float = 0.0
    duration_s: float = 0.0
    eval_every: int = 10
    checkpoint_interval_s: float = 5.0
    report_interval_s: float = 1.0
    token: str | None = None
    collect_rule: str = "quorum"

    def validate(self, room: str = "room") -> None:
        """Raises:
            ConfigError: naming the first bad setting (``room.field``) and its value.
        """
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"{room}.{name}", getattr(self, name), why)

        for name, lo in (("batch", 0), ("global_batch", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= 2**24:
                raise bad(name, f"must be an integer in [{lo}, {2**24}]")
        for name in ("steps", "seed", "eval_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(name, "must be an integer >= 0")
        for name, lo, hi in (("lr", 0.0, 1e6), ("target_accuracy", 0.0, 1.0), ("duration_s", 0.0, 1e9),
                             ("checkpoint_interval_s", 0.05, 1e9), ("report_interval_s", 0.05, 3600.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                raise bad(name, f"must be a number in [{lo}, {hi}]")
        if not self.hidden or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in self.hidden):
            if self.hidden != ():
                raise bad("hidden", "layer widths must be positive integers")
        if self.topology not in TOPOLOGIES:
            raise bad("topology", f"expected one of {TOPOLOGIES}")
        if self.collect_rule not in ("quorum", "grace"):
            raise bad("collect_rule", "expected quorum or grace")
        from tabcohort.wire.codecs import get_codec
        get_codec(self.precision)
        if self.token is not None:
            check_token(f"{room}.token", self.token)

    def public(self) -> dict[str, Any]:
        """The job without its token, as JSON-ready data."""
        d = asdict(self)
        d.pop("token")
        d["hidden"] = list(self.hidden)
        d["timing"] = asdict(self.timing)
        d["batch"] = self.batch or self.global_batch      # a rank's cap unless it sets its own
        d["link"] = "rtc" if self.topology == "mesh" else "ws"  # star: each rank picks ws or rtc
        d["stop"] = {"steps": self.steps, "target_accuracy": self.target_accuracy,
                     "duration_s": self.duration_s}
        return d


@dataclass(frozen=True)
class ServerLimits:
    """Explicit bounds on every input.

    Attributes:
        max_rooms: rooms per server.
        max_ranks_per_room: connected plus reserved ranks per room (>= 200 required).
        max_ws_message_bytes: largest WebSocket message (a chunk or a control message).
        max_control_bytes: largest text (control) message.
        queue_high_water_bytes: per-peer relay queue at which the room reports pressure 1.
        queue_max_bytes: per-peer relay queue bound; a consumer beyond it is dropped.
        queue_max_items: per-peer relay queue bound in messages.
        resume_grace_s: a disconnected rank's id stays reserved this long.
        register_timeout_s: a socket must register within this.
        heartbeat_s: WebSocket ping period (aiohttp ``heartbeat``).
        close_timeout_s: bound on a close handshake before the transport is aborted.
        max_checkpoint_bytes: largest checkpoint upload (it must also be exactly the room's
            parameter count x 4 bytes, checked against Content-Length before reading).
        max_ranks_per_address: seats (connected plus reserved) per client address per room.
        max_connections_per_address: open TCP connections per client address (any endpoint).
        header_timeout_s: a connection must send a complete request head within this (slowloris).
        sender_max_msgs_per_s: messages (chunks and controls) one link may send per second
            (burst: twice that); more are dropped (``rate_limited``).
        sender_max_bytes_per_s: bytes one link may send per second (burst: one second's worth).
        rate_limit_close_s: a link that goes on sending over its rate for about this long's
            worth of excess messages is closed (4029).
        pressure_stall_s: a rank whose socket has not accepted one write for this long stops
            counting in the room's pressure (it is not reading: a frozen tab, a stopped process),
            so the leader does not pace the whole room on it (its frames are shed instead).
        write_stall_s: a rank whose socket has not accepted one write for this long is a slow
            consumer (closed 4008).
        max_auth_failures: failed token checks one address may make per ``auth_window_s``;
            beyond that its requests get 429 until the window passes.
        auth_window_s: the failed-auth window, seconds.
        register_rate_per_s, register_burst: the admission rate limit (a token bucket over all
            rooms) for WebSocket registrations, resumes included; one beyond it is closed with
            4029 and the client retries after a full-jitter backoff.
    """

    max_rooms: int = 64
    max_ranks_per_room: int = 1024
    max_ws_message_bytes: int = DATA_CHANNEL_MAX_MESSAGE_BYTES + 1024
    max_control_bytes: int = 65536
    queue_high_water_bytes: int = 1 << 20
    queue_max_bytes: int = 16 << 20
    queue_max_items: int = 8192
    resume_grace_s: float = 30.0
    register_timeout_s: float = 10.0
    heartbeat_s: float = 10.0
    close_timeout_s: float = 2.0
    max_checkpoint_bytes: int = 256 << 20
    register_rate_per_s: float = 50.0
    register_burst: int = 100
    max_ranks_per_address: int = 64
    max_connections_per_address: int = 256
    header_timeout_s: float = 10.0
    sender_max_msgs_per_s: float = 5000.0
    sender_max_bytes_per_s: float = 128 << 20
    rate_limit_close_s: float = 2.0
    write_stall_s: float = 10.0
    pressure_stall_s: float = 2.0
    max_auth_failures: int = 20
    auth_window_s: float = 60.0

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(name, v, "must be a positive number")
        if self.max_ranks_per_room < 200:
            raise ConfigError("max_ranks_per_room", self.max_ranks_per_room, "must be >= 200")
        if self.queue_max_bytes < self.queue_high_water_bytes:
            raise ConfigError("queue_max_bytes", self.queue_max_bytes, "must be >= queue_high_water_bytes")


@dataclass
class ServerConfig:
    """The server: its rooms, limits and checkpoint directory (``None`` = no checkpoints)."""

    rooms: dict[str, JobConfig] = field(default_factory=lambda: {"digits": JobConfig()})
    limits: ServerLimits = field(default_factory=ServerLimits)
    checkpoint_dir: str | None = None
    seed: int | None = None  # rank-id randomness (None = os entropy)
    #: WebRTC star links terminated here: ICE servers (STUN/TURN URLs; none by default) and the
    #: host candidate addresses (``None`` = aioice's list, which never has 127.0.0.1; set
    #: ``["127.0.0.1"]`` on a loopback-only host).
    rtc_ice_servers: tuple[str, ...] = ()
    rtc_host_addresses: list[str] | None = None
    #: the operator's token: stop a room, see the ranks' pids, every room's data in /metrics
    #: (``None``: generated at start; ``tabcohort serve`` prints it)
    operator_token: str | None = None
    #: Origins (``scheme://host[:port]``) besides the server's own that may open a WebSocket or
    #: send a state-changing request; ``*`` allows any (not recommended)
    allowed_origins: tuple[str, ...] = ()

    def validate(self) -> None:
        if not self.rooms:
            raise ConfigError("rooms", self.rooms, "at least one room is needed")
        if len(self.rooms) > self.limits.max_rooms:
            raise ConfigError("rooms", len(self.rooms), f"more than max_rooms={self.limits.max_rooms}")
        for name, job in self.rooms.items():
            check_room_name(name)
            job.validate(name)
        if self.operator_token is not None:
            check_token("operator_token", self.operator_token)
        for o in self.allowed_origins:
            if o != "*" and not re.match(r"https?://[^/\s]+\Z", o):
                raise ConfigError("allowed_origins", o, "expected an origin like https://example.org[:port], or *")
