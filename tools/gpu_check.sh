#!/usr/bin/env bash
# GPU check, bounded: at most ~10 minutes on one CUDA GPU, every stage under its own timeout (run from anywhere):
#   1. env      torch/triton/CUDA present (else stop)
#   2. install  the package, editable, no deps (only when it is not importable yet), and the optional pieces this
#               machine can install by itself (sglang-router, torch_memory_saver) -- each skipped with a line if not
#   3. tests    the kernel tests with the compiled Triton backend (tests/kernels; TRITON_INTERPRET unset)
#   4. bench_logprob, fork_attention, bench_rescoring, bench_divergence   kernel benchmarks (JSON)
#   5. train    2 real training iterations of a small real model (tiny-qwen3, or smollm2-135m when it can be built
#               offline) in bf16, TP1, TE spec when transformer_engine is installed, with an SGLang rollout server
#               colocated on the same GPU (memory released/resumed between phases when torch_memory_saver is
#               there), a weight sync per iteration with the greedy probe check, and the engine-vs-trainer log-prob
#               mismatch from the metrics
# Stage timings and exit codes: $OUT/stages.json. Outputs (logs, JUnit XML, benchmark JSON) go to $OUT when set, else
# runs/gpu_check/. Exit status: the first failure.
#   bash tools/gpu_check.sh
set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT_DIR="${OUT:-$REPO/runs/gpu_check}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python}"
unset TRITON_INTERPRET OPID_TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
status=0
STAGES="$OUT_DIR/stages.jsonl"
: > "$STAGES"
step() {  # step NAME TIMEOUT_S CMD...
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > >(tee "$OUT_DIR/$name.log") 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT_DIR/summary.txt"
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"limit_s\": $limit}" >> "$STAGES"
  if [ $rc -ne 0 ] && [ $status -eq 0 ]; then status=$rc; fi
  return $rc
}

step env 30 "$PY" -c "
import torch, triton
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)
assert torch.cuda.is_available(), 'no CUDA device visible'
print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
" || { echo "no usable CUDA torch + triton: stopping"; exit 1; }
"$PY" -c "import opid_mega.kernels" 2>/dev/null || \
  step install 90 "$PY" -m pip install --no-build-isolation --no-deps -e "$REPO"
for opt in sglang-router torch_memory_saver; do  # optional; an offline machine skips them
  "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${opt//-/_}') is None)" 2>/dev/null || \
    step "install_${opt//-/_}" 60 "$PY" -m pip install -q "$opt" || echo "$opt not installable here: skipped"
done
step import 60 "$PY" -c "import opid_mega.kernels as k; print(k.__file__)"
step tests 120 "$PY" -m pytest tests/kernels -q -p no:cacheprovider --junitxml="$OUT_DIR/kernel_tests.xml"
step bench_logprob 60 "$PY" tools/bench_logprob.py --preset gpu --json "$OUT_DIR/bench_logprob.json"
# fork attention at production-like shapes: Triton vs the torch per-segment path (accuracy and time)
step fork_attention 45 "$PY" - "$OUT_DIR/fork_attention.json" <<'PYEOF'
import json, sys, time
import torch
from opid_mega.kernels import build_fork_metadata, fork_attention
res = []
for dtype in (torch.bfloat16, torch.float32):
    for (groups, prefix, b1, b2, hq, hkv, d) in ((8, 2048, 600, 560, 28, 4, 128), (32, 512, 200, 180, 16, 2, 128)):
        ids, cu = [], [0]
        for _ in range(groups):
            ids += [0] * prefix + [1] * b1 + [2] * b2
            cu.append(len(ids))
        dev = torch.device("cuda")
        bids = torch.tensor(ids, dtype=torch.int32, device=dev)
        cus = torch.tensor(cu, dtype=torch.int32, device=dev)
        n = len(ids)
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(n, h, d, device=dev, generator=g).to(dtype) for h in (hq, hkv, hkv))
        meta = build_fork_metadata(cus, bids)
        row = {"dtype": str(dtype), "N": n, "groups": groups, "prefix": prefix, "branches": [b1, b2], "Hq": hq,
               "Hkv": hkv, "D": d}
        outs = {}
        for backend in ("triton", "torch"):
            outs[backend] = fork_attention(q, k, v, cus, bids, backend=backend, meta=meta)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                fork_attention(q, k, v, cus, bids, backend=backend, meta=meta)
            torch.cuda.synchronize()
            row[f"ms_{backend}"] = (time.perf_counter() - t0) / 5 * 1e3
        row["max_abs_diff"] = (outs["triton"].float() - outs["torch"].float()).abs().max().item()
        print(row)
        res.append(row)
