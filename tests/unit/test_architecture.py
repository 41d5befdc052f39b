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


def lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{root / 'client_py'}{os.pathsep}{root / 'server'}")
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_layers_hold():
    r = lint(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "broken" in r.stdout and "0 broken" in r.stdout


def test_a_forbidden_import_breaks_a_contract(tmp_path):
    for d in ("client_py", "server"):
        shutil.copytree(REPO / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    m = tmp_path / "client_py" / "tabcohort" / "protocol" / "machine.py"
    m.write_text(m.read_text() + "\nfrom ..runtime import driver as _layer_breach  # noqa\n")
    r = lint(tmp_path)
    assert r.returncode != 0 and "the protocol knows no runtime, bus or server BROKEN" in r.stdout, r.stdout
