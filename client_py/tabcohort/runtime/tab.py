"""The rank in a browser tab (Pyodide, in a dedicated module Web Worker).

``web/rank-worker.js`` boots Pyodide, installs this package from the server's wheel, and runs
``await run_tab(config)``. The life of a tab rank mirrors the native one
(:mod:`tabcohort.runtime.native`): fetch the job and the dataset (``Dataset.from_portable``:
scikit-learn is not in Pyodide) and verify both hashes, load the room's checkpoint if any,
join over the star relay (:class:`~tabcohort.bus.browser.BrowserBus`, the page owns the
socket) or, in a mesh room, over the page's data channels
(:class:`~tabcohort.bus.browser.BrowserMeshBus`), report the state to the server and to the page every ``report_interval_s``, upload
checkpoints while leading, and on the server's ``stop`` leave the cohort with the final model.

Page messages (JSON, ``{k: ...}``): ``progress`` (text), ``state`` (the state report plus
``links``, ``transport``, ``digest``), ``error`` (text, ``kind``), ``stopped``. UI controls arrive
as ``{k: "control", action: "start"|"stop"|"lr"|"precision", value}``; ``lr`` and ``precision``
are honoured only while this rank leads (PROTOCOL.md: only the leader runs the optimizer and
publishes parameters).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from array import array
from typing import Any

from ..errors import ConfigError, TabcohortError


class TabRun:
    """One tab rank. ``cfg``: ``base`` (page origin), ``room``, ``token``, ``backend``, ``autostart``."""

    def __init__(self, cfg: dict, port: Any = None) -> None:
        from ..bus.browser import JsPort

        self.cfg = cfg
        self.port = port or JsPort()
        self.stop_event = asyncio.Event()
        self.stop_reason: str | None = None
        self.failed: str | None = None
        self.publish_seen = False
        self.driver: Any = None
        self.bus: Any = None
        self.start_step = 0
        self.rejoin = False
        self.n_rejoins = 0
        self.t0 = time.monotonic()
        # largest gaps (ms, loop clock) between consecutive heartbeats sent and messages received:
        # a hidden tab must keep both under policy.drop (DESIGN.md, "Hidden and frozen tabs")
        self.gaps = {"beat_max_ms": 0.0, "recv_max_ms": 0.0, "beats": 0}
        self._last_beat_ms: float | None = None
        self._last_recv_ms: float | None = None

    # ------------------------------------------------------------------ page I/O
    def ui(self, k: str, **kw: Any) -> None:
        kw["k"] = k
        self.port.post_json(kw)

    def progress(self, text: str) -> None:
        self.ui("progress", text=text, t=round(time.monotonic() - self.t0, 3))

    async def _fetch(self, path: str, *, kind: str = "json") -> Any:
        import js
        from pyodide.ffi import to_js

        url = f"{self.cfg['base']}/api/rooms/{self.cfg['room']}{path}"
        headers = {"Authorization": f"Bearer {self.cfg['token']}"} if self.cfg.get("token") else {}
        opts = to_js({"headers": headers, "cache": "no-store"}, dict_converter=js.Object.fromEntries)
        try:
            r = await js.fetch(url, opts)
        except Exception as e:
            raise TabcohortError(f"the server is unreachable ({self.cfg['base']}): {e}") from None
        if r.status == 403:
            raise ConfigError("token", "<hidden>", "the server rejected the room token")
        if r.status == 404 and path != "/checkpoint":
            raise ConfigError("room", self.cfg["room"], "no such room on the server")
        if r.status == 404:
            return None
        if r.status != 200:
            raise TabcohortError(f"GET {url}: HTTP {r.status}")
        if kind == "json":
            return json.loads(await r.text())
        buf = await r.arrayBuffer()
        data = buf.to_bytes()
        return {k: r.headers.get(k) for k in ("X-Tabcohort-Step", "X-Tabcohort-Digest")}, data

    # ------------------------------------------------------------------ life
    async def run(self) -> int:
        try:
            return await self._run()
        except (ConfigError, TabcohortError) as e:
            kind = "token" if "token" in str(e) else "room" if "no such room" in str(e) else "unreachable" \
                if "unreachable" in str(e) else "error"
            self.ui("error", text=str(e), kind=kind)
            return 2

    async def _run(self) -> int:
        from ..bus.browser import BrowserBus, BrowserMeshBus, BrowserRtcStarBus, PortHub
        from ..model import Dataset, make_worker
        from ..protocol import RankMachine, Timing, job_hash
        from ..vec import digest
        from .driver import RankDriver

        cfg = self.cfg
        if cfg.get("link") not in (None, "ws", "rtc"):
            raise ConfigError("link", cfg.get("link"), "expected ws or rtc (the page's ?link=)")
        loop = asyncio.get_running_loop()
        self.progress("fetching the job")
        job = await self._fetch("/job")
        if job.get("topology") not in ("star", "mesh"):
            raise ConfigError("topology", job.get("topology"), "this tab supports the star and mesh topologies")
        self.progress(f"fetching the dataset ({job['dataset_info']['name']})")
        t_ds = time.monotonic()
        portable = await self._fetch("/dataset")
        ds = Dataset.from_portable(portable)
        del portable
        if ds.content_hash() != job["dataset_info"]["sha256"]:
            raise TabcohortError("the dataset's content hash differs from the job's")
        worker = make_worker(ds, hidden=tuple(job["hidden"]), batch=cfg.get("batch") or job["batch"],
                             seed=job["seed"], backend=cfg.get("backend") or "auto", activation=job["activation"])
        jh = job_hash(worker.spec(), ds.content_hash(), worker.bucket_len)
        if jh != job["job_hash"]:
            raise TabcohortError(f"job hash {jh} != the server's {job['job_hash']}: different model code?")
        self.progress(f"dataset ready: {ds.train_len} training samples in {time.monotonic() - t_ds:.2f} s; "
                      f"backend {worker.backend}")
        got = await self._fetch("/checkpoint", kind="bytes")
        if got is not None:
            headers, data = got
            if len(data) != 4 * worker.bucket_len or hashlib.sha256(data).hexdigest() != headers.get(
                    "X-Tabcohort-Digest"):
                raise TabcohortError("the server's checkpoint is corrupt (length or digest mismatch)")
            v = array("f")
            v.frombytes(data)
            worker.set_params(v)
            self.start_step = int(headers.get("X-Tabcohort-Step") or 0)
            self.progress(f"loaded checkpoint at step {self.start_step}")

        hub = PortHub(self.port, on_other=self._on_ui).start()
        ws = cfg["base"].replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        url = f"{ws}/api/rooms/{cfg['room']}/ws"
        running = False   # a rejoin keeps the start/stop state the user chose
        while True:  # one pass per seat: a refused resume joins again as a new rank (no reload)
            common = dict(token=cfg.get("token"), precision=job["precision"], on_control=self._on_control)
            if job.get("topology") == "mesh":
                # a data channel per pair, in the page; idle bound as a native mesh rank's (native.py)
                beat_s = float(job["timing"].get("beat_ms", 400.0)) / 1000.0
                bus = self.bus = BrowserMeshBus(hub, url, idle_timeout_s=max(5.0, 10 * beat_s),
                                                connect_timeout_s=float(cfg.get("rtc_timeout_s") or 10.0), **common)
            elif (cfg.get("link") or job.get("link") or "ws") == "rtc":
                # star over a data channel to the server (the page's ?link=rtc; native --link rtc)
                bus = self.bus = BrowserRtcStarBus(hub, url, connect_timeout_s=float(cfg.get("rtc_timeout_s") or 10.0),
                                                   **common)
            else:
                bus = self.bus = BrowserBus(hub, url, **common)
            self.progress("joining the room")
            try:
                await bus.connect()
            except Exception as e:
                await hub.aclose()
                raise TabcohortError(f"could not join: {e}") from None
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
                now = driver.now_ms()
                if self._last_recv_ms is not None:
                    self.gaps["recv_max_ms"] = max(self.gaps["recv_max_ms"], now - self._last_recv_ms)
                self._last_recv_ms = now
                if msg.get("t") == "round" and not msg.get("assign"):
                    self.publish_seen = True
                inner(msg)
            bus.on_message = tap
            bus_post = bus.post

            def post(msg: dict) -> None:
                if msg.get("t") == "beat":
                    now = driver.now_ms()
                    if self._last_beat_ms is not None:
                        self.gaps["beat_max_ms"] = max(self.gaps["beat_max_ms"], now - self._last_beat_ms)
                    self._last_beat_ms = now
                    self.gaps["beats"] += 1
                bus_post(msg)
            bus.post = post
            self.progress(f"rank {bus.id:08x} joined room {cfg['room']} ({worker.backend}, batch {worker.batch})")
            self.ui("joined", id=bus.id, t=round(time.monotonic() - self.t0, 3))
            if running if self.n_rejoins else cfg.get("autostart", True):
                driver.start(job["lr"])
            next_ckpt = time.monotonic() + job["checkpoint_interval_s"]
            period = job["report_interval_s"]
            ui_period = min(period, 0.5)
            next_report = 0.0
            try:
                while not self.stop_event.is_set():
                    try:
                        await asyncio.wait_for(self.stop_event.wait(), ui_period)
                    except asyncio.TimeoutError:
                        pass
                    st = self._state(digest)
                    self.ui("state", state=st)
                    if time.monotonic() >= next_report:
                        next_report = time.monotonic() + period
                        bus.send_control({"type": "report", "state": self._server_state(st)})
                    if machine.looping and time.monotonic() >= next_ckpt:
                        next_ckpt = time.monotonic() + job["checkpoint_interval_s"]
                        await self._upload(final=False)
            except BaseException:
                await driver.close()
                await bus.aclose()
                await hub.aclose()
                self.port.destroy()
                raise
            if not self.rejoin:
                break
            # the server no longer knows this id (restarted without its checkpoint directory,
            # or the grace period ran out): join again as a new rank with the worker's
            # parameters and step; the next round (or the bootstrap) syncs it
            self.rejoin = False
            self.stop_event.clear()
            running = machine.running
            self.start_step = machine.step
            self.n_rejoins += 1
            await driver.close()
            await bus.aclose()
            self.progress(f"rank {bus.id:08x}: the server refused its resume; rejoining as a new rank")
        try:
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
                await self._upload(final=True)
            st = self._state(digest)
            st["final"] = True
            bus.send_control({"type": "report", "state": self._server_state(st)})
            end = time.monotonic() + 2.0
            while bus.queued_bytes() and bus.connected and time.monotonic() < end:
                await asyncio.sleep(0.02)
            self.ui("state", state=st)
            self.ui("stopped", reason=self.stop_reason, digest=st["digest"], step=st["step"])
        finally:
            await driver.close()
            await bus.aclose()
            await hub.aclose()
            self.port.destroy()
            # every proxy this rank created is destroyed (tests/browser/test_tab_e2e.py checks)
            self.ui("teardown", proxies_created=getattr(self.port, "proxies_created", None),
                    proxies_destroyed=getattr(self.port, "proxies_destroyed", None))
        return 1 if self.failed else 0

    # ------------------------------------------------------------------ controls
    def _on_ui(self, it: dict) -> None:
        if it.get("k") != "control" or self.driver is None:
            return
        action, value = it.get("action"), it.get("value")
        d, m = self.driver, self.driver.machine
        if action == "start":
            d.start(None)
        elif action == "stop":
            d.stop()
        elif action == "lr" and (m.looping or m.is_leader(d.now_ms())):
            try:
                lr = float(value)
            except (TypeError, ValueError):
                return
            if math.isfinite(lr) and lr > 0:
                d.set_lr(lr)
        elif action == "precision" and (m.looping or m.is_leader(d.now_ms())):
            try:
                self.bus.set_precision(str(value))
            except ConfigError as e:
                self.ui("error", text=str(e), kind="control")
                return
            m.precision = str(value)

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
            self.rejoin = True              # the resume was refused: _run() joins again
            self.stop_event.set()
        elif t == "failed":
            self.failed = str(obj.get("reason"))
            self._request_stop(f"link failed: {self.failed}")

    def _request_stop(self, why: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = why
        self.stop_event.set()

    def _state(self, digest: Any) -> dict:
        st = self.driver.state()
        st["digest"] = digest(self.driver.worker.params())
        bus = self.bus
        rtc = hasattr(bus, "paths")
        st["links"] = bus.link_rows() if rtc else bus.links()
        st["transport"] = bus.transport
        if rtc:  # as a native WebRTC rank reports them (tests and the operator view read these)
            st["link_bytes"] = bus.transport_bytes()
            st["paths"] = bus.paths()
        st["link"] = {"kind": "rtc" if rtc else "ws", "connected": bus.connected, "reconnects": bus.n_reconnects,
                      "uplink_bytes": self.bus.uplink_bytes, "downlink_bytes": self.bus.downlink_bytes,
                      "pressure": self.bus.pressure()}
        st["start_step"] = self.start_step
        st["rejoins"] = self.n_rejoins
        st["uptime_s"] = round(time.monotonic() - self.t0, 3)
        st["gaps"] = {k: round(v, 1) for k, v in self.gaps.items()}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in st.items()}

    @staticmethod
    def _server_state(st: dict) -> dict:
        out = dict(st)
        out.pop("peers", None)
        out.pop("links", None)
        if "paths" in out:  # WebRTC: each link's path, keyed as native ranks key them
            out["links"] = out.pop("paths")
        out["pid"] = None
        out["kind"] = "tab"
        return out

    async def _upload(self, *, final: bool) -> None:
        import js
        from pyodide.ffi import to_js

        from ..vec import all_finite, digest

        m, w, bus = self.driver.machine, self.driver.worker, self.bus
        p = w.params()
        if not all_finite(p):
            # never store a diverged model (the server refuses it too: HTTP 422)
            self.progress(f"checkpoint upload skipped: the parameters at step {m.step} are not finite "
                          "(training diverged)")
            return
        data = array("f", p).tobytes() if not hasattr(p, "astype") else p.astype("<f4").tobytes()
        h = {"X-Tabcohort-Rank": str(bus.id), "X-Tabcohort-Secret": bus.secret or "",
             "X-Tabcohort-Step": str(m.step), "X-Tabcohort-Digest": digest(p),
             "X-Tabcohort-Loss": repr(float(m.loss))}
        if self.cfg.get("token"):
            h["Authorization"] = f"Bearer {self.cfg['token']}"
        if final:
            h["X-Tabcohort-Final"] = "1"
        url = f"{self.cfg['base']}/api/rooms/{self.cfg['room']}/checkpoint"
        opts = to_js({"method": "PUT", "headers": h, "body": to_js(data)}, dict_converter=js.Object.fromEntries)
        try:
            r = await js.fetch(url, opts)
            if r.status not in (200, 409):
                self.progress(f"checkpoint upload: HTTP {r.status}")
        except Exception as e:  # a failed upload must not stop training
            self.progress(f"checkpoint upload failed: {e}")


async def run_tab(cfg_json: str) -> int:
    """Entry point for ``web/rank-worker.js``: ``cfg_json`` is the page's config as JSON."""
    return await TabRun(json.loads(cfg_json)).run()


def _step_limit(job: dict) -> int | None:
    """The job's exact step limit for the machine (docs/PROTOCOL-NOTES.md, note 13); None = none."""
    steps = job.get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None
