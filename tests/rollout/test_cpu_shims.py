"""The CPU-serving import shims (opid_mega/rollout/cpu_shims), loaded WITHOUT putting them on this process's path."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from opid_mega.rollout.sglang_engine import CPU_SHIMS_DIR
from tolerance import assert_close_scaled


def _custom_ops():
    spec = importlib.util.spec_from_file_location("_opid_shim_custom_ops", CPU_SHIMS_DIR / "vllm" / "_custom_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference(positions, x, head_size, rot_dim, base, is_neox):
    """float64 rotary embedding written from the definition (angle = pos * base^(-2i/rot_dim))."""
    x = x.double().view(x.shape[0], -1, head_size)
    inv = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    ang = positions.double()[:, None] * inv[None, :]  # [T, rot/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    if is_neox:
        x1, x2 = rot[..., : rot_dim // 2], rot[..., rot_dim // 2:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    return torch.cat((out, rest), -1).flatten(1)


@pytest.mark.parametrize("is_neox,rot_dim", [(True, 32), (False, 32), (True, 16)])
def test_rotary_embedding_shim_matches_float64_definition(is_neox, rot_dim):
    ops = _custom_ops()
    g = torch.Generator().manual_seed(0)
    T, hq, hk, hs, base = 7, 4, 2, 32, 10000.0
    inv = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    ang = torch.arange(64, dtype=torch.float64)[:, None] * inv[None, :]
    cache = torch.cat((ang.cos(), ang.sin()), -1).float()  # vLLM/SGLang layout: [max_pos, rot_dim] = cos | sin
    positions = torch.randint(0, 64, (T,), generator=g)
    qkv = torch.randn(T, (hq + 2 * hk) * hs, generator=g)
    q, k = qkv[:, : hq * hs], qkv[:, hq * hs:(hq + hk) * hs]  # strided views into a fused qkv, like SGLang's
    q_ref = _reference(positions, q.clone(), hs, rot_dim, base, is_neox)
    k_ref = _reference(positions, k.clone(), hs, rot_dim, base, is_neox)
    v_before = qkv[:, (hq + hk) * hs:].clone()
    ops.rotary_embedding(positions, q, k, hs, cache, is_neox)  # in place
    assert_close_scaled(qkv[:, : hq * hs], q_ref, msg="q")  # fp32 vs float64: 1e-5 of the largest entry
    assert_close_scaled(qkv[:, hq * hs:(hq + hk) * hs], k_ref, msg="k")
    assert torch.equal(qkv[:, (hq + hk) * hs:], v_before)  # values untouched


def test_torchvision_stub_imports_and_fails_loudly_when_used():
    code = (
        "import torchvision, torchvision.transforms as T\n"
        "from torchvision.transforms import InterpolationMode\n"
        "from torchvision.transforms.v2 import functional as tvF\n"
        "import torchvision.transforms.functional as F\n"
        "from torchvision.ops.boxes import batched_nms\n"
        "mode = InterpolationMode.BICUBIC\n"
        "class Mine(T.Compose): pass\n"
        "try:\n"
        "    T.Resize(3)\n"
        "except RuntimeError as e:\n"
        "    print('raised:', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(CPU_SHIMS_DIR))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "raised: torchvision.transforms.Resize is unavailable" in out.stdout
