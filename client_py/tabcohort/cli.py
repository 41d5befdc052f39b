"""The ``tabcohort`` command line (argparse, stdlib: the client package stays dependency-free).

Subcommands: ``simulate`` (an in-process cohort), ``serve`` (the server; imports
``tabcohort_server`` lazily), ``rank`` (a native rank that joins a room on a server) and
``evaluate`` (a model export's held-out metrics). README.md ("Set up and run", "Write your own
job") is the user's guide.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import re
import sys
import time
from typing import Any, Callable, Mapping, Sequence

from ._alloc import hold_allocator
from .errors import ConfigError, TabcohortError

DESCRIPTION = """\
Elastic data-parallel training across browser tabs and native Python processes.

A server (tabcohort serve) hosts a room: a model, a data set and a cohort of ranks. Native
ranks join it with tabcohort rank; a browser tab joins by opening the server's URL. Ranks come
and go at any time; one leader runs the optimizer. tabcohort simulate trains a
cohort inside this process, without a server."""

EPILOG = """\
examples:
  tabcohort serve --room digits --dataset digits --checkpoint-dir ckpt   # prints the URL to open
  tabcohort rank --server http://127.0.0.1:8080 --room digits \\
      --trainer-token="$(cat ckpt/.trainer-token)"                      # a native rank that may lead
  tabcohort simulate --ranks 4 --steps 400                               # no server needed
  tabcohort serve --job examples/jobs/cnn_digits.py --lr 0.3 --checkpoint-dir ckpt  # your own model and data
  tabcohort rank --server http://127.0.0.1:8080 --room cnn_digits --trust-job \\
      --trainer-token="$(cat ckpt/.trainer-token)"                      # ... run by a native rank
  tabcohort evaluate --job examples/jobs/cnn_digits.py --model cnn_digits-step200.npz

tabcohort COMMAND --help lists a command's options and their defaults."""


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default, except where there is none to show (None, False) or the
    help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        if ("default" in h or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or not action.option_strings):
            return h
        return super()._get_help_string(action)


def _hidden(text: str) -> tuple[int, ...]:
    if not text.strip():
        return ()
    try:
        widths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hidden={text!r}: expected comma-separated integers, e.g. 32 or 64,32")
    if any(w <= 0 for w in widths):
        raise argparse.ArgumentTypeError(f"--hidden={text!r}: layer widths must be positive integers")
    return widths


#: simulate's option names for InprocConfig fields, so errors name what the user typed.
_SIM_FLAGS = {"loss": "--link-loss", "delay_ms": "--link-delay-ms", "kill_leader_at_step": "--kill-leader-at",
              "add_rank_at_step": "--add-rank-at", "partition_at_step": "--partition-at",
              "bandwidth_bytes_per_s": "--link-bandwidth"}


def _flag(field: str) -> str:
    if field.startswith("-"):   # (already the option's name)
        return field
    return _SIM_FLAGS.get(field, "--" + field.replace("_", "-"))


def _train_options(p: argparse.ArgumentParser) -> None:
    """The local-steps options of ``serve`` and ``simulate`` (docs/PROTOCOL.md, "Local steps
    and optimizer state"; README "Local steps")."""
    g = p.add_argument_group("local steps (DiLoCo-style rounds; README \"Local steps\")")
    g.add_argument("--local-steps", type=int, default=1, metavar="H",
                   help="inner steps per round; 1 = one synchronous step per round")
    g.add_argument("--inner-optimizer", default="sgd", metavar="NAME", help="sgd or adam (H > 1)")
    g.add_argument("--inner-lr", type=float, default=None,
                   help="inner learning rate (default: 0.1 for sgd, 0.001 for adam)")
    g.add_argument("--outer-optimizer", default=None, metavar="NAME",
                   help="sgd or nesterov (default: sgd for H = 1, nesterov for H > 1)")
    g.add_argument("--outer-lr", type=float, default=None,
                   help="the leader's learning rate, the round's: --lr under another name (default: 0.5 "
                        "for H = 1, 0.7 for H > 1)")
    g.add_argument("--outer-momentum", type=float, default=None, help="Nesterov momentum (default: 0.9)")


def _train_from(a: argparse.Namespace, default_lr: float) -> tuple[Any, float]:
    """``(TrainConfig, lr)`` from the parsed options (ConfigError names the option)."""
    from .protocol.optim import from_options

    return from_options(local_steps=a.local_steps, inner_optimizer=a.inner_optimizer, inner_lr=a.inner_lr,
                        outer_optimizer=a.outer_optimizer, outer_lr=a.outer_lr,
                        outer_momentum=a.outer_momentum, lr=a.lr, default_lr=default_lr)


