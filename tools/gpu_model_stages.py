#!/usr/bin/env python3
"""The model stages of tools/gpu_check.sh: a random Qwen3 (the real Qwen3 tokenizer, no hub) run through the trainer's
own code, on CUDA in bf16 (or, `--tiny`, a tiny fp32 model on the CPU: the check's --dry-run).

    ppo     one PPO step of the trainer's Policy (megatron-core; training attention through the model, so it takes
            the varlen path opid_mega.megatron.attention picks): a warm-up step (kernel compilation), then one timed
            step on the same mini-batch; figures: step seconds, tokens/s, model TFLOP/s (6 x params x tokens),
            peak memory, loss, grad norm, first-mini-batch approx KL (0 when old = current log-probs), the
            attention backend
    engine  the local rollout engine (HF transformers; SGLang cannot be carried to the device): sampled rollouts,
            tokens/s; then the trainer's log-probs of the same tokens (Megatron) against the engine's: the
            engine-vs-trainer mismatch in this dtype

    python3 tools/gpu_model_stages.py ppo --model-dir /tmp/m --json ppo.json [--tiny]
    python3 tools/gpu_model_stages.py engine --model-dir /tmp/m --json engine.json [--tiny]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (Qwen3 shape, dtype, samples, prompt tokens, response tokens, micro_batch_tokens, rollout prompts, new tokens)
SIZES = {
    "gpu": (dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=128), "bfloat16", 16, 512, 256, 8192, 16, 128),
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16), "float32", 4, 24, 8, 256, 2, 8),
}


def ensure_model(model_dir: Path, shape: dict, dtype: str) -> Path:
    """A random Qwen3 HF directory (seeded; built once, on the GPU when there is one) with the Qwen3 tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from opid_mega.models import _tiny_token_ids, qwen_tokenizer_dir

    if (model_dir / "model.safetensors").is_file() or (model_dir / "model.safetensors.index.json").is_file():
        return model_dir
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    config = Qwen3Config(vocab_size=151936, **shape, **_tiny_token_ids(), tie_word_embeddings=True,
                         max_position_embeddings=4096, dtype=dtype)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = [151645, 151643]
    model.save_pretrained(str(model_dir), safe_serialization=True)
    tok.save_pretrained(str(model_dir))
    del model
    return model_dir


def policy_for(model_dir: Path, dtype: str, micro_batch_tokens: int, mini_batch: int):
    from opid_mega.config import load_config
    from opid_mega.megatron.policy import Policy

    import torch

    cfg = load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), [
        "model.init_from=", f"model.dtype={dtype}", "train.use_reference=false", "algo.kl_coef=0.0",
        f"train.micro_batch_tokens={micro_batch_tokens}", f"train.mini_batch_size={mini_batch}", "train.ppo_epochs=1",
        f"parallel.backend={'nccl' if torch.cuda.is_available() else 'gloo'}", "logging.tensorboard=false"])
    return cfg, Policy(cfg, str(model_dir))


def n_params(policy) -> int:
    return sum(p.numel() for c in policy.chunks for p in c.parameters())


