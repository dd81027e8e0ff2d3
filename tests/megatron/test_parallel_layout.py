"""Layout validation before any rank starts (opid_mega.megatron.layout): a fuzzed validator against a plain reference
predicate, the config keys it reads, and the one-line refusals of opid-logprobs and opid-train."""
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opid_mega.config import ConfigError, load_config
from opid_mega.megatron.layout import (LayoutError, check_layout, config_layout_error, layout_error, model_facts)
from opid_mega.models import _TINY_SHAPES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _reference_ok(f, tp, pp, vpp, sp, cp, world):
    """The rules written out plainly: every split must be exact."""
    return (cp == 1 and (not sp or tp > 1) and (vpp == 1 or pp >= 2)
            and f["heads"] % tp == 0 and f["kv_heads"] % tp == 0 and f["ffn"] % tp == 0 and f["vocab"] % tp == 0
            and f["layers"] % (pp * vpp) == 0 and world % (tp * pp * cp) == 0)


@settings(max_examples=400, deadline=None)
@given(heads=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 14, 16, 28, 32, 40]), kv_div=st.sampled_from([1, 2, 4, 7, 8]),
       layers=st.integers(1, 48), vocab=st.sampled_from([1000, 1024, 32000, 49152, 151936, 151643]),
       ffn=st.sampled_from([128, 256, 1536, 18944, 11008, 4864]),
       tp=st.integers(1, 16), pp=st.integers(1, 8), vpp=st.integers(1, 4), sp=st.booleans(),
       cp=st.sampled_from([1, 1, 1, 2]), world=st.integers(1, 64))
def test_validator_matches_reference_predicate(heads, kv_div, layers, vocab, ffn, tp, pp, vpp, sp, cp, world):
    kv = heads // kv_div if heads % kv_div == 0 else heads
    facts = dict(name="m", heads=heads, kv_heads=kv, layers=layers, vocab=vocab, ffn=ffn, hidden=64 * heads)
    msg = layout_error(facts, tp=tp, pp=pp, vpp=vpp, sp=sp, cp=cp, world=world)
    assert (msg is None) == _reference_ok(facts, tp, pp, vpp, sp, cp, world), (msg, tp, pp, vpp, sp, cp, world)
    if msg is not None:
        assert "\n" not in msg
        if cp != 1:
            assert msg.startswith(f"cp={cp}")
        elif heads % tp and (vpp == 1 or pp >= 2):
            assert f"tp={tp}" in msg and f"{heads} attention heads" in msg
        with pytest.raises(LayoutError):
            check_layout(facts, tp=tp, pp=pp, vpp=vpp, sp=sp, cp=cp, world=world)


def test_messages_name_the_problem():
    f = model_facts(dict(_TINY_SHAPES), name="tiny-qwen3")  # 4 heads, 2 KV heads, 2 layers, vocab 151936
    assert layout_error(f, tp=3, world=3) == "tp=3 does not divide the 4 attention heads of tiny-qwen3"
    assert "2 KV heads" in layout_error(f, tp=4, world=4)
    assert "2 layers" in layout_error(f, pp=4, world=4)
    assert "pp*vpp = 2*2" in layout_error(f, pp=2, vpp=2, world=2)
    assert layout_error(f, tp=1, sp=True) == "sequence parallel needs tp > 1 (got tp=1)"
    assert layout_error(f, cp=2).startswith("cp=2: context parallelism is not supported")
    assert layout_error(f, tp=2, world=3).startswith("world size 3 is not divisible by tp*pp*cp")
    assert layout_error(f, tp=2, pp=2, sp=True, world=8) is None
    assert layout_error(None, tp=2, world=2) is None
    assert "vocabulary size 151643" in layout_error(dict(f, vocab=151643), tp=2)


def test_model_facts_from_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(_TINY_SHAPES, model_type="qwen3")))
    f = model_facts(str(tmp_path))
    assert (f["heads"], f["kv_heads"], f["layers"], f["vocab"], f["name"]) == (4, 2, 2, 151936, tmp_path.name)
    with pytest.raises(LayoutError, match="no config.json"):
        model_facts(str(tmp_path / "missing"))


