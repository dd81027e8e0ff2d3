"""OPID/PPO training step on megatron-core: DDP + optimizer, token-budget mini/micro-batches, reference swap.

The loss (``opid_mega.algo``) runs inside megatron's ``get_forward_backward_func`` (every pipeline schedule).
Every aggregation (``algo.loss_agg``) uses megatron's per-token-loss idiom: :func:`ppo_loss_func` returns ``(loss
summed over tokens with per-token weights, a count, metrics)``; DDP sums the gradients over the data-parallel ranks
and ``finalize_model_grads`` divides them by the count summed over micro-batches and ranks. token-mean (ours): weight
1, count = valid tokens, so the gradient is that of one token mean over the WHOLE mini-batch. token-mean-micro (the
reference's): weight 1 / (the micro-batch's valid tokens), count 1 per micro-batch holding one, so the gradient is
that of the mean over the mini-batch's micro-batches (all ranks) of each micro-batch's token mean.

Public integration surface for your own Megatron script: :func:`opid_mega.megatron.logprobs.forward_step`
with ``loss_func=partial(ppo_loss_func, cfg=LossConfig(...))`` -- see docs/megatron.md.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from opid_mega.algo import distill_loss, kl_penalty, ppo_policy_loss, reference_micro_weights
from opid_mega.megatron.logprobs import (PackedBatch, Sample, compute_logprobs, forward_step, run_schedule,
                                        split_output)


@dataclass
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = 3.0
    kl_coef: float = 0.01
    kl_kind: str = "low_var_kl"
    entropy_coef: float = 0.001
    # token-mean (ours: over the whole mini-batch) | token-mean-micro (the reference's: per micro-batch, then the mean
    # over micro-batches and ranks) | seq-mean-token-sum | seq-mean-token-mean (over the whole mini-batch)
    loss_agg: str = "token-mean"
    # PPO log-ratio clamp (algo.log_ratio_clamp): None = not clamped, as in the reference
    log_ratio_clamp: Optional[float] = None
    # The rollout's sampling temperature: the new log-probs (and entropy) are those of softmax(logits / T), like the
    # old and reference log-probs they are compared with (compute_logprobs(..., temperature=T)).
    temperature: float = 1.0
    # algo.distill_coef: c · KL(p_o ‖ p_s) on the paired (skill-routed) tokens of micro-batches with row pairs,
    # weighted and counted like the PPO loss's tokens, back-propagated through the original context only
    distill_coef: float = 0.0
    # The policy loss (algo.loss_fn, resolved by opid_mega.plugins.loss_function): called like ppo_policy_loss, as
    # loss_fn(logp, old_logp, advantages, weights, clip_low=, clip_high=, dual_clip=, log_ratio_clamp=,
    # normalizer=1.0) -> (Σ weights · per-token loss, metrics); docs/custom_algo.md
    loss_fn: Callable = ppo_policy_loss


def token_weights(batch: PackedBatch, mask: torch.Tensor, agg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights and the count megatron divides the mini-batch's summed loss by.

    token-mean: weight = mask, count = valid tokens. token-mean-micro: weight = mask / (the micro-batch's valid
    tokens), count = 1 (0 for a micro-batch without one). seq-mean-token-sum: weight = mask, count = sequences with
    a valid token. seq-mean-token-mean: weight = mask / (the sequence's valid tokens), count = such sequences. Summed
    over all micro-batches and DP ranks and divided by the summed counts, this is `opid_mega.algo.agg_loss` over the
    whole mini-batch (token-mean-micro: with one micro id per micro-batch).

    Given weights (``batch.extras["loss_weight"]``, token-mean-micro with train.micro_batch_size > 0: the reference's
    micro-batches of that many step-samples, whatever the packing, ``opid_mega.algo.reference_micro_weights``):
    weight = mask x that weight, count = ``batch.extras["loss_count"]`` (1 on one micro-batch of the whole
    mini-batch, else 0): the weights already hold the whole normalisation."""
    ex = getattr(batch, "extras", None) or {}
    if "loss_weight" in ex or "loss_count" in ex:  # (an empty micro-batch has the count alone)
        if agg != "token-mean-micro":
            raise ValueError(f"loss_agg={agg!r}: per-token loss weights are token-mean-micro's")
        count = ex.get("loss_count")
        w = mask * ex["loss_weight"] if "loss_weight" in ex else mask * 0
        return w, (count.sum() if count is not None else mask.sum() * 0).to(mask.dtype)
    if agg == "token-mean":
        return mask, mask.sum()
    if agg == "token-mean-micro":
        n = mask.sum()
        return mask / n.clamp(min=1), (n > 0).to(mask.dtype)
    if agg not in ("seq-mean-token-sum", "seq-mean-token-mean"):
        raise ValueError(f"loss_agg={agg!r}, allowed: token-mean, token-mean-micro, seq-mean-token-sum, "
                         "seq-mean-token-mean")
    per = torch.tensor(batch.scored_per_seq, device=mask.device)
    seq = torch.repeat_interleave(torch.arange(per.numel(), device=mask.device), per)
    cnt = torch.zeros(per.numel(), dtype=mask.dtype, device=mask.device).index_add_(0, seq, mask)
    nseq = (cnt > 0).sum().to(mask.dtype)
    if agg == "seq-mean-token-sum":
        return mask, nseq
    return mask / cnt.clamp(min=1)[seq], nseq