def _job_option(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` of ``--job-option``: VALUE as JSON (``3``, ``0.5``, ``[64, 32]``, ``true``),
    else as a string."""
    name, sep, raw = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--job-option={text!r}: expected NAME=VALUE, e.g. hidden=[64,32] or "
                                         "text=shakespeare")
    def not_finite(tok: str) -> float:
        raise argparse.ArgumentTypeError(f"--job-option={text!r}: {tok} is not a finite number (a job's OPTIONS "
                                         "are JSON data, which has no NaN or Infinity)")

    def finite(tok: str) -> float:
        v = float(tok)
        return v if math.isfinite(v) else not_finite(tok)

    try:
        value = json.loads(raw, parse_float=finite, parse_constant=not_finite)
    except ValueError:
        value = raw
    return name, value


def _job_args(parser: argparse.ArgumentParser, default_help: str) -> None:
    """The options that choose a room's model: ``--job`` and its ``--job-option``, or the
    built-in MLP job's ``--dataset``, ``--hidden``, ``--activation``."""
    parser.add_argument("--job", default=None, metavar="PATH_OR_MODULE[:FACTORY]",
                        help="a module job: your model and data (README \"Write your own job\"), loaded and "
                             "checked once at start; " + default_help)
    parser.add_argument("--job-option", type=_job_option, action="append", default=[], metavar="NAME=VALUE",
                        help="set one of the --job's OPTIONS (VALUE as JSON, else a string); repeatable")
    parser.add_argument("--dataset", default=None,
                        help="the built-in MLP job's data: digits (needs scikit-learn), synthetic, or a path "
                             "to an .npz with X and y (default: digits)")
    parser.add_argument("--hidden", type=_hidden, default=None,
                        help="the built-in MLP job's hidden widths, e.g. 32 or 64,32 (default: 32; "
                             "'' for none: softmax regression)")
    parser.add_argument("--activation", default=None, choices=("relu", "tanh"),
                        help="the built-in MLP job's hidden activation (default: relu)")


def _job_options(pairs: list[tuple[str, Any]]) -> dict:
    """``--job-option`` pairs as a dict; a ConfigError for a NAME given twice (the last one won,
    unsaid: a new-user trial)."""
    seen: dict[str, Any] = {}
    for name, value in pairs:
        if name in seen:
            shown = [v if isinstance(v, str) else json.dumps(v) for v in (seen[name], value)]
            raise ConfigError("--job-option", f"{name}={shown[1]}", f"{name} is given twice (first {name}={shown[0]}): "
                              "give each option once")
        seen[name] = value
    return seen


#: the built-in MLP job's options when not given (None in the parser, so that one given with
#: ``--job`` is refused even when it names the default: ``--job x.py --dataset digits``)
BUILTIN_JOB_DEFAULTS = {"dataset": "digits", "hidden": (32,), "activation": "relu"}


def _check_job_args(a: argparse.Namespace) -> dict:
    """The job options of ``a``, and the built-in job's defaults filled in; a ConfigError for
    the built-in job's options given with ``--job``, ``--job-option`` without it, or one option
    given twice."""
    if a.job is not None:
        for name in BUILTIN_JOB_DEFAULTS:
            val = getattr(a, name)
            if val is not None:
                raise ConfigError(f"--{name}", val if isinstance(val, str) else ",".join(map(str, val)),
                                  "a module job (--job) brings its own model and data; --dataset, "
                                  "--hidden and --activation are the built-in MLP job's (use --job-option)")
    elif a.job_option:
        name, value = a.job_option[0]
        raise ConfigError("--job-option", f"{name}={value if isinstance(value, str) else json.dumps(value)}", "sets an option of a module job (--job); the built-in "
                          "MLP job's options are --dataset, --hidden, --activation and --seed")
    for name, default in BUILTIN_JOB_DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, default)
    return _job_options(a.job_option)


class _Parser(argparse.ArgumentParser):
    """argparse with a bad option reported like every other bad setting: one line naming it,
    exit code 2 (argparse documents overriding ``error``; its default printed the whole usage
    block above the one line that mattered)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        # an abbreviated option is refused, not guessed: ``--global 64`` would have meant
        # ``--global-batch`` today and an error once another ``--global-...`` option exists
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def error(self, message: str):  # type: ignore[override]
        # in the form every other bad setting has, ``tabcohort: configuration error: --OPT=VALUE:
        # why`` (README): argparse's own ("argument --ranks: invalid int value: 'abc'", under
        # "tabcohort simulate:") read differently from --ranks=0's, a new-user trial
        m = re.fullmatch(r"argument (\S+): invalid (.+?) value: (.+)", message, re.S)
        c = re.fullmatch(r"argument (\S+): invalid choice: ('.*?') (.*)", message, re.S)
        if m:
            message = f"{m.group(1)}={m.group(3)}: invalid {m.group(2)} value"
        elif c:
            message = f"{c.group(1)}={c.group(2)}: invalid choice {c.group(3)}"
        elif message.startswith("argument "):
            message = message[len("argument "):]
            # (a type's own message names the option with its value: "--hidden: --hidden='0': ...")
            o = re.match(r"(\S+): (?=\1=)", message)
            if o:
                message = message[o.end():]
        self.exit(2, f"tabcohort: configuration error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .runtime.session import package_version

    p = _Parser(prog="tabcohort", description=DESCRIPTION, epilog=EPILOG, formatter_class=_Help)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           title="commands (tabcohort COMMAND --help lists its options)")

    s = sub.add_parser("simulate", formatter_class=_Help, help="train with N ranks in one process over the in-memory bus",
                       description="Run a cohort of ranks in this process over the in-memory bus "
                                   "(encoded frames only) and report accuracy, throughput and "
                                   "whether all ranks end bit-identical.")
    s.add_argument("--ranks", type=int, default=4,
                   help="number of ranks, at most 256: every rank beats to every other, about n^2 deliveries per "
                        "beat period in one process (README \"Scaling limits\")")
    _job_args(s, "default: the built-in MLP job")
    s.add_argument("--batch", type=int, default=None,
                   help="sets the global batch to ranks x batch when --global-batch is 0 (default 32; with "
                        "--global-batch it has no effect and is refused); not a per-rank limit: any rank here "
                        "may take a whole round, the shares follow measured speed")
    s.add_argument("--global-batch", type=int, default=0,
                   help="samples per round, split across the ranks by measured speed "
                        "(docs/PROTOCOL.md \"Shares\"; 0 = ranks x batch, fixed from the start)")
    s.add_argument("--lr", type=float, default=None, help="the round's learning rate (with --local-steps H > 1 the outer one; the inner "
                        "one is --inner-lr); default 0.5, 0.7 for H > 1")
    s.add_argument("--steps", type=int, default=400, help="stop at exactly this step")
    s.add_argument("--target-accuracy", type=float, default=0.0,
                   help="stop once held-out accuracy reaches this fraction (0 = off)")
    s.add_argument("--max-seconds", type=float, default=300.0, help="stop after this many seconds")
    s.add_argument("--precision", default="f32", help="wire precision: f32, f16, bf16, int8")
    s.add_argument("--backend", default="auto", help="worker backend: auto, numpy, python")
    s.add_argument("--seed", type=int, default=0, help="seed of data shuffle, init and rank ids")
    s.add_argument("--eval-every", type=int, default=10, help="the leader evaluates held-out accuracy every K steps (0: never)")
    s.add_argument("--collect-rule", choices=("grace", "quorum"), default="grace",
                   help="how a leader ends a round's collection: grace (a short wait after the quorum, "
                        "docs/PROTOCOL-NOTES.md note 7) or quorum (finish at the quorum, as PROTOCOL.md); "
                        "tabcohort serve uses grace too unless told")
    g = s.add_argument_group("fault injection")
    g.add_argument("--kill-leader-at", type=int, default=0, metavar="STEP", help="kill the leader at STEP")
    g.add_argument("--add-rank-at", type=int, default=0, metavar="STEP", help="add a rank at STEP")
    g.add_argument("--partition-at", type=int, default=0, metavar="STEP",
                   help="split the ranks into two halves at STEP")
    # (default None, 3000 applied with --partition-at: a value given without it is refused, not ignored)
    g.add_argument("--heal-after-ms", type=float, default=None,
                   help="heal the partition this many ms after --partition-at splits it (default 3000)")
    g.add_argument("--link-loss", type=float, default=0.0, help="per-message loss probability on every link, in [0, 1)")
    g.add_argument("--link-delay-ms", type=float, default=0.0, help="one-way delay on every link")
    g.add_argument("--link-bandwidth", type=float, default=0.0, metavar="BYTES_PER_S",
                   help="capacity of every link, bytes/s (0 = unlimited)")
    _train_options(s)
    s.add_argument("--json", action="store_true", help="print the result as JSON")

    r = sub.add_parser("rank", formatter_class=_Help, help="run a native rank that joins a room on a server",
                       description="Join a room's cohort through the server (the room's topology: a star "
                                   "through the server, or a mesh of direct links; see --link). Settings also come from TABCOHORT_SERVER, TABCOHORT_ROOM, "
                                   "TABCOHORT_TOKEN, TABCOHORT_TRAINER_TOKEN, TABCOHORT_BATCH, TABCOHORT_LINK "
                                   "(arguments win).")
    r.add_argument("--server", default=None, help="server URL, e.g. http://127.0.0.1:8080 (TABCOHORT_SERVER)")
    r.add_argument("--room", default=None, help="room name (TABCOHORT_ROOM); without it, the server's only "
                                                "room (a server with several names them)")
    r.add_argument("--token", default=None, help="room token, if the room has one (TABCOHORT_TOKEN)")
    r.add_argument("--trainer-token", default=None,
                   help="the server's trainer credential: with it this rank may lead (run the optimizer, "
                        "upload checkpoints); without it it contributes buckets only, unless the server runs "
                        "--any-rank-may-lead (TABCOHORT_TRAINER_TOKEN; serve prints it and writes it to "
                        "CHECKPOINT_DIR/.trainer-token)")
    r.add_argument("--batch", default=None,
                   help="this rank's cap: the most samples it computes per round, e.g. for its memory "
                        "(TABCOHORT_BATCH; default or 0: the room's, normally its global batch; the leader "
                        "sets the share within it by measured speed)")
    r.add_argument("--link", default=None, help="link kind to the server in a star room: ws or rtc (TABCOHORT_LINK; default: ws)")
    r.add_argument("--ice-servers", default=None, help="WebRTC STUN/TURN URLs, comma-separated "
                   "(TABCOHORT_ICE_SERVERS; default none)")
    r.add_argument("--rtc-hosts", default=None, help="WebRTC ICE host addresses, comma-separated, e.g. "
                   "127.0.0.1 on a loopback-only host (TABCOHORT_RTC_HOSTS; default: the interfaces')")
    r.add_argument("--rtc-timeout", default=None, help="seconds for a data channel to open before the "
                   "relay is used (TABCOHORT_RTC_TIMEOUT; default 5)")
    r.add_argument("--no-direct", dest="direct", action="store_const", const="0", default=None,
                   help="no direct TCP paths to the room's other native ranks: everything through the "
                        "server's relay (TABCOHORT_DIRECT=0; default: direct paths on in star rooms over ws)")
    r.add_argument("--direct-host", default=None, metavar="IP",
                   help="the address direct paths listen on and connect from, on an ephemeral port "
                        "(TABCOHORT_DIRECT_HOST; default: the local address that routes to the server)")
    r.add_argument("--direct-announce", default=None, metavar="IP:PORT",
                   help="announce this address for direct paths instead of the listening one, e.g. a "
                        "port forward (TABCOHORT_DIRECT_ANNOUNCE)")
    r.add_argument("--backend", default="auto", help="worker backend: auto, numpy, python")
    r.add_argument("--trust-job", action="store_const", const="1", default=None,
                   help="in a room that runs a module job, run the job code the server serves "
                        "(TABCOHORT_TRUST_JOB=1; README \"Trust model\"); without it or --job a rank refuses")
    r.add_argument("--job", default=None, metavar="PATH",
                   help="your local copy of the room's module job, run instead of the server's (its code "
                        "hash must match the room's; TABCOHORT_JOB)")
    r.add_argument("--print-every", type=float, default=1.0, metavar="S",
                   help="print a progress line every S seconds (0: with each state report)")
    d = r.add_argument_group("LAN discovery (needs zeroconf: pip install 'tabcohort[lan]')")
    d.add_argument("--discover", action="store_const", const="1", default=None,
                   help="find the server by an mDNS browse instead of --server (TABCOHORT_DISCOVER=1)")
    d.add_argument("--discover-host", default=None, metavar="HOST",
                   help="find it by unicast DNS-SD queries to HOST's mDNS port, for a rank that cannot "
                        "hear multicast (TABCOHORT_DISCOVER_HOST)")
    d.add_argument("--discover-timeout", default=None, metavar="S",
                   help="seconds to look before giving up (TABCOHORT_DISCOVER_TIMEOUT; default 5)")
    d.add_argument("--discover-interfaces", default=None, metavar="IPS",
                   help="IPv4 addresses of the interfaces to browse on, comma-separated, e.g. 127.0.0.1 "
                        "(TABCOHORT_DISCOVER_INTERFACES; default all)")

    e = sub.add_parser("evaluate", formatter_class=_Help, help="print a model export's held-out metrics",
                       description="Load a model export (GET /api/rooms/ROOM/model: an .npz with params.npy and "
                                   "job.json) into its job's worker and print held-out accuracy and loss. A job needs "
                                   "--job (your copy of it: its data comes from its load_data()); the built-in MLP "
                                   "job is this install's own copy (its code hash must be the model's).")
    e.add_argument("--model", required=True, metavar="FILE", help="the .npz export")
    e.add_argument("--job", default=None, metavar="PATH_OR_MODULE[:FACTORY]", help="the module job it was trained as")
    e.add_argument("--dataset", default=None, metavar="PATH.npz",
                   help="the built-in job trained on an .npz: where that file is here (default: its file name "
                        "in the working directory)")
    e.add_argument("--job-option", type=_job_option, action="append", default=[], metavar="NAME=VALUE",
                   help="one of the --job's LOCAL_OPTIONS as it is here (e.g. where its data file lies; VALUE as "
                        "JSON, else a string); its OPTIONS are the model's; repeatable")
    e.add_argument("--backend", default="auto", help="worker backend: auto, numpy, python")
    e.add_argument("--json", action="store_true", help="print the metrics as JSON")

    v = sub.add_parser("serve", formatter_class=_Help,
                       help="run the server, hosting the room --room names (with --redis: one node of a cluster)",
                       description="Serve the room --room names (one per command; the Python API's "
                                   "ServerConfig(rooms=...) holds several): its job and data over HTTP, the "
                                   "WebSocket star relay, checkpoints, /metrics and /healthz. With --redis it is "
                                   "one node of a cluster (README \"Cluster\"), where every room the nodes "
                                   "define is listed and reachable through any of them.")
    v.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0: every interface)")
    v.add_argument("--port", type=int, default=8080, help="listen port (0 = any free port)")
    v.add_argument("--room", default=None,
                   help="the room's name (one room per serve command; its checkpoints are ROOM.ckpt); default: "
                        "the --job module's name (my_job.py: my_job), digits for the built-in job")
    _job_args(v, "default: the built-in MLP job")
    v.add_argument("--global-batch", type=int, default=64,
                   help="samples per round, split across the cohort by measured speed (docs/PROTOCOL.md "
                        "\"Shares\"); fixed, so a joining tab adds speed, not samples")
    v.add_argument("--batch", type=int, default=0,
                   help="the most samples one rank computes per round, at most --global-batch (0 = the global "
                        "batch; a rank may pick its own with rank --batch)")
    v.add_argument("--lr", type=float, default=None, help="the round's learning rate (with --local-steps H > 1 the outer one; the inner "
                        "one is --inner-lr); default 0.5, 0.7 for H > 1")
    _train_options(v)
    v.add_argument("--seed", type=int, default=0, help="dataset shuffle and init seed")
    v.add_argument("--precision", default="f32", help="wire precision: f32, f16, bf16, int8")
    v.add_argument("--collect-rule", default="grace", choices=("grace", "quorum"),
                   help="how a leader ends a round's collection: grace (a short wait after the quorum, "
                        "docs/PROTOCOL-NOTES.md note 7; keeps the buckets of ranks that finish together) "
                        "or quorum (finish at the quorum: above three ranks the buckets after it are "
                        "dropped, a part of the global batch)")
    v.add_argument("--aggregate", default="clip", choices=("clip", "trimmed-mean", "mean"),
                   help="how the leader combines buckets (docs/PROTOCOL.md \"Untrusted ranks\"): clip "
                        "(each bucket's norm bounded by a multiple of the cohort's median: 4x for ranks that may "
                        "lead, 1x for contributors), trimmed-mean "
                        "(coordinate-wise, 20%% each end), or mean (trusted groups)")
    v.add_argument("--lr-max", type=float, default=10.0,
                   help="the largest learning rate a round may carry; ranks drop rounds above it")
    v.add_argument("--topology", default="star", help="star (ranks link to the server) or mesh (WebRTC data channels between ranks)")
    v.add_argument("--steps", type=int, default=0, help="stop the room at exactly this step (0 = no limit)")
    v.add_argument("--target-accuracy", type=float, default=0.0, help="stop at this held-out accuracy (0 = off)")
    v.add_argument("--eval-every", type=int, default=10,
                   help="the leader evaluates held-out accuracy every K steps (0: never); it waits for a job's "
                        "evaluate(), so a slow one slows the room")
    v.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0 = off)")
    v.add_argument("--token", default=None, help="room token ranks and tabs must present (16+ characters); "
                   "it lets one join and read the room, not stop it (default TABCOHORT_TOKEN, else none: "
                   "an open room)")
    v.add_argument("--operator-token", default=None,
                   help="the operator's token (16+ characters) for stopping the room, the operator view's "
                        "actions and every room's data; default TABCOHORT_OPERATOR_TOKEN, else generated "
                        "and printed at start")
    v.add_argument("--trainer-token", default=None,
                   help="the trainer credential (16+ characters) a rank must present to lead (tabcohort rank "
                        "--trainer-token); default TABCOHORT_TRAINER_TOKEN, else CHECKPOINT_DIR/.trainer-token, "
                        "else generated; printed at start and written there. Tabs never carry it: they contribute")
    v.add_argument("--any-rank-may-lead", action="store_true",
                   help="trusted groups: every rank may lead, credential or not (README \"Trust model\" says "
                        "what this gives up)")
    v.add_argument("--checkpoint-keep", type=int, default=5,
                   help="checkpoints kept per room: the newest N plus the best by held-out accuracy")
    v.add_argument("--allow-origin", default=None, metavar="ORIGINS",
                   help="web origins (comma-separated, e.g. https://lab.example.org) besides the server's "
                        "own that may open a WebSocket or change state (default: same origin only)")
    v.add_argument("--max-ranks-per-address", type=int, default=64,
                   help="seats (connected + reserved) one client address may hold in a room (default 64)")
    v.add_argument("--max-connections-per-address", type=int, default=256,
                   help="open TCP connections one client address may hold (default 256)")
    v.add_argument("--max-auth-failures", type=int, default=20,
                   help="failed token checks one client address may make per minute before its checks get 429 "
                        "(default 20; behind a proxy every client shares the proxy's address)")
    v.add_argument("--checkpoint-dir", default=None, help="directory for checkpoints; a room resumes from its file "
                   "there (ROOM.ckpt) at start (default: none, nothing is kept)")
    v.add_argument("--checkpoint-interval", type=float, default=5.0, help="the leader uploads a checkpoint every this many seconds")
    v.add_argument("--report-interval", type=float, default=1.0, help="ranks report their state every this many seconds")
    v.add_argument("--beat-ms", type=float, default=400.0, help="protocol beat period, ms")
    v.add_argument("--drop-ms", type=float, default=1600.0, help="protocol drop period, ms (at least 4 x --beat-ms)")
    v.add_argument("--collect-ms", type=float, default=2000.0, help="protocol collect window, ms")
    v.add_argument("--takeover-ms", type=float, default=3200.0, help="protocol takeover period, ms (at least 8 x --beat-ms)")
    v.add_argument("--rtc-hosts", default=None, help="WebRTC ICE host addresses for --link rtc ranks, "
                   "comma-separated (e.g. 127.0.0.1 on a loopback-only host; default: aioice's list)")
    v.add_argument("--ice-servers", default=None, help="WebRTC STUN/TURN URLs, comma-separated (default: none)")
    v.add_argument("--grace", type=float, default=30.0, help="seconds a disconnected rank's id stays reserved")
    v.add_argument("--roll-call", type=float, default=30.0, metavar="S",
                   help="seconds a restarted server's (or a cluster node's newly acquired room's) roll call stays "
                        "partial, the longer of this and --grace: its ranks come back within it (default 30, "
                        "the ranks' reconnect bound; at least 10, their largest delay between two attempts). "
                        "Lower it only where every rank comes back sooner.")
    c = v.add_argument_group("cluster (several serve nodes coordinated through Redis; README \"Cluster\")")
    c.add_argument("--redis", default=None, metavar="URL",
                   help="join a cluster: redis://HOST:PORT/DB (TABCOHORT_REDIS); give every node the same "
                        "rooms and a shared --checkpoint-dir")
    c.add_argument("--node-id", default=None, help="this node's id in the cluster (TABCOHORT_NODE_ID; "
                   "default: hostname-random)")
    c.add_argument("--advertise-url", default=None, metavar="URL",
                   help="the base URL other nodes send ranks and pages to (TABCOHORT_ADVERTISE_URL; "
                        "default: http://HOST:PORT as bound)")
    # (defaults None, applied with --redis: a value given without it is refused, not ignored)
    c.add_argument("--cluster-lease-ms", type=float, default=None,
                   help="room lease in Redis, ms, in [100, 3600000] (default 5000)")
    c.add_argument("--cluster-tick-ms", type=float, default=None,
                   help="heartbeat / renew period, ms, at most a third of the lease (default 1000)")
    c.add_argument("--cluster-takeover-ms", type=float, default=None,
                   help="a dead owner's room is claimed this long after its lease lapsed, ms (default: the lease)")
    v.add_argument("--advertise", action="store_true",
                   help="advertise the server on the LAN over mDNS as _tabcohort._tcp (needs zeroconf)")
    v.add_argument("--advertise-interfaces", default=None, metavar="IPS",
                   help="IPv4 interface addresses to advertise on, comma-separated (default: --host's, "
                        "or all interfaces when listening on 0.0.0.0)")
    p.commands = sub.choices     # (command name -> its parser: main names it in an error)
    return p


def _simulate(a: argparse.Namespace) -> int:
    from .runtime.inproc import InprocConfig

    train, lr = _train_from(a, 0.5)
    job_options = _check_job_args(a)
    if a.heal_after_ms is not None and not a.partition_at:
        raise ConfigError("--heal-after-ms", a.heal_after_ms, "applies only with --partition-at STEP (it heals "
                          "that partition): without it there is nothing to heal")
    cfg = InprocConfig(ranks=a.ranks, dataset=a.dataset, batch=32 if a.batch is None else a.batch, hidden=a.hidden, lr=lr,
                       activation=a.activation, job_options=job_options,
                       steps=a.steps, target_accuracy=a.target_accuracy, max_seconds=a.max_seconds,
                       precision=a.precision, seed=a.seed, backend=a.backend, eval_every=a.eval_every,
                       kill_leader_at_step=a.kill_leader_at, add_rank_at_step=a.add_rank_at,
                       partition_at_step=a.partition_at,
                       heal_after_ms=3000.0 if a.heal_after_ms is None else a.heal_after_ms,
                       loss=a.link_loss, delay_ms=a.link_delay_ms, collect_rule=a.collect_rule,
                       global_batch=a.global_batch, train=train, bandwidth_bytes_per_s=a.link_bandwidth,
                       job=a.job)
    try:
        cfg.validate()
        if a.backend not in ("auto", "numpy", "python"):
            raise ConfigError("backend", a.backend, "expected one of auto, numpy, python")
    except ConfigError as exc:
        raise ConfigError(_flag(exc.variable), exc.value, exc.reason) from None
    if a.batch is not None and a.global_batch:
        # (it was ignored in silence: the global batch is the round's samples whatever --batch says)
        raise ConfigError("--batch", a.batch, f"has no effect with --global-batch {a.global_batch}, which sets "
                          f"the samples of a round: give one of them")
    t0 = time.monotonic()
    cohort: list[Any] = []     # (the run's cohort, once built: what Ctrl-C's summary reads)
    try:
        return _simulate_run(a, cfg, job_options, cohort)
    except KeyboardInterrupt:
        if not a.json:   # (under --json main() prints the one document; before, exit 130 said nothing)
            step, acc = cohort[0].so_far() if cohort else (None, None)
            print(interrupted_line(step, acc, time.monotonic() - t0), flush=True)
        raise


def interrupted_line(step: int | None, accuracy: float | None, seconds: float) -> str:
    """``simulate``'s one line when Ctrl-C stops it: the step reached (None: before the ranks
    started), the last held-out accuracy when one is known, and the seconds since it began."""
    where = "before the ranks started" if step is None else f"at step {step}"
    acc = (f", last test accuracy {accuracy * 100:.2f} %" if isinstance(accuracy, (int, float))
           and 0.0 <= accuracy <= 1.0 else ", no test accuracy yet" if step is not None else "")
    return f"stopped by Ctrl-C {where}{acc}, after {seconds:.1f} s"


def _simulate_run(a: argparse.Namespace, cfg: Any, job_options: Any, cohort: list[Any]) -> int:
    """:func:`_simulate` from its job check on; ``cohort`` gets the run's cohort once built."""
    from .model import load_dataset
    from .runtime.inproc import InprocCohort
    try:   # a bad --dataset or --job is named before anything starts (the run loads it again)
        if not cfg.job:
            load_dataset(cfg.dataset, seed=cfg.seed)
        else:
            from .jobs import PROBE_TIMEOUT_S, load_job
            load_job(cfg.job, with_data=False, options=job_options, timeout_s=PROBE_TIMEOUT_S)
    except ConfigError as exc:
        raise ConfigError(_flag(exc.variable), exc.value, exc.reason) from None
    # progress goes to stderr under --json, so stdout is exactly one JSON document
    out = sys.stderr if a.json else sys.stdout
    opts = ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in (job_options or {}).items())
    what = f"job {cfg.job}{f' ({opts})' if opts else ''}" if cfg.job else f"dataset {cfg.dataset}"
    print(f"tabcohort simulate: {_n(cfg.ranks, 'rank')}, {what}, global batch {cfg.resolved_global_batch}, "
          f"lr {cfg.lr}, precision {cfg.precision}", flush=True, file=out)
    if cfg.resolved_global_batch < cfg.ranks:
        # (a share is one sample at least: the others looked as if they computed)
        idle = cfg.ranks - cfg.resolved_global_batch
        print(f"note: a round covers {_n(cfg.resolved_global_batch, 'sample')} (the global batch) and a share is at "
              f"least one, so at least {_n(idle, 'rank')} {'gets' if idle == 1 else 'get'} no share in a round (a rank without one follows the round and may take over); "
              f"raise --global-batch to have every rank compute", flush=True, file=out)
    print("loading the dataset and starting the ranks...", flush=True, file=out)
    # (a refused or failed run's one JSON document is printed by main()'s handlers)
    async def run() -> Any:
        cohort.append(InprocCohort(cfg, progress=lambda line: print(line, flush=True, file=out)))
        return await cohort[0].run()
    res = asyncio.run(run())
    # a run --max-seconds ended before its first step trained nothing: not a success (it printed
    # "done: 0 steps", the initial model's test accuracy and exit 0: a new-user trial)
    no_step = res.steps == 0 and res.stopped_by == "max_seconds"
    ok = res.bit_identical and not no_step and not res.separate_leaders
    why_no_step = (f"no step was taken: --max-seconds {a.max_seconds:g} ended the run; {res.slow_call}"
                   if res.slow_call else
                   f"no step was taken: --max-seconds {a.max_seconds:g} ended the run while the cohort of "
                   f"{_n(cfg.ranks, 'rank')} was still forming (every rank beats to every other, about n^2 deliveries per "
                   f"beat period: README \"Scaling limits\"); raise --max-seconds or run fewer ranks")
    if a.json:   # ("ok" as a refused or failed run's {"ok": false, "error": ...} has it)
        doc = {"ok": ok, **({"error": why_no_step} if no_step else {}), **res.__dict__}
        # rank ids as the console, the state report and `shares` show them (8 hex digits): the
        # digests and leaders were decimal beside hex shares, and could not be matched by eye
        doc["digests"] = {f"{k:08x}": v for k, v in res.digests.items()}
        doc["leaders"] = [f"{k:08x}" for k in res.leaders]
        doc["separate_leaders"] = [f"{k:08x}" for k in res.separate_leaders]
        if not math.isfinite(doc["loss"]):
            doc["loss"] = None   # (no round yet: NaN is not JSON, RFC 8259; evaluate says null too)
        _print_json(json.dumps(doc, default=str, indent=2))
    elif no_step:
        print(f"stopped: {why_no_step}")
    else:
        acc_s = f"{res.accuracy * 100:.2f} %" if res.accuracy is not None else "n/a (evaluate() outside [0, 1])"
        # (the last training loss too: a job with its gradient's sign flipped ended on "test
        # accuracy 6.50 %" with the rising loss nowhere on screen, in a run too short for progress)
        loss_s = f"training loss {res.loss:.4g}, " if math.isfinite(res.loss) else ""
        print(f"done: {res.steps} steps in {res.seconds:.1f} s, {loss_s}test accuracy {acc_s}, "
              f"{res.samples_per_s:.0f} samples/s, leaders {[f'{k:08x}' for k in res.leaders]}")
        if res.shares or res.speeds:
            print("last shares of the global batch (samples, the rank's measured samples/s): " + ", ".join(
                f"{k} {res.shares.get(k, 0)}" + (f" ({res.speeds[k]:.0f}/s)" if k in res.speeds else "")
                for k in sorted(set(res.shares) | set(res.speeds))))
        print(f"bit-identical parameters on {'all ' if len(res.digests) > 1 else ''}{_n(len(res.digests), 'rank')}: "
              f"{'yes' if res.bit_identical else 'NO'} ({next(iter(res.digests.values()))[:16]})"
              + (f", but as {len(res.separate_leaders)} separate cohorts, not one" if res.separate_leaders else ""))
        if res.note:
            print(f"  ({res.note})")
        if res.stopped_by == "max_seconds" and not res.separate_leaders:
            # (it ended short of --steps in silence: a new-user trial; not said of separate
            # cohorts, which more time would not join)
            print(f"  (--max-seconds {a.max_seconds:g} ended the run before --steps {a.steps}: raise it to run them all)")
    return 0 if ok else 1


def _n(count: int, noun: str) -> str:
    """``1 rank``, ``4 ranks``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _ip_list(flag: str, value: str) -> list[str]:
    """Comma-separated IP address literals; a ConfigError naming ``flag`` otherwise."""
    import ipaddress
    out = [h.strip() for h in value.split(",") if h.strip()]
    for h in out:
        try:
            ipaddress.ip_address(h)
        except ValueError:
            raise ConfigError(flag, value, f"{h!r} is not an IP address literal; expected e.g. 127.0.0.1") from None
    return out


def _rank(a: argparse.Namespace) -> int:
    from .runtime.native import RankConfig, run_rank

    cfg = RankConfig.from_sources({"server": a.server, "room": a.room, "token": a.token, "batch": a.batch,
                                   "trainer_token": a.trainer_token,
                                   "link": a.link, "backend": a.backend, "ice_servers": a.ice_servers,
                                   "rtc_hosts": a.rtc_hosts, "rtc_timeout": a.rtc_timeout,
                                   "direct": a.direct, "direct_host": a.direct_host,
                                   "direct_announce": a.direct_announce,
                                   "discover": a.discover, "discover_host": a.discover_host,
                                   "discover_timeout": a.discover_timeout,
                                   "discover_interfaces": a.discover_interfaces,
                                   "trust_job": a.trust_job, "job": a.job})
    cfg.validate()  # ConfigError before any network activity (getaddrinfo only)
    if cfg.discover:
        cfg.discover_server(progress=say)
    if not (a.print_every >= 0):
        raise ConfigError("--print-every", a.print_every, "must be seconds >= 0")
    from .bus.room import CLOSE_BAD_TOKEN, LinkFailed
    from .runtime.native import TRAINER_TOKEN_REFUSED
    try:
        return asyncio.run(run_rank(cfg, progress=say, print_every_s=a.print_every))
    except LinkFailed as e:   # the room token was checked over HTTP first: this is the trainer credential
        if e.code == CLOSE_BAD_TOKEN and cfg.trainer_token and "trainer" in e.reason:
            raise ConfigError(cfg._name("trainer_token"), "<hidden>", TRAINER_TOKEN_REFUSED) from None
        raise


def _evaluate(a: argparse.Namespace) -> int:
    from .jobs.arrays import ArrayFormatError, read_npz
    try:
        with open(a.model, "rb") as f:
            arrays, other = read_npz(f.read())
        params = arrays["params"]
        job = json.loads(other["job.json"])
    except OSError as e:
        raise ConfigError("--model", a.model, f"cannot read it ({e.strerror})") from None
    except KeyError as e:
        raise ConfigError("--model", a.model, f"not a model export: it has no {e.args[0]!r} member (an export "
                          "is GET /api/rooms/ROOM/model: an .npz with params.npy and job.json)") from None
    except (ArrayFormatError, ValueError) as e:
        # (a raw checkpoint, GET .../checkpoint, is float32 parameters without the job: a new-user
        # trial downloaded one and was not told where the export is)
        raise ConfigError("--model", a.model, f"not a model export (.npz with params.npy and job.json): {e}; "
                          "download one from GET /api/rooms/ROOM/model (the page of a finished room links "
                          "it), not the raw .../checkpoint") from None
    if params.descr != "<f4" or len(params.shape) != 1 or params.size != job.get("bucket_len"):
        raise ConfigError("--model", a.model, f"params.npy must be float32 of shape ({job.get('bucket_len')},), "
                          f"got {params.descr} {params.shape}")
    from .vec import all_finite
    if not all_finite(params.data):   # (it printed "held-out accuracy 7.22 %" and exited 0 on a NaN parameter)
        first = next(i for i, x in enumerate(params.data) if not math.isfinite(x))
        n_bad = sum(1 for x in params.data if not math.isfinite(x))   # (no index list: it may be all NaN)
        raise ConfigError("--model", a.model, f"{n_bad} of its {params.size} parameters are not finite "
                          f"(the first at index {first}: {params.data[first]!r}): not a model to evaluate")
    batch = int(job.get("batch") or 1)
    info = job.get("job_info")
    if not isinstance(info, dict):
        raise ConfigError("--model", a.model, "its job.json names no job (job_info): exported by an older "
                          "tabcohort; evaluate it with that version")
    from .jobs import PROBE_TIMEOUT_S, find_source, load_job, shipped_source
    ref = a.job
    if not ref:   # the built-in job (or another that ships with tabcohort): this install's own copy
        own = shipped_source(info.get("code_sha256"))
        if own is None:
            raise ConfigError("--job", "(not given)", f"the model was trained as the job {info.get('name')!r}: "
                              "give --job PATH naming it")
        ref = os.path.join(own.root, own.module + ".py")
    elif (src := find_source(ref)).code_sha256 != info.get("code_sha256"):
        from .runtime.session import renamed_copy_hint
        hint = renamed_copy_hint(src, info, "--job")
        if hint is not None:
            raise ConfigError("--job", a.job, f"it is the model's job {info.get('name')!r} {hint}")
        raise ConfigError("--job", a.job, f"its code is not the model's job {info.get('name')!r} (code sha256 "
                          f"{str(info.get('code_sha256'))[:16]}): another job, or another version of it")
    options = info.get("options")
    given = _job_options(a.job_option)
    if given and not a.job:
        raise ConfigError("--job-option", next(iter(given)), "sets a LOCAL_OPTIONS entry of a module job (--job)")
    for k, v in given.items():
        # (a model trained with a LOCAL_OPTIONS override, e.g. another data file, could not be
        # evaluated: a new-user trial); the published OPTIONS are the model's own
        if isinstance(options, dict) and k in options and options[k] != v:
            raise ConfigError("--job-option", f"{k}={v!r}", f"the model was trained with {k}={options[k]!r} (one of "
                              "the job's OPTIONS, part of its hash): only LOCAL_OPTIONS may be given here")
    if given:
        options = {**(options or {}), **given}
    if a.dataset is not None:
        if not info.get("builtin") or not str((options or {}).get("dataset", "")).startswith("npz:"):
            raise ConfigError("--dataset", a.dataset, "only for a model of the built-in job trained on an .npz file")
        options = {**options, "dataset_path": a.dataset}
    try:
        loaded = load_job(ref, options=options, timeout_s=PROBE_TIMEOUT_S)
    except ConfigError as exc:
        if a.dataset is not None and exc.variable in ("dataset", "dataset_path"):
            raise ConfigError("--dataset", a.dataset, exc.reason) from None   # (the file the user gave)
        if exc.variable in ("dataset", "dataset_path") and "no such file" in exc.reason:
            # the model's own path to its data (relative to where serve ran): say how to give it
            raise ConfigError(exc.variable, exc.value, f"{exc.reason}; give the data file's path with "
                              "--dataset PATH") from None
        raise
    worker = loaded.make_worker(batch=batch, seed=int(job.get("seed", 0)), backend=a.backend)
    from .protocol.optim import TrainConfig
    jh = loaded.job_hash(worker, TrainConfig.from_job(job).spec())
    if jh != job["job_hash"]:
        if a.dataset is not None and not a.job:
            # (it blamed --job=.../builtin_mlp.py, which the user never gave: the data differ)
            raise ConfigError("--dataset", a.dataset, f"not the data the model was trained on (job hash {jh} "
                              f"is not the model's {job['job_hash']})")
        local = getattr(loaded.module, "LOCAL_OPTIONS", None)
        hint = (f"; if the model was trained with one of its LOCAL_OPTIONS ({', '.join(sorted(map(str, local)))}) "
                f"set otherwise (e.g. another data file), give it with --job-option NAME=VALUE"
                if isinstance(local, dict) and local and not given else "")
        # (which part differs, where the model's job.json says: it named all three; the code
        # was compared above)
        theirs = info.get("data_sha256")
        differs = ("its data differs from the model's" if theirs and loaded.data.sha256 != theirs else
                   "its spec differs: the model's layers or training settings" if theirs else
                   "other data or spec")
        raise ConfigError("--job", a.job or ref, f"its job hash {jh} is not the model's "
                          f"{job['job_hash']} ({differs}){hint}")
    worker.set_params(params.data)
    loss, acc = float(worker.evaluate_loss()), float(worker.evaluate())
    if not 0.0 <= acc <= 1.0:
        raise ConfigError("--job", a.job or ref,
                          f"the job's evaluate() returned {acc!r}, not a held-out accuracy in [0, 1]")
    # a job without evaluate_loss() has no held-out loss: null in JSON (NaN is not JSON, RFC 8259)
    res = {"job_hash": job["job_hash"], "step": (job.get("checkpoint") or {}).get("step"),
           "accuracy": acc, "loss": loss if math.isfinite(loss) else None}
    if a.json:
        _print_json(json.dumps(res, allow_nan=False))
    else:
        has_loss = getattr(getattr(worker, "inner", worker), "evaluate_loss", None) is not None
        loss_s = (f"{res['loss']:.4f}" if res["loss"] is not None
                  else "not finite" if has_loss else "n/a (the job has no evaluate_loss())")
        print(f"model {a.model}: step {res['step']}, job hash {res['job_hash'][:16]}: held-out accuracy "
              f"{res['accuracy'] * 100:.2f} %, held-out loss {loss_s}")
    return 0


def _trainer_token_from_env(env: Mapping[str, str]) -> str | None:
    """``serve``'s trainer token from ``TABCOHORT_TRAINER_TOKEN`` (None: unset).

    Raises:
        ConfigError: set but empty, naming the variable (it was taken as unset, and serve read
            or generated another token than the one the operator meant; ``--trainer-token=""``
            was refused).
    """
    var = "TABCOHORT_TRAINER_TOKEN"
    value = env.get(var)
    if value == "":
        from .runtime.native import EMPTY_TOKEN_VARIABLE
        raise ConfigError(var, "", EMPTY_TOKEN_VARIABLE + f"; give a token of 16..256 printable ASCII characters, or "
                          f"unset {var}: serve then reads CHECKPOINT_DIR/.trainer-token or generates one")
    return value


def default_room_name(job: str | None) -> str:
    """The room a ``serve`` without ``--room`` hosts: ``digits`` for the built-in job (whatever
    its ``--dataset``: the name every earlier checkpoint directory holds), else named after the
    module job, so its checkpoints (``ROOM.ckpt``) do not take the built-in room's name.

    Args:
        job: the ``--job`` argument (a path to a ``.py`` file or a package directory, or a
            module name, each optionally with ``:FACTORY``), or None for the built-in job.

    Returns:
        The module's stem (``my_job.py`` -> ``my_job``, ``pkg.mod:make`` -> ``mod``), with
        every character outside ``[A-Za-z0-9._-]`` replaced by ``-``, cut to 64 and without
        leading or trailing dots or leading dashes (the server's room-name rule,
        ``tabcohort_server.config.ROOM_NAME``); ``job`` when nothing is left.
    """
    if job is None:
        return "digits"
    src = job
    if ":" in src and not os.path.exists(src):   # PATH_OR_MODULE:FACTORY
        src = src.rsplit(":", 1)[0]
    src = src.rstrip("/" + os.sep)
    base = os.path.basename(src)
    if base == "__init__.py":         # a package named by its __init__.py: the package
        name = os.path.basename(os.path.dirname(os.path.abspath(src)))
    elif base.endswith(".py"):
        name = base[:-3]
    elif os.sep in src or "/" in src or os.path.isdir(src):
        name = base               # a package directory
    else:
        name = base.rsplit(".", 1)[-1]   # a module name: its last component
    # (no leading "-": the name is typed after --room, where it would read as an option)
    name = re.sub(r"[^A-Za-z0-9._-]", "-", name)[:64].strip(".").lstrip("-")
    return name or "job"


def _serve(a: argparse.Namespace) -> int:
    if a.room is None:
        a.room = default_room_name(a.job)
    try:
        return _serve_checked(a)
    except ConfigError as e:  # a room field (``digits.steps``) or a Timing field -> the flag typed
        field = e.variable[len(a.room) + 1:] if e.variable.startswith(f"{a.room}.") else e.variable
        field = {"allowed_origins": "allow_origin", "resume_grace_s": "grace"}.get(field, field)
        dest = field[:-2] if field.endswith("_s") else field
        if dest in ("dataset", "dataset_path") and a.job is None:
            # (the built-in job reads --dataset from its absolute path: echo what the user typed)
            raise ConfigError("--dataset", a.dataset, e.reason) from None
        if dest and "." not in dest and not dest.startswith("-") and hasattr(a, dest):
            raise ConfigError("--" + dest.replace("_", "-"), e.value, e.reason) from None
        raise


def _serve_checked(a: argparse.Namespace) -> int:
    if not 0 <= a.port <= 65535:
        raise ConfigError("--port", a.port, "must be in 0..65535 (0 = any free port)")
    try:
        from tabcohort_server.config import JobConfig, ServerConfig, ServerLimits
        from tabcohort_server.serve import serve
    except ImportError as exc:
        raise ConfigError("serve", "tabcohort_server", f"the server package is not importable: {exc}")
    from .protocol.policy import Timing

    job_options = _check_job_args(a)
    if a.job is None and a.dataset not in ("digits", "synthetic") and not (
            a.dataset.endswith(".npz") or os.sep in a.dataset or os.path.exists(a.dataset)):
        # (as simulate's load_dataset tells a name from a path: "no such file '/abs/nosuch'" was
        # said of a name the user never typed as a path)
        from .model.data import UNKNOWN_DATASET
        raise ConfigError("--dataset", a.dataset, UNKNOWN_DATASET)
    # docs/PROTOCOL.md "Timing": the policy raises drop to 4 beats and takeover to 8, so a smaller
    # value would be silently ignored; say so instead
    for flag, val, k in (("--drop-ms", a.drop_ms, 4), ("--takeover-ms", a.takeover_ms, 8)):
        if isinstance(val, (int, float)) and isinstance(a.beat_ms, (int, float)) and 0 < a.beat_ms and val < k * a.beat_ms:
            raise ConfigError(flag, val, f"must be at least {k} x --beat-ms ({k * a.beat_ms:g} ms): "
                              f"docs/PROTOCOL.md \"Timing\" derives it from the beat, so a smaller value has no effect")
    if a.target_accuracy and a.eval_every == 0:
        raise ConfigError("--target-accuracy", a.target_accuracy, "needs evaluations: with --eval-every 0 the "
                          "leader never evaluates")
    train, lr = _train_from(a, 0.5)
    if a.token is None and os.environ.get("TABCOHORT_TOKEN"):
        # (rank and tab read it: exported once for both, serve ran an open room, unsaid)
        from tabcohort_server.config import check_token
        a.token = os.environ["TABCOHORT_TOKEN"]
        check_token("TABCOHORT_TOKEN", a.token)
    job = JobConfig(dataset=a.dataset, hidden=a.hidden, activation=a.activation, job_options=job_options,
                    batch=a.batch, global_batch=a.global_batch, lr=lr, seed=a.seed,
                    local_steps=train.local_steps, inner_optimizer=train.inner_optimizer, inner_lr=train.inner_lr,
                    outer_optimizer=train.outer_optimizer, outer_momentum=train.outer_momentum,
                    precision=a.precision, topology=a.topology, steps=a.steps, collect_rule=a.collect_rule,
                    aggregate=a.aggregate, lr_max=a.lr_max, job=a.job, target_accuracy=a.target_accuracy, duration_s=a.duration, token=a.token,
                    eval_every=a.eval_every,
                    checkpoint_interval_s=a.checkpoint_interval, report_interval_s=a.report_interval,
                    timing=Timing(a.beat_ms, a.drop_ms, a.collect_ms, a.takeover_ms))
    from tabcohort.bus.rtc_util import parse_ice_servers
    op_token = a.operator_token
    if op_token is None and os.environ.get("TABCOHORT_OPERATOR_TOKEN"):
        from tabcohort_server.config import check_token
        op_token = os.environ["TABCOHORT_OPERATOR_TOKEN"]
        check_token("TABCOHORT_OPERATOR_TOKEN", op_token)
    trainer = a.trainer_token
    if trainer is None and os.environ.get("TABCOHORT_TRAINER_TOKEN") is not None:
        from tabcohort_server.config import check_token
        trainer = _trainer_token_from_env(os.environ)
        check_token("TABCOHORT_TRAINER_TOKEN", trainer)
    elif trainer is not None:
        from tabcohort_server.config import check_token
        check_token("--trainer-token", trainer)
    origins = tuple(o.strip().rstrip("/") for o in (a.allow_origin or "").split(",") if o.strip())
    for name in ("max_ranks_per_address", "max_connections_per_address", "max_auth_failures"):
        if getattr(a, name) < 1:
            raise ConfigError("--" + name.replace("_", "-"), getattr(a, name), "must be an integer >= 1")
    cfg = ServerConfig(rooms={a.room: job}, checkpoint_dir=a.checkpoint_dir,
                       operator_token=op_token, allowed_origins=origins,
                       trainer_token=trainer, any_rank_may_lead=a.any_rank_may_lead,
                       checkpoint_keep=a.checkpoint_keep,
                       limits=ServerLimits(resume_grace_s=a.grace, roll_call_s=a.roll_call, max_ranks_per_address=a.max_ranks_per_address,
                                           max_connections_per_address=a.max_connections_per_address,
                                           max_auth_failures=a.max_auth_failures),
                       rtc_ice_servers=tuple(parse_ice_servers(a.ice_servers, "--ice-servers")),
                       rtc_host_addresses=None if not a.rtc_hosts else _ip_list("--rtc-hosts", a.rtc_hosts))
    redis_url = a.redis or os.environ.get("TABCOHORT_REDIS") or None
    if redis_url:
        import secrets
        import socket
        from tabcohort_server.cluster import ClusterConfig, ClusterTiming
        flag = "--redis" if a.redis else "TABCOHORT_REDIS"
        from tabcohort_server.cluster import check_redis_url
        check_redis_url(redis_url, flag)
        node_id = a.node_id or os.environ.get("TABCOHORT_NODE_ID") or (
            "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in socket.gethostname())[:48]
            + "-" + secrets.token_hex(3))
        lease_ms = ClusterTiming.lease_ms if a.cluster_lease_ms is None else a.cluster_lease_ms
        timing = ClusterTiming(lease_ms=lease_ms,
                               tick_ms=ClusterTiming.tick_ms if a.cluster_tick_ms is None else a.cluster_tick_ms,
                               takeover_ms=lease_ms if a.cluster_takeover_ms is None else a.cluster_takeover_ms)
        cfg.cluster = ClusterConfig(redis_url=redis_url, node_id=node_id,
                                    advertise_url=(a.advertise_url or os.environ.get("TABCOHORT_ADVERTISE_URL")
                                                   or "").rstrip("/"),
                                    timing=timing)
        try:
            cfg.cluster.validate()
        except ConfigError as exc:   # name the environment variable when the value came from it
            env = {"--node-id": ("TABCOHORT_NODE_ID", a.node_id),
                   "--advertise-url": ("TABCOHORT_ADVERTISE_URL", a.advertise_url)}.get(exc.variable)
            if env is not None and not env[1] and os.environ.get(env[0]):
                raise ConfigError(env[0], exc.value, exc.reason) from None
            raise
    else:   # a cluster option without a cluster would be silently ignored: refuse it (only the
        # flags: TABCOHORT_NODE_ID / TABCOHORT_ADVERTISE_URL may be set by default, as in
        # docker-compose.yml, and are read only with Redis)
        for flag, val in (("--node-id", a.node_id), ("--advertise-url", a.advertise_url),
                          ("--cluster-lease-ms", a.cluster_lease_ms), ("--cluster-tick-ms", a.cluster_tick_ms),
                          ("--cluster-takeover-ms", a.cluster_takeover_ms)):
            if val is not None:
                raise ConfigError(flag, val, "needs --redis (or TABCOHORT_REDIS): it configures a cluster "
                                  "node, and without Redis this server is not one")
    ifaces = None
    if a.advertise_interfaces is not None and not a.advertise:
        raise ConfigError("--advertise-interfaces", a.advertise_interfaces, "applies only with --advertise (it "
                          "chooses where the server is advertised): without it nothing is advertised")
    if a.advertise_interfaces:
        import ipaddress
        ifaces = [h.strip() for h in a.advertise_interfaces.split(",") if h.strip()]
        for h in ifaces:
            try:
                ipaddress.IPv4Address(h)
            except ValueError:
                raise ConfigError("--advertise-interfaces", a.advertise_interfaces,
                                  "expected comma-separated IPv4 interface addresses") from None
    if a.advertise:
        try:
            import zeroconf  # noqa: F401
        except ImportError as exc:
            raise ConfigError("--advertise", True, f"needs the zeroconf package (pip install 'tabcohort[lan]'): {exc}")
    return serve(cfg, host=a.host, port=a.port, progress=say,
                 advertise=a.advertise, advertise_interfaces=ifaces)


def say(line: str) -> None:
    """Print one progress line of a long-running command (``rank``, ``serve``). An output that
    is gone (the terminal hung up: EIO; the pipe's reader left: EPIPE, as ``| head`` does) asks
    for the ordered stop, as a hangup does (SIGHUP; nothing under ``nohup``, which ignores it),
    and the printing ends: standard output goes to the null device, so neither a later line nor
    the flush at exit raises, and the stop runs to its final checkpoint. Any other error (a full
    disk) is raised as before."""
    import errno
    import signal
    try:
        print(line, flush=True)
    except OSError as e:
        if e.errno not in (errno.EIO, errno.EPIPE):
            raise
        try:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, sys.stdout.fileno())
            os.close(fd)
        except (OSError, ValueError):
            pass
        hup = getattr(signal, "SIGHUP", None)
        if hup is not None and signal.getsignal(hup) not in (signal.SIG_IGN, signal.SIG_DFL):
            # (said first: "SIGHUP: stopping in order" alone read as a hangup that never came)
            why = "its reader left (a closed pipe)" if e.errno == errno.EPIPE else "the terminal hung up"
            try:
                os.write(2, f"tabcohort: standard output is gone, {why}: stopping as on a hangup\n".encode())
            except OSError:
                pass
            os.kill(os.getpid(), hup)   # (a handler is installed: the ordered stop; else it runs on)


#: where ``--json``'s one document goes (:func:`_json_to_stdout_alone`); None: ``sys.stdout``
_JSON_OUT: Any = None


def _json_to_stdout_alone() -> Callable[[], None]:
    """Under ``--json`` standard output carries exactly one JSON document: what anything else
    writes there (a job's ``print()`` in ``grads()``, a library's C code on file descriptor 1)
    goes to standard error instead, and the document to the original standard output (a job
    that printed made ``simulate --json``'s output unreadable: a new-user trial). Returns the
    function that puts standard output back."""
    global _JSON_OUT
    try:
        sys.stdout.flush()
        out_fd = sys.stdout.fileno()
        fd = os.dup(out_fd)
        os.dup2(sys.stderr.fileno(), out_fd)
    except (OSError, ValueError, AttributeError):   # (no real descriptors: a captured stdout)
        return lambda: None
    _JSON_OUT = os.fdopen(fd, "w")

    def restore() -> None:     # (main() called in a process that goes on: a test's)
        global _JSON_OUT
        try:
            sys.stdout.flush()
            _JSON_OUT.flush()
            os.dup2(fd, out_fd)
        except (OSError, ValueError):
            pass
        _JSON_OUT.close()
        _JSON_OUT = None
    return restore


def _print_json(text: str) -> None:
    """Print ``--json``'s document where :func:`_json_to_stdout_alone` keeps it."""
    out = _JSON_OUT if _JSON_OUT is not None else sys.stdout
    print(text, file=out, flush=True)


class _LogLine(logging.Formatter):
    """A log record as one of the command's own lines: ``tabcohort serve: warning: ...``
    (timestamped ``tabcohort.server WARNING`` lines among the plain progress lines read as
    another program's: a new-user trial)."""

    def format(self, record: logging.LogRecord) -> str:
        record = logging.makeLogRecord(record.__dict__)
        record.levelname = record.levelname.lower()
        return super().format(record)


def _log_lines(command: str | None, *, verbose: bool) -> None:
    """Log records to stderr: warnings and errors as the command's lines; with ``--verbose``
    every record, with its time and logger (for a bug report)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s") if verbose
                         else _LogLine(f"tabcohort {command or ''}: %(levelname)s: %(message)s".replace(" :", ":")))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[handler])


def main(argv: Sequence[str] | None = None) -> int:
    try:   # (building the parser reads the package's metadata: a Ctrl-C there printed a traceback)
        parser = build_parser()
        a, extra = parser.parse_known_args(argv)
    except KeyboardInterrupt:
        print("tabcohort: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    if extra:   # (named by the command's parser: "see tabcohort serve --help", not "tabcohort --help")
        parser.commands[a.command].error(f"unrecognized arguments: {' '.join(extra)}")
    _log_lines(a.command, verbose=a.verbose)
    restore = (_json_to_stdout_alone() if a.command in ("simulate", "evaluate") and getattr(a, "json", False)
               else lambda: None)
    try:
        return _main_command(a, parser)
    finally:
        restore()


def _main_command(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        if a.command in ("simulate", "rank", "serve"):
            hold_allocator()
        if a.command == "simulate":
            return _simulate(a)
        if a.command == "rank":
            return _rank(a)
        if a.command == "serve":
            return _serve(a)
        if a.command == "evaluate":
            return _evaluate(a)
    except ConfigError as exc:
        print(f"tabcohort: configuration error: {exc}", file=sys.stderr)
        if a.command in ("simulate", "evaluate") and getattr(a, "json", False):
            # (stdout is one JSON document under --json, a refused configuration's too)
            _print_json(json.dumps({"ok": False, "error": f"configuration error: {exc}"}, indent=2))
        return 2
    except TabcohortError as exc:
        print(f"tabcohort: error: {exc}", file=sys.stderr)
        if a.command in ("simulate", "evaluate") and getattr(a, "json", False):
            # (stdout is still one JSON document: a script reading it learns why)
            _print_json(json.dumps({"ok": False, "error": str(exc)}, indent=2))
        return 1
    except KeyboardInterrupt:
        if a.command in ("simulate", "evaluate") and getattr(a, "json", False):
            _print_json(json.dumps({"ok": False, "error": "interrupted (Ctrl-C)"}, indent=2))
        elif a.command != "simulate":   # (simulate says its own summary line)
            # (serve stopped during its job's start-up check ended with exit 130 and no word)
            print(f"tabcohort {a.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    parser.error(f"unknown command {a.command}")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
