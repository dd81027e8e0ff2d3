"""4-rank gloo worker (TP2 x DP2) for sequence parallel and the distributed optimizer: `python _sp_distopt_worker.py
SPEC.json`. Writes results.pt (rank 0) for test_megatron_sp_distopt.py to compare:

- sp[arch][False|True]: log-probs + entropy of packed micro-batches, every rank's local gradients (main_grad after
  finalize_model_grads) of one OPID/PPO mini-batch, the same with the distillation loss on fork-layout micro-batches
  with skill contexts (the divergence head's hidden-state gradient under SP), and the weights after one optimizer
  step, without / with SP;
- opt[name]: the weights after 2 optimizer steps (plain | distributed optimizer | + overlap_grad_reduce | + SP) and
  the step metrics; "resumed": the distributed optimizer resumed from its checkpoint after step 1, then step 2.
"""
import json
import os
import sys
import time
from functools import partial

import torch


def _train_samples(seqs, lps):
    from opid_mega.megatron.logprobs import Sample

    out = []
    for i, (toks, k) in enumerate(seqs):
        n = len(toks) - k
        g = torch.Generator().manual_seed(100 + i)
        out.append(Sample(toks, k, advantages=torch.randn(n, generator=g).tolist(),
                          old_logprobs=(lps[i] + 0.05 * torch.randn(n, generator=g)).tolist(),
                          ref_logprobs=(lps[i] - 0.05 * torch.randn(n, generator=g)).tolist()))
    return out


