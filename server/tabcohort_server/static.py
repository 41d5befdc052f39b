"""Static routes for the tab: the page, the Pyodide core, the client package as a wheel, vendored JS.

Routes (registered by :func:`setup_static`, called from ``create_app``):

- ``GET /``: the room page (``web/index.html``); ``?room=NAME&token=...`` picks the room.
- ``GET /operator``: the operator view of a room (``web/operator.html``).
- ``GET /web/...``: the page's own HTML/CSS/JS.
- ``GET /api/boot``: what the tab should load, as JSON: the Pyodide core URL and whether it is
  the server's local copy (``source: "local"``) or the public CDN for the same version
  (``"cdn"``), an operator-configured Pyodide package directory for numpy (or the CDN), and the
  client wheel's URL and digest.
- ``GET /pyodide/...``: the Pyodide core from ``node_modules/pyodide`` (``TABCOHORT_PYODIDE_DIR``
  overrides), when present.
- ``GET /pyodide-packages/...``: ``TABCOHORT_PYODIDE_PACKAGES``, a directory holding a Pyodide
  distribution's package wheels and ``pyodide-lock.json`` (optional).
- ``GET /wheel/{name}.whl``: ``client_py/tabcohort`` as a pure-Python ``py3-none-any`` wheel built
  with stdlib :mod:`zipfile` on first request, cached in memory, rebuilt when a source file
  changes (size or mtime). No network, no build tools.
- ``GET /vendor/uplot/...``: uPlot's ``dist`` from ``node_modules/uplot``.

Every response carries a Content-Security-Policy (:func:`content_security_policy`) without
``'unsafe-inline'`` or ``'unsafe-eval'``: the page has no inline script, and a string a peer
managed to get into the page as markup could not run (the page renders peer data as text).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import mimetypes
import os
import pathlib
import zipfile
from typing import Any

from aiohttp import web

ROOT = pathlib.Path(__file__).resolve().parents[2]
WEB_DIR = ROOT / "web"
CLIENT_DIR = ROOT / "client_py" / "tabcohort"
NODE_MODULES = ROOT / "node_modules"
#: The Pyodide version package.json pins; the CDN fallback serves the same one.
PYODIDE_VERSION = "314.0.7"
CDN = "https://cdn.jsdelivr.net/pyodide/v{version}/full/"
DIST_NAME = "tabcohort"

# Module workers need a JavaScript MIME type for .mjs; streaming wasm compile needs application/wasm.
mimetypes.add_type("text/javascript", ".mjs")
mimetypes.add_type("text/javascript", ".js")
mimetypes.add_type("application/wasm", ".wasm")


def _pyodide_dir() -> pathlib.Path | None:
    d = pathlib.Path(os.environ.get("TABCOHORT_PYODIDE_DIR") or NODE_MODULES / "pyodide")
    return d if (d / "pyodide.mjs").is_file() else None


def missing_page_assets() -> str | None:
    """What the page lacks locally, said once by ``serve`` at start, or None: without
    ``node_modules/pyodide`` (or ``TABCOHORT_PYODIDE_DIR``) tabs load Pyodide from the CDN, which
    needs internet (offline a tab only said "boot failed: Failed to fetch ... cdn.jsdelivr.net"),
    and without ``node_modules/uplot`` the page's charts stay blank."""
    missing = []
    if _pyodide_dir() is None:
        where = os.environ.get("TABCOHORT_PYODIDE_DIR") or NODE_MODULES / "pyodide"
        missing.append(f"Pyodide in {where} (tabs will load it from {CDN.format(version=_pyodide_version(None))}, "
                       f"which needs internet)")
    if not (NODE_MODULES / "uplot" / "dist").is_dir():
        missing.append(f"uPlot in {NODE_MODULES / 'uplot'} (the page's charts stay blank)")
    if not missing:
        return None
    return (f"no local {' and no local '.join(missing)}: `npm ci` in the repository (or bash "
            f"scripts/install.sh) installs them; TABCOHORT_PYODIDE_DIR points at another Pyodide")


