"""The bus conformance battery runs once per (harness, precision); see bus_harness.py."""

from __future__ import annotations

import sys

import pytest

from .bus_harness import BusHarness, MemoryHarness


def _ws_available() -> bool:
    """The WebSocket star harness needs aiohttp and the server package (native tiers only)."""
    import pathlib
    import sys

    if sys.platform == "emscripten":
        return False
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return False
    try:
        import tabcohort_server  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "server"))
        try:
            import tabcohort_server  # noqa: F401
        except ImportError:
            return False
    return True

#: name -> factory(precision) of every transport that must pass the battery.
HARNESSES = {
    "memory": lambda p: MemoryHarness(p),
    "memory-delayed-chunked": lambda p: MemoryHarness(p, max_message_bytes=1024, delay_ms=5.0,
                                                      jitter_ms=0.0),
}
if _ws_available():
    from .ws_harness import WsHarness

    HARNESSES["ws-star"] = lambda p: WsHarness(p)
    HARNESSES["ws-star-chunked"] = lambda p: WsHarness(p, max_message_bytes=1024)
    from .direct_harness import DirectHarness

    HARNESSES["tcp-direct"] = lambda p: DirectHarness(p)
    try:
        import aiortc  # noqa: F401
    except ImportError:
        pass
    else:
        from .rtc_harness import RtcMeshHarness, RtcStarHarness

        HARNESSES["rtc-mesh"] = lambda p: RtcMeshHarness(p)
        HARNESSES["rtc-star"] = lambda p: RtcStarHarness(p)
        # receivers whose channels take 16 KiB messages (RFC 8841 a=max-message-size)
        HARNESSES["rtc-mesh-16k"] = lambda p: RtcMeshHarness(p, small_message_bytes=16384)
        HARNESSES["rtc-star-16k"] = lambda p: RtcStarHarness(p, small_message_bytes=16384)
if sys.platform != "emscripten":
    from .tcp_harness import TcpHarness

    HARNESSES["tcp"] = lambda p: TcpHarness(p)
    HARNESSES["tcp-chunked"] = lambda p: TcpHarness(p, max_message_bytes=1024)
PRECISIONS = ["f32", "f16", "bf16", "int8"]


@pytest.fixture(params=[(h, p) for h in HARNESSES for p in PRECISIONS], ids=lambda hp: f"{hp[0]}-{hp[1]}")
def harness(request) -> BusHarness:
    name, precision = request.param
    h = HARNESSES[name](precision)
    yield h
    h.close()
