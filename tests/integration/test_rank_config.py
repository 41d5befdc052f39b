"""Native rank configuration: clear ConfigErrors naming the variable, before any network use."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest

from tabcohort.errors import ConfigError
from tabcohort.runtime.native import RankConfig

from .conftest import ROOT, _env, wait_for


def cfg(env: dict, **args) -> RankConfig:
    return RankConfig.from_sources({k: None for k in ("server", "room", "token", "batch", "link")} | args, env)


@pytest.mark.parametrize("env,var,value", [
    ({"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d", "TABCOHORT_BATCH": "3.5"},
     "TABCOHORT_BATCH", "3.5"),
    # (a u32 on the wire: a larger batch joined, then failed every hello and beat)
    ({"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d", "TABCOHORT_BATCH": "99999999999999"},
     "TABCOHORT_BATCH", "99999999999999"),
    ({"TABCOHORT_SERVER": "127.0.0.1:8080", "TABCOHORT_ROOM": "d"}, "TABCOHORT_SERVER", "127.0.0.1:8080"),
    # a path was dropped without a word (every endpoint is at the server's root)
    ({"TABCOHORT_SERVER": "http://127.0.0.1:1/tabcohort", "TABCOHORT_ROOM": "d"}, "TABCOHORT_SERVER",
     "http://127.0.0.1:1/tabcohort"),
    ({"TABCOHORT_SERVER": "http://127.0.0.1:1/?room=d", "TABCOHORT_ROOM": "d"}, "TABCOHORT_SERVER",
     "http://127.0.0.1:1/?room=d"),
    ({"TABCOHORT_SERVER": "http://no-such-host.invalid:8080", "TABCOHORT_ROOM": "d"}, "TABCOHORT_SERVER",
     "http://no-such-host.invalid:8080"),
    ({"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d", "TABCOHORT_LINK": "carrier-pigeon"},
     "TABCOHORT_LINK", "carrier-pigeon"),
    ({"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d", "TABCOHORT_DIRECT_HOST": "lan-host"},
     "TABCOHORT_DIRECT_HOST", "lan-host"),
    ({"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d", "TABCOHORT_DIRECT_ANNOUNCE": "10.0.0.1"},
     "TABCOHORT_DIRECT_ANNOUNCE", "10.0.0.1"),
    ({"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d", "TABCOHORT_DIRECT": "maybe"},
     "TABCOHORT_DIRECT", "maybe"),
    # a bracketed host urlsplit cannot parse was a traceback (ValueError: Invalid IPv6 URL)
    ({"TABCOHORT_SERVER": "http://[zz]:80", "TABCOHORT_ROOM": "d"}, "TABCOHORT_SERVER", "http://[zz]:80"),
    ({"TABCOHORT_SERVER": "http://[::1", "TABCOHORT_ROOM": "d"}, "TABCOHORT_SERVER", "http://[::1"),
    # port 0 was taken as no port (80); 99999 was said "not a number" (a new-user trial)
    ({"TABCOHORT_SERVER": "http://127.0.0.1:0", "TABCOHORT_ROOM": "d"}, "TABCOHORT_SERVER", "http://127.0.0.1:0"),
    ({"TABCOHORT_SERVER": "http://127.0.0.1:99999", "TABCOHORT_ROOM": "d"}, "TABCOHORT_SERVER",
     "http://127.0.0.1:99999"),
    # a local copy of the job that does not exist is named by where it came from, before connecting
    ({"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d", "TABCOHORT_JOB": "/nonexistent.py"},
     "TABCOHORT_JOB", "/nonexistent.py"),
])
def test_bad_environment_is_a_config_error_naming_the_variable(env, var, value):
    with pytest.raises(ConfigError) as e:
        cfg(env).validate()
    assert e.value.variable == var and e.value.value == value


def test_a_batch_of_0_is_the_rooms_as_with_serve():
    # (a new-user trial: `rank --batch 0` was refused while `serve --batch 0` meant the default)
    for given in ("0", 0):
        c = cfg({}, server="http://127.0.0.1:1", room="d", batch=given)
        c.validate()
        assert c.batch is None
    with pytest.raises(ConfigError, match=r"in \[0, 16777216\] \(0: the room's"):
        cfg({}, server="http://127.0.0.1:1", room="d", batch="-1").validate()


def test_arguments_win_and_are_named():
    c = cfg({"TABCOHORT_BATCH": "8"}, server="http://127.0.0.1:1", room="d", batch="x")
    with pytest.raises(ConfigError) as e:
        c.validate()
    assert e.value.variable == "--batch"


@pytest.mark.integration
def test_cli_names_a_bad_direct_host_before_connecting():
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "rank", "--server", "http://127.0.0.1:9",
                        "--room", "d", "--direct-host", "999.1.1.1"], env=_env(), cwd=str(ROOT),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--direct-host='999.1.1.1'" in r.stderr, r.stderr


@pytest.mark.parametrize("kw,named,says", [
    ({"direct_host": "192.0.2.1"}, "--direct-host", "not an address of this machine"),
    ({"direct_host": "0.0.0.0"}, "--direct-host", "--direct-announce"),
    ({"direct": "0", "direct_host": "127.0.0.1"}, "--direct-host", "--no-direct"),
    ({"direct": "0", "direct_announce": "127.0.0.1:4000"}, "--direct-announce", "--no-direct"),
])
def test_a_direct_host_that_cannot_listen_or_cannot_matter_is_named(kw, named, says):
    # docs/PROTOCOL.md "Direct TCP path": checked by a local bind before any connection; an
    # address of another machine was accepted and then failed every retry in a warning
    c = cfg({}, server="http://127.0.0.1:1", room="d", **kw)
    with pytest.raises(ConfigError) as e:
        c.validate(resolve=False)
    assert e.value.variable == named and says in str(e.value), str(e.value)
    ok = cfg({}, server="http://127.0.0.1:1", room="d", direct_host="0.0.0.0", direct_announce="127.0.0.1:4000")
    ok.validate(resolve=False)


def test_direct_paths_are_on_by_default_and_no_direct_turns_them_off():
    on = cfg({}, server="http://127.0.0.1:1", room="d")
    on.validate(resolve=False)
    off = cfg({}, server="http://127.0.0.1:1", room="d", direct="0")
    off.validate(resolve=False)
    assert on.direct is True and off.direct is False


def test_cli_names_an_unparsable_server_url_without_a_traceback():
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "rank", "--server", "http://[::1", "--room", "d"],
                       env=_env(), cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--server='http://[::1'" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_server_url_s_password_is_never_printed():
    # a new-user trial: "waiting for the server at http://user:pw@..." echoed the password
    c = cfg({}, server="http://user:pw@127.0.0.1:1/x", room="d")
    with pytest.raises(ConfigError) as e:
        c.validate(resolve=False)
    assert ":pw@" not in str(e.value) and "--server='http://user:***@127.0.0.1:1/x'" in str(e.value), str(e.value)
    # (port 9 on loopback: discard, nobody listens here; the rank retries with a progress line)
    p = subprocess.Popen([sys.executable, "-m", "tabcohort.cli", "rank", "--server", "http://user:pw@127.0.0.1:9",
                          "--room", "d"], env=_env(), cwd=str(ROOT), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        line = p.stdout.readline()
    finally:
        p.kill()
        p.wait(30)
        p.stdout.close()
    assert "waiting for the server at http://user:***@127.0.0.1:9" in line and ":pw@" not in line, line
    assert "(Connect call failed" in line, line        # (the reason; it said "(ClientConnectorError)")


@pytest.mark.integration
def test_cli_exits_2_with_the_variable_before_connecting():
    env = _env() | {"TABCOHORT_SERVER": "http://127.0.0.1:9", "TABCOHORT_ROOM": "d", "TABCOHORT_BATCH": "many"}
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "rank"], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "TABCOHORT_BATCH='many'" in r.stderr


def test_rank_started_before_the_server_waits_for_it_then_joins(cluster):
    import socket

    from .conftest import wait_for

    with socket.socket() as s:            # a free port nobody listens on yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster.url = f"http://127.0.0.1:{port}"
    early = cluster.rank()
    wait_for(lambda: "waiting for the server" in early.text(), 20, "the rank to report it is waiting")
    assert early.p.poll() is None
    from .conftest import Proc
    srv = Proc(["serve", "--port", str(port), "--room", cluster.room, "--trainer-token", cluster.trainer_token],
               cluster.tmp / "serve-late.log")
    cluster.procs.append(srv)
    wait_for(lambda: any(r["report"] and r["report"]["ready"] for r in _state(cluster.url, cluster.room)["ranks"]),
             45, "the early rank to join and become ready")


def _state(url, room):
    import json
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"{url}/api/rooms/{room}", timeout=2) as r:
            return json.load(r)
    except (urllib.error.URLError, ConnectionError):
        return {"ranks": []}


@pytest.mark.parametrize("args,named", [
    (["--host", "nohost.invalid"], "--host='nohost.invalid'"),
    (["--host", "192.0.2.1"], "--host='192.0.2.1'"),        # (an address of no interface here)
    (["--checkpoint-dir", "/proc/no/such/dir"], "--checkpoint-dir="),
    # job and timing values name the flag the user typed, not the room's config field
    (["--steps", "-1"], "--steps=-1"),
    # (serve said "--dataset='/abs/nosuch': no such file" of a name the user typed: echo it, as simulate does)
    (["--dataset", "nosuch"], "--dataset='nosuch': unknown dataset: expected 'digits', 'synthetic' or a path"),
    (["--dataset", "nosuch.npz"], "--dataset='nosuch.npz': no such file"),
    # (a step is an integer in [0, 2^63), README "Untrusted ranks": a larger limit was accepted)
    (["--steps", "99999999999999999999"], "--steps=99999999999999999999: must be at most 9223372036854775807"),
    (["--checkpoint-interval", "0"], "--checkpoint-interval=0.0"),
    (["--beat-ms", "0"], "--beat-ms=0.0"),
    (["--port", "99999"], "--port=99999"),
    (["--grace", "-5"], "--grace=-5.0"),
    # the policy derives drop and takeover from the beat: a smaller value would be silently ignored
    (["--drop-ms", "100"], "--drop-ms=100.0"),
    (["--beat-ms", "1000", "--drop-ms", "4000", "--takeover-ms", "4000"], "--takeover-ms=4000.0"),
])
def test_serve_bad_listen_settings_are_config_errors(args, named):
    port = [] if "--port" in args else ["--port", "0"]
    r = subprocess.run([sys.executable, "-m", "tabcohort", "serve", *port, *args], capture_output=True,
                       text=True, timeout=60, env=_env(), cwd=ROOT)
    assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("args", [["--cluster-lease-ms", "2000"], ["--cluster-tick-ms", "100"],
                                  ["--cluster-takeover-ms", "1000"], ["--node-id", "n1"],
                                  ["--advertise-url", "http://10.0.0.1:8080"]])
def test_serve_cluster_options_without_redis_are_config_errors_not_ignored(args):
    # (--cluster-lease-ms and the other timing flags were silently ignored: the server served alone)
    env = {k: v for k, v in _env().items() if k != "TABCOHORT_REDIS"}
    env["TABCOHORT_NODE_ID"] = "set-by-default"   # (read only with Redis: not what is refused)
    r = subprocess.run([sys.executable, "-m", "tabcohort", "serve", "--port", "0", "--dataset", "synthetic", *args],
                       capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"configuration error: {args[0]}=" in r.stderr and "needs --redis" in r.stderr, r.stderr
    assert "tabcohort serve: http" not in r.stdout, r.stdout        # refused before it listened


@pytest.mark.parametrize("args,named,why", [
    # (each was accepted and did nothing: nothing is advertised without --advertise)
    (["--advertise-interfaces", "1.2.3.4"], "--advertise-interfaces='1.2.3.4'", "applies only with --advertise"),
    # (it said the built-in job takes --dataset, --hidden and --activation: --seed is one of its options too)
    (["--job-option", "foo=1"], "--job-option='foo=1'", "--dataset, --hidden, --activation and --seed"),
])
def test_serve_options_that_would_do_nothing_are_config_errors(args, named, why):
    r = subprocess.run([sys.executable, "-m", "tabcohort", "serve", "--port", "0", "--dataset", "synthetic", *args],
                       capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"configuration error: {named}" in r.stderr and why in r.stderr, r.stderr
    assert "tabcohort serve: http" not in r.stdout, r.stdout        # refused before it listened


def test_serve_help_says_it_hosts_the_room_room_names():
    # (it said "run the server with one room" while README said one serve holds every room it is given)
    r = subprocess.run([sys.executable, "-m", "tabcohort", "--help"], capture_output=True, text=True, timeout=60,
                       env=_env(), cwd=ROOT)
    assert r.returncode == 0 and "hosting the room --room names" in " ".join(r.stdout.split()), r.stdout
    r = subprocess.run([sys.executable, "-m", "tabcohort", "serve", "--help"], capture_output=True, text=True,
                       timeout=60, env=_env(), cwd=ROOT)
    assert "one per command" in " ".join(r.stdout.split()), r.stdout
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "One `tabcohort serve` hosts one room, the one `--room` names" in readme


def test_serve_on_a_port_in_use_is_a_config_error(tmp_path):
    import socket
    ckdir = tmp_path / "new-dir"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "tabcohort", "serve", "--port", str(port), "--checkpoint-dir",
                            str(ckdir)], capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
    assert r.returncode == 2 and f"--port={port}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not ckdir.exists()   # (it was created, empty, for a server that never ran)


def test_serve_names_the_built_in_job_s_options_for_a_model_too_large_to_send_at_once():
    # a new-user trial: `serve --hidden 5000,4000` waited 120 s for the pure-Python path's check,
    # then blamed --job (a path inside tabcohort the user never gave); the size check comes first
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tabcohort", "serve", "--port", "0", "--hidden", "5000,4000",
                        "--dataset", "synthetic"], capture_output=True, text=True, timeout=110, env=_env(), cwd=ROOT)
    took = time.monotonic() - t0
    assert r.returncode == 2 and took < 100, (took, r.stderr)
    assert "--hidden=5000,4000" in r.stderr and "at most 16,515,072 parameters" in r.stderr, r.stderr
    assert "--job=" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_token_room_missing_and_wrong_token_are_clear_errors(cluster):
    cluster.serve("--token", "room-token-s3cret-0123")
    for extra, text in (([], "this room needs a token"), (["--token", "a-wrong-room-token-0123"], "rejected the room token")):
        r = subprocess.run([sys.executable, "-m", "tabcohort", "rank", "--server", cluster.url, "--room", cluster.room,
                            *extra], capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
        assert r.returncode == 2 and text in r.stderr and "Traceback" not in r.stderr, r.stderr
    # serve says how a tab joins it (a new user found no word on the page's ?token=, README or serve)
    said = cluster.server.text()
    assert f"  tabs: {cluster.url}/?room={cluster.room}&token=... (the room token" in said, said
    assert "room-token-s3cret-0123" not in said, said


def test_a_refused_trainer_token_is_a_clear_error_with_the_hint_and_no_unclosed_session(cluster):
    # (it was "tabcohort: error: server refused the link (close 4001: bad trainer token)", exit 1,
    # then aiohttp's "Unclosed client session" from the socket the refused bus left open)
    cluster.serve("--dataset", "synthetic")
    wrong = "a-wrong-trainer-token-0123"
    for args, env, named in ((["--trainer-token", wrong], {}, "--trainer-token='<hidden>'"),
                             ([], {"TABCOHORT_TRAINER_TOKEN": wrong}, "TABCOHORT_TRAINER_TOKEN='<hidden>'")):
        r = subprocess.run([sys.executable, "-m", "tabcohort", "rank", "--server", cluster.url, "--room", cluster.room,
                            *args], capture_output=True, text=True, timeout=60, env={**_env(), **env}, cwd=ROOT)
        out = r.stdout + r.stderr
        assert r.returncode == 2 and f"configuration error: {named}: the server refused the trainer token" in r.stderr, out
        assert "--any-rank-may-lead" in r.stderr and ".trainer-token" in r.stderr, out
        assert "Unclosed" not in out and "Traceback" not in out and wrong not in out, out
    assert cluster.state()["drops"].get("bad_trainer_token") == 2
    # refused at its first request (GET .../job, 403), before the job's code, data and checkpoint
    # were downloaded: it used to be refused only at its register, after them (no rank registered)
    metrics = urllib.request.urlopen(f"{cluster.url}/metrics", timeout=5).read().decode()
    assert 'tabcohort_server_refused_total{reason="auth_failed"} 2.0' in metrics, metrics[-2000:]
    assert cluster.state()["ranks"] == []


def test_a_bad_trainer_token_is_named_and_never_shown():
    with pytest.raises(ConfigError) as e:
        cfg({"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d",
             "TABCOHORT_TRAINER_TOKEN": "secret but short"[:10]}).validate()
    assert e.value.variable == "TABCOHORT_TRAINER_TOKEN" and e.value.value == "<hidden>"
    assert "secret" not in str(e.value)
    ok = cfg({"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d",
              "TABCOHORT_TRAINER_TOKEN": "a-long-enough-trainer-token"})
    ok.validate()
    assert ok.trainer_token == "a-long-enough-trainer-token"


def test_a_bad_discovery_timeout_is_named_even_without_discovery():
    for env, named in (({"TABCOHORT_DISCOVER_TIMEOUT": "xx"}, "TABCOHORT_DISCOVER_TIMEOUT"),
                       ({"TABCOHORT_DISCOVER_TIMEOUT": "nan"}, "TABCOHORT_DISCOVER_TIMEOUT")):
        with pytest.raises(ConfigError) as e:
            cfg({"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d", **env}).validate()
        assert e.value.variable == named
    cfg({"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d"}).validate()   # the default


def test_a_room_token_too_short_is_named_before_connecting():
    # (it was refused by the server after the job download, as "the server rejected the room token")
    with pytest.raises(ConfigError) as e:
        cfg({"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d", "TABCOHORT_TOKEN": "short"}).validate()
    assert e.value.variable == "TABCOHORT_TOKEN" and e.value.value == "<hidden>" and "16..256" in e.value.reason
    with pytest.raises(ConfigError) as e:
        cfg({}, server="http://127.0.0.1:1", room="d", token="has a space in it!").validate()
    assert e.value.variable == "--token"
    for ok in ("", "a-long-enough-room-token"):
        cfg({"TABCOHORT_SERVER": "http://127.0.0.1:1", "TABCOHORT_ROOM": "d", "TABCOHORT_TOKEN": ok}).validate()


def test_an_unknown_backend_is_named_before_connecting():
    with pytest.raises(ConfigError) as e:
        cfg({}, server="http://127.0.0.1:1", room="d", backend="foo").validate()
    assert e.value.variable == "--backend" and e.value.value == "foo" and "numpy" in e.value.reason


def test_a_room_missing_on_the_server_and_a_server_that_is_not_tabcohort_are_told_apart(cluster):
    # a rank pointed at some other HTTP server said "no such room on the server"
    import http.server
    import threading

    cluster.serve()
    r = subprocess.run([sys.executable, "-m", "tabcohort", "rank", "--server", cluster.url, "--room", "nope"],
                       capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
    assert r.returncode == 2 and "--room='nope': no such room on the server" in r.stderr, r.stderr
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{other.server_address[1]}"
        r = subprocess.run([sys.executable, "-m", "tabcohort", "rank", "--server", url, "--room", "digits"],
                           capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
    finally:
        other.shutdown()
        other.server_close()
    assert r.returncode == 2 and f"--server='{url}'" in r.stderr and "no tabcohort error" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_rank_of_a_token_room_follows_a_nodes_redirect_with_its_token(cluster):
    # a review: a cluster node answers a room it does not own with 307 to the owner, and aiohttp
    # drops Authorization on a redirect to another origin: a rank of a token room pointed at
    # such a node was refused its own token. Here a plain redirector stands in for that node.
    import asyncio

    import aiohttp
    from aiohttp import web

    from tabcohort.runtime.native import RankRun

    cluster.serve("--token", "room-token-s3cret-0123", "--dataset", "synthetic")

    async def main() -> dict:
        async def moved(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(cluster.url + request.path_qs)
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", moved)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            cfg = RankConfig.from_sources({"server": f"http://127.0.0.1:{port}", "room": cluster.room,
                                           "token": "room-token-s3cret-0123"}, {})
            async with aiohttp.ClientSession() as http:
                return await RankRun(cfg)._get(http, "/job")
        finally:
            await runner.cleanup()
    job = asyncio.run(main())
    assert job["room"] == cluster.room and job["bucket_len"] > 0, job


def test_an_https_url_for_a_plain_http_server_fails_at_once_with_the_hint(cluster):
    # a new-user trial: the rank retried the TLS handshake for the whole 30 s, "waiting for the
    # server" (ClientConnectorSSLError), as if the server were still starting
    http_url = cluster.serve()
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "rank", "--server", http_url.replace("http://", "https://"),
                        "--room", cluster.room], env=_env(), cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode != 0 and took < 20, (took, out)
    assert "TLS handshake failed" in out and f"try {http_url}" in out and "Traceback" not in out, out


def test_serve_on_every_interface_prints_links_a_machine_can_open(cluster):
    """`serve --host 0.0.0.0`: the links and the URL name this machine's routable address (here,
    in a network namespace with loopback only, 127.0.0.1), never 0.0.0.0, which no other machine
    can open and where a page is no secure context (a new-user trial)."""
    url = cluster.serve("--host", "0.0.0.0")
    text = cluster.server.text()
    assert url.startswith("http://127.0.0.1:") and "0.0.0.0:" not in text, text
    assert "listening on every interface (0.0.0.0)" in text, text
    p = cluster.rank()                          # (the URL it printed works)
    wait_for(lambda: cluster.state()["step"] >= 5, 60, "a rank training through the printed URL")
    p.kill()


def test_a_token_given_for_an_open_room_is_said_not_to_be_checked(cluster):
    """A rank given --token for a room serve opened (no --token) joined without a word, and its
    user took the room for a protected one (a new-user trial): it says the room is open."""
    cluster.serve()
    p = cluster.rank("--token", "a-token-nobody-checks-0123")
    wait_for(lambda: "is open (serve gave it no --token)" in p.text(), 60, "the rank's note")
    wait_for(lambda: cluster.state()["step"] >= 5, 60, "the rank training")
    p.kill()


def test_a_rank_without_a_room_joins_the_server_s_only_room(cluster):
    """``--room`` was required even of a server with one room (a new user's first command named
    the server only): the rank takes the server's only room and says so."""
    from .conftest import Proc
    cluster.serve()
    p = Proc(["rank", "--server", cluster.url], cluster.tmp / "roomless.log",
             env={"TABCOHORT_TRAINER_TOKEN": cluster.trainer_token})
    cluster.procs.append(p)
    wait_for(lambda: f"room {cluster.room}: the server's only room (no --room given)" in p.text(), 60, "the rank's line")
    wait_for(lambda: cluster.state()["step"] >= 5, 60, "the rank training")
    p.kill()


