"""What a native rank (:mod:`tabcohort.runtime.native`) and a tab rank
(:mod:`tabcohort.runtime.tab`) share: the checks on what the server hands out, the machine for
one seat, the server's controls, and leaving the cohort (PROTOCOL.md, "Native bring-up",
"Controls"; docs/INTERFACES.md, "Close codes and reconnects").

The runtimes differ only in how they fetch, upload and show (aiohttp and a terminal, or the
page's ``fetch`` and UI); those stay in their modules.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from array import array
from typing import Any, Awaitable, Callable

from .._json import within_depth
from ..errors import ConfigError, TabcohortError


def step_limit(job: dict) -> int | None:
    """The job's exact step limit for the machine (docs/PROTOCOL-NOTES.md, note 13); None = none."""
    steps = job.get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None


def check_topology(job: dict, who: str) -> None:
    """Raises ConfigError unless the room's topology is star or mesh."""
    if job.get("topology") not in ("star", "mesh"):
        raise ConfigError("topology", job.get("topology"), f"{who} supports the star and mesh topologies")


#: the most of a finished room's ``stop_reason`` a rank repeats, characters
STOP_REASON_SHOWN_LEN = 300


#: the deepest nesting of arrays and objects a room summary may have (the server's is about 6)
ROOM_SUMMARY_MAX_DEPTH = 64


def parse_room_summary(body: bytes | str) -> dict | None:
    """The room's public summary (the body of ``GET /api/rooms/ROOM``, UTF-8 JSON) as a dict, or
    None when the body is not a JSON object (not JSON, a list, a number too long to convert,
    arrays or objects nested deeper than :data:`ROOM_SUMMARY_MAX_DEPTH`): the summary is only a
    hint, and a misconfigured server or proxy answers anything. (The depth is bounded before
    the body is parsed: in Pyodide, a body of 20,000 brackets overflowed the JavaScript stack in
    ``json.loads``, a fatal error of the whole runtime, not a RecursionError.)"""
    try:
        text = body.decode("utf-8") if isinstance(body, (bytes, bytearray)) else body
        if not isinstance(text, str) or not within_depth(text, ROOM_SUMMARY_MAX_DEPTH):
            return None
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def finished_room_message(summary: Any) -> str | None:
    """What a rank says before it leaves a room that has finished (README "Resuming": a room
    whose checkpoint already reached ``--steps`` is finished, and ranks that join are told to
    stop), from the room's public summary (:func:`parse_room_summary`); None when the summary
    does not say ``"stopped": true`` (the rank goes on: a summary of any other shape is unknown,
    never a reason to stop).

    The message is plain text: the server's ``stop_reason`` (a string, else left out) is cut to
    :data:`STOP_REASON_SHOWN_LEN` characters, and its unprintable characters and ``<``, ``>``
    become ``?`` (a terminal prints it, a page shows it).
    """
    if not isinstance(summary, dict) or summary.get("stopped") is not True:
        return None
    reason = summary.get("stop_reason")
    why = ("".join(c if c.isprintable() and c not in "<>" else "?" for c in reason[:STOP_REASON_SHOWN_LEN])
           if isinstance(reason, str) else "")
    return (f"stopped{f' (server: {why})' if why.strip() else ''} before joining the cohort: the room has "
            "finished; nothing was fetched")


