"""A job's code: finding it (a file, a package, a module name), the deterministic bundle a
server serves, unpacking a served bundle, importing it (README "Write your own job")."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import sys
import tempfile
import traceback
import zipfile
from typing import Any, Iterator

from ..errors import ConfigError

DEFAULT_FACTORY = "make_worker"
#: The bundle member that names the module and the factory.
BUNDLE_MANIFEST = "tabcohort-job.json"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
_MAX_BUNDLE_FILES = 512


class JobError(ConfigError):
    """A job that cannot be run: ``variable`` is the option (``--job``), ``value`` the job, and
    the reason says what is wrong (a file and line where there is one)."""

    def __init__(self, reason: str, value: object = None, variable: str = "--job") -> None:
        super().__init__(variable, value, reason)


#: the most characters of a job's own exception message an error quotes: the message is its
#: author's, of any length (a 10 KB one was printed whole, on one line, by serve and simulate)
EXCEPTION_TEXT_MAX_CHARS = 500


def _said(exc: BaseException) -> str:
    """``str(exc)``, cut to :data:`EXCEPTION_TEXT_MAX_CHARS` characters (saying how many more);
    for a ``SystemExit``, what it means in a job."""
    if isinstance(exc, SystemExit):
        # (a job's sys.exit(), or an argparse parser run at its import, ended `serve` with its
        # exit code and no word: a new-user trial)
        return (f"{exc.code!r}: a job must not end the process (sys.exit(), or a command-line parser "
                f"run at import: put it under `if __name__ == \"__main__\":`)")
    text = str(exc)
    if len(text) <= EXCEPTION_TEXT_MAX_CHARS:
        return text
    return f"{text[:EXCEPTION_TEXT_MAX_CHARS]}... ({len(text) - EXCEPTION_TEXT_MAX_CHARS} more characters)"


def _where(exc: BaseException, files: set[str], called: Any = None) -> str:
    """``file:line`` of the innermost frame of ``exc`` inside the job's files; when none is (the
    call itself failed, e.g. a factory without the ``options`` keyword), where ``called`` (the
    job's function) is defined, not the line of tabcohort's that called it."""
    tb = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(tb):
        if os.path.abspath(fr.filename) in files:
            return f"{fr.filename}:{fr.lineno}"
    # (a class named as the factory is called through its __init__: where that is defined)
    code = getattr(called, "__code__", None) or getattr(getattr(called, "__init__", None), "__code__", None)
    if code is not None and os.path.abspath(code.co_filename) in files:
        return f"{code.co_filename}:{code.co_firstlineno} (where {getattr(called, '__name__', '?')} is defined)"
    return tb[-1].filename + f":{tb[-1].lineno}" if tb else "?"


class JobSource:
    """A job's code: its files (relative path -> bytes), module name and factory name.

    ``bundle`` is the deterministic zip served to ranks (``GET /api/rooms/ROOM/job/code``) and
    ``code_sha256`` its sha256. ``root`` is the directory the files are imported from.
    """

    def __init__(self, module: str, files: dict[str, bytes], factory: str, root: str, ref: str) -> None:
        self.module, self.files, self.factory, self.root, self.ref = module, files, factory, root, ref
        self.is_package = any(p == f"{module}/__init__.py" for p in files)
        self.bundle = source_bundle(module, files, factory)
        self.code_sha256 = hashlib.sha256(self.bundle).hexdigest()

    def compile_all(self) -> None:
        """Raises:
            JobError: a syntax error, naming the file and line.
        """
        for rel, src in sorted(self.files.items()):
            path = os.path.join(self.root, rel)
            try:
                compile(src, path, "exec", dont_inherit=True)
            except SyntaxError as e:
                raise JobError(f"syntax error in {e.filename or path}:{e.lineno}: {e.msg}", self.ref) from None
            except ValueError as e:   # null bytes
                raise JobError(f"{path}: {e}", self.ref) from None

    @contextlib.contextmanager
    def bundle_only(self) -> Iterator[None]:
        """``sys.path`` without the job's own directory (the current one under ``python -m``)
        while the job's code runs in a check: a rank imports it from its bundle alone, so a file
        beside a one-file job that is not in the bundle must fail the check, not every rank
        (imports inside the factory, ``grads`` or ``evaluate`` too)."""
        saved = list(sys.path)
        root = os.path.abspath(self.root)
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
        try:
            yield
        finally:
            sys.path[:] = saved

    def missing_file_hint(self, exc: BaseException) -> str:
        """A hint when ``exc`` is a ModuleNotFoundError for a module beside the job, else ''."""
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        top = missing.split(".")[0] if missing else None
        if top and (os.path.exists(os.path.join(self.root, top + ".py")) or os.path.isdir(os.path.join(self.root, top))):
            return (f"; {top} is beside the job but not part of it: a job of several files is a package "
                    f"(a directory with __init__.py; README 'Write your own job')")
        return ""

    def import_module(self) -> Any:
        """Import the job's module from :attr:`root` (a fresh import: a cached module of the same
        name is replaced).

        Raises:
            JobError: a syntax error (file and line) or an exception while importing.
        """
        self.compile_all()
        for k in [k for k in sys.modules if k == self.module or k.startswith(self.module + ".")]:
            del sys.modules[k]
        if self.is_package:
            init = os.path.join(self.root, self.module, "__init__.py")
            spec = importlib.util.spec_from_file_location(
                self.module, init, submodule_search_locations=[os.path.join(self.root, self.module)])
        else:
            spec = importlib.util.spec_from_file_location(self.module, os.path.join(self.root, self.module + ".py"))
        if spec is None or spec.loader is None:
            raise JobError(f"cannot import {self.module} from {self.root}", self.ref)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[self.module] = mod
        _JOB_MODULES.add(self.module)
        files = {os.path.abspath(os.path.join(self.root, r)) for r in self.files}
        try:
            with self.bundle_only():
                spec.loader.exec_module(mod)
        except (Exception, SystemExit) as e:
            del sys.modules[self.module]
            hint = self.missing_file_hint(e)
            raise JobError(f"importing the job raised {type(e).__name__}: {_said(e)} ({_where(e, files)}){hint}",
                           self.ref) from None
        if not callable(getattr(mod, self.factory, None)):
            what = (f"has no function {self.factory}()" if not hasattr(mod, self.factory) else
                    f"has {self.factory}, a {type(getattr(mod, self.factory)).__name__}, not a function")
            raise JobError(f"the job module {self.module} {what} (the factory; name another with PATH:NAME)",
                           self.ref)
        return mod


def source_bundle(module: str, files: dict[str, bytes], factory: str) -> bytes:
    """The deterministic code bundle: :data:`BUNDLE_MANIFEST` (``{"module", "factory"}``) and the
    files, sorted, stored uncompressed (a deflate stream differs between zlib builds), with a
    fixed timestamp, mode and creator system (Python writes the host's: Windows and Linux would
    hash the same code differently), so the same code has the same sha256 on every machine."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        manifest = json.dumps({"module": module, "factory": factory}, sort_keys=True).encode()
        for name, data in [(BUNDLE_MANIFEST, manifest)] + [(rel, files[rel]) for rel in sorted(files)]:
            info = zipfile.ZipInfo(name, _ZIP_DATE)
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3               # unix
            info.external_attr = 0o100644 << 16  # a regular file, rw-r--r--
            z.writestr(info, data)
    return buf.getvalue()


