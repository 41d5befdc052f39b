"""A hostile rank: a real process that speaks the wire protocol (the project's own ``StarBus`` and
``FrameWriter``) to attack a room, for the integration tier (tests/integration/test_hostile_*.py).

Run: ``python tests/integration/hostile_rank.py --server URL --room ROOM --attack A[,B...]
[--out FILE] [--seconds S] [--seed N]``. It never presents the trainer credential (it is a
stranger in an open room) unless ``--trainer-token`` is given. Attacks (the numbers of the
hostile-rank threat list in docs/PROTOCOL.md, "Roles"):

1. ``poison``: answer every round assigned to it with 1e30 in every element;
   ``poison_samples``: 0.05 everywhere but claiming ``samples = 2**62``;
   ``flip``: declare the global batch as its cap, answer every round at once (so the leader
   measures it as by far the fastest rank) with the room's last step reversed: three times
   ``(new - old parameters) / lr``, a bucket as long as an honest one and pointing uphill;
   ``steer``: as ``flip``, but every bucket points one fixed random way, ``--scale`` (4) times
   as long as the room's last step over lr: clipped onto its bound in every round, never far
   enough past it to count toward the clip rule's quarantine.
2. ``lead_nan`` / ``lead_lr`` / ``lead_beats``: reconnect until its id is the lowest in the
   room, announce ready and running with a high term, then send rounds with NaN parameters,
   or the last parameters it saw with lr 10000, or only beats (never leading).
3. ``silent``: announce ready and running, never answer a round.
4. ``backlog``: ``backlog`` controls of 1e12 bytes; ``report_step``: state reports claiming to lead
   at step 10**15 with accuracy 1.0 and term 2**62.
5. ``checkpoint``: uploads with its own id and secret: ``X-Tabcohort-Final`` with step 2**64+1 and
   NaN data, negative steps, step 10**15 with finite data and the final flag, the wrong length.
6. ``forge``: join over the direct bus (direct TCP paths to the native ranks, authenticated as a
   room member) and write, on its own paths, frames whose header names another rank: to every
   follower a ``round`` "from" the leader with its term, step 2**62 and the parameters halved, and
   beats "from" the leader saying it stopped (docs/PROTOCOL.md, "Direct TCP path": a path speaks
   for its peer only).

``random``: a seeded random combination of the above (``--seed``). Every result (the HTTP status of
each checkpoint upload, the rounds answered, the id it got) is one JSON object per line in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import struct
import sys
import time
from typing import Any

import numpy as np

ATTACKS = ("poison", "poison_samples", "flip", "steer", "lead_nan", "lead_lr", "lead_beats", "silent", "backlog",
           "report_step", "checkpoint", "forge")
LEAD = frozenset(("lead_nan", "lead_lr", "lead_beats"))


class Hostile:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.attacks = set(a.attack)
        self.out = open(a.out, "a", buffering=1) if a.out else sys.stdout
        self.bus: Any = None
        self.job: dict = {}
        self.last_params: Any = None
        self.last_round: dict | None = None
        self.prev_round: dict | None = None
        self.max_share = 0
        self.direction: Any = None
        self.n_answered = 0
        self.term = 2**62

    def log(self, **kw: Any) -> None:
        self.out.write(json.dumps({"t": round(time.time(), 3), **kw}) + "\n")

    async def run(self) -> int:
        import aiohttp

        from tabcohort.bus.aio import ws_url

        base = self.a.server.rstrip("/")
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/api/rooms/{self.a.room}/job") as r:
                self.job = await r.json()
            await self._connect(ws_url(base, self.a.room))
            self.log(event="joined", id=self.bus.id, attacks=sorted(self.attacks))
            tasks = [asyncio.create_task(self._announce())]
            if "checkpoint" in self.attacks:
                tasks.append(asyncio.create_task(self._poison_checkpoints(http, base)))
            if "backlog" in self.attacks or "report_step" in self.attacks:
                tasks.append(asyncio.create_task(self._forge_controls()))
            if self.attacks & LEAD:
                tasks.append(asyncio.create_task(self._lead()))
            if "forge" in self.attacks:
                tasks.append(asyncio.create_task(self._forge_frames()))
            try:
                await asyncio.sleep(self.a.seconds)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                self.log(event="done", answered=self.n_answered)
                await self.bus.aclose()
        return 0

    async def _connect(self, url: str) -> None:
        from tabcohort.bus.aio import direct_bus, star_bus

        tries = 0
        while True:
            if "forge" in self.attacks:   # direct TCP paths to the native ranks, as a room member
                bus = direct_bus(url, direct_host="127.0.0.1", trainer_token=self.a.trainer_token,
                                 precision=self.job["precision"])
            else:
                bus = star_bus(url, trainer_token=self.a.trainer_token, precision=self.job["precision"])
            await bus.connect()
            tries += 1
            # hostile leadership: reconnect until this id is the lowest in the room, at most 40
            # times: each left id stays reserved for the resume grace, and the server refuses a
            # 65th rank from one address (4011; the honest ranks share it), which ended the
            # attacker before it acted when an honest id was very low (CI: 0x024e83c4). With a
            # higher id the attack still runs: the roles, not the id order, stop it
            if not self.attacks & LEAD or not bus.peers or bus.id < min(bus.peers) or tries >= 40:
                break
            await bus.aclose()
        self.log(event="id", id=bus.id, tries=tries, lowest=not bus.peers or bus.id < min(bus.peers))
        bus.on_message = self._on_message
        self.bus = bus

    def _state_fields(self) -> dict:
        batch = self.job["global_batch"] if self.attacks & {"flip", "steer"} else self.job["batch"]
        return {"batch": batch, "ready": True, "running": True,
                "step": 0 if self.last_round is None else int(self.last_round["step"]), "backend": "python"}

    async def _announce(self) -> None:
        """hello once, then beats: ready and running (every attack that joins the cohort)."""
        if not self.attacks & {"poison", "poison_samples", "flip", "steer", "silent", *LEAD}:
            return
        from tabcohort import PROTOCOL_VERSION
        b = self.bus
        b.post({"t": "hello", "from": b.id, "version": PROTOCOL_VERSION, "job": self.job["job_hash"],
                "model": str(self.job["model"].get("name", "mlp"))[:200], **self._state_fields()})
        while True:
            term = self.term if self.attacks & LEAD else (0 if self.last_round is None else int(self.last_round["term"]))
            b.post({"t": "beat", "from": b.id, "term": term, **self._state_fields()})
            await asyncio.sleep(self.job["timing"]["beat_ms"] / 1000.0)

    def _on_message(self, msg: dict) -> None:
        if msg.get("t") != "round" or msg.get("from") == self.bus.id:
            return
        self.prev_round, self.last_round = self.last_round, msg
        self.last_params = msg["params"]
        me = self.bus.id
        if me not in (msg.get("assign") or {}):
            return
        if "silent" in self.attacks or "lead_beats" in self.attacks:
            return
        n = self.job["bucket_len"]
        if "poison" in self.attacks:
            g, samples = [1e30] * n, int(msg["shares"].get(me, 1))
        elif "poison_samples" in self.attacks:
            g, samples = [0.05] * n, 2**62
        elif self.attacks & {"flip", "steer"}:
            prev, samples, lr = self.prev_round, int(msg["shares"].get(me, 1)), float(msg["lr"]) or 1.0
            if prev is None or int(prev["step"]) + 1 != int(msg["step"]):
                g = np.zeros(n, dtype=np.float32)
            else:
                g = ((np.asarray(msg["params"], dtype=np.float32) - np.asarray(prev["params"], dtype=np.float32))
                     * np.float32(3.0 / lr))
                if "steer" in self.attacks:
                    if self.direction is None:
                        v = np.random.default_rng(self.a.seed).standard_normal(n)
                        self.direction = (v / np.linalg.norm(v)).astype(np.float32)
                    g = self.direction * np.float32(self.a.scale / 3.0 * float(np.linalg.norm(g)))
            if samples > self.max_share:
                self.max_share = samples
                self.log(event="share", step=int(msg["step"]), samples=samples,
                         of=sum(int(v) for v in msg["shares"].values()))
        else:
            return
        self.bus.post({"t": "grad", "from": me, "to": msg["from"], "step": msg["step"], "term": msg["term"],
                       "loss": 0.1, "samples": samples, "g": g})
        self.n_answered += 1
        if self.n_answered % 25 == 0:
            self.log(event="answered", n=self.n_answered)

    async def _lead(self) -> None:
        """Rounds as a leader of a high term: NaN parameters, or lr 10000, or nothing (beats)."""
        b, n, step = self.bus, self.job["bucket_len"], 0
        while True:
            await asyncio.sleep(0.05)
            if "lead_beats" in self.attacks:
                continue
            if "lead_nan" in self.attacks:
                params, lr = [math.nan] * n, 0.5
            elif self.last_params is not None:
                params, lr = list(self.last_params), 10000.0
            else:
                continue
            step += 1
            base = 0 if self.last_round is None else int(self.last_round["step"])
            b.post({"t": "round", "from": b.id, "step": base + step, "term": self.term, "lr": lr, "assign": {},
                    "shares": {}, "cursor": 0, "params": params, "loss": 0.1, "samples": 64, "cohort": 4})

    async def _forge_frames(self) -> None:
        """On its own direct paths, frames naming the leader as their sender (attack 6)."""
        from tabcohort.bus import direct
        from tabcohort.wire import FrameWriter

        b, sent = self.bus, 0
        while True:
            await asyncio.sleep(0.25)
            m = self.last_round
            if m is None:
                continue
            lead = int(m["from"])
            for k in list(b.paths()):
                ch = b.channel_of.get(k)
                if k == lead or ch is None or ch.stream is None or b.paths().get(k) != "tcp":
                    continue
                w = FrameWriter(lead, max_message_bytes=direct.DIRECT_MAX_MESSAGE_BYTES)
                frames = w.write({"t": "round", "step": 2**62, "term": int(m["term"]), "lr": float(m["lr"]),
                                  "loss": 0.1, "samples": 64, "cohort": 2, "cursor": 0, "assign": {}, "shares": {},
                                  "params": np.asarray(m["params"], dtype=np.float32) * np.float32(0.5)})
                frames += w.write({"t": "beat", "batch": 8, "ready": True, "running": False,
                                   "step": int(m["step"]), "backend": "numpy", "term": int(m["term"])})
                ch.stream.transport.write(direct.frame(frames))
                sent += 1
                if sent % 10 == 1:
                    self.log(event="forged", n=sent, to=k, as_sender=lead)

    async def _forge_controls(self) -> None:
        b = self.bus
        while True:
            if "backlog" in self.attacks:
                b.send_control({"type": "backlog", "bytes": 10**12})
            if "report_step" in self.attacks:
                b.send_control({"type": "report", "state": {
                    "id": b.id, "leader": b.id, "is_leader": True, "ready": True, "running": True,
                    "step": 10**15, "term": 2**62, "accuracy": 1.0, "loss": 0.0, "kind": "native"}})
            await asyncio.sleep(0.2)

    async def _poison_checkpoints(self, http: Any, base: str) -> None:
        """Upload poisoned checkpoints with this rank's own id and secret; log each status."""
        n = self.job["bucket_len"]
        nan = struct.pack(f"<{n}f", *([math.nan] * n))
        fine = struct.pack(f"<{n}f", *([0.01] * n))
        cases = [("final_u64_overflow_nan", 2**64 + 1, nan, True), ("nan", 10, nan, False),
                 ("negative_step", -5, fine, False), ("final_negative", -1, fine, True),
                 ("final_huge_step", 10**15, fine, True), ("u63_edge", 2**63, fine, True),
                 ("short", 10, fine[:-4], True), ("finite_step_1", 1, fine, False)]
        url = f"{base}/api/rooms/{self.a.room}/checkpoint"
        # claim to lead first (the server trusts no such claim without the role)
        self.bus.send_control({"type": "report", "state": {"id": self.bus.id, "leader": self.bus.id,
                                                           "is_leader": True, "step": 0, "term": 2**62}})
        await asyncio.sleep(0.3)
        end = time.monotonic() + self.a.seconds
        while time.monotonic() < end:     # again and again while the honest cohort trains
            for name, step, data, final in cases:
                h = {"X-Tabcohort-Rank": str(self.bus.id), "X-Tabcohort-Secret": self.bus.secret or "",
                     "X-Tabcohort-Step": str(step), "X-Tabcohort-Digest": hashlib.sha256(data).hexdigest()}
                if final:
                    h["X-Tabcohort-Final"] = "1"
                try:
                    async with http.put(url, data=data, headers=h) as r:
                        self.log(event="checkpoint", case=name, status=r.status, text=(await r.text())[:200])
                except aiohttp_errors() as e:    # the server went away at the end of the run
                    self.log(event="checkpoint", case=name, status=None, text=repr(e)[:200])
                    return
            await asyncio.sleep(0.3)


def aiohttp_errors() -> tuple[type[BaseException], ...]:
    import aiohttp
    return (aiohttp.ClientError, OSError, asyncio.TimeoutError)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True)
    p.add_argument("--room", required=True)
    p.add_argument("--attack", required=True, help="comma-separated: " + ", ".join(ATTACKS) + ", random")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--trainer-token", default=None)
    p.add_argument("--scale", type=float, default=4.0, help="steer: the bucket's length over the last step's / lr")
    a = p.parse_args(argv)
    attacks = [x.strip() for x in a.attack.split(",") if x.strip()]
    if "random" in attacks:
        rng = random.Random(a.seed)
        pool = [x for x in ATTACKS if x not in LEAD] + [rng.choice(sorted(LEAD))]
        attacks = [x for x in attacks if x != "random"] + rng.sample(pool, rng.randint(2, 4))
        if "poison" in attacks and "poison_samples" in attacks:
            attacks.remove("poison_samples")
    bad = [x for x in attacks if x not in ATTACKS]
    if bad:
        p.error(f"unknown attack(s) {bad}; expected {ATTACKS} or random")
    a.attack = attacks
    return asyncio.run(Hostile(a).run())


if __name__ == "__main__":
    sys.exit(main())
