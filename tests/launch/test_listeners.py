"""What listens during a one-node run launched by tools/launch/torchrun.sh (`ss -ltnp`, polled through the run):
the trainer's ranks listen on loopback only (gloo on the loopback interface: GLOO_SOCKET_IFNAME from torchrun.sh;
the weight-update group's store on 127.0.0.1, closed after the group's first update); the SGLang server and the
router bind deploy.bind_host (127.0.0.1 on one node). What SGLang and torchrun open themselves is printed and checked
against docs/multi-node.md ("Ports").

One node, 2 ranks, one SGLang CPU server behind the router, sync.method=distributed (the store), 2 iterations; tiny
random Qwen3.
"""
import importlib.util
import re
import subprocess
import time

import pytest

from .test_launch import BASE_ENV, CONFIG, LAUNCH, ROOT, TINY

# 2 ranks: under torchrun a one-rank world would not reach the agent's store (opid_mega.megatron.parallel takes a
# fresh MASTER_PORT for a world of 1)
ARGS = TINY + ["deploy.gpus_per_node=2", "train.mini_batch_size=4", "rollout.engine=sglang", "deploy.rollout_servers_per_node=1", "deploy.balancer=router",
               "sync.method=distributed", "train.iterations=2",
               "rollout.sglang_args=[--dtype,float32,--max-total-tokens,4096,--max-running-requests,8,"
               "--disable-radix-cache]"]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def _role(pid: int, root: int) -> str:
    """Which process of the launch `pid` is (by its own command line or its nearest launched ancestor's), or ""."""
    chain, p = [], pid
    while p > 1 and len(chain) < 50:
        chain.append(p)
        if p == root:
            break
        p = _ppid(p)
    if root not in chain:
        return ""
    for q in chain:  # nearest first
        cmd = _cmdline(q)
        if "sglang_router.launch_router" in cmd:
            return "router"
        if "sglang.launch_server" in cmd:
            return "sglang server"
        if "opid_mega.cli" in cmd and "torch.distributed.run" not in cmd:
            return "trainer rank"
        if "torch.distributed.run" in cmd:
            return "torchrun agent"
    return "launcher"


def _listeners(root: int) -> set:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    found = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 6:
            continue
        local = parts[3]
        addr = local.rsplit(":", 1)[0].strip("[]")
        for pid in re.findall(r"pid=(\d+)", line):
            role = _role(int(pid), root)
            if role:
                found.add((role, addr))
    return found


@pytest.mark.slow
def test_one_node_run_listens_on_loopback_only(tmp_path):
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang / sglang-router not installed")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this run serves on CPU")
    if subprocess.run(["ss", "-V"], capture_output=True).returncode != 0:
        pytest.skip("no ss (iproute2)")
    run = tmp_path / "run"
    env = {**BASE_ENV, "OMP_NUM_THREADS": "1"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    env.pop("NCCL_SOCKET_IFNAME", None)
    with open(tmp_path / "out", "wb") as out:
        proc = subprocess.Popen(["bash", str(LAUNCH / "torchrun.sh"), "--config", CONFIG, "--run-dir", str(run)]
                                + ARGS, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                start_new_session=True)
        seen = set()
        t0 = time.monotonic()
        try:
            while proc.poll() is None and time.monotonic() - t0 < 800:
                seen |= _listeners(proc.pid)
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                import os
                import signal

                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
    log = (tmp_path / "out").read_text(errors="replace")
    print("listeners during the run:", sorted(seen))
    assert proc.returncode == 0, log[-4000:]
    assert "torchrun.sh: GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo" in log
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    roles = {role for role, _ in seen}
    print("router lines:", [ln for ln in log.splitlines() if "router" in ln.lower()][:5])
    assert {"trainer rank", "sglang server"} <= roles, seen
    outside = sorted((role, addr) for role, addr in seen if addr not in loopback)
    # only torchrun's own rendezvous store and what SGLang's scheduler opens itself (docs/multi-node.md, "Ports")
    assert not [x for x in outside if x[0] in ("trainer rank", "router")], outside
