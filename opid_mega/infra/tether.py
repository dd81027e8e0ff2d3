"""Servers end with the process that launched them; what a dead earlier start left behind is found and stopped.

The trainer launches SGLang servers and the router in their own sessions (a terminal's Ctrl-C reaches the trainer
alone: opid_mega.infra.shutdown). A rank killed without a chance to stop them (SIGKILL, the OOM killer) would leave
them running, holding GPU memory, cores and ports. Two guards:

* A watch on the owner. The launching process puts `OPID_OWNER=<pid>:<start time>` into the child's environment
  (`owner_env`); the child runs through `python -m opid_mega.infra.keyed`, which calls `watch_owner()` before the
  server module starts: it forks a small watcher process into the server's process group that checks every
  `POLL_S` (0.5 s) whether the owner still runs (same pid and start time) and, once it does not, sends SIGKILL to
  the whole group (the server, its scheduler and detokenizer children, itself). When the server exits first, the
  watcher keeps watching for as long as anything else of the group runs (a server that died leaves its children),
  and exits once it is alone. A separate process, so a server holding the GIL in native code cannot delay it, and a watch on
  the owner process rather than a parent-death signal: PR_SET_PDEATHSIG fires when the launching *thread* exits, and
  servers are launched from short-lived threads (opid_mega.rollout.fleet.launch_fleet).
* A record per launched process in the run directory (`<log dir>/pids/<host>.<pid>.json`: pid, its start time,
  the boot, the owner's pid and start time), written at launch and removed at a clean stop. Before launching, a
  start sweeps the records of this host (`sweep`): a recorded process that still runs with the recorded start time
  (so never a pid reused by something else) and whose owner is gone is reported in one line and stopped (its
  process group: SIGTERM, then SIGKILL after 5 s); records of processes that are gone are removed. A process whose
  owner still runs belongs to a live start and is left alone.

The start time is field 22 of /proc/PID/stat (clock ticks since boot), and it is always recorded: a process whose
start time cannot be told (gone already, or no /proc: not Linux) gets no record and no watcher, and a pid whose
recorded start time is unknown matches nothing (it could be anyone's by now).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from opid_mega.infra.shutdown import group_members

OWNER_ENV = "OPID_OWNER"
POLL_S = 0.5
RECORDS = "pids"


def start_time(pid: int) -> Optional[int]:
    """Field 22 of /proc/PID/stat (start time, clock ticks after boot) of a running process; None when it is gone, a
    zombie, or cannot be told (no /proc)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
    except OSError:
        return None
    if fields[0] in ("Z", "X"):  # fields[0] is field 3 (state); field 22 is fields[19]
        return None
    return int(fields[19])


def running(pid: int, start: Optional[int]) -> bool:
    """The process `pid` runs and is the one that started at `start` (not a later process given the same pid). A
    start time that was never known (None, 0) matches nothing: such a pid could be anyone's by now."""
    return bool(start) and start_time(pid) == start


def exit_with_owner(owner_pid: int, owner_start: Optional[int], poll_s: float = POLL_S,
                    preload: tuple = ()) -> None:
    """For a helper process that serves its owner until told to stop (a multiprocessing Manager's server, given this
    as its initializer): a daemon thread ends the process once the owner (pid and start time) is gone, so a SIGKILLed
    owner does not leave it running for good. Nothing is watched when the owner's start time is unknown. `preload`:
    modules a daemon thread imports in the background while the helper serves, rather than the first request that
    needs them (a Manager's server imports the classes of what it is sent when it unpickles them; a request that
    comes before the import is done waits for it). In the background, so the helper starts as fast as without."""
    import importlib
    import threading

    if preload:
        threading.Thread(target=lambda: [importlib.import_module(name) for name in preload], name="preload",
                         daemon=True).start()
    if not owner_start:
        return

    def watch():
        while running(owner_pid, owner_start):
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="owner-watch", daemon=True).start()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def owner_env(pid: Optional[int] = None) -> dict:
    """The environment entry that ties a launched child to `pid` (default: this process); empty where its start time
    cannot be told (no /proc: the child then runs untied)."""
    pid = os.getpid() if pid is None else int(pid)
    start = start_time(pid)
    return {OWNER_ENV: f"{pid}:{start}"} if start else {}