def trusted_job_source(info: dict, *, trust: bool, local: str | None, trust_var: str = "--trust-job",
                       job_var: str = "--job") -> Any:
    """What a native rank may run for the room's job (README "Trust model for job code"): the local copy
    ``local`` (its code hash must be the room's), the rank's own copy of a job that ships with
    tabcohort when the room's code hash is that copy's (the built-in job:
    :func:`tabcohort.jobs.shipped_source`), ``None`` = the server's code (``trust``), or a
    ConfigError naming both options.

    Raises:
        ConfigError: neither option, or the local copy's code hash differs.
    """
    from ..jobs import find_source, shipped_source
    name, want = info.get("name"), info.get("code_sha256")
    if not local:
        own = shipped_source(want)
        if own is not None:
            return own
        if info.get("builtin") and not trust:
            raise ConfigError("tabcohort", package_version(), f"the room's built-in job {name!r} has code sha256 "
                              f"{str(want)[:16]} and this tabcohort's differs: the server runs other "
                              f"tabcohort code (this is tabcohort {package_version()}); install the server's "
                              f"version (or pass {trust_var} to run the server's copy)")
    if local:
        src = find_source(local)
        if src.code_sha256 != want:
            hint = renamed_copy_hint(src, info, job_var)
            if hint is not None:
                raise ConfigError(job_var, local, f"this copy is the room's job {name!r} {hint}")
            raise ConfigError(job_var, local, f"this copy's code hash {src.code_sha256[:16]} is not the room's job "
                              f"{name!r} (code sha256 {str(want)[:16]}): another job, or another version of it; get the room's "
                              f"version or use {trust_var} to run the server's")
        return src
    if trust:
        return None
    # (it began "--trust-job=False: the room runs ...", as if the user had typed that)
    raise ConfigError(trust_var, False, f"the room runs the job {name!r} (code sha256 {str(want)[:16]}, "
                      f"{info.get('code_bytes')} bytes) that the server serves, and a native rank never runs a "
                      f"server's code silently: pass --trust-job (or TABCOHORT_TRUST_JOB=1) to run it, or "
                      f"--job PATH naming your local copy of the job (its hash must match)",
                      head=("this rank was not told to trust the room's job" if trust_var.startswith("--")
                            else f"{trust_var} is off: this rank does not trust the room's job"))


def renamed_copy_hint(src: Any, info: dict, option: str) -> str | None:
    """When ``src`` (a :class:`tabcohort.jobs.JobSource`) is the job ``info`` describes (its
    ``module``, ``factory``, ``code_sha256``) under another module or factory name, what to do
    ("under another name: ..."), else None. The job's code hash covers both names, so a
    byte-identical copy saved as another file was refused as another job (a new-user trial)."""
    module, factory, want = info.get("module"), info.get("factory"), info.get("code_sha256")
    if not (isinstance(module, str) and isinstance(factory, str) and module.isidentifier()
            and factory.isidentifier() and _same_code_other_name(src, module, factory, want)):
        return None
    return (f"under another name: its module is {module!r} with factory {factory!r}, this copy's "
            f"{src.module!r} with {src.factory!r} (both are part of the job's code hash); name the copy "
            f"{module}{'/' if src.is_package else '.py'} and pass {option} PATH"
            + (f":{factory}" if factory != "make_worker" else ""))


def _same_code_other_name(src: Any, module: str, factory: str, want: Any) -> bool:
    """Whether ``src``'s files, renamed to ``module`` with ``factory``, are the code of hash
    ``want``."""
    from ..jobs.source import JobSource

    old = src.module
    files = {}
    for rel, data in src.files.items():
        if rel == f"{old}.py":
            rel = f"{module}.py"
        elif rel.startswith(f"{old}/"):
            rel = f"{module}/{rel[len(old) + 1:]}"
        files[rel] = data
    return JobSource(module, files, factory, src.root, src.ref).code_sha256 == want


async def make_module_worker(job: dict, src: Any, data_raw: bytes, *, batch: int | None,
                             backend: str) -> tuple[Any, str]:
    """The job's worker from its code (a :class:`tabcohort.jobs.JobSource`) and its data
    (``.npz`` bytes) with the room's options (``job_info["options"]``), and the job hash,
    checked against the server's.

    Raises:
        TabcohortError: the data's sha256 or the job hash differs from the job's
            (different job code or data).
        JobError: the job's code fails to import or its factory raises.
        ConfigError: ``backend`` is not one the job runs on.
    """
    from ..jobs import JobData, LoadedJob
    from ..protocol.optim import TrainConfig

    info = job["job_info"]
    data = JobData.from_npz(data_raw)
    if data.sha256 != info["data_sha256"]:
        raise TabcohortError(f"the job's data sha256 {data.sha256} != the job's {info['data_sha256']}")
    loaded = LoadedJob(src, src.import_module(), data, info.get("options"))
    worker = await loaded.make_worker_async(batch=batch or job["batch"], seed=job["seed"], backend=backend)
    jh = loaded.job_hash(worker, TrainConfig.from_job(job).spec())
    if jh != job["job_hash"] or worker.bucket_len != job["bucket_len"]:
        raise TabcohortError(f"job hash {jh} != the server's {job['job_hash']}: different job code or data?")
    return worker, jh


