#!/usr/bin/env python
"""Benchmark: weight sync Megatron -> a real SGLang server, per method, against model size.

For each model size (random Qwen3-style models, fp32, built here) one process holds the Megatron policy (TP1) and one
SGLang server serves the same architecture; every method of opid_mega.megatron.weight_sync runs `--repeats` times
(median seconds; the probe check is off while timing, then run once per method and reported):
  tensor       update_weights_from_tensor (shared-memory handles on CPU)
  distributed  update_weights_from_distributed over a gloo group (NCCL on GPU)
  disk         safetensors into a directory + update_weights_from_disk
Then a paper estimate for Qwen2.5-7B (15.23 GB in bf16) from the bandwidths given (stated in the output).

    python tools/bench_weight_sync.py --preset ci --json runs/bench_weight_sync.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRESETS = {  # (hidden, layers, heads, kv_heads, intermediate)
    "ci": [(64, 2, 4, 2, 128), (512, 8, 8, 2, 1536), (1024, 12, 16, 4, 3072)],
    "quick": [(64, 2, 4, 2, 128), (256, 4, 4, 2, 768)],
}
QWEN25_7B_BYTES = 7_615_616_512 * 2  # bf16


def build_model(out: Path, hidden, layers, heads, kv, inter) -> int:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from opid_mega.models import _save_tiny, _tiny_token_ids

    cfg = Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                      max_position_embeddings=4096, tie_word_embeddings=True, dtype="float32", **_tiny_token_ids())
    _save_tiny(Qwen3ForCausalLM, cfg, out)
    with torch.device("meta"):
        m = Qwen3ForCausalLM(cfg)
    return sum(p.numel() for p in m.parameters())


def run_size(shape, repeats: int, work: Path) -> dict:
    from opid_mega.config import load_config
    from opid_mega.megatron import parallel
    from opid_mega.megatron.policy import Policy
    from opid_mega.megatron.weight_sync import WeightSync
    from opid_mega.models import load_tokenizer
    from opid_mega.rollout.sglang_engine import SGLangEngine

    d = work / ("qwen3-h%d-l%d" % shape[:2])
    params = build_model(d, *shape)
    cfg = load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), ["model.init_from=", "sync.check_interval=0"])
    policy = Policy(cfg, str(d))
    engine = SGLangEngine(str(d), server_args=["--dtype", "float32", "--max-total-tokens", "2048",
                                               "--max-running-requests", "2", "--disable-radix-cache"],
                          log_dir=str(work / "logs"), startup_timeout_s=600)
    row = {"hidden": shape[0], "layers": shape[1], "params": params, "bytes": params * 4, "methods": {}}
    try:
        version = 0
        for method in ("tensor", "distributed", "disk"):
            cfg.sync.method = method
            ws = WeightSync(policy, engine, cfg, str(work / "sync"), load_tokenizer(str(d)))
            times = []
            for _ in range(repeats + 1):  # the first call also creates the update group (distributed)
                version += 1
                t0 = time.perf_counter()
                ws(version)
                times.append(time.perf_counter() - t0)
            ws.version = version
            diff = ws.check()
            med = statistics.median(times[1:])
            row["methods"][method] = {"seconds": med, "first_s": times[0], "gb_per_s": params * 4 / med / 1e9,
                                      "probe_max_abs_diff": diff}
            print(f"  {method:12s} {med:7.3f} s  ({params * 4 / med / 1e9:5.2f} GB/s)  first {times[0]:.3f} s  "
                  f"probe diff {diff:.2g}", flush=True)
    finally:
        engine.shutdown()
        parallel.destroy_all()
    return row


def paper_estimate(nvlink_gbs: float, ib_gbs: float, disk_gbs: float, hbm_gbs: float) -> dict:
    b = QWEN25_7B_BYTES / 1e9
    return {"model": "Qwen2.5-7B bf16", "gigabytes": b,
            "assumptions_GB_per_s": {"nvlink_broadcast": nvlink_gbs, "infiniband": ib_gbs, "disk_write_read": disk_gbs,
                                     "hbm_copy": hbm_gbs},
            "tensor_colocated_s": 2 * b / hbm_gbs,  # CUDA IPC handle: the engine copies once from the trainer's buffer
            "distributed_same_node_s": b / nvlink_gbs,
            "distributed_cross_node_s": b / ib_gbs,
            "disk_s": 2 * b / disk_gbs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="ci")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--nvlink-gbs", type=float, default=150.0)
    p.add_argument("--ib-gbs", type=float, default=40.0)
    p.add_argument("--disk-gbs", type=float, default=2.0)
    p.add_argument("--hbm-gbs", type=float, default=1500.0)
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_sync_") as tmp:
        for shape in PRESETS[a.preset]:
            print(f"hidden {shape[0]}, {shape[1]} layers:", flush=True)
            rows.append(run_size(shape, a.repeats, Path(tmp)))
    est = paper_estimate(a.nvlink_gbs, a.ib_gbs, a.disk_gbs, a.hbm_gbs)
    print("\n| params | fp32 MB | tensor s | distributed s | disk s |\n|---|---|---|---|---|")
    for r in rows:
        m = r["methods"]
        print(f"| {r['params'] / 1e6:.1f} M | {r['bytes'] / 1e6:.0f} | {m['tensor']['seconds']:.3f} | "
              f"{m['distributed']['seconds']:.3f} | {m['disk']['seconds']:.3f} |")
    print(f"\n7B on paper ({est['gigabytes']:.2f} GB, bandwidths {est['assumptions_GB_per_s']} GB/s): colocated tensor "
          f"{est['tensor_colocated_s']:.2f} s, distributed same node {est['distributed_same_node_s']:.2f} s / across "
          f"nodes {est['distributed_cross_node_s']:.2f} s, disk {est['disk_s']:.1f} s (+ the TP/PP gather)")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"sizes": rows, "paper_7b": est}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
