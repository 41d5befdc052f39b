"""Run every benchmark in one go, collect their Markdown tables, and write README's figures.

Each benchmark prints a Markdown table of ratios measured side by side within its own run and
writes JSON to ``bench/results/``. This entry point runs them one after the other (never in
parallel: the machines have 2 cores) and writes ``bench/results/REPORT.md`` with every table,
``bench/results/summary.json`` with the collected JSON, and README.md's Performance figures:
the block between ``<!-- bench:begin -->`` and ``<!-- bench:end -->``, one section per benchmark
(``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->``). A benchmark of this run replaces its
section with what it printed today (with the date, commit and load average), or, if it was
skipped or failed, with a line saying its figures are missing and why: never an older figure.
Sections of benchmarks not in this run (``--only``) stay as they were, dated. ``--no-readme``
leaves README.md alone. Benchmarks whose optional dependencies
are missing say so: bench_pg's gloo column without torch, in its output; bench_tab without a local
Pyodide (``npm ci``) or Chromium, and bench_anchors without torch, are skipped with the reason.
A benchmark still running after 30 minutes (``TABCOHORT_BENCH_TIMEOUT_S``) is stopped and reported
as failed.

The link benchmarks (``links``, ``overhead``, ``server_scale``) start a real server and rank
processes on loopback; together they take about 6-8 minutes on 2 shared cores (``--only
links,overhead,server_scale``).

Usage: python bench/run_all.py [--quick] [--only NAME,NAME] [--no-readme]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
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
    "scale": ("bench_scale.py", [], ["--quick"]),
    "cluster": ("bench_cluster.py", [], ["--pings", "200", "--connects", "10"]),
    "pg": ("bench_pg.py", [], ["--iters", "5"]),
    "tab": ("bench_tab.py", [], []),
    "anchors": ("bench_anchors.py", [], ["--steps", "5", "--seconds", "4"]),
    "local_steps": ("bench_local_steps.py", [], ["--quick"]),
    "local_steps_relay": ("bench_local_steps_relay.py", [], ["--hs", "1,16", "--window-s", "5"]),
}

#: name -> (README heading, what it measures): the generated block's text around each table
ABOUT = {
    "local_steps": ("Local steps", "DiLoCo-style rounds (docs/PROTOCOL.md \"Local steps and optimizer "
                    "state\"): 4 ranks of the digits MLP, then of the CNN module job (examples/jobs/cnn_digits.py), in the simulation, compute time per sample measured "
                    "at the start of the run, every link throttled (bytes/s and delay) and unthrottled; time "
                    "to a held-out accuracy target and bytes per applied sample for each H, as ratios to H = 1 "
                    "in the same run."),
    "local_steps_relay": ("Local steps over the real relay", "a real server and four real rank processes "
                          "(the digits MLP, a global batch of 64, at most 16 samples per rank), each rank "
                          "behind its own shaped TCP link (bench/throttle.py: bytes/s and delay each way, "
                          "the simulator's link knob): applied samples/s and link bytes per applied sample "
                          "in a window after the cohort formed, for each H, as ratios to H = 1 in the same run."),
    "wire": ("Wire", "a `round` frame's encoded size per precision relative to f32, and the stdlib codec's "
             "throughput relative to numpy's (the tab's pure-Python path vs the native one)."),
    "hetero": ("Heterogeneous cohorts", "speed-proportional shares of a fixed global batch (docs/PROTOCOL.md "
               "\"Shares\"): cohort efficiency = applied samples/s of the cohort / the sum of its ranks' solo "
               "applied samples/s, each rank measured alone at the same global batch in the same run; a rank "
               "of speed v takes 0.5 ms + s / v ms for a share of s samples. Virtual time (the discrete-event "
               "simulation), once more with ranks that read nothing while they compute (\"blocking compute\": "
               "as native ranks and tabs on the python or js backend do, so a peer's bucket waits behind the "
               "leader's own compute; the rows that show what those runtimes get), and wall clock (real "
               "machines and drivers on one asyncio loop, the compute an awaited sleep); and digits "
               "accuracy, heterogeneous vs homogeneous at one global batch."),
    "yield": ("Yield between rounds", "a 4-rank in-process cohort with a tiny model: rounds/s with the "
              "driver's `call_soon` yield against the same cohort yielding through a 4 ms timer (what a "
              "clamped browser `setTimeout(0)` gives), interleaved."),
    "scaling": ("Scaling and the collection rule", "in-process cohorts with 50 ms of awaited compute per "
                "bucket: applied efficiency = applied samples/s (N) / (N x applied samples/s (1)) under the "
                "quorum rule (PROTOCOL.md) and the grace rule (docs/PROTOCOL-NOTES.md note 7), wall clock "
                "and in virtual time (the discrete-event simulation)."),
    "transports": ("Transports", "our bus over an aiortc data channel against a raw aiortc channel's "
                   "goodput, and round time per link kind relative to the WebSocket star."),
    "links": ("Scaling over real links", "a real `tabcohort serve` on loopback and real rank processes "
              "per link kind (ws-star, rtc-star, rtc-mesh), both collection rules."),
    "overhead": ("Protocol overhead", "two ranks, a tiny model, no compute: rounds/s against the raw "
                 "round trip of a pre-encoded chunk on the same path."),
    "server_scale": ("Server scale", "simulated ranks added in stages to one room: relayed frames/s, "
                     "server CPU per relayed frame and an open-loop probe's latency against an idle room."),
    "scale": ("Cohort size by simulation", "one room of 10, 100 and 1,000 ranks on the discrete-event "
              "simulator (the production rank machine, virtual time, the in-memory bus) with joins, leaves "
              "and leader kills: rounds/s, beat messages per rank per second, bytes into the leader per "
              "round, beats per join and the time to re-elect (README \"Scaling limits\", docs/SCALING.md)."),
    "cluster": ("Cluster: redirect or proxy", "a rank that reaches a node which does not own its room: "
                "sent to the owner (4012, what the cluster does) against a WebSocket proxy on that node; "
                "connect time and a frame's round trip, real redis-server and two `tabcohort serve --redis` "
                "nodes on loopback (README \"Cluster\")."),
    "pg": ("Process group", "`tabcohort.pg` all_reduce of 1M float32 against torch.distributed with gloo "
           "in the same run (when torch is installed)."),
    "tab": ("Tabs", "Chromium headless (`--enable-unsafe-webgpu`) with Pyodide tabs against native ranks on "
            "the same job: the grads time per bucket of the tab's webgpu, js and python backends in one tab "
            "and of numpy natively (the digits MLP and a 1.13M-parameter MLP; webgpu runs on the adapter "
            "named, here SwiftShader, a CPU implementation: not a GPU's speed), join time, rounds/s of "
            "mixed and tab-only cohorts per tab backend, main-thread long tasks, shares (with the native ranks "
            "on one core and the server and Chromium on the other, as if the tab were a volunteer's own machine)."),
    "anchors": ("Against gloo and hivemind", "one synchronous step on 1M float32 parameters: a cohort "
                "round through a real server, over the native ranks' direct TCP paths (`tcp-mesh`) and "
                "over the WebSocket star (`ws-star`), timed as gloo's broadcast + reduce is (from the "
                "parameters' send to the reduced update applied), against gloo and hivemind's averager "
                "(optional: torch and hivemind in a venv, `--anchor-python`)."),
}

#: a benchmark that runs longer than this is stopped and reported as failed (never a hang)
TIMEOUT_S = float(os.environ.get("TABCOHORT_BENCH_TIMEOUT_S", "1800"))
README = HERE.parent / "README.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _section(name: str, body: str) -> str:
    return f"<!-- bench:{name} -->\n{body.strip()}\n<!-- /bench:{name} -->"


def measured_section(name: str, script: str, args: list[str], stdout: str, stamp: str) -> str:
    """README's section for one benchmark from what it printed: its tables, its notes (a bench's
    own ``#`` title lines become italic notes), without the JSON path line."""
    title, what = ABOUT.get(name, (name, ""))
    lines = []
    for line in stdout.splitlines():
        if line.startswith(("JSON:", "=== ", "{", "wrote ")):   # machine-readable lines, the JSON path
            continue
        if line.startswith("#"):
            line = "*" + line.lstrip("#").strip() + "*"
        lines.append(line)
    body = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    cmd = " ".join(["python", f"bench/{script}", *args]).replace(str(HERE.parent) + os.sep, "")
    return _section(name, f"**{title}** (`{cmd}`; {stamp}): {what}\n\n{body}")