def package_version() -> str:
    """The installed tabcohort distribution's version ("unknown" when run from a checkout)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tabcohort")
    except PackageNotFoundError:
        return "unknown"


#: how long a leaving leader stays for its re-publishes at most, seconds (PROTOCOL.md "Publish")
REPUBLISH_LINGER_S = 3.0
#: when the server stops a room, a publication that arrived up to this long (s) before its
#: ``stop`` reached this rank counts as the stopping leader's: the server tells every rank at
#: once, and the leader may read it, and publish, first
STOP_SKEW_S = 1.0
#: how long a follower of a room the server stopped waits for the leader's final publication
#: while the leader's rounds keep coming (``leave``); 5 s when they stop coming
ROOM_STOP_PUBLISH_WAIT_S = 30.0
#: how often (s) a rank's report loop looks whether it began to lead (:meth:`RankSession.lead_began`)
LEAD_CHECK_S = 0.05


def _at_or_above(key: tuple, than: tuple) -> bool:
    """``(term, step)`` ``key`` is at or above ``than``; False unless both are integer pairs."""
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (*key, *than))
    return ok and key >= than


def checkpoint_term(headers: dict) -> int:
    """The term of the leader that uploaded a checkpoint (``X-Tabcohort-Term``), 0 when absent
    or not an integer in [0, 2^63)."""
    return _u63_header(headers, "X-Tabcohort-Term")


def checkpoint_cursor(headers: dict) -> int:
    """The samples assigned before a checkpoint's step (``X-Tabcohort-Cursor``: PROTOCOL.md,
    "Leader: driving one round", step 2), 0 when absent or not an integer in [0, 2^63)."""
    return _u63_header(headers, "X-Tabcohort-Cursor")


def _u63_header(headers: dict, name: str) -> int:
    v = str(headers.get(name, ""))
    return int(v) if v.isascii() and v.isdigit() and len(v) <= 19 and int(v) < 1 << 63 else 0


def load_checkpoint(worker: Any, data: bytes, headers: dict, *, state_len: int = 0) -> tuple[int, Any]:
    """Set the worker's parameters from a checkpoint body (the parameters, then
    ``state_len`` float32 values of the leader's optimizer state: PROTOCOL.md "Local steps and
    optimizer state"); returns its step and the state (``array('f')``, or None when
    ``state_len`` is 0).

    Raises:
        TabcohortError: the length or the sha256 (``X-Tabcohort-Digest``) does not match.
    """
    n = worker.bucket_len
    if len(data) != 4 * (n + state_len) or hashlib.sha256(data).hexdigest() != headers.get("X-Tabcohort-Digest"):
        raise TabcohortError("the server's checkpoint is corrupt (length or digest mismatch)")
    v = array("f")
    v.frombytes(data[:4 * n])
    worker.set_params(v)
    state = None
    if state_len:
        state = array("f")
        state.frombytes(data[4 * n:])
    return int(headers.get("X-Tabcohort-Step") or 0), state


def params_bytes(p: Any) -> bytes:
    """A parameter vector as little-endian float32 bytes (the checkpoint body)."""
    return array("f", p).tobytes() if not hasattr(p, "astype") else p.astype("<f4").tobytes()


def checkpoint_body(machine: Any, worker: Any) -> tuple[bytes, str] | None:
    """The checkpoint body a leader uploads: its parameters, then its optimizer state (none
    for a stateless optimizer), float32 LE, and the body's sha256; None when a value is not
    finite (a diverged model is never stored)."""
    from ..vec import all_finite

    p = worker.params()
    state = machine.optimizer_state()
    if not all_finite(p) or (state is not None and not all_finite(state)):
        return None
    data = params_bytes(p) + (params_bytes(state) if state is not None else b"")
    return data, hashlib.sha256(data).hexdigest()


def upload_headers(machine: Any, bus: Any, body_digest: str, *, final: bool) -> dict[str, str]:
    """The headers of a leader's checkpoint upload (``PUT /api/rooms/ROOM/checkpoint``): its id
    and secret, the step, the body's sha256, its loss, its held-out accuracy, and whether it is
    the run's final one.

    The accuracy is the leader's own evaluation (the server never decodes parameters, README
    "Checkpoints and stopping") and is sent only when it was evaluated on the parameters
    uploaded, those of ``machine.step`` (``machine.accuracy_now``): the server ranks the
    history's "best" by it, and the last evaluation, up to ``eval_every - 1`` steps older, is
    another model's. :func:`checkpoint_upload` evaluates them first."""
    h = {"X-Tabcohort-Rank": str(bus.id), "X-Tabcohort-Secret": bus.secret or "",
         "X-Tabcohort-Step": str(machine.step), "X-Tabcohort-Digest": body_digest,
         "X-Tabcohort-Cursor": str(int(machine.checkpoint_cursor)), "X-Tabcohort-Loss": repr(float(machine.loss))}
    if isinstance(getattr(machine, "job", None), str):
        # the job this model was trained on: a server restarted with another job refuses it
        # (a rank that resumed its id there uploaded its old job's model as the new job's)
        h["X-Tabcohort-Job"] = machine.job
    acc = machine.accuracy_now
    if isinstance(acc, (int, float)) and math.isfinite(acc):
        h["X-Tabcohort-Accuracy"] = repr(float(acc))
    if final:
        h["X-Tabcohort-Final"] = "1"
    return h


