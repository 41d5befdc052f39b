"""`tabcohort simulate` as a user runs it: real processes, real output, exit codes."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
REPO = pathlib.Path(__file__).resolve().parents[2]


def simulate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "client_py"), str(REPO / "server")]))
    return subprocess.run([sys.executable, "-m", "tabcohort", "simulate", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.mark.parametrize("args,named", [
    (["--ranks", "0"], "--ranks=0"), (["--lr", "inf"], "--lr=inf"), (["--link-loss", "1.5"], "--link-loss=1.5"),
    (["--add-rank-at", "1000", "--steps", "100"], "--add-rank-at=1000"),
    (["--kill-leader-at", "100", "--steps", "100"], "--kill-leader-at=100"),
    (["--kill-leader-at", "-1"], "--kill-leader-at=-1"), (["--precision", "f8"], "precision"),
    (["--backend", "torch"], "--backend='torch'"), (["--ranks", "100000"], "--ranks=100000"),
    # (every rank beats to every other: about n^2 deliveries per beat period in one process)
    (["--ranks", "257"], "--ranks=257: at most 256 ranks"),
    (["--dataset", "nope"], "--dataset='nope'"), (["--max-seconds", "0"], "--max-seconds=0.0: must be a number > 0"),
    # (one range said for every bad value: -1 was told "[0.0, inf]", and then 0 was refused)
    (["--max-seconds", "-1"], "--max-seconds=-1.0: must be a number > 0"),
    (["--ranks", "1", "--kill-leader-at", "10"], "--kill-leader-at=10"),
    (["--link-loss", "1"], "--link-loss=1.0"), (["--ranks", "1", "--partition-at", "10"], "--partition-at=10"),
    (["--target-accuracy", "0.9", "--eval-every", "0"], "--target-accuracy=0.9"), (["--hidden", "0"], "--hidden='0'"), (["--job-option", "channels"], "--job-option='channels'"),
    (["--job", "/no/such/job.py"], "--job='/no/such/job.py'"),
    (["--job", "/tmp"], "--job='/tmp': a directory without __init__.py is no package"),
    # (the value was dropped from the echo: "--job-option='hidden'")
    (["--job-option", "hidden=3"], "--job-option='hidden=3': sets an option of a module job"),
    # as serve bounds them: a batch over 2^24 failed every hello (u32) and hung; an infinite
    # delay delivered nothing
    (["--global-batch", "100000000000"], "--global-batch=100000000000"),
    (["--batch", "16777217"], "--batch=16777217"),
    # (ignored in silence: the global batch is a round's samples whatever --batch says)
    (["--batch", "8", "--global-batch", "100"], "--batch=8: has no effect with --global-batch 100"),
    (["--link-delay-ms", "inf"], "--link-delay-ms=inf"),
    # (a JSON value with no JSON form was blamed on --job: "SPEC and OPTIONS must be JSON-ready")
    (["--job-option", "a=1e999"], "--job-option='a=1e999': 1e999 is not a finite number"),
    # (serve refused a negative seed; simulate ran with it)
    (["--seed", "-1"], "--seed=-1: must be an integer >= 0"),
    # (accepted and did nothing: there is no partition to heal without --partition-at)
    (["--heal-after-ms", "100"], "--heal-after-ms=100.0: applies only with --partition-at"),
])
def test_bad_configuration_names_the_option_and_exits_2_before_starting(args, named):
    r = simulate(*args)
    assert r.returncode == 2, r.stderr
    assert named in r.stderr and "Traceback" not in r.stderr
    assert "starting the ranks" not in r.stdout


def test_json_output_is_one_document_and_short_runs_end_bit_identical():
    for _ in range(3):
        r = simulate("--ranks", "2", "--dataset", "synthetic", "--steps", "40", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        res = json.loads(r.stdout)
        assert res["ok"] is True and res["bit_identical"] is True and res["steps"] >= 40
        assert "step" in r.stderr                      # progress went to stderr
        assert len(res["leaders"]) >= 1, res           # (a short run said "leaders []")
        # every rank id as the console and `shares` show it, 8 hex digits (digests were decimal)
        ids = set(res["digests"]) | set(res["leaders"]) | set(res["shares"]) | set(res["speeds"])
        assert all(re.fullmatch(r"[0-9a-f]{8}", k) for k in ids) and set(res["leaders"]) <= set(res["digests"]), res
    r = simulate("--ranks", "2", "--dataset", "synthetic", "--steps", "40")
    # the summary says the last training loss (a job with a flipped gradient showed only its accuracy)
    assert r.returncode == 0 and re.search(r"done: \d+ steps in [\d.]+ s, training loss [\d.e+-]+, test accuracy",
                                           r.stdout), r.stdout[-2000:]


def test_a_run_whose_links_are_too_slow_for_its_rounds_says_why_its_ranks_differ():
    # a new-user trial: `--link-bandwidth 1000` ended "NO" with no word on why
    r = simulate("--ranks", "3", "--steps", "300", "--link-bandwidth", "1000")
    assert r.returncode == 1 and "bit-identical parameters on all 3 ranks: NO" in r.stdout, r.stdout[-1500:]
    assert "--link-bandwidth 1000 bytes/s carries one round" in r.stdout, r.stdout[-1500:]


def test_ranks_whose_links_never_carry_a_beat_end_as_separate_cohorts_not_a_success():
    # a new-user trial: at `--link-bandwidth 1` no beat crossed a link, each of its 4 ranks led a
    # cohort of its own and computed the same rounds alone, and the run ended "bit-identical: yes"
    r = simulate("--ranks", "3", "--dataset", "synthetic", "--steps", "400", "--link-bandwidth", "1",
                 "--max-seconds", "3")
    assert r.returncode == 1, r.stdout[-1500:]
    assert re.search(r"bit-identical parameters on all 3 ranks: \w+ \([0-9a-f]+\), but as 3 separate cohorts, not one",
                     r.stdout), r.stdout[-1500:]
    assert "each hearing no other rank: they did not train together (--link-bandwidth 1 bytes/s carries one round" \
        in r.stdout, r.stdout[-1500:]
    assert "raise it to run them all" not in r.stdout, r.stdout[-1500:]   # (more time joins no cohort)
    # lone leaders that stop at the step limit are found too (they no longer lead then)
    r = simulate("--ranks", "2", "--dataset", "synthetic", "--steps", "5", "--link-bandwidth", "1",
                 "--max-seconds", "20")
    assert r.returncode == 1 and "but as 2 separate cohorts, not one" in r.stdout, r.stdout[-1500:]
    r = simulate("--ranks", "3", "--dataset", "synthetic", "--steps", "400", "--link-bandwidth", "1",
                 "--max-seconds", "3", "--json")
    res = json.loads(r.stdout)
    assert r.returncode == 1 and res["ok"] is False and len(res["separate_leaders"]) == 3, res
    assert set(res["separate_leaders"]) == set(res["digests"]), res


def test_a_refused_configuration_under_json_is_one_json_document_too():
    # a new-user trial: `--json` printed nothing on stdout for a bad --dataset (exit 2)
    r = simulate("--ranks", "2", "--dataset", "nope.npz", "--json")
    assert r.returncode == 2, r.stderr
    res = json.loads(r.stdout)
    assert res["ok"] is False and "configuration error" in res["error"] and "nope.npz" in res["error"], res


def test_diverging_run_stops_with_a_clear_error():
    # (one run: under --json the error line is on stderr as without it)
    j = simulate("--ranks", "2", "--dataset", "synthetic", "--lr", "1000", "--steps", "500", "--max-seconds", "60",
                 "--json")
    assert j.returncode == 1
    assert "tabcohort: error: " in j.stderr and "diverged" in j.stderr and "--lr" in j.stderr, j.stderr[-1500:]
    # under --json stdout is still one JSON document (it was empty): a script learns why
    doc = json.loads(j.stdout)
    assert doc["ok"] is False and "diverged" in doc["error"] and "--lr" in doc["error"], (j.stdout, j.stderr[-500:])


def test_a_run_whose_loss_runs_away_with_finite_gradients_is_diverged_too():
    # a new user's `--lr 1000000` on digits ended at chance accuracy with exit 0: every gradient
    # stayed finite (dead ReLUs), the loss ended ~2e5x a uniform guess's
    r = simulate("--ranks", "2", "--dataset", "digits", "--lr", "1000000", "--steps", "150", "--max-seconds", "60")
    assert r.returncode == 1, r.stderr[-2000:]
    assert "diverged" in r.stderr and "loss ended at" in r.stderr and "--lr" in r.stderr


def test_an_lr_above_the_default_ceiling_still_trains_one_cohort():
    # the ranks' lr ceiling (10 by default, against a hostile leader) is raised to the run's own
    # lr: at --lr 11 the follower refused every round and the run ended "bit-identical: NO"
    r = simulate("--ranks", "2", "--dataset", "digits", "--lr", "11", "--steps", "30", "--max-seconds", "60", "--json")
    doc = json.loads(r.stdout)
    assert doc["bit_identical"] is True, (r.stdout[-1500:], r.stderr[-1500:])


def test_steps_is_an_exact_limit_in_process():
    # a new user's `simulate --steps 50` ran 128 steps (the limit was checked every 50 ms from
    # outside); the leader now knows it (docs/PROTOCOL-NOTES.md, note 13)
    r = simulate("--ranks", "3", "--dataset", "digits", "--steps", "50", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["steps"] == 50 and res["bit_identical"] is True, res


def test_the_output_says_each_rank_s_share_of_the_global_batch_and_its_measured_speed():
    # "Shares": a person sees why a rank got few samples (its measured samples/s), in the text
    # output and in the JSON document
    r = simulate("--ranks", "3", "--dataset", "synthetic", "--steps", "200", "--global-batch", "96")
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("last shares of the global batch"))
    parts = line.split(": ", 1)[1].split(", ")
    assert len(parts) == 3 and all("/s)" in p for p in parts), line
    assert sum(int(p.split()[1]) for p in parts) == 96, line
    r = simulate("--ranks", "3", "--dataset", "synthetic", "--steps", "200", "--global-batch", "96", "--json")
    res = json.loads(r.stdout)
    assert sum(res["shares"].values()) == 96 and len(res["speeds"]) == 3, res


def test_the_json_document_lists_a_rank_without_a_share_with_0():
    # (it listed only the ranks the last round gave samples: a rank left out was nowhere in it)
    r = simulate("--ranks", "3", "--dataset", "synthetic", "--steps", "30", "--global-batch", "2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert set(res["shares"]) == set(res["digests"]) and len(res["shares"]) == 3, res["shares"]
    assert sum(res["shares"].values()) == 2 and 0 in res["shares"].values(), res["shares"]


def test_a_run_that_ends_inside_its_partition_says_why_the_ranks_differ():
    # a new user's run of README's partition example ended "NO" with no word on why: the run
    # was over before the heal, and the side that paused never saw the last rounds
    r = simulate("--ranks", "4", "--dataset", "synthetic", "--partition-at", "20", "--heal-after-ms", "600000",
                 "--steps", "300")
    assert r.returncode == 1, (r.stdout[-1500:], r.stderr[-1500:])
    assert "bit-identical parameters on all 4 ranks: NO" in r.stdout, r.stdout[-1500:]
    assert "the run ended inside the partition" in r.stdout and "--steps" in r.stdout, r.stdout[-1500:]
    # the fault fires within a few steps of the one asked for (checked every 5 ms, not 50)
    step = int(re.search(r"\* step (\d+): partitioned", r.stdout).group(1))
    assert 20 <= step < 20 + 150, r.stdout[-1500:]


def test_a_run_that_ends_inside_its_partition_reports_the_leading_side_s_model():
    # a new user's run reported 41 % accuracy at "1500 steps": the first rank's model, on the
    # paused side at step 5, while the leading side's was at 97 %
    r = simulate("--ranks", "4", "--partition-at", "100", "--heal-after-ms", "600000", "--steps", "1500", "--json")
    res = json.loads(r.stdout)
    assert res["steps"] == 1500 and res["bit_identical"] is False, res
    assert res["accuracy"] >= 0.9, res


def test_a_lossy_run_ends_bit_identical_because_a_missed_final_publish_is_sent_again():
    # a new user's `--link-loss` runs ended "NO" now and then (3 of 7 seeds at 0.2): the final
    # publish was one broadcast, and link loss dropped it to a rank (PROTOCOL.md, "Publish")
    for seed in ("1", "2", "6"):
        r = simulate("--ranks", "4", "--link-loss", "0.2", "--steps", "300", "--seed", seed)
        assert r.returncode == 0 and "bit-identical parameters on all 4 ranks: yes" in r.stdout, r.stdout[-1500:]


@pytest.mark.parametrize("command,args,env,named", [
    # (each named something the user never typed: "rtc host address", "ice server", or the
    # top-level "see tabcohort --help" for a bad option of a command)
    ("serve", ["--rtc-hosts", "zzz.."], {}, "--rtc-hosts='zzz..'"),
    ("serve", ["--ice-servers", "http://x"], {}, "--ice-servers='http://x'"),
    ("rank", ["--server", "http://127.0.0.1:1", "--room", "d", "--ice-servers", "http://x"], {},
     "--ice-servers='http://x'"),
    ("rank", ["--server", "http://127.0.0.1:1", "--room", "d"], {"TABCOHORT_ICE_SERVERS": "http://x"},
     "TABCOHORT_ICE_SERVERS='http://x'"),
    ("serve", ["--bogus"], {}, "see tabcohort serve --help"),
    # (serve had no --eval-every: a slow evaluate() slowed the room with no way to space it out)
    ("serve", ["--eval-every", "-1"], {}, "--eval-every=-1"),
    ("serve", ["--max-auth-failures", "0"], {}, "--max-auth-failures=0"),
    ("serve", ["--eval-every", "0", "--target-accuracy", "0.9"], {}, "--target-accuracy=0.9: needs evaluations"),
])
def test_every_command_names_the_option_or_variable_it_refuses(command, args, env, named):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "client_py"), str(REPO / "server")]), **env)
    r = subprocess.run([sys.executable, "-m", "tabcohort", command, *args], capture_output=True, text=True,
                       timeout=60, env=e, cwd=REPO)
    assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_run_that_max_seconds_ends_early_says_so():
    # a new-user trial: `--max-seconds 1 --steps 100000` printed "done: 1108 steps", exit 0, and
    # nothing said --max-seconds ended it
    r = simulate("--ranks", "2", "--steps", "100000000", "--max-seconds", "1")
    assert r.returncode == 0 and "--max-seconds 1 ended the run before --steps 100000000" in r.stdout, r.stdout
    j = json.loads(simulate("--ranks", "2", "--steps", "100000000", "--max-seconds", "1", "--json").stdout)
    assert j["stopped_by"] == "max_seconds"
    assert json.loads(simulate("--ranks", "2", "--steps", "20", "--json").stdout)["stopped_by"] == "steps"


def test_max_seconds_bounds_a_flooded_run_and_a_run_with_no_step_is_not_a_success():
    # a new-user trial: --ranks 128 --max-seconds 10 ran 164 s (the event loop's queue full of
    # start-up beats; memory grew ~45 MB/s), then printed "done: 0 steps" and exited 0
    r = simulate("--ranks", "256", "--steps", "5", "--max-seconds", "0.5", "--json")
    doc = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert r.returncode == 1 and doc["ok"] is False and doc["steps"] == 0, (r.stdout, r.stderr[-1500:])
    assert doc["stopped_by"] == "max_seconds" and doc["seconds"] < 0.5 + 3.0, doc
    assert "no step was taken: --max-seconds 0.5" in doc["error"] and doc["loss"] is None, doc
    r = simulate("--ranks", "256", "--steps", "5", "--max-seconds", "0.5")
    assert r.returncode == 1 and "stopped: no step was taken" in r.stdout and "done:" not in r.stdout, r.stdout


def test_evaluate_json_prints_its_error_as_json():
    # (a new-user trial: evaluate --json printed nothing on stdout when it failed; simulate's did)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "client_py"), str(REPO / "server")]))
    r = subprocess.run([sys.executable, "-m", "tabcohort", "evaluate", "--model", "/nonexistent/m.npz", "--json"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    j = json.loads(r.stdout)
    assert r.returncode == 2 and j["ok"] is False and "--model" in j["error"], (r.stdout, r.stderr)


def test_one_rank_is_said_in_the_singular():
    # (it printed "tabcohort simulate: 1 ranks, ..." and "on all 1 ranks")
    r = simulate("--ranks", "1", "--dataset", "synthetic", "--steps", "5")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tabcohort simulate: 1 rank, dataset synthetic" in r.stdout, r.stdout
    assert "1 ranks" not in r.stdout and "bit-identical parameters on 1 rank: yes" in r.stdout, r.stdout


def test_a_loss_that_stays_run_away_stops_the_run_within_the_bound():
    # `--lr 1000 --steps 20000` showed a loss near 400 the whole way, ran to the end (10 s), and
    # only then said diverged; a served room stops after DIVERGED_AFTER_S (5 s): so does simulate
    import time
    t0 = time.monotonic()
    r = simulate("--ranks", "2", "--dataset", "digits", "--lr", "1000", "--steps", "10000000", "--max-seconds", "120")
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr[-2000:]
    assert "diverged" in r.stderr and "has stayed above" in r.stderr and "for 5 s" in r.stderr, r.stderr[-2000:]
    assert took < 60, took   # (not the 120 s --max-seconds)


def test_a_global_batch_larger_than_the_training_set_is_warned_of_by_simulate_and_serve(tmp_path):
    # a new-user trial: --global-batch 100000 over 1,600 samples (the page suggested "a larger
    # --global-batch") had honest ranks clipped and quarantined, with no word why
    r = simulate("--ranks", "2", "--steps", "5", "--global-batch", "5000")
    assert r.returncode == 0, r.stderr[-1500:]
    want = ("warning: the global batch 5000 is larger than the job's training set (1437 samples): every round "
            "covers it 3.5 times over")
    assert want in r.stdout and "quarantine honest ranks" in r.stdout, r.stdout[:1500]
    assert "warning: the global batch" not in simulate("--ranks", "2", "--steps", "5", "--global-batch", "1437").stdout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "client_py"), str(REPO / "server")]))
    with open(tmp_path / "serve.log", "wb") as log:
        p = subprocess.Popen([sys.executable, "-m", "tabcohort", "serve", "--port", "0", "--global-batch", "5000",
                              "--operator-token=operator-token-for-tests-0123"], stdout=log, stderr=subprocess.STDOUT,
                             env=env, cwd=REPO)
        try:
            from .conftest import wait_for
            def listening() -> str | None:
                t = (tmp_path / "serve.log").read_text()
                return t if "\nURL " in t or p.poll() is not None else None
            out = wait_for(listening, 60, "serve to listen")
        finally:
            p.terminate()
            p.wait(10)
    assert "  " + want in out, out


def test_a_job_that_prints_leaves_json_output_one_document(tmp_path):
    # a new-user trial: a job with print() in grads() made `simulate --json`'s stdout unreadable;
    # its prints go to stderr under --json (Python's and the C level's alike)
    job = tmp_path / "printer.py"
    from ..unit.test_jobs import JOB                       # (a pure-Python job of 3 parameters)
    printer = JOB.replace("    def grads(self, offset, samples):\n",
                          "    def grads(self, offset, samples):\n"
                          "        print('grads called', offset, samples)\n"
                          "        __import__('os').write(1, b'and at the C level\\n')\n")
    assert printer != JOB
    job.write_text(printer)
    r = simulate("--job", str(job), "--ranks", "2", "--steps", "5", "--json")
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["steps"] == 5, doc
    assert "grads called" in r.stderr and "and at the C level" in r.stderr


def test_a_global_batch_smaller_than_the_cohort_says_some_ranks_get_no_share():
    # a new-user trial: --global-batch 2 --ranks 4 ran with idle ranks and nothing said so
    r = simulate("--ranks", "4", "--global-batch", "2", "--steps", "5", "--max-seconds", "60")
    assert r.returncode == 0, r.stderr
    assert "so at least 2 ranks get no share in a round" in r.stdout, r.stdout
    r = simulate("--ranks", "2", "--global-batch", "2", "--steps", "5", "--max-seconds", "60")
    assert r.returncode == 0 and "get no share" not in r.stdout, r.stdout