def _pyodide_version(d: pathlib.Path | None) -> str:
    if d is not None:
        try:
            return str(json.loads((d / "package.json").read_text())["version"])
        except (OSError, ValueError, KeyError):
            pass
    return PYODIDE_VERSION


def _stdlib_pyc(d: pathlib.Path | None) -> pathlib.Path | None:
    """A precompiled (.pyc) copy of Pyodide's stdlib zip, as the Pyodide test tier caches it
    (``.cache/pyodide-wheels/stdlib-py314-{key}.zip``, built by ``tests/pyodide/run.mjs``;
    ``TABCOHORT_PYODIDE_STDLIB`` overrides). It halves Pyodide's boot; without it the tab boots
    from the stock stdlib (sources only)."""
    p = os.environ.get("TABCOHORT_PYODIDE_STDLIB")
    if p:
        return pathlib.Path(p) if pathlib.Path(p).is_file() else None
    if d is None:
        return None
    src = d / "python_stdlib.zip"
    if not src.is_file():
        return None
    key = hashlib.sha256(f"{_pyodide_version(d)}:{src.stat().st_size}".encode()).hexdigest()[:16]
    f = ROOT / ".cache" / "pyodide-wheels" / f"stdlib-py314-{key}.zip"
    return f if f.is_file() else None


def _packages_dir() -> pathlib.Path | None:
    p = os.environ.get("TABCOHORT_PYODIDE_PACKAGES")
    return pathlib.Path(p) if p and pathlib.Path(p).is_dir() else None


def _client_version() -> str:
    try:
        import tomllib
        return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])
    except (OSError, ValueError, KeyError, ImportError):
        return "0.0.0"


