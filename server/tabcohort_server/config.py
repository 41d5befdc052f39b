"""Server and room configuration, validated before anything listens (STYLE.md, errors)."""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

from tabcohort.errors import ConfigError
from tabcohort.protocol.policy import Timing
from tabcohort.wire.chunk import DATA_CHANNEL_MAX_MESSAGE_BYTES
from tabcohort.wire.precision import check_precision

TOPOLOGIES = ("star", "mesh")
LINKS = ("ws",)
#: Room names: 1..64 ASCII characters of ``[A-Za-z0-9._-]``, not ``.`` or ``..`` (they are
#: path segments of every room URL).
ROOM_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}\Z", re.ASCII)
#: Shortest room or operator token accepted (a guessable token is no protection).
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 256


def same_secret(want: str, given: object) -> bool:
    """Constant-time comparison of a secret (a token, a rank's secret) with what a client sent.

    ``given`` is untrusted: anything but a string is no match, and a string of any code points
    (an HTTP header's undecodable bytes come in as surrogate escapes, a JSON string may hold a
    lone surrogate) is compared as UTF-8 bytes with surrogates passed through, never raising."""
    return isinstance(given, str) and secrets.compare_digest(
        want.encode("utf-8", "surrogatepass"), given.encode("utf-8", "surrogatepass"))


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
                                       f"print(secrets.token_hex(24))')")


