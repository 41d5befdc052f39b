"""The native rank's progress line: what it says beyond the numbers."""
from __future__ import annotations

import pytest

from tabcohort.runtime.native import _below_global_batch


def test_a_leader_whose_rounds_cover_less_than_the_global_batch_says_so():
    # a new user's two ranks with --batch 8 in a room of global batch 64 trained on 16 samples a
    # round with no word on it (rounds_below_global_batch rose in the report only)
    st = {"is_leader": True, "global_batch": 64, "shares": {"0000000a": 8, "0000000b": 8}}
    line = _below_global_batch(st)
    assert "rounds cover 16 of the global batch 64" in line and "--batch" in line
    assert _below_global_batch({**st, "shares": {"0000000a": 32, "0000000b": 32}}) == ""
    assert _below_global_batch({**st, "is_leader": False}) == ""          # only the leader plans
    assert _below_global_batch({**st, "global_batch": None}) == ""


def _line(st: dict) -> str:
    from tabcohort.runtime.native import RankConfig, RankRun

    out: list[str] = []
    run = RankRun(RankConfig.from_sources({"server": "http://127.0.0.1:1", "room": "d"}, {}), progress=out.append)
    run._print(1.0, {"step": 7, "leader": st.get("leader", 0xA), "cohort": 1, "loss": 0.5, "steps_per_s": 0.0,
                     "ready": True, "running": True, **st})
    return out[-1]


def test_a_follower_shows_no_accuracy_of_its_own_and_a_leader_without_majority_says_why():
    # from a new-user trial: a rank that lost the lead kept printing its last lead's accuracy as
    # if current, and a leader left alone by a server outage printed 0.0 steps/s with no reason
    assert "acc n/a (evaluated by the leader)" in _line({"is_leader": False, "accuracy": 0.972})
    assert "acc  97.2%" in _line({"is_leader": True, "accuracy": 0.972})
    assert "acc  97.2%" in _line({"is_leader": False, "running": False, "accuracy": 0.972})   # its stop line
    assert "no majority" in _line({"is_leader": True, "majority": False})
    assert "no majority" not in _line({"is_leader": True, "majority": True})


def test_the_stop_line_of_the_rank_that_led_still_says_me():
    # a stopped leader no longer leads (is_leader False), and its last line named its own id
    # as any other rank's
    assert "leader 0000000a (me)" in _line({"id": 0xA, "is_leader": False, "running": False})
    assert "(me)" not in _line({"id": 0xB, "is_leader": False, "running": False})
    assert "leader 0000000a (me)" in _line({"id": 0xA, "is_leader": True})
    # a stopped leader hears no leader (itself no longer leads): its line said "leader - (me)"
    # (a new-user trial); a follower whose leader is gone says "leader -"
    assert "leader 0000000a (me)" in _line({"id": 0xA, "is_leader": False, "running": False, "leader_live": False})
    assert "leader -  " in _line({"id": 0xB, "is_leader": False, "running": False, "leader_live": False})
    # a leader stopped before its first evaluation is not told that the leader evaluates
    line = _line({"id": 0xA, "is_leader": False, "running": False, "accuracy": None})
    assert "acc n/a " in line and "evaluated by the leader" not in line, line


def test_the_stop_line_says_the_cohort_the_rank_trained_in_not_zero():
    # a stopped rank is in no cohort (the machine counts running ranks): its last line said
    # "cohort 0" after a run of "cohort 2"
    from tabcohort.runtime.native import RankConfig, RankRun

    out: list[str] = []
    run = RankRun(RankConfig.from_sources({"server": "http://127.0.0.1:1", "room": "d"}, {}), progress=out.append)
    base = {"id": 0xA, "leader": 0xA, "loss": 0.5, "steps_per_s": 10.0, "ready": True, "is_leader": True}
    run._print(1.0, {**base, "step": 5, "cohort": 2, "running": True})
    run._print(2.0, {**base, "step": 9, "cohort": 0, "running": False, "is_leader": False})
    assert "cohort 2" in out[0] and "cohort 2" in out[1], out


def test_refused_rounds_are_said_on_the_lines_after_they_happen_not_forever():
    # a new-user trial: a job with a few NaN batches long ago put "DIVERGED x4: ..." on every line
    # of a run that trained on
    from tabcohort.runtime.native import RankConfig, RankRun

    out: list[str] = []
    run = RankRun(RankConfig.from_sources({"server": "http://127.0.0.1:1", "room": "d"}, {}), progress=out.append)
    base = {"leader": 0xA, "cohort": 2, "loss": 0.5, "steps_per_s": 10.0, "ready": True, "running": True,
            "is_leader": True, "fault": "diverged: the leader's own bucket of step 5 is not finite"}
    for step, div in ((5, 0), (9, 4), (20, 4), (30, 4), (40, 6)):
        run._print(1.0, {**base, "step": step, "diverged": div})
    lines = out
    assert "DIVERGED" not in lines[0]
    assert "DIVERGED x4 since the last line (4 in all): diverged: the leader's own bucket" in lines[1]
    assert "DIVERGED" not in lines[2] and "DIVERGED" not in lines[3]
    assert "DIVERGED x2 since the last line (6 in all)" in lines[4]
    # a rejoin's new seat counts from 0 again: its refusals are said, not hidden under the old count
    for step, div in ((50, 0), (60, 3), (70, 3)):
        run._print(1.0, {**base, "step": step, "diverged": div})
    assert "DIVERGED" not in lines[5] and "DIVERGED x3 since the last line (3 in all)" in lines[6]
    assert "DIVERGED" not in lines[7]