class WheelBuilder:
    """Builds ``tabcohort-{version}-py3-none-any.whl`` from ``client_py/tabcohort`` (stdlib only).

    The wheel is rebuilt when the set of source files or any file's size or mtime changes.
    """

    def __init__(self, src: pathlib.Path = CLIENT_DIR, version: str | None = None) -> None:
        self.src = src
        self.version = version or _client_version()
        self._key: tuple | None = None
        self._data: bytes = b""
        self.n_builds = 0

    @property
    def filename(self) -> str:
        return f"{DIST_NAME}-{self.version}-py3-none-any.whl"

    def _files(self) -> list[pathlib.Path]:
        return sorted(p for p in self.src.rglob("*.py") if "__pycache__" not in p.parts)

    def get(self) -> bytes:
        files = self._files()
        key = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
        if key != self._key:
            self._data = self._build(files)
            self._key = key
            self.n_builds += 1
        return self._data

    def digest(self) -> str:
        return hashlib.sha256(self.get()).hexdigest()

    def _build(self, files: list[pathlib.Path]) -> bytes:
        buf = io.BytesIO()
        dist_info = f"{DIST_NAME}-{self.version}.dist-info"
        record: list[str] = []

        def add(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # reproducible
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, data)
            h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={h},{len(data)}")

        with zipfile.ZipFile(buf, "w") as zf:
            for p in files:
                add(zf, f"{DIST_NAME}/{p.relative_to(self.src).as_posix()}", p.read_bytes())
            add(zf, f"{dist_info}/METADATA",
                f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {self.version}\n".encode())
            add(zf, f"{dist_info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: tabcohort_server.static\n"
                                          b"Root-Is-Purelib: true\nTag: py3-none-any\n")
            add(zf, f"{dist_info}/top_level.txt", f"{DIST_NAME}\n".encode())
            record.append(f"{dist_info}/RECORD,,")
            info = zipfile.ZipInfo(f"{dist_info}/RECORD", date_time=(1980, 1, 1, 0, 0, 0))
            zf.writestr(info, "\n".join(record) + "\n")
        return buf.getvalue()


WHEEL = web.AppKey("wheel", WheelBuilder)
CSP = web.AppKey("csp", str)


def content_security_policy(cdn: str | None = None) -> str:
    """The Content-Security-Policy of every response (W3C CSP Level 3).

    Scripts come from this server only (``cdn``: plus the Pyodide CDN's origin, when the server has
    no local Pyodide); ``'wasm-unsafe-eval'`` lets Pyodide compile its WebAssembly (nothing else
    is evaluated); the rank's worker is a same-origin module script; fetches and the WebSocket go
    to this origin only. No inline script, no inline event handler, no plugins, no framing.

    Args:
        cdn: an ``https://host`` origin also allowed for scripts and fetches, or ``None``.
    """
    extra = f" {cdn}" if cdn else ""
    return ("default-src 'none'; "
            f"script-src 'self' 'wasm-unsafe-eval'{extra}; worker-src 'self'; "
            f"connect-src 'self'{extra}; img-src 'self' data:; style-src 'self'; "
            "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.setdefault("Content-Security-Policy", request.app[CSP])
    response.headers.setdefault("X-Content-Type-Options", "nosniff")


def boot_info(wheel: WheelBuilder) -> dict[str, Any]:
    """What ``/api/boot`` returns (see the module docstring)."""
    d = _pyodide_dir()
    version = _pyodide_version(d)
    cdn = CDN.format(version=version)
    pk = _packages_dir()
    return {
        "pyodide": {"url": "/pyodide/" if d is not None else cdn, "source": "local" if d is not None else "cdn",
                    "version": version},
        "packages": {"url": "/pyodide-packages/" if pk is not None else cdn,
                     "source": "local" if pk is not None else "cdn"},
        "wheel": {"url": f"/wheel/{wheel.filename}", "name": wheel.filename, "sha256": wheel.digest()},
        "site_packages": "/lib/python3.14/site-packages",
        "stdlib": {"url": "/pyodide-stdlib.zip" if _stdlib_pyc(d) is not None else None},
    }


async def _boot(request: web.Request) -> web.Response:
    info = boot_info(request.app[WHEEL])
    return web.json_response(info, headers={"Cache-Control": "no-store"})


async def _wheel(request: web.Request) -> web.Response:
    w = request.app[WHEEL]
    if request.match_info["name"] != w.filename:
        raise web.HTTPNotFound(text=f"no such wheel; this server builds {w.filename}")
    return web.Response(body=w.get(), content_type="application/zip",
                        headers={"Cache-Control": "no-cache"})


async def _stdlib(request: web.Request) -> web.StreamResponse:
    f = _stdlib_pyc(_pyodide_dir())
    if f is None:
        raise web.HTTPNotFound(text="no precompiled stdlib")
    return web.FileResponse(f, headers={"Content-Type": "application/zip"})


def _page(name: str):
    async def handler(request: web.Request) -> web.FileResponse:
        return web.FileResponse(WEB_DIR / name, headers={"Cache-Control": "no-cache"})
    return handler


def setup_static(app: web.Application) -> None:
    """Register the page, Pyodide, wheel and vendor routes on ``app``."""
    app[WHEEL] = WheelBuilder()
    d = _pyodide_dir()
    cdn = None
    if d is None or _packages_dir() is None:   # the page loads Pyodide (or numpy) from the CDN
        u = CDN.split("/")
        cdn = f"{u[0]}//{u[2]}"
    app[CSP] = content_security_policy(cdn)
    app.on_response_prepare.append(_security_headers)
    app.router.add_get("/", _page("index.html"))
    app.router.add_get("/operator", _page("operator.html"))
    app.router.add_get("/api/boot", _boot)
    app.router.add_get("/wheel/{name}", _wheel)
    app.router.add_get("/pyodide-stdlib.zip", _stdlib)
    if WEB_DIR.is_dir():
        app.router.add_static("/web/", WEB_DIR)
    if d is not None:
        app.router.add_static("/pyodide/", d)
    pk = _packages_dir()
    if pk is not None:
        app.router.add_static("/pyodide-packages/", pk)
    uplot = NODE_MODULES / "uplot" / "dist"
    if uplot.is_dir():
        app.router.add_static("/vendor/uplot/", uplot)