def ppo_loss_func(batch: PackedBatch, output: torch.Tensor, cfg: LossConfig = LossConfig()):
    """megatron loss_func: OPID/PPO loss of one packed micro-batch, summed over its scored tokens.

    ``output`` is the last stage's ``[1 or 2, n]`` (log-probs, entropy), or ``(that, divergences)`` for a batch with
    row ``pairs`` (fork-layout distillation batches). ``batch.extras`` must hold ``old_logprobs``, ``advantages``,
    ``loss_mask`` and, when ``cfg.kl_coef > 0``, ``ref_logprobs``.
    Returns (loss_sum, count, metrics) where metrics are detached [sum, count] pairs; `cfg.loss_agg` sets the
    per-token weights and the count (see :func:`token_weights`; clip fractions are then weighted alike). With
    ``cfg.distill_coef`` > 0 the loss adds ``opid_mega.algo.distill_loss`` of the pairs, each weighted by its
    original token's weight (summed here; megatron divides by the same count). The policy-gradient term is
    ``cfg.loss_fn`` (algo.loss_fn; default ``opid_mega.algo.ppo_policy_loss``) of the per-token weights with
    normalizer 1, i.e. their weighted sum; of its metrics, clipfrac, clipfrac_dual and approx_kl are reported."""
    output, div = split_output(output)
    ex = batch.extras
    for k in ("old_logprobs", "advantages", "loss_mask"):
        if k not in ex:
            raise ValueError(f"ppo_loss_func: the micro-batch has no {k!r}")
    logp, mask = output[0], ex["loss_mask"]
    w, ntok = token_weights(batch, mask, cfg.loss_agg)
    # the clip-fraction metrics' weight: the count, or (given weights, whose count sits on one micro-batch) Σ weights
    mw = w.sum().detach() if "loss_weight" in ex or "loss_count" in ex else ntok
    out = cfg.loss_fn(logp, ex["old_logprobs"], ex["advantages"], w, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                      dual_clip=cfg.dual_clip, log_ratio_clamp=cfg.log_ratio_clamp, normalizer=1.0)
    if not (isinstance(out, tuple) and len(out) == 2 and torch.is_tensor(out[0]) and out[0].dim() == 0
            and isinstance(out[1], dict)):
        raise ValueError(f"ppo_loss_func: the policy loss {cfg.loss_fn.__module__}:{cfg.loss_fn.__qualname__} "
                         f"returned {type(out).__name__}, expected (a scalar tensor, a dict of metrics)")
    pg_sum, m = out
    loss = pg_sum
    metrics = {"pg_loss": torch.stack([pg_sum.detach().clone(), ntok])}
    if cfg.kl_coef > 0:
        if "ref_logprobs" not in ex:
            raise ValueError("ppo_loss_func: kl_coef > 0 needs ref_logprobs in the micro-batch")
        kl_sum = (kl_penalty(logp, ex["ref_logprobs"], cfg.kl_kind) * w).sum()
        loss = loss + cfg.kl_coef * kl_sum
        metrics["kl"] = torch.stack([kl_sum.detach().clone(), ntok])
    if cfg.entropy_coef > 0:
        if output.shape[0] < 2:
            raise ValueError("ppo_loss_func: entropy_coef > 0 needs the entropy output (return_entropy=True)")
        ent_sum = (output[1] * w).sum()
        loss = loss - cfg.entropy_coef * ent_sum
        metrics["entropy"] = torch.stack([ent_sum.detach().clone(), ntok])
    if cfg.distill_coef > 0 and div is not None:
        w_pair = w[batch.pairs[1].to(w.device)]
        d_sum, dm = distill_loss(div, w_pair, cfg.distill_coef, normalizer=1.0)
        loss = loss + d_sum
        metrics["distill_kl"] = torch.stack([dm["distill_kl"] * w_pair.sum(), w_pair.sum()])
    for k in ("clipfrac", "clipfrac_dual", "approx_kl"):
        if k in m:  # (a custom policy loss may report none of them)
            metrics[k] = torch.stack([m[k].detach() * mw, mw])
    metrics["loss"] = torch.stack([loss.detach().clone(), ntok])
    return loss, ntok.to(torch.int), metrics