def test_a_rank_without_a_room_is_told_the_rooms_of_a_server_with_several(tmp_path):
    """Several rooms (or none): ``--room`` is named with the rooms listed, before joining any; a
    listed name that is no room name (untrusted: it came over the network) is not shown."""
    import http.server
    import json
    import threading

    listing = {"rooms": [{"room": "digits"}, {"room": "<b>x</b>"}, {"room": "cnn"}, {"room": 7}]}

    class Rooms(http.server.BaseHTTPRequestHandler):
        def do_GET(self):   # noqa: N802 (http.server's name)
            body = json.dumps(listing if self.path == "/api/rooms" else {"error": "no"}).encode()
            self.send_response(200 if self.path == "/api/rooms" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Rooms)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        r = subprocess.run([sys.executable, "-m", "tabcohort", "rank", "--server", url],
                           capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
        assert r.returncode == 2 and "--room=''" in r.stderr and "has 2 rooms; its rooms: digits, cnn" in r.stderr, \
            r.stderr
        assert "<b>" not in r.stderr and "Traceback" not in r.stderr, r.stderr
        listing["rooms"] = []
        r = subprocess.run([sys.executable, "-m", "tabcohort", "rank", "--server", url],
                           capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
        assert r.returncode == 2 and "has 0 rooms; it has none" in r.stderr, r.stderr
        listing["rooms"] = [{"room": ".."}]        # (no room name: the server refuses it too)
        r = subprocess.run([sys.executable, "-m", "tabcohort", "rank", "--server", url],
                           capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
        assert r.returncode == 2 and "has 0 rooms" in r.stderr, r.stderr
        listing.clear()                             # (no list at all: another server's JSON)
        r = subprocess.run([sys.executable, "-m", "tabcohort", "rank", "--server", url],
                           capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
        assert r.returncode == 2 and "with HTTP 200 and no list of rooms: is this the URL" in r.stderr, r.stderr
    finally:
        srv.shutdown()
        srv.server_close()
