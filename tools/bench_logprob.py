#!/usr/bin/env python
"""Benchmark: token log-probs from hidden states at large vocabulary — naive vs chunked torch vs fused.

Methods (all return float32 log-probs [N]; with --entropy cases also the entropy):
  naive          full [N, V] logits (input dtype matmul, then float32) + log_softmax + gather (autograd backward).
  chunked_torch  opid_mega.kernels.fused_logprobs(backend="torch"): chunked over the vocabulary (CPU production path).
  fused          opid_mega.kernels.fused_logprobs(backend="auto"): the Triton kernel on CUDA; on CPU "auto" picks the
                 chunked torch path, so this column equals chunked_torch there (`fused_backend` says which ran).

What "peak_bytes" measures (extra memory of one call beyond what existed before it, minus the gradients it must
return for fwd+bwd cases — grad_hidden and grad_weight are the same for every method):
  CUDA: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus memory_allocated() before.
  CPU:  peak resident set size of this process (VmHWM after resetting it through /proc/self/clear_refs) minus the
        resident size before the call. The script re-executes itself with MALLOC_MMAP_THRESHOLD_=65536 so every
        tensor buffer is its own mmap, returned to the OS on free: RSS then follows live tensor memory instead of
        glibc's recycled heap. It counts every real byte (torch temporaries, autograd buffers), not just tensors.
Timings: median wall time over repeats after one warm-up call (shared CPUs are noisy; never assert on them).

    python tools/bench_logprob.py --preset ci --json runs/bench_logprob.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"

PRESETS = {
    # (N, H, V, dtype, pass, entropy)
    "ci": [(128, 256, 152064, "float32", "fwd", False), (128, 256, 152064, "float32", "fwd+bwd", True)],
    "cpu": [(512, 512, 152064, "float32", "fwd", False), (512, 512, 152064, "float32", "fwd+bwd", True),
            (1024, 896, 152064, "float32", "fwd", False)],
    "gpu": [(4096, 3584, 152064, "bfloat16", "fwd", False), (4096, 3584, 152064, "bfloat16", "fwd+bwd", True),
            (16384, 3584, 152064, "bfloat16", "fwd", False), (1024, 2048, 151936, "bfloat16", "fwd", False),
            (4096, 3584, 152064, "float32", "fwd", False)],
}


def _reexec_with_mmap_threshold():
    if os.environ.get(MMAP_ENV) is None and sys.platform.startswith("linux"):
        env = dict(os.environ, **{MMAP_ENV: "65536"})
        os.execve(sys.executable, [sys.executable] + sys.argv, env)


def measure(call, methods, device, grad_bytes: int, repeats: int, case: dict) -> dict:
    """Per method: a warm-up call (kernel compilation), one call under PeakMeter (its extra peak memory minus the
    `grad_bytes` the gradients themselves take, into case["peak_bytes"]) and the median of `repeats` timed calls
    (case["seconds"]). Returns each method's measured result."""
    import torch

    from opid_mega.bench.core import PeakMeter  # opid-bench's meter: CUDA allocator peak, or VmHWM on the CPU

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    results = {}
    for method in methods:
        results[method] = call(method)  # warm-up (and kernel compilation)
        sync()
        del results[method]
        with PeakMeter(device) as meter:
            results[method] = call(method)
        case["peak_bytes"][method] = max(0, meter.peak - grad_bytes)
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            out = call(method)
            sync()
            times.append(time.perf_counter() - t0)
            del out
        case["seconds"][method] = statistics.median(times)
    return results


