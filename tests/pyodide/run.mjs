// Run the project's pytest suite inside Pyodide (Python 3.14, no numpy) under Node 20, offline.
//
//   node tests/pyodide/run.mjs [pytest args...]     (normally via tests/pyodide/run.sh)
//
// - boots the core runtime from the repo's node_modules/pyodide (npm ci), loads no packages;
// - unpacks the pure-Python wheels of pytest & co from the wheel cache
//   (TABCOHORT_PYODIDE_WHEELS, default .cache/pyodide-wheels) into site-packages;
// - mounts the repo at /repo with NODEFS (source changes need no rebuild), puts
//   /repo/client_py first on sys.path, chdirs to /repo so pyproject.toml's pytest settings apply;
// - runs pytest.main(args) and exits with pytest's exit code.
// Host paths inside the repo given as arguments are rewritten to /repo/...
// Timings (boot, unpack, pytest) go to stderr as "[pyodide-tier] ..." lines.

import { loadPyodide } from "pyodide";
import crypto from "node:crypto";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const t0 = performance.now();

// An uncaught error would make Node print the offending source line: all 1.2 MB of the minified
// pyodide.asm.mjs. Print the message alone.
for (const ev of ["uncaughtException", "unhandledRejection"]) {
  process.on(ev, (e) => {
    process.stderr.write(`[pyodide-tier] ${ev}: ${(e && (e.stack || e.message)) || e}\n`);
    process.exit(3);
  });
}
const here = path.dirname(fileURLToPath(import.meta.url));
const repoDir = path.resolve(here, "..", "..");
const wheelDir = path.resolve(
  repoDir,
  process.env.TABCOHORT_PYODIDE_WHEELS || path.join(".cache", "pyodide-wheels"),
);
const MOUNT = "/repo";
const SITE = "/lib/python3.14/site-packages";

const log = (msg) => process.stderr.write(`[pyodide-tier] ${msg}\n`);
const ms = (a, b) => `${(b - a).toFixed(0)} ms`;

// Environment seen by Python: Pyodide's defaults plus the variables tests and tools read.
const env = { HOME: "/home/pyodide", PYTHONHASHSEED: process.env.PYTHONHASHSEED || "0" };
for (const [k, v] of Object.entries(process.env)) {
  if (/^(TABCOHORT_|PYTEST_|HYPOTHESIS_)/.test(k) || k === "CI" || k === "NO_COLOR") env[k] = v;
}

// Raw byte-level stdout/stderr (pytest's own line handling; no per-line console.log).
const rawOut = (fd) => ({
  write(buf) {
    let off = 0;
    while (off < buf.length) off += fs.writeSync(fd, buf, off, buf.length - off);
    return buf.length;
  },
});

// The npm package's python_stdlib.zip holds .py sources only, so every stdlib import (Pyodide's
// own boot included) compiles from source: ~4 s boot on these machines. The first run writes a
// copy of the zip with unchecked-hash .pyc beside each .py (zipimport prefers them; tracebacks
// still find the source) into the cache; later runs boot from it in ~2 s.
const pyodideDir = path.dirname(fileURLToPath(import.meta.resolve("pyodide/pyodide.mjs")));
const pyodideVersion = JSON.parse(fs.readFileSync(path.join(pyodideDir, "package.json"))).version;
const stdlibSrc = path.join(pyodideDir, "python_stdlib.zip");
const stdlibKey = crypto
  .createHash("sha256")
  .update(`${pyodideVersion}:${fs.statSync(stdlibSrc).size}`)
  .digest("hex")
  .slice(0, 16);
const stdlibPyc = path.join(wheelDir, `stdlib-py314-${stdlibKey}.zip`);
const useStdlibPyc = process.env.TABCOHORT_PYODIDE_BUNDLE !== "0" && fs.existsSync(stdlibPyc);

const pyodide = await loadPyodide({
  env,
  stdin: () => null,
  ...(useStdlibPyc ? { stdLibURL: stdlibPyc } : {}),
});
pyodide.setStdout(rawOut(1));
pyodide.setStderr(rawOut(2));
const tBoot = performance.now();
let stdlibNote = useStdlibPyc ? "precompiled stdlib" : "stdlib from source";