def loss_micro_batches(part, budget: int, num_ranks: int = 1, rank: int = 0,
                       micro_batch_size: int = 0) -> list[PackedBatch]:
    """This rank's packed micro-batches of one mini-batch (`TrainData` ``part``, :meth:`TrainData.micro_batches`);
    with ``micro_batch_size`` > 0 they carry the reference's loss weights (``opid_mega.algo.reference_micro_weights``)
    and the count 1 on DP rank 0's first micro-batch (0 elsewhere), so megatron's division leaves those weights as
    they are (algo.loss_agg=token-mean-micro with train.micro_batch_size)."""
    if micro_batch_size:
        part.values["loss_weight"] = reference_micro_weights(part.resp_lens, micro_batch_size)
    batches = part.micro_batches(budget, num_ranks, rank)
    if micro_batch_size:
        for i, b in enumerate(batches):
            b.extras["loss_count"] = torch.tensor([1.0 if i == 0 and rank == 0 else 0.0])
    return batches


def wrap_ddp(chunks, config, use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
             bucket_size: Optional[int] = None):
    """megatron DDP around each chunk (``train.distributed_optimizer``, ``train.overlap_grad_reduce``; gloo or NCCL).

    ``use_distributed_optimizer``: gradients are reduce-scattered into the optimizer's data-parallel shards (pair it
    with :func:`build_optimizer`, which follows the wrapper). ``overlap_grad_reduce``: each gradient bucket is reduced
    asynchronously as soon as the backward of the mini-batch's last micro-batch has filled it; the schedules get
    megatron's ``no_sync_func`` / ``grad_sync_func`` hooks for that (as Megatron-LM sets them). ``bucket_size``:
    parameters per bucket (None: megatron's default; only used with ``overlap_grad_reduce``)."""
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
                                            use_distributed_optimizer=use_distributed_optimizer,
                                            bucket_size=bucket_size)
    ddp = [DistributedDataParallel(config=config, ddp_config=ddp_cfg, module=c, disable_bucketing=i > 0)
           for i, c in enumerate(chunks)]
    one = (lambda fns: fns[0] if len(fns) == 1 else fns)  # noqa: E731 - megatron takes one function or a list
    config.no_sync_func = one([m.no_sync for m in ddp]) if overlap_grad_reduce else None
    config.grad_sync_func = one([m.start_grad_sync for m in ddp]) if overlap_grad_reduce else None
    return ddp


