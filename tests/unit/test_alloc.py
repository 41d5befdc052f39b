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

# a rank's round trip of 1M float32 through the wire, 40 times, a few vectors alive at once, with
# the frame body also joined whole (``encode_body``: 4 MB of bytes made and dropped per round);
# prints the minor page faults it took
_ROUNDS = textwrap.dedent("""
    import resource, sys
    from array import array
    from tabcohort._alloc import hold_allocator
    from tabcohort.wire import FrameReader, FrameWriter
    held = hold_allocator()
    x = array("f", [0.25] * 1_000_000)
    w, r = FrameWriter(7, max_message_bytes=1 << 20), FrameReader()
    def cycle():
        out = []
        msg = {"t": "grad", "step": 3, "term": 1, "loss": 0.5, "samples": 8, "g": x}
        body = w.encode_body(msg)
        for c in w.write(msg):
            out += r.feed(c, now_ms=0.0)
        return out[0]["g"]
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
    # (seen here: 10,431 page faults with glibc's defaults, 976 held, over 40 round trips of 4 MB frames)
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