def test_config_keys_and_validation():
    cfg = load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.distributed_optimizer=true",
                             "train.overlap_grad_reduce=true", "parallel.backend=gloo"])
    assert cfg.parallel.sequence_parallel and cfg.parallel.cp == 1 and cfg.parallel.backend == "gloo"
    assert cfg.train.distributed_optimizer and cfg.train.overlap_grad_reduce
    d = load_config(None)
    assert not d.train.distributed_optimizer and not d.train.overlap_grad_reduce and d.parallel.backend == "auto"
    with pytest.raises(ConfigError, match=r"parallel\.cp: got 2, allowed: 1"):
        load_config(None, ["parallel.cp=2"])
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel: got true with parallel\.tp=1"):
        load_config(None, ["parallel.sequence_parallel=true"])
    assert config_layout_error(load_config(None, ["parallel.tp=2"]), world=2) is None
    assert config_layout_error(load_config(None, ["parallel.tp=3"]), world=3) == \
        "tp=3 does not divide the 4 attention heads of tiny-qwen3"


def test_backend_choice():
    import torch

    from opid_mega.megatron.parallel import resolve_backend

    gpu = torch.cuda.is_available()
    assert resolve_backend("auto") == ("nccl" if gpu else "gloo") and resolve_backend("gloo") == "gloo"
    with pytest.raises(ValueError, match="allowed: auto, nccl, gloo"):
        resolve_backend("mpi")
    if not gpu:
        with pytest.raises(ValueError, match="parallel.backend=nccl needs a GPU"):
            resolve_backend("nccl")
        assert config_layout_error(load_config(None, ["parallel.backend=nccl"]), world=1) == \
            "parallel.backend=nccl needs a GPU and this machine has none (use auto or gloo)"


def _one_line_refusal(proc, prog, *needles):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for n in needles:
        assert n in lines[0], lines[0]


def test_logprobs_cli_refuses_tp3_on_a_4_head_model_in_one_line(tmp_path):
    model = tmp_path / "tiny-qwen3"  # the built-in tiny-qwen3's config (4 heads); no weights are needed to refuse
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(_TINY_SHAPES, model_type="qwen3")))
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"tokens": [1, 2, 3], "score_from": 1}\n')
    proc = subprocess.run([sys.executable, "-m", "opid_mega.megatron.logprobs_cli", "--model", str(model),
                           "--input", str(inp), "--out", str(tmp_path / "o.jsonl"), "--tp", "3"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    _one_line_refusal(proc, "opid-logprobs", "tp=3", "4 attention heads")
    assert not (tmp_path / "o.jsonl").exists()


def test_train_cli_refuses_a_bad_layout_in_one_line(tmp_path):
    env = dict(os.environ, WORLD_SIZE="3", RANK="0", OMP_NUM_THREADS="1")  # as torchrun would start rank 0
    proc = subprocess.run([sys.executable, "-m", "opid_mega.cli", "--config", os.path.join(ROOT, "configs",
                           "tiny_cpu.yaml"), "--run-dir", str(tmp_path / "run"), "parallel.tp=3"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    _one_line_refusal(proc, "opid-train", "tp=3", "4 attention heads")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_initialize_sets_the_cuda_device_only_for_nccl(monkeypatch, backend):
    """parallel.initialize on a (pretended) 1-GPU machine as local rank 1: gloo never calls torch.cuda.set_device
    (ordinal 1 does not exist there: "invalid device ordinal"); NCCL binds the rank to its GPU. The rendezvous is
    stopped right after that decision (no process group is made)."""
    import torch
    import torch.distributed as dist

    from opid_mega.megatron import cpu_compat, parallel

    class Reached(Exception):
        pass

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(d))
    monkeypatch.setattr(cpu_compat, "apply", lambda: False)  # what it returns on a GPU machine
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def stop(*a, **k):
        raise Reached(a[0] if a else k.get("backend"))

    monkeypatch.setattr(dist, "init_process_group", stop)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(Reached, match=backend):
        parallel.initialize(1, 1, backend=backend)
    assert calls == ([] if backend == "gloo" else [1])
