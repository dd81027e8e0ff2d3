"""The trainer's policy: Megatron model chunks + DDP + optimizer + frozen reference copy, built from an HF directory.

Used by `opid_mega.trainer` (PPO updates, scoring, weight sync), `opid_mega.sft` (the warm start) and `opid-eval`.
Every rank builds its own shard (TP x PP x DP from `cfg.parallel`).
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Optional

import torch

from opid_mega.config import Config, control_timeout


def minibatch_plan(num_samples: int, mini_batch_size: int, epochs: int, shuffle: bool, seed: int) -> list:
    """The step-sample indices of each mini-batch :meth:`Policy.train` takes, in order (one optimizer step each):
    consecutive step-samples of the data's order, or after a shuffle seeded by ``seed`` before each epoch. A function
    of the data's size, the config and the seed only, never of the data-parallel layout: the batch builder then splits
    each mini-batch over the DP ranks, so a run resumed on another world size (``--resume D deploy.nodes=N``) trains
    on the same global sample order, split over its new ranks."""
    order = list(range(num_samples))
    rng = random.Random(seed)
    plan = []
    for _ in range(epochs):
        if shuffle:
            rng.shuffle(order)
        plan.extend(order[start:start + mini_batch_size] for start in range(0, len(order), mini_batch_size))
    return plan


class Policy:
    """Megatron model chunks + DDP + optimizer + frozen reference copy, built from an HF directory."""

    def __init__(self, cfg: Config, hf_dir: str, prog: str = "opid-train"):
        from transformers import AutoConfig

        from opid_mega.megatron import parallel, weights
        from opid_mega.megatron.model import build_model, recompute_config, transformer_config
        from opid_mega.megatron.train_step import LossConfig, ReferenceWeights, build_optimizer, wrap_ddp
        from opid_mega.models import torch_dtype
        from opid_mega.plugins import loss_function

        from opid_mega.megatron.layout import check_layout, model_facts

        p = cfg.parallel
        check_layout(model_facts(hf_dir), tp=p.tp, pp=p.pp, vpp=p.vpp, sp=p.sequence_parallel, cp=p.cp,
                     world=torch.distributed.get_world_size() if torch.distributed.is_initialized()
                     else int(os.environ.get("WORLD_SIZE", "1")))
        parallel.initialize(p.tp, p.pp, p.vpp, seed=cfg.train.seed, backend=p.backend,
                            timeout_s=cfg.deploy.train_timeout_s, control_timeout_s=control_timeout(cfg),
                            gpu_ids=_train_gpus(cfg), heartbeat_timeout_s=cfg.deploy.heartbeat_timeout_s, prog=prog)
        if cfg.train.save_interval:  # the checkpoint writer's queue, made while the model builds (see the function)
            from opid_mega.megatron.checkpoint import prepare_writer

            prepare_writer()
        self.cfg, self.hf_dir = cfg, hf_dir
        self.hf_config = AutoConfig.from_pretrained(hf_dir)
        tcfg = transformer_config(self.hf_config, tp=p.tp, pp=p.pp, vpp=p.vpp, dtype=torch_dtype(cfg.model.dtype),
                                  sequence_parallel=p.sequence_parallel, **recompute_config(cfg.train.recompute))
        self.chunks = build_model(self.hf_config, tcfg, kernel_backend=cfg.scoring.kernel_backend)
        weights.load_hf_weights(self.chunks, self.hf_config, hf_dir)
        self.reference = ReferenceWeights(self.chunks) if cfg.train.use_reference and cfg.algo.kl_coef > 0 else None
        t = cfg.train
        self.ddp = wrap_ddp(self.chunks, tcfg, use_distributed_optimizer=t.distributed_optimizer,
                            overlap_grad_reduce=t.overlap_grad_reduce)
        self.optimizer = build_optimizer(self.ddp, lr=t.lr, weight_decay=t.weight_decay, clip_grad=t.grad_clip,
                                         betas=(t.adam_beta1, t.adam_beta2))
        a = cfg.algo
        self.loss_cfg = LossConfig(clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
                                   kl_coef=a.kl_coef if self.reference else 0.0, kl_kind=a.kl_kind,
                                   entropy_coef=a.entropy_coef, loss_agg=a.loss_agg,
                                   log_ratio_clamp=a.log_ratio_clamp,
                                   temperature=cfg.rollout.temperature,  # new log-probs at the sampling T
                                   distill_coef=a.distill_coef,
                                   loss_fn=loss_function(a.loss_fn))  # algo.loss_fn, imported on every rank

    @staticmethod
    def dp_map(fn, items: list) -> list:
        """fn(items) computed data-parallel: each DP rank runs fn on its strided share (dp_shard) and the results are
        all-gathered back into item order on every rank. fn maps a list to one result per item."""
        from megatron.core import parallel_state as ps

        n = ps.get_data_parallel_world_size()
        if n == 1 or len(items) < n:  # every rank needs a share (pipeline schedules run on all stages)
            return fn(items)
        mine = list(range(ps.get_data_parallel_rank(), len(items), n))
        part = [r.cpu() if torch.is_tensor(r) else r for r in fn([items[i] for i in mine])]
        shares = [None] * n
        torch.distributed.all_gather_object(shares, list(zip(mine, part)), group=ps.get_data_parallel_group())
        out = [None] * len(items)
        for share in shares:
            for i, r in share:
                out[i] = r
        return out

    def logprobs(self, seqs: list, temperature: Optional[float] = None) -> list:
        """NaiveScorer's logprob_fn: [(tokens, score_from)] -> float32 log-probs of tokens[score_from:] under
        softmax(logits / temperature); None: the rollout's sampling temperature (rollout.temperature)."""
        from opid_mega.megatron.logprobs import Sample, compute_logprobs

        temp = self.cfg.rollout.temperature if temperature is None else temperature
        return self.dp_map(lambda part: compute_logprobs(self.chunks, [Sample(t, s) for t, s in part],
                                                         temperature=temp,
                                                         max_tokens=self.cfg.train.micro_batch_tokens), seqs)

    def packed_logprobs(self, mbs: list, temperature: Optional[float] = None, pairs: Optional[list] = None,
                        topk: int = 0) -> list:
        """ForkScorer's packed_logprob_fn: fork-layout micro-batches -> one float32 tensor per micro-batch; with
        `pairs` (per micro-batch (skill positions, original positions) among its gathered rows) one dict per
        micro-batch instead: {"logprobs": [M], and the divergences of the pairs (dual_context_divergence's keys)}."""
        from opid_mega.megatron.logprobs import PackedBatch, compute_logprobs

        batches = [PackedBatch.from_micro_batch(mb) for mb in mbs]
        temp = self.cfg.rollout.temperature if temperature is None else temperature
        if pairs is None:
            return self.dp_map(lambda part: compute_logprobs(self.chunks, [], batches=part, temperature=temp),
                               batches)
        if len(pairs) != len(batches):
            raise ValueError(f"packed_logprobs: {len(pairs)} pair lists for {len(batches)} micro-batches")
        for b, (s, o) in zip(batches, pairs):
            b.pairs = torch.stack([torch.as_tensor(s, dtype=torch.long), torch.as_tensor(o, dtype=torch.long)])

        def run(part):
            lps, divs = compute_logprobs(self.chunks, [], batches=part, temperature=temp, topk=topk)
            return [{"logprobs": lp, **d} for lp, d in zip(lps, divs)]

        return self.dp_map(run, batches)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next optimizer steps, on every parameter group (what megatron's own
        OptimizerParamScheduler does; `opid_mega.algo.schedule.learning_rate` gives the value per iteration)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def reference_weights(self):
        """A context in which the model holds the frozen reference weights (the training weights come back after)."""
        return self.reference.swapped_in(self.chunks)

    def train(self, data, seed: int) -> dict:
        """train.ppo_epochs epochs over the step-samples of ``data`` (`TrainData`) in mini-batches of
        train.mini_batch_size step-samples (one optimizer step each): consecutive step-samples in the order of
        ``data`` (rollout order, or with train.balance_ranks the reference's token-balanced order, made by the
        trainer), or (train.shuffle_minibatches) after a shuffle seeded by ``seed`` before each epoch. Each mini-batch is packed by the
        C++ batch builder into micro-batches of train.micro_batch_tokens tokens balanced over the data-parallel ranks;
        every rank trains on its share and Megatron's DDP reduces the gradients. algo.loss_agg=token-mean-micro with
        train.micro_batch_size > 0: the loss is aggregated over the reference's micro-batches (that many consecutive
        step-samples of the mini-batch each; opid_mega.algo.reference_micro_weights), whatever the packing."""
        from megatron.core import parallel_state as ps

        from opid_mega.megatron.train_step import loss_micro_batches, train_mini_batch

        t = self.cfg.train
        sums: dict = {}
        first_kl = None
        n = 0
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        micro = t.micro_batch_size if self.cfg.algo.loss_agg == "token-mean-micro" else 0
        for idx in minibatch_plan(data.num_samples, t.mini_batch_size, t.ppo_epochs, t.shuffle_minibatches, seed):
            batches = loss_micro_batches(data.subset(idx), t.micro_batch_tokens, dp, rank, micro)
            m = train_mini_batch(self.ddp, self.optimizer, batches, self.loss_cfg)
            if first_kl is None:
                first_kl = m.get("approx_kl", float("nan"))
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
            n += 1
        out = {k: v / max(n, 1) for k, v in sums.items()}
        out["approx_kl_first"] = first_kl
        out["mini_batches"] = n
        return out

    def export(self):
        from opid_mega.megatron.weights import export_hf_weights

        for bucket in export_hf_weights(self.chunks, self.hf_config):
            yield from bucket

    def save(self, ckpt_dir: str, step: int, state: dict, meta: Optional[dict] = None) -> None:
        """Checkpoint ``step``: the trainer's ``state`` (JSON) and ``meta`` (strings, e.g. the config digest) go into
        the checkpoint's ``extra``."""
        from opid_mega.megatron import checkpoint

        checkpoint.save(ckpt_dir, step, self.chunks, self.optimizer,
                        extra={**(meta or {}), "trainer_state": json.dumps(state)},
                        keep=self.cfg.train.keep_checkpoints)

    def load(self, ckpt_dir: str) -> tuple[int, dict]:
        from opid_mega.megatron import checkpoint

        step, extra = checkpoint.load(ckpt_dir, self.chunks, self.optimizer)
        raw = extra.get("trainer_state") if isinstance(extra, dict) else None
        return step, json.loads(raw) if raw else {}

    def save_hf(self, out_dir: str) -> None:
        """The current weights as an HF directory (config + tokenizer copied from the source dir)."""
        import shutil

        from safetensors.torch import save_file

        from opid_mega.megatron.weights import hf_state_dict

        sd = {k: v.contiguous() for k, v in hf_state_dict(self.chunks, self.hf_config).items()}  # collective
        if torch.distributed.get_rank() != 0:
            return
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for f in Path(self.hf_dir).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy(f, out / f.name)
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def _train_gpus(cfg):
    """This node's training GPU ids from the deploy section (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    from opid_mega.placement import node_placement

    return node_placement(cfg.deploy).train_gpus
