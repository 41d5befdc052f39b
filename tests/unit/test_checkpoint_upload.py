"""A leader's checkpoint upload (tabcohort.runtime.session.checkpoint_upload) waits for its link:
a server that restarted knows the rank only once the link has resumed; and it carries the held-out
accuracy of the parameters it stores, never an older step's (README "Checkpoints and stopping")."""

from __future__ import annotations

from types import SimpleNamespace

from tabcohort.model.toy import ToyWorker
from tabcohort.runtime.session import checkpoint_upload, params_bytes, upload_headers

from .machine_helpers import rig, round_msg


def test_a_periodic_upload_waits_for_the_link_and_the_final_one_is_tried_anyway():
    r = rig(1, ready=True)
    w = ToyWorker(bucket_len=4, batch=2)
    said: list[str] = []
    bus = SimpleNamespace(id=1, secret="s", connected=False)
    assert checkpoint_upload(r.m, w, bus, said.append, final=False) is None
    final = checkpoint_upload(r.m, w, bus, said.append, final=True)
    assert final is not None and final[1]["X-Tabcohort-Final"] == "1"
    bus.connected = True
    up = checkpoint_upload(r.m, w, bus, said.append, final=False)
    assert up is not None and len(up[0]) == 16 and up[1]["X-Tabcohort-Rank"] == "1"
    assert said == []


def _lead_to(r, step):
    """The single-rank leader of rig ``r`` driven to ``step`` (one round per step)."""
    t = r.m.next_deadline_ms() or 0.0
    if not r.m.looping:
        r.m.start(now_ms=t)
    for _ in range(100):
        if r.m.step >= step:
            return
        computes = r.computes(r.drain())
        for c in computes:
            r.m.bucket_ready(c.token, *r.w.grads_sync(c.offset), now_ms=t)
        if not computes:
            t = max(t + 1, r.m.next_deadline_ms() or 0.0)
            r.m.on_timer(now_ms=t)
    raise AssertionError(f"the leader did not reach step {step}: step {r.m.step}")


def _evaluating(r):
    """``r``'s worker evaluates to a different accuracy at every call; the parameters of each
    call are recorded."""
    seen = []

    def evaluate():
        seen.append(bytes(params_bytes(r.w.params())))
        return len(seen) / 100
    r.w.evaluate = evaluate
    return seen


def test_an_upload_sends_no_accuracy_of_an_older_step():
    """The leader evaluates every ``eval_every`` steps; a checkpoint of a later step labelled
    with that accuracy was ranked "best" by another model's (README "Checkpoints and stopping")."""
    r = rig(1, ready=True, eval_every=2)
    seen = _evaluating(r)
    _lead_to(r, 3)
    assert len(seen) == 1 and r.m.accuracy == 0.01 and r.m.step == 3    # (evaluated at step 2)
    bus = SimpleNamespace(id=1, secret="s", connected=True)
    h = upload_headers(r.m, bus, "d" * 64, final=False)
    assert h["X-Tabcohort-Step"] == "3" and "X-Tabcohort-Accuracy" not in h, h
    _lead_to(r, 4)                                   # an evaluation step: its own accuracy
    assert upload_headers(r.m, bus, "d" * 64, final=False)["X-Tabcohort-Accuracy"] == repr(0.02)


def test_an_upload_evaluates_the_parameters_it_stores_once():
    """Every checkpoint carries the accuracy of the very bytes it stores, evaluated at upload
    unless their step was evaluated already; none in a room that never evaluates."""
    r = rig(1, ready=True, eval_every=10)
    seen = _evaluating(r)
    _lead_to(r, 3)
    assert seen == []
    bus = SimpleNamespace(id=1, secret="s", connected=True)
    data, h = checkpoint_upload(r.m, r.w, bus, [].append, final=False)
    assert seen == [data] and h["X-Tabcohort-Step"] == "3" and h["X-Tabcohort-Accuracy"] == repr(0.01)
    data, h = checkpoint_upload(r.m, r.w, bus, [].append, final=True)   # the same step: not again
    assert seen == [data] and h["X-Tabcohort-Accuracy"] == repr(0.01)
    # a room that never evaluates (--eval-every 0) stores no accuracy, and evaluates nothing
    quiet = rig(1, ready=True, eval_every=0)
    quiet_seen = _evaluating(quiet)
    _lead_to(quiet, 2)
    assert "X-Tabcohort-Accuracy" not in checkpoint_upload(quiet.m, quiet.w, bus, [].append, final=True)[1]
    assert quiet_seen == []


def test_adopted_parameters_are_not_labelled_with_the_accuracy_of_the_ones_before():
    """A rank's accuracy at (term, step) is of its own parameters; another leader's round at
    the same term and step (two that took over at once: PROTOCOL.md "Lineage and terms") replaces them."""
    r = rig(5, ready=True, eval_every=10)
    _evaluating(r)
    r.m.handle(round_msg(2, 0, params=[0.5] * 4, term=0), now_ms=1)
    r.m.evaluate_now()
    assert r.m.accuracy_now == 0.01
    r.m.handle(round_msg(1, 0, params=[0.75] * 4, term=0), now_ms=2)   # (the lower id wins the term)
    assert list(r.w.params()) == [0.75] * 4 and r.m.accuracy == 0.01 and r.m.accuracy_now is None
