"""The run directory as a contract (opid_mega.rundir, opid_mega.infra.jsonl), without a trainer: torn JSONL repair, the audit
log's resume, atomic config.yaml, the strict config read, the refusals of opid-train's command line, the lock, the
weight-sync directory. The trainer-level fault tests are tests/trainer/test_run_integrity.py."""
import fcntl
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from opid_mega import rundir
from opid_mega.infra import files
from opid_mega.infra.jsonl import cut_to_last_line, drop_records

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")


def test_cut_to_last_line_removes_only_a_torn_tail(tmp_path):
    p = tmp_path / "a.jsonl"
    assert cut_to_last_line(p) == 0  # missing: nothing
    p.write_bytes(b'{"a": 1}\n{"b": 2}\n')
    assert cut_to_last_line(p) == 0 and p.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    p.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": "\xc3')  # torn inside a multi-byte character
    assert cut_to_last_line(p) == 8 and p.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    p.write_bytes(b'{"no newline at all')
    assert cut_to_last_line(p) == 19 and p.read_bytes() == b""
    big = b"".join(b'{"i": %d}\n' % i for i in range(20000)) + b'{"i": 2' + b"x" * 70000  # tail > one read block
    p.write_bytes(big)
    cut_to_last_line(p)
    assert p.read_bytes() == big[:big.rindex(b"\n") + 1]


def test_drop_records_truncates_a_tail_or_rewrites(tmp_path):
    p = tmp_path / "a.jsonl"
    recs = [{"iteration": i, "k": k} for i in (1, 2, 3) for k in range(2)] + [{"iteration": None}]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs[:6]) + '{"iteration": 3, "k": 9')  # + a torn line
    assert drop_records(p, lambda r: r["iteration"] > 1) == 4
    assert [json.loads(x) for x in p.read_text().splitlines()] == recs[:2]
    # a kept record after a dropped one (not in order): rewritten, the order of the kept ones unchanged
    p.write_text("".join(json.dumps(r) + "\n" for r in [recs[2], recs[0], recs[6], recs[4]]))
    assert drop_records(p, lambda r: (r["iteration"] or 0) > 1) == 2
    assert [json.loads(x) for x in p.read_text().splitlines()] == [recs[0], recs[6]]
    assert not (tmp_path / "a.jsonl.tmp").exists()
    assert drop_records(tmp_path / "missing.jsonl", lambda r: True) == 0


def test_audit_log_repairs_a_torn_line_and_drops_rerun_iterations(tmp_path):
    from opid_mega.skills.audit import AuditLog, read_audit

    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as a:
        for it in (1, 2, 3):
            a.log_augmented_prompt(iteration=it, sample_id=f"{it}/s0", kind="step", placement="faithful",
                                   skill="s", prompt="p")
    with open(path, "a") as f:
        f.write('{"type": "analysis", "iteration": 3, "traj_')  # a run killed mid-write
    with AuditLog(path, resume_iteration=2) as a:  # resumed from the checkpoint of iteration 2
        assert a.dropped == 1
        a.log_augmented_prompt(iteration=3, sample_id="3/s0", kind="step", placement="faithful", skill="s",
                               prompt="p")
    recs = list(read_audit(path))  # the whole file parses
    assert [r["sample_id"] for r in recs] == ["1/s0", "2/s0", "3/s0"]
    assert path.read_text().endswith("\n")
    # a fresh open (no resume) keeps every record, and still cuts a torn tail
    with open(path, "a") as f:
        f.write('{"torn"')
    AuditLog(path).close()
    assert len(list(read_audit(path))) == 3 and path.read_text().endswith("}\n")


def test_analysis_cache_is_cut_back_to_its_last_line_on_open(tmp_path):
    from opid_mega.skills.llm_analyzer import LLMAnalyzer

    path = tmp_path / "analysis_cache.jsonl"
    good = {"key": "k1", "model": "m", "analysis": {"episode_summary": "", "episode_skill": "e", "step_skills": {}}}
    path.write_text(json.dumps(good) + "\n" + '{"key": "k2", "model": "m", "anal')
    a = LLMAnalyzer("http://127.0.0.1:9", model="m", cache_path=path)
    try:
        assert a._cache_get("k1").episode_skill == "e" and a._cache_get("k2") is None
    finally:
        a.close()
    assert path.read_text() == json.dumps(good) + "\n"


