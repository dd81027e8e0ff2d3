#!/usr/bin/env python
"""Benchmark: dual-context divergence head at large vocabulary — naive (two full [N, V] log-softmaxes) vs fused.

Methods (both return log p_s(y), log p_o(y), KL(p_s‖p_o), KL(p_o‖p_s) per row, and the top-k of p_s when asked):
  naive  opid_mega.kernels.naive_divergence: full [N, V] logits of both contexts, two float32 log_softmaxes, the KLs
         summed over the vocabulary (autograd backward through the original context).
  fused  opid_mega.kernels.dual_context_divergence(backend="auto"): the Triton kernel on CUDA; on CPU "auto" is the
         chunked torch path (one pass over the vocabulary, no [N, V] tensor).
fwd+bwd cases back-propagate logp_orig + KL(p_s‖p_o) + KL(p_o‖p_s) into h_orig and the weight (the distillation
term's backward).

Peak memory is measured as in tools/bench_logprob.py (its PeakMeter): extra memory of one call beyond what existed
before it, minus the gradients every method must return (grad_h_orig and grad_weight). CUDA: max_memory_allocated;
CPU: peak RSS (VmHWM reset through /proc/self/clear_refs) minus RSS before, with MALLOC_MMAP_THRESHOLD_=65536 so
freed tensor buffers go back to the OS. Times: median over repeats after one warm-up call (never asserted on).

    python tools/bench_divergence.py --preset ci --json runs/bench_divergence.json

The JSON holds every case under "cases"; its top-level "peak_bytes" {"naive", "fused"}, "seconds" and
"peak_ratio" are those of the fwd+bwd case (the heaviest); "tp2_vs_tp1" (CPU presets): the fused path split over
the vocabulary on 2 gloo processes against one process, max abs difference of every output and gradient. Beside
every max abs diff, "scale": per key the magnitude it is rounded at (the reference's largest |value|; for a KL the
largest |log-prob|), for a tolerance scaled to it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_logprob import _reexec_with_mmap_threshold, measure  # noqa: E402  (the same measuring method)

PRESETS = {
    # (N, H, V, dtype, pass, topk)
    "ci": [(128, 256, 152064, "float32", "fwd", 0), (128, 256, 152064, "float32", "fwd", 32),
           (128, 256, 152064, "float32", "fwd+bwd", 0)],
    "cpu": [(512, 512, 152064, "float32", "fwd", 0), (512, 512, 152064, "float32", "fwd+bwd", 0),
            (512, 512, 152064, "float32", "fwd", 32)],
    "tiny": [(16, 32, 3000, "float32", "fwd", 4), (16, 32, 3000, "float32", "fwd+bwd", 0)],  # tests
    "gpu": [(4096, 3584, 152064, "bfloat16", "fwd", 0), (4096, 3584, 152064, "bfloat16", "fwd+bwd", 0),
            (4096, 3584, 152064, "bfloat16", "fwd", 32), (4096, 3584, 152064, "float32", "fwd", 0)],
}
# (N, H, V, topk) of the TP2 vs TP1 check (CPU presets; the GPU one needs NCCL ranks: tests/kernels cover it)
TP2_CASE = {"ci": (128, 256, 152064, 32), "cpu": (256, 512, 152064, 32), "tiny": (16, 32, 3000, 4)}
KEYS = ("logp_skill", "logp_orig", "kl_skill_orig", "kl_orig_skill")


def run_case(n, h, v, dtype_name, pass_, topk, device, repeats):
    import torch
    from opid_mega.kernels import dual_context_divergence, naive_divergence
    from opid_mega.kernels._dispatch import resolve_backend

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    h_orig = torch.randn(n, h, generator=g)
    h_skill = (h_orig + 0.5 * torch.randn(n, h, generator=g)).to(dtype).to(device)
    h_orig = h_orig.to(dtype).to(device)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype).to(device)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    backward = pass_ == "fwd+bwd"
    grad_bytes = (n * h + v * h) * h_orig.element_size() if backward else 0

    def call(method):
        ho = h_orig.detach().requires_grad_(backward)
        w = weight.detach().requires_grad_(backward)
        fn = naive_divergence if method == "naive" else dual_context_divergence
        out = fn(h_skill, ho, w, targets, topk=topk)
        if backward:
            (out["logp_orig"].sum() + out["kl_skill_orig"].sum() + out["kl_orig_skill"].sum()).backward()
        return {k: x.detach() for k, x in out.items()}, ho.grad, w.grad

    case = {"N": n, "H": h, "V": v, "dtype": dtype_name, "pass": pass_, "topk": topk, "device": device.type,
            "fused_backend": resolve_backend("auto", h_orig, "bench"), "naive_logits_bytes": 2 * n * v * 4,
            "peak_bytes": {}, "seconds": {}, "max_abs_diff_vs_naive": {}}
    results = measure(call, ("naive", "fused"), device, grad_bytes, repeats, case)
    (fo, fgh, fgw), (no, ngh, ngw) = results["fused"], results["naive"]
    diffs = {k: (fo[k] - no[k]).abs().max().item() for k in KEYS}
    if topk:
        diffs["topk_logp_skill"] = (fo["topk_logp_skill"] - no["topk_logp_skill"]).abs().max().item()
        diffs["topk_ids_equal"] = bool(torch.equal(fo["topk_ids"], no["topk_ids"]))
    if backward:
        diffs["grad_h_orig"] = (fgh.float() - ngh.float()).abs().max().item()
        diffs["grad_weight"] = (fgw.float() - ngw.float()).abs().max().item()
    case["max_abs_diff_vs_naive"] = diffs
    case["scale"] = _scales(no, ngh if backward else None, ngw if backward else None, diffs)
    case["peak_ratio"] = case["peak_bytes"]["fused"] / max(1, case["peak_bytes"]["naive"])
    return case


def _scales(out, grad_h, grad_w, keys) -> dict:
    """Per compared key, the magnitude its rounding is set by (a tolerance for its max abs diff scales with it): the
    largest |value| of the reference; for a KL (a difference of log-probs, itself small) at least the largest
    |log-prob| of the two contexts."""
    mag = {k: float(x.double().abs().max()) for k, x in out.items() if k != "topk_ids" and x.numel()}
    if grad_h is not None:
        mag["grad_h_orig"], mag["grad_weight"] = float(grad_h.double().abs().max()), float(grad_w.double().abs().max())
    logp = max(mag["logp_skill"], mag["logp_orig"])
    return {k: max(mag[k], logp) if k.startswith("kl_") else mag[k] for k in keys if k in mag}


def _inputs(n, h, v, topk_unused=0):
    import torch

    g = torch.Generator().manual_seed(0)
    h_orig = torch.randn(n, h, generator=g)
    h_skill = h_orig + 0.5 * torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h ** 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    return h_skill, h_orig, weight, targets


def _fused_fwd_bwd(h_skill, h_orig, weight, targets, topk, vocab_start=0, tp_group=None):
    from opid_mega.kernels import dual_context_divergence

    ho, w = h_orig.detach().requires_grad_(True), weight.detach().requires_grad_(True)
    out = dual_context_divergence(h_skill, ho, w, targets, topk=topk, vocab_start=vocab_start, tp_group=tp_group,
                                  backend="torch")
    (out["logp_orig"].sum() + out["kl_skill_orig"].sum() + out["kl_orig_skill"].sum()).backward()
    return {k: x.detach() for k, x in out.items()}, ho.grad, w.grad


def _tp_rank(rank, world, port, n, h, v, topk, out_path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    hs, ho, w, t = _inputs(n, h, v)
    shard = v // world
    out, gh, gw = _fused_fwd_bwd(hs, ho, w[rank * shard:(rank + 1) * shard], t, topk, vocab_start=rank * shard,
                                 tp_group=dist.group.WORLD)
    torch.save({"out": out, "grad_h": gh, "grad_w": gw}, f"{out_path}.{rank}")
    dist.destroy_process_group()


def tp2_vs_tp1(n, h, v, topk):
    """The fused path vocabulary-parallel over 2 gloo ranks (each holding half of the weight rows, partials
    all-reduced) vs one rank: max abs differences of every output and of the gradients (fwd+bwd)."""
    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tp")
        mp.spawn(_tp_rank, args=(2, port, n, h, v, topk, path), nprocs=2, join=True)
        parts = [torch.load(f"{path}.{r}") for r in range(2)]
    one, gh, gw = _fused_fwd_bwd(*_inputs(n, h, v), topk)
    diffs = {k: (parts[0]["out"][k].double() - one[k].double()).abs().max().item() for k in one if k != "topk_ids"}
    if topk:
        diffs["topk_ids_equal"] = bool(torch.equal(parts[0]["out"]["topk_ids"], one["topk_ids"]))
    diffs["grad_h_orig"] = (parts[0]["grad_h"] - gh).abs().max().item()
    diffs["grad_weight"] = (torch.cat([p["grad_w"] for p in parts]) - gw).abs().max().item()
    return {"N": n, "H": h, "V": v, "topk": topk, "max_abs_diff": diffs, "scale": _scales(one, gh, gw, diffs)}


def _mb(x):
    return f"{x / 2**20:.1f}"


def print_table(cases):
    print("| pass | top-k | naive peak MiB | fused peak MiB | fused / naive | naive s | fused s | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cases:
        d = max(x for x in c["max_abs_diff_vs_naive"].values() if not isinstance(x, bool))
        print(f"| {c['pass']} | {c['topk']} | {_mb(c['peak_bytes']['naive'])} | {_mb(c['peak_bytes']['fused'])} | "
              f"{100 * c['peak_ratio']:.2f}% | {c['seconds']['naive']:.3f} | {c['seconds']['fused']:.3f} | {d:.1e} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="ci (< 1 min on 2 CPU cores), cpu, gpu, tiny (tests); default: gpu on CUDA, cpu otherwise")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (ci preset default: 1)")
    args = ap.parse_args(argv)
    _reexec_with_mmap_threshold()

    import torch
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = args.preset or ("gpu" if device.type == "cuda" else "cpu")
    if args.threads or preset == "ci":
        torch.set_num_threads(args.threads or 1)
    repeats = args.repeats or (1 if preset == "ci" else 3)
    t_start = time.time()
    cases = [run_case(*spec, device=device, repeats=repeats) for spec in PRESETS[preset]]
    print(f"device={device} preset={preset} torch={torch.__version__} threads={torch.get_num_threads()} peak memory = "
          f"{'cuda max_memory_allocated' if device.type == 'cuda' else 'VmHWM - VmRSS (mmap-backed)'}, gradients "
          f"excluded; wall {time.time() - t_start:.1f} s")
    print_table(cases)
    main_case = next((c for c in cases if c["pass"] == "fwd+bwd"), cases[0])
    result = {"preset": preset, "device": device.type, "torch": torch.__version__,
              "peak_bytes": dict(main_case["peak_bytes"]), "seconds": dict(main_case["seconds"]),
              "peak_ratio": main_case["peak_ratio"], "cases": cases}
    if preset in TP2_CASE:  # vocabulary parallel over 2 gloo processes (CPU) == one process
        result["tp2_vs_tp1"] = tp2_vs_tp1(*TP2_CASE[preset])
        d = result["tp2_vs_tp1"]["max_abs_diff"]
        print("TP2 vs TP1 (fwd+bwd, top-k %d): max abs diff %.1e over %s" % (
            TP2_CASE[preset][3], max(x for x in d.values() if not isinstance(x, bool)), ", ".join(sorted(d))))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
