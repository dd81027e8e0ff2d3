"""Repairs of the run directory's append-only JSONL files (audit.jsonl, the analysis cache) after a killed run.

    cut_to_last_line(path)                   # a torn last line (no newline: the writer was killed) is cut off
    drop_records(path, lambda r: r["iteration"] > 20)   # records of iterations re-run after a resume

A JSONL record is complete when its newline is on disk: the writers write `json + "\\n"` in one call and flush, so a
run killed mid-write leaves at most one torn line at the end of the file, which :func:`cut_to_last_line` removes
before new records are appended (appending to a torn line would glue the first new record to it).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

_CHUNK = 1 << 16


def cut_to_last_line(path: str | os.PathLike) -> int:
    """Truncate ``path`` after its last newline (to empty when it has none). Returns the bytes removed (0 when the file
    is missing or already ends with a newline)."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - _CHUNK)
            f.seek(start)
            block = f.read(end - start)
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            end = start
        else:
            keep = 0
        if keep == size:
            return 0
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
        return size - keep


def drop_records(path: str | os.PathLike, drop: Callable[[dict], bool]) -> int:
    """Remove the records for which ``drop(record)`` is true from a JSONL file (a torn last line is cut first; lines
    that do not parse are kept as they are). When the dropped records are the file's tail (records appended in
    order, the usual case) the file is truncated in place; otherwise it is rewritten through a temporary file and
    renamed. Returns the number of records dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    cut_to_last_line(path)
    first = None  # byte offset of the first dropped record
    dropped, tail_only = 0, True
    with open(path, "rb") as f:
        offset = 0
        for raw in f:
            gone = _drops(raw, drop)
            if gone:
                dropped += 1
                if first is None:
                    first = offset
            elif first is not None and raw.strip():
                tail_only = False  # a kept record after a dropped one
            offset += len(raw)
    if not dropped:
        return 0
    if tail_only:
        with open(path, "r+b") as f:
            f.truncate(first)
            f.flush()
            os.fsync(f.fileno())
        return dropped
    tmp = path.with_name(path.name + ".tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for raw in src:
            if not _drops(raw, drop):
                dst.write(raw)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)
    return dropped


def _drops(raw: bytes, drop: Callable[[dict], bool]) -> bool:
    if not raw.strip():
        return False
    try:
        rec = json.loads(raw)
    except ValueError:
        return False
    return isinstance(rec, dict) and bool(drop(rec))
