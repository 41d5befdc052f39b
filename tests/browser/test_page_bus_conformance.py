"""The bus conformance battery (tests/conformance/test_bus_conformance.py, every case; the pressure
case at two precisions, PRESSURE_CASES) against the
browser buses in a real Chromium page's worker, through the page's own WebSocket and
RTCPeerConnections (web/app.js), against a real tabcohort server: ``page-ws-star``
(:func:`~tabcohort.bus.page.page_star_bus`), ``page-rtc-star``
(``page_star_bus(link="rtc")``: a page-owned data channel to the server,
which ends it with aiortc) and ``page-rtc-mesh``
(:func:`~tabcohort.bus.page.page_mesh_bus`; after each case, every link between open buses
must be a data channel that carried bytes, none on the relay). One server and one page for the
module (Pyodide boots once); fresh buses per case. See page_harness.py."""

from __future__ import annotations

import pytest

from tests.conformance.test_bus_conformance import *  # noqa: F401,F403  (the battery's cases run here)

from .conftest import Tab
from .page_harness import ConfServer, PageHarness, PageSession

pytestmark = pytest.mark.browser

KINDS = {"page-ws-star": "star", "page-rtc-star": "rtc-star", "page-rtc-mesh": "mesh"}
PRECISIONS = ["f32", "f16", "bf16", "int8"]
#: the data-channel kinds again with receivers that take 16 KiB messages (SDPs rewritten by the
#: server; the star's relay re-cuts every large frame), at two precisions to bound the tier's time
SMALL = {"page-rtc-star-16k": "rtc-star", "page-rtc-mesh-16k": "mesh"}
CASES = [(k, p) for k in KINDS for p in PRECISIONS] + [(k, p) for k in SMALL for p in ("f32", "int8")]


@pytest.fixture(scope="module")
def page_session(browser):
    server = ConfServer()
    tab = Tab(browser, server.url, "?room=star&mode=conformance&rtc-loopback=1&numpy=off&autostart=0")
    try:
        yield PageSession(tab, server)
        assert not tab.console_errors, tab.console_errors
    finally:
        tab.close()
        server.close()


@pytest.fixture(params=CASES, ids=lambda kp: f"{kp[0]}-{kp[1]}")
def harness(request, page_session):
    name, precision = request.param
    small = 16384 if name in SMALL else None
    h = PageHarness(page_session, KINDS.get(name) or SMALL[name], precision, small_message_bytes=small)
    yield h
    h.close()


_battery_pressure = test_pressure_rises_when_a_receiver_stalls_and_falls_when_it_drains  # noqa: F405
#: pressure counts bytes queued, whatever the precision encoded them: in the page the pressure case
#: runs at the widest and the narrowest frames (f32, int8; the native battery at all four). Its
#: f16 and bf16 cases cost the browser tier 53 s of a worker's time (each post encodes 40,000
#: values in Pyodide's pure Python), and the other cases of the page battery run at all four
PRESSURE_CASES = [(k, p) for k, p in CASES if p in ("f32", "int8")]


@pytest.mark.parametrize("harness", PRESSURE_CASES, indirect=True, ids=lambda kp: f"{kp[0]}-{kp[1]}")
def test_pressure_rises_when_a_receiver_stalls_and_falls_when_it_drains(harness):
    _battery_pressure(harness)
