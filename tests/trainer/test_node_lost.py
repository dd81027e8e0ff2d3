"""A node lost during a rollout ends the job within deploy.control_timeout_s with one line naming it (exit 5), not a
training-group timeout or a day-long wait; and the control group's default timeout is derived from the deadlines.

Two gloo ranks under torchrun on this machine's loopback (the namespace cluster would need two SGLang servers and
several minutes per launch): the lost "node" is a rank SIGSTOPped while global rank 0 plays its rollout (delayed
10 s by tests/trainer/_slow_rank0.py). A stopped process is what a frozen or cut-off node looks like to its peers:
its sockets stay open and nothing comes from it."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from .conftest import CONFIG, TINY

HERE = os.path.dirname(__file__)
BOUND = 15  # deploy.control_timeout_s of these runs
DELAY = 10  # rank 0's rollout delay (OPID_TEST_DELAY_S)


def test_control_timeout_is_derived_from_the_deadlines(tiny_cfg):
    from opid_mega.config import CONTROL_MARGIN_S, control_timeout

    assert CONTROL_MARGIN_S == 600
    cfg = tiny_cfg("algo.mode=opid", "rollout.deadline_s=300", "analyzer.deadline_s=200")
    assert cfg.deploy.control_timeout_s is None and control_timeout(cfg) == 300 + 200 + 600
    # nothing analysed: the rollout alone
    assert control_timeout(tiny_cfg("algo.mode=grpo", "rollout.deadline_s=300")) == 300 + 600
    # the evaluation replays its tasks with skills: two rollouts and an analysis
    cfg = tiny_cfg("algo.mode=opid", "eval.with_skills=true", "rollout.deadline_s=300", "analyzer.deadline_s=200")
    assert control_timeout(cfg) == 2 * 300 + 200 + 600
    # the defaults: a few hours, not a day
    assert control_timeout(tiny_cfg("algo.mode=opid")) == 7200 + 3600 + 600
    # the explicit override wins
    assert control_timeout(tiny_cfg("deploy.control_timeout_s=45")) == 45


def _launch(tmp_path, tag, args=None, env=None):
    mark, log = tmp_path / "rollout_started", open(tmp_path / "stderr.txt", "w")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "OPID_TEST_DELAY_S": str(DELAY),
           "OPID_TEST_MARK": str(mark), "OPID_TEST_TAG": tag, **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", os.path.join(HERE, "_slow_rank0.py"),
           "--config", CONFIG, "--run-dir", str(tmp_path / "run")] + TINY + \
        (args if args is not None else [f"deploy.control_timeout_s={BOUND}"])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    return proc, mark, tmp_path / "stderr.txt"


def _rank_pid(tag: str, rank: int) -> int:
    """The pid of the trainer rank `rank` of the launch tagged `tag` (its environment holds both; the processes it
    started, env workers included, inherit that environment: the rank is the one whose parent is none of them)."""
    found = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if env.get(b"OPID_TEST_TAG") == tag.encode() and env.get(b"RANK") == str(rank).encode() \
                and b"TORCHELASTIC_RUN_ID" in env:
            found[int(d)] = ppid
    ranks = [pid for pid, ppid in found.items() if ppid not in found]
    assert len(ranks) == 1, (rank, found)
    return ranks[0]


def _wait_for(cond, proc, seconds, what):
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        got = cond()
        if got:
            return got
        if proc.poll() is not None and not cond():
            raise AssertionError(f"{what}: the job ended first (exit {proc.returncode})")
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {seconds} s")


def _lines(path, prefix="opid-train: lost "):
    return [x for x in path.read_text(errors="replace").splitlines() if x.startswith(prefix)]


def _end(proc, pid):
    """The stopped rank killed (torchrun would, after its grace period), then the job's exit code."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _stop_rank(proc, tag, rank, err, seconds):
    """Once the launch reached the moment (the caller waited for it), SIGSTOP its rank `rank` (a lost node) and wait
    up to `seconds` for the lost-node line: (the lines, seconds until the line, the job's exit code, its stderr)."""
    pid = None
    try:
        pid = _rank_pid(tag, rank)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        lines = _wait_for(lambda: _lines(err), proc, seconds, "the lost-node line")
        took = time.monotonic() - stopped_at
    finally:
        code = _end(proc, pid) if pid else (proc.kill() or proc.wait())
    return lines, took, code, err.read_text(errors="replace")


def _wait_or_end(proc, cond, what):
    try:
        _wait_for(cond, proc, 300, what)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


