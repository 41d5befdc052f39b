"""A leader's checkpoint upload (tabcohort.runtime.session.checkpoint_upload) waits for its link:
a server that restarted knows the rank only once the link has resumed (README "Checkpoints")."""

from __future__ import annotations

from types import SimpleNamespace

from tabcohort.model.toy import ToyWorker
from tabcohort.runtime.session import checkpoint_upload

from .machine_helpers import rig


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
