"""Make numpy unimportable for this interpreter (the no-numpy native test tier).

tests/no_numpy/run.sh puts this directory first on PYTHONPATH, so the ``site`` module imports
this file at startup (and in every subprocess that inherits PYTHONPATH). A ``sys.meta_path``
finder placed first refuses ``numpy`` and every ``numpy.*`` submodule, as a Pyodide tab without
numpy would: ``import numpy`` raises ``ModuleNotFoundError`` whether or not numpy is installed.
Packages that merely probe for numpy (hypothesis, pytest) see it as absent.
"""

from __future__ import annotations

import sys

_BLOCKED = "numpy"


class _NoNumpyFinder:
    """A meta path finder that rejects numpy and its submodules."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):  # noqa: ANN001, ANN205 - importlib protocol
        if fullname == _BLOCKED or fullname.startswith(_BLOCKED + "."):
            raise ModuleNotFoundError(
                f"No module named {fullname!r} (blocked by tests/no_numpy/sitecustomize.py)",
                name=fullname,
            )
        return None

    @staticmethod
    def invalidate_caches() -> None:
        pass


if not any(isinstance(f, _NoNumpyFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _NoNumpyFinder())
for _name in [m for m in sys.modules if m == _BLOCKED or m.startswith(_BLOCKED + ".")]:
    del sys.modules[_name]  # in case something imported it before us