def build_optimizer(ddp_chunks, lr: float = 1e-6, weight_decay: float = 0.01, clip_grad: float = 1.0,
                    betas=(0.9, 0.999), eps: float = 1e-8, use_distributed_optimizer: Optional[bool] = None):
    """megatron optimizer (AdamW: decoupled weight decay) with grad clipping; hooks it into the model config.

    ``use_distributed_optimizer`` None: what the DDP wrappers were built for (:func:`wrap_ddp`); a different value is
    an error (the distributed optimizer needs the wrappers' reduce-scatter buffers)."""
    wrapped = ddp_chunks[0].ddp_config.use_distributed_optimizer
    if use_distributed_optimizer is None:
        use_distributed_optimizer = wrapped
    if bool(use_distributed_optimizer) != bool(wrapped):
        raise ValueError(f"build_optimizer: use_distributed_optimizer={use_distributed_optimizer} but the DDP wrappers "
                         f"were built with use_distributed_optimizer={wrapped} (wrap_ddp)")
    cfg = ddp_chunks[0].config
    opt_cfg = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                              adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=eps,
                              bf16=cfg.bf16, fp16=cfg.fp16, params_dtype=cfg.params_dtype,
                              use_distributed_optimizer=use_distributed_optimizer)
    opt = get_megatron_optimizer(opt_cfg, ddp_chunks)
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.grad_scale_func = opt.scale_loss
    return opt


def _reduce_metrics(outs: list[dict]) -> dict[str, float]:
    """Token-weighted means over micro-batches and data-parallel ranks."""
    keys = sorted({k for d in outs for k in d})
    if not keys:
        return {}
    acc = torch.zeros(len(keys), 2, dtype=torch.float64)
    for d in outs:
        for i, k in enumerate(keys):
            if k in d:
                acc[i] += d[k].double().cpu()
    if parallel_state.get_data_parallel_world_size() > 1:
        acc = acc.to(torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu")
        dist.all_reduce(acc, group=parallel_state.get_data_parallel_group())
    return {k: float(acc[i, 0] / acc[i, 1].clamp(min=1)) for i, k in enumerate(keys)}


def _broadcast_from_last_stage(obj):
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return obj
    group = parallel_state.get_pipeline_model_parallel_group()
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_process_group_ranks(group)[-1], group=group)
    return box[0]


def train_mini_batch(ddp_chunks, optimizer, batches: list[PackedBatch], cfg: LossConfig = LossConfig()) -> dict[str, float]:
    """One optimizer step on this rank's micro-batches of a mini-batch (`PackedBatch`es carrying old_logprobs /
    advantages / ref_logprobs / loss_mask: the trainer's come from `opid_mega.megatron.policy.TrainData`,
    a list of `Sample`s gives them through `opid_mega.megatron.logprobs.plain_batches`)."""
    for c in ddp_chunks:
        c.train()
        c.zero_grad_buffer()
    optimizer.zero_grad()
    step = partial(forward_step, return_entropy=cfg.entropy_coef > 0, loss_func=partial(ppo_loss_func, cfg=cfg),
                   temperature=cfg.temperature)
    outs = run_schedule(ddp_chunks, batches, step, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    metrics = _broadcast_from_last_stage(_reduce_metrics(outs) if outs else None) or {}
    metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), update_ok=float(ok))
    return metrics


def dp_shard(items: Sequence) -> list:
    """This data-parallel rank's strided share of ``items``."""
    r, n = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    return list(items[r::n])


class ReferenceWeights:
    """The frozen reference policy as a CPU copy of this rank's parameters, swapped into the training model
    for the reference log-prob forward (no second model on the device)."""

    def __init__(self, chunks):
        self.params = [{n: p.detach().cpu().clone() for n, p in c.named_parameters()} for c in chunks]

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self, chunks):
        backup = [{n: p.detach().cpu().clone() for n, p in c.named_parameters()} for c in chunks]
        try:
            for c, ref in zip(chunks, self.params):
                for n, p in c.named_parameters():
                    p.copy_(ref[n])
            yield
        finally:
            for c, saved in zip(chunks, backup):
                for n, p in c.named_parameters():
                    p.copy_(saved[n])

    def logprobs(self, chunks, samples: Sequence[Sample], max_tokens: int = 4096, temperature: float = 1.0):
        """Reference-policy log-probs of ``samples`` (for the KL term), computed with the swapped-in weights at the
        sampling temperature."""
        with self.swapped_in(chunks):
            return compute_logprobs(chunks, samples, max_tokens=max_tokens, temperature=temperature)
