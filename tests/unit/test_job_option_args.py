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


def test_a_built_in_job_option_with_job_is_refused_even_when_it_names_the_default(capsys):
    # ``--dataset digits`` is the default: it was accepted with ``--job`` and then ignored
    for flag, value in (("--dataset", "digits"), ("--hidden", "32"), ("--activation", "relu")):
        rc = main(["simulate", "--job", "any_job.py", flag, value, "--steps", "1"])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert f"{flag}={value!r}" in err and "a module job (--job) brings its own model and data" in err, err


def test_an_abbreviated_option_is_refused_not_guessed(capsys):
    try:
        rc = main(["simulate", "--global", "64", "--steps", "1"])
    except SystemExit as e:   # (argparse's exit)
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "unrecognized arguments: --global" in err and "configuration error" in err, err


def test_a_value_argparse_refuses_is_said_in_the_form_every_other_bad_setting_has(capsys):
    # "tabcohort simulate: configuration error: argument --ranks: invalid int value: 'abc'" read
    # differently from --ranks=0's "tabcohort: configuration error: --ranks=0: ..." (a new-user trial)
    for argv, said in ((["simulate", "--ranks", "abc"], "--ranks='abc': invalid int value (see tabcohort simulate --help)"),
                       (["serve", "--port", "x1"], "--port='x1': invalid int value (see tabcohort serve --help)"),
                       (["simulate", "--ranks"], "--ranks: expected one argument"),
                       # (a type's own message names the option once: "--hidden: --hidden='0': ...")
                       (["simulate", "--hidden", "0"], "--hidden='0': layer widths must be positive integers (see "),
                       (["bogus"], "COMMAND='bogus': invalid choice (choose from ")):
        try:
            rc = main(argv)
        except SystemExit as e:   # (argparse's exit)
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith(f"tabcohort: configuration error: {said}"), err
