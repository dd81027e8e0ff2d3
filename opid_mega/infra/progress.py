"""Progress reporting that suits both a terminal and a log file.

    bar = progress(total=60, desc="opid-sft")      # a tqdm bar on a terminal
    bar.update(1, nll="1.234")                      # one line per update when stdout is not a terminal
    bar.close()

On a terminal this is a tqdm bar (rate, elapsed, ETA). When stdout is redirected (`opid-train ... > log.txt`, CI,
a SLURM log) tqdm would write carriage-return-joined redraws; instead every update prints one plain line:
`opid-sft 12/60 [35s<2:20, 2.9s/it] nll=1.234`. `OPID_PROGRESS=bar|lines|off` overrides the choice.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional, TextIO


def _fmt_seconds(s: float) -> str:
    s = int(round(max(0.0, s)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else (f"{m}:{sec:02d}" if m else f"{sec}s")


def progress_mode(stream: Optional[TextIO] = None) -> str:
    """`bar` on a terminal, `lines` otherwise; OPID_PROGRESS=bar|lines|off forces one."""
    forced = os.environ.get("OPID_PROGRESS", "").strip().lower()
    if forced in ("bar", "lines", "off"):
        return forced
    if forced:
        raise ValueError(f"OPID_PROGRESS={forced!r}: allowed bar, lines, off")
    stream = stream or sys.stdout
    try:
        return "bar" if stream.isatty() else "lines"
    except (AttributeError, ValueError):  # a closed or exotic stream
        return "lines"


class LineProgress:
    """tqdm's small API (update, set_postfix, refresh, write, close, n) printing one line per update."""

    def __init__(self, total: Optional[int] = None, desc: str = "", initial: int = 0, unit: str = "it",
                 stream: Optional[TextIO] = None, silent: bool = False):
        self.total, self.desc, self.n, self.unit = total, desc, initial, unit
        self.stream = stream or sys.stdout
        self.silent = silent
        self._start_n = initial
        self._t0 = time.monotonic()
        self._postfix: dict = {}

    def set_postfix(self, parts=None, refresh: bool = True, **kw) -> None:
        self._postfix = {**dict(parts or {}), **kw}

    def line(self) -> str:
        elapsed = time.monotonic() - self._t0
        done = self.n - self._start_n
        per = elapsed / done if done > 0 else None
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        timing = _fmt_seconds(elapsed)
        if per is not None and self.total:
            timing += f"<{_fmt_seconds(per * max(0, self.total - self.n))}"
        if per is not None:
            timing += f", {per:.1f}s/{self.unit}"
        post = " ".join(f"{k}={v}" for k, v in self._postfix.items())
        return f"{self.desc} {count} [{timing}]" + (f" {post}" if post else "")

    def update(self, k: int = 1, **postfix) -> None:
        self.n += k
        if postfix:
            self._postfix.update(postfix)
        self.refresh()

    def refresh(self) -> None:
        if not self.silent:
            print(self.line(), file=self.stream, flush=True)

    def write(self, message: str) -> None:
        print(message, file=self.stream, flush=True)

    def close(self) -> None:
        pass


class _Bar:
    """A tqdm bar with `update(k, **postfix)` like LineProgress."""

    def __init__(self, **kw):
        from tqdm import tqdm

        self._bar = tqdm(dynamic_ncols=True, **kw)

    def __getattr__(self, name):
        return getattr(self._bar, name)

    def update(self, k: int = 1, **postfix) -> None:
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(k)


def progress(total: Optional[int] = None, desc: str = "", initial: int = 0, unit: str = "it",
             stream: Optional[TextIO] = None):
    """A progress reporter for `total` steps: a tqdm bar on a terminal, one line per update otherwise."""
    mode = progress_mode(stream)
    if mode == "bar":
        return _Bar(total=total, desc=desc, initial=initial, unit=unit, file=stream or sys.stdout)
    return LineProgress(total=total, desc=desc, initial=initial, unit=unit, stream=stream, silent=mode == "off")
