"""On a simulated cluster node (tools/cluster_sim.py): a rank that launched a real SGLang CPU server and the router,
both bound to the node's cluster address, is SIGKILLed alone (the OOM killer's way); 10 s later nothing of the
server or the router runs on that node (opid_mega.infra.tether: the watcher in each process group); a second start
in the same run directory finds nothing to stop. Needs root and SGLang + sglang-router; skips otherwise."""
import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest

from .test_launch import BASE_ENV, ROOT

sys.path.insert(0, str(ROOT / "tools"))
import cluster_sim  # noqa: E402  (tools/cluster_sim.py)

RANK = """
import os, sys, time
from opid_mega.models import prepare_model
from opid_mega.rollout.fleet import RouterFleet
from opid_mega.rollout.sglang_engine import SGLangEngine
run_dir = sys.argv[1]
model = prepare_model("tiny-qwen3", run_dir + "/models")
flags = ["--dtype", "float32", "--max-total-tokens", "4096", "--max-running-requests", "8", "--disable-radix-cache"]
host = os.environ["NODE_ADDR"]
server = SGLangEngine(model, server_args=flags, host=host, log_dir=run_dir + "/sglang", startup_timeout_s=600)
router = RouterFleet([server], router_args=["--policy", "round_robin"], host=host, log_dir=run_dir + "/sglang")
print(server.pid, router.router_pid, flush=True)
time.sleep(3600)
"""


@pytest.mark.slow
def test_sigkilled_rank_on_a_node_leaves_no_server_or_router(tmp_path):
    reason = cluster_sim.unavailable_reason()
    if reason:
        pytest.skip(f"simulated cluster unavailable: {reason}")
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang / sglang-router not installed")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this test serves on CPU")
    run = tmp_path / "run"
    with cluster_sim.Cluster(2) as c:
        rank = c.popen(1, [sys.executable, "-c", RANK, str(run)], env={**BASE_ENV, "OMP_NUM_THREADS": "1"},
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
        line = rank.stdout.readline()
        assert line.strip(), rank.stderr.read()[-3000:]
        server, router = (int(x) for x in line.split())
        before = set(c.pids(1))
        assert {server, router} <= before
        # the rank process itself (the child of the node's command wrapper that runs the script)
        ranks = [p for p in before if b"-c" in open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
                 and b"RouterFleet" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and any(p in c.pids(1) for p in before):
            time.sleep(0.1)
        left = [p for p in c.pids(1) if p in before]
        gone_s = time.monotonic() - t0
        rank.wait(timeout=30)
        print(f"node 1: {len(before)} processes of the rank, its server and router; gone {gone_s:.1f} s after SIGKILL "
              f"of the rank; left: {left}")
        assert not left, [open(f"/proc/{p}/cmdline", "rb").read()[:200] for p in left if os.path.exists(f"/proc/{p}")]
        # a second start on node 1 in the same run directory: nothing left to stop, the dead start's records go
        r = c.run(1, [sys.executable, "-c", "import sys; from opid_mega.infra import tether; "
                                            "print(tether.sweep(sys.argv[1]))", str(run / "sglang")],
                  env=BASE_ENV, cwd=str(ROOT))
        assert r.returncode == 0 and r.stdout.strip() == "[]" and "leftover" not in r.stderr, r.stderr
        assert not list((run / "sglang" / "pids").glob("*.json"))