def _split_ref(ref: str) -> tuple[str, str]:
    head, sep, tail = ref.rpartition(":")
    if sep and tail.isidentifier() and head and not (len(head) == 1 and head.isalpha()):
        return head, tail
    return ref, DEFAULT_FACTORY


#: module names this process imported as jobs (:meth:`JobSource.import_module`): another job of
#: the same name may replace one, a module of the interpreter's may not
_JOB_MODULES: set[str] = set()


#: standard-library modules a rank or the server may import after the job is loaded (importing
#: the job under one of these names would hand them the job instead)
_LATER_IMPORTS = frozenset({"asyncio", "base64", "concurrent", "email", "hashlib", "hmac", "http", "ipaddress",
                            "json", "logging", "random", "secrets", "select", "selectors", "signal", "socket",
                            "ssl", "struct", "threading", "urllib", "zipfile", "zlib"})


def _taken_name(module: str, root: str) -> str | None:
    """What ``module`` (a job's module name, its files under ``root``) already names in this
    process, or None: tabcohort's, a module imported here (not an earlier job's), or a
    standard-library module tabcohort imports later (:data:`_LATER_IMPORTS`)."""
    if module in ("tabcohort", "tabcohort_server"):
        return "tabcohort's own"
    mod = sys.modules.get(module)
    where = getattr(mod, "__file__", None)
    if mod is not None and module not in _JOB_MODULES and (
            where is None or not os.path.realpath(where).startswith(os.path.realpath(root) + os.sep)):
        return f"that of the imported module {module!r} ({where or 'built in'})"
    if mod is None and module in _LATER_IMPORTS:
        return "a module of Python's standard library that tabcohort imports"
    return None


