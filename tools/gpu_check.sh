#!/usr/bin/env bash
# GPU check for an offline machine with one CUDA GPU and a Python 3.12 `python3` that has torch, triton and
# transformers but no megatron-core (docs/gpu_check.md). What it installs comes from gpu_wheels/, made by
# tools/gpu_wheels.sh on a machine with the package registry and carried with the run. Stages, in order, each under
# its own time limit (their sum, the planned budget, is printed first and is <= 540 s; the time a stage leaves
# unused goes to the stages after it, so the whole run never exceeds the budget):
#   env             torch / triton / CUDA facts and the measured bf16 matmul rate (every kernel figure is also
#                   given as a share of it)
#   install         gpu_wheels/*.whl with `pip install --no-index --no-deps --target` into a directory already on
#                   PYTHONPATH (without pip: the wheels unzipped there); nothing else is installed
#   kernel_tests    tests/kernels -m "not slow" with the compiled Triton backend (fixed tiles; one test autotunes)
#   bench_logprob   `opid-bench logprob --preset 7b` and `--preset 32b`: the fused log-prob head against its peers
#                   (eager naive, Liger's fused linear CE where carried), Qwen2.5-7B's head (hidden 3584, V 152,064)
#                   and one TP-4 rank of Qwen2.5-32B's (hidden 5120, V 38,016), bf16, fwd and fwd+bwd
#   bench_divergence  `opid-bench divergence`, the same presets: the dual-context divergence head
#   bench_fork_attention  `opid-bench fork_attention`, the same presets: the fork-attention kernel alone against the
#                   naive scorer's per-sequence attention, dense-mask SDPA and FlexAttention with the same mask
#   rescoring       `opid-bench rescoring --preset 7b`: fork vs two-pass naive scoring on a bf16 megatron-core model
#                   (Qwen2.5-7B layer shapes, 4 layers, full vocabulary), both skill placements
#   delta_noise     `opid-bench delta_noise --preset 7b`: the noise of Δ on that model in bf16, fp16 and fp32 when the
#                   same step-samples are packed otherwise, scored in two passes, or given an empty skill
#   ppo_step        one bf16 PPO step of the trainer's Policy (training attention through the model: the varlen path)
#   local_engine    the local rollout engine, and its and the trainer's log-probs against an fp32 reference
# Every opid-bench table comes from this one run, 5 timed repeats per row (median, min, max); they come back as
# bench.tar.gz, the folder gpu/ of opid-bench JSONs, OP_PRESET.json (their titles name the GPU):
#   rm -rf docs/bench/gpu && tar xzf bench.tar.gz -C docs/bench
#   opid-bench report docs/bench/gpu --markdown docs/performance.md
# The summary states the fused heads' GPU targets (docs/performance.md) as met or not (`targets`).
# The package runs from this checkout (PYTHONPATH; kernels/ appears as opid_mega.kernels as setup.py maps it), so
# every stage is independent of the install: a stage that fails never takes a later one with it. A stage whose
# Python packages (or the Qwen3 tokenizer) are missing is `skipped` with the reason, never a failure. Output in $OUT
# (else runs/gpu_check/): summary.json (printed last) + stages.log + bench.tar.gz + ppo_step.json + local_engine.json
# (<= 8 files). Exit status: 1 iff a stage that ran failed or timed out.
#   bash tools/gpu_check.sh             # on the GPU machine
#   bash tools/gpu_check.sh --dry-run   # the same plumbing on a CPU machine: TRITON_INTERPRET=1, tiny shapes
#   GPU_CHECK_ONLY=install,ppo_step bash tools/gpu_check.sh   # only these stages (the others: skipped)
#   GPU_CHECK_XDIST=0 bash tools/gpu_check.sh                  # the kernel tests in one process
set -u
DRY=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY=1 ;;
  *) echo "usage: bash tools/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
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

