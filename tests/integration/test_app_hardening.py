"""The app under attack through real sockets (``aiohttp_client`` and a real listening site): roles
(operator token vs room token), Origin checks, failed-auth limits, per-room data behind tokens,
malformed reports, deep JSON, checkpoint uploads checked before reading, the dataset compressed
once, seats and connections per address, slowloris."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import pytest
import pytest_asyncio

from tabcohort.wire import FrameWriter
from tabcohort_server import JobConfig, ServerConfig, ServerLimits, create_app
from tabcohort_server.app import ASSETS, REFUSED, ROOMS
from tabcohort_server.serve import start_site

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

OP = "operator-token-0123456789"
TOKEN = "room-token-0123456789"
TRAINER = "trainer-token-0123456789"


def config(**lim) -> ServerConfig:
    return ServerConfig(rooms={"r": JobConfig(dataset="synthetic", steps=40),
                               "t": JobConfig(dataset="synthetic", token=TOKEN)},
                        operator_token=OP, trainer_token=TRAINER, allowed_origins=("https://lab.example.org",),
                        limits=ServerLimits(**lim))


@pytest_asyncio.fixture
async def client(aiohttp_client):
    return await aiohttp_client(create_app(config(max_auth_failures=5, max_ranks_per_address=4)))


def bearer(tok: str) -> dict:
    return {"Authorization": f"Bearer {tok}"}


async def join(client, room="r", headers=None, **reg):
    ws = await client.ws_connect(f"/api/rooms/{room}/ws", headers=headers or {})
    await ws.send_str(json.dumps({"type": "register", **reg}))
    msg = await ws.receive(5)
    return ws, (json.loads(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else None)


async def test_only_the_operator_token_stops_a_room(client):
    assert (await client.post("/api/rooms/r/stop")).status == 403           # open room, no token
    assert (await client.post("/api/rooms/t/stop", headers=bearer(TOKEN))).status == 403  # the join token
    assert (await client.post(f"/api/rooms/t/stop?token={TOKEN}")).status == 403
    assert not client.app[ROOMS].get("t").stopped
    r = await client.post("/api/rooms/t/stop", headers=bearer(OP))
    assert r.status == 200 and client.app[ROOMS].get("t").stopped
    assert client.app[REFUSED]["auth_failed"] == 3


@pytest.mark.parametrize("origin,ok", [(None, True), ("https://evil.example", False), ("null", False),
                                       ("https://lab.example.org", True), ("SAME", True)])
async def test_state_changes_and_websockets_need_an_allowed_origin(client, origin, ok):
    host = f"{client.server.host}:{client.server.port}"
    hdr = {} if origin is None else {"Origin": f"http://{host}" if origin == "SAME" else origin}
    r = await client.post("/api/rooms/r/stop", headers={**hdr, **bearer(OP)})
    assert (r.status == 200) == ok and client.app[ROOMS].get("r").stopped == ok
    if ok:
        ws, welcome = await join(client, headers=hdr)
        assert welcome["type"] == "welcome"
        await ws.close()
    else:
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await client.ws_connect("/api/rooms/r/ws", headers=hdr)
        assert e.value.status == 403
        assert client.app[REFUSED]["origin"] == 2


async def test_failed_token_checks_are_limited_per_address(client):
    for _ in range(5):
        assert (await client.get("/api/rooms/t?token=wrong-guess-000000")).status == 403
    r = await client.get(f"/api/rooms/t?token={TOKEN}")                  # even the right one, for a while
    assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
    ws = await client.ws_connect("/api/rooms/t/ws")
    msg = await ws.receive(5)
    assert msg.type == aiohttp.WSMsgType.CLOSE and ws.close_code == 4029
    assert (await client.get("/api/rooms/r")).status == 200              # an open room is not gated
    assert client.app[REFUSED]["auth_rate_limited"] == 2


async def test_the_trainer_token_on_an_open_rooms_job_is_a_limited_token_check(client):
    # a review: GET .../job with a wrong X-Tabcohort-Trainer-Token on an open room was refused
    # each time but never limited (an open room checks no room token, and so no rate)
    for _ in range(5):
        assert (await client.get("/api/rooms/r/job", headers={"X-Tabcohort-Trainer-Token": "guess-0000000000"})).status == 403
    r = await client.get("/api/rooms/r/job", headers={"X-Tabcohort-Trainer-Token": TRAINER})
    assert r.status == 429
    assert (await client.get("/api/rooms/r/job")).status == 200       # without the header: not a check


async def test_an_open_rooms_state_answers_no_operator_token_guess_past_the_limit(client):
    # a review: GET /api/rooms/OPEN with a token compared it with the operator token (the
    # operator's summary differs) and counted nothing: guesses without a limit. A second review:
    # counted but answered 200, a stale operator page polling each second locked its address out
    for _ in range(50):   # a tab's link to an open room may carry a token: ignored, never compared
        r = await client.get(f"/api/rooms/r?token={OP if _ % 2 else 'stray-token-000000'}")
        assert r.status == 200 and "checkpoints" not in await r.json()
    assert client.app[REFUSED]["auth_failed"] == 0
    assert "checkpoints" in await (await client.get("/api/rooms/r", headers=bearer(OP))).json()
    for _ in range(5):    # an operator claim: a wrong one is refused (a page stops polling) and counted
        assert (await client.get("/api/rooms/r", headers=bearer("wrong-guess-000000"))).status == 403
    assert client.app[REFUSED]["auth_failed"] == 5
    assert (await client.get("/api/rooms/r", headers=bearer(OP))).status == 429   # the right one too, for a while
    assert (await client.get("/api/rooms/r")).status == 200                      # no claim: no check, served


async def test_an_open_rooms_register_answers_no_trainer_token_guess_past_the_limit(client):
    # a review: a WebSocket register with a wrong trainer_token in an open room was refused
    # (4001) and counted but never blocked, so the socket answered every guess
    for _ in range(5):
        ws, _ = await join(client, trainer_token="guess-0000000000")
        assert ws.close_code == 4001
    ws, _ = await join(client, trainer_token=TRAINER)                      # blocked now, the right one too
    assert ws.close_code == 4029
    ws, welcome = await join(client)                                      # no credential: no check
    assert welcome["type"] == "welcome"
    await ws.close()


async def test_metrics_answers_no_token_guess_past_the_failed_check_limit(client):
    # a hostile trial: /metrics showed a token room's series for the right token and counted no
    # failure, so it answered 201 guesses from an address the room endpoint had blocked
    for _ in range(5):
        r = await client.get("/metrics?token=wrong-guess-000000")
        assert r.status == 200 and 'room="t"' not in await r.text()
    assert client.app[REFUSED]["auth_failed"] == 5
    r = await client.get(f"/metrics?token={TOKEN}")                    # blocked now, the right one too
    assert r.status == 429
    assert (await client.get("/metrics")).status == 200                 # no token: no check, served


async def test_a_token_rooms_data_stays_behind_its_token(client):
    ws, w = await join(client, "t", token=TOKEN, trainer_token=TRAINER)
    await ws.send_str(json.dumps({"type": "report", "state": {"step": 7, "leader": w["id"], "is_leader": True,
                                                              "loss": 0.25, "pid": 999}}))
    room = client.app[ROOMS].get("t")
    end = time.monotonic() + 5
    while room.step() != 7:
        assert time.monotonic() < end
        await asyncio.sleep(0.01)
    anon = await (await client.get("/metrics")).text()
    assert 'room="r"' in anon and 'room="t"' not in anon
    for tok in (TOKEN, OP):
        text = await (await client.get("/metrics", headers=bearer(tok))).text()
        assert 'tabcohort_step{room="t"} 7.0' in text
    listed = {x["room"]: x for x in (await (await client.get("/api/rooms")).json())["rooms"]}
    assert "n_connected" not in listed["t"] and "n_connected" in listed["r"]
    assert (await client.get("/api/rooms/t")).status == 403
    as_rank = await (await client.get("/api/rooms/t", headers=bearer(TOKEN))).json()
    assert as_rank["step"] == 7 and "pid" not in as_rank["ranks"][0]["report"]
    as_op = await (await client.get("/api/rooms/t", headers=bearer(OP))).json()
    assert as_op["ranks"][0]["report"]["pid"] == 999
    await ws.close()


async def test_malformed_reports_never_break_the_room_for_the_others(client, caplog):
    caplog.set_level(logging.WARNING)
    (good, wg), (bad, wb) = await join(client, trainer_token=TRAINER), await join(client)
    room = client.app[ROOMS].get("r")
    await good.send_str(json.dumps({"type": "report", "state": {"step": 5, "leader": wg["id"], "is_leader": True}}))
    end = time.monotonic() + 5
    while room.step() < 5:
        assert time.monotonic() < end
        await asyncio.sleep(0.01)
    for attack in ({"type": "report", "state": {}}, {"type": "report", "state": {"step": None}},
                   {"type": "report", "state": {"step": 10**15, "leader": wb["id"], "is_leader": True}},
                   {"type": "report", "state": {"step": "x", "loss": "y"}}):
        await bad.send_str(json.dumps(attack))
    await bad.send_str('{"type": "report", "state": {"step": NaN}}')
    await bad.send_str("[" * 30000 + "]" * 30000)
    await good.send_str(json.dumps({"type": "register", "nested": "[" * 30000}))
    for step in (10, 20):
        await good.send_str(json.dumps({"type": "report", "state": {"step": step, "leader": wg["id"],
                                                                    "is_leader": True, "loss": 0.5}}))
    end = time.monotonic() + 5
    while room.step() < 20:
        assert time.monotonic() < end, room.drops
        await asyncio.sleep(0.01)
    for path in ("/api/rooms/r", "/metrics"):
        assert (await client.get(path)).status == 200
    st = await (await client.get("/api/rooms/r")).json()
    assert st["step"] == 20 and not st["stopped"]                        # the forged 10**15 did not count
    for reason in ("bad_report.step", "bad_json", "too_deep"):
        assert st["drops"].get(reason), st["drops"]
    await good.send_str(json.dumps({"type": "report", "state": {"step": 40, "leader": wg["id"], "is_leader": True}}))
    msg = None
    while True:
        msg = json.loads((await good.receive(5)).data)
        if msg["type"] == "stop":
            break
    assert msg["reason"] == "steps 40 reached"
    assert "RecursionError" not in caplog.text and "Traceback" not in caplog.text
    ws = await client.ws_connect("/api/rooms/r/ws")                    # a deep register: refused, counted
    await ws.send_str("[" * 30000 + "]" * 30000)
    assert (await ws.receive(5)).type == aiohttp.WSMsgType.CLOSE and ws.close_code == 4000
    assert room.drops.get("bad_register") == 1
    for ws_ in (good, bad, ws):
        await ws_.close()


async def test_seats_per_address_are_bounded(client):
    socks = [await join(client) for _ in range(4)]
    assert all(w["type"] == "welcome" for _, w in socks)
    ws, w = await join(client)
    assert w is None and ws.close_code == 4011
    for s, _ in socks:
        await s.close()


async def lead(client, ws, w, room="r") -> None:
    """Make the rank of ``ws`` the room's current leader (it may lead and reports that it leads)."""
    await ws.send_str(json.dumps({"type": "report", "state": {"step": 0, "leader": w["id"], "is_leader": True}}))
    r = client.app[ROOMS].get(room)
    end = time.monotonic() + 5
    while r.leader_peer() is None or r.leader_peer().id != w["id"]:
        assert time.monotonic() < end
        await asyncio.sleep(0.01)


