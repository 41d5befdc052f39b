"""The layers of docs/INTERFACES.md hold: import-linter checks the contracts in pyproject.toml
(``[tool.importlinter]``), and a copy with a forbidden import must break them."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

if sys.platform == "emscripten":
    pytest.skip("import-linter is a test extra run natively", allow_module_level=True)

REPO = pathlib.Path(__file__).resolve().parents[2]
#: the bus's sans-I/O cores (docs/INTERFACES.md, "Bus"): no event loop, socket or transport
CORES = ("room.py", "path.py", "direct.py")
IO_MODULES = {"asyncio", "socket", "selectors", "aiohttp", "aiortc", "aioice", "js", "pyodide", "time"}


def lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{root / 'client_py'}{os.pathsep}{root / 'server'}")
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def lint_with_breach(tmp_path: pathlib.Path, module: str, line: str) -> subprocess.CompletedProcess:
    """Lint a copy of the tree whose ``module`` (a path under the repository) has ``line`` appended."""
    for d in ("client_py", "server"):
        shutil.copytree(REPO / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    m = tmp_path / module
    m.write_text(m.read_text() + "\n" + line + "\n")
    return lint(tmp_path)


def test_the_layers_hold():
    r = lint(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "broken" in r.stdout and "0 broken" in r.stdout


def test_a_forbidden_import_breaks_a_contract(tmp_path):
    r = lint_with_breach(tmp_path, "client_py/tabcohort/protocol/machine.py", "from ..runtime import driver as _layer_breach  # noqa")
    assert r.returncode != 0 and "the protocol knows no runtime, bus or server BROKEN" in r.stdout, r.stdout


def io_imports(source: str) -> set[str]:
    """Top-level module names imported anywhere in ``source`` that do I/O or read a clock."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & IO_MODULES


def test_the_bus_cores_do_no_io_and_read_no_clock():
    for name in CORES:
        src = (REPO / "client_py" / "tabcohort" / "bus" / name).read_text()
        assert io_imports(src) == set(), name
    assert io_imports("import asyncio\nfrom time import monotonic\n") == {"asyncio", "time"}


def test_a_core_that_imports_a_transport_breaks_the_bus_layers(tmp_path):
    r = lint_with_breach(tmp_path, "client_py/tabcohort/bus/path.py", "from . import star as _layer_breach  # noqa")
    assert r.returncode != 0 and "the bus is layered" in r.stdout and "BROKEN" in r.stdout, r.stdout


def test_a_server_that_decodes_parameters_breaks_its_contract(tmp_path):
    # docs/INTERFACES.md: the server never decodes parameters (it relays routing headers and
    # stores checkpoints as bytes; their accuracy is the leader's own evaluation)
    r = lint_with_breach(tmp_path, "server/tabcohort_server/app.py", "from tabcohort.vec import to_vector as _decodes  # noqa")
    assert r.returncode != 0 and "the server never decodes parameters BROKEN" in r.stdout, r.stdout


def test_a_request_handler_that_runs_model_code_breaks_the_server_contract(tmp_path):
    # docs/INTERFACES.md "The server": the job is built once at start (tabcohort_server.assets);
    # no other server module loads a model or runs a rank's protocol machine
    r = lint_with_breach(tmp_path, "server/tabcohort_server/rooms.py", "from tabcohort.model import make_worker as _runs_model  # noqa")
    assert r.returncode != 0 and "outside its start-up job check BROKEN" in r.stdout, r.stdout
    r = lint_with_breach(tmp_path / "b", "server/tabcohort_server/app.py", "from tabcohort.protocol.machine import RankMachine as _m  # noqa")
    assert r.returncode != 0 and "outside its start-up job check BROKEN" in r.stdout, r.stdout
    # (the package re-exports the machine: importing it from there is the same breach)
    r = lint_with_breach(tmp_path / "c", "server/tabcohort_server/rooms.py", "from tabcohort.protocol import RankMachine as _m  # noqa")
    assert r.returncode != 0 and "outside its start-up job check BROKEN" in r.stdout, r.stdout


def wire_package_imports(source: str) -> list[str]:
    """Imports of the ``tabcohort.wire`` package itself in ``source`` (not of a submodule)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "tabcohort.wire":
            found.append(", ".join(a.name for a in node.names))
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "tabcohort.wire"]
    return found


def test_the_server_names_the_wire_submodule_it_uses():
    # the package re-exports the frame reader and the codecs, and import-linter sees an import
    # of the package, not of what it re-exports: ``from tabcohort.wire import FrameReader`` in
    # the server kept "the server never decodes parameters" (a docs review). Server modules
    # import the routing submodules by name (chunk, limits, precision), which the contract checks.
    for path in sorted((REPO / "server" / "tabcohort_server").glob("*.py")):
        assert wire_package_imports(path.read_text()) == [], path.name
    assert wire_package_imports("from tabcohort.wire import FrameReader\n") == ["FrameReader"]
    assert wire_package_imports("from tabcohort.wire.chunk import parse_route\n") == []


def test_a_server_that_reads_frames_breaks_its_contract(tmp_path):
    r = lint_with_breach(tmp_path, "server/tabcohort_server/rooms.py",
                         "from tabcohort.wire.reader import FrameReader as _decodes  # noqa")
    assert r.returncode != 0 and "the server never decodes parameters BROKEN" in r.stdout, r.stdout


def test_precision_names_are_the_codecs():
    from tabcohort.wire.codecs import CODECS
    from tabcohort.wire.precision import PRECISIONS

    assert sorted(CODECS) == sorted(PRECISIONS)
