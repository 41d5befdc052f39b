"""The tab worker's inbox conflation (``tcConflate`` in web/rank-worker.js; PROTOCOL.md,
"Follower: receiving messages", superseded rounds), run in Node on chunks the Python wire
writes: a take that holds several complete rounds of one sender keeps only the newest."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import sys

import pytest

if sys.platform == "emscripten":
    pytest.skip("the worker's JS runs natively under Node (Pyodide has no subprocesses)", allow_module_level=True)

from tabcohort.wire import FrameWriter  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]

RUN = """
globalThis.self = globalThis;
self.postMessage = () => {};
await import(process.argv[1]);
const items = JSON.parse(require_stdin()).map((d) => d.hex === undefined ? d
  : { ...d, data: Uint8Array.from(Buffer.from(d.hex, "hex")).buffer });
const out = self.tcConflate(items).map((d) => d.data ? { ...d, data: undefined, n: d.data.byteLength,
  head: Buffer.from(d.data).subarray(0, 30).toString("hex") } : d);
console.log(JSON.stringify(out));
function require_stdin() { return require("fs").readFileSync(0, "utf8"); }
"""


def node() -> str:
    exe = shutil.which("node")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("node is not installed (scripts/install-test.sh installs it)")
        pytest.skip("node is not installed")
    return exe


def conflate(items: list[dict]) -> list[dict]:
    src = "import { createRequire } from 'module'; const require = createRequire(import.meta.url);\n" + RUN
    r = subprocess.run([node(), "--input-type=module", "-e", src, (ROOT / "web" / "rank-worker.js").as_uri()],
                       input=json.dumps(items), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def rnd(step: int) -> dict:
    return {"t": "round", "step": step, "term": 1, "lr": 0.1, "loss": 0.5, "samples": 8, "cohort": 2,
            "cursor": 0, "assign": {7: 0}, "shares": {7: 8}, "params": [0.25] * 300}


def chunks(w: FrameWriter, msg: dict, link: int = 1) -> list[dict]:
    return [{"k": "ws-chunk", "link": link, "hex": bytes(c).hex()} for c in w.write(msg)]


def test_older_complete_rounds_of_a_sender_are_dropped_and_summarised():
    lead = FrameWriter(5, max_message_bytes=512)      # several chunks per round
    other = FrameWriter(9, max_message_bytes=512)
    beat = {"t": "beat", "batch": 8, "ready": True, "running": True, "step": 1, "backend": "py", "term": 1}
    r1, r2, r3 = chunks(lead, rnd(1)), chunks(lead, rnd(2)), chunks(lead, rnd(3))
    b = chunks(lead, beat)
    o1 = chunks(other, rnd(1))
    partial = chunks(lead, rnd(4))[:-1]               # the newest round, not complete in this take
    items = r1 + b + o1 + r2 + [{"k": "ws-text", "link": 1, "text": "{}"}] + r3 + partial
    out = conflate(items)
    kept = [d for d in out if d["k"] != "conflated"]
    summary = [d for d in out if d["k"] == "conflated"]
    # rounds 1 and 2 of sender 5 dropped; its round 3 (newest complete), the beat, sender 9's
    # only round, the text and the incomplete round 4 are kept, in order
    assert len(kept) == len(b) + len(o1) + 1 + len(r3) + len(partial)
    assert [d["k"] for d in kept[:len(b)]] == ["ws-chunk"] * len(b)
    assert summary == [{"k": "conflated", "via": "ws-chunk", "link": 1, "sender": 5, "frames": 2,
                        "chunks": len(r1) + len(r2),
                        "bytes": sum(len(bytes.fromhex(d["hex"])) for d in r1 + r2)}]


def test_a_take_with_one_round_per_sender_is_unchanged():
    lead = FrameWriter(5)
    items = chunks(lead, rnd(1)) + chunks(FrameWriter(6), rnd(1)) + chunks(lead, rnd(2), link=2)
    out = conflate(items)
    assert [d["k"] for d in out] == ["ws-chunk"] * len(items)      # different links: separate lanes
