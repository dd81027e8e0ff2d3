"""Nothing lost (issue 22): opid-train on the tiny config killed inside its checkpoint writes, re-run with the same
command line, with a torn audit log, an emptied config, a second trainer on the same directory, and out of disk on a
small tmpfs. Every run is a subprocess as a user starts it; the metrics of the resumed runs must continue the
uninterrupted run's (iteration 2 as the first, uninterrupted process logged it before it was killed).

SIGKILL at every named point of a save on a tiny model: tests/megatron/test_checkpoint_integrity.py; the pieces
without a trainer (lock, refusals, JSONL repair): tests/test_rundir.py."""
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import group_members

from .conftest import CONFIG, TINY
from .test_e2e import DETERMINISTIC, ENV

ARGS = TINY + ["train.iterations=2", "train.save_interval=1", "train.keep_checkpoints=0"]
FAULT_ENV = "OPID_CKPT_FAULT"  # opid_mega.megatron.checkpoint.FAULT_ENV (not imported: no megatron import here)


def _cmd(run: Path, *extra: str) -> list:
    return [sys.executable, "-m", "opid_mega.cli", "--config", CONFIG, "--run-dir", str(run), *extra] + ARGS


class _Proc:
    """A command in its own session with stdout/stderr in files (a SIGKILLed trainer's orphaned helpers, e.g.
    megatron's checkpoint-writer manager, would hold pipes open); whatever it leaves behind is killed after."""

    def __init__(self, cmd: list, logs: Path, **env):
        logs.mkdir(parents=True, exist_ok=True)
        n = len(list(logs.glob("*.out")))
        self.out_path, self.err_path = logs / f"{n}.out", logs / f"{n}.err"
        with open(self.out_path, "w") as fo, open(self.err_path, "w") as fe:
            self.proc = subprocess.Popen(cmd, env={**ENV, **env}, stdout=fo, stderr=fe, start_new_session=True)
        self.pid, self.cmd = self.proc.pid, cmd

    def wait(self, timeout: float = 600) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            _kill_group(self.proc)
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, self.out_path.read_text(),
                                           self.err_path.read_text())


def _run(cmd: list, logs: Path, timeout: float = 600, **env) -> subprocess.CompletedProcess:
    return _Proc(cmd, logs, **env).wait(timeout)


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait()
    deadline = time.time() + 20
    while group_members(proc.pid) and time.time() < deadline:
        time.sleep(0.2)


def _lines(text: str) -> list:
    return [ln for ln in text.splitlines() if ln.strip()]


def _snapshot(d: Path) -> dict:
    """Every file of a run directory: relative path -> sha256 of its bytes."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def _metrics(run: Path) -> list:
    from opid_mega.metrics import read_metrics

    return read_metrics(run)


def _audit_key(rec: dict) -> tuple:
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in rec.items() if k not in ("time", "elapsed_s")))


def _assert_continues(before: dict, after: dict) -> None:
    """The deterministic metrics of one iteration in two processes: same keys, values within float32 noise scaled
    to each value's magnitude."""
    keys = sorted(k for k in before if k.startswith(DETERMINISTIC))
    assert keys and keys == sorted(k for k in after if k.startswith(DETERMINISTIC)), (keys, sorted(after))
    for k in keys:
        a, b = before[k], after[k]
        if a is None or b is None:
            assert a is b, (k, a, b)
            continue
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a), abs(b)), (k, a, b)


def _complete_checkpoints(run: Path) -> list:
    from opid_mega.megatron.checkpoint import checkpoint_problem

    ckpt = run / "checkpoints"
    names = sorted(p.name for p in ckpt.iterdir())
    for name in names:
        if name.startswith("step_"):
            assert checkpoint_problem(str(ckpt / name)) is None, name
    return names