def test_a_rank_shows_its_share_and_a_follower_without_one_is_told_why_once():
    # a new-user trial: the demo's second rank printed lines like the leader's with no word that
    # it computed nothing (every round's 64 samples were the leader's), nor why
    from tabcohort.runtime.native import RankConfig, RankRun

    out: list[str] = []
    run = RankRun(RankConfig.from_sources({"server": "http://127.0.0.1:1", "room": "d"}, {}), progress=out.append)
    base = {"id": 0xB, "leader": 0xA, "cohort": 2, "loss": 0.5, "steps_per_s": 10.0, "ready": True,
            "running": True, "is_leader": False, "global_batch": 64}
    from tabcohort.runtime.native import NO_SHARE_LINES

    for step in range(1, NO_SHARE_LINES + 3):
        run._print(float(step), {**base, "step": step, "shares": {"0000000a": 64}})
    run._print(9.0, {**base, "step": 99, "shares": {"0000000a": 40, "0000000b": 24}})
    notes = [i for i, line in enumerate(out) if "no share: the other ranks finish the global batch" in line]
    assert notes == [NO_SHARE_LINES - 1], out                           # after a run of lines, once
    assert all("share 0/64" in line for line in out[:-1])
    assert "share 24/64" in out[-1]
    assert "share" not in _line({"id": 0xB, "global_batch": 64})        # before any round
    assert "share 64/64" in _line({"id": 0xA, "is_leader": True, "global_batch": 64, "shares": {"0000000a": 64}})


def test_a_follower_probed_now_and_then_is_told_why_it_has_no_share():
    # a new-user trial: a pure-Python follower beside a numpy leader showed "share 1/64" on some
    # lines (its one-sample probes) and "share 0/64" on the others, none of its samples was ever
    # applied, and the note never came (it needed lines without a share in a row)
    from tabcohort.runtime.native import NO_SHARE_LINES, RankConfig, RankRun

    out: list[str] = []
    run = RankRun(RankConfig.from_sources({"server": "http://127.0.0.1:1", "room": "d"}, {}), progress=out.append)
    base = {"id": 0xB, "leader": 0xA, "cohort": 2, "loss": 0.5, "steps_per_s": 10.0, "ready": True,
            "running": True, "is_leader": False, "global_batch": 64}
    for step in range(1, 2 * NO_SHARE_LINES + 1):
        probe = {"0000000b": 1} if step % 2 else {}
        run._print(float(step), {**base, "step": step, "shares": {"0000000a": 64, **probe}})
    notes = [i for i, line in enumerate(out) if "no share: the other ranks finish the global batch" in line]
    assert notes == [2 * NO_SHARE_LINES - 1], out
    # a follower with a share on most lines is never told
    out.clear()
    run = RankRun(RankConfig.from_sources({"server": "http://127.0.0.1:1", "room": "d"}, {}), progress=out.append)
    for step in range(1, 6 * NO_SHARE_LINES):
        share = {} if step % 3 == 0 else {"0000000b": 20}
        run._print(float(step), {**base, "step": step, "shares": {"0000000a": 44, **share}})
    assert not any("no share:" in line for line in out), out


def test_a_rank_whose_server_is_unreachable_says_so_on_its_lines():
    # a new-user trial: with the server gone a rank printed normal lines for 30 s, then stopped
    assert "server unreachable: reconnecting" in _line({"server_connected": False})
    assert "unreachable" not in _line({"server_connected": True})


def test_a_stop_line_behind_the_room_s_step_limit_says_so():
    # a trial's overloaded follower said "stopped (step limit 10 reached); step 7" and no more; a
    # review found the server's own reason ("steps 10 reached") never matched
    from tabcohort.runtime.native import behind_step_limit

    assert "behind the room's step limit 10" in behind_step_limit(7, 10, "server: steps 10 reached")
    assert "behind the room's step limit 10" in behind_step_limit(7, 10, "step limit 10 reached")
    assert behind_step_limit(10, 10, "server: steps 10 reached") == ""
    assert behind_step_limit(7, 10, "server: stopped by the operator") == ""
    assert behind_step_limit(7, None, "server: steps 10 reached") == ""


