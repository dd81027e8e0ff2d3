"""Dual-context rescoring: naive two-pass scoring vs the fork scorer (shared prefix computed once).

Shapes come from real prompts of our environments: an ALFWorld-style game (generated locally) is played along its
planner walkthrough, the verl-agent prompt of a mid-episode step (full history window) is tokenized with the real
Qwen3 chat template, and a rule-analyzer skill section is inserted at the faithful or late point. That gives
P (shared prefix), S (skill section), T (tail after the insertion point, incl. the chat-template end); R (response
tokens) is a parameter. Both scorers run the same Megatron model (TP1, forward only) and compute log-probs for their
response rows only; the naive scorer runs `prefix+tail+resp` and `prefix+skill+tail+resp` as two sequences.

The bound is the exact FLOP ratio naive/fork from the model's dimensions: linear layers per token, causal attention
(naive: each sequence over its whole length; fork: the prefix once, each branch over prefix + itself) and the LM head
on the response rows (the same in both).

    python tools/bench_rescoring.py                 # ALFWorld shapes, both placements, hidden 512 x 8 layers
    python tools/bench_rescoring.py --preset ci     # < 1 minute on 2 CPU cores
    python tools/bench_rescoring.py --json out.json

On a GPU the same command runs the Triton kernels (fork attention, fused log-prob) through the model.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

import torch

PRESETS = {
    # model dims, response length, samples per call, repeats
    "full": dict(hidden=512, layers=8, ffn=1536, heads=8, kv_heads=2, head_dim=64, vocab=16384, R=160, samples=2,
                 repeats=3, steps=(3,)),
    "ci": dict(hidden=256, layers=2, ffn=768, heads=4, kv_heads=2, head_dim=64, vocab=8192, R=64, samples=1,
               repeats=2, steps=(3,)),
    # tools/gpu_check.sh: a bf16 model with Qwen2.5-7B's attention shape (28 heads / 4 KV heads x 128, hidden 3584)
    # over fewer layers and the full vocabulary; "tiny": its --dry-run on CPU
    "gpu": dict(hidden=3584, layers=4, ffn=18944, heads=28, kv_heads=4, head_dim=128, vocab=152064, R=160, samples=8,
                repeats=3, steps=(3,)),
    "tiny": dict(hidden=64, layers=2, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=4096, R=16, samples=1,
                 repeats=1, steps=(1,)),
}


# ----------------------------------------------------------------------------------------------- shapes
def real_prompt_pieces(step: int, seed: int = 0, env_name: str = "alfworld"):
    """(chat-templated) token pieces of a real prompt of `env_name` (alfworld: a generated ALFWorld-style game, needs
    textworld; search_qa: the shipped Search-QA questions, pure Python + bm25s) at `step` of its walkthrough: head
    (task line), middle, tail; plus a real rule-analyzer episode skill section."""
    from opid_mega.envs import make_env
    from opid_mega.models import load_tokenizer, qwen_tokenizer_dir
    from opid_mega.skills import RuleAnalyzer, StepView, TrajectoryView, render_skill_section, split_prompt

    env = make_env("alfworld", generated=True) if env_name == "alfworld" else make_env(env_name)
    task = env.tasks("train", 1, seed)[0]
    obs = env.reset(task)
    walk = env.walkthrough() or []
    history, views, prompt = [], [], None
    for t, action in enumerate(walk):
        prompt = env.build_prompt(history=history, current_obs=obs, history_length=5)
        if t == min(step, len(walk) - 1):
            break
        new_obs, reward, done, info = env.step(action)
        views.append(StepView(info.get("raw_obs", new_obs), f"<action>{action}</action>", reward, action))
        history.append((obs, action))
        obs = new_obs
        if done:
            break
    task_description = env.task_description  # read before close: a worker-process env is gone after it
    env.close()
    analysis = RuleAnalyzer().analyze_one(TrajectoryView(task=task_description, won=True, steps=views or [
        StepView(obs, "<action>look</action>", 0.0, "look")]))
    tok = load_tokenizer(qwen_tokenizer_dir())
    marker = "\x00PROMPT\x00"
    templ = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                    add_generation_prompt=True, enable_thinking=False)
    t_head, t_tail = templ.split(marker)
    head, middle, tail = split_prompt(prompt)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    pieces = (enc(t_head + head), enc(middle), enc(tail + t_tail))
    section = enc(render_skill_section(analysis.episode_skill, "episode"))
    return pieces, section


def shapes_for(pieces, section, placement: str, R: int) -> dict:
    a, b, c = pieces
    if placement == "late":
        P, T = len(a) + len(b), len(c)
    else:
        P, T = len(a), len(b) + len(c)
    return dict(P=P, S=len(section), T=T, R=R)


# ----------------------------------------------------------------------------------------------- FLOPs
def flops(dims: dict, lengths_naive: list[int], fork_groups: list[tuple[int, list[int]]], resp_rows: int) -> tuple:
    """Exact forward FLOPs (multiply-add = 2) of the naive and the fork scoring."""
    h, L, f = dims["hidden"], dims["layers"], dims["ffn"]
    hq, hkv, d, v = dims["heads"], dims["kv_heads"], dims["head_dim"], dims["vocab"]
    linear = L * (2 * h * (hq + 2 * hkv) * d + 2 * hq * d * h + 2 * 3 * h * f)
    attn_per_key = L * 4 * hq * d  # QK^T and AV per (query, key) pair
    head = 2 * h * v * resp_rows

    def causal(n, offset=0):  # queries 1..n each seeing offset + i keys
        return n * offset + n * (n + 1) // 2

    naive = sum(linear * n + attn_per_key * causal(n) for n in lengths_naive) + head
    fork = 0
    for p, branches in fork_groups:
        fork += linear * (p + sum(branches)) + attn_per_key * (causal(p) + sum(causal(b, p) for b in branches))
    fork += head
    return naive, fork


# ----------------------------------------------------------------------------------------------- timing
class PeakMemory:
    """GPU: torch.cuda.max_memory_allocated. CPU: peak RSS growth over the call, sampled every 2 ms from
    /proc/self/statm (an approximation of the extra memory the call needs)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self.peak = self._rss()
            self._stop = False
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self.base
        else:
            self._stop = True
            self._thread.join()
            self.peak = max(self.peak, self._rss())
            self.extra = self.peak - self.base


