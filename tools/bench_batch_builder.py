"""Benchmark: C++ batch builder (opid_mega._C) vs the numpy reference at realistic OPID batch shapes.

One iteration's CPU-side batch work, end to end:
  outcome advantages -> fork-layout scoring micro-batches (original + skill context per step-sample, identical
  step-0 prompts shared) -> token advantages (λ·Δ by skill type) -> plain training micro-batches with advantages.

Shapes: `alfworld` 16 tasks x 8 trajectories x 30 steps = 3840 step-samples, prompts 1-2k tokens, responses
50-300; `search_qa` 1024 trajectories x 4 steps = 4096 step-samples, prompts 0.8-3k tokens. The skill is inserted
`late` (before the closing paragraph, DESIGN.md) by default or `faithful` (episode skill right after the task line).
Outputs of both backends are checked byte-identical once. Times are medians of repeated runs: wall clock
(`speedup`) and process CPU time summed over threads (`speedup_cpu`, steadier on a shared, oversubscribed machine).

    python tools/bench_batch_builder.py                        # both shapes
    python tools/bench_batch_builder.py --preset ci            # small shapes, < 1 minute
    python tools/bench_batch_builder.py --json bench.json      # {"alfworld": {"speedup": ...}, ...}
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from opid_mega import batching
from opid_mega.batching.layout import ContextBatch

SHAPES = {
    # name: (tasks, trajectories per task, steps, prompt range, response range, critical steps K)
    "alfworld": (16, 8, 30, (1000, 2000), (50, 300), 5),
    "search_qa": (128, 8, 4, (800, 3000), (50, 300), 2),
}
CI_SHAPES = {
    "alfworld": (2, 8, 30, (1000, 2000), (50, 300), 5),
    "search_qa": (16, 8, 4, (800, 3000), (50, 300), 2),
}


def make_batch(shape, placement: str, seed: int = 0, vocab: int = 151_000, token_dtype=np.int32):
    """Synthetic rollout batch with the given shape: CSR contexts (original, +skill) and per-sample arrays."""
    tasks, trajs, steps, prompt_rng, resp_rng, k_crit = shape
    rng = np.random.default_rng(seed)
    pieces, ctx_lens, resp_lens, gids, use_step, scores = [], [], [], [], [], []
    for t in range(tasks):
        step0 = rng.integers(0, vocab, int(rng.integers(*prompt_rng)))
        task_line = int(rng.integers(30, 80))
        for j in range(trajs):
            won = rng.random() < 0.5
            critical = set(rng.choice(steps, size=min(k_crit, steps), replace=False).tolist())
            for s in range(steps):
                prompt = step0 if s == 0 else rng.integers(0, vocab, int(rng.integers(*prompt_rng)))
                resp = rng.integers(0, vocab, int(rng.integers(*resp_rng)))
                is_step = s in critical
                skill = rng.integers(0, vocab, int(rng.integers(40, 120)))
                if placement == "late" or is_step:
                    cut = prompt.size - int(rng.integers(60, 100))  # before the closing paragraph
                else:
                    cut = task_line  # episode skill right after the task line
                pieces += [prompt, resp, prompt[:cut], skill, prompt[cut:], resp]
                ctx_lens += [prompt.size + resp.size, prompt.size + skill.size + resp.size]
                resp_lens += [resp.size, resp.size]
                gids.append(t)
                use_step.append(is_step)
                scores.append((10.0 if won else 0.0) - (0.1 if rng.random() < 0.05 else 0.0))
    tokens = np.concatenate(pieces).astype(token_dtype)  # int32 as flatten_contexts makes; int64 is accepted
    ctx_offsets = np.concatenate([[0], np.cumsum(ctx_lens)]).astype(np.int64)
    n = len(gids)
    ctx = ContextBatch(tokens, ctx_offsets, np.array(resp_lens, np.int64), np.arange(0, 2 * n + 1, 2, dtype=np.int64))
    use_step = np.array(use_step, bool)
    return {
        "contexts": ctx,
        "group_ids": np.array(gids, np.int64),
        "scores": np.array(scores, np.float64),
        "use_step": use_step,
        "use_ep": ~use_step,
        "resp": ctx.resp_lens[::2].copy(),
        "rng": rng,
    }


def train_inputs(data):
    """Original contexts (prompt + response) as plain training sequences, CSR."""
    ctx = data["contexts"]
    starts, ends = ctx.ctx_offsets[0:-1:2], ctx.ctx_offsets[1::2]
    tokens = np.concatenate([ctx.tokens[a:b] for a, b in zip(starts, ends)])
    offsets = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64)
    return tokens, offsets


def pipeline(data, train, backend, budget, ranks, normalize):
    ctx = data["contexts"]
    a_out = batching.outcome_advantage(data["scores"], data["group_ids"], "mean_std_norm", backend=backend)
    scoring = batching.build_fork_batches(ctx, budget, ranks, backend=backend)
    d_ep, d_step = data["deltas"]
    adv = batching.token_advantages(a_out, data["resp"], [d_ep, d_step], [data["use_ep"], data["use_step"]],
                                    [0.001, 0.001], normalize=normalize, backend=backend)
    train_b = batching.build_train_batches(train[0], train[1], data["resp"], budget, ranks, token_values=adv,
                                           backend=backend)
    return scoring, adv, train_b


def timed(fn, repeats):
    """Median wall time and median process CPU time (all threads) of `repeats` runs."""
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def bench_shape(name, shape, args):
    data = make_batch(shape, args.placement, token_dtype=np.dtype(args.token_dtype))
    total_resp = int(data["resp"].sum())
    data["deltas"] = [data["rng"].standard_normal(total_resp).astype(np.float32) * 0.3 for _ in range(2)]
    train = train_inputs(data)
    ctx = data["contexts"]
    # correctness once: identical outputs
    out_py = pipeline(data, train, "python", args.budget, args.ranks, args.normalize)
    out_c = pipeline(data, train, "cpp", args.budget, args.ranks, args.normalize)
    for a, b in ((out_py[0].flat, out_c[0].flat), (out_py[2].flat, out_c[2].flat)):
        for key in a:
            x, y = a[key], b[key]
            same = x.tobytes() == y.tobytes() if isinstance(x, np.ndarray) else x == y
            if not same:
                raise SystemExit(f"{name}: backends differ on {key}")
    if out_py[1].tobytes() != out_c[1].tobytes():
        raise SystemExit(f"{name}: backends differ on token advantages")
    scoring = out_c[0]
    del out_py, out_c  # time every run with the same memory held
    t_py, cpu_py = timed(lambda: pipeline(data, train, "python", args.budget, args.ranks, args.normalize),
                         args.repeats_py)
    t_c, cpu_c = timed(lambda: pipeline(data, train, "cpp", args.budget, args.ranks, args.normalize),
                       args.repeats_cpp)
    # the fork scoring builder alone (the largest piece)
    t_py_fork, cpu_py_fork = timed(lambda: batching.build_fork_batches(ctx, args.budget, args.ranks,
                                                                       backend="python"), args.repeats_py)
    t_c_fork, cpu_c_fork = timed(lambda: batching.build_fork_batches(ctx, args.budget, args.ranks, backend="cpp"),
                                 args.repeats_cpp)
    res = {
        "step_samples": int(ctx.num_samples),
        "context_tokens": int(ctx.tokens.size),
        "scoring_tokens": scoring.num_tokens,
        "shared_fraction": round(scoring.shared_fraction, 4),
        "scoring_micro_batches": scoring.num_ranks * scoring.micro_batches_per_rank,
        "python_s": round(t_py, 6),
        "cpp_s": round(t_c, 6),
        "speedup": round(t_py / t_c, 2),
        "python_cpu_s": round(cpu_py, 6),
        "cpp_cpu_s": round(cpu_c, 6),
        "speedup_cpu": round(cpu_py / max(cpu_c, 1e-9), 2),
        "fork_python_s": round(t_py_fork, 6),
        "fork_cpp_s": round(t_c_fork, 6),
        "fork_speedup": round(t_py_fork / t_c_fork, 2),
        "fork_speedup_cpu": round(cpu_py_fork / max(cpu_c_fork, 1e-9), 2),
    }
    print(f"{name:10s} samples={res['step_samples']} ctx_tokens={res['context_tokens']:,} "
          f"scoring_tokens={res['scoring_tokens']:,} shared={res['shared_fraction']:.1%} | pipeline python "
          f"{t_py * 1e3:.0f} ms  cpp {t_c * 1e3:.1f} ms  speedup {res['speedup']:.1f}x (cpu time "
          f"{res['speedup_cpu']:.1f}x) | fork builder "
          f"{t_py_fork * 1e3:.0f} / {t_c_fork * 1e3:.1f} ms = {res['fork_speedup']:.1f}x (cpu time "
          f"{res['fork_speedup_cpu']:.1f}x)", flush=True)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=["full", "ci"], default="full")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--placement", choices=["late", "faithful"], default="late")
    p.add_argument("--budget", type=int, default=32768, help="tokens per micro-batch")
    p.add_argument("--ranks", type=int, default=4, help="data-parallel ranks")
    p.add_argument("--token-dtype", choices=["int32", "int64"], default="int32",
                   help="dtype of the input token ids (flatten_contexts makes int32; int64 is range-checked)")
    p.add_argument("--normalize", action="store_true", help="batch z-normalise Δ (exact sums)")
    p.add_argument("--repeats-py", type=int, default=None)
    p.add_argument("--repeats-cpp", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="C++ worker threads (sets OPID_BB_THREADS)")
    p.add_argument("--json", default=None, help="write results to this file")
    args = p.parse_args(argv)
    if args.threads is not None:
        os.environ["OPID_BB_THREADS"] = str(args.threads)  # read by the extension at its first parallel call
    if args.repeats_py is None:
        args.repeats_py = 5 if args.preset == "full" else 2
    if args.repeats_cpp is None:
        args.repeats_cpp = 9 if args.preset == "full" else 5
    if batching.backend_name() != "cpp":
        raise SystemExit("opid_mega._C is not built: run `pip install --no-build-isolation --no-deps -e .`")
    shapes = SHAPES if args.preset == "full" else CI_SHAPES
    print(f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f} preset={args.preset} placement={args.placement} "
          f"budget={args.budget} ranks={args.ranks} tokens={args.token_dtype} "
          f"normalize={args.normalize} repeats python={args.repeats_py} cpp={args.repeats_cpp}")
    results = {name: bench_shape(name, shapes[name], args) for name in args.shapes}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
