"""Benchmark: training attention over a packed micro-batch -- the varlen path vs the dense mask vs the loop.

What is measured: forward + backward of the core attention alone (q, k, v -> out; backward of a given upstream
gradient to q, k, v), fp32 on the CPU, at one packed micro-batch, for three paths:
  dense  -- ONE SDPA over the whole pack with its [N, N] boolean mask (``fork_attention_mask``) and k/v repeated to
            the query heads;
  loop   -- the previous per-sequence paths: plain packs -- causal SDPA per sequence, outputs concatenated
            (``segment_attention``); fork layouts -- SDPA per group with the group's dense [L_g, L_g] mask (the
            previous distillation training path);
  varlen -- ``opid_mega.megatron.attention.varlen_attention``: ONE varlen call over the pack's ``VarlenLayout``
            (on the CPU: SDPA's flash kernels per segment into one output buffer; on a GPU without TE /
            flash-attn: ``torch.nn.attention.varlen.varlen_attn``).
Presets: ``ci`` / ``tiny`` -- plain packs of causal sequences; ``fork_ci`` / ``fork_tiny`` -- fork layouts as the
distillation's training batches have them (per group a shared prefix, a branch with the skill context + response,
a branch with the response under the original context). Heads: Qwen2.5-7B on one TP4 rank (28/4 heads -> 7 query
heads, 1 KV head, head dim 128) unless overridden.

Memory: each path runs in its own fresh process; after the inputs exist and a small warm-up call (at a few dozen
tokens, so thread pools and kernel caches are not counted), freed heap is trimmed, the kernel's peak-RSS mark is reset
(``/proc/self/clear_refs`` = 5) and the resident size read. ``peak_bytes`` = peak resident size during the first
full-size step minus that base (Linux only): everything the step allocates. ``attention_bytes`` = ``peak_bytes``
minus ``interface_bytes``, the fp32 output and the q, k, v gradients that any exact attention produces (they belong
to the surrounding layer: the output projection and the QKV projection's backward hold them anyway): the attention's
own memory (masks, saved softmax statistics, GQA copies, gathered keys, temporaries). The upstream gradient is an
input. ``step_s``: median wall time of ``--repeat`` further steps (the first step when repeat is 0).

    python tools/bench_train_attention.py --preset ci --json           # JSON on stdout
    python tools/bench_train_attention.py --preset fork_ci             # a table
    python tools/bench_train_attention.py --preset tiny --json out.json

JSON: nested objects, ``out["dense"]["peak_bytes"]``, ``out["varlen"]["step_s"]``, ``out["loop"][...]`` (the keys
``dense.peak_bytes``, ``varlen.peak_bytes``, ``dense.step_s``, ``varlen.step_s`` as nested dicts), plus
``config``, ``varlen_memory_fraction`` (varlen / dense ``peak_bytes``), ``varlen_attention_memory_fraction``
(varlen / dense ``attention_bytes``, the "attention memory"), ``speedup`` (dense / varlen step time) and
``loop_speedup`` (loop / varlen step time); per path ``digest``: for the output and dq, dk, dv,
[sum(x * r), sum |x * r|] in float64 (r: the upstream gradient, or the input itself), so the paths' results can be
compared. The parent process does not import torch; run it with the machine to itself (OMP_NUM_THREADS is
respected).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRESETS = {
    # ~1k-token sequences packed into one 8k-token micro-batch
    "ci": dict(seq_lens=[1100, 900, 1024, 1200, 850, 1000, 1118, 1000], heads=7, kv_heads=1, head_dim=128, repeat=2),
    # seconds: for the test that runs the script end to end
    "tiny": dict(seq_lens=[100, 60, 97], heads=4, kv_heads=2, head_dim=32, repeat=1),
    # distillation fork layout: 5 groups of (shared prefix, [skill context + response, response]), 7,680 tokens
    "fork_ci": dict(groups=[[512, [640, 384]], [700, [500, 300]], [400, [700, 420]], [600, [560, 380]],
                            [480, [604, 300]]], heads=7, kv_heads=1, head_dim=128, repeat=2),
    "fork_tiny": dict(groups=[[40, [30, 20]], [25, [8, 12]], [33, []]], heads=4, kv_heads=2, head_dim=32, repeat=1),
}
PATHS = ("dense", "loop", "varlen")


def layout_of(cfg: dict):
    """(cu_seqlens list, branch ids list or None) of a preset."""
    if "groups" not in cfg:
        cu = [0]
        for n in cfg["seq_lens"]:
            cu.append(cu[-1] + n)
        return cu, None
    cu, br = [0], []
    for prefix, branches in cfg["groups"]:
        br += [0] * prefix
        for b, n in enumerate(branches):
            br += [b + 1] * n
        cu.append(len(br))
    return cu, br


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _worker(path: str, cfg: dict) -> dict:
    import ctypes
    import gc
    import statistics
    import time

    import torch
    import torch.nn.functional as F

    from opid_mega.kernels.fork_attention import fork_attention_mask
    from opid_mega.megatron.attention import packed_seq_params, segment_attention, varlen_attention

    heads, kv, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    scale = d ** -0.5

    def make(layout, seed):
        cu_list, br_list = layout
        g = torch.Generator().manual_seed(seed)
        n = cu_list[-1]
        q, k, v = (torch.randn(n, h, d, generator=g).requires_grad_() for h in (heads, kv, kv))
        w = torch.randn(n, heads, d, generator=g)
        cu = torch.tensor(cu_list, dtype=torch.int32)
        br = None if br_list is None else torch.tensor(br_list, dtype=torch.int32)
        return q, k, v, w, cu, br

    def forward(q, k, v, w, cu, br):
        if path == "dense":
            mask = fork_attention_mask(cu, br if br is not None else torch.zeros(q.shape[0], dtype=torch.int32))
            rep = heads // kv
            qq, kk, vv = (x.transpose(0, 1)[None] for x in (q, k.repeat_interleave(rep, 1),
                                                              v.repeat_interleave(rep, 1)))
            out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)[0].transpose(0, 1)
        elif path == "loop":
            params = packed_seq_params(cu, br)
            masks = params.group_masks("cpu") if params.has_branches else None
            out = segment_attention(q, k, v, cu.tolist(), softmax_scale=scale, masks=masks)
        else:
            out = varlen_attention(q, k, v, packed_seq_params(cu, br), softmax_scale=scale)
        return out

    def step(q, k, v, w, cu, br):
        forward(q, k, v, w, cu, br).backward(w)
        for x in (q, k, v):
            x.grad = None

    small = ([0, 20, 34], [0] * 8 + [1] * 6 + [2] * 6 + [0] * 14) if "groups" in cfg else ([0, 40, 64], None)
    step(*make(small, 1))  # warm-up at a few dozen tokens
    inputs = make(layout_of(cfg), 0)
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    step(*inputs)
    first = time.perf_counter() - t0
    peak = _status_bytes("VmHWM") - base
    times = []
    for _ in range(cfg["repeat"]):
        t0 = time.perf_counter()
        step(*inputs)
        times.append(time.perf_counter() - t0)
    n = inputs[0].shape[0]
    interface = 4 * n * d * (2 * heads + 2 * kv)  # fp32 output, dq, dk, dv: what any exact attention allocates
    # what the step computed, for comparing the paths (after the measured steps): per tensor sum(x * r) in float64
    # against a fixed tensor r (the upstream gradient for the output, the input itself for its gradient) and
    # sum |x * r|, the magnitude that sum is rounded at
    q, k, v, w = inputs[:4]
    out = forward(*inputs)
    out.backward(w)
    digest = {name: [float((x.double() * r.double()).sum()), float((x.double() * r.double()).abs().sum())]
              for name, x, r in (("out", out.detach(), w), ("dq", q.grad, q.detach()), ("dk", k.grad, k.detach()),
                                 ("dv", v.grad, v.detach()))}
    return {"peak_bytes": peak, "attention_bytes": peak - interface, "interface_bytes": interface,
            "step_s": statistics.median(times) if times else first, "threads": torch.get_num_threads(),
            "digest": digest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="ci")
    ap.add_argument("--repeat", type=int, default=None, help="timed steps after the memory step")
    ap.add_argument("--json", nargs="?", const="-", default=None, help="write JSON (to stdout without a path)")
    ap.add_argument("--worker", choices=list(PATHS), help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, json.loads(args.config))))
        return
    cfg = dict(PRESETS[args.preset])
    if args.repeat is not None:
        cfg["repeat"] = args.repeat
    cu, br = layout_of(cfg)
    cfg["tokens"] = cu[-1]
    cfg["layout"] = "fork" if br is not None else "plain"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = {"preset": args.preset, "config": cfg,
           "measures": "forward+backward of the core attention alone (fp32, CPU)",
           "memory": "peak RSS of a fresh process during the step minus RSS before it (inputs allocated)"}
    for path in PATHS:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", path, "--config", json.dumps(cfg)],
                           capture_output=True, text=True, env=env, cwd=ROOT)
        if r.returncode != 0:
            sys.exit(f"bench_train_attention: the {path} worker failed:\n{r.stderr[-3000:]}")
        out[path] = json.loads(r.stdout.strip().splitlines()[-1])
    out["varlen_memory_fraction"] = out["varlen"]["peak_bytes"] / max(out["dense"]["peak_bytes"], 1)
    out["varlen_attention_memory_fraction"] = (out["varlen"]["attention_bytes"]
                                               / max(out["dense"]["attention_bytes"], 1))
    out["speedup"] = out["dense"]["step_s"] / max(out["varlen"]["step_s"], 1e-12)
    out["loop_speedup"] = out["loop"]["step_s"] / max(out["varlen"]["step_s"], 1e-12)
    if args.json is not None:
        text = json.dumps(out, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.json != "-":
        what = (f"{len(cfg['groups'])} fork groups" if "groups" in cfg else f"{len(cfg['seq_lens'])} sequences")
        print(f"packed micro-batch of {cfg['tokens']} tokens ({what}), "
              f"{cfg['heads']}/{cfg['kv_heads']} heads x {cfg['head_dim']}, fp32, forward+backward of the attention")
        for path in PATHS:
            print(f"  {path:7s} peak {out[path]['peak_bytes'] / 2**20:9.1f} MiB   attention "
                  f"{out[path]['attention_bytes'] / 2**20:9.1f} MiB   step {out[path]['step_s']:8.3f} s")
        print(f"  varlen / dense: peak {out['varlen_memory_fraction']:.3f}, attention memory "
              f"{out['varlen_attention_memory_fraction']:.3f}; speedup {out['speedup']:.1f}x (vs the loop "
              f"{out['loop_speedup']:.2f}x)")


if __name__ == "__main__":
    main()
