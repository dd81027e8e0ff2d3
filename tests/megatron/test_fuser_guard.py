"""megatron-core's torch.compile jit_fuser is its own no-op in our processes (opid_mega.megatron.fuser_guard): importing
megatron-core through opid_mega.megatron imports neither dynamo's compiler nor inductor, and the fusions it would
compile are off in our models anyway; OPID_MEGATRON_JIT_FUSER=1, or a megatron-core imported first, keeps its default.
Three fresh interpreters in all (module fixture `runs`), each reporting the fuser in effect and a model's numbers."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")

# after the given imports: the fuser in effect, whether inductor came in, then a tiny model's forward + backward
REPORT = """
import sys, torch
import megatron.core.jit as jit
from megatron.core.transformer.transformer_config import TransformerConfig  # decorates the fused helpers
print(jit.jit_fuser is jit.noop_decorator, jit.jit_fuser is torch.compile, "torch._inductor.compile_fx" in sys.modules)
from opid_mega.megatron import attention, parallel
from opid_mega.megatron.model import build_model, transformer_config
parallel.initialize(1, 1)
arch = dict(hidden=32, ffn=64, layers=2, heads=4, kv_heads=2, head_dim=8, vocab=128, eps=1e-6,
            rope_theta=10000.0, qkv_bias=False, qk_norm=True, tied=True, max_pos=64)
torch.manual_seed(0)
model = build_model(arch, transformer_config(arch))[0]
ids = torch.randint(0, 128, (1, 12))
out = model(ids, torch.arange(12)[None], None, packed_seq_params=attention.packed_seq_params(torch.tensor([0, 5, 12])),
            score_rows=torch.arange(11), score_targets=ids[0, 1:])
out.sum().backward()
grads = sum(p.grad.double().abs().sum() for p in model.parameters() if p.grad is not None)
print(repr(out.double().sum().item()), repr(grads.item()))
parallel.destroy_all()
"""
CASES = {  # name: (imports before the report, extra environment)
    "guarded": ("import opid_mega.megatron.model\n", {}),
    "asked_for": ("import opid_mega.megatron\n", {"OPID_MEGATRON_JIT_FUSER": "1"}),
    # a Megatron script that imported megatron-core before plugging OPID in keeps its fuser
    "megatron_first": ("import megatron.core\nimport opid_mega.megatron.model\n", {}),
}


@pytest.fixture(scope="module")
def runs() -> dict:
    """{case: ((fuser is the no-op, fuser is torch.compile, inductor imported), (output sum, gradient sum))}"""
    out = {}
    for name, (prelude, env) in CASES.items():
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(prelude) + REPORT], capture_output=True, text=True,
                           timeout=300, env={**{k: v for k, v in os.environ.items() if k != "OPID_MEGATRON_JIT_FUSER"},
                                             "PYTHONWARNINGS": "ignore", **env})
        assert r.returncode == 0, (name, r.stderr[-3000:])
        lines = r.stdout.strip().splitlines()
        out[name] = (tuple(x == "True" for x in lines[-2].split()), tuple(lines[-1].split()))
    return out


def test_through_opid_mega_megatron_the_fuser_is_megatron_cores_noop(runs):
    assert runs["guarded"][0] == (True, False, False)


def test_asked_for_or_megatron_imported_first_the_default_stays(runs):
    assert runs["asked_for"][0] == (False, True, True)
    assert runs["megatron_first"][0] == (False, True, True)


def test_the_model_is_the_same_with_and_without_the_guard(runs):
    """The fused helpers the guard leaves uncompiled are never called by our model: its forward and backward give the
    same numbers bit for bit either way."""
    assert runs["guarded"][1] == runs["asked_for"][1] == runs["megatron_first"][1]
    assert all(float(x) != 0.0 for x in runs["guarded"][1])
