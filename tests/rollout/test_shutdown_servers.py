"""SIGTERM / SIGHUP to an opid-train that launched real SGLang CPU servers leave no process of the run behind
(issue 22, item 6): the signal arrives mid-rollout; every process the trainer started (rollout server, analyzer
server, router, and all their children, each server in its own process group) is gone when the trainer exits with
128 + signum and one line on stderr.

SIGTERM: one rollout server + the launched analyzer server (analyzer.backend=llm, no base_url). SIGHUP: one rollout
server behind sglang-router. Tiny random Qwen3, rollout.engine=sglang, the CPU test flags of real_sglang_cpu.
"""
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                         "MASTER_ADDR", "MASTER_PORT")}
ENV.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
# 2 tasks x 2 trajectories of <= 3 steps, long enough responses that the rollout is still running when signalled
ARGS = ["model.init_from=", "rollout.engine=sglang", "rollout.tasks_per_iter=2", "rollout.group_size=2",
        "env.max_steps=3", "rollout.max_response_tokens=64", "eval.interval=0", "eval.num_tasks=0",
        "train.iterations=3", "train.save_interval=0", "train.micro_batch_tokens=1024", "train.mini_batch_size=8",
        "logging.tensorboard=false", "logging.progress=false", "deploy.rollout_servers_per_node=1"]


