"""`opid-train` end to end as a user runs it (subprocesses): the main job on a tiny budget, and resume after SIGKILL."""
import json
import os
import re
import signal
import subprocess
import sys
import time

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


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
def test_sigkill_and_resume_gives_the_same_metrics(tmp_path, staleness):
    """max_staleness 1: the checkpoint of iteration 1 holds the rollout of iteration 2, drawn before iteration 1
    trained; the resumed run trains on it, not on a redraw with the newer weights."""
    args = TINY + ["train.iterations=3", "train.save_interval=1", f"train.max_staleness={staleness}"]
    one_thread = {**ENV, "OMP_NUM_THREADS": "1"}  # the uninterrupted and the killed run side by side, a core each
    ref = tmp_path / "ref"
    with open(tmp_path / "ref.stderr", "w") as ref_err:
        ref_proc = subprocess.Popen([sys.executable, "-m", "opid_mega.cli", "--config", CONFIG, "--run-dir", str(ref)]
                                    + args, env=one_thread, stdout=subprocess.DEVNULL, stderr=ref_err)

    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "opid_mega.cli", "--config", CONFIG, "--run-dir", str(run)] + args
    # Its own process group, so the kill also takes the run's helper processes (megatron's checkpoint writer).
    proc = subprocess.Popen(cmd, env=one_thread, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    latest = run / "checkpoints" / "latest_step"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().strip() == "1":
            time.sleep(1.0)  # inside iteration 2 (rollout / update)
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished or died before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert latest.read_text().strip() in ("1", "2")

    assert ref_proc.wait(timeout=600) == 0, (tmp_path / "ref.stderr").read_text()[-3000:]
    r = subprocess.run([sys.executable, "-m", "opid_mega.cli", "--resume", str(run)], env=one_thread,
                       capture_output=True, text=True, timeout=600)
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
def test_disaggregated_rollout_beside_the_update_gives_the_colocated_metrics(tmp_path):
    """train.max_staleness=1, deploy.mode=disaggregated: iteration k+1's rollout plays in the background while k is
    scored and trained (opid_mega.pipeline) and is landed before the weight sync: the same records, drawn with the
    same weights, as the colocated pipeline draws before the update, so the same metrics."""
    one_thread = {**ENV, "OMP_NUM_THREADS": "1"}
    args = TINY + ["train.iterations=3", "train.max_staleness=1"]
    procs = {}
    for mode in ("colocated", "disaggregated"):
        with open(tmp_path / f"{mode}.stderr", "w") as err:
            procs[mode] = subprocess.Popen([sys.executable, "-m", "opid_mega.cli", "--config", CONFIG, "--run-dir",
                                            str(tmp_path / mode)] + args + [f"deploy.mode={mode}"], env=one_thread,
                                           stdout=subprocess.DEVNULL, stderr=err)
    for mode, proc in procs.items():
        assert proc.wait(timeout=600) == 0, (tmp_path / f"{mode}.stderr").read_text()[-3000:]
    a, b = _metrics(tmp_path / "colocated"), _metrics(tmp_path / "disaggregated")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    assert [m["rollout/staleness"] for m in b] == [0, 1, 1]
    # the background rollout is waited for only before the sync; the colocated pipeline has no such wait
    assert all("time/rollout_wait" in m for m in b) and not any("time/rollout_wait" in m for m in a)
    for ma, mb in zip(a, b):
        keys = [k for k in ma if k.startswith(DETERMINISTIC)]
        assert keys
        for k in keys:
            assert_close_scaled(mb.get(k), ma[k], rel=1e-5, floor=1.0, msg=f"step {ma['step']} {k}")


@pytest.mark.slow
def test_ctrl_c_ends_with_one_line_and_leaves_nothing_running(tmp_path):
    """SIGINT to the run's whole process group (what Ctrl-C in a terminal does) inside iteration 2: exit 130, one line
    on stderr saying where it stopped, the last checkpoint and how to resume; no traceback; no process left."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "opid_mega.cli", "--config", CONFIG, "--run-dir", str(run)] + TINY + [
        "train.iterations=3", "train.save_interval=1", "logging.progress=false"]
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as fo, open(err, "w") as fe:
        # SIGINT back to its default in the child: a background job (`cmd &` in a script, CI) inherits it ignored
        proc = subprocess.Popen(cmd, env=ENV, stdout=fo, stderr=fe, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
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
    text = out.read_text() + err.read_text()
    assert rc == 130, text[-3000:]
    assert "\r" not in text, "a progress bar redraw reached a log file"
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    lines = [ln for ln in err.read_bytes()[before:].decode().splitlines() if ln.strip()]  # written after Ctrl-C
    assert len(lines) == 1, lines
    m = re.fullmatch(rf"opid-train: interrupted in iteration (\d) of 3; last checkpoint {re.escape(str(run))}"
                     rf"/checkpoints/step_(\d); resume with: opid-train --resume {re.escape(str(run))}", lines[0])
    # the iteration in progress; its own checkpoint counts once written (a Ctrl-C during a write waits for it)
    assert m and int(m[1]) in (2, 3) and int(m[2]) in (int(m[1]) - 1, int(m[1])), lines[0]
    deadline = time.time() + 20
    while group_members(proc.pid) and time.time() < deadline:
        time.sleep(0.5)
    assert not group_members(proc.pid), "processes of the run outlived it"


@pytest.mark.slow
def test_resume_with_a_smaller_max_staleness_corrects_the_restored_stale_records(tmp_path):
    """A run at train.max_staleness=1 killed after its first checkpoint (which holds the next iteration's rollout,
    drawn one version early) and resumed with train.max_staleness=0: the restored record is still stale and trains
    with its behaviour weights (train/behavior_weight_mean in its metrics); before, max_staleness=0 skipped the
    correction and the stale record trained uncorrected."""
    run = tmp_path / "run"
    one_thread = {**ENV, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "opid_mega.cli", "--config", CONFIG, "--run-dir", str(run)] + TINY + [
        "train.iterations=3", "train.save_interval=1", "train.max_staleness=1"]
    proc = subprocess.Popen(cmd, env=one_thread, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    latest = run / "checkpoints" / "latest_step"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None and not (latest.exists() and latest.read_text().strip()):
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished or died before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    step = int(latest.read_text().strip())
    assert step in (1, 2)
    r = subprocess.run([sys.executable, "-m", "opid_mega.cli", "--resume", str(run), "train.max_staleness=0"],
                       env=one_thread, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = [m for m in _metrics(run) if m["step"] == step + 1][-1]
    print(f"resumed at step {step + 1}: staleness {resumed['rollout/staleness']}, behaviour weights mean "
          f"{resumed.get('train/behavior_weight_mean')}")
    assert resumed["rollout/staleness"] == 1  # the record drawn before the checkpoint, one version early
    assert 0 < resumed["train/behavior_weight_mean"] <= 2.0


@pytest.mark.slow
def test_sigterm_while_the_next_rollout_plays_in_the_background_runs_every_closer_within_seconds(tmp_path):
    """deploy.mode=disaggregated, train.max_staleness=1: iteration 2's rollout plays beside iteration 1's update
    (delayed 300 s here: tests/trainer/_slow_rank0.py). SIGTERM then: the run ends by its own shutdown (every closer,
    the one line naming the iteration and the checkpoint, exit 143) within seconds. Before, close() waited for the
    background rollout and only the 20 s watchdog's forced exit ended the process, skipping the closers after it."""
    run, mark = tmp_path / "run", tmp_path / "rollouts_started"
    env = {**ENV, "OMP_NUM_THREADS": "1", "OPID_TEST_DELAY_S": "300", "OPID_TEST_DELAY_SKIP": "1",
           "OPID_TEST_MARK": str(mark)}
    cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "_slow_rank0.py"), "--config", CONFIG,
           "--run-dir", str(run)] + TINY + ["train.iterations=3", "train.max_staleness=1", "deploy.mode=disaggregated"]
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None and \
                not (mark.exists() and len(mark.read_text().splitlines()) >= 2):
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
        time.sleep(2.0)  # iteration 1 scores and trains, then waits for the background rollout
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)  # the rank alone, as torchrun's agent and SLURM send it
        try:
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        took = time.monotonic() - t0
    text = (tmp_path / "stderr").read_text()
    print(f"ended {took:.1f} s after SIGTERM, exit {rc}")
    assert rc == 143 and took < 15, text[-3000:]
    assert "still running 20 s after the signal" not in text
    assert re.search(r"opid-train: stopped by SIGTERM in iteration 1 of 3; ", text), text[-3000:]
    assert not group_members(proc.pid)  # env workers and helpers gone with it
