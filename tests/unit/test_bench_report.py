"""bench/run_all.py writes README's Performance figures: a benchmark of the run replaces its
section with what it printed (dated), a skipped or failed one says its figures are missing and
why (never an older figure), and the sections of benchmarks not in the run stay as they were."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.needs_loop   # native only: it imports subprocess-driving code

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "bench" / "run_all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_bench_block_is_rewritten_section_by_section(tmp_path):
    ra = _run_all()
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n\n{ra.BEGIN}\nstale hand-typed 6.0x\n{ra.END}\n\nafter\n")
    out = "# wire: 10 params\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\nJSON: /x.json\n"
    ra.write_readme({"wire": ra.measured_section("wire", "bench_wire.py", ["--n", "10"], out, "STAMP1"),
                     "yield": ra.missing_section("yield", "it failed with exit code 1: boom", "STAMP1")}, readme)
    text = readme.read_text()
    assert text.startswith("intro\n\n") and text.endswith(f"{ra.END}\n\nafter\n")
    assert "6.0x" not in text                               # nothing outside a section survives
    secs = ra.block_sections(text)
    assert list(secs) == list(ra.BENCHES)                   # every benchmark has its section, in order
    assert "| 1 | 2 |" in secs["wire"] and "STAMP1" in secs["wire"] and "JSON:" not in secs["wire"]
    assert "*wire: 10 params*" in secs["wire"]              # a bench's title line is a note, not a heading
    assert "Figures missing" in secs["yield"] and "boom" in secs["yield"]
    assert "not measured yet" in secs["pg"]
    # a later run of one benchmark keeps the others' sections as they were
    ra.write_readme({"pg": ra.measured_section("pg", "bench_pg.py", [], "| x |\n|---|\n| 9 |\n", "STAMP2")}, readme)
    secs2 = ra.block_sections(readme.read_text())
    assert secs2["wire"] == secs["wire"] and secs2["yield"] == secs["yield"] and "| 9 |" in secs2["pg"]


def test_readme_has_the_generated_block():
    ra = _run_all()
    assert ra.block_sections((ROOT / "README.md").read_text()).keys() == set(ra.BENCHES)
