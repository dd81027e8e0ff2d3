"""The interface gloo and NCCL use, found by tools/launch/torchrun.sh when nobody set GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME (opid_mega.infra.hosts.socket_ifname), on the simulated cluster (tools/cluster_sim.py) whose nodes
have stock Debian/Ubuntu hosts files (each node's own name on 127.0.1.1) and, here, no NODE_ADDR or interface
variables at all, as a user's shell on a real cluster:
  - rendezvous on node 0's address: the 2-node run completes (gloo on eth0 on both nodes);
  - rendezvous on node 0's NAME, which node 0 resolves to 127.0.1.1: node 0 ends at once with one line naming the
    fix (NODE_ADDR), instead of a gloo "Connection refused, remote=[127.0.1.1]" traceback after the rendezvous.
Needs root (network namespaces); skips with the reason otherwise.
"""
import subprocess
import sys
import time

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


@pytest.mark.slow
def test_two_nodes_without_interface_variables_complete(tmp_path):
    run = tmp_path / "run"
    t0 = time.monotonic()
    with cluster_sim.Cluster(2, interface_env=False) as c:
        outs = [open(tmp_path / f"node{k}.out", "wb") for k in (0, 1)]
        procs = [_launch(c, k, run, f"{c.nodes[0].addr}:29400", outs[k]) for k in (0, 1)]
        try:
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for f in outs:
                f.close()
    logs = [(tmp_path / f"node{k}.out").read_text(errors="replace") for k in (0, 1)]
    print(f"2 nodes x 1 rank without NODE_ADDR / GLOO_SOCKET_IFNAME: {time.monotonic() - t0:.1f} s")
    assert codes == [0, 0], "\n----\n".join(x[-4000:] for x in logs)
    for log in logs:
        assert "torchrun.sh: GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0" in log, log[-2000:]
    assert_one_iteration(run)


def test_a_rendezvous_name_on_loopback_is_one_line_naming_the_fix(tmp_path):
    with cluster_sim.Cluster(2, interface_env=False) as c:
        t0 = time.monotonic()
        r = c.run(0, ["bash", str(LAUNCH / "torchrun.sh"), "--config", CONFIG, "--run-dir", str(tmp_path / "run")]
                  + TINY + ["deploy.nodes=2", "deploy.gpus_per_node=1"], timeout=60, cwd=str(ROOT),
                  env={**BASE_ENV, "NNODES": "2", "NPROC_PER_NODE": "1", "RDZV_ENDPOINT": "node0:29400"})
        took = time.monotonic() - t0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    print(f"ended in {took:.1f} s: {lines}")
    assert r.returncode == 2 and took < 60
    assert len(lines) == 1 and lines[0].startswith("opid: the rendezvous host 'node0' resolves to 127.0.1.1 "
                                                   "(loopback)") and "set NODE_ADDR" in lines[0], lines
