"""The real trainer, colocated (hooks forced on without CUDA), against a strict fake of SGLang 0.5.23's memory state
machine (tests/sglang_fake.py) backed by an in-process model: two iterations with a weight sync and the probe check
each, then a Ctrl-C in the third iteration's PPO update. The server must never die (SGLang's scheduler dies on a
resume of an unreleased tag, a double release, or a decode with memory released), every probe must decode on
resumed memory and match the trainer, and the interrupted run must leave the attached server holding its memory."""
import os
import sys

import pytest

import opid_mega.megatron.colocate as colocate
from opid_mega.megatron.policy import Policy
from opid_mega.rollout.local_engine import LocalEngine
from opid_mega.trainer import TrainingInterrupted, resolve_init, train

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/sglang_fake.py
from sglang_fake import ALL_TYPES, FakeSGLang, StrictSGLang  # noqa: E402


class ForcedColocation(colocate.Colocation):
    def __init__(self, cfg, policy, engine, force=True):
        super().__init__(cfg, policy, engine, force=True)


@pytest.mark.slow
def test_colocated_trainer_against_strict_sglang(tiny_cfg, tmp_path, monkeypatch):
    probe_cfg = tiny_cfg()
    strict = StrictSGLang(backend=LocalEngine(resolve_init(probe_cfg)), model_path=resolve_init(probe_cfg))
    server = FakeSGLang(routes=strict)
    cfg = tiny_cfg("rollout.engine=sglang", f"rollout.sglang_url={server.url}", "deploy.mode=colocated",
                   "deploy.release_engine_memory=true", "deploy.offload_optimizer=true", "sync.check_interval=1",
                   "train.iterations=3", "train.save_interval=0", "algo.mode=grpo")
    monkeypatch.setattr(colocate, "Colocation", ForcedColocation)
    real_train = Policy.train
    seen = {"updates": 0}

    def interrupted_train(self, *a, **kw):
        seen["updates"] += 1
        seen.setdefault("tags_in_update", []).append(set(strict.memory.offload_tags))
        if seen["updates"] == 3:
            raise KeyboardInterrupt  # Ctrl-C in the third PPO update, the server's memory released
        return real_train(self, *a, **kw)

    monkeypatch.setattr(Policy, "train", interrupted_train)
    try:
        with pytest.raises(TrainingInterrupted, match="interrupted in iteration 3"):
            train(cfg, str(tmp_path))
        assert strict.dead is None, strict.dead
        # during every PPO update the server held nothing; the interrupted run gave everything back
        assert seen["tags_in_update"] == [set(ALL_TYPES)] * 3
        assert strict.memory.offload_tags == set() and strict.memory.paused == set()
        assert strict.updates >= 2 and strict.version == "2"  # two syncs, each with its probe decoded after it
        calls = strict.memory.calls
        per_iteration = [("release", ALL_TYPES), ("resume", ["weights"]), ("resume", ["kv_cache", "cuda_graph"])]
        assert calls == per_iteration * 2 + [("release", ALL_TYPES), ("resume", ["cuda_graph", "kv_cache",
                                                                                  "weights"])], calls
        from opid_mega.metrics import read_metrics

        rows = read_metrics(tmp_path)
        assert [r["step"] for r in rows] == [1, 2]
        assert all(r["weight_sync/probe_max_abs_diff"] <= 1e-3 for r in rows), rows
        assert all(r["rollout/logprob_mismatch"] < 1e-4 for r in rows), rows
    finally:
        server.close()