json.dump({"cases": res}, open(sys.argv[1], "w"), indent=1)
bad = [r for r in res if r["max_abs_diff"] > (2e-2 if "bfloat16" in r["dtype"] else 1e-4)]
sys.exit(1 if bad else 0)
PYEOF
if [ -f tools/bench_rescoring.py ]; then
  if "$PY" tools/bench_rescoring.py --help 2>/dev/null | grep -q -- "--json"; then
    step bench_rescoring 60 "$PY" tools/bench_rescoring.py --json "$OUT_DIR/bench_rescoring.json"
  else
    step bench_rescoring 60 "$PY" tools/bench_rescoring.py
  fi
else
  echo "tools/bench_rescoring.py not present: skipped" | tee -a "$OUT_DIR/summary.txt"
fi
# the dual-context divergence (algo.delta=full_kl|topk_kl, algo.distill_coef): fused Triton vs two full log-softmaxes
step bench_divergence 90 "$PY" tools/bench_divergence.py --preset gpu --json "$OUT_DIR/bench_divergence.json"
# 2 real iterations on this GPU: SGLang rollouts, weight sync (+ probe check), engine-vs-trainer mismatch
if "$PY" -c "import sglang" 2>/dev/null; then
  SAVER=false
  "$PY" -c "import torch_memory_saver" 2>/dev/null && SAVER=true
  step train 220 "$PY" -m opid_mega.cli --config configs/tiny_cpu.yaml --run-dir "$OUT_DIR/train" \
    model.init_from= model.dtype=bfloat16 parallel.backend=nccl scoring.kernel_backend=auto \
    rollout.engine=sglang "rollout.sglang_args=[--mem-fraction-static,0.3,--max-running-requests,16]" \
    rollout.tasks_per_iter=4 rollout.group_size=4 env.max_steps=4 train.iterations=2 train.save_interval=0 \
    eval.interval=0 sync.check_interval=1 deploy.gpus_per_node=1 deploy.train_gpus_per_node=1 \
    deploy.rollout_servers_per_node=1 deploy.rollout_mem_fraction=0.3 deploy.release_engine_memory=$SAVER \
    logging.tensorboard=false logging.progress=false
  "$PY" - "$OUT_DIR/train/metrics.jsonl" "$OUT_DIR/train_metrics.json" <<'PYEOF' || status=${status:-1}
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
keep = ("step", "rollout/logprob_mismatch", "weight_sync/version", "weight_sync/bytes", "weight_sync/transfer_s",
        "weight_sync/probe_max_abs_diff", "time/rollout", "time/scoring", "time/update", "time/weight_sync")
out = [{k: r.get(k) for k in keep} for r in rows]
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[2], "w"), indent=1)
sys.exit(0 if [r["step"] for r in rows] == [1, 2] else 1)
PYEOF
else
  echo "sglang is not installed on this machine (and cannot be from here): training stage skipped" | \
    tee -a "$OUT_DIR/summary.txt"
fi
"$PY" - "$STAGES" "$OUT_DIR/stages.json" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
json.dump({"stages": rows, "total_s": sum(r["seconds"] for r in rows)}, open(sys.argv[2], "w"), indent=1)
print(json.dumps({"stages": rows, "total_s": sum(r["seconds"] for r in rows)}))
PYEOF
echo "outputs in $OUT_DIR; status $status"
exit $status
