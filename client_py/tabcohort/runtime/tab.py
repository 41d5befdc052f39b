"""The rank in a browser tab (Pyodide, in a dedicated module Web Worker).

``web/rank-worker.js`` boots Pyodide, installs this package from the server's wheel, and runs
``await run_tab(config)``. The life of a tab rank mirrors the native one
(:mod:`tabcohort.runtime.native`): leave a room that has finished (its public summary says so),
fetch the job, its code (the tab's own copy for the built-in job) and its
data (``.npz``, cached by sha256) and verify the hashes, load the room's checkpoint if any,
join over the star relay (:func:`~tabcohort.bus.page.page_star_bus`, the page owns the
socket) or, in a mesh room, over the page's data channels
(:func:`~tabcohort.bus.page.page_mesh_bus`), report the state to the server and to the page every ``report_interval_s``, upload
checkpoints while leading, and on the server's ``stop`` leave the cohort with the final model.

Page messages (JSON, ``{k: ...}``): ``progress`` (text), ``state`` (the state report plus
``links``, ``transport``, ``digest``), ``error`` (text, ``kind``), ``stopped``, ``finished`` (text:
the room had finished before this tab fetched its job, and the rank ended); also ``job``
(``status`` loading / ready / failed, ``name``, ``code_bytes``, ``code_sha256``, ``data_bytes``,
``data_sha256``, ``backend`` when ready, ``error`` when failed) and ``download`` (``what`` code
/ data, ``got``, ``total`` bytes, ``cached``). UI controls arrive
as ``{k: "control", action: "start"|"stop"|"lr"|"precision", value}``; ``lr`` and ``precision``
are honoured only while this rank leads and the server lets it lead (docs/PROTOCOL.md, "Roles":
in a room that requires the trainer credential a tab only contributes, so nobody at a
volunteer's page sets the room's learning rate or precision; a trusted-group room lets any
rank lead).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

from ..errors import ConfigError, LocalProtocolError, TabcohortError
from .session import (RankSession, check_topology, checkpoint_upload, finished_room_message, parse_room_summary,
                      path_report)


#: the longest error text the page is given (a job's exception message can be any length)
ERROR_TEXT_MAX_CHARS = 1000


class JobLoadError(TabcohortError):
    """The room's module job failed to download, import or build in this tab."""


