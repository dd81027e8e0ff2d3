"""Durable files: atomic replacement, fsync of files and directories, and the run's id (a file in the run
directory, written once)."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Optional

RUN_ID_FILE = "run_id"


def write_atomic(path: str | os.PathLike, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to a temporary file in ``path``'s directory (created with ``mode``), fsync it, rename it over
    ``path`` and fsync the directory: a reader sees the old file or the whole new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # whatever the umask
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_path(path.parent)


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory: its entries, e.g. a rename in it); best effort, never raises (a
    file system without directory fsync, a path that went away)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def run_id(run_dir: str | os.PathLike, create: bool = True) -> Optional[str]:
    """The run's id, ``<directory name>-<8 hex>``, fixed at the run's start and kept in run_dir/run_id so that a
    resume reuses it. ``create``: make one when there is none (global rank 0)."""
    path = Path(run_dir) / RUN_ID_FILE
    try:
        rid = path.read_text().strip()
        if rid:
            return rid
    except FileNotFoundError:
        pass
    if not create:
        return None
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(run_dir).resolve().name) or "run"
    rid = f"{name}-{secrets.token_hex(4)}"
    write_atomic(path, rid + "\n", mode=0o644)
    return rid


def new_run_id(run_dir: str | os.PathLike) -> str:
    """A fresh start: a new id (an old run_id file of a run that never saved a checkpoint is replaced)."""
    try:
        os.unlink(Path(run_dir) / RUN_ID_FILE)
    except FileNotFoundError:
        pass
    return run_id(run_dir)