@pytest.mark.slow
@pytest.mark.parametrize("stopped", [1, 0], ids=["rank1_stopped", "rank0_stopped"])
def test_a_rank_stopped_during_the_rollout_ends_the_job_with_one_line(tmp_path, stopped):
    tag = uuid.uuid4().hex
    proc, mark, err = _launch(tmp_path, tag)
    _wait_or_end(proc, lambda: mark.exists(), "rank 0's first rollout")
    # rank 1 stopped: rank 0 ends its rollout (<= DELAY s) and finds rank 1 silent in the roll call before its
    # broadcast (min(120 s, the bound)); rank 0 stopped: rank 1 waits the bound from the start of the rollout
    lines, took, code, text = _stop_rank(proc, tag, stopped, err, DELAY + BOUND + 30)
    host = socket.gethostname()
    assert len(lines) == 1, text[-3000:]
    if stopped == 1:  # rank 0 names the rank that did not answer
        assert lines[0].startswith(f"opid-train: lost node 0 (host {host}, global rank 1): no answer when rank 0's "
                                   f"work was done within {BOUND} s on the control group"), lines
    else:  # the lowest other rank names rank 0
        assert lines[0].startswith(f"opid-train: lost node 0 (host {host}, global rank 0): no word from it within "
                                   f"{BOUND} s on the control group"), lines
    assert "the job ends, exit 5" in lines[0]
    assert took <= DELAY + BOUND + 20, took  # + the rollout itself and process start-up slack on 2 cores
    # the reporting rank left with exit 5 (torchrun's summary), the job failed; no gloo timeout surfaced
    assert code != 0 and re.search(r"exitcode\s*:\s*5 ", text), text[-3000:]
    # (torch's own C++ log may add "Rank 1 failed to pass monitoredBarrier" lines; torchrun its ChildFailedError)
    assert "Timed out waiting" not in text and "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text, \
        text[-3000:]
    print(f"stopped rank {stopped}: one line after {took:.1f} s (bound {BOUND} s, rank 0's rollout {DELAY} s): "
          f"{lines[0]}")


class _Node:
    """A rank's view of the rendezvous store that can be frozen (a SIGSTOPped or cut-off node: its requests stop
    coming) or broken (the store unreachable from it: every request fails)."""

    def __init__(self, store):
        import threading

        self.store, self.thawed, self.broken = store, threading.Event(), False
        self.thawed.set()

    def _call(self, name, *args):
        self.thawed.wait()
        if self.broken:
            raise RuntimeError("Socket Timeout")
        return getattr(self.store, name)(*args)

    def set(self, *a):
        return self._call("set", *a)

    def get(self, *a):
        return self._call("get", *a)

    def check(self, *a):
        return self._call("check", *a)

    def multi_get(self, *a):
        return self._call("multi_get", *a)


def _heartbeats(n, timeout_s, reporter=1):
    """n ranks' heartbeats over one in-process store; each records how it ended instead of exiting."""
    import torch.distributed as dist

    from opid_mega.megatron.heartbeat import Heartbeat

    store, ended = dist.HashStore(), {}
    nodes = [_Node(store) for _ in range(n)]
    beats = [Heartbeat(nodes[r], r, n, timeout_s, describe=lambda ranks, s: f"lost rank {ranks} within {s:g} s",
                       reports=lambda lost, r=r: r == (reporter if lost == 0 else 0),
                       on_lost=lambda code, r=r: ended.setdefault(r, (code, time.monotonic())))
             for r in range(n)]
    return nodes, beats, ended


def test_heartbeat_names_a_silent_rank_wherever_it_stopped_and_not_one_that_ended(capsys):
    """deploy.heartbeat_timeout_s (opid_mega.megatron.heartbeat): rank 2 stops answering (its process stopped, its
    node cut off): rank 0 names it within the timeout + a beat and leaves with exit code 5, rank 1 reads rank 0's
    verdict and leaves quietly; a rank that ended (stop()) is never counted lost; rank 0 gone silent is named by the
    lowest rank on another host; a store that no longer answers is node 0 lost."""
    timeout = 1.5
    nodes, beats, ended = _heartbeats(4, timeout)
    for b in beats:
        b.start()
    time.sleep(0.6)
    beats[3].stop()  # ended: said so
    nodes[2].thawed.clear()  # stopped
    t0 = time.monotonic()
    while len(ended) < 2 and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert sorted(ended) == [0, 1] and all(code == 5 for code, _ in ended.values()), ended
    assert ended[0][1] - t0 <= timeout + 0.5, ended[0][1] - t0
    assert beats[0].lost == beats[1].lost == f"lost rank [2] within {timeout:g} s"
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "lost rank" in ln]
    assert lines == [f"opid-train: lost rank [2] within {timeout:g} s"]  # one line, from rank 0
    nodes[2].thawed.set()
    for b in beats:
        b.stop()

    nodes, beats, ended = _heartbeats(3, timeout)  # rank 0 stopped: rank 1 (the reporter here) names it
    for b in beats:
        b.start()
    time.sleep(0.6)
    nodes[0].thawed.clear()
    t0 = time.monotonic()
    while len(ended) < 2 and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert sorted(ended) == [1, 2] and max(t for _, t in ended.values()) - t0 <= timeout + 0.5
    assert beats[1].lost == f"lost rank [0] within {timeout:g} s"
    assert [ln for ln in capsys.readouterr().err.splitlines() if "lost rank" in ln] == [f"opid-train: {beats[1].lost}"]
    nodes[0].thawed.set()
    for b in beats:
        b.stop()

    nodes, beats, ended = _heartbeats(2, timeout)  # the store unreachable from rank 1: node 0 lost, to rank 1
    for b in beats:
        b.start()
    time.sleep(0.6)
    nodes[1].broken = True
    t0 = time.monotonic()
    while 1 not in ended and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert 1 in ended and ended[1][1] - t0 <= timeout + 0.5 and beats[1].lost == f"lost rank [0] within {timeout:g} s"
    for b in beats:
        b.stop()