def test_config_yaml_is_written_atomically_with_mode_0600(tmp_path):
    from opid_mega.config import load_config

    cfg = load_config(CONFIG)
    old_umask = os.umask(0o022)
    try:
        rundir.write_config(tmp_path, cfg)
    finally:
        os.umask(old_umask)
    p = tmp_path / "config.yaml"
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert [x.name for x in tmp_path.iterdir()] == ["config.yaml"]  # no temporary left
    assert rundir.config_digest(rundir.read_saved_config(tmp_path)) == rundir.config_digest(cfg)


def test_a_damaged_config_yaml_is_refused_in_one_line(tmp_path):
    from opid_mega.config import dump_config, load_config

    text = dump_config(load_config(CONFIG))
    lines = text.splitlines(keepends=True)
    cut = "".join(lines[:len(lines) // 2])  # cut at a line boundary: parses, later sections missing
    for content, words in (("", "is empty"), ("\n  \n", "is empty"), ("model: [1, 2\n", "not valid YAML"),
                           ("- 1\n- 2\n", "does not hold a config"), (cut, "is incomplete (no section")):
        (tmp_path / "config.yaml").write_text(content)
        with pytest.raises(rundir.RunDirError, match=r"--resume") as e:
            rundir.read_saved_config(tmp_path)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(rundir.RunDirError, match="no config.yaml there"):
        rundir.read_saved_config(tmp_path / "nothing")


def test_config_digest_names_the_sections_that_differ():
    from opid_mega.config import load_config

    a = rundir.config_digest(load_config(CONFIG, ["logging.run_dir=/x", "analyzer.api_key=secret1"]))
    b = rundir.config_digest(load_config(CONFIG, ["logging.run_dir=/y", "analyzer.api_key=secret2"]))
    assert a == b  # the run directory's path and the API key are not part of it
    c = rundir.config_digest(load_config(CONFIG, ["train.lr=2.0e-5", "rollout.group_size=8"]))
    assert rundir.digest_diff(a, c) == ["rollout", "train"]


def test_resume_overrides_are_recorded_and_replayed(tmp_path):
    from opid_mega.config import load_config

    cfg = load_config(CONFIG)
    rundir.write_config(tmp_path, cfg)
    before = (tmp_path / "config.yaml").read_bytes()
    rundir.record_resume(tmp_path, 4, ["train.iterations=20"])
    rundir.record_resume(tmp_path, 8, [])  # nothing to record
    with open(tmp_path / rundir.OVERRIDES_FILE, "a") as f:
        f.write('{"time": 1, "step": 9, "overr')  # torn by a kill
    rundir.record_resume(tmp_path, 9, ["train.lr=3.0e-5"])
    recs = [json.loads(x) for x in (tmp_path / rundir.OVERRIDES_FILE).read_text().splitlines()]
    assert [(r["step"], r["overrides"]) for r in recs] == [(4, ["train.iterations=20"]), (9, ["train.lr=3.0e-5"])]
    new, digest = rundir.resume_config(tmp_path, ["rollout.group_size=2"])
    assert (new.train.iterations, new.train.lr, new.rollout.group_size) == (20, 3.0e-5, 2)
    assert digest == rundir.config_digest(cfg)  # the digest is config.yaml's own, which is never rewritten
    assert (tmp_path / "config.yaml").read_bytes() == before


@pytest.fixture
def cli(monkeypatch, capsys):
    """opid-train's train_main in this process (no subprocess start-up): cli(*args) -> (exit code, stdout, stderr)."""
    from opid_mega import cli as module

    monkeypatch.setattr(module, "quiet", lambda: None)  # no thread / warning settings changed in the test process
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)

    def run(*args):
        capsys.readouterr()
        try:
            code = module.train_main(list(args))
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def _run_with_checkpoints(d: Path) -> None:
    from opid_mega.config import load_config

    d.mkdir()
    rundir.write_config(d, load_config(CONFIG, [f"logging.run_dir={d}"]))
    (d / "checkpoints" / "step_2").mkdir(parents=True)
    (d / "checkpoints" / "latest_step").write_text("2")
    (d / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


def test_cli_refuses_a_fresh_run_into_a_run_and_moves_it_aside_with_overwrite(tmp_path, cli):
    """Without --resume / --overwrite: exit 2, one line naming both, nothing touched. --overwrite: the run is moved
    to <dir>.old-<time>, byte for byte (the new run itself is not started here: its config is refused by layout)."""
    d = tmp_path / "run"
    _run_with_checkpoints(d)
    before = _snapshot(d)
    r = cli("--config", CONFIG, "--run-dir", str(d), "train.iterations=1")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--resume" in lines[0] and "--overwrite" in lines[0] and "step_2" in lines[0], lines
    assert _snapshot(d) == before
    r = cli("--config", CONFIG, "--run-dir", str(d), "--overwrite", "--resume", "auto")
    assert r.returncode == 2 and "give one of them" in r.stderr and _snapshot(d) == before
    # --resume auto: the only checkpoint is incomplete (a bare directory): refused, not restarted over it
    r = cli("--config", CONFIG, "--run-dir", str(d), "--resume", "auto")
    assert r.returncode == 2 and "none is complete" in r.stderr and "--overwrite" in r.stderr, r.stderr
    assert _snapshot(d) == before
    # --overwrite with a layout that cannot start: refused before the old run is moved
    r = cli("--config", CONFIG, "--run-dir", str(d), "--overwrite", "parallel.tp=3")
    assert r.returncode == 2 and "tp=3" in r.stderr and _snapshot(d) == before, r.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    # --overwrite with cores this machine lacks: refused right after the directory was handled (no training starts)
    r = cli("--config", CONFIG, "--run-dir", str(d), "--overwrite", "deploy.trainer_cpus=[4096]")
    assert r.returncode == 2 and "4096" in r.stderr, r.stderr
    old = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(old) == 1 and "moved the run" in r.stdout and str(old[0]) in r.stdout
    assert _snapshot(old[0]) == {k: v for k, v in before.items()} | {".lock": _snapshot(old[0])[".lock"]}
    assert rundir.checkpoint_names(d) == []  # the directory is the new run's


def test_cli_refuses_an_emptied_config_on_resume(tmp_path, cli):
    d = tmp_path / "run"
    _run_with_checkpoints(d)
    (d / "config.yaml").write_text("")
    for args in (["--resume", str(d)], ["--config", CONFIG, "--run-dir", str(d), "--resume", "auto"]):
        r = cli(*args)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "config.yaml is empty" in lines[0], lines
    r = cli("--resume", str(tmp_path / "nope"))
    assert r.returncode == 2 and "no such directory" in r.stderr


_HOLDER = """
import sys, time
from opid_mega.rundir import RunLock
lock = RunLock(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def test_the_lock_refuses_a_second_trainer_naming_the_holder(tmp_path, cli, monkeypatch):
    d = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(d)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        attempts = []
        lockf = rundir.fcntl.lockf
        with monkeypatch.context() as m:
            m.setattr(rundir.fcntl, "lockf", lambda fd, op, *a: (attempts.append(op), lockf(fd, op, *a))[1])
            with pytest.raises(rundir.RunDirError, match=rf"in use by another trainer \(pid {holder.pid} on "):
                rundir.RunLock(d)
        # at once, no waiting: one non-blocking attempt, refused while the holder still runs
        assert attempts == [fcntl.LOCK_EX | fcntl.LOCK_NB] and holder.poll() is None
        r = cli("--config", CONFIG, "--run-dir", str(d))
        assert r.returncode == 2 and f"pid {holder.pid}" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    finally:
        holder.kill()
        holder.wait()
    with rundir.RunLock(d) as lock:  # the holder died: the kernel dropped its lock
        assert (d / ".lock").read_text().split()[0] == str(os.getpid())
        assert lock.fd is not None


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    """A child forked by the trainer (megatron's checkpoint writers) that outlives it must not hold the lock."""
    d = tmp_path / "run"
    code = ("import os, sys, time\nfrom opid_mega.rundir import RunLock\nlock = RunLock(sys.argv[1])\n"
            "pid = os.fork()\nif pid == 0:\n    null = os.open(os.devnull, os.O_WRONLY)\n"
            "    os.dup2(null, 1); os.dup2(null, 2); time.sleep(60); os._exit(0)\n"
            "print(pid, flush=True)\nos._exit(0)\n")
    p = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=60)
    child = int(p.stdout.strip())
    try:
        os.kill(child, 0)  # still running, with the lock file's descriptor inherited
        with rundir.RunLock(d):  # the parent is gone; its still-running child does not hold the lock
            pass
    finally:
        os.kill(child, 9)


def test_move_aside_and_run_id(tmp_path):
    d = tmp_path / "exp"
    d.mkdir()
    (d / "x").write_text("1")
    a = rundir.move_aside(d)
    d.mkdir()
    b = rundir.move_aside(d)
    assert a != b and a.name.startswith("exp.old-") and (a / "x").read_text() == "1" and not d.exists()
    d.mkdir()
    rid = files.run_id(d)
    assert rid.startswith("exp-") and len(rid) == len("exp-") + 8 and files.run_id(d) == rid  # kept on resume
    assert files.new_run_id(d) != rid  # a fresh start: a new one


def test_weight_sync_disk_dir_is_run_owned_and_only_its_versions_are_removed(tmp_path):
    from opid_mega.config import load_config
    from opid_mega.megatron.weight_sync import WeightSync, remove_old_versions

    shared = tmp_path / "shared"
    run = tmp_path / "runA"
    run.mkdir()
    cfg = load_config(CONFIG, [f"sync.disk_dir={shared}"])
    ws = WeightSync(None, None, cfg, str(run))
    assert ws.disk_dir == shared / files.run_id(run) and ws.disk_dir.parent == shared
    assert WeightSync(None, None, cfg, str(run)).disk_dir == ws.disk_dir  # a resume reuses the run id
    assert WeightSync(None, None, load_config(CONFIG), str(run)).disk_dir == run / "weight_sync"
    # what shares the directory: someone's venv and data, another run's live weights, our old versions
    for name in ("venv", "val_data", "vocab_cache", "v_notes", "vfoo"):
        (shared / name).mkdir(parents=True)
    (shared / "other-run-1234abcd" / "v7").mkdir(parents=True)
    mine = ws.disk_dir
    for name in ("v3", "v4", ".v5.tmp", "v5", "vocab", "v6.txt"):
        (mine / name).mkdir(parents=True) if name != "v6.txt" else (mine / name).write_text("x")
    assert remove_old_versions(mine, mine / "v5") == [".v5.tmp", "v3", "v4"]
    assert sorted(p.name for p in mine.iterdir()) == ["v5", "v6.txt", "vocab"]
    assert sorted(p.name for p in shared.iterdir()) == sorted(["venv", "val_data", "vocab_cache", "v_notes", "vfoo",
                                                               "other-run-1234abcd", mine.name])
    assert (shared / "other-run-1234abcd" / "v7").is_dir()


def test_records_holding_unicode_line_separators_read_back_whole(tmp_path):
    """Records are written with ensure_ascii=False and end with "\\n" only: a U+2028 / U+2029 / NEL / VT / FF inside
    a record's text (an observation, a task) is part of that record, not a line break (str.splitlines would split)."""
    from opid_mega.skills.audit import AuditLog, read_audit

    texts = ["a\u2028b", "c\u2029d", "e\x85f", "g\x0bh\x0ci", "j\x1ck\x1dl\x1em"]
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    for i, t in enumerate(texts):
        log.log_analysis(iteration=1, traj_id=f"t{i}", task=t, won=True, prompt=t, raw_reply=None, failure="x")
    log.close()
    got = list(read_audit(path, "analysis"))
    assert [r["task"] for r in got] == texts