def build_model(dims: dict):
    from transformers import Qwen3Config

    from opid_mega.megatron import parallel
    from opid_mega.megatron.model import build_model as build, transformer_config

    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    parallel.initialize(tp=1, pp=1, seed=3)
    hf = Qwen3Config(vocab_size=dims["vocab"], hidden_size=dims["hidden"], intermediate_size=dims["ffn"],
                     num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
                     num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"], max_position_embeddings=8192)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return build(hf, transformer_config(hf, dtype=dtype))


def scorers(chunks, max_tokens: int):
    from opid_mega.megatron.logprobs import PackedBatch, Sample, compute_logprobs
    from opid_mega.scoring.fork_scorer import ForkScorer
    from opid_mega.scoring.scorer import NaiveScorer

    def naive_fn(seqs, temperature=1.0):
        return compute_logprobs(chunks, [Sample(t, s) for t, s in seqs], max_tokens=max_tokens,
                                temperature=temperature)

    def packed_fn(mbs, temperature=1.0):
        batches = [PackedBatch.from_micro_batch(mb) for mb in mbs]
        out = compute_logprobs(chunks, None, batches=batches, temperature=temperature)
        return out

    return NaiveScorer(naive_fn), ForkScorer(packed_fn, max_tokens=max_tokens, share_prompts=False)


def run_case(chunks, dims, shape, n_samples, repeats, seed=0):
    from opid_mega.scoring.scorer import ScoreRequest

    rng = random.Random(seed)
    v = dims["vocab"]
    P, S, T, R = shape["P"], shape["S"], shape["T"], shape["R"]
    reqs = []
    for _ in range(n_samples):  # distinct prompts: no cross-sample sharing, only the dual-context prefix
        prompt = [rng.randrange(v) for _ in range(P + T)]
        reqs.append(ScoreRequest(prompt, [rng.randrange(v) for _ in range(R)],
                                 {"episode": (P, [rng.randrange(v) for _ in range(S)])}))
    max_tokens = n_samples * (2 * (P + T + R) + S) + 1
    naive, fork = scorers(chunks, max_tokens)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res_n, res_f = naive.score(reqs), fork.score(reqs)  # warm-up (and the equivalence check below)
    diff = max(max((a.orig - b.orig).abs().max().item(), (a.skill["episode"] - b.skill["episode"]).abs().max().item())
               for a, b in zip(res_n, res_f))
    # the magnitude the log-probs are rounded at (a tolerance for max_abs_diff scales with it): the largest |log-prob|
    scale = max(max(a.orig.abs().max().item(), a.skill["episode"].abs().max().item()) for a in res_n)
    times = {"naive": [], "fork": []}
    mem = {}
    for _ in range(repeats):
        for name, sc in (("naive", naive), ("fork", fork)):  # interleaved, side by side
            with PeakMemory(cuda) as pm:
                sync()
                t0 = time.perf_counter()
                sc.score(reqs)
                sync()
                times[name].append(time.perf_counter() - t0)
            mem[name] = max(mem.get(name, 0), pm.extra)
    med = {k: statistics.median(t) for k, t in times.items()}
    lengths_naive = [P + T + R, P + S + T + R] * n_samples
    groups = [(P, [S + T + R, T + R])] * n_samples
    f_naive, f_fork = flops(dims, lengths_naive, groups, resp_rows=2 * R * n_samples)
    bound = f_naive / f_fork
    measured = med["naive"] / med["fork"]
    return dict(shape, samples=n_samples, naive_tokens=naive.last_tokens, fork_tokens=fork.last_tokens,
                shared_fraction=round(fork.last_shared_fraction, 4), max_abs_diff=diff, logprob_scale=scale,
                seconds={k: round(x, 4) for k, x in med.items()},
                tokens_per_s={"naive": round(naive.last_tokens / med["naive"], 1),
                              "fork": round(naive.last_tokens / med["fork"], 1)},
                peak_extra_bytes=mem, bound_speedup=round(bound, 4), measured_speedup=round(measured, 4),
                fraction_of_bound=round(measured / bound, 4))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    ap.add_argument("--placements", default="late,faithful")
    ap.add_argument("--response-tokens", type=int, default=None, help="R (default: the preset's)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--env", default="alfworld", choices=("alfworld", "search_qa"),
                    help="the environment whose real prompts give the shapes (search_qa: no textworld needed)")
    args = ap.parse_args(argv)
    cfg = dict(PRESETS[args.preset])
    R = args.response_tokens or cfg["R"]
    dims = {k: cfg[k] for k in ("hidden", "layers", "ffn", "heads", "kv_heads", "head_dim", "vocab")}
    torch.manual_seed(0)
    chunks = build_model(dims)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    cases = []
    for step in cfg["steps"]:
        pieces, section = real_prompt_pieces(step, env_name=args.env)
        for placement in args.placements.split(","):
            shape = shapes_for(pieces, section, placement, R)
            if args.preset == "ci":  # keep the CI preset small: scale the prompt down, keep its proportions
                k = 4
                shape = dict(P=max(1, shape["P"] // k), S=max(1, shape["S"] // k), T=max(1, shape["T"] // k), R=R)
            case = run_case(chunks, dims, shape, cfg["samples"], cfg["repeats"])
            case.update(env=args.env, step=step, placement=placement)
            cases.append(case)
    print(f"device: {device}; model: hidden {dims['hidden']}, {dims['layers']} layers, ffn {dims['ffn']}, heads "
          f"{dims['heads']}/{dims['kv_heads']} x {dims['head_dim']}, vocab {dims['vocab']}; preset {args.preset}")
    hdr = f"{'placement':>9} {'P':>5} {'S':>4} {'T':>4} {'R':>4} {'shared':>7} {'naive s':>8} {'fork s':>8} " \
          f"{'tok/s naive':>11} {'tok/s fork':>10} {'bound':>6} {'measured':>8} {'of bound':>8} {'max|d|':>8}"
    print(hdr)
    for c in cases:
        print(f"{c['placement']:>9} {c['P']:>5} {c['S']:>4} {c['T']:>4} {c['R']:>4} {c['shared_fraction']:>7.3f} "
              f"{c['seconds']['naive']:>8.3f} {c['seconds']['fork']:>8.3f} {c['tokens_per_s']['naive']:>11.0f} "
              f"{c['tokens_per_s']['fork']:>10.0f} {c['bound_speedup']:>6.3f} {c['measured_speedup']:>8.3f} "
              f"{c['fraction_of_bound']:>8.1%} {c['max_abs_diff']:>8.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "model": dims, "preset": args.preset, "env": args.env,
                       "dtype": str(next(p for c in chunks for p in c.parameters()).dtype), "cases": cases}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