def test_the_lost_node_bound_is_minutes_by_default_and_opid_plan_states_it(tiny_cfg, capsys):
    from opid_mega.config import beat_interval, node_lost_bound
    from opid_mega.plan import main as plan_main

    cfg = tiny_cfg()
    assert cfg.deploy.heartbeat_timeout_s == 60 and beat_interval(60) == 5 and node_lost_bound(cfg) == 75
    assert node_lost_bound(tiny_cfg("deploy.heartbeat_timeout_s=6")) == 6 + 1 + 10
    assert plan_main(["--config", CONFIG, "--json", "deploy.nodes=2", "deploy.gpus_per_node=1"]) in (0, 1)
    out = json.loads(capsys.readouterr().out)
    assert out["node_lost_bound_s"] == 75
    plan_main(["--config", CONFIG, "deploy.nodes=2", "deploy.gpus_per_node=1"])
    text = capsys.readouterr().out
    assert "a lost node ends the job within 75 s" in text, text[-2000:]


HEARTBEAT = 6  # deploy.heartbeat_timeout_s of these runs (bound: 6 + 1 + 10 s)


@pytest.mark.slow
@pytest.mark.parametrize("stopped", [1, 0], ids=["rank1_stopped", "rank0_stopped"])
def test_a_rank_stopped_inside_the_ppo_update_ends_the_job_within_the_heartbeat_bound(tmp_path, stopped, tiny_cfg):
    """Rank 0's update starts 10 s late (tests/trainer/_slow_rank0.py), so rank 1 waits in the update's collective;
    a rank is SIGSTOPped then. The control group's timeout is the default (hours) and the training groups' 300 s:
    the heartbeats (deploy.heartbeat_timeout_s=6) end the job with one line naming the stopped rank's node, exit 5,
    within the bound. Before, the collective's 300 s timeout ended it with a gloo traceback naming no node."""
    from opid_mega.config import node_lost_bound

    tag = uuid.uuid4().hex
    train_mark = tmp_path / "update_started"
    proc, _, err = _launch(tmp_path, tag, args=[f"deploy.heartbeat_timeout_s={HEARTBEAT}"],
                           env={"OPID_TEST_DELAY_S": "0", "OPID_TEST_TRAIN_DELAY_S": "10",
                                "OPID_TEST_TRAIN_MARK": str(train_mark)})
    _wait_or_end(proc, lambda: train_mark.exists(), "rank 0's update")
    time.sleep(2.0)  # rank 1 is in the update's collective, waiting for rank 0
    lines, took, code, text = _stop_rank(proc, tag, stopped, err, 120)
    host = socket.gethostname()
    assert len(lines) == 1, text[-3000:]
    assert lines[0].startswith(f"opid-train: lost node 0 (host {host}, global rank {stopped}): no heartbeat within "
                               f"{HEARTBEAT} s in the rendezvous store"), lines
    assert "the job ends, exit 5" in lines[0]
    bound = node_lost_bound(tiny_cfg(f"deploy.heartbeat_timeout_s={HEARTBEAT}"))
    # rank 1 stopped: rank 0 first sleeps out its delay (it beats meanwhile); + process slack on 2 cores
    assert took <= bound + 20, took
    assert code != 0 and re.search(r"exitcode\s*:\s*5 ", text), text[-3000:]
    assert "Timed out waiting" not in text and "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text, \
        text[-3000:]
    print(f"stopped rank {stopped} inside the update: one line after {took:.1f} s (bound {bound:g} s): {lines[0]}")
