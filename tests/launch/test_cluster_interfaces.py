"""The interface gloo and NCCL use, found by tools/launch/torchrun.sh when nobody set GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME (opid_mega.infra.hosts.socket_ifname), on the simulated cluster (tools/cluster_sim.py) whose nodes
have stock Debian/Ubuntu hosts files (each node's own name on 127.0.1.1) and, here, no NODE_ADDR or interface
variables at all, as a user's shell on a real cluster:
  - rendezvous on node 0's address: the 2-node run completes (gloo on eth0 on both nodes);
  - rendezvous on node 0's NAME, which node 0 resolves to 127.0.1.1: node 0 ends at once with one line naming the
    fix (NODE_ADDR), instead of a gloo "Connection refused, remote=[127.0.1.1]" traceback after the rendezvous.
Needs root (network namespaces); skips with the reason otherwise.
"""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_launch import BASE_ENV, CONFIG, LAUNCH, ROOT, TINY, assert_one_iteration

sys.path.insert(0, str(ROOT / "tools"))
import cluster_sim  # noqa: E402  (tools/cluster_sim.py)

_REASON = cluster_sim.unavailable_reason()
pytestmark = pytest.mark.skipif(bool(_REASON), reason=f"simulated cluster unavailable: {_REASON}")


def _launch(cluster, k: int, run, rdzv: str, out):
    env = {**BASE_ENV, "NNODES": "2", "NPROC_PER_NODE": "1", "RDZV_ENDPOINT": rdzv, "RDZV_ID": "ifname-test",
           "OMP_NUM_THREADS": "1"}
    cmd = ["bash", str(LAUNCH / "torchrun.sh"), "--config", CONFIG, "--run-dir", str(run)] + TINY + \
          ["deploy.nodes=2", "deploy.gpus_per_node=1"]
    return cluster.popen(k, cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))


def _on_both_nodes(tmp_path, start, tag: str = "node"):
    """start(k, out) on nodes 0 and 1 at once, node k's output into tmp_path/<tag><k>.out; (exit codes, outputs)."""
    outs = [open(tmp_path / f"{tag}{k}.out", "wb") for k in (0, 1)]
    try:
        procs = [start(k, outs[k]) for k in (0, 1)]
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for f in outs:
            f.close()
    return codes, [(tmp_path / f"{tag}{k}.out").read_text(errors="replace") for k in (0, 1)]


@pytest.mark.slow
def test_two_nodes_without_interface_variables_complete(tmp_path):
    run = tmp_path / "run"
    t0 = time.monotonic()
    with cluster_sim.Cluster(2, interface_env=False) as c:
        codes, logs = _on_both_nodes(tmp_path, lambda k, out: _launch(c, k, run, f"{c.nodes[0].addr}:29400", out))
    print(f"2 nodes x 1 rank without NODE_ADDR / GLOO_SOCKET_IFNAME: {time.monotonic() - t0:.1f} s")
    assert codes == [0, 0], "\n----\n".join(x[-4000:] for x in logs)
    for log in logs:
        assert "torchrun.sh: GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0" in log, log[-2000:]
    assert_one_iteration(run)


def _torchrun(cluster, k: int, run, rdzv: str, out):
    """A plain `torchrun ... -m opid_mega.cli` on node k, as a user would type it: no interface variables, no
    --local-addr (torchrun gives the workers node 0's host name as MASTER_ADDR, which node 0 resolves to 127.0.1.1)."""
    env = {**BASE_ENV, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "plain-torchrun", "-m", "opid_mega.cli",
           "--config", CONFIG, "--run-dir", str(run)] + TINY + ["deploy.nodes=2", "deploy.gpus_per_node=1"]
    return cluster.popen(k, cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))


@pytest.mark.slow
def test_plain_torchrun_on_stock_hosts_completes(tmp_path):
    """The package sets the interface itself at process-group set-up (opid_mega.infra.hosts.set_socket_ifname):
    a plain torchrun with the rendezvous on node 0's NAME trains on 2 nodes with stock hosts files (node 0: its one
    cluster interface; node 1: the interface routing to node 0). Before, node 0's gloo took 127.0.1.1 and the
    run ended in a traceback."""
    run = tmp_path / "run"
    t0 = time.monotonic()
    with cluster_sim.Cluster(2, interface_env=False) as c:
        codes, logs = _on_both_nodes(tmp_path, lambda k, out: _torchrun(c, k, run, "node0:29400", out))
    print(f"plain torchrun, 2 nodes x 1 rank, stock hosts: {time.monotonic() - t0:.1f} s")
    assert codes == [0, 0], "\n----\n".join(x[-4000:] for x in logs)
    assert_one_iteration(run)