async def test_checkpoint_upload_is_checked_before_its_body_is_read(client):
    ws, w = await join(client, trainer_token=TRAINER)
    await lead(client, ws, w)
    a = client.app[ASSETS]["r"]
    host, port = client.server.host, client.server.port
    # a 250 MiB Content-Length from a registered rank: refused at once, without sending a byte of body
    reader, writer = await asyncio.open_connection(host, port)
    writer.write((f"PUT /api/rooms/r/checkpoint HTTP/1.1\r\nHost: {host}\r\nContent-Length: {250 << 20}\r\n"
                  f"X-Tabcohort-Rank: {w['id']}\r\nX-Tabcohort-Step: 1\r\nX-Tabcohort-Secret: {w['secret']}\r\n"
                  f"X-Tabcohort-Digest: x\r\n\r\n").encode())
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 5)
    assert status.startswith(b"HTTP/1.1 413"), status
    writer.close()
    # chunked (no Content-Length): read at most the parameters' size, then refused
    async def body():
        for _ in range(64):
            yield b"\0" * (4 * a.bucket_len)
    r = await client.put("/api/rooms/r/checkpoint", data=body(), headers={
        "X-Tabcohort-Rank": str(w["id"]), "X-Tabcohort-Step": "1", "X-Tabcohort-Secret": w["secret"],
        "X-Tabcohort-Digest": "x"})
    assert r.status == 413
    # a stranger's upload is refused before reading, and counted as a failed auth
    r = await client.put("/api/rooms/r/checkpoint", data=b"\0" * 8, headers={
        "X-Tabcohort-Rank": str(w["id"]), "X-Tabcohort-Step": "1", "X-Tabcohort-Secret": "nope"})
    assert r.status == 403


