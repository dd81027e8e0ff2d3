"""Benchmark: training attention over a packed micro-batch, varlen path vs the dense-mask path.

What is measured: forward + backward of the core attention alone (q, k, v -> out; backward of a given upstream
gradient to q, k, v), fp32 on the CPU, at one packed micro-batch of several causal sequences:
  dense  -- the previous training path: the [N, N] boolean mask of the pack (``fork_attention_mask``, built in the
            step) and one SDPA over the whole pack with k/v repeated to the query heads;
  varlen -- ``opid_mega.megatron.attention.varlen_attention`` (on the CPU: causal SDPA per sequence).
Heads: Qwen2.5-7B on one TP4 rank (28/4 heads -> 7 query heads, 1 KV head, head dim 128) unless overridden.

Memory: each path runs in its own fresh process; after the inputs exist and a small warm-up call (at 64 tokens,
so thread pools and kernel caches are not counted), freed heap is trimmed, the kernel's peak-RSS mark is reset
(``/proc/self/clear_refs`` = 5) and the resident size read. ``peak_bytes`` = peak resident size during the first
full-size step minus that base (Linux only): everything the step allocates. ``attention_bytes`` = ``peak_bytes``
minus ``interface_bytes``, the fp32 output and the q, k, v gradients that any exact attention produces (they belong
to the surrounding layer: the output projection and the QKV projection's backward hold them anyway): the attention's
own memory (masks, saved softmax statistics, GQA copies, temporaries). The upstream gradient is an input.
``step_s``: median wall time of ``--repeat`` further steps (the first step when repeat is 0).

    python tools/bench_train_attention.py --preset ci --json      # JSON on stdout
    python tools/bench_train_attention.py --preset tiny           # seconds; a table
    python tools/bench_train_attention.py --json out.json         # JSON to a file

JSON: nested objects, ``out["dense"]["peak_bytes"]``, ``out["varlen"]["step_s"]`` (the keys ``dense.peak_bytes``,
``varlen.peak_bytes``, ``dense.step_s``, ``varlen.step_s`` of issue 13 as nested dicts), plus ``config``,
``varlen_memory_fraction`` (varlen / dense ``peak_bytes``), ``varlen_attention_memory_fraction`` (varlen / dense
``attention_bytes``, issue 13's "attention memory") and ``speedup`` (dense / varlen step time).
The parent process does not import torch; run it with the machine to itself (OMP_NUM_THREADS is respected).
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
}


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
    from opid_mega.megatron.attention import packed_seq_params, varlen_attention

    heads, kv, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    scale = d ** -0.5

    def make(lens, seed):
        g = torch.Generator().manual_seed(seed)
        n = sum(lens)
        q, k, v = (torch.randn(n, h, d, generator=g).requires_grad_() for h in (heads, kv, kv))
        w = torch.randn(n, heads, d, generator=g)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        return q, k, v, w, cu

    def step(q, k, v, w, cu):
        if path == "dense":
            mask = fork_attention_mask(cu, torch.zeros(q.shape[0], dtype=torch.int32))
            rep = heads // kv
            qq, kk, vv = (x.transpose(0, 1)[None] for x in (q, k.repeat_interleave(rep, 1),
                                                              v.repeat_interleave(rep, 1)))
            out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)[0].transpose(0, 1)
        else:
            out = varlen_attention(q, k, v, packed_seq_params(cu), softmax_scale=scale)
        out.backward(w)
        for x in (q, k, v):
            x.grad = None

    step(*make([40, 24], 1))  # warm-up at 64 tokens
    inputs = make(cfg["seq_lens"], 0)
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
    return {"peak_bytes": peak, "attention_bytes": peak - interface, "interface_bytes": interface,
            "step_s": statistics.median(times) if times else first, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="ci")
    ap.add_argument("--repeat", type=int, default=None, help="timed steps after the memory step")
    ap.add_argument("--json", nargs="?", const="-", default=None, help="write JSON (to stdout without a path)")
    ap.add_argument("--worker", choices=["dense", "varlen"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, json.loads(args.config))))
        return
    cfg = dict(PRESETS[args.preset])
    if args.repeat is not None:
        cfg["repeat"] = args.repeat
    cfg["tokens"] = sum(cfg["seq_lens"])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = {"preset": args.preset, "config": cfg,
           "measures": "forward+backward of the core attention alone (fp32, CPU)",
           "memory": "peak RSS of a fresh process during the step minus RSS before it (inputs allocated)"}
    for path in ("dense", "varlen"):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", path, "--config", json.dumps(cfg)],
                           capture_output=True, text=True, env=env, cwd=ROOT)
        if r.returncode != 0:
            sys.exit(f"bench_train_attention: the {path} worker failed:\n{r.stderr[-3000:]}")
        out[path] = json.loads(r.stdout.strip().splitlines()[-1])
    out["varlen_memory_fraction"] = out["varlen"]["peak_bytes"] / max(out["dense"]["peak_bytes"], 1)
    out["varlen_attention_memory_fraction"] = (out["varlen"]["attention_bytes"]
                                               / max(out["dense"]["attention_bytes"], 1))
    out["speedup"] = out["dense"]["step_s"] / max(out["varlen"]["step_s"], 1e-12)
    if args.json is not None:
        text = json.dumps(out, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.json != "-":
        print(f"packed micro-batch of {cfg['tokens']} tokens ({len(cfg['seq_lens'])} sequences), "
              f"{cfg['heads']}/{cfg['kv_heads']} heads x {cfg['head_dim']}, fp32, forward+backward of the attention")
        for path in ("dense", "varlen"):
            print(f"  {path:7s} peak {out[path]['peak_bytes'] / 2**20:9.1f} MiB   attention "
                  f"{out[path]['attention_bytes'] / 2**20:9.1f} MiB   step {out[path]['step_s']:8.3f} s")
        print(f"  varlen / dense: peak {out['varlen_memory_fraction']:.3f}, attention memory "
              f"{out['varlen_attention_memory_fraction']:.3f}; speedup {out['speedup']:.1f}x")


if __name__ == "__main__":
    main()
