#!/usr/bin/env python3
"""The model stages of tools/gpu_check.sh: a random Qwen3 run through the trainer's own code, on CUDA in bf16 (or,
`--tiny`, a tiny fp32 model on the CPU: the check's --dry-run). Neither stage needs a tokenizer (random token ids).

    ppo     one PPO step of the trainer's Policy (megatron-core + DDP + optimizer, no checkpoints; training attention
            through the model, so it takes the varlen path opid_mega.megatron.attention picks): a warm-up step
            (kernel compilation), then one timed step on the same mini-batch; figures: step seconds, tokens/s, model
            TFLOP/s (`ppo_flops`: the FLOPs of the rows actually computed), peak memory, loss, grad norm,
            first-mini-batch approx KL (0 when old = current log-probs), the attention backend. The Policy reads its
            weights from an HF directory, written once under --model-dir.
    engine  the local rollout engine (HF transformers; SGLang cannot be carried to the device) on an in-memory model:
            sampled rollouts, tokens/s; then the log-probs of the same tokens from the trainer's forward (megatron
            model chunks, forward only: no DDP, no optimizer, nothing written) and from a high-precision reference
            (the same weights in float32, or float64 for --tiny, through HF, log-softmax in float64): the
            engine-vs-trainer mismatch and each one's error against the reference.

    python3 tools/gpu_model_stages.py ppo --model-dir /tmp/m --json ppo.json [--tiny]
    python3 tools/gpu_model_stages.py engine --json engine.json [--tiny]

Both end with the process groups destroyed (a clean exit).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (Qwen3 shape, dtype, samples, prompt tokens, response tokens, micro_batch_tokens, rollout prompts, new tokens)
SIZES = {
    "gpu": (dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=128), "bfloat16", 16, 512, 256, 8192, 16, 128),
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16), "float32", 4, 24, 8, 256, 2, 8),
}
VOCAB = 151936  # Qwen3's
TOKEN_IDS = dict(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)  # Qwen3's special tokens


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_qwen3(shape: dict, dtype: str):
    """A random Qwen3 (seeded) in `dtype`, built on the GPU when there is one."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = Qwen3Config(vocab_size=VOCAB, **shape, **TOKEN_IDS, tie_word_embeddings=True,
                         max_position_embeddings=4096, dtype=dtype)
    torch.manual_seed(0)
    with _device():
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype)).eval()
        # .to(bf16) also rounds the rotary inv_freq buffer to bf16 (a phase error growing with the position: 3% of
        # the attention output at position 600); from_pretrained(dtype=...), the engines' path, keeps it in fp32,
        # and so does every reference built from this model
        model.model.rotary_emb = Qwen3RotaryEmbedding(config=config)
    model.generation_config.eos_token_id = [151645, 151643]
    return model


def ppo_flops(shape: dict, samples: int, prompt: int, response: int) -> float:
    """Model FLOPs of one PPO step over `samples` sequences of prompt + response tokens: forward and backward
    (3 x the forward) of what is computed -- every token through the layers (linear layers, causal attention), the
    LM head only on the scored rows (the response tokens; opid_mega.megatron.model computes log-probs there only).
    The forward is `opid_mega.bench.scoring.scoring_flops`'s count."""
    from opid_mega.bench.scoring import scoring_flops

    dims = {"hidden": shape["hidden_size"], "layers": shape["num_hidden_layers"], "ffn": shape["intermediate_size"],
            "heads": shape["num_attention_heads"], "kv_heads": shape["num_key_value_heads"],
            "head_dim": shape["head_dim"], "vocab": VOCAB}
    forward, _ = scoring_flops(dims, [prompt + response] * samples, [], resp_rows=samples * response)
    return 3 * forward


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def attention_backend() -> str:
    import torch

    try:
        from opid_mega.megatron.attention import varlen_backend

        dev = _device()
        return varlen_backend(torch.empty(1, 1, 1, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else
                                          torch.float32))
    except Exception as exc:  # noqa: BLE001 - a figure, never the stage's failure
        return f"unknown ({type(exc).__name__}: {exc})"


def kernel_backend(requested: str) -> str:
    """What the model's log-prob kernels run on here for `requested` (scoring.kernel_backend)."""
    import torch

    from opid_mega.kernels._dispatch import resolve_backend

    return resolve_backend(requested, torch.empty(1, device=_device()), "fused_logprobs")


