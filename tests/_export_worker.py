"""A run directory with real multi-rank checkpoints, for tests/test_export.py.

    python _export_worker.py SPEC.json

SPEC: {"hf_dir", "run_dir", "tp", "pp", "steps": [...], "seqs": [[tokens, score_from], ...], "ref": PREFIX}.
Every rank builds the trainer's Policy (Megatron chunks, DDP, Adam, reference copy) at TP x PP from hf_dir, then for
each step: perturbs the weights (the same noise on every rank, so replicated tensors stay replicated and the tied
output layer stays equal to the embedding), takes the trainer's log-probs of the sequences (Policy.logprobs, T = 1)
and the whole model as HF tensors, and saves the checkpoint the trainer would (Policy.save: model + optimizer + RNG).
Rank 0 writes config.yaml and PREFIX<step>.pt = {"hf": {name: tensor}, "logprobs": [tensor, ...]}.
"""
import json
import os
import sys
import zlib

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def perturb(chunks, step: int, tied: bool) -> None:
    for c in chunks:
        for name, p in c.named_parameters():
            key = "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" else name
            g = torch.Generator().manual_seed(zlib.crc32(f"{step}:{key}".encode()))
            with torch.no_grad():
                p.add_(torch.randn(p.shape, generator=g) * (0.05 if p.dim() == 1 else 0.01))


def run_rank(spec) -> None:
    import torch.distributed as dist

    from opid_mega import rundir
    from opid_mega.config import load_config
    from opid_mega.megatron import parallel
    from opid_mega.megatron.policy import Policy
    from opid_mega.megatron.weights import hf_state_dict

    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), [
        "model.init_from=", f"model.path={spec['hf_dir']}", f"parallel.tp={spec['tp']}", f"parallel.pp={spec['pp']}",
        "model.dtype=float32", "train.micro_batch_tokens=512", "train.keep_checkpoints=0", "train.use_reference=false",
        "logging.tensorboard=false",
        f"logging.run_dir={spec['run_dir']}"])
    policy = Policy(cfg, spec["hf_dir"])
    ckpt = os.path.join(spec["run_dir"], "checkpoints")
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(spec["run_dir"], exist_ok=True)
        rundir.write_config(spec["run_dir"], cfg)
    for step in spec["steps"]:
        perturb(policy.chunks, step, bool(policy.hf_config.tie_word_embeddings))
        lps = policy.logprobs([tuple(s) for s in spec["seqs"]], temperature=1.0)
        hf = hf_state_dict(policy.chunks, policy.hf_config)  # collective
        if rank == 0:
            torch.save({"hf": hf, "logprobs": [t.clone() for t in lps]}, f"{spec['ref']}{step}.pt")
        policy.save(ckpt, step, {"iteration": step})
    parallel.destroy()


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from opid_mega.megatron.parallel import spawn

    spawn(spec["tp"] * spec["pp"], run_rank, spec, timeout_s=spec.get("timeout_s", 400))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
