"""Sequence parallel and the distributed optimizer on gloo, in ONE 4-rank launch (TP2 x DP2):

- TP2 vs TP2 + sequence parallel on packed micro-batches of odd length (padded to a multiple of TP, the padding never
  scored): log-probs, entropy and every rank's gradients equal (fp32, within 1e-5 of each tensor's largest), for a
  tied Qwen3 (q/k norm) and an untied Qwen2 (QKV bias), also with the distillation loss (fork layout, skill
  contexts, the divergence head);
- plain vs distributed optimizer, also with overlap_grad_reduce (small buckets: several per backward) and with SP:
  equal weights after 2 optimizer steps (to 1e-5, 1% of a step of lr 1e-3); the distributed optimizer's state
  survives a checkpoint save/load (resumed step 2 = uninterrupted step 2)."""
import json
import os

import pytest
import torch

from megatron_testutil import hf_logprobs, launch, make_hf_model, random_sequences
from tolerance import assert_close_scaled, assert_dicts_close_scaled

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sp_distopt_worker.py")
LOSS = dict(clip_low=0.2, clip_high=0.2, dual_clip=3.0, kl_coef=0.1, kl_kind="low_var_kl", entropy_coef=0.01)
OPTIMIZERS = [["plain", False, False, False], ["distopt", True, False, False], ["distopt_overlap", True, True, False],
              ["distopt_overlap_sp", True, True, True]]
REL = 1e-5  # two fp32 paths (TP2 vs TP2 + SP, plain vs distributed optimizer): 1e-5 of the magnitudes compared
LR = 1e-3
STEP_REL = 0.01  # weights after optimizer steps: to 1% of one step of lr (Adam moves each weight by up to lr)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("spdo")
    # 6 sequences, 3 per DP rank; micro-batches of <= 24 tokens hold 1-2 sequences with odd total lengths
    seqs = random_sequences(11, [(9, 3), (14, 5), (7, 1), (11, 4), (8, 2), (13, 6)])
    models, hf = [], {}
    for i, arch in enumerate(("qwen3", "qwen2")):
        d = str(root / arch)
        hf[arch] = make_hf_model(arch, d, seed=10 + i, layers=4)
        models.append(dict(arch=arch, model=d))
    spec = dict(models=models, sequences=seqs, micro_tokens=24, lr=LR, clip_grad=1.0, loss=LOSS,
                optimizers=OPTIMIZERS, sp_layouts=[[1, None], [2, 2]], bucket_size=20000, out=str(root),
                timeout_s=540)
    with open(root / "spec.json", "w") as f:
        json.dump(spec, f)
    rc, log = launch([WORKER, str(root / "spec.json")], root / "worker.log", timeout=600)
    assert rc == 0, log[-8000:]
    return torch.load(root / "results.pt", weights_only=False), hf, seqs


def _maxdiff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.parametrize("layout", ["pp1vpp1", "pp2vpp2"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_sequence_parallel_equals_tp2_logprobs_and_gradients(run, arch, layout):
    """TP2 (DP2), and TP2 x PP2 with 2 virtual stages (the interleaved schedule's fixed-shape p2p), SP off vs on."""
    results, hf, seqs = run
    off, on = results["sp"][f"{arch}_{layout}"][False], results["sp"][f"{arch}_{layout}"][True]
    assert not off["sp_norm_weights"] and on["sp_norm_weights"]
    if layout == "pp1vpp1":  # SP is really on: each TP rank holds half the tokens; every residual-stream norm marked
        assert (off["hidden_rows"], on["hidden_rows"]) == (8, 4)
        assert on["sp_norm_weights"] == sorted(["0.decoder.final_layernorm.weight"] + [
            f"0.decoder.layers.{i}.{n}.weight" for i in range(4) for n in ("input_layernorm", "pre_mlp_layernorm")])
    for (t, k), a, b, ea, eb in zip(seqs, off["logprobs"], on["logprobs"], off["entropy"], on["entropy"]):
        assert_close_scaled(a, hf_logprobs(hf[arch], t, k), rel=REL, msg="TP2 vs HF")  # TP2 itself is right
        assert_close_scaled(b, a, rel=REL, msg="SP log-probs")
        assert_close_scaled(eb, ea, rel=REL, msg="SP entropy")
    for rank, (ga, gb) in enumerate(zip(off["grads"], on["grads"])):
        assert set(ga) == set(gb), rank
        assert max(float(ga[n].abs().max()) for n in ga) > 0  # gradients do flow
        assert_dicts_close_scaled(gb, ga, rel=REL, msg=f"rank {rank} SP grad")
    # the distillation loss (fork layout + skill contexts, the divergence head): SP leaves its gradients unchanged
    assert sum(off["distill_kl"]) > 1e-3
    assert_close_scaled(sum(on["distill_kl"]), sum(off["distill_kl"]), rel=1e-4, floor=1.0, msg="distill_kl sum")
    for rank, (ga, gb) in enumerate(zip(off["distill_grads"], on["distill_grads"])):
        assert max(float((ga[n] - off["grads"][rank][n]).abs().max()) for n in ga) > 1e-4  # the KL term is there
        assert_dicts_close_scaled(gb, ga, rel=REL, msg=f"rank {rank} SP distill grad")
    assert_close_scaled(on["metrics"]["loss"], off["metrics"]["loss"], rel=REL, floor=1.0, msg="loss")
    assert_dicts_close_scaled(on["after_step"], off["after_step"], rel=STEP_REL, scale=LR, msg="SP weights after")


def test_distributed_optimizer_equals_plain_after_two_steps(run):
    results, hf = run[0]["opt"], run[1]["qwen3"].state_dict()  # the optimizer runs train the qwen3 model
    plain = results["plain"]
    assert max(float((plain["final"][k] - hf[k]).abs().max()) for k in plain["final"]) > 1e-4  # it did train
    for name in ("distopt", "distopt_overlap", "distopt_overlap_sp"):
        assert_dicts_close_scaled(results[name]["final"], plain["final"], rel=STEP_REL, scale=LR, msg=name)
        for mp, mo in zip(plain["metrics"], results[name]["metrics"]):
            assert_close_scaled(mo["loss"], mp["loss"], rel=REL, floor=1.0, msg=f"{name} loss")
            assert_close_scaled(mo["grad_norm"], mp["grad_norm"], rel=1e-4, floor=1.0, msg=f"{name} grad norm")


def test_distributed_optimizer_checkpoint_round_trip(run):
    results = run[0]["opt"]
    assert _maxdiff(results["distopt"]["final"], results["resumed"]["final"]) == 0.0
    assert results["resumed"]["metrics"][0]["loss"] == results["distopt"]["metrics"][1]["loss"]
