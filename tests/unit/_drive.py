"""Drive a coroutine without an event loop (the Pyodide + Node tier cannot run one).

``asyncio.sleep(0)`` yields a bare ``None`` to whoever drives the coroutine, so sending ``None``
until ``StopIteration`` runs it to completion; the number of sends proves where it yielded.
"""

from __future__ import annotations

from typing import Any, Coroutine


def drive(coro: Coroutine[Any, Any, Any], *, max_yields: int = 1_000_000) -> tuple[Any, int]:
    """Run ``coro`` to completion by hand.

    Returns:
        ``(result, n_yields)``: the coroutine's return value and how often it yielded.

    Raises:
        AssertionError: the coroutine yielded something other than ``None`` (it awaited a real
            future, which needs a loop) or more than ``max_yields`` times.
    """
    n = 0
    try:
        while True:
            out = coro.send(None)
            if out is not None:
                coro.close()
                raise AssertionError(f"coroutine awaited {out!r}; only sleep(0) yields are "
                                     "drivable without a loop")
            n += 1
            if n > max_yields:
                coro.close()
                raise AssertionError(f"coroutine yielded more than {max_yields} times")
    except StopIteration as done:
        return done.value, n
