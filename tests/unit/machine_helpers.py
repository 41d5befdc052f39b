"""Helpers for stepping RankMachine with explicit time (no event loop)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tabcohort import PROTOCOL_VERSION
from tabcohort.model.toy import ToyWorker
from tabcohort.protocol import Compute, Post, RankMachine, Report, Timing
from tabcohort.vec import to_vector

JOB = "job-test"


@dataclass
class LinkReadouts:
    """The bus read-outs the machine consumes (pressure, quantize, byte count), settable."""

    pressure_value: float = 0.0
    quantizer: object = None
    bytes_total: int = 0

    def pressure(self) -> float:
        return self.pressure_value

    def quantize(self, params):
        return None if self.quantizer is None else self.quantizer(params)

    def total_bytes(self) -> int:
        return self.bytes_total


@dataclass
class Rig:
    m: RankMachine
    w: ToyWorker
    link: LinkReadouts
    out: list = field(default_factory=list)

    def drain(self):
        acts = self.m.drain()
        self.out.extend(acts)
        return acts

    def posts(self, acts=None, t=None):
        acts = self.drain() if acts is None else acts
        return [a.msg for a in acts if isinstance(a, Post) and (t is None or a.msg["t"] == t)]

    def computes(self, acts):
        return [a for a in acts if isinstance(a, Compute)]


def rig(rank_id=5, *, now=0.0, ready=False, timing=Timing(), bucket_len=4, batch=2, **kw) -> Rig:
    w = ToyWorker(bucket_len=bucket_len, batch=batch)
    link = LinkReadouts()
    # peers' buckets here are fixed synthetic vectors (grad() below), not gradients that shrink
    # with the leader's as training converges: the rules other than robust aggregation are
    # tested with the plain sample-weighted mean; tests/unit/test_robust.py tests the default
    kw.setdefault("aggregate", "mean")
    m = RankMachine(rank_id, w, link, job=JOB, now_ms=now, timing=timing, ready=ready, **kw)
    r = Rig(m, w, link)
    r.drain()
    return r


def hello(sender, *, ready=True, running=True, step=0, batch=2, job=JOB, version=PROTOCOL_VERSION, to=None):
    msg = {"t": "hello", "from": sender, "version": version, "job": job, "batch": batch,
           "ready": ready, "running": running, "step": step, "model": "toy-lsq", "backend": "python"}
    if to is not None:
        msg["to"] = to
    return msg


def beat(sender, *, ready=True, running=True, step=0, batch=2, to=None, term=0):
    msg = {"t": "beat", "from": sender, "batch": batch, "ready": ready, "running": running,
           "step": step, "backend": "python", "term": term}
    if to is not None:
        msg["to"] = to
    return msg


def round_msg(sender, step, *, params=None, assign=None, lr=0.1, n=4, loss=math.nan, samples=0, cohort=1,
              term=1, shares=None, share=2, cursor=0):
    assign = assign or {}
    shares = shares if shares is not None else {k: share for k in assign}
    return {"t": "round", "from": sender, "step": step, "term": term, "lr": lr, "assign": assign,
            "shares": shares, "cursor": cursor,
            "params": to_vector(params if params is not None else [0.25] * n),
            "loss": loss, "samples": samples, "cohort": cohort}


def grad(sender, to, step, *, g=None, n=4, loss=1.0, samples=2, term=1):
    return {"t": "grad", "from": sender, "to": to, "step": step, "term": term, "loss": loss, "samples": samples,
            "g": to_vector(g if g is not None else [1.0] * n)}


class SeatBus:
    """The room bus a :meth:`RankSession.seat` reads (id and roles) and its machine posts to:
    a connected bus that sends nothing anywhere."""

    id, may_lead, lead_roles = 1, True, {}
    on_message = None

    def __init__(self):
        self.silence_bounds_ms = []

    def post(self, msg):
        pass

    def set_silence_bound_ms(self, bound_ms):
        self.silence_bounds_ms.append(bound_ms)

    def pressure(self):
        return 0.0

    def quantize(self, params):
        return None

    def total_bytes(self):
        return 0


#: the served job fields a seat reads (the toy worker's room)
SEAT_JOB = {"timing": {k: getattr(Timing(), k) for k in ("beat_ms", "drop_ms", "collect_ms", "takeover_ms", "forget_ms")},
            "lr": 0.1, "eval_every": 10, "precision": "f32"}


async def seat_after(welcome: dict, job_hash: str = "job-test"):
    """A :class:`RankSession` told ``welcome`` (as a bus's connect does), then seated on a
    :class:`SeatBus` with the toy worker: ``(session, machine)`` (its driver closed)."""
    from tabcohort.runtime.session import RankSession

    s = RankSession()
    s.on_control(welcome)
    m, d = s.seat(SeatBus(), ToyWorker(bucket_len=4, batch=2), SEAT_JOB, job_hash)
    await d.close()
    return s, m
