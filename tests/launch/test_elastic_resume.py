"""Resuming on another world size: a 1-node checkpoint resumed as 2 nodes (tools/launch/torchrun.sh, 2 simulated
nodes on localhost, 1 rank each: data parallel 2; rank 1 has no RNG file in the checkpoint and starts from the
(step, rank) seed), then back on 1 node; the launch preflight of a plain `--resume D` reads the recorded resume
overrides (deploy.nodes=2). Tiny random Qwen3, local rollout engine, one iteration per start.
"""
import subprocess
import sys
import time

import pytest

from .test_launch import BASE_ENV, CONFIG, LAUNCH, ROOT, TINY, free_port, metrics

ARGS = [a for a in TINY if not a.startswith(("train.iterations", "train.save_interval"))] + \
    ["train.save_interval=1", "train.keep_checkpoints=1"]


def _single(args, timeout=400):
    """opid-train in one process (a 1-node, 1-rank run)."""
    r = subprocess.run([sys.executable, "-m", "opid_mega.cli"] + args, env={**BASE_ENV, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


@pytest.mark.slow
def test_resume_on_two_nodes_from_a_one_node_checkpoint_and_back(tmp_path):
    run = tmp_path / "run"
    t0 = time.monotonic()
    _single(["--config", CONFIG, "--run-dir", str(run)] + ARGS + ["train.iterations=1"])
    assert [r["step"] for r in metrics(run)] == [1]

    env = {**BASE_ENV, "NNODES": "2", "NPROC_PER_NODE": "1", "RDZV_ENDPOINT": f"localhost:{free_port()}",
           "RDZV_ID": "elastic", "OMP_NUM_THREADS": "1"}
    cmd = [str(LAUNCH / "torchrun.sh"), "--resume", str(run), "deploy.nodes=2", "deploy.gpus_per_node=1",
           "train.iterations=2"]
    procs = [subprocess.Popen(cmd, env={**env, "NODE_RANK": str(n)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=str(ROOT)) for n in (0, 1)]
    try:
        logs = [p.communicate(timeout=500)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    both = "".join(logs)
    assert "was saved by 1 rank(s), this run has 2: ranks 1..1 start from RNG states seeded by (step, rank)" in both
    assert [r["step"] for r in metrics(run)] == [1, 2]

    # the preflight of a plain resume plans with the recorded override: 2 nodes
    r = subprocess.run([sys.executable, str(LAUNCH / "preflight.py"), "--", "--resume", str(run)],
                       env=BASE_ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[:2] == ["2", "1"], r.stdout + r.stderr

    _single(["--resume", str(run), "deploy.nodes=1", "deploy.gpus_per_node=1", "train.iterations=3"])
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    print(f"1 node -> 2 nodes -> 1 node: {time.monotonic() - t0:.1f} s")
