"""Termination signals, and the process groups this process launched (servers, the router).

Every server the trainer starts (SGLang rollout and analyzer servers, sglang-router) runs in its own session, so a
terminal's Ctrl-C reaches the trainer alone and the trainer stops them in order. They register their process group
here (`register_group`); `stop_all()` stops every group still registered (SIGTERM, a short wait, SIGKILL).

`install_signal_handlers()` (opid-train, on every torchrun rank): SIGTERM and SIGHUP take the path of Ctrl-C
(SIGINT): they raise :class:`Interrupted` (a KeyboardInterrupt) in the main thread, so a checkpoint write in
progress completes first (opid_mega.megatron.checkpoint holds the three signals while it writes), then the
trainer's `finally` blocks shut the servers down, then opid-train prints one line and exits with 128 + signum
(`exit_now`). A signal whose disposition was inherited as ignored (nohup, a background job) stays ignored.

A watchdog thread sees every such signal at once (signal.set_wakeup_fd), even while the main thread is blocked in
C code (a gloo collective waiting for rank 0): if the process has not exited `grace_s` seconds (20 by default) after
the signal, not counting a checkpoint write in progress (during which the servers are stopped at once: the write
does not need them), it stops every registered group and exits with 128 + signum itself. So under torchrun, whose
agent sends SIGTERM to every rank and SIGKILL ~30 s later, each node's first rank stops its node's servers.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_lock = threading.Lock()
_groups: dict[int, str] = {}  # pgid -> what it is (for messages)
_stopping = threading.Event()  # stop_all() ran: nothing new may be launched
_writing = 0  # checkpoint writes in progress (nested: count)
_writing_done = threading.Condition(_lock)
_interrupted: list[int] = []  # the signals raised as Interrupted so far (the first one raises, later ones are kept)
_exiting = threading.Event()  # exit_now() is running
_watchdog: Optional[threading.Thread] = None


class Interrupted(KeyboardInterrupt):
    """SIGTERM / SIGHUP (SIGINT raises a plain KeyboardInterrupt); `signum` is the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)
        _interrupted.append(self.signum)  # later SIGTERM / SIGHUP no longer raise (the shutdown is under way)


def signal_of(exc: BaseException) -> int:
    """The signal behind an interrupt: Interrupted's own, else SIGINT (Ctrl-C)."""
    return getattr(exc, "signum", signal.SIGINT)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def describe(signum: int) -> str:
    """How a run ended by `signum` is described in its one line: "interrupted" (Ctrl-C), "stopped by SIGTERM"."""
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}"


# ---- launched process groups -------------------------------------------------------------------------------------
def register_group(pgid: int, what: str = "") -> None:
    """A process group this process launched (its leader's pid). Stopped at once when stop_all() already ran."""
    with _lock:
        _groups[int(pgid)] = what
    if _stopping.is_set():
        _kill_groups([int(pgid)], 0.5)


def unregister_group(pgid: int) -> None:
    with _lock:
        _groups.pop(int(pgid), None)


def stopping() -> bool:
    """True once stop_all() ran: a launcher must not start anything new (and a wait for a server gives up)."""
    return _stopping.is_set()


def _kill_groups(pgids, timeout_s: float) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and any(_group_has_processes(p) for p in pgids):
        time.sleep(0.05)
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def group_members(pgid: int) -> list[int]:
    """The live processes (not zombies: a stopped leader stays one until its parent reaps it) of group `pgid`
    (Linux /proc; empty without it)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    return [pid for pid, fields in _proc_stats(names) if fields[2] == str(pgid) and fields[0] not in ("Z", "X")]


def _group_has_processes(pgid: int) -> bool:
    """A live process is in group `pgid`."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    return bool(group_members(pgid))


def _proc_stats(names: list):
    """(pid, the /proc/<pid>/stat fields after the command name: state, ppid, pgrp, ...) of every process among the
    /proc entries `names` that can still be read."""
    for d in names:
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    yield int(d), f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue


def stop_all(timeout_s: float = 5.0) -> list[int]:
    """SIGTERM every registered process group, wait up to `timeout_s` for them, SIGKILL what is left. Returns the
    pgids it signalled. Idempotent; after it, launching is refused (`stopping()`)."""
    _stopping.set()
    with _lock:
        pgids = list(_groups)
        _groups.clear()
    if pgids:
        _kill_groups(pgids, timeout_s)
    return pgids


