"""Processes as the tests see them through /proc (Linux)."""
import os


def group_members(pgid: int) -> list:
    """Live processes (not zombies or dead) of process group `pgid`."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                out.append(int(d))
    return out


def children(ppid: int) -> dict:
    """Live children of `ppid`: pid -> command line (its arguments joined by spaces)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if int(fields[1]) == ppid and fields[0] not in ("Z", "X"):
                out[int(d)] = cmd
    return out
