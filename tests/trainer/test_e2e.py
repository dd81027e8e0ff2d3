"""`opid-train` end to end as a user runs it (subprocesses): the main job on a tiny budget, and resume after SIGKILL."""
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
from procs import group_members
from tolerance import assert_close_scaled

from .conftest import CONFIG, TINY

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "2"}


def _metrics(run_dir):
    from opid_mega.metrics import read_metrics

    return read_metrics(run_dir)


@pytest.mark.slow
def test_main_job_end_to_end(tmp_path):
    run = tmp_path / "run"
    # as a user runs it into a log file: default warning filters, progress on, stdout not a terminal
    env = {k: v for k, v in ENV.items() if k not in ("PYTHONWARNINGS", "OPID_PROGRESS")}
    cmd = [sys.executable, "-m", "opid_mega.cli", "--config", CONFIG, "--run-dir", str(run)] + TINY + [
        "train.iterations=2", "eval.interval=1", "eval.num_tasks=2", "logging.tensorboard=true",
        "logging.progress=true", "train.save_interval=1", "train.keep_checkpoints=1"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert r.stdout.startswith("opid-train: "), r.stdout[:300]  # the first line says what is built / found
    assert "\r" not in log, "a progress bar redraw reached a log file"
    assert "Swig" not in log and "swig" not in log and "DeprecationWarning" not in log, log[-3000:]
    assert [ln.split(" [")[0] for ln in r.stdout.splitlines() if ln.startswith("opid ")] == ["opid 0/2", "opid 1/2",
                                                                                              "opid 2/2"]
    # keep_checkpoints=1: only the newest checkpoint stays
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_2"]
    recs = _metrics(run)
    assert [m["step"] for m in recs] == [0, 1, 2]
    for key in ("train/success_rate", "adv/outcome_abs_mean", "ppo/kl", "rollout/logprob_mismatch",
                "time/rollout", "eval/success_rate"):
        assert key in recs[-1], key
    assert (run / "checkpoints" / "latest_step").read_text().strip() == "2"
    assert (run / "config.yaml").exists()
    audit = [json.loads(line) for line in (run / "audit.jsonl").read_text().splitlines()]
    assert {"analysis", "augmented_prompt"} <= {a["type"] for a in audit}
    rep = subprocess.run([sys.executable, "-m", "opid_mega.report", str(run)], env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr[-2000:]
    pngs = list((run / "plots").glob("*.png"))
    assert len(pngs) >= 3 and all(p.stat().st_size > 1000 for p in pngs)


DETERMINISTIC = ("train/", "adv/", "analysis/", "ppo/", "rollout/", "eval/")
ONE_THREAD = {**ENV, "OMP_NUM_THREADS": "1"}  # two runs side by side, a core each


def _fresh(run_dir, staleness, *overrides):
    """The command line (after `python -m opid_mega.cli`) of a fresh TINY run of 3 iterations, a checkpoint after
    each, at train.max_staleness=`staleness`."""
    return ["--config", CONFIG, "--run-dir", str(run_dir)] + TINY + [
        "train.iterations=3", "train.save_interval=1", f"train.max_staleness={staleness}", *overrides]


@dataclasses.dataclass
class Runs:
    base: Path  # base/<name>: the run directories; base/<name>.stdout, .stderr: what each command printed
    killed_in_time: bool  # base/killed was still running when it was killed
    latest_after_kill: Optional[str]  # what base/killed/checkpoints/latest_step named right after the kill
    done: dict  # name -> subprocess.CompletedProcess of every command but the killed start


def _runs(base, staleness, copies, then) -> Runs:
    """Runs at train.max_staleness=`staleness`, each on a core (OMP_NUM_THREADS=1), never more than two at once:
    base/ref, uninterrupted, beside base/killed, whose whole process group is SIGKILLed inside iteration 2 (one second
    after its checkpoint 1 is committed). Right after the kill, base/killed is copied to base/<name> for each name in
    `copies`: a copy resumes as the run itself (a resume takes its run directory from --resume and finds everything
    under it; config.yaml's logging.run_dir is replaced and not hashed: opid_mega.rundir.plan_run, config_digest).
    Then the commands `then` ([(name, command line after `python -m opid_mega.cli`)]: a resume of base/killed or of a
    copy, or another fresh run) run in that order, each as soon as a core is free; resumes only when the kill came in
    time. Assertion-free: the tests check what came out."""
    running, started, done, killed = {}, {}, {}, None

    def start(name, cmd, **kw):
        with open(base / f"{name}.stdout", "w") as out, open(base / f"{name}.stderr", "w") as err:
            running[name] = subprocess.Popen([sys.executable, "-m", "opid_mega.cli"] + cmd, env=ONE_THREAD,
                                             stdout=out, stderr=err, **kw)
        started[name] = time.time()

    def reap():
        for name, proc in list(running.items()):
            if proc.poll() is None and time.time() - started[name] > 600:
                proc.kill()  # ran past its 600 s: a return code of -9 and its stderr tell the test
                proc.wait()
            if proc.poll() is not None:
                del running[name]
                done[name] = subprocess.CompletedProcess(proc.args, proc.returncode,
                                                         (base / f"{name}.stdout").read_text(),
                                                         (base / f"{name}.stderr").read_text())

    try:
        start("ref", _fresh(base / "ref", staleness))
        # Its own process group, so the kill also takes the run's helper processes (megatron's checkpoint writer).
        start("killed", _fresh(base / "killed", staleness), start_new_session=True)
        proc = killed = running.pop("killed")
        latest = base / "killed" / "checkpoints" / "latest_step"
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None:
            if latest.exists() and latest.read_text().strip() == "1":
                time.sleep(1.0)  # inside iteration 2 (rollout / update)
                break
            time.sleep(0.2)
        in_time = proc.poll() is None
        if in_time:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            deadline = time.time() + 20  # nothing of the killed run writes into the directory while it is copied
            while group_members(proc.pid) and time.time() < deadline:
                time.sleep(0.2)
            for name in copies:
                shutil.copytree(base / "killed", base / name)
        latest_after_kill = latest.read_text().strip() if latest.exists() else None
        queue = [(name, cmd) for name, cmd in then if in_time or "--resume" not in cmd]
        while queue or running:
            while queue and len(running) < 2:
                start(*queue.pop(0))
            time.sleep(0.2)
            reap()
    finally:  # an error above: nothing of these runs outlives the fixture / test
        if killed is not None and killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
            killed.wait()
        for proc in running.values():
            proc.kill()
            proc.wait()
    return Runs(base, in_time, latest_after_kill, done)


@pytest.fixture(scope="module")
def staleness_one(tmp_path_factory) -> Runs:
    """The train.max_staleness=1 runs three tests share (a whole run is ~15 s on a core): `ref`, uninterrupted and
    colocated (deploy.mode's default); `killed`, SIGKILLed inside iteration 2 and resumed with the same config;
    `smaller`, a copy of the killed run directory resumed with train.max_staleness=0; `disaggregated`, a fresh run
    with deploy.mode=disaggregated."""
    base = tmp_path_factory.mktemp("staleness_one")
    return _runs(base, 1, copies=["smaller"], then=[
        ("killed", ["--resume", str(base / "killed")]),
        ("disaggregated", _fresh(base / "disaggregated", 1, "deploy.mode=disaggregated")),
        ("smaller", ["--resume", str(base / "smaller"), "train.max_staleness=0"]),
    ])


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
def test_sigkill_and_resume_gives_the_same_metrics(tmp_path, request, staleness):
    """max_staleness 1: the checkpoint of iteration 1 holds the rollout of iteration 2, drawn before iteration 1
    trained; the resumed run trains on it, not on a redraw with the newer weights. (Staleness 1: the runs of the
    staleness_one fixture, whose uninterrupted run is also the colocated run of the disaggregated test and whose
    killed run, copied, is also the one resumed with a smaller max_staleness.)"""
    if staleness == 1:
        runs = request.getfixturevalue("staleness_one")
    else:
        runs = _runs(tmp_path, staleness, copies=[], then=[("killed", ["--resume", str(tmp_path / "killed")])])
    ref, run = runs.base / "ref", runs.base / "killed"
    assert runs.killed_in_time, "the run finished or died before it could be killed"
    assert runs.latest_after_kill in ("1", "2"), runs.latest_after_kill

    assert runs.done["ref"].returncode == 0, runs.done["ref"].stderr[-3000:]
    r = runs.done["killed"]  # opid-train --resume <run>
    assert r.returncode == 0, r.stderr[-3000:]
    # train.log: the killed start's console and the resume's, appended (a header line per start)
    log = (run / "train.log").read_text().splitlines()
    starts = [i for i, line in enumerate(log) if line.startswith("==== ")]
    assert len(starts) == 2 and "--resume" in log[starts[1]] and "--resume" not in log[starts[0]], starts
    assert f"opid-train: done, run directory {run} (plots: opid-report {run})" in log[starts[1]:]
    assert all(line in log[starts[1]:] for line in r.stdout.splitlines() if line.startswith("opid-train:"))
    a, b = _metrics(ref), _metrics(run)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    assert [m["rollout/staleness"] for m in b] == [0, staleness, staleness]
    for ma, mb in zip(a, b):
        keys = [k for k in ma if k.startswith(DETERMINISTIC)]
        assert keys
        for k in keys:
            # scaled to the value, at least 1: a small metric (a KL, a mean advantage, a loss) comes out of a
            # cancellation of terms of size ~1 (normalised advantages, probabilities, log-prob differences)
            assert_close_scaled(mb.get(k), ma[k], rel=1e-5, floor=1.0, msg=f"step {ma['step']} {k}")


@pytest.mark.slow
def test_disaggregated_rollout_beside_the_update_gives_the_colocated_metrics(staleness_one):
    """train.max_staleness=1, deploy.mode=disaggregated: iteration k+1's rollout plays in the background while k is
    scored and trained (opid_mega.pipeline) and is landed before the weight sync: the same records, drawn with the
    same weights, as the colocated pipeline draws before the update, so the same metrics. (The colocated run:
    staleness_one's uninterrupted `ref`.)"""
    for mode in ("ref", "disaggregated"):
        assert staleness_one.done[mode].returncode == 0, staleness_one.done[mode].stderr[-3000:]
    a, b = _metrics(staleness_one.base / "ref"), _metrics(staleness_one.base / "disaggregated")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    assert [m["rollout/staleness"] for m in b] == [0, 1, 1]
    # the background rollout is waited for only before the sync; the colocated pipeline has no such wait
    assert all("time/rollout_wait" in m for m in b) and not any("time/rollout_wait" in m for m in a)
    for ma, mb in zip(a, b):
        keys = [k for k in ma if k.startswith(DETERMINISTIC)]
        assert keys
        for k in keys:
            assert_close_scaled(mb.get(k), ma[k], rel=1e-5, floor=1.0, msg=f"step {ma['step']} {k}")


def _ctrl_c_run(tmp_path):
    """SIGINT to the run's process group inside iteration 2: (exit code, all output, stderr written after it, run)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "opid_mega.cli", "--config", CONFIG, "--run-dir", str(run)] + TINY + [
        "train.iterations=3", "train.save_interval=1", "logging.progress=false"]
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as fo, open(err, "w") as fe:
        # SIGINT back to its default in the child: a background job (`cmd &` in a script, CI) inherits it ignored
        proc = subprocess.Popen(cmd, env={**ENV, "OMP_NUM_THREADS": "1"}, stdout=fo, stderr=fe,
                                start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            latest = run / "checkpoints" / "latest_step"
            deadline = time.time() + 400
            while time.time() < deadline and proc.poll() is None:
                if latest.exists() and latest.read_text().strip() == "1":
                    time.sleep(1.0)  # inside iteration 2
                    break
                time.sleep(0.2)
            assert proc.poll() is None, "the run finished or died before it could be interrupted"
            before = err.stat().st_size  # what the run wrote to stderr before Ctrl-C (e.g. weight-loading bars)
            os.killpg(proc.pid, signal.SIGINT)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.time() + 20
    while group_members(proc.pid) and time.time() < deadline:
        time.sleep(0.5)
    return rc, out.read_text() + err.read_text(), err.read_bytes()[before:].decode(), run, group_members(proc.pid)


def _sigterm_in_background_rollout_run(tmp_path):
    """SIGTERM while iteration 2's rollout plays beside iteration 1's update: (exit code, seconds to exit, stderr,
    processes of its group left)."""
    run, mark = tmp_path / "run", tmp_path / "rollouts_started"
    env = {**ENV, "OMP_NUM_THREADS": "1", "OPID_TEST_DELAY_S": "300", "OPID_TEST_DELAY_SKIP": "1",
           "OPID_TEST_MARK": str(mark)}
    cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "_slow_rank0.py"), "--config", CONFIG,
           "--run-dir", str(run)] + TINY + ["train.iterations=3", "train.max_staleness=1", "deploy.mode=disaggregated"]
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            deadline = time.time() + 400
            while time.time() < deadline and proc.poll() is None and \
                    not (mark.exists() and len(mark.read_text().splitlines()) >= 2):
                time.sleep(0.2)
            assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(2.0)  # iteration 1 scores and trains, then waits for the background rollout
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGTERM)  # the rank alone, as torchrun's agent and SLURM send it
            rc = proc.wait(timeout=60)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return rc, took, (tmp_path / "stderr").read_text(), group_members(proc.pid)


@pytest.fixture(scope="module")
def signalled(tmp_path_factory) -> dict:
    """The two signal runs below side by side, a core each (each spends most of its time starting and waiting):
    {name: Future of its result}; a run's failure is raised by the test that reads it."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = {"ctrl_c": _ctrl_c_run, "sigterm": _sigterm_in_background_rollout_run}
    with ThreadPoolExecutor(len(jobs)) as pool:
        return {name: pool.submit(fn, tmp_path_factory.mktemp(name)) for name, fn in jobs.items()}


@pytest.mark.slow
def test_ctrl_c_ends_with_one_line_and_leaves_nothing_running(signalled):
    """SIGINT to the run's whole process group (what Ctrl-C in a terminal does) inside iteration 2: exit 130, one line
    on stderr saying where it stopped, the last checkpoint and how to resume; no traceback; no process left."""
    rc, text, after, run, left = signalled["ctrl_c"].result()
    assert rc == 130, text[-3000:]
    assert "\r" not in text, "a progress bar redraw reached a log file"
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    lines = [ln for ln in after.splitlines() if ln.strip()]  # written after Ctrl-C
    assert len(lines) == 1, lines
    m = re.fullmatch(rf"opid-train: interrupted in iteration (\d) of 3; last checkpoint {re.escape(str(run))}"
                     rf"/checkpoints/step_(\d); resume with: opid-train --resume {re.escape(str(run))}", lines[0])
    # the iteration in progress; its own checkpoint counts once written (a Ctrl-C during a write waits for it)
    assert m and int(m[1]) in (2, 3) and int(m[2]) in (int(m[1]) - 1, int(m[1])), lines[0]
    assert not left, "processes of the run outlived it"


@pytest.mark.slow
def test_resume_with_a_smaller_max_staleness_corrects_the_restored_stale_records(staleness_one):
    """A run at train.max_staleness=1 killed after its first checkpoint (which holds the next iteration's rollout,
    drawn one version early) and resumed with train.max_staleness=0: the restored record is still stale and trains
    with its behaviour weights (train/behavior_weight_mean in its metrics); before, max_staleness=0 skipped the
    correction and the stale record trained uncorrected. (The run: staleness_one's `smaller`, a copy of its `killed`
    run directory made right after the kill inside iteration 2; checkpoint 2, if written by then, holds iteration 3's
    rollout, drawn one version early too.)"""
    assert staleness_one.killed_in_time, "the run finished or died before it could be killed"
    assert staleness_one.latest_after_kill in ("1", "2"), staleness_one.latest_after_kill
    step = int(staleness_one.latest_after_kill)
    r = staleness_one.done["smaller"]  # opid-train --resume <copy> train.max_staleness=0
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = [m for m in _metrics(staleness_one.base / "smaller") if m["step"] == step + 1][-1]
    print(f"resumed at step {step + 1}: staleness {resumed['rollout/staleness']}, behaviour weights mean "
          f"{resumed.get('train/behavior_weight_mean')}")
    assert resumed["rollout/staleness"] == 1  # the record drawn before the checkpoint, one version early
    assert 0 < resumed["train/behavior_weight_mean"] <= 2.0


@pytest.mark.slow
def test_sigterm_while_the_next_rollout_plays_in_the_background_runs_every_closer_within_seconds(signalled):
    """deploy.mode=disaggregated, train.max_staleness=1: iteration 2's rollout plays beside iteration 1's update
    (delayed 300 s here: tests/trainer/_slow_rank0.py). SIGTERM then: the run ends by its own shutdown (every closer,
    the one line naming the iteration and the checkpoint, exit 143) within seconds. Before, close() waited for the
    background rollout and only the 20 s watchdog's forced exit ended the process, skipping the closers after it."""
    rc, took, text, left = signalled["sigterm"].result()
    print(f"ended {took:.1f} s after SIGTERM, exit {rc}")
    assert rc == 143 and took < 15, text[-3000:]
    assert "still running 20 s after the signal" not in text
    assert re.search(r"opid-train: stopped by SIGTERM in iteration 1 of 3; ", text), text[-3000:]
    assert not left  # env workers and helpers gone with it