def _descendants(root: int) -> list[int]:
    """The pids of every live descendant of `root` (Linux /proc; elsewhere multiprocessing's children)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        import multiprocessing

        return [p.pid for p in multiprocessing.active_children()]
    parent = {pid: int(fields[1]) for pid, fields in _proc_stats(names) if fields[0] != "Z"}
    out, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def stop_children(timeout_s: float = 2.0) -> None:
    """SIGTERM every descendant process still running (env worker processes, checkpoint writers: what the
    interpreter's exit handlers would have stopped), SIGKILL what is left after `timeout_s`."""
    kids = _descendants(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in kids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.monotonic() + (timeout_s if sig == signal.SIGTERM else 0.0)
        while time.monotonic() < end and set(kids) & set(_descendants(os.getpid())):
            time.sleep(0.05)
        kids = [k for k in kids if k in set(_descendants(os.getpid()))]
        if not kids:
            return


def exiting() -> bool:
    """True once exit_now() runs: the process is on its way out."""
    return _exiting.is_set()


def exit_now(code: int, timeout_s: float = 5.0) -> None:
    """Stop every registered group (`stop_all(timeout_s)`) and every other child process (`stop_children`), flush
    stdout/stderr and leave with `code` at once (os._exit: threads still waiting on a socket or a collective would
    otherwise hold the interpreter's exit)."""
    _exiting.set()
    try:
        stop_all(timeout_s)
        stop_children(min(timeout_s, 2.0))
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        os._exit(code)


# ---- checkpoint writes ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def writing():
    """Marks a checkpoint write in progress (the watchdog waits for it before it exits the process)."""
    global _writing
    with _lock:
        _writing += 1
    try:
        yield
    finally:
        with _lock:
            _writing -= 1
            _writing_done.notify_all()


def writing_now() -> bool:
    with _lock:
        return _writing > 0


# ---- signal handlers ----------------------------------------------------------------------------------------------
def _raise_interrupt(signum, frame):  # noqa: ARG001 - signal handler signature
    # a second SIGTERM must not break the shutdown the first one started (the watchdog covers it), nor one exit_now()
    # runs (a lost node's)
    if not _interrupted and not _exiting.is_set():
        raise Interrupted(signum)


def is_interrupt_handler(handler) -> bool:
    """True for the handlers that turn a signal into an interrupt (Ctrl-C's default, ours)."""
    return handler is signal.default_int_handler or handler is _raise_interrupt


def install_signal_handlers(prog: str = "opid-train", grace_s: float = 20.0) -> None:
    """SIGTERM / SIGHUP -> Interrupted in the main thread (unless inherited as ignored), SIGINT as Python sets it,
    and the watchdog (see the module docstring). An uncaught exception while exit_now() runs (a collective broken by
    the peer whose loss ends the process) prints no traceback and waits for exit_now() to end the process with its
    code. Main thread only; idempotent."""
    global _watchdog
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _raise_interrupt)
    if _watchdog is not None:
        return
    default_hook = sys.excepthook

    def quiet_when_exiting(*exc):  # a lost node's one line stands alone: not the main thread's broken collective
        if not _exiting.is_set():
            return default_hook(*exc)
        time.sleep(60.0)  # exit_now() ends the process (with its code) from the thread that called it

    sys.excepthook = quiet_when_exiting
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):  # not the main thread of the main interpreter
        os.close(r)
        os.close(w)
        return
    _watchdog = threading.Thread(target=_watch, args=(r, prog, grace_s), name="opid-signal-watchdog", daemon=True)
    _watchdog.start()


def _watch(fd: int, prog: str, grace_s: float) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        sigs = [b for b in data if b in SIGNALS and signal.getsignal(b) is not signal.SIG_IGN]
        if sigs:
            _expire(sigs[0], prog, grace_s)
            return


def _expire(signum: int, prog: str, grace_s: float) -> None:
    """After a termination signal: wait out a checkpoint write (stopping the servers meanwhile), then `grace_s` for
    the main thread's own shutdown; if the process is still here, stop everything and exit."""
    with _lock:
        if _writing:
            pgids = list(_groups)
            _groups.clear()
        else:
            pgids = []
    if pgids:  # the write does not need the servers: stop them now, in case SIGKILL follows before the write ends
        _stopping.set()
        _kill_groups(pgids, 2.0)
    with _lock:
        while _writing:
            _writing_done.wait()
    time.sleep(grace_s)
    if _exiting.is_set():  # the main thread is on its way out (it printed its line): give it a moment more
        time.sleep(10.0)
        os._exit(128 + signum)
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: {signal_name(signum)}: still running {grace_s:.0f} s after the signal (blocked waiting on "
              f"another rank or a server); stopped its servers and exiting", file=sys.stderr, flush=True)
    exit_now(128 + signum, timeout_s=2.0)