def run_case(n, h, v, dtype_name, pass_, entropy, device, repeats, methods):
    import torch
    from opid_mega.kernels import fused_logprobs, naive_logprobs
    from opid_mega.kernels._dispatch import resolve_backend

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype).to(device)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    backward = pass_ == "fwd+bwd"
    grad_bytes = (n * h + v * h) * hidden.element_size() if backward else 0

    def call(method):
        hh = hidden.detach().requires_grad_(backward)
        ww = weight.detach().requires_grad_(backward)
        if method == "naive":
            out = naive_logprobs(hh, ww, targets, return_entropy=entropy)
        else:
            out = fused_logprobs(hh, ww, targets, return_entropy=entropy,
                                 backend="torch" if method == "chunked_torch" else "auto")
        lp, ent = out if entropy else (out, None)
        if backward:
            loss = lp.sum() + (0.001 * ent.sum() if ent is not None else 0.0)
            loss.backward()
        res = (lp.detach(), ent.detach() if ent is not None else None, hh.grad, ww.grad)
        return res

    case = {"N": n, "H": h, "V": v, "dtype": dtype_name, "pass": pass_, "entropy": entropy,
            "device": device.type, "fused_backend": resolve_backend("auto", hidden, "bench"),
            "naive_logits_bytes": n * v * 4, "peak_bytes": {}, "seconds": {}, "max_abs_diff_vs_naive": {}}
    results = measure(call, methods, device, grad_bytes, repeats, case)
    if "naive" in results:
        ref = results["naive"]
        for method, res in results.items():
            if method == "naive":
                continue
            diffs = {"logprob": (res[0] - ref[0]).abs().max().item()}
            if entropy:
                diffs["entropy"] = (res[1] - ref[1]).abs().max().item()
            if backward:
                diffs["grad_hidden"] = (res[2].float() - ref[2].float()).abs().max().item()
                diffs["grad_weight"] = (res[3].float() - ref[3].float()).abs().max().item()
            case["max_abs_diff_vs_naive"][method] = diffs
    if "naive" in case["peak_bytes"]:
        case["peak_ratio_vs_naive"] = {m: case["peak_bytes"][m] / max(1, case["peak_bytes"]["naive"])
                                       for m in case["peak_bytes"] if m != "naive"}
    return case


def _mb(x):
    return f"{x / 2**20:9.1f}"


def print_table(cases):
    methods = ["naive", "chunked_torch", "fused"]
    print(f"{'N':>6} {'H':>5} {'V':>7} {'dtype':>8} {'pass':>8} {'ent':>4} | "
          + " | ".join(f"{m + ' MiB':>17} {'s':>7}" for m in methods) + " | fused/naive mem")
    for c in cases:
        cols = []
        for m in methods:
            if m in c["peak_bytes"]:
                cols.append(f"{_mb(c['peak_bytes'][m]):>17} {c['seconds'][m]:7.3f}")
            else:
                cols.append(f"{'-':>17} {'-':>7}")
        ratio = c.get("peak_ratio_vs_naive", {}).get("fused")
        print(f"{c['N']:>6} {c['H']:>5} {c['V']:>7} {c['dtype']:>8} {c['pass']:>8} {str(c['entropy'])[0]:>4} | "
              + " | ".join(cols) + (f" | {100 * ratio:6.2f}%" if ratio is not None else " |"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="ci (< 1 min on 2 CPU cores), cpu, gpu; default: gpu on CUDA, cpu otherwise")
    ap.add_argument("--json", default=None, help="write {'cases': [...]} here")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--methods", default="naive,chunked_torch,fused")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (ci preset default: 1)")
    args = ap.parse_args(argv)
    _reexec_with_mmap_threshold()

    import torch
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = args.preset or ("gpu" if device.type == "cuda" else "cpu")
    if args.threads or preset == "ci":
        # ci: one intra-op thread by default; on shared, loaded CI cores OpenMP spin-waits otherwise dominate
        torch.set_num_threads(args.threads or 1)
    repeats = args.repeats or (1 if preset == "ci" else 3)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if device.type == "cpu" and "fused" in methods and "chunked_torch" in methods:
        methods.remove("fused")  # same code path on CPU; reported as a copy below
    cases = []
    t_start = time.time()
    for spec in PRESETS[preset]:
        case = run_case(*spec, device=device, repeats=repeats, methods=methods)
        if device.type == "cpu" and "chunked_torch" in case["peak_bytes"]:
            case["peak_bytes"]["fused"] = case["peak_bytes"]["chunked_torch"]
            case["seconds"]["fused"] = case["seconds"]["chunked_torch"]
            case["max_abs_diff_vs_naive"]["fused"] = case["max_abs_diff_vs_naive"].get("chunked_torch")
            if "peak_ratio_vs_naive" in case:
                case["peak_ratio_vs_naive"]["fused"] = case["peak_ratio_vs_naive"]["chunked_torch"]
            case["note"] = "CPU: backend='auto' runs the chunked torch path, so fused == chunked_torch"
        cases.append(case)
    print(f"device={device} preset={preset} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"peak memory = {'cuda max_memory_allocated' if device.type == 'cuda' else 'VmHWM - VmRSS (mmap-backed)'}"
          f", gradients excluded; wall {time.time() - t_start:.1f} s")
    print_table(cases)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"preset": preset, "device": device.type, "torch": torch.__version__, "cases": cases}, f,
                      indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
