"""tabcohort._alloc: a native rank holds frame-sized buffers in glibc's heap (the allocator
setting ``tabcohort rank``, ``serve``, ``simulate`` and the process group make at start)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tabcohort._alloc import hold_allocator
from tabcohort.errors import ConfigError

# a native rank's round of frame-sized buffers, 40 times, a few alive at once: the 1 MiB chunks
# of a 4 MB frame as they are read, the body they are joined into, a float64 temporary of the
# reduce (the sizes glibc's dynamic mmap threshold does not settle on); prints the minor page
# faults it took. (The wire's own round trip no longer makes enough such temporaries to show it:
# FrameWriter copies a vector once, into its chunks.)
_ROUNDS = textwrap.dedent("""
    import resource
    from tabcohort._alloc import hold_allocator
    held = hold_allocator()
    def cycle():
        chunks = [bytearray(1 << 20) for _ in range(4)]
        body = b"".join(chunks)
        reduce_tmp = bytearray(8 << 20)
        return body
    keep = [cycle() for _ in range(3)]
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(40):
        keep[i % 3] = cycle()
    print(held, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
""")


def test_a_bad_setting_names_the_variable():
    with pytest.raises(ConfigError) as e:
        hold_allocator({"TABCOHORT_MALLOC_HOLD": "yes"})
    assert "TABCOHORT_MALLOC_HOLD" in str(e.value) and "'yes'" in str(e.value)


def test_zero_keeps_the_defaults():
    assert hold_allocator({"TABCOHORT_MALLOC_HOLD": "0"}) is False


def test_held_buffers_are_reused_instead_of_faulted_in_again():
    if sys.platform == "emscripten":
        pytest.skip("glibc's allocator: native tiers only")
    faults = {}
    for value in ("0", "1"):
        env = {**os.environ, "TABCOHORT_MALLOC_HOLD": value}
        out = subprocess.run([sys.executable, "-c", _ROUNDS], env=env, capture_output=True, text=True,
                             timeout=120, check=True).stdout.split()
        faults[value] = (out[0], int(out[1]))
    assert faults["0"][0] == "False" and faults["1"][0] == "True", faults
    # (seen here: 18,304 page faults with glibc's defaults, 2,048 held, numpy or not)
    assert faults["1"][1] < 0.8 * faults["0"][1], faults


def test_the_cli_names_a_bad_setting_before_any_network_activity():
    if sys.platform == "emscripten":
        pytest.skip("glibc's allocator: native tiers only")
    env = {**os.environ, "TABCOHORT_MALLOC_HOLD": "2"}
    r = subprocess.run([sys.executable, "-m", "tabcohort", "rank", "--server", "http://127.0.0.1:9",
                        "--room", "digits"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "configuration error: TABCOHORT_MALLOC_HOLD='2'" in r.stderr, r.stderr
    assert "127.0.0.1:9" not in r.stderr, r.stderr   # (refused before it tried the server)