@pytest.mark.slow
def test_kill_inside_saves_rerun_torn_audit_emptied_config_and_a_second_trainer(tmp_path):
    """One run directory through every fault, in order:
    A   the fresh run is SIGKILLed inside step 2's save (after the tensors were written, before the RNG files);
    B   the same command line without --resume auto is refused in one line and the old run is byte-identical;
        an emptied and a cut config.yaml are refused (--resume and --resume auto), then restored;
        half a record is appended to audit.jsonl;
    C   the same command line with --resume auto continues from step_1 and is SIGKILLed after renaming step_2.tmp to
        step_2 but before latest_step; while it runs, a second trainer on the directory is refused (the lock);
    D   --resume auto again: step_2 (uncommitted) is removed, iteration 2 is re-run and saved; the run completes.
    Then metrics, audit and checkpoints are whole and iteration 2 equals the uninterrupted process' iteration 2."""
    run = tmp_path / "run"
    t0 = time.monotonic()
    logs = tmp_path / "logs"
    a = _run(_cmd(run), logs, **{FAULT_ENV: "tensors_written@2"})
    assert a.returncode == -signal.SIGKILL, a.stderr[-3000:]
    assert (run / "checkpoints" / "latest_step").read_text() == "1" and (run / "checkpoints" / "step_2.tmp").is_dir()
    first = _metrics(run)  # iterations 1 and 2 of the uninterrupted process
    assert [m["step"] for m in first] == [1, 2]
    from opid_mega.skills.audit import read_audit

    audit_first = sorted(_audit_key(r) for r in read_audit(run / "audit.jsonl"))
    assert any(dict(r)["iteration"] == "2" for r in audit_first)  # iteration 2 was audited before the kill
    config_bytes = (run / "config.yaml").read_bytes()
    assert (run / "config.yaml").stat().st_mode & 0o777 == 0o600
    run_id = (run / "run_id").read_text()
    print(f"A (fresh, killed in save 2): {time.monotonic() - t0:.1f} s")

    # B: the same command line again: refused, nothing touched
    t = time.monotonic()
    before = _snapshot(run)
    b = _run(_cmd(run), logs, timeout=120)
    assert b.returncode == 2, b.stderr[-3000:]
    assert len(_lines(b.stderr)) == 1 and "--resume" in b.stderr and "--overwrite" in b.stderr, b.stderr
    assert _snapshot(run) == before
    # emptied: refused by --resume RUN_DIR; cut at a line boundary (later sections missing): by --resume auto
    for spoilt, words, cmd in ((b"", "is empty", [sys.executable, "-m", "opid_mega.cli", "--resume", str(run)]),
                               (config_bytes[:config_bytes.index(b"\ntrain:") + 1], "is incomplete",
                                _cmd(run, "--resume", "auto"))):
        (run / "config.yaml").write_bytes(spoilt)
        r = _run(cmd, logs, timeout=120)
        assert r.returncode == 2 and len(_lines(r.stderr)) == 1 and words in r.stderr, (cmd, r.stderr[-2000:])
    (run / "config.yaml").write_bytes(config_bytes)
    os.chmod(run / "config.yaml", 0o600)
    assert _snapshot(run) == before
    with open(run / "audit.jsonl", "a") as f:
        f.write('{"type": "analysis", "time": 1.0, "iteration": 2, "traj_id": "2/')  # torn: half a record
    print(f"B (refusals): {time.monotonic() - t:.1f} s")

    # C: --resume auto continues; a second trainer meanwhile is refused by the lock; killed after the rename
    t = time.monotonic()
    c = _Proc(_cmd(run, "--resume", "auto"), logs, **{FAULT_ENV: "renamed@2"})
    try:
        deadline = time.time() + 120
        while time.time() < deadline and c.proc.poll() is None:
            holder = (run / ".lock").read_text().split() if (run / ".lock").exists() else []
            if holder and holder[0] == str(c.pid):
                break
            time.sleep(0.1)
        assert c.proc.poll() is None, "the resumed run ended before the second trainer could start"
        e = _run(_cmd(run, "--resume", "auto"), logs, timeout=120)
        # refused, not queued behind the lock (one non-blocking attempt: tests/test_rundir.py), naming the holder
        assert e.returncode == 2 and len(_lines(e.stderr)) == 1, e.stderr[-2000:]
        assert f"in use by another trainer (pid {c.pid} on " in e.stderr, e.stderr
    finally:
        cr = c.wait(600)
    assert cr.returncode == -signal.SIGKILL, cr.stderr[-3000:]
    assert (run / "checkpoints" / "latest_step").read_text() == "1" and (run / "checkpoints" / "step_2").is_dir()
    print(f"C (--resume auto, killed after the rename): {time.monotonic() - t:.1f} s")

    # D: --resume auto completes the run
    t = time.monotonic()
    d = _run(_cmd(run, "--resume", "auto"), logs)
    assert d.returncode == 0, d.stderr[-3000:]
    assert re.search(r"removed what a killed save left in .*checkpoints: step_2\b", d.stdout), d.stdout[-2000:]
    print(f"D (--resume auto, completes): {time.monotonic() - t:.1f} s")

    assert _complete_checkpoints(run) == ["latest_step", "step_1", "step_2"]
    assert (run / "checkpoints" / "latest_step").read_text() == "2"
    final = _metrics(run)
    assert [m["step"] for m in final] == [1, 2]
    assert final[0] == first[0]  # kept as written
    _assert_continues(first[1], final[1])
    audit = list(read_audit(run / "audit.jsonl"))  # the torn line was cut: the whole file parses
    assert (run / "audit.jsonl").read_text().endswith("\n")
    assert sorted(_audit_key(r) for r in audit) == audit_first  # iteration 2 once, as the first process logged it
    assert (run / "config.yaml").read_bytes() == config_bytes  # never rewritten on resume
    assert (run / "run_id").read_text() == run_id and not (run / "resume_overrides.jsonl").exists()
    print(f"total: {time.monotonic() - t0:.1f} s")


