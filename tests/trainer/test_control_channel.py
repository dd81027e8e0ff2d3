"""Issue 14 item 2: ranks that wait for global rank 0's rollout / analysis / evaluation wait on the gloo control group
(deploy.control_timeout_s), not in a training collective (deploy.train_timeout_s).

Two gloo ranks (DP2). Rank 0's every rollout and evaluation is delayed 6 s, twice a 3 s training-group timeout;
the run completes (rollout, evaluation, checkpoint). The same run with a 4 s control timeout fails: rank 1 gives up
waiting for rank 0 on the control group after 4 s (one line naming rank 0's node), so the first run really waited
longer than the timeout it was given."""
import os
import re
import subprocess
import sys

import pytest

from .conftest import CONFIG, TINY

HERE = os.path.dirname(__file__)
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OPID_TEST_DELAY_S": "6", "OMP_NUM_THREADS": "1"}
ARGS = TINY + ["eval.interval=1", "eval.num_tasks=1", "eval.before_training=true", "train.save_interval=1",
               "deploy.train_timeout_s=3"]


def _run(run_dir, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           os.path.join(HERE, "_slow_rank0.py"), "--config", CONFIG, "--run-dir", str(run_dir)] + ARGS + list(extra)
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_rank0_slower_than_training_timeout(tmp_path):
    from opid_mega.metrics import read_metrics

    r = _run(tmp_path / "ok")
    assert r.returncode == 0, r.stderr[-4000:]
    assert [m["step"] for m in read_metrics(tmp_path / "ok")] == [0, 1]
    assert (tmp_path / "ok" / "checkpoints" / "latest_step").read_text().strip() == "1"

    # 4 s, not the training groups' 3 s: the bound that ends the wait is the control group's. Rank 1 says so in one
    # line naming rank 0's node (opid_mega.megatron.parallel.NodeLost, exit 5); torchrun stops rank 0 and exits 1.
    r = _run(tmp_path / "short", "deploy.control_timeout_s=4")
    assert r.returncode == 1, r.stderr[-3000:]
    assert re.search(r"^opid-train: lost node 0 \(host \S+, global rank 0\): no word from it within 4 s on the "
                     r"control group", r.stderr, re.M), r.stderr[-3000:]
    assert "Timed out waiting" not in r.stderr, r.stderr[-3000:]
