"""The CUDA branch of update_weights_from_tensor (sglang_engine.cuda_ipc_payloads), run on CPU tensors with SGLang's
real MultiprocessingSerializer: SGLang's torch reductions patch is applied before anything is serialized (a CUDA IPC
handle must name its GPU by UUID: the server runs under another CUDA_VISIBLE_DEVICES), and the request carries one
separately serialized payload per server TP rank (SGLang's ranks each deserialize their own entry), each of which
deserializes to the bucket. The patch itself is recorded, not applied: it is process-wide and breaks pickling CPU
tensors (shown at the end, in a child process)."""
import subprocess
import sys

import pytest
import torch

import opid_mega.rollout.sglang_engine as sglang_engine
from opid_mega.rollout.sglang_engine import SGLangEngine
from sglang_fake import StrictSGLang


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_one_payload_per_tp_rank_after_the_reductions_patch(fake_sglang, monkeypatch, tp_size):
    pytest.importorskip("sglang")
    from sglang.srt.utils import patch_torch
    from sglang.srt.utils.common import MultiprocessingSerializer

    order = []
    monkeypatch.setattr(patch_torch, "monkey_patch_torch_reductions", lambda: order.append("patch"))
    real = MultiprocessingSerializer.serialize

    def serialize(obj, output_str=False):
        order.append("serialize")
        return real(obj, output_str=output_str)

    monkeypatch.setattr(MultiprocessingSerializer, "serialize", staticmethod(serialize))
    monkeypatch.setattr(sglang_engine, "_on_cuda", lambda bucket: True)  # take the CUDA branch with CPU tensors
    strict = StrictSGLang(tp_size=tp_size)
    server = fake_sglang(routes=strict)
    engine = SGLangEngine(url=server.url, max_retries=1)
    assert engine.tp_size == tp_size
    g = torch.Generator().manual_seed(tp_size)
    bucket = [("model.a.weight", torch.randn(3, 5, generator=g)), ("model.b.bias", torch.randn(7, generator=g))]
    assert engine.update_weights([list(bucket)], version="1") == sum(t.numel() * 4 for _, t in bucket)
    assert order == ["patch"] + ["serialize"] * tp_size
    (body,) = strict.tensor_updates
    payloads = body["serialized_named_tensors"]
    assert len(payloads) == tp_size and len(set(payloads)) == tp_size  # serialized once per rank, not copied
    for p in payloads:
        got = MultiprocessingSerializer.deserialize(p)
        assert [n for n, _ in got] == [n for n, _ in bucket]
        for (_, a), (_, b) in zip(got, bucket):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert engine.weight_version() == "1" and strict.dead is None


def test_the_cpu_branch_is_unchanged(fake_sglang):
    strict = StrictSGLang(tp_size=2)
    engine = SGLangEngine(url=fake_sglang(routes=strict).url, max_retries=1)
    engine.update_weights([("w", torch.ones(3))], version="1")
    (body,) = strict.tensor_updates
    assert len(body["serialized_named_tensors"]) == 2  # shared-memory handles: one payload, sent to each rank


@pytest.mark.slow
def test_the_real_patch_breaks_cpu_pickling_so_it_stays_on_the_cuda_branch():
    pytest.importorskip("sglang")
    code = ("import torch\nfrom sglang.srt.utils.patch_torch import monkey_patch_torch_reductions\n"
            "from opid_mega.rollout.sglang_engine import serialize_named_tensors\n"
            "serialize_named_tensors([('w', torch.ones(2))])\nmonkey_patch_torch_reductions()\n"
            "try:\n    serialize_named_tensors([('w', torch.ones(2))])\nexcept IndexError:\n    print('IndexError')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "IndexError", out.stderr[-2000:]