if (!useStdlibPyc && process.env.TABCOHORT_PYODIDE_BUNDLE !== "0" && fs.existsSync(wheelDir)) {
  const src = fs.readFileSync(stdlibSrc);
  pyodide.FS.writeFile("/tmp/stdlib-src.zip", new Uint8Array(src.buffer, src.byteOffset, src.byteLength));
  pyodide.runPython(`
import importlib.util, zipfile
from importlib._bootstrap_external import _code_to_hash_pyc
with zipfile.ZipFile("/tmp/stdlib-src.zip") as zin, zipfile.ZipFile("/tmp/stdlib-pyc.zip", "w", zipfile.ZIP_STORED) as zout:
    for info in zin.infolist():
        data = zin.read(info)
        zout.writestr(info.filename, data)
        if info.filename.endswith(".py"):
            try:
                code = compile(data, info.filename, "exec", dont_inherit=True)
            except SyntaxError:  # test data and templates that are not meant to compile
                continue
            pyc = _code_to_hash_pyc(code, importlib.util.source_hash(data), checked=False)
            zout.writestr(info.filename + "c", bytes(pyc))
`);
  const tmp = `${stdlibPyc}.${process.pid}.tmp`;
  fs.writeFileSync(tmp, pyodide.FS.readFile("/tmp/stdlib-pyc.zip"));
  fs.renameSync(tmp, stdlibPyc);
  pyodide.FS.unlink("/tmp/stdlib-src.zip");
  pyodide.FS.unlink("/tmp/stdlib-pyc.zip");
  stdlibNote = `built ${path.basename(stdlibPyc)} in ${ms(tBoot, performance.now())}`;
}
const tStdlib = performance.now();

// Wheels.
const tWheels0 = performance.now();
let wheels = [];
try {
  wheels = fs.readdirSync(wheelDir).filter((f) => f.endsWith(".whl")).sort();
} catch {}
if (wheels.length === 0) {
  log(`no wheels in ${wheelDir}: run tests/pyodide/run.sh (it fetches them)`);
  process.exit(4);
}
const u8 = (buf) => new Uint8Array(buf.buffer, buf.byteOffset, buf.byteLength);
// unpackArchive rejects a Node Buffer ("Unknown typed array type 'Buffer'"): hence u8().
//
// Importing pytest + hypothesis from source costs ~1-2 s per run in Pyodide (no .pyc on the
// freshly unpacked files, whose mtimes are "now"). So the first run unpacks the wheels, compiles
// them to unchecked-hash .pyc (valid whatever the mtimes) and saves the result as one zip in the
// wheel cache, keyed by Pyodide version + wheel names; later runs unpack that zip instead.
// (Delete .cache/pyodide-wheels/site-py314-*.zip to rebuild; run.sh does when the pins change.)
const key = crypto
  .createHash("sha256")
  .update(JSON.stringify([pyodideVersion, wheels]))
  .digest("hex")
  .slice(0, 16);
const bundle = path.join(wheelDir, `site-py314-${key}.zip`);
let bundleNote, before;
const useBundle = process.env.TABCOHORT_PYODIDE_BUNDLE !== "0"; // 0: plain wheels, no .pyc
if (useBundle && fs.existsSync(bundle)) {
  pyodide.unpackArchive(u8(fs.readFileSync(bundle)), "zip", { extractDir: SITE });
  bundleNote = `precompiled bundle ${path.basename(bundle)}`;
} else {
  before = new Set(pyodide.FS.readdir(SITE));
  for (const w of wheels) {
    pyodide.unpackArchive(u8(fs.readFileSync(path.join(wheelDir, w))), "wheel", { extractDir: SITE });
  }
  if (!useBundle) bundleNote = `${wheels.length} wheels, no bundle`;
}
if (!bundleNote) {
  const tC = performance.now();
  const added = pyodide.FS.readdir(SITE).filter((n) => !before.has(n));
  pyodide.globals.set("_tier_added", pyodide.toPy(added));
  const data = pyodide.runPython(`
import compileall, io, os, py_compile, zipfile
site = ${JSON.stringify(SITE)}
for name in _tier_added:
    p = os.path.join(site, name)
    if os.path.isdir(p) and name != "pygments":  # pytest uses pygments only on a tty
        compileall.compile_dir(p, quiet=2, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
buf = io.BytesIO()
with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
    for name in sorted(_tier_added):
        p = os.path.join(site, name)
        if os.path.isfile(p):
            z.write(p, name)
            continue
        for root, dirs, files in os.walk(p):
            dirs.sort()
            for f in sorted(files):
                full = os.path.join(root, f)
                z.write(full, os.path.relpath(full, site))
buf.getvalue()
`);
  const bytes = data.toJs();
  data.destroy();
  const tmp = `${bundle}.${process.pid}.tmp`;
  fs.writeFileSync(tmp, bytes);
  fs.renameSync(tmp, bundle); // atomic: concurrent runs never see half a bundle
  bundleNote = `${wheels.length} wheels, built ${path.basename(bundle)} in ${ms(tC, performance.now())}`;
}
const tWheels = performance.now();