def find_source(ref: str) -> JobSource:
    """The job named by ``PATH_OR_MODULE[:FACTORY]``: a ``.py`` file, a package directory, or an
    importable module name (its file is read, not imported).

    Raises:
        JobError: nothing found, or an unreadable file.
    """
    target, factory = _split_ref(ref)
    path = os.path.abspath(os.path.expanduser(target))
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "__init__.py")):
        root, module = os.path.dirname(path), os.path.basename(path)
        files = {}
        for dirpath, dirnames, names in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for n in sorted(names):
                if n.endswith(".py"):
                    full = os.path.join(dirpath, n)
                    files[os.path.relpath(full, root).replace(os.sep, "/")] = _read(full, ref)
        if len(files) > _MAX_BUNDLE_FILES:
            raise JobError(f"the package has {len(files)} .py files (at most {_MAX_BUNDLE_FILES})", ref)
    elif os.path.isfile(path):
        if not path.endswith(".py"):
            raise JobError("expected a .py file, a package directory or a module name", ref)
        root, module = os.path.dirname(path), os.path.basename(path)[:-3]
        files = {module + ".py": _read(path, ref)}
    elif target.replace(".", "").replace("_", "").isalnum() and not os.path.sep in target:
        try:
            spec = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            raise JobError("no such file, package directory or importable module", ref)
        if not spec.origin and spec.submodule_search_locations:
            raise JobError("the module is a namespace package (a directory without __init__.py); name "
                           "the package's directory with an __init__.py, or a .py file", ref)
        if not spec.origin or not spec.origin.endswith(".py"):
            raise JobError(f"the module is importable but not from a .py file (origin {spec.origin!r}: "
                           "built-in, frozen or compiled); a job is read as Python source", ref)
        if spec.submodule_search_locations:
            return find_source(os.path.dirname(spec.origin) + (f":{factory}" if factory != DEFAULT_FACTORY else ""))
        return find_source(spec.origin + (f":{factory}" if factory != DEFAULT_FACTORY else ""))
    elif os.path.isdir(path):   # (it was said to be "no such file" of a directory that exists)
        raise JobError("a directory without __init__.py is no package: name the job's .py file, or a "
                       "package directory (one with an __init__.py)", ref)
    else:
        raise JobError("no such file, package directory or importable module", ref)
    if not module.isidentifier():
        raise JobError(f"{module!r} is not a valid module name (rename the file)", ref)
    taken = _taken_name(module, root)
    if taken is not None:
        # (a job saved as tabcohort.py, asyncio.py or numpy.py replaced that module in the
        # process: tracebacks from deep inside tabcohort; a new-user trial)
        raise JobError(f"the job's module name {module!r} is {taken}: importing the job would replace it; "
                       f"rename the {'directory' if os.path.isdir(os.path.join(root, module)) else 'file'}", ref)
    return JobSource(module, files, factory, root, ref)


def _read(path: str, ref: str) -> bytes:
    """A job file's bytes, line endings as ``\\n`` (a Windows checkout is the same code)."""
    try:
        with open(path, "rb") as f:
            return f.read().replace(b"\r\n", b"\n")
    except OSError as e:
        raise JobError(f"cannot read {path}: {e.strerror}", ref) from None


def load_bundle(bundle: bytes, *, expect_sha256: str | None = None, cache_dir: str | None = None) -> JobSource:
    """A job's code from its bundle (as served by a server), written under ``cache_dir`` (default
    a new temporary directory) so it can be imported.

    Raises:
        JobError: the sha256 differs from ``expect_sha256``, or not a job bundle.
    """
    sha = hashlib.sha256(bundle).hexdigest()
    if expect_sha256 is not None and sha != expect_sha256:
        raise JobError(f"the job code's sha256 {sha} != the job's {expect_sha256}", "code")
    try:
        z = zipfile.ZipFile(io.BytesIO(bundle))
        with z:
            manifest = json.loads(z.read(BUNDLE_MANIFEST))
            module, factory = str(manifest["module"]), str(manifest["factory"])
            files = {}
            for info in z.infolist()[:_MAX_BUNDLE_FILES + 1]:
                name = info.filename
                if name == BUNDLE_MANIFEST:
                    continue
                parts = name.split("/")
                if not name.endswith(".py") or any(p in ("", ".", "..") for p in parts) or name.startswith("/"):
                    raise JobError(f"bad file name {name!r} in the job bundle", "code")
                files[name] = z.read(info)
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError) as e:
        raise JobError(f"not a job bundle ({type(e).__name__}: {e})", "code") from None
    if not module.isidentifier() or not factory.isidentifier():
        raise JobError(f"bad module or factory name in the job bundle ({module!r}, {factory!r})", "code")
    root = os.path.join(cache_dir, sha[:32]) if cache_dir else tempfile.mkdtemp(prefix="tabcohort-job-")
    for rel, data in files.items():
        full = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)
    src = JobSource(module, files, factory, root, f"{module}:{factory}")
    if src.code_sha256 != sha:   # the bundle was not made by source_bundle from these files
        raise JobError("the job bundle is not canonical (rebuilt from its files it hashes differently)", "code")
    return src