def checkpoint_upload(machine: Any, worker: Any, bus: Any, progress: Callable[[str], None], *,
                      final: bool) -> tuple[bytes, dict[str, str]] | None:
    """The body and headers of a leader's checkpoint upload (``checkpoint_body``,
    ``upload_headers``); None, said through ``progress``, when the parameters are not finite
    (never store a diverged model: the server refuses it too, HTTP 422), and None while the
    link to the server is down, unless ``final``: a server that restarted knows the rank's id
    only once its link has resumed, and refused the upload that came first as from a stranger
    (HTTP 403, counted ``checkpoint_bad_rank``); the next interval's upload follows the resume.

    The parameters uploaded are evaluated first (``machine.evaluate_now()``: not again when
    their step was just evaluated, never in a room with ``eval_every`` 0), so that every
    checkpoint carries the held-out accuracy of its own parameters (README "Checkpoints and
    stopping"). Why not send an accuracy only when the upload happens to fall on an evaluated
    step: the upload's clock and the evaluations' steps are independent, so nearly every
    periodic checkpoint would have none and "best" would be chosen among a few. The cost is at
    most one evaluation per ``checkpoint_interval_s`` (5 s by default) beside one every
    ``eval_every`` steps: 0.07 ms for the digits job on numpy, 18 ms on pure Python (measured
    natively), and the tab's built-in job evaluates on its JS kernels. It runs between the
    slices of a gradient in progress, as ``apply`` may (PROTOCOL.md "Worker contract")."""
    if not final and not bus.connected:
        return None
    body = checkpoint_body(machine, worker)
    if body is None:
        progress(f"checkpoint upload skipped: the parameters at step {machine.step} are not finite "
                 "(training diverged)")
        return None
    data, body_digest = body
    machine.evaluate_now()
    return data, upload_headers(machine, bus, body_digest, final=final)


def path_report(bus: Any) -> dict:
    """The state report's ``links`` (each peer's path, keyed ``server`` or ``%08x``),
    ``link_bytes`` (chunk bytes by path kind) and, on a bus with a path per peer,
    ``pair_bytes`` (``%08x`` -> chunk bytes sent + received by path kind, e.g. ``{"tcp": n,
    "relay": 0}``) of a :class:`~tabcohort.bus.base.RoomBus`."""
    out = {"links": {("server" if k == 0 else f"{k:08x}"): v for k, v in bus.paths().items()},
           "link_bytes": bus.transport_bytes()}
    pairs = bus.pair_bytes()
    if pairs is not None:
        out["pair_bytes"] = {f"{k:08x}": v for k, v in pairs.items()}
    return out


