"""torchrun worker for test_weight_sync_senders: TP2 x DP2 on 4 gloo ranks, one weight sync into a recording engine
on global rank 0; every rank writes how many TP all-gathers it ran and, on rank 0, what the engine received."""
import json
import os
import sys

import torch


class Recorder:
    """An in-process engine that keeps what it is sent (update_weights, like LocalEngine's)."""

    def __init__(self):
        self.got = {}

    def update_weights(self, pairs):
        for n, t in pairs:
            self.got[n] = t.clone()


def main(model_dir, out_dir):
    from opid_mega.config import load_config
    from opid_mega.megatron import weights
    from opid_mega.megatron.policy import Policy
    from opid_mega.megatron.weight_sync import WeightSync

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_cpu.yaml"),
                      ["model.init_from=", "parallel.tp=2", "sync.check_interval=0", "sync.bucket_mb=1"])
    policy = Policy(cfg, model_dir)
    calls = {"gather": 0}
    real = weights._gather_tp

    def counting(name, param):
        calls["gather"] += 1
        return real(name, param)

    weights._gather_tp = counting
    rank = torch.distributed.get_rank()
    engine = Recorder() if rank == 0 else None
    out = WeightSync(policy, engine, cfg, out_dir)(1)
    res = {"rank": rank, "gathers": calls["gather"], "metrics": out}
    if rank == 0:
        from safetensors.torch import load_file

        ref = {}
        for f in sorted(os.listdir(model_dir)):
            if f.endswith(".safetensors"):
                ref.update(load_file(os.path.join(model_dir, f)))
        res["names_equal"] = sorted(engine.got) == sorted(ref)
        res["max_diff"] = max((engine.got[n] - ref[n]).abs().max().item() for n in ref if n in engine.got)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