def _proc_stat(pid: int):
    """(ppid, pgid, state, start time) of a live process, else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[2]), fields[0], int(fields[19])


def _all():
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _proc_stat(int(d))
            if st is not None and st[2] != "Z":
                out[int(d)] = st
    return out


def _descendants(root: int) -> dict:
    """pid -> (pgid, start time) of every live descendant of `root`."""
    procs = _all()
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, pgid, _, start) in procs.items():
            if ppid == parent and pid not in found:
                found[pid] = (pgid, start)
                frontier.append(pid)
    return found


def _left(recorded: dict, pgids: set) -> list:
    """What is still alive of the recorded processes (same pid and start time), or in their process groups."""
    procs = _all()
    return sorted({pid for pid, (pgid, start) in recorded.items() if pid in procs and procs[pid][3] == start} |
                  {pid for pid, st in procs.items() if st[1] in pgids})


def _generates(run: Path) -> int:
    return sum(p.read_text(errors="replace").count("POST /generate") for p in (run / "sglang").glob("sglang_server_*.log")) \
        if (run / "sglang").exists() else 0


CASES = {
    "SIGTERM": (signal.SIGTERM, "analyzer"),
    "SIGHUP": (signal.SIGHUP, "router"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_signal_leaves_no_process_of_the_run(case, tmp_path, real_sglang_cpu, tiny_qwen3):
    sig, extra = CASES[case]
    if extra == "router" and importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router not installed")
    flags = ",".join(real_sglang_cpu(max_total_tokens=4096))
    args = ARGS + [f"model.path={tiny_qwen3}", f"rollout.sglang_args=[{flags}]"]
    if extra == "analyzer":  # the trainer launches an SGLang server for the analyzer too
        args += ["analyzer.backend=llm", f"analyzer.model={tiny_qwen3}", f"analyzer.sglang_args=[{flags}]",
                 "analyzer.max_tokens=16", "analyzer.json_mode=false"]
    else:
        args += ["deploy.balancer=router", "deploy.router_args=[--policy,round_robin]"]
    run = tmp_path / "run"
    err = tmp_path / "stderr"
    with open(tmp_path / "stdout", "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen([sys.executable, "-m", "opid_mega.cli", "--config", CONFIG, "--run-dir", str(run)]
                                + args, env=ENV, stdout=fo, stderr=fe, start_new_session=True,
                                # a SIGHUP ignored by whoever started pytest (nohup) would stay ignored in the run
                                preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
        try:
            t0 = time.monotonic()
            while _generates(run) < 2:  # the rollout has begun (past the servers' warm-up request)
                assert proc.poll() is None, (tmp_path / "stdout").read_text()[-2000:] + err.read_text()[-3000:]
                assert time.monotonic() - t0 < 400, "the rollout did not start"
                time.sleep(0.2)
            started = time.monotonic() - t0
            recorded = _descendants(proc.pid)
            pgids = {pgid for pgid, _ in recorded.values()} - {proc.pid}  # the servers' own groups
            want = 2  # rollout server + analyzer server, or rollout server + router
            assert len(pgids) >= want, recorded
            before = err.stat().st_size
            ts = time.monotonic()
            os.kill(proc.pid, sig)
            rc = proc.wait(timeout=90)
            stop_s = time.monotonic() - ts
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    name = signal.Signals(sig).name
    print(f"{case}: rollout began {started:.0f} s after the start; {len(recorded)} processes in {len(pgids) + 1} "
          f"groups; exit {rc} {stop_s:.1f} s after the signal")
    lines = [ln for ln in err.read_bytes()[before:].decode(errors="replace").splitlines() if ln.strip()]
    assert rc == 128 + sig, lines
    assert len(lines) == 1, lines
    assert re.fullmatch(rf"opid-train: stopped by {name} in iteration 1 of 3; no checkpoint yet; nothing to "
                        r"resume: start it again", lines[0]), lines[0]
    deadline = time.monotonic() + 20
    while _left(recorded, pgids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _left(recorded, pgids), f"processes of the run outlived it: {_left(recorded, pgids)}"
    # the servers were stopped, not taken for crashed: none slept out SGLang's crash diagnostics (5 s, py-spy ...)
    logs = sorted(run.rglob("sglang_server_*.log"))
    assert logs and not [p.name for p in logs if "before crash diagnostics" in p.read_text(errors="replace")], logs


# ---- a rank killed without a chance to stop its servers (SIGKILL, the OOM killer) --------------------------------
RANK = """
import sys, time
from opid_mega.rollout.fleet import RouterFleet
from opid_mega.rollout.sglang_engine import SGLangEngine
model, run_dir, flags = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
server = SGLangEngine(model, server_args=flags, log_dir=run_dir + "/sglang", startup_timeout_s=600)
router = RouterFleet([server], router_args=["--policy", "round_robin"], log_dir=run_dir + "/sglang")
print(server.pid, router.router_pid, flush=True)
time.sleep(3600)
"""


@pytest.mark.slow
def test_sigkilled_rank_takes_its_server_and_router_along(tmp_path, real_sglang_cpu, tiny_qwen3):
    """SIGKILL of a process that launched a real SGLang CPU server and the router: no process of either is alive 10 s
    later (opid_mega.infra.tether); the next start in the same run directory finds nothing left to stop."""
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router not installed")
    run = tmp_path / "run"
    flags = ",".join(real_sglang_cpu(max_total_tokens=4096))
    rank = subprocess.Popen([sys.executable, "-c", RANK, tiny_qwen3, str(run), flags], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = rank.stdout.readline()
        assert line.strip(), rank.stderr.read()[-3000:]
        server, router = (int(x) for x in line.split())
        recorded = _descendants(rank.pid)
        pgids = {server, router}
        assert {pgid for pgid, _ in recorded.values()} >= pgids, recorded
        assert len(list((run / "sglang" / "pids").glob("*.json"))) == 2
        os.killpg(rank.pid, signal.SIGKILL)  # the rank alone: its servers run in their own sessions
        rank.wait(timeout=30)
        t0 = time.monotonic()
        while _left(recorded, pgids) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        gone_s = time.monotonic() - t0
    finally:
        if rank.poll() is None:
            os.killpg(rank.pid, signal.SIGKILL)
    left = _left(recorded, pgids)
    for pid in left:  # never leave them running, whatever the outcome
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(f"{len(recorded)} processes of the server and router; gone {gone_s:.1f} s after SIGKILL of the rank")
    assert not left, f"processes of the SIGKILLed rank's server/router alive 10 s later: {left}"
    from opid_mega.infra import tether

    lines = []

    class Out:
        def write(self, s):
            lines.extend(ln for ln in s.splitlines() if ln.strip())

        def flush(self):
            pass

    assert tether.sweep(run / "sglang", out=Out()) == [] and lines == []  # nothing left: nothing reported
    assert not list((run / "sglang" / "pids").glob("*.json"))