def new_token() -> str:
    """A fresh random token: 24 bytes from :mod:`secrets` as URL-safe base64 (32 characters),
    never starting with ``-``. Why: one is given on a command line (``--trainer-token TOKEN``),
    and argparse reads a value that starts with ``-`` as an option ("expected one argument"):
    1 in 64 generated tokens did (the demo's server failed to start on one in CI)."""
    while True:
        tok = secrets.token_urlsafe(24)
        if not tok.startswith("-"):
            return tok


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
        collect_rule: how a leader ends a round's collection: ``grace`` (the default,
            docs/PROTOCOL-NOTES.md note 7: a short window after the quorum keeps the buckets of
            ranks that finish together, as speed-planned shares do) or ``quorum``
            (PROTOCOL.md, "Timing and the cohort-size policy": finish at the quorum); every rank
            of the room uses it.
        aggregate: how the leader combines buckets (PROTOCOL.md, "Untrusted ranks"): ``clip``
            (norm clipping relative to the cohort, the default), ``trimmed-mean``, or ``mean``
            (the plain sample-weighted mean, for trusted groups).
        lr_max: the largest learning rate a round may carry; followers drop rounds above it
            (>= ``lr``).
        local_steps, inner_optimizer, inner_lr, outer_optimizer, outer_momentum: local steps
            and the optimizers (``tabcohort.protocol.optim.TrainConfig``; PROTOCOL.md "Local
            steps and optimizer state"); ``lr`` is then the outer learning rate. In the job
            hash unless they are the default (one synchronous SGD step per round).
        job: a module job, ``PATH_OR_MODULE[:FACTORY]`` (README "Write your own job"); ``None``
            = the built-in MLP job (``tabcohort.jobs.BUILTIN``) over ``dataset`` with
            ``hidden`` and ``activation`` (:meth:`job_ref`).
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
    collect_rule: str = "grace"
    aggregate: str = "clip"
    lr_max: float = 10.0
    local_steps: int = 1
    inner_optimizer: str = "sgd"
    inner_lr: float = 0.1
    outer_optimizer: str = "sgd"
    outer_momentum: float = 0.9
    job: str | None = None
    #: a module job's options (its ``OPTIONS`` overridden: serve's ``--job-option NAME=VALUE``)
    job_options: dict = field(default_factory=dict)

    def job_ref(self) -> tuple[str, dict | None]:
        """The room's job and its options: ``(job, job_options or None)`` for a module job, else
        the built-in MLP job with ``dataset``, ``hidden``, ``activation`` and ``seed`` (the
        data's shuffle) as its options (``tabcohort.jobs.builtin_mlp.canonical``)."""
        if self.job:
            return self.job, dict(self.job_options) or None
        return "tabcohort.jobs.builtin_mlp", {"dataset": self.dataset, "hidden": list(self.hidden),
                                              "activation": self.activation, "data_seed": self.seed}

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
        if self.batch > self.global_batch:
            # a rank's share is at most the global batch: a larger cap could never apply, and
            # read as "each rank computes this many" it misleads (docs/PROTOCOL.md "Shares")
            raise bad("batch", f"is the most samples one rank computes per round, so at most the global batch "
                               f"(serve's --global-batch, a rooms file's global_batch: {self.global_batch}); raise that, or give "
                               f"0 (= the global batch)")
        for name in ("steps", "seed", "eval_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(name, "must be an integer >= 0")
        if self.steps >= 2**63:
            # a step is an integer in [0, 2^63) on the wire and in every report (README
            # "Untrusted ranks"): a larger limit could never be met
            raise bad("steps", f"must be at most {2**63 - 1} (steps are integers in [0, 2^63); 0 = no limit)")
        for name, lo, hi in (("lr", 0.0, 1e6), ("target_accuracy", 0.0, 1.0), ("duration_s", 0.0, 1e9),
                             ("checkpoint_interval_s", 0.05, 1e9), ("report_interval_s", 0.05, 3600.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                raise bad(name, f"must be a number in [{lo}, {hi}]")
        if self.target_accuracy and not self.eval_every:
            raise bad("target_accuracy", "needs evaluations: with eval_every 0 the accuracy is never measured")
        if not self.hidden or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in self.hidden):
            if self.hidden != ():
                raise bad("hidden", "layer widths must be positive integers")
        if self.topology not in TOPOLOGIES:
            raise bad("topology", f"expected one of {TOPOLOGIES}")
        if self.collect_rule not in ("quorum", "grace"):
            raise bad("collect_rule", "expected quorum or grace")
        from tabcohort.protocol.policy import AGGREGATES
        if self.aggregate not in AGGREGATES:
            raise bad("aggregate", f"expected one of {AGGREGATES}")
        v = self.lr_max
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 1e6:
            raise bad("lr_max", "must be a number in (0, 1e6]")
        if self.lr > v:
            # name the value the user most likely set: the lr, against the bound it passed
            raise bad("lr", f"above the room's lr_max ({v:g}): lower the lr (--lr, or --outer-lr with local "
                            f"steps) or raise lr_max (--lr-max)")
        from tabcohort.protocol.optim import TrainConfig
        TrainConfig.from_job(self)          # ConfigError naming --local-steps etc.
        check_precision(self.precision)
        if self.token is not None:
            check_token(f"{room}.token", self.token)
        if self.job is not None and (not isinstance(self.job, str) or not self.job.strip()):
            raise ConfigError("--job", self.job, "expected PATH_OR_MODULE[:FACTORY]")

    def public(self) -> dict[str, Any]:
        """The job without its token, as JSON-ready data."""
        d = asdict(self)
        d.pop("token")
        d.pop("job")   # a server path: the job's name and hashes are in job_info
        d.pop("job_options")   # in job_info["options"]
        if self.job is None:
            d["hidden"] = list(self.hidden)
        else:   # the built-in MLP's settings mean nothing for a module job (its export said
            # "dataset digits, hidden [32]" for a logistic regression: a new-user trial)
            for k in ("dataset", "hidden", "activation"):
                d.pop(k, None)
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
        queue_max_bytes: per-peer relay queue bound; when full, the sender holding the most
            of it loses its newest items there (``fair_share``), never the receiver.
        queue_max_items: per-peer relay queue bound in messages.
        resume_grace_s: a disconnected rank's id stays reserved this long.
        roll_call_s: how long a server that took a room up from a previous life (a restart on
            its checkpoint directory, a cluster node acquiring the room) assumes its ranks take
            to come back: its roll call is partial for the longer of this and
            ``resume_grace_s`` (PROTOCOL.md, "Membership and majority"). The ranks' reconnect
            bound (30 s) by default; at least 10 s, their largest delay between two reconnect
            attempts. Lower it only where every rank comes back sooner (a rank back after the
            window can be taken for gone, and the first one back lead alone).
        register_timeout_s: a socket must register within this.
        heartbeat_s: WebSocket ping period (aiohttp ``heartbeat``).
        close_timeout_s: bound on a close handshake before the transport is aborted.
        max_checkpoint_bytes: largest checkpoint upload (it must also be exactly the room's
            parameter count plus its optimizer state length, x 4 bytes, checked against
            Content-Length before reading).
        max_ranks_per_address: seats (connected plus reserved) per client address per room.
        max_connections_per_address: open TCP connections per client address (any endpoint).
        header_timeout_s: a connection must send a complete request head within this (slowloris).
        sender_max_msgs_per_s: messages (chunks and controls) one link may send per second
            (burst: twice that); more are dropped (``rate_limited``).
        sender_max_bytes_per_s: bytes one link may send per second (burst: one second's worth);
            a WebSocket link over it is read no faster (back-pressure), a data channel's
            chunks are dropped. 1 GiB/s: a leader of 1M float32 parameters sends 4 MB a round,
            at 100 rounds/s on one machine 400 MB/s (128 MiB/s held it to 31 rounds/s). For
            ranks that may lead (docs/PROTOCOL.md, "Roles").
        contributor_max_bytes_per_s: the same for a rank that may not lead (a contributor in
            an open room: it sends only its buckets; its broadcasts reach every rank, so one
            stranger's budget is kept at a tenth of a trainer's).
        rate_limit_close_s: a link that goes on sending over its rate for about this long's
            worth of excess messages is closed (4029).
        pressure_stall_s: a rank whose socket has not accepted one write for this long stops
            counting in the room's pressure (it is not reading: a frozen tab, a stopped process),
            so the leader does not pace the whole room on it (its frames are shed instead).
        pressure_report_s: a change of the room's pressure that does not cross 1 is told to
            the ranks at most once per this long (leaders pace only above 1: crossing it is
            told at once); without it a relay queue that fills and empties with every round
            sends two controls per round to every rank.
        write_stall_s: a rank whose socket has not accepted one write for this long is a slow
            consumer (closed 4008).
        max_auth_failures: failed token checks one address may make per ``auth_window_s``;
            beyond that its requests get 429 until the window passes.
        auth_window_s: the failed-auth window, seconds.
        register_rate_per_s, register_burst: the admission rate limit (a token bucket over all
            rooms) for WebSocket registrations, resumes included; one beyond it is closed with
            4029 and the client retries after a full-jitter backoff.
        backlog_max_pressure: the most a rank's ``backlog`` claim (bytes it says it holds
            unconsumed) can add to the room's pressure, in high-water marks; a larger claim is
            clamped (``backlog_clamped``). At 1.0 no claim alone can make a leader pace (it
            paces only above 1), so a forged claim cannot throttle the room.
        max_steps_per_s, step_jump_slack: a leader report whose step is ahead of the room's
            trusted step by more than ``step_jump_slack + max_steps_per_s x`` the seconds since
            that step was trusted is not believed (``report_step_jump``): it neither moves the
            room's step nor meets ``--steps``.
    """

    max_rooms: int = 64
    max_ranks_per_room: int = 1024
    max_ws_message_bytes: int = DATA_CHANNEL_MAX_MESSAGE_BYTES + 1024
    max_control_bytes: int = 65536
    queue_high_water_bytes: int = 1 << 20
    queue_max_bytes: int = 16 << 20
    queue_max_items: int = 8192
    resume_grace_s: float = 30.0
    roll_call_s: float = 30.0   # (rooms.RANK_RECONNECT_MAX_S)
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
    sender_max_bytes_per_s: float = 1 << 30
    contributor_max_bytes_per_s: float = 128 << 20
    rate_limit_close_s: float = 2.0
    write_stall_s: float = 10.0
    pressure_stall_s: float = 2.0
    pressure_report_s: float = 0.25
    max_auth_failures: int = 20
    auth_window_s: float = 60.0
    backlog_max_pressure: float = 1.0
    max_steps_per_s: float = 20000.0
    step_jump_slack: int = 2000

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(name, v, "must be a positive number")
        if self.max_ranks_per_room < 200:
            raise ConfigError("max_ranks_per_room", self.max_ranks_per_room, "must be >= 200")
        if self.roll_call_s < 10.0:   # (tabcohort.bus.backoff.RECONNECT_CAP_S)
            raise ConfigError("roll_call_s", self.roll_call_s, "must be >= 10 (the ranks' largest delay between two "
                              "reconnect attempts: a rank back after the roll call is taken for gone)")
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
    #: the trainer credential (docs/PROTOCOL.md, "Roles"): a rank that registers with it may
    #: lead (run the optimizer, publish parameters, upload checkpoints); one without it only
    #: contributes buckets. ``None``: generated at start, printed, and written to
    #: ``checkpoint_dir/.trainer-token`` (mode 0600) when there is a checkpoint directory.
    trainer_token: str | None = None
    #: trusted groups: every rank may lead, credential or not (today's behaviour before roles;
    #: README "Trust model" says what it gives up)
    any_rank_may_lead: bool = False
    #: checkpoints kept per room: the newest ``checkpoint_keep`` plus the best by held-out accuracy
    checkpoint_keep: int = 5
    #: one node of a cluster coordinated through Redis (``tabcohort serve --redis``; README
    #: "Cluster"); ``None``: a single server, as without it
    cluster: Any = None

    def validate(self) -> None:
        if self.cluster is not None:
            self.cluster.validate()
        if not self.rooms:
            raise ConfigError("rooms", self.rooms, "at least one room is needed")
        if len(self.rooms) > self.limits.max_rooms:
            raise ConfigError("rooms", len(self.rooms), f"more than max_rooms={self.limits.max_rooms}")
        for name, job in self.rooms.items():
            check_room_name(name)
            job.validate(name)
        if self.operator_token is not None:
            check_token("operator_token", self.operator_token)
        if self.trainer_token is not None:
            check_token("trainer_token", self.trainer_token)
        if not isinstance(self.any_rank_may_lead, bool):
            raise ConfigError("any_rank_may_lead", self.any_rank_may_lead, "must be true or false")
        k = self.checkpoint_keep
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 1000:
            raise ConfigError("checkpoint_keep", k, "must be an integer in [1, 1000]")
        for o in self.allowed_origins:
            if o != "*" and not re.match(r"https?://[^/\s]+\Z", o):
                raise ConfigError("allowed_origins", o, "expected an origin like https://example.org[:port], or *")