def _tmpfs(path: Path, size: int, remount: bool = False) -> None:
    path.mkdir(parents=True, exist_ok=True)
    opts = f"remount,size={size}" if remount else f"size={size}"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        if remount:
            raise RuntimeError(f"tmpfs remount failed: {r.stderr}")
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount permission): {r.stderr.strip()}")


def _model_bytes() -> int:
    """float32 bytes of the tiny config's model (its cached HF weights, counted by element)."""
    from safetensors import safe_open

    from opid_mega.config import load_config
    from opid_mega.models import resolve_model_path

    cfg = load_config(CONFIG, TINY)
    hf = Path(resolve_model_path(cfg.model.path, cfg.model.builtin, cfg.model.cache_dir))
    n = 0
    for f in hf.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n += _numel(st.get_slice(k).get_shape())
    return 4 * n


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


@pytest.mark.slow
def test_out_of_disk_on_a_small_tmpfs_is_one_line_and_the_previous_checkpoint_resumes(tmp_path):
    """The run directory on a tmpfs with room for one checkpoint (model + Adam state, ~3x the fp32 weights) and a
    half: step_1 is saved, step_2's save is refused before anything is written (one line naming the bytes needed and
    free, exit 4, no step_2 or step_2.tmp left); with more room, --resume continues from step_1 and iteration 2
    equals the refused run's iteration 2."""
    fs = tmp_path / "fs"
    _tmpfs(fs, 1 << 20)
    try:
        one = 3 * _model_bytes()
        _tmpfs(fs, int(1.6 * one) + (32 << 20), remount=True)
        run = fs / "run"
        t0 = time.monotonic()
        r = _run(_cmd(run), tmp_path / "logs")
        print(f"refused save: {time.monotonic() - t0:.1f} s")
        assert r.returncode == 4, r.stderr[-3000:]
        last = _lines(r.stderr)[-1]
        m = re.fullmatch(r"opid-train: checkpoint step_2 needs about (\d+) bytes \(the size of step_1\) but "
                         rf"{re.escape(str(run / 'checkpoints'))} has only (\d+) bytes free: nothing of it was written;"
                         r" the last complete checkpoint is step_1; free some space \(or lower "
                         r"train\.keep_checkpoints\) and resume", last)
        assert m and int(m[2]) < int(m[1]), last
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        assert _complete_checkpoints(run) == ["latest_step", "step_1"]
        refused = _metrics(run)
        assert [x["step"] for x in refused] == [1, 2]  # iteration 2 ran; only its checkpoint was refused

        _tmpfs(fs, 3 * one + (64 << 20), remount=True)
        t0 = time.monotonic()
        r = _run([sys.executable, "-m", "opid_mega.cli", "--resume", str(run)], tmp_path / "logs")
        print(f"resume with room: {time.monotonic() - t0:.1f} s")
        assert r.returncode == 0, r.stderr[-3000:]
        assert _complete_checkpoints(run) == ["latest_step", "step_1", "step_2"]
        final = _metrics(run)
        assert [x["step"] for x in final] == [1, 2] and final[0] == refused[0]
        _assert_continues(refused[1], final[1])
    finally:
        subprocess.run(["umount", "-l", str(fs)], capture_output=True)
