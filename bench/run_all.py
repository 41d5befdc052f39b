"""Run every benchmark in one go and collect their Markdown tables into one report.

Each benchmark prints a Markdown table of ratios measured side by side within its own run and
writes JSON to ``bench/results/``. This entry point runs them one after the other (never in
parallel: the machines have 2 cores) and writes ``bench/results/REPORT.md`` with every table and
``bench/results/summary.json`` with the collected JSON. Benchmarks whose optional dependencies
are missing say so: bench_pg's gloo column without torch, in its output; bench_tab without a local
Pyodide (``npm ci``) or Chromium, and bench_anchors without torch, are skipped with the reason.
A benchmark still running after 30 minutes is stopped and reported as failed.

The link benchmarks (``links``, ``overhead``, ``server_scale``) start a real server and rank
processes on loopback; together they take about 6-8 minutes on 2 shared cores (``--only
links,overhead,server_scale``).

Usage: python bench/run_all.py [--quick] [--only NAME,NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: name -> (script, arguments, quick arguments)
BENCHES = {
    "wire": ("bench_wire.py", [], ["--n", "200000"]),
    "yield": ("bench_yield.py", ["--json", str(RESULTS / "bench_yield.json")], ["--seconds", "1", "--repeats", "1",
                                                                               "--json", str(RESULTS / "bench_yield.json")]),
    "scaling": ("bench_scaling.py", [], ["--seconds", "1.5", "--ns", "1,4,16"]),
    "hetero": ("bench_hetero.py", [], ["--quick"]),
    "transports": ("bench_transports.py", [], ["--mb", "16", "--steps", "100"]),
    "links": ("bench_links.py", [], ["--seconds", "3"]),
    "overhead": ("bench_overhead.py", [], ["--seconds", "2", "--pings", "200"]),
    "server_scale": ("bench_server_scale.py", [], ["--phase-s", "5"]),
    "pg": ("bench_pg.py", [], ["--iters", "5"]),
    "tab": ("bench_tab.py", [], []),
    "anchors": ("bench_anchors.py", [], ["--steps", "5", "--seconds", "4"]),
}

#: a benchmark that runs longer than this is stopped and reported as failed (never a hang)
TIMEOUT_S = 1800


def missing(name: str, repo: pathlib.Path) -> str | None:
    """Why an optional benchmark cannot run here (it is skipped, saying so), or None."""
    if name == "tab":
        if not (repo / "node_modules" / "pyodide" / "pyodide.mjs").exists():
            return "no local Pyodide (run `npm ci`, or `bash scripts/install.sh`, first)"
        chromium = os.environ.get("TABCOHORT_CHROMIUM", "/usr/bin/chromium")
        if not os.path.exists(chromium):
            return f"{chromium} is missing (apt-get install -y chromium)"
    if name == "anchors":
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            return "torch is not installed (optional: pip install torch==2.13.0; hivemind==1.1.12 too)"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (noisier ratios)")
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(BENCHES))
    a = ap.parse_args()
    names = [n for n in (a.only.split(",") if a.only else BENCHES) if n]
    RESULTS.mkdir(parents=True, exist_ok=True)
    repo = HERE.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo / "client_py"), str(repo / "server"),
                                                       os.environ.get("PYTHONPATH", "")]))
    report = [f"# tabcohort benchmarks ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores)\n"]
    failed = []
    for name in names:
        if name not in BENCHES:
            print(f"unknown benchmark {name!r}; choose from {', '.join(BENCHES)}", file=sys.stderr)
            return 2
        script, args, quick = BENCHES[name]
        path = HERE / script
        if not path.exists():
            report.append(f"## {name}\n\n(not present: {script})\n")
            continue
        why = missing(name, repo)
        if why is not None:
            print(f"=== {name}: skipped: {why}", flush=True)
            report.append(f"## {name}\n\n(skipped: {why})\n")
            continue
        cmd = [sys.executable, str(path), *(quick if a.quick else args)]
        print(f"=== {name}: {' '.join(cmd)}", flush=True)
        t0 = time.time()
        try:
            r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            r = subprocess.CompletedProcess(cmd, 124, e.stdout or "", f"timed out after {TIMEOUT_S} s")
            r.stdout = r.stdout.decode(errors="replace") if isinstance(r.stdout, bytes) else r.stdout
        dt = time.time() - t0
        print(r.stdout, end="")
        if r.returncode != 0:
            print(r.stderr[-2000:], file=sys.stderr)
            failed.append(name)
        report.append(f"## {name} (`python bench/{script} {' '.join(quick if a.quick else args)}`, {dt:.0f} s)\n\n"
                      + r.stdout + ("\n(failed: see stderr)\n" if r.returncode else "\n"))
    (RESULTS / "REPORT.md").write_text("\n".join(report))
    summary = {}
    for f in [*RESULTS.glob("bench_*.json"), RESULTS / "hetero.json"]:
        if not f.exists():
            continue
        try:
            summary[f.stem] = json.loads(f.read_text())
        except ValueError:
            pass
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nreport: {RESULTS / 'REPORT.md'}; JSON: {RESULTS / 'summary.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
