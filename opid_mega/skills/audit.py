"""Append-only JSONL audit log of every hindsight analysis and every skill-augmented prompt.

    audit = AuditLog(run_dir / "audit.jsonl")
    audit.log_analysis(iteration=3, traj_id="3/task7/g2", task=..., won=True, prompt=..., raw_reply=...,
                       analysis=analysis, failure=None, attempts=1)
    audit.log_augmented_prompt(iteration=3, sample_id="3/task7/g2/s4", kind="step", placement="faithful",
                               skill="Open the drawer before ...", prompt=augmented_text)

One JSON object per line, `"type"` is "analysis" or "augmented_prompt", `"time"` is unix seconds. Every record is
flushed as it is written (optionally fsync'ed), under a lock, so a killed run loses at most the line being written
and threads never interleave lines. Opening the log cuts such a torn last line off (`opid_mega.infra.jsonl`), so the next
record starts on a line of its own; `read_audit` skips one that is still there. A resumed run opens it with
`resume_iteration=N`: the records of iterations after N (re-run from the checkpoint) are dropped first, as
metrics.jsonl drops its lines after the resume step, so no iteration is logged twice.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional


def _jsonable(obj: Any) -> Any:
    """Dataclasses (e.g. Analysis) to dicts; int dict keys stay as JSON string keys."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


class AuditLog:
    """Thread-safe, append-only JSONL writer. `path=None` makes a no-op log (every call returns at once)."""

    def __init__(self, path: str | os.PathLike | None, fsync: bool = False, resume_iteration: Optional[int] = None):
        self.path = Path(path) if path is not None else None
        self.fsync = fsync
        self._lock = threading.Lock()
        self._file = None
        self.dropped = 0  # records of iterations after resume_iteration removed on open
        if self.path is not None:
            from opid_mega.infra.jsonl import cut_to_last_line, drop_records

            self.path.parent.mkdir(parents=True, exist_ok=True)
            cut_to_last_line(self.path)
            if resume_iteration is not None:
                self.dropped = drop_records(self.path, lambda r: isinstance(r.get("iteration"), int)
                                            and not isinstance(r.get("iteration"), bool)
                                            and r["iteration"] > resume_iteration)
            self._file = open(self.path, "a", encoding="utf-8")

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, record_type: str, **fields: Any) -> None:
        if self._file is None:
            return
        rec = {"type": record_type, "time": time.time(), **_jsonable(fields)}
        line = json.dumps(rec, ensure_ascii=False) + "\n"
        with self._lock:
            if self._file.closed:
                raise ValueError(f"audit log {self.path} is closed")
            self._file.write(line)
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())

    def log_analysis(self, *, iteration: Optional[int], traj_id: Any, task: str, won: bool,
                     prompt: Optional[str], raw_reply: Optional[str], analysis: Any = None,
                     failure: Optional[str] = None, attempts: int = 0, **extra: Any) -> None:
        """One analysis: `analysis` (an Analysis or dict) when parsed, else `failure` says why it is missing.

        `raw_reply` may be a list (the first answer and the re-asked one). Extra keyword fields are stored as given
        (e.g. replies, cached, reasked, analyzer, elapsed_s).
        """
        self.write("analysis", iteration=iteration, traj_id=traj_id, task=task, won=bool(won), prompt=prompt,
                   raw_reply=raw_reply, analysis=analysis, failure=failure, attempts=int(attempts), **extra)

    def log_augmented_prompt(self, *, iteration: Optional[int], sample_id: Any, kind: str, placement: str,
                             skill: str, prompt: str, **extra: Any) -> None:
        """One skill-augmented prompt (kind: "episode" | "step"; placement: "faithful" | "late" | ...)."""
        self.write("augmented_prompt", iteration=iteration, sample_id=sample_id, kind=kind, placement=placement,
                   skill=skill, prompt=prompt, **extra)

    def close(self) -> None:
        with self._lock:
            if self._file is not None and not self._file.closed:
                self._file.close()

    def __enter__(self) -> "AuditLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, record) of a JSONL file; a torn (unparseable) LAST line — a run killed mid-write — is skipped,
    a bad line elsewhere is an error naming the file and line."""
    with open(path, encoding="utf-8", newline="") as f:
        # records end with "\n" only: str.splitlines() would also split at U+2028, NEL, ... inside a record
        # (written with ensure_ascii=False)
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise ValueError(f"{path}:{i + 1}: not a JSON line: {line[:80]!r}") from None
        yield i + 1, rec


def read_audit(path: str | os.PathLike, record_type: Optional[str] = None) -> Iterator[dict]:
    """Records of an audit file (optionally only one type); a torn last line is skipped."""
    for _, rec in read_jsonl(path):
        if record_type is None or rec.get("type") == record_type:
            yield rec