def missing_section(name: str, why: str, stamp: str | None) -> str:
    """README's section for a benchmark with no figures: says which are missing and why."""
    title, what = ABOUT.get(name, (name, ""))
    when = f"in the run of {stamp}" if stamp else "yet"
    return _section(name, f"**{title}**: {what}\n\n**Figures missing**: not measured {when} ({why}).")


def write_readme(sections: dict[str, str], readme: pathlib.Path = README) -> None:
    """Replace the sections of ``sections`` inside README's bench block; keep the others; a
    benchmark that has no section yet gets a "not measured yet" line."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme}: no {BEGIN} ... {END} block to write")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    old = block_sections(text)
    out = []
    for name in BENCHES:
        if name in sections:
            out.append(sections[name])
        elif name in old:
            out.append(old[name])
        else:
            out.append(missing_section(name, f"run `python bench/run_all.py --only {name}`", None))
    readme.write_text(head + BEGIN + "\n" + "\n\n".join(out) + "\n" + END + tail)


def _stamp(quick: bool) -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True,
                             text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        sha = "?"
    load = "?"
    try:
        load = " / ".join(f"{x:.1f}" for x in os.getloadavg()) + " (1/5/15 min)"
    except OSError:
        pass
    return (f"{time.strftime('%Y-%m-%d %H:%M')}, commit {sha}, {os.cpu_count()} cores, load {load}"
            f"{', --quick' if quick else ''}")


def block_sections(text: str) -> dict[str, str]:
    """The sections (name -> text) of the bench block in README-like ``text``."""
    if BEGIN not in text or END not in text:
        return {}
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return {m.group(1): m.group(0) for m in re.finditer(r"<!-- bench:(\w+) -->.*?<!-- /bench:\1 -->", block, re.S)}


def missing(name: str, repo: pathlib.Path) -> str | None:
    """Why an optional benchmark cannot run here (it is skipped, saying so), or None."""
    if name == "tab":
        if not (repo / "node_modules" / "pyodide" / "pyodide.mjs").exists():
            return "no local Pyodide (run `npm ci`, or `bash scripts/install.sh`, first)"
        chromium = os.environ.get("TABCOHORT_CHROMIUM", "/usr/bin/chromium")
        if not os.path.exists(chromium):
            return f"{chromium} is missing (apt-get install -y chromium)"
    if name == "cluster" and shutil.which("redis-server") is None:
        return "redis-server is not installed (apt-get install redis-server)"
    if name == "anchors":
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            return "torch is not installed (optional: pip install torch==2.13.0; hivemind==1.1.12 too)"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (noisier ratios)")
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(BENCHES))
    ap.add_argument("--no-readme", action="store_true", help="do not rewrite README.md's bench block")
    a = ap.parse_args()
    sections: dict[str, str] = {}
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
            sections[name] = missing_section(name, f"skipped: {why}", _stamp(a.quick))
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
            last = (r.stderr.strip().splitlines() or ["no output"])[-1][:200]
            sections[name] = missing_section(name, f"it failed with exit code {r.returncode}: {last}", _stamp(a.quick))
        else:
            sections[name] = measured_section(name, script, quick if a.quick else args, r.stdout, _stamp(a.quick))
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
    if not a.no_readme and sections:
        write_readme(sections)
        print(f"README.md: the Performance figures of {', '.join(sections)} rewritten")
    print(f"\nreport: {RESULTS / 'REPORT.md'}; JSON: {RESULTS / 'summary.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
