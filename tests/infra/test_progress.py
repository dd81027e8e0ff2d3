"""Progress output: a bar on a terminal, one plain line per update in a log file (no carriage returns)."""
import io
import re

import pytest

from opid_mega.infra.progress import LineProgress, _fmt_seconds, progress, progress_mode


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_lines_when_not_a_terminal(monkeypatch):
    monkeypatch.delenv("OPID_PROGRESS", raising=False)
    out = io.StringIO()
    bar = progress(total=3, desc="opid-sft epoch", unit="ep", stream=out)
    assert isinstance(bar, LineProgress)
    for nll in ("2.5000", "1.2500", "0.6250"):
        bar.update(1, nll=nll)
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 3
    assert re.fullmatch(r"opid-sft epoch 1/3 \[\d+s<\d+s, \d+\.\ds/ep\] nll=2\.5000", lines[0]), lines[0]
    assert lines[2].startswith("opid-sft epoch 3/3 [") and lines[2].endswith("nll=0.6250")
    assert "<0s" in lines[2]  # nothing left: ETA 0


def test_bar_on_a_terminal(monkeypatch):
    monkeypatch.delenv("OPID_PROGRESS", raising=False)
    tty = FakeTTY()
    assert progress_mode(tty) == "bar"
    bar = progress(total=2, desc="x", stream=tty)
    assert not isinstance(bar, LineProgress)
    bar.update(1, loss="1.0")
    bar.close()
    assert "x:" in tty.getvalue() and "loss=1.0" in tty.getvalue()


def test_environment_override(monkeypatch):
    monkeypatch.setenv("OPID_PROGRESS", "lines")
    assert progress_mode(FakeTTY()) == "lines"
    monkeypatch.setenv("OPID_PROGRESS", "off")
    out = io.StringIO()
    bar = progress(total=2, stream=out)
    bar.update(1)
    assert out.getvalue() == ""
    monkeypatch.setenv("OPID_PROGRESS", "fancy")
    with pytest.raises(ValueError, match="OPID_PROGRESS"):
        progress_mode(io.StringIO())


def test_eta_from_the_rate(monkeypatch):
    clock = iter([100.0, 110.0])  # start, then 10 s after 2 of 6 updates: 5 s each, 4 left -> 20 s
    monkeypatch.setattr("opid_mega.infra.progress.time.monotonic", lambda: next(clock))
    bar = LineProgress(total=6, desc="d", stream=io.StringIO())
    bar.n = 2
    assert bar.line() == "d 2/6 [10s<20s, 5.0s/it]"
    assert _fmt_seconds(3725) == "1:02:05" and _fmt_seconds(65) == "1:05"


def test_metrics_logger_writes_lines_to_a_log(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OPID_PROGRESS", raising=False)
    from opid_mega.metrics import MetricsLogger

    with MetricsLogger(tmp_path, tensorboard=False, progress=True, total=2) as log:
        log.log(1, {"train/success_rate": 0.5})
        log.log(2, {"train/success_rate": 0.75})
    out = capsys.readouterr().out
    assert "\r" not in out
    lines = [ln for ln in out.splitlines() if ln.startswith("opid ")]
    assert [ln.split(" [")[0] for ln in lines] == ["opid 1/2", "opid 2/2"]
    assert "succ=0.75" in lines[1]