def _parse_owner(value: str) -> Optional[tuple[int, int]]:
    try:
        pid, start = value.split(":")
        return int(pid), int(start)
    except ValueError:
        return None


def watch_owner(poll_s: float = POLL_S) -> Optional[int]:
    """In a launched child, before it runs its server: read (and remove) $OPID_OWNER and fork a watcher that kills
    this process's group once the owner is gone. Returns the watcher's pid, or None without $OPID_OWNER."""
    value = os.environ.pop(OWNER_ENV, "")
    owner = _parse_owner(value) if value else None
    if owner is None or not owner[1]:
        if value:
            print(f"opid_mega.infra.tether: ignoring ${OWNER_ENV}={value!r} (expected PID:START)", file=sys.stderr)
        return None
    server = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child:
        return child
    try:  # the watcher: plain system calls only (forked from a process that may hold threads)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the owner, which stops the group itself
        group, me = os.getpgrp(), os.getpid()
        leads = group == server  # the server leads its own group (how it is launched): the whole group is ours
        while True:
            time.sleep(poll_s)
            if leads:  # the group lives on while any member but this watcher does, the server's children included
                if not [p for p in group_members(group) if p != me]:
                    break  # nothing left to watch
            elif os.getppid() != server:  # the server exited
                break
            if not running(*owner):
                try:
                    if leads:
                        os.killpg(group, signal.SIGKILL)
                    else:
                        os.kill(server, signal.SIGKILL)
                except OSError:
                    pass
                break
    finally:
        os._exit(0)


# ---- records in the run directory ----------------------------------------------------------------------------------
def _records(directory) -> Path:
    return Path(directory) / RECORDS


def record(directory, pid: int, what: str) -> Optional[Path]:
    """Note a process this process launched (the leader of its own group) under `directory`/pids, with its start time
    and ours. None (no record) when its start time cannot be told: it is gone already, or there is no /proc; a
    record without one could later name whatever process reuses the pid."""
    start, own = start_time(pid), start_time(os.getpid())
    if not start or not own:
        return None
    d = _records(directory)
    d.mkdir(parents=True, exist_ok=True)
    entry = {"pid": int(pid), "start": start, "boot": _boot_id(), "host": socket.gethostname(),
             "owner_pid": os.getpid(), "owner_start": own, "what": str(what)}
    path = d / f"{entry['host']}.{int(pid)}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entry) + "\n")
    os.replace(tmp, path)
    return path


def forget(directory, pid: int) -> None:
    """Drop the record of `pid` (it was stopped cleanly)."""
    try:
        (_records(directory) / f"{socket.gethostname()}.{int(pid)}.json").unlink()
    except OSError:
        pass


def _stop_group(pid: int, start: int, timeout_s: float) -> None:
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 2.0)):
        if not running(pid, start):
            return
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        end = time.monotonic() + wait
        while time.monotonic() < end and running(pid, start):
            time.sleep(0.1)


def sweep(directory, timeout_s: float = 5.0, out=None) -> list[int]:
    """Stop what a dead earlier start left under `directory`/pids on this host (see the module docstring), one line
    each on `out` (stderr by default). Returns the pids stopped."""
    d = _records(directory)
    if not d.is_dir():
        return []
    out = out or sys.stderr
    host, boot, stopped = socket.gethostname(), _boot_id(), []
    for path in sorted(d.glob(f"{host}.*.json")):
        try:
            entry = json.loads(path.read_text())
            pid, start = int(entry["pid"]), int(entry["start"])
            owner = int(entry["owner_pid"]), int(entry["owner_start"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours to read
        if entry.get("boot", "") != boot or not running(pid, start):
            try:
                path.unlink()
            except OSError:
                pass
            continue
        if running(*owner):
            continue  # a live start's own process
        print(f"opid: stopping a leftover {entry.get('what') or 'process'} (pid {pid}) that an earlier start of this "
              f"run (pid {owner[0]}, gone) left running; record {path}", file=out, flush=True)
        _stop_group(pid, start, timeout_s)
        stopped.append(pid)
        try:
            path.unlink()
        except OSError:
            pass
    return stopped
