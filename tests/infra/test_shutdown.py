"""opid_mega.infra.shutdown: SIGTERM / SIGHUP take Ctrl-C's path, a checkpoint write holds them, the launched process
groups are stopped, and the watchdog ends a process whose main thread is blocked (issue 22, item 6).

The handlers and the watchdog are process-wide, so every case that installs them runs in a child process (the
pytest process must keep its own SIGINT behaviour); the checkpoint hold is tested in-process with the handler only.
"""
import os
import platform
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from opid_mega.infra import shutdown

# The child: registers a process group (`sleep`, its own session, like a launched server), starts a plain child
# process (like an env worker: in the child's own process group), installs the handlers, prints READY, then waits in the main thread. BLOCK=1: SIGTERM/SIGHUP blocked in the main thread only, so the signal
# lands on another thread and the main thread stays in its sleep (as in a gloo collective): only the watchdog can end
# it. Otherwise the interrupt is raised in the main thread, which reports and exits like opid-train.
CHILD = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from opid_mega.infra import shutdown
    group = subprocess.Popen(["sleep", "600"], start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    shutdown.register_group(group.pid, "a server")
    plain = subprocess.Popen(["sleep", "601"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shutdown.install_signal_handlers("child", grace_s=float(os.environ["GRACE"]))
    if os.environ.get("BLOCK") == "1":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP})
    try:
        print("READY", group.pid, plain.pid, flush=True)
        time.sleep(60)
    except KeyboardInterrupt as e:
        signum = shutdown.signal_of(e)
        print(f"child: {shutdown.describe(signum)}", file=sys.stderr, flush=True)
        shutdown.exit_now(128 + signum)
    sys.exit(5)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _child(tmp_path, block: bool, grace: float = 2.0, preexec=None):
    env = {**os.environ, "GRACE": str(grace), "BLOCK": "1" if block else "0"}
    if preexec is None:  # a SIGHUP ignored by whoever started pytest (nohup) would stay ignored in the child
        preexec = lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    line = proc.stdout.readline().split()
    assert line and line[0] == "READY", proc.communicate(timeout=30)
    return proc, int(line[1]), int(line[2])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_takes_the_interrupt_path_and_stops_the_groups(tmp_path, sig):
    proc, group, plain = _child(tmp_path, block=False, grace=30.0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    # the interrupt path's one line, not the watchdog's ("still running 30 s after the signal"): no waiting
    assert proc.returncode == 128 + sig
    assert err.strip().splitlines() == [f"child: stopped by {signal.Signals(sig).name}"]
    assert not _alive(group) and not _alive(plain)


# clock_nanosleep's syscall number (time.sleep), by machine
_SLEEP_SYSCALL = {"x86_64": 230, "aarch64": 115}


def _wait_until_sleeping(pid: int, timeout_s: float = 30.0) -> None:
    """Until the child's main thread is inside time.sleep's system call. Before that it still runs bytecode, and
    CPython runs a Python signal handler in the main thread whatever that thread's signal mask (the C handler runs on
    the watchdog thread and sets the interpreter's flag): a SIGTERM sent in that window is handled at once."""
    want = _SLEEP_SYSCALL.get(platform.machine())
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/syscall") as f:
                nr = f.read().split()[0]
        except (OSError, IndexError):
            nr = None
        if want is None or nr is None:  # no syscall file here: a pause long enough for a few bytecodes
            time.sleep(1.0)
            return
        if nr == str(want):
            return
        time.sleep(0.01)
    raise AssertionError(f"the child's main thread never reached time.sleep (syscall {nr})")


def test_watchdog_ends_a_process_whose_main_thread_is_blocked(tmp_path):
    proc, group, plain = _child(tmp_path, block=True, grace=2.0)
    _wait_until_sleeping(proc.pid)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    # the watchdog after its 2 s grace (not before); the upper bound only catches a wait far past it (the child's
    # sleep ends after 60 s with exit 5)
    assert proc.returncode == 128 + signal.SIGTERM and 2.0 <= elapsed < 30.0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("child: SIGTERM: still running 2 s after the signal"), lines
    assert not _alive(group) and not _alive(plain)


def test_an_inherited_ignored_sighup_stays_ignored(tmp_path):
    """nohup: a SIGHUP the run was started to ignore does not stop it."""
    proc, group, plain = _child(tmp_path, block=False, grace=30.0,
                                preexec=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert proc.poll() is None and _alive(group)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and not _alive(group) and not _alive(plain)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_checkpoint_write_holds_sigterm_and_sighup(sig):
    from opid_mega.megatron.checkpoint import _ctrl_c_after_write

    before = signal.signal(sig, shutdown._raise_interrupt)  # what install_signal_handlers sets (no watchdog here)
    try:
        reached_end = False
        with pytest.raises(shutdown.Interrupted) as exc:
            with _ctrl_c_after_write():
                assert shutdown.writing_now()
                os.kill(os.getpid(), sig)
                sum(range(100_000))  # bytecode runs: a pending signal's handler would run here
                reached_end = True
        assert reached_end and exc.value.signum == sig and not shutdown.writing_now()
        assert signal.getsignal(sig) is shutdown._raise_interrupt
    finally:
        signal.signal(sig, before)
        shutdown._interrupted.clear()