@pytest.mark.slow
def test_a_rendezvous_name_on_loopback_of_a_multi_homed_node_is_one_line_naming_the_fix(tmp_path):
    """Node 0 with two cluster interfaces and its name on 127.0.1.1: which interface the other nodes reach cannot be
    told. torchrun.sh ends at once with one line naming the fix; so does a plain torchrun's rank (at process-group
    set-up, opid_mega.infra.hosts.set_socket_ifname), within 60 s each."""
    with cluster_sim.Cluster(2, interface_env=False) as c:
        ns = c.nodes[0].netns
        for cmd in (["link", "add", "eth1", "type", "veth", "peer", "name", "eth1p"],
                    ["addr", "add", "198.19.0.1/24", "dev", "eth1"], ["link", "set", "eth1", "up"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True, capture_output=True)
        t0 = time.monotonic()
        r = c.run(0, ["bash", str(LAUNCH / "torchrun.sh"), "--config", CONFIG, "--run-dir", str(tmp_path / "run")]
                  + TINY + ["deploy.nodes=2", "deploy.gpus_per_node=1"], timeout=60, cwd=str(ROOT),
                  env={**BASE_ENV, "NNODES": "2", "NPROC_PER_NODE": "1", "RDZV_ENDPOINT": "node0:29400"})
        took = time.monotonic() - t0
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        print(f"torchrun.sh ended in {took:.1f} s: {lines}")
        assert r.returncode == 2 and took < 60
        assert len(lines) == 1 and lines[0].startswith("opid: the rendezvous host 'node0' resolves to 127.0.1.1 "
                                                       "(loopback)") and "set NODE_ADDR" in lines[0], lines
        assert "this node has 2 (eth0, eth1)" in lines[0]
        # a plain torchrun on both nodes: node 0's rank says it at process-group set-up and its agent ends with
        # the rank's exit code; node 1 then loses the rendezvous and ends too
        t0 = time.monotonic()
        outs = [open(tmp_path / f"plain{k}.out", "wb") for k in (0, 1)]
        try:
            procs = [_torchrun(c, k, tmp_path / "run2", "node0:29400", outs[k]) for k in (0, 1)]
            code = procs[0].wait(timeout=120)
            took = time.monotonic() - t0
            procs[1].wait(timeout=120)
        finally:
            for f in outs:
                f.close()
    log = (tmp_path / "plain0.out").read_text(errors="replace")
    ours = [ln for ln in log.splitlines() if ln.startswith("opid-train: the rendezvous host")]
    print(f"plain torchrun: node 0 ended in {took:.1f} s: {ours}")
    assert code != 0 and took < 60 and len(ours) == 1, log[-3000:]
    assert "'node0' resolves to 127.0.1.1 (loopback)" in ours[0] and "torchrun --local-addr" in ours[0]


@pytest.mark.slow
def test_ray_launcher_on_stock_hosts_completes(tmp_path):
    """A Ray cluster of 2 nodes (`ray start` in each, 1 CPU each: one trainer per node) with stock hosts files and
    no interface variables; tools/launch/ray_launch.py on node 0. The ranks get the interface at process-group
    set-up (opid_mega.infra.hosts.set_socket_ifname): before, gloo took the host name's 127.0.1.1 and the run
    ended in a traceback."""
    pytest.importorskip("ray")
    import secrets
    import shutil
    import tempfile

    run = tmp_path / "run"
    temps = [tempfile.mkdtemp(prefix=f"ray{k}-", dir="/tmp") for k in (0, 1)]  # short: Ray's socket paths
    token = tmp_path / "ray_token"  # recent Ray turns token auth on whenever ~/.ray/auth_token exists: say it
    token.write_text(secrets.token_hex(32))
    env = {**BASE_ENV, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token)}
    t0 = time.monotonic()
    try:
        with cluster_sim.Cluster(2, interface_env=False) as c:
            head = c.nodes[0].addr
            common = ["--num-cpus", "1", "--num-gpus", "0", "--object-store-memory", str(100 * 2 ** 20),
                      "--disable-usage-stats"]
            ray_bin = str(Path(sys.executable).parent / "ray")
            c.run(0, [ray_bin, "start", "--head", "--node-ip-address", head, "--port", "6379",
                      "--include-dashboard=false", "--temp-dir", temps[0], *common], env=env, timeout=180)
            c.run(1, [ray_bin, "start", "--address", f"{head}:6379", "--node-ip-address", c.nodes[1].addr,
                      "--temp-dir", temps[1], *common], env=env, timeout=180)
            r = c.run(0, [sys.executable, str(LAUNCH / "ray_launch.py"), "--address", f"{head}:6379",
                          "--timeout", "400", "--config", CONFIG, "--run-dir", str(run)] + TINY
                      + ["deploy.nodes=2", "deploy.gpus_per_node=1"], env=env, timeout=480, cwd=str(ROOT))
    finally:
        for d in temps:
            shutil.rmtree(d, ignore_errors=True)
    print(f"ray_launch.py, 2 nodes x 1 rank, stock hosts: {time.monotonic() - t0:.1f} s")
    assert r.returncode == 0, r.stderr[-6000:]
    assert "ray_launch.py: 2 rank(s) (2 x 1)" in r.stderr and "all 2 rank(s) finished" in r.stderr, r.stderr[-3000:]
    placed = re.findall(r"rank \d: node \d local rank 0/1 on (198\.18\.0\.\d)\n", r.stderr)
    assert sorted(placed) == ["198.18.0.1", "198.18.0.2"], r.stderr[-3000:]  # one rank on each node
    assert_one_iteration(run)