def _gather_all(items, n_total):
    """Each DP rank holds results for indices r::dp; every rank gets the merged list (from TP rank 0)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mine = {}
    if ps.get_tensor_model_parallel_rank() == 0:
        r, d = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        mine = dict(zip(range(r, n_total, d), items))
    allv = [None] * dist.get_world_size()
    dist.all_gather_object(allv, mine)
    merged = {}
    for m in allv:
        merged.update(m)
    return [merged[i] for i in range(n_total)]


def _per_rank(obj):
    import torch.distributed as dist

    allv = [None] * dist.get_world_size()
    dist.all_gather_object(allv, obj)
    return allv


def _build(spec, model, sp, dist_opt=False, overlap=False, pp=1, vpp=None):
    from transformers import AutoConfig

    from opid_mega.megatron import weights
    from opid_mega.megatron.model import build_model, transformer_config
    from opid_mega.megatron.train_step import build_optimizer, wrap_ddp

    hf = AutoConfig.from_pretrained(model)
    tcfg = transformer_config(hf, tp=2, pp=pp, vpp=vpp, sequence_parallel=sp)
    chunks = build_model(hf, tcfg)
    weights.load_hf_weights(chunks, hf, model)
    ddp = wrap_ddp(chunks, tcfg, use_distributed_optimizer=dist_opt, overlap_grad_reduce=overlap,
                   bucket_size=spec["bucket_size"] if overlap else None)
    opt = build_optimizer(ddp, lr=spec["lr"], clip_grad=spec["clip_grad"])
    return hf, chunks, ddp, opt


def _grads(ddp, samples, micro_tokens, loss_cfg):
    """Local gradients (main_grad after megatron's finalize_model_grads) of one mini-batch, no optimizer step."""
    from opid_mega.megatron.logprobs import forward_step, plain_batches, run_schedule
    from opid_mega.megatron.train_step import ppo_loss_func

    for c in ddp:
        c.train()
        c.zero_grad_buffer()
    batches = plain_batches(samples, micro_tokens).batches
    step = partial(forward_step, return_entropy=True, loss_func=partial(ppo_loss_func, cfg=loss_cfg))
    run_schedule(ddp, batches, step, forward_only=False)
    return {f"{i}.{n}": p.main_grad.detach().clone() for i, c in enumerate(ddp) for n, p in c.module.named_parameters()}


def _distill_grads(ddp, seqs, lps, micro_tokens, loss_cfg):
    """Local gradients of one mini-batch with the distillation loss: fork-layout micro-batches where every sequence
    also has a skill context (3 tokens inserted after its first token, same response), this DP rank's share."""
    from dataclasses import replace

    import numpy as np
    from megatron.core import parallel_state as ps

    from opid_mega.megatron.logprobs import forward_step, run_schedule
    from opid_mega.megatron.policy import TrainData
    from opid_mega.megatron.train_step import ppo_loss_func

    samples = _train_samples(seqs, lps)
    data = TrainData.from_sequences(
        [list(t) for t, _ in seqs], [len(t) - k for t, k in seqs],
        skills=[{"step": (1, [11, 12, 13])} for _ in seqs],
        old_logprobs=np.concatenate([np.asarray(s.old_logprobs, np.float32) for s in samples]),
        advantages=np.concatenate([np.asarray(s.advantages, np.float32) for s in samples]),
        ref_logprobs=np.concatenate([np.asarray(s.ref_logprobs, np.float32) for s in samples]))
    batches = data.micro_batches(micro_tokens, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())
    assert all(b.pairs is not None for b in batches if b.score_rows.numel())
    for c in ddp:
        c.train()
        c.zero_grad_buffer()
    cfg = replace(loss_cfg, distill_coef=0.5)
    step = partial(forward_step, return_entropy=True, loss_func=partial(ppo_loss_func, cfg=cfg))
    outs = run_schedule(ddp, batches, step, forward_only=False)
    kl = sum(float(o["distill_kl"][0]) for o in outs if "distill_kl" in o)  # padding micro-batches have no pairs
    return {f"{i}.{n}": p.main_grad.detach().clone() for i, c in enumerate(ddp) for n, p in c.module.named_parameters()}, kl


def run_rank(spec):
    import faulthandler

    faulthandler.dump_traceback_later(max(10, spec["timeout_s"] - 20), exit=True)
    import torch.distributed as dist

    from opid_mega.megatron import checkpoint, parallel, weights
    from opid_mega.megatron.logprobs import compute_logprobs
    from opid_mega.megatron.logprobs import plain_batches
    from opid_mega.megatron.train_step import LossConfig, dp_shard, train_mini_batch

    t0 = time.monotonic()
    seqs, mt = spec["sequences"], spec["micro_tokens"]
    loss_cfg = LossConfig(**spec["loss"])
    from opid_mega.megatron.logprobs import Sample

    results = {"sp": {}, "opt": {}}
    base = None
    for (pp, vpp), m in [(lay, m) for lay in spec["sp_layouts"] for m in spec["models"]]:
        parallel.initialize(2, pp, vpp, backend="gloo")
        tag = f"{m['arch']}_pp{pp}vpp{vpp or 1}"
        res = results["sp"][tag] = {}
        for sp in (False, True):
            hf, chunks, ddp, opt = _build(spec, m["model"], sp, pp=pp, vpp=vpp)
            lp, ent = compute_logprobs(chunks, dp_shard([Sample(t, k) for t, k in seqs]), max_tokens=mt,
                                       return_entropy=True)
            r = res[sp] = {"logprobs": _gather_all(lp, len(seqs)), "entropy": _gather_all(ent, len(seqs))}
            if pp == 1:  # rows of the model's hidden states for an 8-token row: 8, or 8 / tp under SP
                with torch.no_grad():
                    ids = torch.tensor([seqs[0][0][:8]])
                    r["hidden_rows"] = int(chunks[0](ids, torch.arange(8)[None]).shape[0])
            r["sp_norm_weights"] = sorted(f"{i}.{n}" for i, c in enumerate(chunks) for n, p in c.named_parameters()
                                          if getattr(p, "sequence_parallel", False))
            if not sp:
                lps = r["logprobs"]
                if base is None:
                    base = (m["model"], lps)
            samples = dp_shard(_train_samples(seqs, lps))
            r["grads"] = _per_rank(_grads(ddp, samples, mt, loss_cfg))
            grads, kl = _distill_grads(ddp, seqs, lps, 2 * mt, loss_cfg)
            r["distill_grads"], r["distill_kl"] = _per_rank(grads), _per_rank(kl)
            r["metrics"] = train_mini_batch(ddp, opt, plain_batches(samples, mt).batches, loss_cfg)
            r["after_step"] = weights.hf_state_dict(chunks, hf)
        if dist.get_rank() == 0:
            print(f"[worker] sp {tag} done at {time.monotonic() - t0:.1f}s", flush=True)
    parallel.initialize(2, 1, backend="gloo")
    model, lps = base
    samples = dp_shard(_train_samples(seqs, lps))
    ckpt = os.path.join(spec["out"], "ckpt_distopt")
    for name, dist_opt, overlap, sp in spec["optimizers"]:
        hf, chunks, ddp, opt = _build(spec, model, sp, dist_opt, overlap)
        r = results["opt"][name] = {"metrics": []}
        for step in (1, 2):
            r["metrics"].append(train_mini_batch(ddp, opt, plain_batches(samples, mt).batches, loss_cfg))
            if step == 1 and name == "distopt":
                checkpoint.save(ckpt, 1, ddp, opt)
        r["final"] = weights.hf_state_dict(chunks, hf)
        if name == "distopt":  # a fresh model + distributed optimizer (original weights) resumed from step 1
            hf, chunks, ddp, opt = _build(spec, model, sp, dist_opt, overlap)
            step, _ = checkpoint.load(ckpt, ddp, opt)
            assert step == 1, step
            r2 = results["opt"]["resumed"] = {"metrics": [train_mini_batch(ddp, opt, plain_batches(samples, mt).batches, loss_cfg)]}
            r2["final"] = weights.hf_state_dict(chunks, hf)
        if dist.get_rank() == 0:
            print(f"[worker] {name} done at {time.monotonic() - t0:.1f}s", flush=True)
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(spec["out"], "results.pt"))
    parallel.destroy()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from opid_mega.megatron.parallel import spawn

    spawn(4, run_rank, spec, timeout_s=spec["timeout_s"])
