"""The aiohttp app through ``aiohttp_client``: endpoints, ids, spoofing, bad input, slow consumers,
tokens."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket

import aiohttp
import pytest
import pytest_asyncio

from tabcohort.jobs import shipped_source
from tabcohort.wire import FrameWriter
from tabcohort_server import JobConfig, ServerConfig, ServerLimits, create_app
from tabcohort_server.app import ROOMS

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


TOKEN = "room-token-0123456789"


def beat() -> dict:
    return {"t": "beat", "batch": 4, "ready": True, "running": True, "term": 1, "step": 1, "backend": "py"}


@pytest_asyncio.fixture
async def client(aiohttp_client):
    cfg = ServerConfig(rooms={"r": JobConfig(dataset="synthetic"), "t": JobConfig(dataset="synthetic", token=TOKEN)},
                       limits=ServerLimits(queue_high_water_bytes=64 << 10, queue_max_bytes=256 << 10,
                                           write_stall_s=3.0,   # (a test sender may send at loopback speed)
                                           sender_max_msgs_per_s=50_000, sender_max_bytes_per_s=1 << 30,
                                           contributor_max_bytes_per_s=1 << 30))
    return await aiohttp_client(create_app(cfg))


async def join(client, room="r", *, close_timeout_s=10.0, **reg):
    ws = await client.ws_connect(f"/api/rooms/{room}/ws", timeout=aiohttp.ClientWSTimeout(ws_close=close_timeout_s))
    await ws.send_str(json.dumps({"type": "register", **reg}))
    msg = await ws.receive()
    if msg.type != aiohttp.WSMsgType.TEXT:
        return ws, None
    return ws, json.loads(msg.data)


async def next_binary(ws, timeout=5.0) -> bytes:
    while True:
        msg = await ws.receive(timeout)
        if msg.type == aiohttp.WSMsgType.BINARY:
            return msg.data
        assert msg.type == aiohttp.WSMsgType.TEXT, msg


async def test_job_dataset_health_metrics(client):
    assert (await (await client.get("/healthz")).json())["ok"]
    job = await (await client.get("/api/rooms/r/job")).json()
    assert job["topology"] == "star" and job["link"] == "ws" and job["bucket_len"] > 0 and "token" not in job
    # the built-in MLP is a job like any other: its code bundle and data are served with their hashes
    info = job["job_info"]
    code = await (await client.get("/api/rooms/r/job/code")).read()
    data = await (await client.get("/api/rooms/r/job/data")).read()
    assert hashlib.sha256(code).hexdigest() == info["code_sha256"] == shipped_source(info["code_sha256"]).code_sha256
    assert hashlib.sha256(data).hexdigest() == info["data_sha256"] == job["dataset_info"]["sha256"]
    assert info["builtin"] and info["options"]["dataset"] == "synthetic" and "webgpu" in info["accepts"], info
    assert (await client.get("/api/rooms/r/dataset")).status == 404   # (it was the built-in job's own route)
    assert (await client.get("/api/rooms/nope/job")).status == 404
    assert (await client.get("/api/rooms/r/checkpoint")).status == 404
    text = await (await client.get("/metrics")).text()
    for name in ("tabcohort_rooms", "tabcohort_ranks{", "tabcohort_step{", "tabcohort_frames_relayed_total",
                 "tabcohort_bytes_relayed_total", "tabcohort_ranks_quarantined{", "tabcohort_ranks_silent{",
                 "tabcohort_buckets_clipped{"):
        assert name in text


async def test_ids_assigned_and_spoofed_from_dropped_and_counted(client):
    (a, wa), (b, wb) = await join(client), await join(client)
    assert wa["id"] != wb["id"] and wb["peers"] == [wa["id"]]
    a_chunk = FrameWriter(wa["id"]).write(beat())[0]
    await b.send_bytes(a_chunk)                       # b claims to be a
    await a.send_bytes(a_chunk)                       # a is a
    assert await next_binary(b) == a_chunk
    room = client.app[ROOMS].get("r")
    assert room.drops.get("spoofed") == 1
    assert 'reason="spoofed"' in await (await client.get("/metrics")).text()
    st = await (await client.get("/api/rooms/r")).json()
    assert {r["id"] for r in st["ranks"]} == {wa["id"], wb["id"]}
    await a.close()
    await b.close()


async def test_malformed_oversize_and_invalid_utf8_are_survived(client):
    (a, wa), (b, wb) = await join(client), await join(client)
    await a.send_bytes(b"\x07" * 30)                  # bad version: dropped, link stays
    await a.send_str("{not json")                     # bad control: counted, link stays
    ok = FrameWriter(wa["id"]).write(beat())[0]
    await a.send_bytes(ok)
    assert await next_binary(b) == ok
    room = client.app[ROOMS].get("r")
    assert room.drops["bad_version"] == 1 and room.drops["bad_json"] == 1
    big, _ = await join(client)
    await big.send_bytes(b"\x01" * (client.app[ROOMS].get("r").limits.max_ws_message_bytes + 10))
    assert (await big.receive(5)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    bad, _ = await join(client)
    await bad._writer.send_frame(b"\xff\xfe", aiohttp.WSMsgType.TEXT)  # invalid UTF-8 text frame
    while (m := await bad.receive(5)).type == aiohttp.WSMsgType.TEXT:
        pass
    assert m.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    await a.send_bytes(ok)                            # the others still relay
    assert await next_binary(b) == ok
    assert (await client.get("/healthz")).status == 200
    await a.close()
    await b.close()


async def test_black_holed_consumer_is_dropped_without_blocking_the_others(client):
    # (the hole's own close() gets no answer from a server that dropped it: a short wait)
    (a, wa), (good, wg), (hole, wh) = await join(client), await join(client), await join(client, close_timeout_s=1.0)
    # the black hole's kernel receive buffer kept small: the server's writes to it block after
    # kilobytes, not after the megabytes loopback autotuning allows (which a loaded host took
    # longer than the bound to push through the relay)
    hole.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    got = 0

    async def read_good() -> None:
        nonlocal got
        async for m in good:
            if m.type == aiohttp.WSMsgType.BINARY:
                got += 1
    reader = asyncio.create_task(read_good())
    w = FrameWriter(wa["id"], max_message_bytes=65536)
    chunk = w.write({"t": "grad", "term": 1, "step": 1, "loss": 0.1, "samples": 1, "g": [0.5] * 16000})[0]
    room = client.app[ROOMS].get("r")
    sent = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + 60
    while room.drops.get("slow_consumer", 0) == 0:
        assert loop.time() < end, "the black-holed consumer was never dropped"
        await a.send_bytes(chunk)
        sent += 1
        await asyncio.sleep(0)
    assert wh["id"] not in room.connected and wg["id"] in room.connected
    end = loop.time() + 10
    while got < sent:  # the good consumer gets everything, unblocked
        assert loop.time() < end, f"good consumer got {got}/{sent}"
        await asyncio.sleep(0.01)
    reader.cancel()
    for ws in (a, good, hole):
        await ws.close()


async def test_wrong_token_is_refused_with_a_clear_reason(client):
    ws, welcome = await join(client, "t", token="nope")
    assert welcome is None and ws.close_code == 4001
    ws2, welcome2 = await join(client, "t", token=TOKEN)
    assert welcome2["type"] == "welcome"
    assert (await client.get("/api/rooms/t/job")).status == 403
    assert (await client.get(f"/api/rooms/t/job?token={TOKEN}")).status == 200
    await ws2.close()


async def test_the_relay_socket_refuses_per_message_compression(client):
    """A browser offers permessage-deflate (RFC 7692) on every WebSocket; the relay declines it,
    so no chunk to or from a tab goes through zlib (float vectors barely deflate)."""
    ws = await client.ws_connect("/api/rooms/r/ws", compress=15)
    try:
        assert ws.compress == 0, "the relay accepted permessage-deflate"
        await ws.send_str(json.dumps({"type": "register"}))
        assert json.loads((await ws.receive(5)).data)["type"] == "welcome"
    finally:
        await ws.close()


def test_serve_says_at_start_when_the_page_would_load_pyodide_from_the_cdn_or_lack_its_charts(tmp_path, monkeypatch):
    # a new-user trial offline: without node_modules a tab only said "boot failed: Failed to fetch
    # ... cdn.jsdelivr.net/pyodide/..." and the charts stayed blank; serve said nothing at start
    from tabcohort_server import static

    monkeypatch.delenv("TABCOHORT_PYODIDE_DIR", raising=False)
    assert static.missing_page_assets() is None                    # this checkout has both (npm ci)
    monkeypatch.setattr(static, "NODE_MODULES", tmp_path)
    said = static.missing_page_assets()
    assert said and "no local Pyodide" in said and "cdn.jsdelivr.net" in said and "uPlot" in said
    assert "npm ci" in said
