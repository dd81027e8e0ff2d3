"""Multi-rank worker for the Megatron tests: `python _worker.py SPEC.json` spawns WORLD gloo ranks that run every
requested layout in turn (re-initialising model parallelism) and write results for the pytest process to compare."""
import json
import os
import sys
import time

import torch


def _samples(spec, with_train=False, lps=None):
    """The spec's sequences as Samples; for training with deterministic synthetic old/ref log-probs and
    advantages derived from ``lps`` (per-sequence base log-probs)."""
    from opid_mega.megatron.logprobs import Sample

    out = []
    for i, (toks, k) in enumerate(spec["sequences"]):
        n = len(toks) - k
        if not with_train:
            out.append(Sample(toks, k))
            continue
        g = torch.Generator().manual_seed(100 + i)
        adv = (torch.randn(n, generator=g)).tolist()
        old = (lps[i] + 0.05 * torch.randn(n, generator=g)).tolist()
        ref = (lps[i] - 0.05 * torch.randn(n, generator=g)).tolist()
        out.append(Sample(toks, k, old_logprobs=old, advantages=adv, ref_logprobs=ref))
    return out


def _gather_rank0(items, n_total):
    """Each DP rank holds results for indices r::dp (valid on its last PP stage); collect them on rank 0."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mine = {}
    if ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage():
        r, d = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        mine = dict(zip(range(r, n_total, d), items))
    allv = [None] * dist.get_world_size()
    dist.all_gather_object(allv, mine)
    merged = {}
    for m in allv:
        merged.update(m)
    return [merged[i] for i in range(n_total)]


def _check_megatron_version(spec) -> str:
    """The megatron-core this rank imported (the compatibility test shadows the installed one via PYTHONPATH)."""
    import megatron.core

    got = megatron.core.__version__
    want = spec.get("expect_megatron_core")
    if want and got != want:
        raise RuntimeError(f"rank imported megatron-core {got} from {megatron.core.__file__}, expected {want}")
    return got


def run_rank(spec):
    import faulthandler

    faulthandler.dump_traceback_later(max(10, spec.get("timeout_s", 600) - 20), exit=True)
    import torch.distributed as dist

    from opid_mega.megatron import parallel
    from opid_mega.megatron.train_step import LossConfig

    results = {"megatron_core_version": _check_megatron_version(spec)}
    t0 = time.monotonic()
    loss_cfg = LossConfig(**spec["loss"])
    for tp, pp, vpp in spec["layouts"]:
        tag = f"tp{tp}pp{pp}vpp{vpp or 1}"
        parallel.initialize(tp, pp, vpp)
        for model in spec["models"]:
            results.setdefault(model["arch"], {})[tag] = _run_model(dict(spec, **model), tp, pp, vpp, tag, loss_cfg)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"[worker] {tag} done at {time.monotonic() - t0:.1f}s", flush=True)
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(spec["out"], "results.pt"))
    parallel.destroy()


def _run_model(spec, tp, pp, vpp, tag, loss_cfg):
    from transformers import AutoConfig

    from opid_mega.megatron import checkpoint, weights
    from opid_mega.megatron.logprobs import compute_logprobs, plain_batches
    from opid_mega.megatron.model import build_model, transformer_config
    from opid_mega.megatron.train_step import (ReferenceWeights, build_optimizer, dp_shard, train_mini_batch,
                                               wrap_ddp)

    out_dir = spec["out"]
    seqs = spec["sequences"]
    hf_cfg = AutoConfig.from_pretrained(spec["model"])
    tcfg = transformer_config(hf_cfg, tp=tp, pp=pp, vpp=vpp)
    chunks = build_model(hf_cfg, tcfg)
    weights.load_hf_weights(chunks, hf_cfg, spec["model"])
    # 1. log-probs + entropy (each DP rank scores its share)
    all_samples = _samples(spec)
    lp, ent = compute_logprobs(chunks, dp_shard(all_samples), max_tokens=spec["micro_tokens"],
                               return_entropy=True)
    res = {"logprobs": _gather_rank0(lp, len(seqs)), "entropy": _gather_rank0(ent, len(seqs))}
    # 2. round trip HF -> Megatron -> HF
    res["export"] = weights.hf_state_dict(chunks, hf_cfg)
    # 3. training steps (reference log-probs from the swapped-in CPU reference copy = current weights)
    if spec.get("train"):
        ref = ReferenceWeights(chunks)
        ddp = wrap_ddp(chunks, tcfg)
        opt = build_optimizer(ddp, lr=spec["lr"], clip_grad=1.0)
        base = [torch.tensor(x) for x in spec["base_logprobs"]]  # identical inputs for every layout
        train_samples = _samples(spec, True, base)
        with ref.swapped_in(chunks):
            ref_lp = _gather_rank0(compute_logprobs(chunks, dp_shard(train_samples),
                                                    max_tokens=spec["micro_tokens"]), len(seqs))
        res["ref_logprobs"] = ref_lp
        resume = spec.get("resume") and tag in spec.get("resume_layouts", [])
        steps = spec.get("steps", 1) if resume else 1
        ckpt_dir = os.path.join(out_dir, f"ckpt_{spec['arch']}_{tag}")
        res["metrics"] = []
        for step in range(1, steps + 1):
            res["metrics"].append(train_mini_batch(ddp, opt, plain_batches(dp_shard(train_samples),
                                                                           spec["micro_tokens"]).batches, loss_cfg))
            if step == 1:
                res["after_step1"] = weights.hf_state_dict(chunks, hf_cfg)
            if resume and step == spec["resume"]:
                checkpoint.save(ckpt_dir, step, ddp, opt)
        if resume:
            res["final"] = weights.hf_state_dict(chunks, hf_cfg)
            # a fresh model + optimizer (from the ORIGINAL HF weights) resumed from the checkpoint
            chunks2 = build_model(hf_cfg, tcfg)
            weights.load_hf_weights(chunks2, hf_cfg, spec["model"])
            ddp2 = wrap_ddp(chunks2, tcfg)
            opt2 = build_optimizer(ddp2, lr=spec["lr"], clip_grad=1.0)
            step0, _ = checkpoint.load(ckpt_dir, ddp2, opt2)
            res["resumed_metrics"] = []
            for step in range(step0 + 1, steps + 1):
                res["resumed_metrics"].append(train_mini_batch(
                    ddp2, opt2, plain_batches(dp_shard(train_samples), spec["micro_tokens"]).batches, loss_cfg))
            res["resumed_final"] = weights.hf_state_dict(chunks2, hf_cfg)
    return res


def run_killed(spec):
    """mode "kill": train, checkpoint after every step, SIGKILL rank 0 right after the checkpoint of step
    ``kill_after``. mode "resume": a new process tree resumes from the latest checkpoint and finishes the run."""
    import faulthandler
    import signal

    import torch.distributed as dist
    from transformers import AutoConfig

    from opid_mega.megatron import checkpoint, parallel, weights
    from opid_mega.megatron.logprobs import plain_batches
    from opid_mega.megatron.model import build_model, transformer_config
    from opid_mega.megatron.train_step import LossConfig, build_optimizer, dp_shard, train_mini_batch, wrap_ddp

    faulthandler.dump_traceback_later(max(10, spec.get("timeout_s", 600) - 20), exit=True)
    (tp, pp, vpp), m = spec["layouts"][0], dict(spec, **spec["models"][0])
    parallel.initialize(tp, pp, vpp)
    hf_cfg = AutoConfig.from_pretrained(m["model"])
    tcfg = transformer_config(hf_cfg, tp=tp, pp=pp, vpp=vpp)
    chunks = build_model(hf_cfg, tcfg)
    weights.load_hf_weights(chunks, hf_cfg, m["model"])
    ddp = wrap_ddp(chunks, tcfg)
    opt = build_optimizer(ddp, lr=spec["lr"], clip_grad=1.0)
    samples = dp_shard(_samples(m, True, [torch.tensor(x) for x in m["base_logprobs"]]))
    ckpt_dir = os.path.join(spec["out"], "ckpt_killed")
    step = 0
    if spec["mode"] == "resume":
        step, _ = checkpoint.load(ckpt_dir, ddp, opt)
    while step < spec["steps"]:
        train_mini_batch(ddp, opt, plain_batches(samples, spec["micro_tokens"]).batches, LossConfig(**spec["loss"]))
        step += 1
        checkpoint.save(ckpt_dir, step, ddp, opt)
        if spec["mode"] == "kill" and step == spec["kill_after"] and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    final = weights.hf_state_dict(chunks, hf_cfg)
    if dist.get_rank() == 0:
        torch.save({"resumed_from": spec["kill_after"], "final": final}, os.path.join(spec["out"], "killed.pt"))
    parallel.destroy()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from opid_mega.megatron.parallel import spawn

    fn = run_killed if spec.get("mode") in ("kill", "resume") else run_rank
    spawn(spec["world"], fn, spec, timeout_s=spec.get("timeout_s", 600))