def test_a_takeover_and_a_server_back_are_said_once_on_the_line_after_them():
    # a new-user trial: "leader 39c374b2" became "leader 7e35d528 (me)" with no word, and the
    # unreachable note just went away when the server was back
    from tabcohort.runtime.native import RankConfig, RankRun

    out: list[str] = []
    run = RankRun(RankConfig.from_sources({"server": "http://127.0.0.1:1", "room": "d"}, {}), progress=out.append)
    base = {"step": 7, "cohort": 2, "loss": 0.5, "steps_per_s": 0.0, "ready": True, "running": True, "id": 0xB}
    for st in ({"leader": None}, {"leader": 0xA}, {"leader": 0xA, "server_connected": False},
               {"leader": 0xA, "server_connected": True}, {"leader": 0xB}, {"leader": None}, {"leader": 0xB}):
        run._print(1.0, {**base, **st})
    changed = [i for i, line in enumerate(out) if "leader changed" in line]
    back = [i for i, line in enumerate(out) if "reachable again" in line]
    assert changed == [4] and "(leader changed: was 0000000a)" in out[4], out   # (not None -> A, nor B -> None -> B)
    assert back == [3], out
    # a stop line after the server was lost says nothing of it coming back (the bus gave up)
    run._print(1.0, {**base, "leader": 0xB, "server_connected": False})
    run._print(1.0, {**base, "leader": 0xB, "server_connected": True, "running": False})
    assert "reachable again" not in out[-1], out[-1]


def test_log_records_are_the_commands_own_lines_and_timestamped_only_when_verbose():
    # (timestamped "tabcohort.bus.star WARNING ..." lines among the progress lines read as
    # another program's: a new-user trial)
    import subprocess
    import sys
    if sys.platform == "emscripten":
        import pytest
        pytest.skip("a subprocess: native tiers only")
    code = ("import logging, sys; from tabcohort.cli import _log_lines; _log_lines('rank', verbose=sys.argv[1] == 'v'); "
            "logging.getLogger('tabcohort.bus.star').warning('peer 0000000a uses the relay'); "
            "logging.getLogger('tabcohort.bus.star').debug('a detail')")
    quiet = subprocess.run([sys.executable, "-c", code, "q"], capture_output=True, text=True, timeout=60)
    assert quiet.stderr == "tabcohort rank: warning: peer 0000000a uses the relay\n", quiet.stderr
    verbose = subprocess.run([sys.executable, "-c", code, "v"], capture_output=True, text=True, timeout=60)
    lines = verbose.stderr.splitlines()
    assert len(lines) == 2 and "tabcohort.bus.star WARNING peer 0000000a" in lines[0] and "a detail" in lines[1], lines


def test_a_changed_learning_rate_is_said_once():
    # (an operator's POST .../lr changed it with no word on any rank's console: a new-user trial)
    from tabcohort.runtime.native import RankConfig, RankRun

    out: list[str] = []
    run = RankRun(RankConfig.from_sources({"server": "http://127.0.0.1:1", "room": "d"}, {}), progress=out.append)
    base = {"leader": 0xA, "cohort": 1, "loss": 0.5, "steps_per_s": 0.0, "ready": True, "running": True}
    for step, lr in ((1, 0.5), (2, 0.5), (3, 0.1), (4, 0.1)):
        run._print(1.0, {"step": step, "lr": lr, **base})
    said = [ln for ln in out if "learning rate now" in ln]
    assert len(said) == 1 and "(learning rate now 0.1, was 0.5)" in said[0] and "step      3" in said[0], out


@pytest.mark.needs_loop
def test_a_final_checkpoint_the_server_did_not_take_is_said_on_the_stop_line(capsys):
    # a new-user trial: the server was stopped mid-run, the rank trained alone until it gave up
    # reconnecting, and 13,168 steps were gone with no word; its upload error read
    # "ClientConnectorError: Cannot connect to host ... ssl:default"
    import asyncio

    import aiohttp
    from aiohttp import web

    from tabcohort.runtime.native import RankConfig, RankRun

    from .machine_helpers import SeatBus, rig

    async def main() -> tuple[str, str, str]:
        app = web.Application()
        app.router.add_put("/api/rooms/d/checkpoint", lambda request: web.Response(text="ok"))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        r = rig(1, ready=True)
        bus = SeatBus()
        bus.secret, bus.connected, bus.server_base = "s", True, f"http://127.0.0.1:{port}"
        run = RankRun(RankConfig.from_sources({"server": bus.server_base, "room": "d"}, {}), progress=print)
        async with aiohttp.ClientSession() as http:
            r.m.step = 40
            await run._upload(http, bus, r.m, r.w, lambda: "", final=False)     # stored: step 40
            ok = run._not_stored_note(40)
            await runner.cleanup()                                               # the server goes
            r.m.step = 90
            await run._upload(http, bus, r.m, r.w, lambda: "", final=True)
            gone = run._not_stored_note(90)
        fresh = RankRun(RankConfig.from_sources({"server": bus.server_base, "room": "d"}, {}), progress=print)
        async with aiohttp.ClientSession() as http:
            await fresh._upload(http, bus, r.m, r.w, lambda: "", final=True)
        return ok, gone, fresh._not_stored_note(90)

    ok, gone, never = asyncio.run(main())
    assert ok == ""
    assert "final checkpoint (step 90) was NOT stored" in gone and "the last this rank stored is of step 40" in gone, gone
    assert "this rank stored no checkpoint" in never, never
    err = capsys.readouterr().err
    assert "is unreachable (ClientConnectorError); training goes on" in err and "ssl:default" not in err, err
