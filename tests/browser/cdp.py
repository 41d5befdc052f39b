"""A small raw DevTools-protocol client (aiohttp WebSocket), for what Playwright cannot do: hidden
and frozen tabs (Chromium's DevTools Page.setWebLifecycleState). Playwright keeps every page visible and
focused; here Chromium is launched directly with ``--remote-debugging-port=0`` and a page is hidden
by opening and activating a second tab (``Target.createTarget`` + ``Target.activateTarget``; works
with ``--headless``) and frozen with ``Page.setWebLifecycleState``.

The client is synchronous for the tests: an asyncio loop runs in a background thread and each
``call`` is a bounded round trip. Sessions are flat (``Target.attachToTarget`` with ``flatten``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Any

import aiohttp

CHROMIUM = os.environ.get("TABCOHORT_CHROMIUM", "/usr/bin/chromium")
#: the base headless flags plus what WebRTC on loopback needs (the same list the Playwright fixture uses).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--allow-loopback-in-peer-connection",
         "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]


class CDPError(RuntimeError):
    pass


class Chromium:
    """One headless Chromium process and one browser-level DevTools WebSocket."""

    def __init__(self, extra_flags: list[str] | None = None, timeout_s: float = 30.0) -> None:
        self.dir = tempfile.mkdtemp(prefix="tc-cdp-")
        args = [CHROMIUM, "--headless", "--remote-debugging-port=0", f"--user-data-dir={self.dir}",
                *FLAGS, *(extra_flags or []), "about:blank"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.ws_url = self._devtools_url(timeout_s)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.events: list[dict] = []          # every event (method, params, sessionId), in order
        self._lock = threading.Lock()
        self._run(self._connect(), timeout_s)

    def _devtools_url(self, timeout_s: float) -> str:
        end = time.monotonic() + timeout_s
        buf = b""
        assert self.proc.stderr is not None
        os.set_blocking(self.proc.stderr.fileno(), False)
        while time.monotonic() < end:
            chunk = self.proc.stderr.read()
            if chunk:
                buf += chunk
                m = re.search(rb"DevTools listening on (ws://\S+)", buf)
                if m:
                    # keep draining stderr so Chromium never blocks on a full pipe
                    threading.Thread(target=self._drain, daemon=True).start()
                    return m.group(1).decode()
            if self.proc.poll() is not None:
                raise CDPError(f"chromium exited: {buf.decode(errors='replace')[-2000:]}")
            time.sleep(0.05)
        raise CDPError(f"no DevTools URL from chromium within {timeout_s} s: {buf[-2000:]!r}")

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        os.set_blocking(self.proc.stderr.fileno(), True)
        try:
            while self.proc.stderr.read(65536):
                pass
        except (OSError, ValueError):
            pass

    def _run(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _connect(self) -> None:
        self.http = aiohttp.ClientSession()
        self.ws = await self.http.ws_connect(self.ws_url, max_msg_size=0)
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            obj = json.loads(msg.data)
            if "id" in obj:
                fut = self._pending.pop(obj["id"], None)
                if fut is not None and not fut.done():
                    if "error" in obj:
                        fut.set_exception(CDPError(f"{obj['error']}"))
                    else:
                        fut.set_result(obj.get("result", {}))
            else:
                with self._lock:
                    self.events.append(obj)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(CDPError("DevTools socket closed"))

    async def _call(self, method: str, params: dict | None, session: str | None) -> dict:
        i = next(self._ids)
        fut = self.loop.create_future()
        self._pending[i] = fut
        msg: dict[str, Any] = {"id": i, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        await self.ws.send_str(json.dumps(msg))
        return await fut

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout_s: float = 30.0) -> dict:
        """One command; raises CDPError on a protocol error, TimeoutError after ``timeout_s``."""
        try:
            return self._run(self._call(method, params, session), timeout_s)
        except TimeoutError:
            raise
        except asyncio.TimeoutError as e:  # older Pythons
            raise TimeoutError(str(e)) from None

    def events_of(self, method: str, session: str | None = None) -> list[dict]:
        with self._lock:
            return [e for e in self.events if e.get("method") == method
                    and (session is None or e.get("sessionId") == session)]

    # ------------------------------------------------------------------ pages
    def open(self, url: str) -> "Page":
        tid = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        sid = self.call("Target.attachToTarget", {"targetId": tid, "flatten": True})["sessionId"]
        page = Page(self, tid, sid)
        page.send("Page.enable")
        page.send("Runtime.enable")
        # the page's dedicated worker(s): attach automatically, flat sessions, never paused
        page.send("Target.setAutoAttach", {"autoAttach": True, "waitForDebuggerOnStart": False, "flatten": True})
        page.send("Page.navigate", {"url": url})
        page.t_open = time.monotonic()
        return page

    def hide(self, page: "Page") -> str:
        """Open and activate another tab so ``page`` becomes hidden; returns the other tab's id."""
        other = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.call("Target.activateTarget", {"targetId": other})
        return other

    def minimize(self, page: "Page") -> None:
        """Minimize ``page``'s window (hides it too; works with ``--headless``, any window layout)."""
        w = self.call("Browser.getWindowForTarget", {"targetId": page.target_id})["windowId"]
        self.call("Browser.setWindowBounds", {"windowId": w, "bounds": {"windowState": "minimized"}})

    def close(self) -> None:
        try:
            self._run(self._close(), 10)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    async def _close(self) -> None:
        try:
            await asyncio.wait_for(self._call("Browser.close", None, None), 5)
        except Exception:
            pass
        await self.ws.close()
        await self.http.close()


class Page:
    """One tab: its flat session, plus the sessions of workers it attached."""

    def __init__(self, cdp: Chromium, target_id: str, session: str) -> None:
        self.cdp, self.target_id, self.session = cdp, target_id, session
        self.t_open = time.monotonic()

    def send(self, method: str, params: dict | None = None, timeout_s: float = 30.0) -> dict:
        return self.cdp.call(method, params, self.session, timeout_s)

    def eval(self, expr: str, timeout_s: float = 30.0, session: str | None = None) -> Any:
        r = self.cdp.call("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True},
                          session or self.session, timeout_s)
        if "exceptionDetails" in r:
            raise CDPError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def tc(self, expr: str = "tc.state", timeout_s: float = 10.0) -> Any:
        """``expr`` over the page's ``window.tc`` (web/app.js), or None before the page defines it."""
        return self.eval(f"(typeof tc === 'undefined') ? null : ({expr})", timeout_s=timeout_s)

    def worker_session(self) -> str | None:
        """The flat session of this page's dedicated worker (auto-attached), if one exists."""
        for e in self.cdp.events_of("Target.attachedToTarget", self.session):
            if e["params"]["targetInfo"]["type"] == "worker":
                return e["params"]["sessionId"]
        return None

    def freeze(self) -> None:
        self.send("Page.setWebLifecycleState", {"state": "frozen"})

    def resume(self) -> None:
        self.send("Page.setWebLifecycleState", {"state": "active"})

    def activate(self) -> None:
        self.cdp.call("Target.activateTarget", {"targetId": self.target_id})


def artifacts_dir() -> pathlib.Path:
    p = pathlib.Path(__file__).resolve().parent / "artifacts"
    p.mkdir(exist_ok=True)
    return p