# name:limit_s of every stage, in order
LIMITS=(env:25 install:20 kernel_tests:110 bench_logprob:60 bench_divergence:50 bench_fork_attention:35 rescoring:45
        delta_noise:60 ppo_step:60 local_engine:45)
BUDGET=0
for x in "${LIMITS[@]}"; do BUDGET=$((BUDGET + ${x#*:})); done
limit_of() { for x in "${LIMITS[@]}"; do [ "${x%%:*}" = "$1" ] && echo "${x#*:}"; done; }
after() {  # the planned seconds of the stages after $1
  local seen=0 sum=0
  for x in "${LIMITS[@]}"; do
    [ $seen -eq 1 ] && sum=$((sum + ${x#*:}))
    [ "${x%%:*}" = "$1" ] && seen=1
  done
  echo $sum
}
echo "gpu_check: budget ${BUDGET} s = $(IFS=+; echo "${LIMITS[*]}" | sed 's/[a-z_]*://g') ($([ $DRY -eq 1 ] && echo dry run || echo device)); out $OUT_DIR"
[ "$BUDGET" -le 540 ] || { echo "gpu_check: the stage limits sum to ${BUDGET} s > 540 s" >&2; exit 2; }
T_END=$(( $(date +%s) + BUDGET ))

# ---- the package from this checkout, without installing it: opid_mega's entries linked, kernels/ as its kernels
SRC="$WORK/src"
mkdir -p "$SRC/opid_mega" "$WORK/site"
for e in "$REPO"/opid_mega/*; do ln -s "$e" "$SRC/opid_mega/$(basename "$e")"; done
ln -s "$REPO/kernels" "$SRC/opid_mega/kernels"
export PYTHONPATH="$SRC:$WORK/site${PYTHONPATH:+:$PYTHONPATH}" GPU_CHECK_SRC="$SRC"
export PYTHONDONTWRITEBYTECODE=1 TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}" NCCL_DEBUG=WARN PIP_ROOT_USER_ACTION=ignore
export PYTHONWARNINGS="ignore:Apex is not installed:UserWarning,ignore:Transformer Engine and Apex are not installed:UserWarning"
if [ $DRY -eq 1 ]; then
  export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
else
  unset TRITON_INTERPRET OPID_TRITON_INTERPRET
fi
# the Qwen3 tokenizer carried beside the wheels (OPID_QWEN_TOKENIZER_DIR); without it, the stages that need it skip
if [ -f "$WHEELS/qwen_tokenizer/tokenizer.json.gz" ] && "$PY" -c 'import gzip, os, sys
for f in sys.argv[2:]:
    with gzip.open(f) as src, open(os.path.join(sys.argv[1], os.path.basename(f)[:-3]), "wb") as dst:
        dst.write(src.read())' "$(mkdir -p "$WORK/qwen_tokenizer" && echo "$WORK/qwen_tokenizer")" \
    "$WHEELS"/qwen_tokenizer/*.gz; then
  export OPID_QWEN_TOKENIZER_DIR="$WORK/qwen_tokenizer"
fi

record() {  # record NAME STATUS SECONDS GIVEN_S [REASON]
  "$PY" -c 'import json, sys; n, st, s, lim, given, why = sys.argv[1:7]
print(json.dumps({"name": n, "status": st, "seconds": round(float(s), 2), "limit_s": int(lim), "given_s": int(given),
                  "reason": why or None}))' "$1" "$2" "$3" "$(limit_of "$1")" "$4" "${5:-}" >> "$STAGES"
}
skip() { echo "=== $1: skipped ($2)" | tee -a "$LOG"; record "$1" skipped 0 0 "$2"; }
NO_DEVICE=""  # set when env finds no CUDA device: every later stage is skipped with that reason
stage() {  # stage NAME NEEDS(modules and/or qwen_tokenizer, comma-separated, or -) CMD...
  local name="$1" needs="$2"
  shift 2
  if [ -n "$NO_DEVICE" ]; then skip "$name" "$NO_DEVICE"; return 0; fi
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ ",$GPU_CHECK_ONLY," != *",$name,"* ]]; then
    skip "$name" "not in GPU_CHECK_ONLY=$GPU_CHECK_ONLY"; return 0
  fi
  if [ "$needs" != "-" ]; then
    local missing
    missing="$("$PY" tools/gpu_check.py missing "$needs" 2>&1)" || missing="(the check itself failed: $missing)"
    if [ -n "$missing" ]; then skip "$name" "missing: $missing"; return 0; fi
  fi
  # its own limit plus what the stages before it left unused, never past the budget's end
  local given=$(( T_END - $(date +%s) - $(after "$name") ))
  [ $given -ge 5 ] || given=5
  echo "=== $name (limit $(limit_of "$name") s, given ${given} s): $*" | tee -a "$LOG"
  if declare -F "$1" > /dev/null; then set -- bash -c "$1"; fi  # a function of this script (exported below)
  local t0 t1 rc status
  t0=$(date +%s.%N)
  # SIGINT first: pytest still writes its report, a Python stage its traceback; SIGKILL 10 s later
  timeout -s INT --kill-after=10 "$given" "$@" > "$WORK/$name.out" 2>&1 < /dev/null
  rc=$?
  t1=$(date +%s.%N)
  cat "$WORK/$name.out" >> "$LOG"
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
  local sec
  sec=$("$PY" -c "print($t1 - $t0)")
  echo "=== $name: $status (rc $rc) in ${sec} s" | tee -a "$LOG"
  [ "$status" = ok ] || tail -n 25 "$WORK/$name.out"
  record "$name" "$status" "$sec" "$given" "$([ "$status" = ok ] || echo "rc $rc")"
}

# ---- env: when it found torch without a CUDA device the rest is skipped (the summary says why); when it could not
# tell (it failed or ran out of time before writing its facts), the stages still run
stage env - "$PY" tools/gpu_check.py env "$WORK/env.json" $([ $DRY -eq 1 ] && echo --dry-run)
if [ $DRY -eq 0 ] && [ -f "$WORK/env.json" ] && ! "$PY" -c 'import json, sys
sys.exit(0 if json.load(open(sys.argv[1])).get("cuda_available") else 1)' "$WORK/env.json" 2> /dev/null; then
  NO_DEVICE="no CUDA device (see the env stage)"
fi
# the folder of this run's opid-bench JSONs (docs/bench/gpu)
RUN=$([ $DRY -eq 1 ] && echo dry_run || echo gpu)
mkdir -p "$WORK/$RUN"
export RUN

# ---- install: the carried wheels into $WORK/site (on PYTHONPATH), --no-deps: their needs are already there
install_stage() {
  local wheels=("$WHEELS"/*.whl)
  if [ $DRY -eq 1 ]; then  # this Python may not be 3.12: unpack them for the GPU machine's, off the path
    "$PY" -m pip install --no-index --no-deps --no-compile --quiet --target "$WORK/site_gpu" --python-version 3.12 \
      --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 --only-binary=:all: "${wheels[@]}" || return 1
    "$PY" tools/gpu_check.py installed "$WORK/install.json" "$WHEELS" "$WORK/site_gpu"
  else
    if "$PY" -m pip --version > /dev/null 2>&1; then
      "$PY" -m pip install --no-index --no-deps --no-compile --quiet --target "$WORK/site" "${wheels[@]}" || return 1
    else  # no pip: a wheel is a zip of its import tree
      "$PY" tools/gpu_check.py unpack "$WORK/site" "${wheels[@]}" || return 1
    fi
    "$PY" tools/gpu_check.py installed "$WORK/install.json" "$WHEELS" "$WORK/site"
  fi
}
export -f install_stage
export DRY PY WHEELS WORK
if [ -n "$NO_DEVICE" ] || compgen -G "$WHEELS/*.whl" > /dev/null; then
  stage install - install_stage
else
  skip install "no wheels in $WHEELS: run tools/gpu_wheels.sh where the package registry is reachable and carry gpu_wheels"
fi

# ---- kernels and their benchmarks
if [ $DRY -eq 1 ]; then  # the stage's plumbing only: the test suite runs every kernel file under the interpreter
  KT=(tests/kernels/test_kernel_logprob_temperature.py)
  P_BENCH=tiny P_HEADS=tiny TINY=--tiny
else
  KT=(tests/kernels)
  P_BENCH=7b P_HEADS="7b 32b" TINY=
fi
XDIST=()  # cold Triton compiles are CPU work: spread the test files over 4 workers where pytest-xdist is there
[ $DRY -eq 0 ] && [ "${GPU_CHECK_XDIST:-1}" != 0 ] && [ -z "$("$PY" tools/gpu_check.py missing xdist 2>&1)" ] \
  && XDIST=(-n 4 --dist loadfile)
stage kernel_tests pytest "$PY" tools/gpu_check.py pytest "${KT[@]}" -m "not slow" -q -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"} \
  --junitxml="$WORK/kernel_tests.xml"
# opid-bench from a neutral directory (in the checkout `python3 -m` would put the checkout's opid_mega, which has no
# kernels, first on sys.path); --no-compile: torch.compile's compile time does not fit a stage's limit. One JSON per
# op and preset, 5 timed repeats per row; a preset that fails leaves the others running (the stage then fails).
opid_bench() {  # OP PRESET...
  local op="$1" rc=0 p
  shift
  for p in "$@"; do
    (cd "$WORK" && "$PY" -m opid_mega.bench.cli "$op" --preset "$p" --repeats 5 --no-compile \
      --json "$WORK/$RUN/${op}_$p.json") || rc=1
  done
  return $rc
}
bench_logprob() { opid_bench logprob $P_HEADS; }
bench_divergence() { opid_bench divergence $P_HEADS; }
bench_fork_attention() { opid_bench fork_attention $P_HEADS; }
bench_rescoring() { opid_bench rescoring $P_BENCH; }
bench_delta_noise() { opid_bench delta_noise $P_BENCH; }
export -f opid_bench bench_logprob bench_divergence bench_fork_attention bench_rescoring bench_delta_noise
export P_BENCH P_HEADS
stage bench_logprob - bench_logprob
stage bench_divergence - bench_divergence
stage bench_fork_attention - bench_fork_attention

# ---- model stages (megatron-core from the wheels)
stage rescoring megatron.core bench_rescoring
stage delta_noise megatron.core bench_delta_noise
stage ppo_step megatron.core,transformers "$PY" tools/gpu_model_stages.py ppo --model-dir "$WORK/model" $TINY \
  --json "$WORK/ppo_step.json"
stage local_engine megatron.core,transformers "$PY" tools/gpu_model_stages.py engine $TINY \
  --json "$WORK/local_engine.json"

# ---- what comes back: summary.json, stages.log, bench.tar.gz (the run's opid-bench JSONs), ppo_step.json,
# local_engine.json (8 files at most)
for f in ppo_step local_engine; do
  [ -f "$WORK/$f.json" ] && cp "$WORK/$f.json" "$OUT_DIR/$f.json"
done
compgen -G "$WORK/$RUN/*.json" > /dev/null && tar czf "$OUT_DIR/bench.tar.gz" -C "$WORK" "$RUN"
"$PY" tools/gpu_check.py summary "$STAGES" "$WORK" "$OUT_DIR/summary.json" "$BUDGET" "$RUN" \
  $([ $DRY -eq 1 ] && echo --dry-run)
exit "$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["exit_status"])' "$OUT_DIR/summary.json" \
  2> /dev/null || echo 1)"