class TabRun(RankSession):
    """One tab rank. ``cfg``: ``base`` (page origin), ``room``, ``token``, ``backend``, ``autostart``."""

    def __init__(self, cfg: dict, port: Any = None) -> None:
        from ..bus.page import JsPort

        super().__init__()
        self.cfg = cfg
        self.port = port or JsPort()
        self.hub: Any = None   # the PortHub, once _run started it
        #: the worker loop's queue of immediate callbacks (runtime.soon), once run_tab installed it
        self.soon: Any = None
        self.stop_event = asyncio.Event()
        self.t0 = time.monotonic()
        # largest gaps (ms, loop clock) between consecutive heartbeats sent and messages received:
        # a hidden tab must keep both under policy.drop, or its peers drop it (README, "Performance")
        self.gaps = {"beat_max_ms": 0.0, "recv_max_ms": 0.0, "beats": 0, "report_max_ms": 0.0}
        self._last_report_s: float | None = None
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
        return {k: r.headers.get(k) for k in ("X-Tabcohort-Step", "X-Tabcohort-Digest", "X-Tabcohort-Term",
                                              "X-Tabcohort-Cursor")}, data

    async def _room_summary(self) -> dict | None:
        """The room's public summary (``GET /api/rooms/ROOM``, without ``Authorization``), or
        None: only a hint, never an error (a body that is not a JSON object is None:
        :func:`~.session.parse_room_summary`)."""
        import js
        from pyodide.ffi import to_js

        url = f"{self.cfg['base']}/api/rooms/{self.cfg['room']}"
        try:
            r = await js.fetch(url, to_js({"cache": "no-store"}, dict_converter=js.Object.fromEntries))
            return parse_room_summary(await r.text()) if r.status == 200 else None
        except Exception:
            return None

    # ------------------------------------------------------------------ life
    async def run(self) -> int:
        try:
            return await self._run()
        except (ConfigError, TabcohortError) as e:
            kind = "job" if isinstance(e, JobLoadError) else "token" if "token" in str(e) else "room" if "no such room" in str(e) else "unreachable" \
                if "unreachable" in str(e) else "error"
            # (cut: a job's exception text is the job author's, of any length; the page shows it)
            self.ui("error", text=str(e)[:ERROR_TEXT_MAX_CHARS], kind=kind)
            return 2

    async def _run(self) -> int:
        from ..bus.page import PortHub, page_mesh_bus, page_star_bus
        from ..bus.room import RECONNECT_MAX_S
        from ..vec import digest

        cfg = self.cfg
        if cfg.get("link") not in (None, "ws", "rtc"):
            raise ConfigError("link", cfg.get("link"), "expected ws or rtc (the page's ?link=)")
        reconnect = cfg.get("reconnect")
        if reconnect is not None and not (isinstance(reconnect, int) and 1 <= reconnect <= RECONNECT_MAX_S):
            raise ConfigError("reconnect", reconnect, "expected whole seconds, 1..30 (the page's ?reconnect=)")
        # a finished room is left before the job, its data and the checkpoint are fetched, as a
        # native rank leaves it (README "Resuming"); asked only without a room token, as there
        finished = finished_room_message(await self._room_summary()) if not cfg.get("token") else None
        if finished is not None:
            self.ui("finished", text=finished)
            return 0
        self.progress("fetching the job")
        job = await self._fetch("/job")
        check_topology(job, "this tab")
        try:
            worker, jh = await self._module_worker(job)
        except JobLoadError as e:
            await self._report_fault(job, str(e))
            raise
        got = await self._fetch("/checkpoint", kind="bytes")
        if got is not None:
            headers, data = got
            self.start_from_checkpoint(worker, job, headers, data)
            self.progress(f"loaded checkpoint at step {self.start_step}")

        hub = self.hub = PortHub(self.port, on_other=self._on_ui).start()
        ws = cfg["base"].replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        url = f"{ws}/api/rooms/{cfg['room']}/ws"
        running = False   # a rejoin keeps the start/stop state the user chose
        while True:  # one pass per seat: a refused resume joins again as a new rank (no reload)
            common = dict(token=cfg.get("token"), precision=job["precision"], on_control=self.on_control,
                          reconnect_max_s=float(reconnect or RECONNECT_MAX_S))
            rtc_timeout_s = float(cfg.get("rtc_timeout_s") or 10.0)
            if job.get("topology") == "mesh":
                # a data channel per pair, in the page; idle bound as a native mesh rank's (native.py)
                beat_s = float(job["timing"].get("beat_ms", 400.0)) / 1000.0
                bus = self.bus = page_mesh_bus(hub, url, idle_timeout_s=max(5.0, 10 * beat_s),
                                               connect_timeout_s=rtc_timeout_s, **common)
            elif (cfg.get("link") or job.get("link") or "ws") == "rtc":
                # star over a data channel to the server (the page's ?link=rtc; native --link rtc)
                bus = self.bus = page_star_bus(hub, url, link="rtc", connect_timeout_s=rtc_timeout_s, **common)
            else:
                bus = self.bus = page_star_bus(hub, url, **common)
            self.progress("joining the room")
            try:
                await bus.connect()
            except Exception as e:
                await hub.aclose()
                raise TabcohortError(f"could not join: {e}") from None
            machine, driver = self.seat(bus, worker, job, jh)
            inner = bus.on_message

            def tap(msg: dict) -> None:
                now = driver.now_ms()
                if self._last_recv_ms is not None:
                    self.gaps["recv_max_ms"] = max(self.gaps["recv_max_ms"], now - self._last_recv_ms)
                self._last_recv_ms = now
                if msg.get("t") == "round":
                    self.saw_round(msg)
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
                driver.start(self.job_lr(job))
            next_ckpt = time.monotonic() + job["checkpoint_interval_s"]
            period = job["report_interval_s"]
            ui_period = min(period, 0.5)
            next_report = 0.0
            # the period comes from the driver's own turns: a timer alone ran 2-10 s late while
            # this tab led a fast cohort (RankDriver.wake_every)
            wake = driver.wake_every(ui_period)
            stopping = asyncio.ensure_future(self.stop_event.wait())
            try:
                while not self.stop_event.is_set():
                    woken = asyncio.ensure_future(wake.wait())
                    await asyncio.wait({stopping, woken}, timeout=ui_period,
                                       return_when=asyncio.FIRST_COMPLETED)
                    woken.cancel()
                    wake.clear()
                    if self.stop_event.is_set():
                        break
                    st = self._state(digest)
                    self.ui("state", state=st)
                    began = self.lead_began(machine, driver)   # (its report at once: PROTOCOL.md "Roles")
                    if time.monotonic() >= next_report or began:
                        t_report = time.monotonic()
                        next_report = t_report + period
                        if self._last_report_s is not None:   # the largest gap between two reports sent
                            self.gaps["report_max_ms"] = max(self.gaps["report_max_ms"],
                                                             1000.0 * (t_report - self._last_report_s))
                        self._last_report_s = t_report
                        bus.send_control({"type": "report", "state": self._server_state(st)})
                    if machine.looping and time.monotonic() >= next_ckpt:
                        next_ckpt = time.monotonic() + job["checkpoint_interval_s"]
                        await self._upload(final=False)
            except BaseException:
                stopping.cancel()
                await driver.close()
                await bus.aclose()
                await hub.aclose()
                self.port.destroy()
                raise
            stopping.cancel()
            if not self.rejoin:
                break
            # the server no longer knows this id (restarted without its checkpoint directory,
            # or the grace period ran out): join again as a new rank with the worker's
            # parameters and step; the next round (or the bootstrap) syncs it
            running = machine.running
            self.rejoined(machine)
            await driver.close()
            await bus.aclose()
            self.progress(f"rank {bus.id:08x}: the server refused its resume; rejoining as a new rank")
        try:
            def final_report() -> dict:
                st = self._state(digest)
                st["final"] = True
                bus.send_control({"type": "report", "state": self._server_state(st)})
                return st
            st = await self.leave(machine, driver, bus, upload=lambda final: self._upload(final=final),
                                  final_report=final_report)
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

    async def _module_worker(self, job: dict) -> tuple[Any, str]:
        """A module job (README "Write your own job"): its code bundle and data fetched (with
        ``download`` progress to the page; the data from the browser's cache when its sha256 is
        there), the code unpacked and imported, the worker built on numpy when Pyodide has it,
        else the job's pure-Python path. A job that fails here is a ``job`` message with
        ``status: "failed"`` and an ``error`` of kind ``job`` on the page, and a state report
        with ``fault`` to the server (:meth:`_report_fault`), not a hang.

        Raises:
            TabcohortError: the job failed to download, import or build (the page was told).
        """
        from .._compat import np
        from ..jobs import load_bundle, resolve_backend, shipped_source
        from .session import make_module_worker

        info = job["job_info"]
        shown = {k: info.get(k) for k in ("name", "module", "code_bytes", "code_sha256", "data_bytes",
                                          "data_sha256", "backends")}
        self.ui("job", status="loading", **shown)
        try:
            want = self.cfg.get("backend") or "auto"
            # a job that lists its backends (the built-in MLP: webgpu, js...) chooses itself
            backend = want if info.get("accepts") else resolve_backend(want if want in ("numpy", "python") else "auto")
            if not info.get("accepts") and backend not in (info.get("backends") or [backend]):
                raise TabcohortError(f"the job {info['name']!r} runs on {', '.join(info['backends'])}; "
                                     f"this tab has {backend} only")
            if want in ("auto", "numpy") and np is None and set(info.get("accepts") or ()) == {"numpy"}:
                # (said before the download; the job's factory raised "No module named 'numpy'")
                raise TabcohortError(f"the job {info['name']!r} runs on numpy only (its BACKENDS), and this tab "
                                     "has no numpy (Pyodide's numpy package did not load)")
            src = shipped_source(info["code_sha256"])   # the built-in job: this tab's own copy
            if src is None:
                self.progress(f"fetching job {info['name']} ({_size(int(info['code_bytes']))} of code)")
                code = await self._download("/job/code", "code", int(info["code_bytes"]), info["code_sha256"])
                src = load_bundle(code, expect_sha256=info["code_sha256"])
            self.progress(f"fetching the job's data ({_size(int(info['data_bytes']))})")
            raw = await self._download("/job/data", "data", int(info["data_bytes"]), info["data_sha256"],
                                       cache=True)
            self.progress(f"importing job {info['name']} and building its worker ({backend})")
            if self.cfg.get("wgsl_suffix"):   # test hook: a kernel that does not compile
                from ..model import backend_js
                backend_js.WGSL_TEST_SUFFIX = str(self.cfg["wgsl_suffix"])
            worker, jh = await make_module_worker(job, src, raw, batch=self.cfg.get("batch"), backend=backend)
            if want not in ("auto", backend) and not info.get("accepts"):
                # the page's ?backend= names one the job has no path for: say so, do not ignore it
                worker.backend_note = (f"?backend={want} was asked for, but the job {info['name']!r} runs on "
                                       f"{', '.join(info.get('backends') or [backend])}; using {backend}")
        except Exception as e:   # the job's own code may raise anything: say so, do not hang
            text = f"the job {info.get('name')!r} failed to load in this tab: {e}"
            self.ui("job", status="failed", error=text[:ERROR_TEXT_MAX_CHARS], **shown)
            raise JobLoadError(text) from None
        self.ui("job", status="ready", backend=worker.backend, **shown)
        self.progress(f"job {info['name']} ready: backend {worker.backend}"
                      + (f" ({worker.backend_note})" if worker.backend_note else ""))
        return worker, jh

    async def _report_fault(self, job: dict, text: str) -> None:
        """Tell the server this tab cannot run the room's job: one state report with ``fault``
        (docs/PROTOCOL.md, "State report") on a seat that never says ``hello``, then leave, so
        the operator view shows it. Best effort, bounded: a server that cannot be reached is
        already said on the page."""
        from ..bus.page import PortHub, page_star_bus

        hub = PortHub(self.port, on_other=lambda it: None).start()
        ws = self.cfg["base"].replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        bus = page_star_bus(hub, f"{ws}/api/rooms/{self.cfg['room']}/ws", token=self.cfg.get("token"),
                            precision=job["precision"], on_control=lambda obj: None, reconnect_max_s=1.0)
        try:
            await asyncio.wait_for(bus.connect(), 10.0)
            if bus.connected:
                bus.send_control({"type": "report", "state": {
                    "id": bus.id, "ready": False, "running": False, "step": 0, "fault": text[:250],
                    "pid": None, "kind": "tab"}})
        except (asyncio.TimeoutError, TabcohortError, ConfigError):
            pass
        finally:
            await bus.aclose()
            await hub.aclose()

    async def _download(self, path: str, what: str, total: int, sha256: str, *,
                        cache: bool = False) -> bytes | bytearray:
        """GET a room's blob, streamed with ``download`` messages ``{what, got, total}`` to the
        page; with ``cache``, kept in the browser's Cache Storage under its sha256, so a reload
        does not download it again (a cached copy whose hash differs is fetched anew).

        Raises:
            TabcohortError: an HTTP error, or the body's sha256 is not ``sha256``.
        """
        import hashlib

        import js
        from pyodide.ffi import to_js

        url = f"{self.cfg['base']}/api/rooms/{self.cfg['room']}{path}"
        key = f"{self.cfg['base']}/tabcohort-cache/{sha256}"
        store = None
        if cache:
            try:
                store = await js.caches.open("tabcohort-job-data")
                hit = await store.match(key)
                if hit:
                    data = (await hit.arrayBuffer()).to_bytes()
                    if hashlib.sha256(data).hexdigest() == sha256:
                        self.ui("download", what=what, got=len(data), total=total, cached=True)
                        return data
            except Exception:   # no Cache Storage here (an insecure origin): download
                store = None
        headers = {"Authorization": f"Bearer {self.cfg['token']}"} if self.cfg.get("token") else {}
        opts = to_js({"headers": headers, "cache": "no-store"}, dict_converter=js.Object.fromEntries)
        r = await js.fetch(url, opts)
        if r.status != 200:
            raise TabcohortError(f"GET {url}: HTTP {r.status}")
        reader = r.body.getReader()
        # one buffer of the announced size, filled in place (a large data set is not copied per chunk)
        buf = bytearray(total if 0 <= total <= 1 << 31 else 0)
        view = memoryview(buf)
        pos = shown_at = 0
        self.ui("download", what=what, got=0, total=total, cached=False)
        while True:
            chunk = await reader.read()
            if chunk.done:
                break
            part = chunk.value
            n = part.length
            if pos + n <= len(buf):
                part.assign_to(view[pos:pos + n])
            else:             # more than announced: the hash check below refuses it
                view.release()
                buf[pos:] = part.to_bytes()
                view = memoryview(buf)
            pos += n
            if pos - shown_at >= 256 * 1024:
                shown_at = pos
                self.ui("download", what=what, got=pos, total=total, cached=False)
        view.release()
        if pos < len(buf):
            del buf[pos:]
        data = buf   # (a bytearray: zipfile, hashlib and the Cache Storage take it without a copy here)
        self.ui("download", what=what, got=pos, total=total, cached=False)
        got_sha = hashlib.sha256(data).hexdigest()
        if got_sha != sha256:
            raise TabcohortError(f"the job's {what} sha256 {got_sha} != the job's {sha256}")
        if store is not None:
            try:
                await store.put(key, js.Response.new(to_js(data)))
            except Exception:
                pass
        return data

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
        elif action in ("lr", "precision") and not m.may_lead:
            self.ui("error", text="only a rank the server lets lead sets the learning rate or precision "
                    "(this tab contributes buckets)", kind="control")
        elif action == "lr" and (m.looping or m.is_leader(d.now_ms())):
            try:
                lr = float(value)
            except (TypeError, ValueError):
                return
            if math.isfinite(lr) and lr > 0:
                try:
                    d.set_lr(lr)
                except LocalProtocolError as e:
                    self.ui("error", text=str(e), kind="control")
        elif action == "precision" and (m.looping or m.is_leader(d.now_ms())):
            try:
                self.bus.set_precision(str(value))
            except ConfigError as e:
                self.ui("error", text=str(e), kind="control")
                return
            m.set_precision(str(value), now_ms=d.now_ms())

    def _path_why(self, peer: int, star: bool) -> dict:
        """A mesh pair on the relay: why, and how many times it fell back (the page shows it)."""
        p = None if star else self.bus.path(peer)
        if p is None or p.why is None or p.label != "relay":
            return {}
        return {"why": p.why, "fallbacks": p.n_fallbacks}

    def _state(self, digest: Any) -> dict:
        st = self.driver.state()
        st["digest"] = digest(self.driver.worker.params())
        m = self.driver.machine
        # roles as the server announced them (text for the page: "may lead" / "contributes")
        st["may_lead"] = m.may_lead
        st["roles"] = {f"{k:08x}": v for k, v in m.lead_roles.items()}
        bus = self.bus
        paths = bus.paths()
        star = bus.transport != "rtc-mesh"
        # per peer: bytes each way and how they travel (a star: the link to the server)
        counts = bus.bytes()
        kinds = {p: f"{paths[0]}-star" for p in counts} if star else paths
        st["links"] = [{"peer": p, "transport": kind, "sent": counts[p].sent if p in counts else 0,
                        "received": counts[p].received if p in counts else 0, **self._path_why(p, star)}
                       for p, kind in sorted(kinds.items())]
        st["transport"] = bus.transport
        ticks = bus.supervise_ticks()
        if ticks is not None:   # the mesh's supervise ticks, and those late (its loop blocked for > 1 s)
            st["supervise"] = ticks
        rtc = bus.transport != "ws-star"
        if rtc:  # as a native WebRTC rank reports them (tests and the operator view read these)
            report = path_report(bus)
            st["link_bytes"], st["paths"] = report["link_bytes"], report["links"]
        st["link"] = {"kind": "rtc" if rtc else "ws", "connected": bus.connected, "reconnects": bus.n_reconnects,
                      "uplink_bytes": self.bus.uplink_bytes, "downlink_bytes": self.bus.downlink_bytes,
                      "pressure": self.bus.pressure()}
        st["start_step"] = self.start_step
        st["rejoins"] = self.n_rejoins
        st["uptime_s"] = round(time.monotonic() - self.t0, 3)
        st["gaps"] = {k: round(v, 1) for k, v in self.gaps.items()}
        hub = self.hub
        # page messages taken per wake-up, and pauses of a rank that fell behind the round rate;
        # the worker's immediate callbacks: host tasks posted for them, and the most ready at once
        st["page_inbox"] = {"wakeups": hub.n_wakeups, "items": hub.n_items, "catch_up_pauses": hub.n_catch_up_pauses}
        soon = self.soon
        if soon is not None:
            st["page_inbox"].update(soon_pumps=soon.n_pumps, soon_run=soon.n_run, soon_max_ready=soon.max_ready_len)
        w = self.driver.worker   # why this backend (a fallback), and the GPU's name (model/backend_js.py)
        note, adapter = getattr(w, "backend_note", None), getattr(w, "adapter", None)
        st["backend_note"] = _fit(note, 256) if isinstance(note, str) else None   # (the server keeps <= 256)
        st["adapter"] = adapter[:256] if isinstance(adapter, str) else None
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

        m, w, bus = self.driver.machine, self.driver.worker, self.bus
        up = checkpoint_upload(m, w, bus, self.progress, final=final)
        if up is None:
            return
        data, h = up
        if self.cfg.get("token"):
            h["Authorization"] = f"Bearer {self.cfg['token']}"
        url = f"{self.cfg['base']}/api/rooms/{self.cfg['room']}/checkpoint"
        opts = to_js({"method": "PUT", "headers": h, "body": to_js(data)}, dict_converter=js.Object.fromEntries)
        try:
            r = await js.fetch(url, opts)
            if r.status not in (200, 409):
                self.progress(f"checkpoint upload: HTTP {r.status}")
        except Exception as e:  # a failed upload must not stop training
            self.progress(f"checkpoint upload failed: {e}")


def _size(n: int) -> str:
    """A byte count as the page writes sizes (kB, MB: powers of 1000)."""
    return f"{n} bytes" if n < 1000 else f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.1f} MB"


async def run_tab(cfg_json: str) -> int:
    """Entry point for ``web/rank-worker.js``: ``cfg_json`` is the page's config as JSON.

    First puts the worker loop's immediate callbacks under one pending host task
    (:mod:`tabcohort.runtime.soon`): with Pyodide's own, a leader tab's timers, fetches and page
    messages waited seconds behind the loop's backlog."""
    from . import soon

    run = TabRun(json.loads(cfg_json))
    run.soon = soon.install(asyncio.get_running_loop())
    return await run.run()



def _fit(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters: cut at a word with an ellipsis when longer (a
    note cut mid-word read as garbled: ``...; using js; usin``)."""
    if len(text) <= limit:
        return text
    return text[:limit - 1].rsplit(" ", 1)[0].rstrip(";,: ") + "…"