// Project source.
pyodide.FS.mkdirTree(MOUNT);
pyodide.FS.mount(pyodide.FS.filesystems.NODEFS, { root: repoDir }, MOUNT);

const args = process.argv.slice(2).map((a) => {
  // --opt=/host/repo/x -> --opt=/repo/x ; /host/repo/x -> /repo/x
  const m = /^(--[^=]+=)?(.*)$/.exec(a);
  const [pre, val] = [m[1] || "", m[2]];
  if (path.isAbsolute(val) && (val === repoDir || val.startsWith(repoDir + path.sep))) {
    return pre + MOUNT + val.slice(repoDir.length);
  }
  return a;
});

pyodide.globals.set("_tier_args", pyodide.toPy(args));
pyodide.globals.set("_tier_mount", MOUNT);
const tSetupPy0 = performance.now();
pyodide.runPython(`
import os, sys, importlib
os.chdir(_tier_mount)
sys.path.insert(0, _tier_mount + "/client_py")
sys.dont_write_bytecode = True   # keep __pycache__ for 3.14 out of the host's work tree
importlib.invalidate_caches()
print(f"[pyodide-tier] Python {sys.version.split()[0]} on {sys.platform} ({sys.implementation.name})", file=sys.stderr)
assert sys.version_info[:2] == (3, 14), sys.version
try:
    import numpy  # noqa: F401
except ImportError as e:
    print(f"[pyodide-tier] numpy unavailable as intended: {e.__class__.__name__}: {e}", file=sys.stderr)
else:
    raise SystemExit("[pyodide-tier] numpy imported inside Pyodide; this tier must run without it")
`);
const tSetupPy = performance.now();

log(
  `boot ${ms(t0, tBoot)} (${stdlibNote}), unpack ${ms(tWheels0, tWheels)} (${bundleNote}), ` +
    `mount+checks ${ms(tSetupPy0, tSetupPy)}; pytest ${args.join(" ")}`,
);

let code;
try {
  code = pyodide.runPython(`
import os, importlib.metadata, pytest
# Natively, pytest assert-rewrites every module of a distribution that ships a pytest11 plugin
# (all of hypothesis), caching the result as .pyc next to the source. Here site-packages is
# in-memory, so that would recompile ~90 modules on every run (seconds). Load the same plugins
# explicitly, by entry-point name (plugins look each other up by it, e.g. looptime -> "asyncio");
# -p loads them without marking their distributions for rewriting: the precompiled .pyc stand.
os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
_plugin_args = []
for _ep in importlib.metadata.entry_points(group="pytest11"):
    _plugin_args += ["-p", _ep.name]
# "-p asyncio" also asks to rewrite a module named asyncio: the stdlib one, imported at boot.
_plugin_args += ["-W", "ignore:Module already imported so cannot be rewritten; asyncio:pytest.PytestAssertRewriteWarning"]

class _NoTimeoutTimers:
    """pytest-timeout needs signal.setitimer or threads; Pyodide has neither. Keep its option and
    marker (tests and CI may pass --timeout) but arm no timer: the outer CI timeout still holds."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_timeout_set_timer(self, item, settings):
        return True

    @pytest.hookimpl(tryfirst=True)
    def pytest_timeout_cancel_timer(self, item):
        return True


_plugins = [_NoTimeoutTimers()] if any(e.name == "timeout" for e in importlib.metadata.entry_points(group="pytest11")) else []
int(pytest.main(_plugin_args + list(_tier_args), plugins=_plugins))
`);
} catch (e) {
  log(`pytest crashed: ${e}`);
  code = 3;
}
const tEnd = performance.now();
log(`pytest ${ms(tSetupPy, tEnd)}; total ${ms(t0, tEnd)}; exit ${code}`);
process.exit(code);
