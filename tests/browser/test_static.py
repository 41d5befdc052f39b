"""The server's tab assets without a browser: the client wheel (stdlib zipfile, cached, rebuilt on
change) and /api/boot (local Pyodide vs CDN fallback)."""

from __future__ import annotations

import io
import zipfile

from tabcohort_server import static


def test_wheel_is_pure_python_cached_and_rebuilt_when_a_source_changes(tmp_path):
    src = tmp_path / "tabcohort"
    (src / "bus").mkdir(parents=True)
    (src / "__init__.py").write_text("x = 1\n")
    (src / "bus" / "__init__.py").write_text("")
    w = static.WheelBuilder(src, version="9.9.9")
    z = zipfile.ZipFile(io.BytesIO(w.get()))
    assert w.filename == "tabcohort-9.9.9-py3-none-any.whl"
    assert "tabcohort/bus/__init__.py" in z.namelist()
    assert "Tag: py3-none-any" in z.read("tabcohort-9.9.9.dist-info/WHEEL").decode()
    first = w.get()
    assert w.n_builds == 1 and w.get() is first
    (src / "__init__.py").write_text("x = 22\n")
    assert w.get() != first and w.n_builds == 2


def test_boot_info_falls_back_to_the_cdn_for_the_same_version(monkeypatch, tmp_path):
    monkeypatch.setenv("TABCOHORT_PYODIDE_DIR", str(tmp_path / "nothing"))
    monkeypatch.delenv("TABCOHORT_PYODIDE_PACKAGES", raising=False)
    info = static.boot_info(static.WheelBuilder())
    assert info["pyodide"]["source"] == "cdn"
    assert info["pyodide"]["url"] == f"https://cdn.jsdelivr.net/pyodide/v{static.PYODIDE_VERSION}/full/"
    assert info["packages"]["source"] == "cdn"
    monkeypatch.setenv("TABCOHORT_PYODIDE_PACKAGES", str(tmp_path))
    monkeypatch.delenv("TABCOHORT_PYODIDE_DIR")
    info = static.boot_info(static.WheelBuilder())
    assert info["packages"] == {"url": "/pyodide-packages/", "source": "local"}
