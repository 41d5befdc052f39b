"""A job's pure-Python path checked where numpy cannot be imported, as in a tab whose Pyodide
has no numpy (README "Write your own job": without ``BACKENDS`` a job runs on numpy where it is
importable, else on its pure-Python path).

The server's start-up check builds the python worker in its own process, where numpy is
importable: a job that imports numpy at its top level passed it, was announced with backends
``numpy, python``, and then failed in every tab without numpy ("importing the job raised
ModuleNotFoundError: No module named 'numpy'"). :func:`needs_numpy` repeats that check in a
child interpreter with numpy made unimportable by a ``sys.meta_path`` finder (as
tests/no_numpy/ does), so tabcohort itself takes its no-numpy paths there too. The child costs
an interpreter start and an import of :mod:`tabcohort.jobs` (about 0.15 s) plus the job's
import and its probe.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

#: the line before the child's result on its stdout (the job may print there too)
_MARK = "\x1etabcohort-nonumpy-result "

#: run by ``python -c``: numpy is refused before anything imports it; then :func:`_child`
_BOOT = r'''
import sys
class _NoNumpy:
    """Refuses numpy and numpy.* (a tab without Pyodide's numpy); remembers who asked."""
    asked = []
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            cls.asked.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoNumpy)
for _m in [m for m in sys.modules if m == "numpy" or m.startswith("numpy.")]:
    del sys.modules[_m]
import json
_h = json.loads(sys.stdin.buffer.readline())
sys.path[:] = _h["path"]
from tabcohort.jobs.nonumpy import _child
_child(_h, _NoNumpy.asked)
'''


def classify(result: dict) -> str | None:
    """The reason a job's pure-Python path needs numpy, from the child's ``result``, or None.

    ``result`` is ``{"ok": bool, "reason": str, "asked": [module names]}``: the python path
    needs numpy when it failed after something asked for numpy (the job's import, its factory
    or a call of its worker). A failure without numpy asked for is another fault (None here:
    the caller's own check says what it is)."""
    if result.get("ok") or not result.get("asked"):
        return None
    return str(result.get("reason") or "it imports numpy")


def needs_numpy(job: Any, *, batch: int, seed: int, timeout_s: float) -> tuple[str | None, str | None]:
    """Build ``job``'s python worker and probe it (:func:`tabcohort.jobs.probe`) in a child
    interpreter where numpy cannot be imported.

    Returns:
        ``(reason, None)``: the pure-Python path needs numpy (``reason``: the failure there);
        ``(None, None)``: it runs without numpy; ``(None, note)``: not decided (the child
        failed for another reason, or could not run, or overran ``timeout_s``): ``note`` says
        why, for a log line.
    """
    header = {"path": list(sys.path), "ref": job.source.ref, "options": job.options,
              "batch": int(batch), "seed": int(seed), "timeout_s": float(timeout_s)}
    stdin = json.dumps(header).encode() + b"\n" + (job.data.raw or b"")
    # output to files, in a process group of its own, ended with its group: a job that leaves a
    # process behind (a pool, a helper) holds no pipe open for the parent to wait on
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f, tempfile.TemporaryFile() as in_f:
        in_f.write(stdin)
        in_f.seek(0)
        try:
            p = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=in_f, stdout=out_f, stderr=err_f,
                                 start_new_session=True)
        except OSError as e:
            return None, f"the check without numpy did not start ({e})"
        try:
            rc = p.wait(timeout=2 * timeout_s + 30)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait()
        if rc is None:
            return None, f"the check without numpy did not end within {2 * timeout_s + 30:g} s"
        out_f.seek(0)
        err_f.seek(0)
        out = out_f.read().decode("utf-8", "replace")
        err = err_f.read().decode("utf-8", "replace")
    at = out.rfind(_MARK)
    if at < 0:
        tail = err.strip().splitlines()[-1:] or ["no output"]
        return None, f"the check without numpy exited {rc} without a result ({tail[0]})"
    try:
        result = json.loads(out[at + len(_MARK):].splitlines()[0])
        reason = classify(result)
    except (ValueError, IndexError, AttributeError, TypeError):
        return None, "the check without numpy gave an unreadable result"
    if reason is None and not result.get("ok"):
        return None, f"without numpy: {result.get('reason')}"
    return reason, None


def _child(header: dict, asked: list[str]) -> None:
    """The child's side of :func:`needs_numpy`: the job's data from stdin, its result on stdout."""
    from . import JobData, load_job, probe
    from ..errors import ConfigError

    raw = sys.stdin.buffer.read()
    del asked[:]            # (tabcohort._compat's own try of numpy)
    result: dict[str, Any] = {"ok": True}
    try:
        job = load_job(header["ref"], with_data=False, options=header["options"], timeout_s=header["timeout_s"])
        job.data = JobData.from_npz(raw)
        w = job.make_worker(batch=header["batch"], seed=header["seed"], backend="python")
        probe(job, batch=header["batch"], seed=header["seed"], worker=w, timeout_s=header["timeout_s"])
    except ConfigError as e:
        result = {"ok": False, "reason": e.reason}
    except Exception as e:      # (the check's own code: said, not a traceback)
        result = {"ok": False, "reason": f"{type(e).__name__}: {e}"}
    result["asked"] = sorted(set(asked))
    sys.stdout.write("\n" + _MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
