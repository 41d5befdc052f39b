"""``python -m tabcohort`` and the ``tabcohort`` console script (:func:`run`)."""

import sys


def run() -> int:
    """Import the command line and run it. A Ctrl-C while the modules load (the first second of
    any command: aiohttp, numpy) ends with one line and exit code 130, as one later does, not a
    traceback of the import machinery (a new-user trial)."""
    try:
        from .cli import main
    except KeyboardInterrupt:
        print("tabcohort: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(run())
