"""Launched servers end with their launcher; a start stops what a dead earlier start left (opid_mega.infra.tether).

The "server" here is Python's http.server run through opid_mega.infra.keyed exactly as the SGLang servers and the
router are (own session, $OPID_OWNER, a record in the run directory); the launcher is a separate Python process that
the test SIGKILLs, as the OOM killer would a rank.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from procs import group_members

from opid_mega.infra import tether

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")

LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    from opid_mega.infra import tether
    run_dir, tie, module = sys.argv[1], sys.argv[2] == "tie", sys.argv[3:]
    env = {**os.environ, **(tether.owner_env() if tie else {})}
    p = subprocess.Popen([sys.executable, "-m", "opid_mega.infra.keyed", *module],
                         env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tether.record(run_dir, p.pid, "test server")
    print(p.pid, flush=True)
    time.sleep(600)
""")
HTTP_SERVER = ["http.server", "0", "--bind", "127.0.0.1"]
# a server with a child process in its group, as SGLang's scheduler and detokenizer are
SERVER_WITH_CHILD = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(600)
""")


def _launch(run_dir, tie: bool, module=None, members=None):
    """(launcher process, server pid) once the server group holds the server, its other `members` and, when tied,
    its watcher."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if module is None:
        module = HTTP_SERVER
    else:  # a module of the test's own, importable by the server
        (run_dir / "server_with_child.py").write_text(module)
        env["PYTHONPATH"] = os.pathsep.join([str(run_dir), env.get("PYTHONPATH", "")])
        module = ["server_with_child"]
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(run_dir), "tie" if tie else "free", *module],
                                stdout=subprocess.PIPE, text=True, env=env)
    server = int(launcher.stdout.readline())
    want = (2 if tie else 1) + (members or 0)
    t0 = time.monotonic()
    while len(group_members(server)) < want and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    assert len(group_members(server)) == want, group_members(server)
    return launcher, server


