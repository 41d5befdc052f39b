"""``--job-option NAME=VALUE`` on serve, simulate and evaluate (README "Write your own job"): a
NAME given twice is a configuration error naming it and both values (the last one won, unsaid:
a new-user trial)."""

from __future__ import annotations

from tabcohort.cli import main


def test_a_job_option_given_twice_is_refused_naming_both_values(capsys):
    rc = main(["simulate", "--job", "any_job.py", "--job-option", "hidden=3",   # (checked before it is read)
               "--job-option", "hidden=5", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "--job-option='hidden=5': hidden is given twice (first hidden=3): give each option once" in err, err
