"""Issue 14 acceptance: a 4-rank launch through tools/launch/torchrun.sh (2 simulated nodes x 2 ranks, c10d on
localhost), each node's first rank launching one real SGLang CPU server, global rank 0 driving both behind SGLang's
router (round robin); 2 iterations. As soon as the router runs, global rank 0's own server has its scheduler frozen
(SIGSTOP: its HTTP front end still passes health checks, so the first rollout requests routed to it hang in flight);
3 s after the other server has answered a rollout request the frozen server is killed (SIGKILL): every trajectory of both iterations is there, the run completes (weight
syncs go to the server left; the probe check runs after the first one), and the metrics count the dead server and
the re-sent requests (the router's own retries and the fleet's)."""
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests

from .test_launch import BASE_ENV, CONFIG, LAUNCH, TWO_BY_TWO, free_port, metrics

KEY = "fleet-test-key-0123456789"  # the run's API key (OPID_SGLANG_API_KEY), so this test can ask the router itself
AUTH = {"Authorization": f"Bearer {KEY}"}

ARGS = ["model.init_from=", "rollout.engine=sglang", "rollout.tasks_per_iter=2", "rollout.group_size=2",
        "env.max_steps=3", "rollout.max_response_tokens=48", "eval.interval=0", "eval.num_tasks=0",
        "train.iterations=2", "train.save_interval=0", "train.micro_batch_tokens=1024", "train.mini_batch_size=8",
        "logging.tensorboard=false", "logging.progress=false", "parallel.tp=2",
        "deploy.rollout_servers_per_node=1", "deploy.balancer=router", "deploy.router_args=[--policy,round_robin]",
        "rollout.sglang_args=[--dtype,float32,--max-total-tokens,4096,--max-running-requests,8,"
        "--disable-radix-cache]", "sync.check_interval=1"] + TWO_BY_TWO


def _server_pid(log: Path) -> int:
    port = re.search(r"--port (\d+)", log.read_text(errors="replace").splitlines()[0]).group(1)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "sglang.launch_server" in cmd and f"--port {port} " in cmd + " ":
                return int(d)
    raise AssertionError(f"no server process for {log}")


def _generates(log: Path) -> int:
    return log.read_text(errors="replace").count("POST /generate")


def _scheduler_pid(pgid: int) -> int:
    """The SGLang scheduler process (it runs the model) of the server in process group `pgid`."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
                if cmd.startswith(b"sglang::scheduler") and os.getpgid(int(d)) == pgid:
                    return int(d)
            except OSError:
                continue
    raise AssertionError(f"no sglang::scheduler in process group {pgid}")


@pytest.mark.slow
def test_two_nodes_two_servers_behind_router_lose_no_trajectory(tmp_path):
    run = tmp_path / "run"
    env = {**BASE_ENV, "NNODES": "2", "NPROC_PER_NODE": "2", "RDZV_ENDPOINT": f"localhost:{free_port()}",
           "RDZV_ID": "fleet", "OMP_NUM_THREADS": "1", "OPID_SGLANG_API_KEY": KEY}
    cmd = ["bash", str(LAUNCH / "torchrun.sh"), "--config", CONFIG, "--run-dir", str(run)] + ARGS
    procs = [subprocess.Popen(cmd, env={**env, "NODE_RANK": str(n)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for n in (0, 1)]
    try:
        deadline = time.monotonic() + 600
        logs = []
        while time.monotonic() < deadline and len(logs) < 2:
            assert all(p.poll() is None for p in procs), [p.communicate()[0][-3000:] for p in procs]
            logs = sorted((run / "sglang").glob("sglang_server_*.log")) if (run / "sglang").exists() else []
            time.sleep(0.2)
        # the victim: global rank 0's own server, the first --worker-urls of the router; frozen as soon as the
        # router has registered it (rank 0 and the router are done with their set-up calls to it), so the first rollout requests routed to it hang
        router = []
        while not router or "--worker-urls" not in router[0].read_text(errors="replace"):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no router"
            router = sorted((run / "sglang").glob("sglang_router_*.log"))
            time.sleep(0.05)
        first_url = router[0].read_text(errors="replace").split("--worker-urls", 1)[1].split()[0]
        router_url = "http://127.0.0.1:" + router[0].stem.rsplit("_", 1)[1]
        while True:  # the router has registered both workers (its registration talks to their schedulers)
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "router not ready"
            try:
                workers = requests.get(router_url + "/workers", timeout=2, headers=AUTH).json().get("workers", [])
                if len(workers) == 2 and all(w.get("is_healthy", True) for w in workers):
                    break
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.1)
        victim = run / "sglang" / f"sglang_server_{first_url.rsplit(':', 1)[1]}.log"
        pgid = os.getpgid(_server_pid(victim))
        # Freeze only its scheduler: /health still answers (the HTTP front end is alive), so rollout requests are
        # routed to it and hang there, in flight, until the whole server is killed 3 s after the rollout began.
        os.kill(_scheduler_pid(pgid), signal.SIGSTOP)
        other = [x for x in logs if x != victim][0]
        while _generates(other) < 2:  # past its warm-up request: the rollout has begun
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "rollout did not start"
            time.sleep(0.05)
        time.sleep(3)
        os.killpg(pgid, signal.SIGKILL)
        outs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(o[-4000:] for o in outs)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/trajectories"] == 4 and r["rollout/env_errors"] == 0  # no trajectory lost
        assert r["weight_sync/version"] == r["step"] and r["weight_sync/probe_max_abs_diff"] <= 1e-3
    last = rows[-1]
    assert last["rollout/dead_servers"] == 1 and last["rollout/servers_alive"] == 1
    resent = last["rollout/retried_requests"] + last.get("rollout/router_retries", 0)
    assert resent >= 1, last
    print({k: v for k, v in last.items() if k.startswith(("rollout/", "weight_sync/"))})