async def test_a_stalled_or_lost_checkpoint_body_frees_the_room_for_the_next_upload(client, monkeypatch, caplog):
    # a hostile trial: headers and 10 bytes, then silence, held the room's upload lock, so every
    # later upload got 409 (uncounted) until the kernel dropped the dead connection; a body cut
    # by a closed connection logged a full traceback at ERROR
    import hashlib
    from array import array

    from tabcohort_server import app as app_module
    monkeypatch.setattr(app_module, "CHECKPOINT_BODY_WINDOW_S", 0.5)
    ws, w = await join(client, trainer_token=TRAINER)
    await lead(client, ws, w)
    a = client.app[ASSETS]["r"]
    room = client.app[ROOMS].get("r")
    data = array("f", [0.5] * (a.bucket_len + a.state_len)).tobytes()
    head = (f"PUT /api/rooms/r/checkpoint HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
            f"X-Tabcohort-Rank: {w['id']}\r\nX-Tabcohort-Step: 1\r\nX-Tabcohort-Secret: {w['secret']}\r\n"
            f"X-Tabcohort-Digest: {hashlib.sha256(data).hexdigest()}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(head + data[:10])
    await writer.drain()
    r = await client.put("/api/rooms/r/checkpoint", data=data, headers={        # meanwhile: busy
        "X-Tabcohort-Rank": str(w["id"]), "X-Tabcohort-Step": "1", "X-Tabcohort-Secret": w["secret"],
        "X-Tabcohort-Digest": hashlib.sha256(data).hexdigest()})
    assert r.status == 409 and room.drops["checkpoint_busy"] == 1
    status = await asyncio.wait_for(reader.readline(), 10)                # the stalled one times out
    assert status.startswith(b"HTTP/1.1 408"), status
    assert room.drops["checkpoint_body_timeout"] == 1
    writer.close()
    # a body cut by its connection closing: counted, no traceback
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(head + data[:10])
    await writer.drain()
    end = time.monotonic() + 5
    while not a.upload_lock.locked():                                     # its body is being read
        assert time.monotonic() < end
        await asyncio.sleep(0.01)
    writer.close()
    while not room.drops.get("checkpoint_body_lost"):
        assert time.monotonic() < end, room.drops
        await asyncio.sleep(0.01)
    r = await client.put("/api/rooms/r/checkpoint", data=data, headers={
        "X-Tabcohort-Rank": str(w["id"]), "X-Tabcohort-Step": "1", "X-Tabcohort-Secret": w["secret"],
        "X-Tabcohort-Digest": hashlib.sha256(data).hexdigest()})
    assert r.status == 200 and (await r.json())["stored"], await r.text()
    assert not [x for x in caplog.records if x.levelno >= logging.ERROR], [x.getMessage() for x in caplog.records]
    # decimal ASCII headers only (int() took "+2", "1_0", other scripts' digits)
    for bad in ("+2", "1_0", "\u0662", "2.0"):
        r = await client.put("/api/rooms/r/checkpoint", data=data, headers={
            "X-Tabcohort-Rank": str(w["id"]), "X-Tabcohort-Step": bad, "X-Tabcohort-Secret": w["secret"],
            "X-Tabcohort-Digest": hashlib.sha256(data).hexdigest()})
        assert r.status == 400, bad


async def test_a_checkpoint_accuracy_is_the_leaders_header_and_a_bad_one_is_stored_without(client):
    # docs/INTERFACES.md "The server never decodes parameters": the accuracy stored with a
    # checkpoint is the uploading leader's own evaluation; one that is not a number in [0, 1] is
    # dropped and counted, and the checkpoint is stored without an accuracy (nothing lost)
    import hashlib
    from array import array

    ws, w = await join(client, trainer_token=TRAINER)
    await lead(client, ws, w)
    a = client.app[ASSETS]["r"]
    room = client.app[ROOMS].get("r")
    for step, header, want in ((1, "0.875", 0.875), (2, "2.5", None), (3, "nan", None), (4, None, None)):
        data = array("f", [0.01 * step] * (a.bucket_len + a.state_len)).tobytes()
        h = {"X-Tabcohort-Rank": str(w["id"]), "X-Tabcohort-Step": str(step), "X-Tabcohort-Secret": w["secret"],
             "X-Tabcohort-Digest": hashlib.sha256(data).hexdigest(), "X-Tabcohort-Loss": "0.5"}
        if header is not None:
            h["X-Tabcohort-Accuracy"] = header
        # (its last report says another accuracy, of an older evaluation: the record holds no such
        # stale figure beside the checkpoint's own, where a person read 0.61 and 0.71 of one model)
        await ws.send_str(json.dumps({"type": "report", "state": {"step": step, "leader": w["id"], "is_leader": True,
                                                                  "accuracy": 0.25}}))
        r = await client.put("/api/rooms/r/checkpoint", data=data, headers=h)
        assert r.status == 200, await r.text()
        got = await r.json()
        assert got["stored"] and got["accuracy"] == want, (header, got)
        meta = room.checkpoint
        assert meta["accuracy"] == want and 0.25 not in meta.values(), meta
    assert room.drops["bad_accuracy_header"] == 2


async def test_slowloris_connections_are_bounded_per_address_and_timed_out(caplog):
    import gc
    app = create_app(config(header_timeout_s=1.0, max_connections_per_address=5))
    runner, site, port = await start_site(app, "127.0.0.1", 0)
    try:
        conns = []
        for _ in range(5):                                   # partial request heads, never finished
            rd, wr = await asyncio.open_connection("127.0.0.1", port)
            wr.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            conns.append((rd, wr))
        await asyncio.sleep(0)
        rd, wr = await asyncio.open_connection("127.0.0.1", port)   # the sixth: aborted at once
        assert await asyncio.wait_for(rd.read(), 2) == b""
        assert app[REFUSED]["connections_per_address"] >= 1
        t0 = time.monotonic()
        for rd, wr in conns:                                 # the header timeout closes the others
            await asyncio.wait_for(rd.read(), 5)
        assert time.monotonic() - t0 < 4
        async with aiohttp.ClientSession() as s:             # and the server answers again
            async with s.get(f"http://127.0.0.1:{port}/healthz") as r:
                assert r.status == 200
        # each refused connection logged a traceback ("Task exception was never retrieved")
        gc.collect()
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    finally:
        await runner.cleanup()


async def ws_join(session: aiohttp.ClientSession, url: str, **reg) -> tuple:
    """A WebSocket to room ``r`` of the server at ``url``, registered (``reg``: the register
    control's fields); returns ``(ws, welcome)``."""
    ws = await session.ws_connect(f"{url}/api/rooms/r/ws")
    await ws.send_str(json.dumps({"type": "register", **reg}))
    return ws, json.loads((await ws.receive(5)).data)


async def test_a_link_over_its_byte_rate_is_slowed_by_back_pressure_and_loses_no_chunk():
    # server "Server controls" (docs/PROTOCOL.md): a dropped chunk loses its whole frame, so a
    # WebSocket over sender_max_bytes_per_s is not read until its budget allows
    from tabcohort.vec import to_vector
    from tabcohort.wire import FrameReader

    rate = 1 << 20
    app = create_app(config(sender_max_bytes_per_s=rate, contributor_max_bytes_per_s=rate))
    runner, site, port = await start_site(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            def connect(**reg):
                return ws_join(s, url, **reg)
            (a, wa), (b, wb) = await connect(), await connect()
            n = 3 * rate // 4                               # 3 MiB of float32: 3 s of budget, 1 s of burst
            values = [float(i % 1000) for i in range(n)]
            msg = {"t": "grad", "term": 1, "step": 1, "loss": 0.5, "samples": 1, "g": to_vector(values),
                   "to": wb["id"]}
            chunks = FrameWriter(wa["id"], max_message_bytes=64 << 10).write(msg)
            t0 = time.monotonic()
            for c in chunks:
                await a.send_bytes(c)
            await a.send_str(json.dumps({"type": "backlog", "bytes": 1000}))   # a control right behind
            reader, got = FrameReader(), []
            while not got:
                m = await b.receive(10)
                assert m.type == aiohttp.WSMsgType.BINARY or m.type == aiohttp.WSMsgType.TEXT, m
                if m.type == aiohttp.WSMsgType.BINARY:
                    got = reader.feed(m.data, now_ms=0.0)
            elapsed = time.monotonic() - t0
            room = app[ROOMS].get("r")
            assert list(got[0]["g"]) == values                 # the whole frame, every chunk
            assert "rate_limited" not in room.drops, room.drops
            assert room.byte_paced > 0 and elapsed >= 1.5, (room.byte_paced, elapsed)
            assert room.summary(time.monotonic())["counters"]["byte_paced"] == room.byte_paced
            end = time.monotonic() + 5
            while room.peers[wa["id"]].rx_backlog != 1000:       # the control waited, not dropped
                assert time.monotonic() < end and "rate_limited" not in room.drops, room.drops
                await asyncio.sleep(0.01)
    finally:
        await runner.cleanup()


async def test_a_resume_that_takes_over_a_live_link_keeps_its_new_link():
    # the old link's cleanup runs after the resume re-seated the same Peer: it must not end
    # the new link (before, the server took the new link for gone: nothing was relayed to it)
    app = create_app(config())
    runner, site, port = await start_site(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            def connect(**reg):
                return ws_join(s, url, **reg)
            (a, wa), (b, wb) = await connect(), await connect()
            room = app[ROOMS].get("r")
            a2, wa2 = await connect(resume={"id": wa["id"], "secret": wa["secret"]})
            assert wa2["id"] == wa["id"] and wa2["resumed"]
            while (m := await a.receive(5)).type not in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                pass                                         # the old link is closed
            end = time.monotonic() + 5
            while a.closed is False or room.peers[wa["id"]].kick is None:
                assert time.monotonic() < end
                await asyncio.sleep(0.01)
            await asyncio.sleep(0)                           # (its handler's cleanup has run)
            p = room.peers[wa["id"]]
            assert p.connected and room.connected.get(wa["id"]) is p, room.drops
            chunk = FrameWriter(wb["id"]).write({"t": "beat", "term": 1, "batch": 1, "ready": True, "running": True,
                                                 "step": 1, "backend": "x", "to": wa["id"]})[0]
            await b.send_bytes(chunk)
            while (m := await a2.receive(5)).type != aiohttp.WSMsgType.BINARY:
                assert m.type == aiohttp.WSMsgType.TEXT, m
            assert m.data == chunk                           # relayed to the new link
    finally:
        await runner.cleanup()


async def test_a_flooding_socket_is_closed_and_honest_sockets_keep_their_traffic():
    app = create_app(config(sender_max_msgs_per_s=2000, rate_limit_close_s=1.0))
    runner, site, port = await start_site(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            def connect(**reg):
                return ws_join(s, url, **reg)
            (a, wa), (b, wb), (f, wf) = await connect(), await connect(), await connect()
            got = {"a": 0, "b": 0}

            async def read(ws, key, other):
                async for m in ws:
                    if m.type == aiohttp.WSMsgType.BINARY and m.data[2:6] == other.to_bytes(4, "little"):
                        got[key] += 1
            readers = [asyncio.create_task(read(a, "a", wb["id"])), asyncio.create_task(read(b, "b", wa["id"]))]
            fw = FrameWriter(wf["id"])
            beat = {"t": "beat", "term": 1, "batch": 1, "ready": True, "running": True, "step": 1, "backend": "x"}
            chunk = fw.write(beat)[0]

            async def flood():
                try:
                    while True:
                        for _ in range(500):
                            await f.send_bytes(chunk)
                        await asyncio.sleep(0)
                except (ConnectionError, aiohttp.ClientError):
                    pass
            ft = asyncio.create_task(flood())
            t_flood = time.monotonic()
            w_a, w_b = FrameWriter(wa["id"]), FrameWriter(wb["id"])
            n = 0
            t_end = time.monotonic() + 4
            while time.monotonic() < t_end:                  # the honest pair: 200 frames/s each way
                await a.send_bytes(w_a.write(beat)[0])
                await b.send_bytes(w_b.write(beat)[0])
                n += 1
                await asyncio.sleep(0.005)
            end = time.monotonic() + 5
            while min(got.values()) < n:
                assert time.monotonic() < end, (got, n)
                await asyncio.sleep(0.01)
            room = app[ROOMS].get("r")
            while (m := await f.receive(5)).type not in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                pass
            assert m.data == 4029 or f.close_code == 4029, (m, f.close_code, room.drops)
            assert set(room.connected) == {wa["id"], wb["id"]} and "slow_consumer" not in room.drops
            assert room.drops["rate_limited"] > 0 and room.drops["rate_limit_close"] == 1
            ft.cancel()
            for t in readers:
                t.cancel()
            await asyncio.gather(ft, *readers, return_exceptions=True)
            print(f"\nflooder sent {room.frames_in - 2 * n} frames in {time.monotonic() - t_flood:.1f} s, closed 4029 "
                  f"after {room.drops['rate_limited']} rate-limited frames; "
                  f"honest pair relayed {n}/{n} each way")
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("sdp", ["garbage", "real"])
async def test_300_webrtc_offers_make_at_most_one_warning(client, caplog, sdp):
    from aiortc import RTCPeerConnection

    caplog.set_level(logging.WARNING, logger="tabcohort.server.rtc")
    text = "v=0 garbage"
    pc = None
    if sdp == "real":
        pc = RTCPeerConnection()
        pc.createDataChannel("x")
        await pc.setLocalDescription(await pc.createOffer())
        text = pc.localDescription.sdp
    ws, w = await join(client)
    for _ in range(300):
        await ws.send_str(json.dumps({"type": "signal", "to": 0, "kind": "offer", "sdp": text}))
    room = client.app[ROOMS].get("r")
    end = time.monotonic() + 10
    while sum(room.drops.get(k, 0) for k in ("rtc_offer_busy", "rtc_offer_rate", "rtc_failed")) < 290:
        assert time.monotonic() < end, room.drops
        await asyncio.sleep(0.05)
    warnings = [r for r in caplog.records if r.name == "tabcohort.server.rtc" and r.levelno >= logging.WARNING]
    assert len(warnings) <= 1, [r.getMessage() for r in warnings]
    await ws.close()
    if pc is not None:
        await pc.close()


async def test_the_operators_state_of_a_token_room_names_its_room_token_and_no_other_does(client):
    # the operator view's "Join this room" link is built from it (the printed operate: link
    # carries no room token, and a tab opened from a join link without it is refused)
    op = await (await client.get("/api/rooms/t", headers=bearer(OP))).json()
    assert op["join_token"] == TOKEN
    member = await (await client.get(f"/api/rooms/t?token={TOKEN}")).json()
    assert "join_token" not in member
    open_room = await (await client.get("/api/rooms/r", headers=bearer(OP))).json()
    assert "join_token" not in open_room


async def test_the_operator_token_in_a_url_is_not_the_operators(client):
    # a URL lands in logs and browser history: the operator's actions take the token in the
    # Authorization header only (a new-user trial: POST .../lr?token=OPERATOR answered 200)
    room = client.app[ROOMS].get("r")
    for path in ("/api/rooms/r/lr", "/api/rooms/r/stop"):
        r = await client.post(f"{path}?token={OP}", json={"lr": 0.3})
        assert r.status == 403, path
    assert not room.stopped and room.operator_lr is None
    r = await client.post("/api/rooms/r/lr", json={"lr": 0.3}, headers=bearer(OP))
    assert r.status == 200 and room.operator_lr == 0.3


async def test_only_the_operator_sets_the_rooms_learning_rate(client):
    ws, w = await join(client, trainer_token=TRAINER)
    room = client.app[ROOMS].get("r")
    for headers in ({}, bearer(TOKEN), bearer(TRAINER)):   # no token, the join token, the trainer's
        r = await client.post("/api/rooms/r/lr", json={"lr": 10000.0}, headers=headers)
        assert r.status == 403
    # (50: above the room's lr_max, 10, every follower drops the rounds: it answered 200)
    # (an unknown field beside a good lr: it answered 200 and set the lr, the field ignored)
    # (an int no float holds: math.isfinite raised OverflowError, a 500 with a traceback)
    for bad in ({"lr": 0}, {"lr": -1}, {"lr": 1e7}, {"lr": "1"}, {"lr": True}, {}, [1], {"lr": 50},
                {"lr": 10**400}, {"lr": -10**400}, {"lr": 0.3, "momentum": 0.9}):
        r = await client.post("/api/rooms/r/lr", json=bad, headers=bearer(OP))
        assert r.status == 400, bad
    assert "'momentum'" in (await r.json())["error"] and room.job.lr == 0.5
    r = await client.post("/api/rooms/r/lr", data=b"garbage", headers=bearer(OP))   # (it said "lr must be a number")
    assert r.status == 400 and "it is not JSON" in (await r.json())["error"]
    # a body that is not UTF-8: 400, and one naming an unknown charset is read as UTF-8 (both
    # answered 500, with a traceback in the log)
    r = await client.post("/api/rooms/r/lr", data=b'\xff\xfe{"lr":0.5}',
                          headers={**bearer(OP), "Content-Type": "application/json"})
    assert r.status == 400 and room.drops["bad_lr"] == 13 and room.job.lr == 0.5
    r = await client.post("/api/rooms/r/lr", data=b'{"lr":0.4}',
                          headers={**bearer(OP), "Content-Type": "application/json; charset=bogus"})
    assert r.status == 200 and room.job.lr == 0.4
    r = await client.post("/api/rooms/r/lr", json={"lr": 0.25}, headers=bearer(OP))
    assert r.status == 200 and room.job.lr == 0.25
    told = []
    while 0.25 not in told:   # every rank is told (the leader applies it; its rounds carry it)
        msg = json.loads((await ws.receive(5)).data)
        if msg["type"] == "lr":
            told.append(msg["lr"])
    assert told == [0.4, 0.25]
    await ws.close()
    # a rank that joins later is told the operator's lr in its welcome (the served job keeps the
    # lr the room started with: a new-user trial's ranks, restarted, trained at that one again)
    ws2, w2 = await join(client, trainer_token=TRAINER)
    assert w2["type"] == "welcome" and w2["lr"] == 0.25
    await ws2.close()
    # a stopped room: 409, the lr unchanged (it answered 200 with no rank left to apply it)
    assert (await client.post("/api/rooms/r/stop", headers=bearer(OP))).status == 200
    r = await client.post("/api/rooms/r/lr", json={"lr": 0.125}, headers=bearer(OP))
    assert r.status == 409 and "stopped" in (await r.json())["error"] and room.job.lr == 0.25


async def _raw_get(client, path: str, auth: bytes) -> bytes:
    """One request with raw header bytes (a client library would refuse to send them)."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: " + auth
                 + b"\r\n\r\n")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return data


async def test_undecodable_or_odd_secrets_are_refused_never_a_500(client, caplog):
    # an Authorization header with bytes that are not UTF-8 was a 500 (UnicodeEncodeError in the
    # token comparison) on 9 of 13 endpoints of a token room, and not counted as a failed check
    # (first: the failed checks below block this address, the right token too, for a while)
    # the scheme is case-insensitive (RFC 7235): the operator's lower-case "bearer" works
    r = await client.get("/metrics", headers={"Authorization": f"bearer {OP}"})
    assert r.status == 200
    for path in ("/api/rooms/t", "/metrics", "/api/rooms/t/checkpoints", "/api/rooms/r"):
        for auth in (b"Bearer \xff\xfe", b"Bearer \xed\xa0\x80abc"):
            head = (await _raw_get(client, path, auth)).split(b"\r\n", 1)[0]
            assert b" 500 " not in head and (b" 403 " in head or b" 200 " in head or b" 429 " in head), (path, head)
    # a resume secret with a non-ASCII character, a token or trainer token with a lone surrogate:
    # each closed the socket with 1006 and a traceback; now the close codes of any bad register
    for reg in ({"resume": {"id": 1, "secret": "\u00e9"}}, {"token": "\ud800" * 20},
                {"trainer_token": "\udfff" * 20}):
        ws = await client.ws_connect("/api/rooms/t/ws")
        await ws.send_str(json.dumps({"type": "register", "token": TOKEN, **reg}))
        msg = await ws.receive(5)
        assert msg.type == aiohttp.WSMsgType.CLOSE and 4000 <= msg.data < 4100, (reg, msg)
        await ws.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


async def test_the_room_names_the_rank_it_trusts_not_one_that_says_it_leads(client):
    # a hostile trial: the page and the operator view took the first report saying is_leader, so
    # a contributor claiming to lead drove the charts, shares and quarantine columns; they now
    # show the report of trusted_id, the rank with the role the server trusts
    lead, w = await join(client, trainer_token=TRAINER)
    stranger, s = await join(client)
    await lead.send_str(json.dumps({"type": "report", "state": {"step": 7, "leader": w["id"], "is_leader": True,
                                                                "loss": 0.5}}))
    # ~20 KB of report, answered to every poll (as many links as the room's 1,024 seats hold)
    links = {f"{k:08x}": "relay" for k in range(1, 1024)}
    await stranger.send_str(json.dumps({"type": "report", "state": {"step": 9, "leader": s["id"], "is_leader": True,
                                                                    "loss": 1e-9, "links": links}}))
    await asyncio.sleep(0)
    for _ in range(100):
        st = await (await client.get("/api/rooms/r")).json()
        if all(r["report"] for r in st["ranks"]):
            break
        await asyncio.sleep(0.01)
    assert st["trusted_id"] == w["id"] and st["loss"] == 0.5, st
    claimed = [r["id"] for r in st["ranks"] if r["report"] and r["report"].get("is_leader")]
    assert sorted(claimed) == sorted([w["id"], s["id"]])       # (what the page picked from before)
    # without the operator token, the other ranks' reports are a few scalars (a hostile trial:
    # 64 seats of 64 KiB reports made each page's poll a 3.3 MB answer); the operator sees all
    other = next(r["report"] for r in st["ranks"] if r["id"] == s["id"])
    assert other == {"step": 9, "is_leader": True, "loss": 1e-9}, other
    full = await (await client.get("/api/rooms/r", headers=bearer(OP))).json()
    assert len(next(r["report"] for r in full["ranks"] if r["id"] == s["id"])["links"]) == 1023
    await lead.close()
    await stranger.close()


async def test_a_rank_trickling_thousands_of_candidates_to_the_server_is_capped(client):
    # a hostile trial: 12,000 trickled candidates to distinct addresses cost the server 54 s of
    # CPU (aioice re-sorts its whole check list per candidate) and froze /healthz for 52 s
    from aiortc import RTCPeerConnection

    from tabcohort.bus.rtc_util import MAX_REMOTE_CANDIDATES

    pc = RTCPeerConnection()
    pc.createDataChannel("x")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = "\r\n".join(l for l in pc.localDescription.sdp.split("\r\n") if "end-of-candidates" not in l)
    ws, w = await join(client)
    await ws.send_str(json.dumps({"type": "signal", "to": 0, "kind": "offer", "sdp": sdp}))
    room = client.app[ROOMS].get("r")
    peer = room.peers[w["id"]]
    end = time.monotonic() + 10
    while peer.rtc is None or peer.rtc.pc is None:
        assert time.monotonic() < end, room.drops
        await asyncio.sleep(0.01)
    n = 400
    t0 = time.monotonic()
    for i in range(n):
        cand = {"candidate": f"candidate:{i} 1 udp 2122260223 127.1.{i // 250}.{i % 250 + 1} {20000 + i} typ host",
                "sdpMid": "0", "sdpMLineIndex": 0}
        await ws.send_str(json.dumps({"type": "signal", "to": 0, "kind": "candidate", "candidate": cand}))
    while room.drops.get("rtc_candidate_limit", 0) < n - MAX_REMOTE_CANDIDATES:
        assert time.monotonic() < end + 10, room.drops
        await asyncio.sleep(0.01)
    assert peer.rtc.n_candidates == MAX_REMOTE_CANDIDATES
    assert (await client.get("/healthz")).status == 200 and time.monotonic() - t0 < 10
    await ws.close()
    await pc.close()



async def test_a_rank_gone_before_the_websocket_handshake_is_counted_not_a_traceback(client, caplog):
    # a new-user trial (70 ranks on 2 cores): each rank that gave up before the server answered
    # its upgrade left a ClientConnectionResetError traceback in the server's log
    import base64
    import os
    import socket
    import struct

    caplog.set_level(logging.ERROR)
    for _ in range(20):
        r, w = await asyncio.open_connection("127.0.0.1", client.server.port)
        key = base64.b64encode(os.urandom(16)).decode()
        w.write(f"GET /api/rooms/r/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
        await w.drain()
        w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        w.close()                                    # (a reset, at once: as a rank's process exits)
    refused = client.app[REFUSED]
    deadline = time.monotonic() + 10
    while refused["gone_before_handshake"] < 20 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert refused["gone_before_handshake"] == 20, dict(refused)
    assert "Traceback" not in caplog.text and "Error handling request" not in caplog.text, caplog.text
    ws, _ = await join(client)                       # and the room still answers a rank
    await ws.close()
