"""The container tier: build the image and run the docker-compose demo for real (tests/container/run.sh).

Opt-in (it installs Debian packages, may start dockerd and builds an image: minutes, needs root):

    TABCOHORT_CONTAINER=1 python -m pytest tests/container -s

CI can equally run ``bash tests/container/run.sh`` directly; this wrapper only makes the tier
visible to pytest and checks the harness's verdict line.
"""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

HERE = pathlib.Path(__file__).resolve().parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.skipif(os.environ.get("TABCOHORT_CONTAINER") != "1",
                       reason="container tier is opt-in: TABCOHORT_CONTAINER=1 (root, minutes)"),
]


@pytest.mark.timeout(3600)
def test_image_builds_and_compose_demo_trains() -> None:
    r = subprocess.run(["bash", str(HERE / "run.sh")], capture_output=True, text=True, timeout=3500)
    print(r.stdout[-6000:])
    print(r.stderr[-3000:])
    assert r.returncode == 0, f"tests/container/run.sh exited {r.returncode}"
    assert "container: OK" in r.stdout
    assert "image size:" in r.stdout
