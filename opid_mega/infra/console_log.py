"""RUN_DIR/train.log: what rank 0's console showed, written to the run directory as well.

    with tee_console(run_dir / TRAIN_LOG, argv=sys.argv):   # sys.stdout and sys.stderr also go to the file
        ...

The file is opened for appending (a resume continues it; a fresh start moves a predecessor's file aside first, see
opid_mega.cli) and flushed at every line. Each start writes one header line to the file only
(`==== <UTC time> pid N: <command line, secrets as ***>`). Only Python-level writes to sys.stdout / sys.stderr are
copied (print, warnings, logging, tqdm); child processes keep their own logs (the SGLang servers: RUN_DIR/sglang/).
An exception leaving the block is written to the file as the traceback the console shows next.

The console is never affected: every call goes to the original stream first-class (its return value, its errors,
isatty/fileno/encoding); a file that cannot be opened or written (disk full, ...) gives one warning line on stderr
and the copy stops, the run goes on.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence, TextIO

TRAIN_LOG = "train.log"


class _LogFile:
    """The shared file of both streams (one lock: stdout and stderr lines do not interleave mid-write)."""

    def __init__(self, f: TextIO, warn_to: Optional[TextIO]):
        self.f: Optional[TextIO] = f
        self.warn_to = warn_to
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        if self.f is None or not text:
            return
        with self.lock:
            try:
                self.f.write(text)
                if "\n" in text:
                    self.f.flush()
            except Exception as exc:  # noqa: BLE001 - disk full, closed file, ...: the console goes on
                self._fail(exc)

    def flush(self) -> None:
        if self.f is None:
            return
        with self.lock:
            try:
                self.f.flush()
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        f, self.f = self.f, None
        name = getattr(f, "name", TRAIN_LOG)
        try:
            f.close()
        except Exception:  # noqa: BLE001
            pass
        try:
            if self.warn_to is not None:
                self.warn_to.write(f"warning: {name}: {type(exc).__name__}: {exc}; the console is no longer copied "
                                   "there\n")
                self.warn_to.flush()
        except Exception:  # noqa: BLE001 - the console itself is broken: nothing more to do
            pass

    def close(self) -> None:
        with self.lock:
            f, self.f = self.f, None
        if f is not None:
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass


class TeeStream:
    """A text stream that writes to `stream` and copies every write to a log file; everything else is `stream`'s."""

    def __init__(self, stream: TextIO, log: _LogFile):
        self._stream = stream
        self._log = log

    def write(self, text: str) -> int:
        self._log.write(text)  # first: a console that raises (a closed pipe) still leaves the line in the file
        return self._stream.write(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._log.flush()
        self._stream.flush()

    def __getattr__(self, name: str):  # isatty, fileno, encoding, buffer, errors, ...
        return getattr(self._stream, name)


@contextmanager
def tee_console(path: str | os.PathLike, argv: Optional[Sequence[str]] = None) -> Iterator[Optional[str]]:
    """Copy sys.stdout and sys.stderr to `path` (appended) inside the block; yields the path, or None when the file
    could not be opened (one warning line on stderr, the block runs without a copy)."""
    from opid_mega.infra.redact import redact_args

    try:
        with open(path, "ab+") as raw:  # the previous start's last line may lack its newline
            raw.seek(0, os.SEEK_END)
            if raw.tell():
                raw.seek(-1, os.SEEK_END)
                if raw.read(1) != b"\n":
                    raw.write(b"\n")
        f = open(path, "a", encoding="utf-8", errors="backslashreplace")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        cmd = " ".join(redact_args(argv)) if argv is not None else ""
        f.write(f"==== {stamp} pid {os.getpid()}: {cmd}\n")
        f.flush()
    except OSError as exc:
        print(f"warning: {path}: {exc}; the console is not copied to a file", file=sys.stderr, flush=True)
        yield None
        return
    old_out, old_err = sys.stdout, sys.stderr
    log = _LogFile(f, old_err)
    tee_out = TeeStream(old_out, log) if old_out is not None else None
    tee_err = TeeStream(old_err, log) if old_err is not None else None
    sys.stdout, sys.stderr = tee_out, tee_err
    moved = _retarget_handlers({id(old_out): tee_out, id(old_err): tee_err})
    try:
        yield str(path)
    except BaseException as exc:
        if not isinstance(exc, SystemExit):  # the traceback the console shows when this propagates
            log.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        raise
    finally:
        if sys.stdout is tee_out:  # someone who replaced it after us keeps theirs
            sys.stdout = old_out
        if sys.stderr is tee_err:
            sys.stderr = old_err
        for handler, stream, tee in moved:
            if handler.stream is tee:
                handler.stream = stream
        log.close()


def _retarget_handlers(tees: dict) -> list:
    """logging.StreamHandlers created before the tee (transformers' and megatron's, on import) hold the original
    stream: point them at its tee. Returns (handler, original stream, tee) to undo."""
    import logging

    loggers = [logging.getLogger()] + [x for x in list(logging.Logger.manager.loggerDict.values())
                                       if isinstance(x, logging.Logger)]
    moved = []
    for logger in loggers:
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler and tees.get(id(handler.stream)) is not None:
                tee = tees[id(handler.stream)]
                moved.append((handler, handler.stream, tee))
                handler.stream = tee
    return moved