def attention_backend() -> str:
    import torch

    try:
        from opid_mega.megatron.attention import varlen_backend

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        return varlen_backend(torch.empty(1, 1, 1, device=dev, dtype=torch.bfloat16 if dev == "cuda" else
                                          torch.float32))
    except Exception as exc:  # noqa: BLE001 - a figure, never the stage's failure
        return f"unknown ({type(exc).__name__}: {exc})"


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def stage_ppo(size: str, model_dir: Path) -> dict:
    import numpy as np
    import torch

    from opid_mega.megatron.train_batches import TrainData

    shape, dtype, S, P, R, mbt, _, _ = SIZES[size]
    ensure_model(model_dir, shape, dtype)
    cfg, policy = policy_for(model_dir, dtype, mbt, S)
    rng = random.Random(0)
    seqs = [[rng.randrange(151000) for _ in range(P + R)] for _ in range(S)]
    old = torch.cat([x.float() for x in policy.logprobs([(s, P) for s in seqs], temperature=1.0)]).numpy()
    adv = np.asarray([rng.choice((-1.0, 1.0)) for _ in range(S) for _ in range(R)], np.float32)
    data = TrainData.from_sequences(seqs, np.full(S, R, np.int64), old_logprobs=old, advantages=adv)
    policy.set_lr(1e-7)  # tiny: the timed step trains on (nearly) the same weights
    t0 = time.perf_counter()
    first = policy.train(data, seed=1)  # warm-up: kernel compilation, allocator
    _sync()
    warm_s = time.perf_counter() - t0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = policy.train(data, seed=2)
    _sync()
    step_s = time.perf_counter() - t0
    tokens = S * (P + R)
    N = n_params(policy)
    out = {"model_params": N, "dtype": dtype, "samples": S, "tokens": tokens, "micro_batch_tokens": mbt,
           "warmup_step_s": round(warm_s, 3), "step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s, 1),
           "model_tflops": round(6 * N * tokens / step_s / 1e12, 3), "attention_backend": attention_backend(),
           "loss": m.get("loss"), "grad_norm": m.get("grad_norm"),
           "approx_kl_first_warmup": first.get("approx_kl_first")}
    if torch.cuda.is_available():
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 3)
    bad = [k for k in ("loss", "grad_norm") if out[k] is None or not np.isfinite(out[k])]
    if bad:
        raise SystemExit(f"ppo: {bad} not finite: {out}")
    if abs(out["approx_kl_first_warmup"] or 0.0) > (1e-3 if dtype == "bfloat16" else 1e-6):
        raise SystemExit(f"ppo: approx KL of the first mini-batch is {out['approx_kl_first_warmup']} with old = "
                         f"current log-probs: {out}")
    return out


def stage_engine(size: str, model_dir: Path) -> dict:
    import torch

    from opid_mega.rollout.engine import SamplingParams
    from opid_mega.rollout.local_engine import LocalEngine

    shape, dtype, _, P, _, mbt, prompts, new = SIZES[size]
    ensure_model(model_dir, shape, dtype)
    engine = LocalEngine(str(model_dir), dtype=dtype)
    rng = random.Random(3)
    ps = [[rng.randrange(151000) for _ in range(P)] for _ in range(prompts)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=new, seed=7)
    engine.generate(ps[:1], SamplingParams(temperature=1.0, max_new_tokens=2, seed=1))  # warm-up
    _sync()
    t0 = time.perf_counter()
    res = engine.generate(ps, sp)
    _sync()
    gen_s = time.perf_counter() - t0
    n_tok = sum(len(r.response_ids) for r in res)
    engine.shutdown()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    _, policy = policy_for(model_dir, dtype, max(mbt, 2 * (P + new)), 1)
    mine = policy.logprobs([(p + list(r.response_ids), len(p)) for p, r in zip(ps, res)], temperature=1.0)
    diffs = torch.cat([(torch.tensor(r.logprobs, dtype=torch.float64) - lp.double()).abs()
                       for r, lp in zip(res, mine) if len(r.logprobs)])
    return {"dtype": dtype, "prompts": prompts, "prompt_tokens": P, "generated_tokens": n_tok,
            "generate_s": round(gen_s, 3), "tokens_per_s": round(n_tok / gen_s, 1),
            "engine_vs_trainer_mean_abs": round(diffs.mean().item(), 6),
            "engine_vs_trainer_max_abs": round(diffs.max().item(), 6)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", choices=("ppo", "engine"))
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--tiny", action="store_true", help="the tiny fp32 model on the CPU (gpu_check --dry-run)")
    args = ap.parse_args(argv)
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    size = "tiny" if args.tiny else "gpu"
    model_dir = Path(args.model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    out = (stage_ppo if args.stage == "ppo" else stage_engine)(size, model_dir)
    out["size"] = size
    print(json.dumps(out))
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
