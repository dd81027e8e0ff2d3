#!/usr/bin/env bash
# Install SGLang 0.5.23 for CPU serving next to the CPU torch of this project, without replacing torch.
#
#   bash tools/install_sglang_cpu.sh            # uses `python` / `python -m pip` on PATH
#   PYTHON=/path/to/python bash tools/install_sglang_cpu.sh
#
# sglang 0.5.23 pins a CUDA torch (2.14.1), transformers 5.19.0 and ~20 CUDA/kernel wheels. On a CPU machine we:
#   1. keep the already installed torch (2.13.0, CPU) and the project's core stack pinned with a constraints file;
#   2. install sglang's Requires-Dist minus torch/torchvision/torchaudio/torchcodec/timm and the CUDA/kernel
#      packages (flashinfer, sglang-kernel, deep-ep/gemm, flash-mla, cutlass, tilelang, quack, ...);
#   3. `pip install --no-deps sglang==0.5.23`.
# The server is then started with `--device cpu --attention-backend torch_native --disable-cuda-graph` and the import
# shims in opid_mega/rollout/cpu_shims/ on its PYTHONPATH (opid_mega.rollout.sglang_engine does this for you).
#
# Measured on the 2-core CI machine (2026-11-29): 60 s, +1.0 GB in site-packages (no CUDA wheels are pulled).
# The project's transformers (5.24) is kept although sglang asks for 5.19.0: serving dense Qwen/Llama works with it.
#
# On a CUDA machine do not use this script: `pip install sglang==0.5.23` as usual.
#
# Idempotent: exits at once when sglang 0.5.23 is installed and torch is unchanged. Safe in CI: it never installs a
# torch wheel (it fails with a clear message if torch is missing or is not 2.13.x), it only adds packages.
#
# Constraints: the project's pinned versions (tools/constraints.txt, the exact set the test suite last passed with)
# apply here too; OPID_CONSTRAINTS=FILE uses another file, OPID_CONSTRAINTS=none none (tools/update_constraints.sh).
set -euo pipefail

PYTHON="${PYTHON:-python}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROJECT_CONSTRAINTS="${OPID_CONSTRAINTS:-$ROOT/tools/constraints.txt}"
pin_args=()
if [[ "$PROJECT_CONSTRAINTS" != "none" ]]; then
    if [[ ! -f "$PROJECT_CONSTRAINTS" ]]; then
        echo "install_sglang_cpu.sh: constraints file $PROJECT_CONSTRAINTS not found (OPID_CONSTRAINTS=none to install unpinned)" >&2
        exit 1
    fi
    pin_args=(-c "$PROJECT_CONSTRAINTS")
fi
SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"

torch_version="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [[ -z "$torch_version" ]]; then
    echo "install_sglang_cpu.sh: torch is not importable with $PYTHON; install torch==$TORCH_VERSION (CPU) first" >&2
    exit 1
fi
if [[ "${torch_version%%+*}" != "$TORCH_VERSION" ]]; then
    echo "install_sglang_cpu.sh: found torch $torch_version, expected $TORCH_VERSION (CPU); refusing to continue" >&2
    exit 1
fi

# Installed = the right sglang version AND its server-side requirements present (a half-finished run re-installs).
have_sglang="$("$PYTHON" - <<'PY' 2>/dev/null || true
import importlib.metadata as m
import importlib.util

missing = [p for p in ("fastapi", "uvicorn", "zmq", "xgrammar", "orjson", "pybase64", "msgspec", "outlines",
                       "partial_json_parser", "setproctitle") if importlib.util.find_spec(p) is None]
print("incomplete" if missing else m.version("sglang"))
PY
)"
if [[ "$have_sglang" == "$SGLANG_VERSION" ]]; then
    echo "install_sglang_cpu.sh: sglang $SGLANG_VERSION already installed (torch $torch_version); nothing to do"
    exit 0
fi

workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT

# Constraints: torch fixed, and the project's core packages kept at whatever the main install chose.
"$PYTHON" - "$workdir/constraints.txt" "$TORCH_VERSION" <<'PY'
import importlib.metadata as m
import sys

path, torch_version = sys.argv[1], sys.argv[2]
lines = [f"torch=={torch_version}"]
for name in ["transformers", "tokenizers", "numpy", "triton", "megatron-core", "safetensors", "accelerate",
             "huggingface-hub", "gguf", "textworld", "alfworld", "pybind11"]:
    try:
        lines.append(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError:
        pass
open(path, "w").write("\n".join(lines) + "\n")
PY

# sglang 0.5.23's Requires-Dist (linux x86-64) minus torch, torchvision, torchaudio, torchcodec, timm and the
# CUDA/kernel wheels: cuda-python, flash-attn-4, flashinfer_python, humming-kernels, kernels, nvidia-cutlass-dsl,
# nvidia-mathdx, nvshmem4py-cu13, quack-kernels, sgl-deep-ep, sgl-deep-gemm, sgl-flash-mla, sglang-kernel, tilelang,
# torch_memory_saver; and mistral_common (an optional import in sglang, only for Mistral tokenizers; every
# release asks for numpy<2.4). transformers/tokenizers are left unpinned here (sglang asks for 5.19.0/0.23.2); the
# constraints keep the project's versions.
cat > "$workdir/requirements.txt" <<'REQ'
aiohttp
anthropic>=0.20.0
apache-tvm-ffi==0.1.11
blobfile==3.0.0
build
compressed-tensors==0.18.0
datasets
deepseek-recipe==0.2.0
distro
easydict
einops
fastapi
gguf
interegular
IPython
llguidance>=1.7.6,<2.0.0
modelscope
msgspec
ninja
numba==0.65.1
numpy
nvidia-ml-py
openai==2.8.0
openai-harmony==0.0.4
orjson
outlines==0.1.11
packaging
partial_json_parser
pillow
prometheus-client>=0.20.0
psutil
py-spy
pybase64
pydantic
python-dateutil<3
python-multipart
pyzmq>=25.1.2
regex
requests
scipy
sentencepiece==0.2.1
setproctitle
smg-grpc-servicer>=0.9.0
soundfile==0.13.1
tiktoken
tml-renderers==0.1.0
tokenizers
tqdm
transformers
uvicorn>=0.51
uvloop
watchfiles
xgrammar==0.2.7
xxhash
zstandard
REQ

echo "install_sglang_cpu.sh: installing sglang's CPU-usable requirements (torch stays $torch_version)"
"$PYTHON" -m pip install --prefer-binary -c "$workdir/constraints.txt" "${pin_args[@]}" -r "$workdir/requirements.txt"
echo "install_sglang_cpu.sh: installing sglang==$SGLANG_VERSION --no-deps"
"$PYTHON" -m pip install --no-deps "sglang==$SGLANG_VERSION"

after="$("$PYTHON" -c 'import torch; print(torch.__version__)')"
if [[ "$after" != "$torch_version" ]]; then
    echo "install_sglang_cpu.sh: torch changed from $torch_version to $after; this must not happen" >&2
    exit 1
fi
echo "install_sglang_cpu.sh: done (sglang $SGLANG_VERSION, torch $after)"
