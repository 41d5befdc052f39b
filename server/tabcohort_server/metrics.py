"""Prometheus metrics read from the room bookkeeping at scrape time (no double counting).

A room's series are given only for the rooms in ``visible`` (the app passes the open rooms and
those whose token, or the operator token, the scrape carried): a token room's step, loss,
accuracy and ranks stay behind its token.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .rooms import RoomRegistry


class RoomCollector(Collector):
    def __init__(self, rooms: RoomRegistry, visible: Iterable[str] | None = None,
                 refused: Counter | None = None) -> None:
        self.rooms = rooms
        self.visible = None if visible is None else set(visible)
        self.refused = refused if refused is not None else Counter()

    def collect(self) -> Iterator:
        rooms = [r for r in self.rooms.rooms.values() if self.visible is None or r.name in self.visible]
        yield GaugeMetricFamily("tabcohort_rooms", "Rooms on this server", value=len(self.rooms.rooms))
        ranks = GaugeMetricFamily("tabcohort_ranks", "Connected ranks", labels=["room"])
        reserved = GaugeMetricFamily("tabcohort_ranks_reserved", "Disconnected ranks whose id is reserved",
                                     labels=["room"])
        step = GaugeMetricFamily("tabcohort_step", "The room's step: its current leader's last plausible "
                                 "report", labels=["room"])
        loss = GaugeMetricFamily("tabcohort_loss", "Leader's last reduced loss", labels=["room"])
        acc = GaugeMetricFamily("tabcohort_accuracy", "Leader's held-out accuracy", labels=["room"])
        term = GaugeMetricFamily("tabcohort_term", "Leader's lineage term", labels=["room"])
        div = GaugeMetricFamily("tabcohort_diverged_rounds", "Leader's rounds refused: an update that "
                                "overflowed, or a non-finite own bucket and no other (parameters kept finite)", labels=["room"])
        pres = GaugeMetricFamily("tabcohort_relay_pressure", "Max relay queue / high-water mark", labels=["room"])
        frames = CounterMetricFamily("tabcohort_frames_relayed", "Chunks written to relay queues", labels=["room"])
        nbytes = CounterMetricFamily("tabcohort_bytes_relayed", "Chunk bytes written to relay queues",
                                     labels=["room"])
        fin = CounterMetricFamily("tabcohort_frames_received", "Chunks received from ranks", labels=["room"])
        drops = CounterMetricFamily("tabcohort_drops", "Relay drops and refusals by reason (bad controls, "
                                    "clamped backlog claims, lead claims without the role, implausible "
                                    "report steps, refused checkpoint uploads: checkpoint_*)",
                                    labels=["room", "reason"])
        leaders = GaugeMetricFamily("tabcohort_ranks_may_lead", "Connected ranks the server lets lead "
                                    "(trainer credential, or a room where any rank may lead)", labels=["room"])
        ckpts = GaugeMetricFamily("tabcohort_checkpoints", "Checkpoints kept (the newest K plus the best)",
                                  labels=["room"])
        ck_step = GaugeMetricFamily("tabcohort_checkpoint_step", "Step of the newest stored checkpoint",
                                    labels=["room"])
        ck_best = GaugeMetricFamily("tabcohort_checkpoint_best_accuracy", "Held-out accuracy of the best kept "
                                    "checkpoint (the leader's own evaluation)", labels=["room"])
        rdrops = GaugeMetricFamily("tabcohort_rank_drops", "Drops the connected ranks report (validated), "
                                   "summed by layer and reason", labels=["room", "layer", "reason"])
        npaths = GaugeMetricFamily("tabcohort_rank_paths", "Pairs of connected ranks by the path their "
                                   "reports name (tcp: a direct TCP path, rtc: a data channel, relay, "
                                   "connecting; each pair counted from both ends)", labels=["room", "path"])
        pbytes = GaugeMetricFamily("tabcohort_rank_path_bytes", "Chunk bytes the connected ranks report "
                                   "sent + received on each kind of path (from both ends)",
                                   labels=["room", "path"])
        robust = {k: GaugeMetricFamily(f"tabcohort_{name}", text, labels=["room"]) for k, name, text in (
            ("quarantined", "ranks_quarantined", "Ranks a leader's robust aggregation has quarantined (no share)"),
            ("silent", "ranks_silent", "Ranks a leader no longer awaits: given a share, they did not deliver"),
            ("clipped", "buckets_clipped", "Buckets a leader clipped to its norm bound (the current leaders' counts)"))}
        refused = CounterMetricFamily("tabcohort_server_refused", "Requests and connections refused "
                                      "server-wide, by reason", labels=["reason"])
        for reason, n in sorted(self.refused.items()):
            refused.add_metric([reason], n)
        for r in rooms:
            ranks.add_metric([r.name], len(r.connected))
            reserved.add_metric([r.name], len(r.peers) - len(r.connected))
            step.add_metric([r.name], r.step())
            head = r.headline()    # (as GET /api/rooms/ROOM shows them: a stopped room keeps its last)
            for fam, key in ((loss, "loss"), (acc, "accuracy"), (term, "term"), (div, "diverged")):
                v = head[key]
                fam.add_metric([r.name], float(v) if isinstance(v, (int, float)) and not isinstance(v, bool)
                               and math.isfinite(v) else math.nan)
            pres.add_metric([r.name], r.pressure())
            leaders.add_metric([r.name], sum(1 for p in r.connected.values() if p.may_lead))
            if r.store is not None:
                ckpts.add_metric([r.name], len(r.store.entries))
                newest, best = r.store.latest_meta(), r.store.best_meta()
                ck_step.add_metric([r.name], math.nan if newest is None else newest["step"])
                ck_best.add_metric([r.name], math.nan if best is None else best["accuracy"])
            frames.add_metric([r.name], r.frames_relayed)
            nbytes.add_metric([r.name], r.bytes_relayed)
            fin.add_metric([r.name], r.frames_in)
            for reason, n in sorted(r.drops.items()):
                drops.add_metric([r.name, reason], n)
            paths, path_bytes = r.rank_paths()
            for kind, n in sorted(paths.items()):
                npaths.add_metric([r.name, kind], n)
            for kind, n in sorted(path_bytes.items()):
                pbytes.add_metric([r.name, kind], n)
            for k, v in r.robustness().items():
                robust[k].add_metric([r.name], v)
            for layer, by in r.rank_drops().items():
                for reason, n in sorted(by.items()):
                    rdrops.add_metric([r.name, layer, reason], n)
        yield from (ranks, reserved, step, loss, acc, term, div, pres, frames, nbytes, fin, drops, rdrops, refused,
                    leaders, ckpts, ck_step, ck_best, npaths, pbytes, *robust.values())