def _wait_gone(pgid: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while group_members(pgid) and time.monotonic() - t0 < timeout_s:
        time.sleep(0.05)
    return time.monotonic() - t0


def _owner_killed(launcher, server: int) -> float:
    """SIGKILL the launcher (the servers' owner), as the OOM killer would; seconds until the server's group is
    empty (at most 10)."""
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    return _wait_gone(server, 10.0)


def _killgroup_members(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_start_time_is_field_22_and_none_for_the_gone():
    p = subprocess.Popen(["sleep", "30"])
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            expected = int(f.read().split()[21])  # "sleep" has no space in its name: plain split is field 22
        assert tether.start_time(p.pid) == expected
        assert tether.start_time(p.pid) >= tether.start_time(os.getpid())
        assert tether.running(p.pid, expected) and not tether.running(p.pid, expected + 1)
    finally:
        p.kill()
        p.wait()
    assert tether.start_time(p.pid) is None and not tether.running(p.pid, expected)


def test_sigkilled_launcher_takes_its_server_along(tmp_path):
    launcher, server = _launch(tmp_path, tie=True)
    try:
        assert launcher.poll() is None
        gone_s = _owner_killed(launcher, server)
        print(f"server group gone {gone_s:.2f} s after SIGKILL of its launcher")
        assert not group_members(server), "the server outlived its SIGKILLed launcher by 10 s"
    finally:
        launcher.kill()
        _killgroup_members(server)
    # the record of the dead start is swept without a kill and without a line (nothing was left)
    lines = []
    assert tether.sweep(tmp_path, out=_Lines(lines)) == [] and lines == []
    assert not list((tmp_path / "pids").glob("*.json"))


def test_the_server_exiting_first_ends_the_watcher(tmp_path):
    launcher, server = _launch(tmp_path, tie=True)
    try:
        watcher = [p for p in group_members(server) if p != server][0]
        os.kill(server, signal.SIGKILL)  # only the server: the watcher must notice and exit by itself
        t0 = time.monotonic()
        while tether.start_time(watcher) is not None and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert tether.start_time(watcher) is None
        assert launcher.poll() is None  # the launcher is not touched
    finally:
        launcher.kill()
        launcher.wait()
        _killgroup_members(server)


def test_the_group_dies_with_its_owner_when_the_server_died_first(tmp_path):
    """The server (the group's leader) dies alone, leaving its child in the group: the watcher stays while the owner
    lives, and once the owner is gone the child goes too (before, the watcher left with the server)."""
    launcher, server = _launch(tmp_path, tie=True, module=SERVER_WITH_CHILD, members=1)
    try:
        watcher_and_child = [p for p in group_members(server) if p != server]
        os.kill(server, signal.SIGKILL)
        time.sleep(2.0)
        assert sorted(group_members(server)) == sorted(watcher_and_child)  # the owner lives: nothing else is killed
        gone_s = _owner_killed(launcher, server)
        print(f"the server's child gone {gone_s:.2f} s after its owner's SIGKILL (the server died first)")
        assert not group_members(server), "the server's child outlived the owner by 10 s"
    finally:
        launcher.kill()
        launcher.wait()
        _killgroup_members(server)


def test_start_times_are_always_recorded_and_an_unknown_one_matches_no_process(tmp_path):
    """A record whose start time is unknown (0) names a live process of someone else now (its pid reused) whose owner
    is gone: the sweep removes the record and kills nothing (before, start time 0 matched any process of that
    pid). A process already gone gets no record; the owner's entry always carries a start time."""
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        assert tether.record(tmp_path, gone.pid, "gone at once") is None
        assert not tether.running(bystander.pid, 0) and not tether.running(bystander.pid, None)
        pid, start = tether.owner_env()[tether.OWNER_ENV].split(":")
        assert int(pid) == os.getpid() and int(start) == tether.start_time(os.getpid()) > 0
        (tmp_path / "pids").mkdir(exist_ok=True)
        stale = tmp_path / "pids" / f"{os.uname().nodename}.{bystander.pid}.json"
        stale.write_text(json.dumps({"pid": bystander.pid, "start": 0, "boot": tether._boot_id(),
                                     "host": os.uname().nodename, "owner_pid": gone.pid, "owner_start": 1,
                                     "what": "a record from before start times"}))
        lines = []
        assert tether.sweep(tmp_path, out=_Lines(lines)) == [] and lines == []
        assert bystander.poll() is None and not stale.exists()
    finally:
        bystander.kill()
        bystander.wait()


class _Lines:
    def __init__(self, into):
        self.into = into

    def write(self, s):
        self.into.extend(ln for ln in s.splitlines() if ln.strip())

    def flush(self):
        pass


def test_a_restart_reports_and_stops_leftovers_and_nothing_else(tmp_path):
    # an untied server (as left by a watcher that was itself killed) outlives its SIGKILLed launcher
    dead, leftover = _launch(tmp_path, tie=False)
    live, running_server = _launch(tmp_path, tie=True)  # a live start's own server in the same directory
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        time.sleep(1.0)
        assert group_members(leftover), "the untied server should outlive its launcher"
        # a record naming a live pid with another start time (a pid reused since): removed, never killed
        reused = tmp_path / "pids" / f"{os.uname().nodename}.{bystander.pid}.json"
        entry = json.loads(next((tmp_path / "pids").glob(f"*.{leftover}.json")).read_text())
        reused.write_text(json.dumps({**entry, "pid": bystander.pid, "start": tether.start_time(bystander.pid) - 1}))
        lines = []
        assert tether.sweep(tmp_path, out=_Lines(lines)) == [leftover]
        assert len(lines) == 1 and f"pid {leftover}" in lines[0] and "test server" in lines[0], lines
        assert not group_members(leftover)
        assert bystander.poll() is None and not reused.exists()
        assert len(group_members(running_server)) == 2  # the live start's server and its watcher: untouched
        remaining = sorted(p.name for p in (tmp_path / "pids").glob("*.json"))
        assert remaining == [f"{os.uname().nodename}.{running_server}.json"], remaining
    finally:
        for p in (dead, live, bystander):
            p.kill()
            p.wait()
        _killgroup_members(leftover)
        _wait_gone(running_server, 10.0)
        _killgroup_members(running_server)
