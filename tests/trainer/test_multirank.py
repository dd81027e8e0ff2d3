"""opid-train under torchrun: Megatron TP2 x PP2 on 4 gloo CPU ranks, rollout/analysis on rank 0 with the batch
broadcast. Its first iteration (before any update) equals the single-process TP1/PP1 run."""
import os
import subprocess
import sys

import pytest

from .conftest import TINY

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
# one mini-batch per iteration: the PPO metrics of iteration 1 are all computed before any update
ARGS = TINY + ["train.iterations=2", "eval.interval=1", "eval.num_tasks=1", "train.mini_batch_size=16"]
# The single-process reference of test_tp2pp2_matches_single_process: only its rows 0 (evaluation before training)
# and 1 are compared, and everything logged up to row 1 comes before iteration 2 and before any checkpoint (the
# trainer logs an iteration's metrics, with its evaluation, before saving; the lr is constant; train.max_staleness=0
# draws no later rollout), so it stops after iteration 1 and saves nothing (no checkpoint-writer process either).
REF_ARGS = ARGS + ["train.iterations=1", "train.save_interval=0"]


def _start(config: str, run_dir, args, nproc: int = 1) -> subprocess.Popen:
    """opid-train on configs/<config> into run_dir (torchrun with nproc ranks when nproc > 1), one thread a rank."""
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    cmd = [sys.executable, *launcher, "-m", "opid_mega.cli", "--config", os.path.join(ROOT, "configs", config),
           "--run-dir", str(run_dir)] + list(args)
    with open(f"{run_dir}.stderr", "w") as err:  # a file, not a pipe: no run waits on another's reader
        return subprocess.Popen(cmd, env={**ENV, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=err)


def _train_side_by_side(*runs):
    """Start every (config, run_dir, args, nproc) at once (each rank single-threaded, so they share the cores without
    spinning) and wait for all; fails with the stderr of a run that failed."""
    procs = [_start(*run) for run in runs]
    for p, run in zip(procs, runs):
        assert p.wait(timeout=420) == 0, open(f"{run[1]}.stderr").read()[-4000:]


@pytest.mark.slow
def test_tp2pp2_matches_single_process(tmp_path):
    from opid_mega.metrics import read_metrics

    multi, single = tmp_path / "tp2pp2", tmp_path / "tp1"
    _train_side_by_side(("tiny_cpu_tp2pp2.yaml", multi, ARGS, 4), ("tiny_cpu.yaml", single, REF_ARGS))
    m, s = read_metrics(multi), read_metrics(single)
    assert [x["step"] for x in m] == [0, 1, 2] and [x["step"] for x in s] == [0, 1]
    assert m[1]["rollout/logprob_mismatch"] < 1e-4 and abs(m[1]["ppo/approx_kl_first"]) < 1e-6
    for k in ("train/success_rate", "train/step_samples", "adv/outcome_abs_mean", "adv/skill_abs_mean",
              "ppo/entropy", "eval/success_rate"):
        assert m[1][k] == pytest.approx(s[1][k], rel=1e-3, abs=1e-6), k
    # The random tiny model fails every episode (A_out = 0): the policy-gradient part of the loss is the λΔ term,
    # a difference of fp32 log-probs (~1e-6 apart across TP layouts), so the loss agrees to ~1e-5 absolute.
    assert m[1]["ppo/loss"] == pytest.approx(s[1]["ppo/loss"], abs=5e-5)
    assert (multi / "checkpoints" / "latest_step").read_text().strip() == "2"
    assert (multi / "audit.jsonl").exists()


@pytest.mark.slow
def test_dp2_shards_the_batch_and_matches_single_process(tmp_path):
    """Two gloo ranks, TP1 x PP1 -> data parallel 2: each rank trains on its share of every mini-batch and the
    log-prob passes are split over the ranks; iteration 1 (before any update) equals the single-process run."""
    from opid_mega.metrics import read_metrics

    args = TINY + ["train.iterations=1", "train.save_interval=0", "rollout.group_size=4", "train.mini_batch_size=16"]
    dp2, single = tmp_path / "dp2", tmp_path / "single"
    _train_side_by_side(("tiny_cpu.yaml", dp2, args, 2), ("tiny_cpu.yaml", single, args))
    (m,), (s,) = read_metrics(dp2), read_metrics(single)
    assert m["train/step_samples"] == s["train/step_samples"] >= 4
    assert m["rollout/logprob_mismatch"] < 1e-4 and abs(m["ppo/approx_kl_first"]) < 1e-6
    for k in ("train/success_rate", "adv/outcome_abs_mean", "adv/skill_abs_mean", "ppo/loss", "ppo/entropy",
              "ppo/kl"):
        assert m[k] == pytest.approx(s[k], rel=1e-4, abs=1e-6), k


@pytest.mark.slow
def test_divergence_signal_and_distillation_tp2pp2_match_single_process(tmp_path):
    """algo.delta=topk_kl and algo.distill_coef through the vocabulary-parallel head (TP2: the top-k merged over
    the shards) and the pipeline (PP2: the divergences broadcast from the last stage; fork-layout training
    micro-batches): iteration 1, before any update, equals the single-process run."""
    from opid_mega.metrics import read_metrics

    args = TINY + ["train.iterations=1", "train.save_interval=0", "train.mini_batch_size=16", "algo.mode=no_routing",
                   "algo.delta=topk_kl", "algo.delta_topk=8", "algo.distill_coef=0.5", "algo.lambda_episode=0.1",
                   "algo.lambda_step=0.1",
            "algo.skill_share_cap=null"]  # the reference's uncapped skill term: tied groups keep it, so it is compared
    multi, single = tmp_path / "tp2pp2", tmp_path / "tp1"
    _train_side_by_side(("tiny_cpu_tp2pp2.yaml", multi, args, 4), ("tiny_cpu.yaml", single, args))
    (m,), (s,) = read_metrics(multi), read_metrics(single)
    assert s["adv/skill_abs_mean"] > 0 and s["ppo/distill_kl"] > 1e-4  # both signals are there to compare
    for k in ("train/step_samples", "adv/outcome_abs_mean", "adv/skill_abs_mean", "ppo/distill_kl", "ppo/entropy"):
        assert m[k] == pytest.approx(s[k], rel=1e-4, abs=1e-6), k
    assert m["ppo/loss"] == pytest.approx(s["ppo/loss"], abs=5e-5)