def stage_ppo(size: str, model_dir: Path) -> dict:
    import numpy as np
    import torch

    from opid_mega.config import load_config
    from opid_mega.megatron.policy import Policy
    from opid_mega.megatron.policy import TrainData

    shape, dtype, S, P, R, mbt, _, _ = SIZES[size]
    if not (model_dir / "model.safetensors").is_file():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = random_qwen3(shape, dtype)
        model.save_pretrained(str(model_dir), safe_serialization=True)
        del model
    cfg = load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), [
        "model.init_from=", f"model.dtype={dtype}", "train.use_reference=false", "algo.kl_coef=0.0",
        f"train.micro_batch_tokens={mbt}", f"train.mini_batch_size={S}", "train.ppo_epochs=1",
        "train.save_interval=0", f"parallel.backend={_backend()}", "scoring.kernel_backend=auto",
        "logging.tensorboard=false"])
    policy = Policy(cfg, str(model_dir))
    rng = random.Random(0)
    seqs = [[rng.randrange(151000) for _ in range(P + R)] for _ in range(S)]
    old = torch.cat([x.float() for x in policy.logprobs([(s, P) for s in seqs], temperature=1.0)]).cpu().numpy()
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
    N = sum(p.numel() for c in policy.chunks for p in c.parameters())
    flops = ppo_flops(shape, S, P, R)
    out = {"model_params": N, "dtype": dtype, "samples": S, "tokens": tokens, "scored_rows": S * R,
           "micro_batch_tokens": mbt, "warmup_step_s": round(warm_s, 3), "step_s": round(step_s, 4),
           "tokens_per_s": round(tokens / step_s, 1), "model_tflop": round(flops / 1e12, 3),
           "model_tflops": round(flops / step_s / 1e12, 3), "attention_backend": attention_backend(),
           "kernel_backend": kernel_backend(cfg.scoring.kernel_backend),
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


def trainer_logprobs(model, dtype: str, seqs: list, max_tokens: int) -> list:
    """The trainer's forward only: megatron model chunks with the HF model's weights (copied from memory), no DDP,
    no optimizer. `seqs`: [(tokens, score_from)] -> one float32 tensor per sequence."""
    import torch

    from opid_mega.megatron import parallel, weights
    from opid_mega.megatron.logprobs import Sample, compute_logprobs
    from opid_mega.megatron.model import build_model, transformer_config

    parallel.initialize(1, 1, backend=_backend())
    hf = model.config
    chunks = build_model(hf, transformer_config(hf, dtype=getattr(torch, dtype)))
    weights.load_hf_weights(chunks, hf, dict(model.state_dict()))
    with torch.no_grad():
        out = compute_logprobs(chunks, [Sample(t, s) for t, s in seqs], max_tokens=max_tokens, temperature=1.0)
    out = [x.detach().double().cpu() for x in out]
    del chunks
    return out


def reference_logprobs(model, seqs: list) -> list:
    """log softmax(logits) of tokens[score_from:] from `model` (already in the reference precision), in float64."""
    import torch

    out = []
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # full fp32 products
    try:
        for tokens, score_from in seqs:
            ids = torch.tensor([tokens], device=next(model.parameters()).device)
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, score_from - 1:-1].double()
            out.append(logits.log_softmax(-1).gather(-1, ids[0, score_from:, None]).squeeze(-1).cpu())
            del logits
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return out


def _diffs(a: list, b: list):
    import torch

    d = torch.cat([(x - y).abs() for x, y in zip(a, b) if len(x)])
    return float(f"{d.mean().item():.3g}"), float(f"{d.max().item():.3g}")


def stage_engine(size: str) -> dict:
    import torch

    from opid_mega.rollout.engine import SamplingParams
    from opid_mega.rollout.local_engine import LocalEngine

    shape, dtype, _, P, _, mbt, prompts, new = SIZES[size]
    model = random_qwen3(shape, dtype)
    engine = LocalEngine(model=model)
    rng = random.Random(3)
    ps = [[rng.randrange(151000) for _ in range(P)] for _ in range(prompts)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=new, seed=7)
    engine.generate(ps[:1], SamplingParams(temperature=1.0, max_new_tokens=2, seed=1))  # warm-up
    _sync()
    t0 = time.perf_counter()
    res = engine.generate(ps, sp)
    _sync()
    gen_s = time.perf_counter() - t0
    engine.shutdown()
    n_tok = sum(len(r.response_ids) for r in res)
    seqs = [(p + list(r.response_ids), len(p)) for p, r in zip(ps, res) if len(r.response_ids)]
    eng = [torch.tensor(r.logprobs, dtype=torch.float64) for r in res if len(r.response_ids)]
    mine = trainer_logprobs(model, dtype, seqs, max(mbt, 2 * (P + new)))
    ref_dtype = torch.float64 if dtype == "float32" else torch.float32  # the same weights, computed wider
    ref_model = copy.deepcopy(model).to(ref_dtype)
    del engine, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ref = reference_logprobs(ref_model, seqs)
    del ref_model
    finite = all(bool(torch.isfinite(x).all()) for x in eng + mine + ref)
    e_mean, e_max = _diffs(eng, ref)
    t_mean, t_max = _diffs(mine, ref)
    et_mean, et_max = _diffs(eng, mine)
    out = {"dtype": dtype, "reference_dtype": str(ref_dtype).replace("torch.", ""), "prompts": prompts,
           "prompt_tokens": P, "generated_tokens": n_tok, "generate_s": round(gen_s, 3),
           "tokens_per_s": round(n_tok / gen_s, 1),
           "engine_vs_reference_mean_abs": e_mean, "engine_vs_reference_max_abs": e_max,
           "trainer_vs_reference_mean_abs": t_mean, "trainer_vs_reference_max_abs": t_max,
           "engine_vs_trainer_mean_abs": et_mean, "engine_vs_trainer_max_abs": et_max}
    if not finite:
        raise SystemExit(f"engine: non-finite log-probs: {out}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", choices=("ppo", "engine"))
    ap.add_argument("--model-dir", default=None, help="ppo: where the random model's HF directory is written")
    ap.add_argument("--json", required=True)
    ap.add_argument("--tiny", action="store_true", help="the tiny fp32 model on the CPU (gpu_check --dry-run)")
    args = ap.parse_args(argv)
    if args.stage == "ppo" and not args.model_dir:
        ap.error("ppo needs --model-dir")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    size = "tiny" if args.tiny else "gpu"
    from opid_mega.infra.runtime import filter_dependency_warnings

    filter_dependency_warnings()  # before megatron-core is imported (its notices come at import)
    from opid_mega.megatron import parallel

    try:
        if args.stage == "ppo":
            model_dir = Path(args.model_dir)
            model_dir.mkdir(parents=True, exist_ok=True)
            out = stage_ppo(size, model_dir)
        else:
            out = stage_engine(size)
    finally:
        parallel.destroy()  # megatron's groups and the process group: no NCCL complaint at exit
    out["size"] = size
    print(json.dumps(out))
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
