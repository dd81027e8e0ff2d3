"""Benchmark: the trainer's CPU-side work between scoring and the PPO forward, per-sample objects vs flat arrays.

One iteration at the ALFWorld shape (16 tasks x 8 trajectories x 30 steps = 3840 step-samples, prompts 1-2k
tokens, responses 50-300, half of the step-samples with a skill context; configs/qwen2.5-7b_alfworld.yaml: mini-batches
of 256 step-samples, micro-batches of 8192 tokens), on data-parallel rank 0 of `--dp` ranks:
  before  the trainer's data path up to commit 8d364b7: advantages in torch over padded [S, R] tensors, one `Sample`
          per step-sample with its values as Python lists, and per mini-batch the strided DP share packed from those
          Samples (`train_mini_batch`'s Samples path). That packing was `greedy_micro_batches` + `pack` (per-token
          Python lists, the "before" of docs/performance.md); `pack` is gone, so it is now
          `opid_mega.megatron.logprobs.plain_batches` (the C++ builder) and this arm measures the Python objects
          around it, not the old packer.
  after   `compute_advantages` (the batch builder's outcome/token advantages on flat arrays), one `TrainData`, and
          per mini-batch `TrainData.subset(...).micro_batches(...)` (the C++ builder: token-budget packing balanced
          over DP ranks)
Both produce the micro-batches the PPO forward consumes; no model runs. Times are medians of `--repeat` runs, side
by side in one process.

    python tools/bench_train_overhead.py                  # ALFWorld shape, dp 4
    python tools/bench_train_overhead.py --preset ci      # 2 tasks instead of 16 (seconds)
    python tools/bench_train_overhead.py --json out.json  # {"before_s": ..., "after_s": ..., "speedup": ...}
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from opid_mega import algo  # noqa: E402
from opid_mega.config import load_config  # noqa: E402
from opid_mega.megatron.logprobs import Sample, plain_batches  # noqa: E402
from opid_mega.megatron.train_batches import TrainData  # noqa: E402
from opid_mega.scoring.scorer import ScoreResult  # noqa: E402
from opid_mega.experience import compute_advantages  # noqa: E402

PRESETS = {"alfworld": (16, 8, 30), "ci": (2, 8, 30), "tiny": (1, 4, 5)}  # tiny: the test


def make_iteration(tasks, trajs, steps, seed=0, vocab=151_000):
    rng = np.random.default_rng(seed)
    n = tasks * trajs * steps
    seqs, scored = [], []
    for i in range(n):
        p, r = int(rng.integers(1000, 2000)), int(rng.integers(50, 300))
        seqs.append((rng.integers(0, vocab, p + r).tolist(), p))
        orig = torch.from_numpy(-rng.random(r, dtype=np.float32) * 3)
        skill = {}
        if i % 2:
            skill[algo.STEP if i % 4 == 1 else algo.EPISODE] = orig + torch.from_numpy(rng.standard_normal(r,
                                                                                           dtype=np.float32))
        scored.append(ScoreResult(orig=orig, skill=skill))
    rewards = [10.0 * float(rng.random() < 0.5) for _ in range(n)]
    invalid = (rng.random(n) < 0.1).tolist()
    groups = [i // (trajs * steps) for i in range(n)]
    ref = [torch.from_numpy(-rng.random(len(t) - p, dtype=np.float32)) for t, p in seqs]
    return seqs, scored, rewards, invalid, groups, ref


# ---------------------------------------------------------------------------------------------------- before
def _pad(rows, width):
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=torch.float32)
    return out


def legacy_advantages(cfg, scored, rewards, invalid, groups):
    R = max(r.orig.numel() for r in scored)
    lens = torch.tensor([r.orig.numel() for r in scored])
    mask = torch.arange(R)[None, :] < lens[:, None]
    old = _pad([r.orig for r in scored], R)
    scores = algo.step_scores(torch.as_tensor(rewards, dtype=torch.float32), torch.as_tensor(invalid),
                              cfg.algo.invalid_penalty)
    a_out = algo.outcome_advantage(scores, torch.as_tensor(groups), cfg.algo.outcome_mode)
    deltas = {}
    for kind in (algo.EPISODE, algo.STEP):
        has = torch.tensor([kind in r.skill for r in scored])
        skill_lp = _pad([r.skill.get(kind, r.orig) for r in scored], R)
        deltas[kind] = algo.skill_delta(skill_lp, old, mask & has[:, None])
    lambdas = {algo.EPISODE: cfg.algo.lambda_episode, algo.STEP: cfg.algo.lambda_step}
    return a_out, algo.combine_advantages(a_out, deltas, lambdas, mask), old, mask


def before(cfg, it, dp):
    seqs, scored, rewards, invalid, groups, ref = it
    _, adv, old, _ = legacy_advantages(cfg, scored, rewards, invalid, groups)
    samples = []
    for k, (t, p) in enumerate(seqs):
        n = len(t) - p
        samples.append(Sample(t, p, old_logprobs=old[k, :n].tolist(), advantages=adv[k, :n].tolist(),
                              ref_logprobs=ref[k].tolist()))
    order = list(range(len(samples)))
    random.Random(0).shuffle(order)
    out = []
    for start in range(0, len(order), cfg.train.mini_batch_size):
        part = [samples[i] for i in order[start:start + cfg.train.mini_batch_size]][0::dp]  # rank 0's share
        out.append(plain_batches(part, cfg.train.micro_batch_tokens).batches)
    return out


# ---------------------------------------------------------------------------------------------------- after
def after(cfg, it, dp):
    seqs, scored, rewards, invalid, groups, ref = it
    adv = compute_advantages(cfg.algo, scored, rewards, invalid, groups)
    data = TrainData.from_sequences([t for t, _ in seqs], adv.resp_lens, old_logprobs=adv.old_logprobs,
                                    advantages=adv.token_advantages, ref_logprobs=torch.cat(ref))
    order = list(range(data.num_samples))
    random.Random(0).shuffle(order)
    return [data.subset(order[s:s + cfg.train.mini_batch_size]).micro_batches(cfg.train.micro_batch_tokens, dp, 0)
            for s in range(0, len(order), cfg.train.mini_batch_size)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="alfworld")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cfg = load_config(str(ROOT / "configs" / "qwen2.5-7b_alfworld.yaml"), ["algo.mode=opid"])
    it = make_iteration(*PRESETS[args.preset])
    tokens = sum(len(t) for t, _ in it[0])
    res = {}
    for name, fn in (("before", before), ("after", after)):
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            mbs = fn(cfg, it, args.dp)
            times.append(time.perf_counter() - t0)
        res[f"{name}_s"] = statistics.median(times)
        res[f"{name}_micro_batches"] = sum(len(m) for m in mbs)
        res[f"{name}_scored_tokens"] = sum(int(b.score_rows.numel()) for m in mbs for b in m)
    res.update(preset=args.preset, dp=args.dp, step_samples=len(it[0]), tokens=tokens,
               speedup=res["before_s"] / res["after_s"], batching_backend=__import__("opid_mega.batching",
                                                                                    fromlist=["x"]).backend_name())
    print(f"{args.preset}: {len(it[0])} step-samples, {tokens} tokens, dp {args.dp} (rank 0's micro-batches): "
          f"before {res['before_s']:.2f} s, after {res['after_s']:.3f} s, {res['speedup']:.1f}x "
          f"[{res['batching_backend']}]")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
