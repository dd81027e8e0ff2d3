#!/usr/bin/env bash
# Part of the README install. Two things, neither needed again by the tests (which download nothing):
#
# 1. megatron-core 0.19.2 for the compatibility tests (tests/megatron/test_megatron_compat_019.py,
#    tests/megatron/test_megatron_lm_builder_019.py), next to (not over) the pinned 0.16.1. 0.19.2 declares
#    Python >= 3.12 but works on 3.11, so it goes, without its dependencies, into its own folder (OPID_COMPAT_DIR,
#    default ~/.cache/opid_mega/megatron-core-0.19.2); the tests put that folder first on PYTHONPATH. The install goes
#    to a scratch folder renamed into place, so a half install is never used; skipped when the folder holds 0.19.2.
# 2. The GPU stack in tools/constraints-gpu.txt must resolve: pip's --dry-run on Python 3.12 (PYTHON312, default the
#    first python3.12 on PATH or under ~/.pyenv/versions) resolves it against the registry's metadata, downloading no
#    large wheel (~3 min on 2 cores), and transformer-engine-torch's pinned version (a source distribution) must exist.
#    A failure fails the install. Skipped when this constraints file already resolved here (a stamp holds its
#    checksum); OPID_GPU_CONSTRAINTS_CHECK=0 skips it, saying so.
#
#   bash tools/install_compat.sh            # uses `python -m pip` on PATH
#   PYTHON=/path/to/python PYTHON312=/path/to/python3.12 bash tools/install_compat.sh
set -euo pipefail

PYTHON="${PYTHON:-python}"
VERSION="0.19.2"
TARGET="${OPID_COMPAT_DIR:-$HOME/.cache/opid_mega/megatron-core-$VERSION}"
HERE="$(cd "$(dirname "$0")" && pwd)"
GPU_CONSTRAINTS="$HERE/constraints-gpu.txt"

install_megatron_core() {
    if [[ -f "$TARGET/megatron/core/package_info.py" && -d "$TARGET/megatron_core-$VERSION.dist-info" ]]; then
        echo "install_compat.sh: megatron-core $VERSION already in $TARGET; nothing to do"
        return 0
    fi
    mkdir -p "$(dirname "$TARGET")"
    scratch="$TARGET.tmp$$"
    trap 'rm -rf "$scratch"' EXIT
    "$PYTHON" -m pip install --no-deps --ignore-requires-python --only-binary=:all: --disable-pip-version-check \
        --target "$scratch" "megatron-core==$VERSION"
    if [[ ! -f "$scratch/megatron/core/package_info.py" || ! -d "$scratch/megatron_core-$VERSION.dist-info" ]]; then
        echo "install_compat.sh: pip reported success but $scratch holds no megatron-core $VERSION" >&2
        exit 1
    fi
    rm -rf "$TARGET"
    mv "$scratch" "$TARGET"
    echo "install_compat.sh: done (megatron-core $VERSION in $TARGET)"
}

find_python312() {
    if [[ -n "${PYTHON312:-}" ]]; then echo "$PYTHON312"; return 0; fi
    local c
    for c in "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.12*/bin/python; do
        if [[ -n "$c" && -x "$c" ]] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null
        then echo "$c"; return 0; fi
    done
    return 1
}

check_gpu_constraints() {
    if [[ "${OPID_GPU_CONSTRAINTS_CHECK:-1}" == "0" ]]; then
        echo "install_compat.sh: OPID_GPU_CONSTRAINTS_CHECK=0: tools/constraints-gpu.txt NOT checked"
        return 0
    fi
    local stamp sum py report te_torch
    stamp="$(dirname "$TARGET")/constraints-gpu.resolved"
    sum="$(sha256sum "$GPU_CONSTRAINTS" | cut -d' ' -f1)"
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$sum" ]]; then
        echo "install_compat.sh: tools/constraints-gpu.txt (sha256 ${sum:0:12}) already resolved here"
        return 0
    fi
    if ! py="$(find_python312)"; then
        echo "install_compat.sh: no Python 3.12 to resolve tools/constraints-gpu.txt with: set PYTHON312" >&2
        exit 1
    fi
    report="$(mktemp)"
    # the binary part of the stack, resolved together under the pins (metadata only: --dry-run)
    "$py" -m pip install --dry-run --ignore-installed --only-binary=:all: --disable-pip-version-check --quiet \
        --report "$report" -c "$GPU_CONSTRAINTS" \
        sglang torch triton sglang-kernel flashinfer-python flash-attn-4 megatron-core transformer-engine-cu13 \
        transformers
    "$py" - "$report" "$GPU_CONSTRAINTS" <<'PY'
import json, re, sys
report, constraints = sys.argv[1:3]
got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
       for i in json.load(open(report))["install"]}
pins = dict(re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line).groups() for line in open(constraints)
            if re.match(r"[A-Za-z0-9]", line))
skip = {"transformer-engine", "transformer-engine-torch"}  # installed from source against the local torch
bad = [f"{n}=={v} (resolved: {got.get(n, 'absent')})" for n, v in pins.items() if n not in skip and got.get(n) != v]
if bad:
    sys.exit("install_compat.sh: tools/constraints-gpu.txt pins not in the resolved set: " + ", ".join(bad))
print(f"install_compat.sh: tools/constraints-gpu.txt resolves on Python 3.12 ({len(got)} packages)")
PY
    rm -f "$report"
    te_torch="$(sed -n 's/^transformer-engine-torch==//p' "$GPU_CONSTRAINTS")"
    if ! "$py" -m pip index versions transformer-engine-torch --disable-pip-version-check 2>/dev/null \
            | grep -q "Available versions:.*\b${te_torch//./\\.}\b"; then
        echo "install_compat.sh: transformer-engine-torch==$te_torch is not in the registry" >&2
        exit 1
    fi
    mkdir -p "$(dirname "$stamp")"
    echo "$sum" > "$stamp"
}

install_megatron_core
check_gpu_constraints
