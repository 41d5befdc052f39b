"""A Ctrl-C while ``tabcohort``'s modules load ends with one line and exit code 130 (README
"Stopping"), not a traceback of the import machinery: the first second of every command."""

from __future__ import annotations

import importlib.abc
import sys

import tabcohort.__main__ as entry


class _CtrlCOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "tabcohort.cli":
            raise KeyboardInterrupt
        return None


def test_ctrl_c_while_the_command_line_loads_is_one_line_and_130(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "tabcohort.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_CtrlCOnImport(), *sys.meta_path])
    assert entry.run() == 130
    assert capsys.readouterr().err == "tabcohort: interrupted (Ctrl-C)\n"


def test_the_console_script_is_the_guarded_entry():
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tabcohort"] == "tabcohort.__main__:run"
