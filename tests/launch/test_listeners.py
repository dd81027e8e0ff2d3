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


def _process_listeners(pid: int, ss=("ss",)) -> set:
    """Addresses process `pid` listens on (`ss -ltnpH`; `ss`: the command, e.g. run inside a network namespace)."""
    out = subprocess.run([*ss, "-ltnpH"], capture_output=True, text=True).stdout
    return {line.split()[3].rsplit(":", 1)[0].strip("[]") for line in out.splitlines()
            if f"pid={pid}," in line and len(line.split()) > 3}


LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def test_one_process_set_up_listens_on_loopback_only():
    """A lone process's process groups (opid_mega.megatron.parallel.initialize without torchrun): an in-process
    store, gloo on the loopback interface. Before, env:// served a TCPStore on every address ([::]:MASTER_PORT)."""
    if subprocess.run(["ss", "-V"], capture_output=True).returncode != 0:
        pytest.skip("no ss (iproute2)")
    import os
    import sys

    env = {k: v for k, v in BASE_ENV.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    code = ("import os, sys\nfrom opid_mega.megatron import parallel\nparallel.initialize()\n"
            "print(os.getpid(), os.environ['GLOO_SOCKET_IFNAME'], flush=True)\nsys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**env, "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    try:
        pid, ifname = p.stdout.readline().split()
        seen = _process_listeners(int(pid))
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    print(f"GLOO_SOCKET_IFNAME={ifname}; listening on {sorted(seen)}")
    assert seen and seen <= LOOPBACK, seen  # gloo's own pair listeners, on loopback


@pytest.mark.slow
def test_one_process_opid_train_run_listens_on_loopback_only(tmp_path):
    """`opid-train` without torchrun (local engine, 3 iterations) on a host whose name resolves to its network
    address (a one-node simulated cluster without the stock 127.0.1.1 line, where gloo's own default would bind that
    address): every listener of the trainer, polled with `ss -ltnp` through the run, is on loopback."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    import cluster_sim

    reason = cluster_sim.unavailable_reason()
    if reason:
        pytest.skip(f"simulated cluster unavailable: {reason}")
    run = tmp_path / "run"
    args = [a for a in TINY if not a.startswith("train.iterations=")] + ["train.iterations=3"]
    env = {k: v for k, v in BASE_ENV.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    seen: set = set()
    with cluster_sim.Cluster(1, stock_hosts=False, interface_env=False) as c:
        ss = ("ip", "netns", "exec", c.nodes[0].netns, "ss")
        with open(tmp_path / "out", "wb") as out:
            proc = c.popen(0, [sys.executable, "-m", "opid_mega.cli", "--config", CONFIG, "--run-dir", str(run)]
                           + args, env={**env, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT,
                           cwd=str(ROOT))
            t0 = time.monotonic()
            while proc.poll() is None and time.monotonic() - t0 < 500:
                trainers = [pid for pid in c.pids(0) if "opid_mega.cli" in _cmdline(pid)]
                for pid in trainers:
                    seen |= _process_listeners(pid, ss)
                time.sleep(0.5)
        code = proc.wait(timeout=60)
        resolved = c.run(0, [sys.executable, "-c", "import socket; print(socket.gethostbyname(socket.gethostname()))"])
    log = (tmp_path / "out").read_text(errors="replace")
    print(f"host name resolves to {resolved.stdout.strip()}; the trainer listened on {sorted(seen)}")
    assert code == 0, log[-4000:]
    assert resolved.stdout.strip() == c.nodes[0].addr  # gloo's default would have been this address
    assert seen and seen <= LOOPBACK, seen
