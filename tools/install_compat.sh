#!/usr/bin/env bash
# Install the second megatron-core the compatibility tests run on (tests/megatron/test_megatron_compat_019.py):
# megatron-core 0.19.2, what GPU users run on Python 3.12, next to (not over) the pinned 0.16.1.
#
#   bash tools/install_compat.sh            # uses `python -m pip` on PATH
#   PYTHON=/path/to/python bash tools/install_compat.sh
#
# 0.19.2 declares Python >= 3.12 but works on 3.11, so it goes, without its dependencies, into its own folder
# (OPID_COMPAT_DIR, default ~/.cache/opid_mega/megatron-core-0.19.2); the tests put that folder first on the ranks'
# PYTHONPATH. The install goes to a scratch folder renamed into place, so a half install is never used. Idempotent:
# exits at once when the folder holds 0.19.2. The tests themselves never download anything.
set -euo pipefail

PYTHON="${PYTHON:-python}"
VERSION="0.19.2"
TARGET="${OPID_COMPAT_DIR:-$HOME/.cache/opid_mega/megatron-core-$VERSION}"

if [[ -f "$TARGET/megatron/core/package_info.py" && -d "$TARGET/megatron_core-$VERSION.dist-info" ]]; then
    echo "install_compat.sh: megatron-core $VERSION already in $TARGET; nothing to do"
    exit 0
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