class RankSession:
    """One rank's life across its seats (a refused resume joins again as a new rank).

    Subclasses fetch, upload and show; this class owns the stop state and the controls.
    """

    def __init__(self) -> None:
        self.stop_event: asyncio.Event | None = None
        self.stop_reason: str | None = None
        self.failed: str | None = None
        #: when (``time.monotonic()``, s) the last publication (a round without an assignment)
        #: arrived, from :meth:`saw_round`
        self.publish_seen_s: float | None = None
        self._publish_key: tuple = (None, None)   # (term, step) of that publication
        #: rounds with an assignment seen (:meth:`saw_round`): a leader that keeps sending them
        #: after this rank stopped is not stopping, and no publication is coming
        self.rounds_seen = 0
        #: the server stopped the whole room (a ``stop`` control): the leader is stopping too;
        #: ``room_stop_s`` is when (``time.monotonic()``) that control arrived
        self.room_stopping = False
        self.room_stop_s = 0.0
        self._publish_since_s = math.inf   # (set by leave())
        #: set by :meth:`leave`: this rank led, and its link to the server had failed, so it
        #: uploaded no final checkpoint (its stop line says so: README "Stopping")
        self.final_upload_skipped = False
        self.driver: Any = None
        self.bus: Any = None
        self.start_step = 0
        #: the optimizer state the next seat starts from (a checkpoint's, or the last seat's)
        self.start_state: Any = None
        #: the loaded checkpoint's term (its leader's): the floor of any term this rank starts
        self.start_term = 0
        #: the samples assigned before the start step (the checkpoint's cursor, or the last seat's)
        self.start_cursor = 0
        #: the learning rate the operator set, from the room's ``welcome`` (None: the job's)
        self.operator_lr: float | None = None
        self.rejoin = False
        self.n_rejoins = 0
        #: the last ``welcome`` was partial (a restarted server's) and no ``roll_call`` came since:
        #: the next seat is told so (PROTOCOL.md "Joining": it bootstraps no lineage till then)
        self.roll_call_partial = False
        #: the job hash this rank's seats run (set by :meth:`seat`), and the room's, from the
        #: last ``welcome`` that named it
        self.job_hash: str | None = None
        self.room_job_hash: str | None = None
        self._lead_seen = False   # (lead_began: whether this rank led at its last look)

    def seat(self, bus: Any, worker: Any, job: dict, jh: str) -> tuple[Any, Any]:
        """The machine and driver for one seat on ``bus`` (connected), at :attr:`start_step`."""
        from ..protocol import RankMachine, Timing
        from ..protocol.optim import TrainConfig
        from .driver import RankDriver, bus_role

        may_lead, peer_roles = bus_role(bus)
        self.job_hash = jh
        self._lead_seen = False     # (a new seat's machine: its lead, when it begins, is reported)
        if self.room_job_hash is not None and self.room_job_hash != jh:
            # (the first welcome comes while the bus connects, before this: a server restarted
            # with another job between this rank's job fetch and its link)
            self._job_changed(self.room_job_hash)
        machine = RankMachine(bus.id, worker, bus, job=jh, now_ms=RankDriver.clock_ms(asyncio.get_running_loop()),
                              timing=Timing(**job["timing"]), lr=self.job_lr(job), eval_every=job["eval_every"],
                              precision=job["precision"], collect_rule=job.get("collect_rule", "grace"),
                              global_batch=job.get("global_batch"), step_limit=step_limit(job),
                              aggregate=job.get("aggregate", "clip"), lr_max=job.get("lr_max", 10.0),
                              may_lead=may_lead, train=TrainConfig.from_job(job), opt_state=self.start_state,
                              start_step=int(self.start_step or 0), term_floor=int(self.start_term or 0),
                              start_cursor=int(self.start_cursor or 0),
                              join_reach_ms=float(getattr(bus, "reach_bound_ms", 0.0) or 0.0))
        machine.set_roles(may_lead=may_lead)   # the server names roles: enforced
        for k, may in peer_roles.items():      # the server's word on each peer's role
            machine.peer_role(k, may)
        if self.roll_call_partial:              # (its welcome came before this seat's machine)
            machine.roll_call_partial(now_ms=RankDriver.clock_ms(asyncio.get_running_loop()))

        silence_bound_ms = [None]

        def on_report(_state: dict) -> None:
            if machine.at_step_limit and not machine.running:   # stopped at the job's step limit
                self.request_stop(f"step limit {machine.step_limit} reached")
            # a direct path silent for policy.drop moves to the relay (PROTOCOL.md "Direct TCP
            # path", "Silence"): the policy stretches with the cohort, so it follows it
            if machine.policy.drop_ms != silence_bound_ms[0]:
                silence_bound_ms[0] = machine.policy.drop_ms
                bus.set_silence_bound_ms(machine.policy.drop_ms)
        def compute_failed(why: str) -> None:   # the job fails every time: this rank stops, exit 1
            self.failed = why
            self.request_stop(f"job failed: {why}")
        self.driver = RankDriver(machine, worker, bus, on_report=on_report, on_compute_failed=compute_failed,
                                 reads_first=True)
        return machine, self.driver

    def start_from_checkpoint(self, worker: Any, job: dict, headers: dict, data: bytes) -> None:
        """Load the room's checkpoint (``GET /checkpoint``'s ``headers`` and body ``data``) into
        ``worker``; the next seat starts at its step, optimizer state, term floor and cursor.

        Raises:
            TabcohortError: the checkpoint is corrupt or does not fit (see :func:`load_checkpoint`)."""
        self.start_step, self.start_state = load_checkpoint(worker, data, headers, state_len=job.get("state_len", 0))
        self.start_term = checkpoint_term(headers)
        self.start_cursor = checkpoint_cursor(headers)

    def job_lr(self, job: dict) -> float:
        """The learning rate a seat starts with: the operator's (``POST .../lr``, told in the
        room's ``welcome``) once set, else the job's."""
        return self.operator_lr if self.operator_lr is not None else job["lr"]

    def lead_began(self, machine: Any, driver: Any) -> bool:
        """Whether ``machine`` began to lead since the last look: its report is then due at
        once (natively within :data:`LEAD_CHECK_S`; a tab at its next page update, at most 0.5 s
        apart), not at the next ``report_interval_s``. The room trusts, uploads from and stops on
        the rank that last reported it leads (docs/PROTOCOL.md, "Roles"); a rank that
        took over and reached ``--steps`` within one interval never said it led, and its final
        checkpoint was refused (403) in favour of the rank it took over from."""
        leading = bool(machine.looping or machine.is_leader(driver.now_ms()))
        began = leading and not self._lead_seen
        self._lead_seen = leading
        return began

    def rejoined(self, machine: Any) -> None:
        """The server refused this seat's resume: the next seat starts where this one was."""
        self.rejoin = False
        self.stop_event.clear()
        self.start_step = machine.step
        self.start_cursor = machine.checkpoint_cursor   # (the cursor of the round at that step)
        self.start_state = machine.optimizer_state()
        self.start_term = max(self.start_term, machine.term)
        self.n_rejoins += 1

    def _job_changed(self, room_job: str) -> None:
        """A server restarted with another job took this rank's link: training on would be the
        old job's model in the new job's room (its checkpoints stored as the new job's)."""
        self.failed = (f"the server now serves another job (job hash {room_job}; this rank runs "
                       f"{self.job_hash}): start the rank again to fetch the room's job")
        self.request_stop(f"job changed: {self.failed}")

    def on_control(self, obj: dict) -> None:
        """A server control (or the bus's ``failed``), after the bus handled it."""
        from .driver import apply_roles

        t = obj.get("type")
        if t == "welcome" and isinstance(obj.get("job_hash"), str):
            self.room_job_hash = obj["job_hash"][:128]
            if self.job_hash is not None and self.room_job_hash != self.job_hash:
                self._job_changed(self.room_job_hash)
                return
        apply_roles(self.driver, obj)
        if t == "welcome" or t == "roll_call":
            self.roll_call_partial = t == "welcome" and obj.get("partial") is True
            if self.roll_call_partial and self.driver is not None:
                # a restarted server: a rank that may lead, not back yet, is in no list; a rank
                # that joins now must not take the room for leaderless (PROTOCOL.md "Joining")
                self.driver.roll_call_partial()
        if t == "peer" and obj.get("up") is False:
            # the server saw the rank's link close: it left (PROTOCOL.md, "Membership and majority")
            k = obj.get("id")
            if isinstance(k, int) and not isinstance(k, bool) and self.driver is not None:
                self.driver.peer_left(k)
        elif t == "unreachable" and isinstance(obj.get("ids"), list) and self.driver is not None:
            # the bus's own word: its link to the room closed, so the peers it carried are out of
            # reach until heard from again (PROTOCOL.md, "Membership and majority")
            self.driver.unreachable(obj["ids"])
        elif (t == "roll_call" or (t == "welcome" and obj.get("partial") is not True)) \
                and isinstance(obj.get("peers"), list) and self.driver is not None:
            # the link opened again: the ranks the server lists are the room's connected ranks,
            # and a member it omits left meanwhile (PROTOCOL.md, "Membership and majority"); a
            # restarted server's roll call is partial until its ``roll_call`` control: a member
            # it does not list yet may be on its way back (a 3-rank cohort split in two lineages
            # when the first rank back took the others for gone)
            self.driver.roll_call(obj["peers"])
        if t == "lr" or (t == "welcome" and "lr" in obj):
            # the operator's learning rate (the server sends it only on the operator's word, and
            # in each later welcome): applied by the leader, whose rounds carry it (PROTOCOL.md
            # "Controls": set_lr); a rank that joins after it starts with it
            lr = obj.get("lr")
            # (above the room's lr_max the machine refuses it: followers would drop the rounds)
            if (isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr) and 0 < lr <= 1e6
                    and (self.driver is None or lr <= self.driver.machine.lr_max)):
                self.operator_lr = float(lr)
                if self.driver is not None:
                    self.driver.set_lr(float(lr))
        elif t == "stop":
            reason = str(obj.get("reason"))
            if reason.startswith("diverged"):   # the room ended because training diverged
                self.failed = reason
            if not self.room_stopping:
                self.room_stopping, self.room_stop_s = True, time.monotonic()
            d = self.driver
            if d is not None and d.machine is not None and not (d.machine.looping or d.machine.is_leader(d.now_ms())):
                # a follower stops taking part at once, not when leave() gets its turn: the peer
                # controls of the others leaving came in the same read, and a rank still behind on
                # its link (thawed after a freeze) took over as a cohort of one and committed 30
                # steps alone before it stopped, ending on other parameters than the room's final
                # checkpoint (PROTOCOL.md "Controls"). A leader goes on to its publication.
                d.stop()
            self.request_stop(f"server: {reason}")
        elif t == "failed" and obj.get("rejoin") and self.stop_reason is None:
            self.rejoin = True              # the resume was refused: the run joins again
            if self.stop_event is not None:
                self.stop_event.set()
        elif t == "failed":
            self.failed = str(obj.get("reason"))
            self.request_stop(f"link failed: {self.failed}")

    def request_stop(self, why: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = why
        if self.stop_event is not None:
            self.stop_event.set()

    def saw_round(self, msg: dict) -> None:
        """A ``round`` arrived (the runtimes' taps): count it when it assigns work, else note
        the publication (PROTOCOL.md "Controls": a stopping leader publishes a round without an
        assignment). A round that assigns work at or above the publication's (term, step) means
        a lead went on from it (a leader that left alone, then a takeover): that publication is
        no longer the model the room ends on, and does not count."""
        key = (msg.get("term"), msg.get("step"))
        if msg.get("assign"):
            self.rounds_seen += 1
            if self.publish_seen_s is not None and _at_or_above(key, self._publish_key):
                self.publish_seen_s = None
        else:
            self.publish_seen_s = time.monotonic()
            self._publish_key = key

    @property
    def publish_seen(self) -> bool:
        """A publication arrived since this rank's stop began (:meth:`leave`), or within
        :data:`STOP_SKEW_S` before the server's ``stop`` of the whole room reached it."""
        return self.publish_seen_s is not None and self.publish_seen_s >= self._publish_since_s

    async def leave(self, machine: Any, driver: Any, bus: Any, *, upload: Callable[[bool], Awaitable[None]],
                    final_report: Callable[[], dict], poll_s: float = 0.02) -> dict:
        """Leave the cohort: the leader publishes and uploads the final checkpoint, a follower
        waits for that publication (5 s; while the leader's rounds keep coming after the server
        stopped the room, up to :data:`ROOM_STOP_PUBLISH_WAIT_S`; not at all when it hears
        neither its leader nor any other member: PROTOCOL.md, "Controls"); then the final
        report, flushed (bounded, 2 s).

        Returns:
            The final state report (``final: True``) as ``final_report`` made it.
        """
        # (a leader that stopped at the job's step limit has published: it uploads the final
        # checkpoint; a follower at the limit holds that publication already)
        was_leader = machine.looping or machine.is_leader(driver.now_ms()) or (
            machine.at_step_limit and machine.counters.get("published", 0) > 0)
        # a follower waits for the leader's publication *after* this stop (PROTOCOL.md,
        # "Controls": a stopping leader publishes); one seen earlier does not count, but when the
        # server stops the room it tells every rank at once, and a leader that read it first
        # published before this rank read its own (its follower then waited the whole 5 s for a
        # publication it held: 3 of 14 runs of a fault campaign)
        t0 = time.monotonic()
        self._publish_since_s = self.room_stop_s - STOP_SKEW_S if self.room_stopping else t0
        driver.stop()
        end, rounds0 = t0 + 5.0, self.rounds_seen

        def leader_drives_on() -> bool:
            # (this rank stopped alone, e.g. its own Ctrl-C: the leader's rounds keep coming, so
            # it waited the whole 5 s for a publication that no one makes; a leader stopping at
            # the same time, as the demo's Ctrl-C stops every process, ends within 250 ms. When
            # the server stops the room the leader is told too and publishes, however late it
            # reads the control: a busy leader tab drove on for 2,000 steps past 250 ms, and its
            # follower tab, gone, ended on another model)
            return (not self.room_stopping and self.rounds_seen - rounds0 >= 3
                    and time.monotonic() - t0 >= 0.25)
        seen = [t0, rounds0]

        def leader_still_driving() -> bool:
            # the server stopped the room, so the leader publishes once it reads the control; a
            # leader tab in a cohort of fast native ranks read it 7 s late (its page's inbox
            # behind their buckets), the followers stopped at 5 s, and they ended on other
            # parameters than the room's final checkpoint (a fault campaign with tabs): wait on
            # while its rounds keep coming, bounded
            now = time.monotonic()
            if self.rounds_seen != seen[1]:
                seen[:] = [now, self.rounds_seen]
            return self.room_stopping and now - seen[0] < 1.0 and now - t0 < ROOM_STOP_PUBLISH_WAIT_S
        # (a rank that never became ready follows nobody: nothing to wait for; nor for one whose
        # leader is no longer heard and that hears no other member, which no publication reaches.
        # A contributor whose trainer had left waited 5 s and said its parameters "may differ"
        # from the final checkpoint the trainer had published as it left: a new-user trial. Any
        # live member is waited for: one that took over and has not yet sent this rank a round
        # publishes when it reads the stop)
        now = driver.now_ms()
        heard = machine.leader_heard(now) or any(k != machine.id for k in machine.cohort_ids(now))
        while (machine.looping if was_leader else
               machine.ready and heard and not self.publish_seen and not machine.at_step_limit
               and not leader_drives_on()) \
                and (time.monotonic() < end or (not was_leader and leader_still_driving())):
            await asyncio.sleep(poll_s)
        if not was_leader and self.room_stopping and machine.ready and not self.publish_seen \
                and not machine.at_step_limit:
            self.progress(f"stopping without the leader's final publication (waited {time.monotonic() - t0:.0f} s): "
                          f"this rank's parameters (step {machine.step}) may differ from the room's final checkpoint"
                          if heard else
                          f"stopping: no leader is heard in this room, so no final publication comes; this rank "
                          f"keeps the parameters of step {machine.step}, the last round it followed")
        self.final_upload_skipped = bool(was_leader and bus.failed)
        if was_leader and not bus.failed:
            await upload(True)       # (evaluated first: the final checkpoint's accuracy is its own model's)
            # a member that missed the publish (a lost frame) is sent it again at the heartbeats
            # ("Publish", re-publish): stay that long, bounded (a leader left within a beat, so
            # the rule helped only where ranks stay, as in `simulate`)
            end = time.monotonic() + REPUBLISH_LINGER_S
            while machine.republish_pending(driver.now_ms()) and time.monotonic() < end and not bus.failed:
                await asyncio.sleep(poll_s)
        st = final_report()
        end = time.monotonic() + 2.0
        while bus.queued_bytes() and bus.connected and time.monotonic() < end:
            await asyncio.sleep(poll_s)
        return st
