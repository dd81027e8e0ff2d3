"""The trainer's policy: Megatron model chunks + DDP + optimizer + frozen reference copy, built from an HF directory.

Used by `opid_mega.trainer` (PPO updates, scoring, weight sync), `opid_mega.sft` (the warm start) and `opid-eval`.
Every rank builds its own shard (TP x PP x DP from `cfg.parallel`).

The policy's view of a record (`TrainData`): PPO training micro-batches from the C++ batch builder, with no
per-sample Python on the way.

PPO training micro-batches from the C++ batch builder, with no per-sample Python on the way.

A rollout batch's training inputs are kept as flat arrays (:class:`TrainData`: every step-sample's prompt +
response tokens concatenated, and per response token the old log-probs, advantages and reference log-probs). A
mini-batch is an index array (:meth:`TrainData.subset`, vectorised gathers); its micro-batches come from
``opid_mega.batching.build_train_batches`` (``opid_mega._C`` when built, else the numpy reference): token-budget
packing balanced over the data-parallel ranks (largest first onto the least-loaded micro-batch, the same number of
micro-batches on every rank). :meth:`TrainData.micro_batches` returns this rank's share as
:class:`~opid_mega.megatron.logprobs.PackedBatch` es (``opid_mega.megatron.logprobs.plain_batches``, the packing
every plain-layout caller shares), the per-token values aligned with the gathered rows by one scatter through the
builder's ``ctx_gather_start``. A sequence longer than the budget gets a micro-batch of its own (the budget is
raised to the longest sequence).

Distillation (``algo.distill_coef`` > 0): samples may carry skill contexts (the same response after a skill-augmented
prompt). The micro-batches are then built in the fork layout (``opid_mega.batching.build_fork_batches``: a sample's
contexts share their prefix and never leave one micro-batch); the PPO values and loss mask sit on the original
context's rows only, and ``PackedBatch.pairs`` pairs every skill-context row with the original row of the same
token, for the divergence the loss back-propagates through the original context.
"""
from __future__ import annotations

import itertools
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from opid_mega.batching.layout import csr_offsets, csr_ranges
from opid_mega.config import Config, control_timeout
from opid_mega.megatron.logprobs import VALUE_KEYS as LOGPROB_VALUE_KEYS
from opid_mega.megatron.logprobs import PackedBatch, empty_batch, plain_batches, rank_batches


# ---- the policy's view of a record ------------------------------------------------------------------------------
# the values TrainData carries (logprobs.VALUE_KEYS but loss_mask, which the layout decides)
VALUE_KEYS = tuple(k for k in LOGPROB_VALUE_KEYS if k != "loss_mask")


@dataclass
class TrainData:
    """Training inputs of step-samples as flat arrays (sample order).

    tokens int32 [T]: prompt + response of every sample; seq_offsets int64 [S+1]; resp_lens int64 [S] (the last
    resp_lens[s] tokens of sequence s are its response, the scored tokens); values: float32 [sum resp_lens] arrays
    keyed by "old_logprobs", "advantages" (both required) and "ref_logprobs" (optional)."""

    tokens: np.ndarray
    seq_offsets: np.ndarray
    resp_lens: np.ndarray
    values: dict = field(default_factory=dict)
    # optional skill contexts, as the record keeps them (opid_mega.experience): sample s owns skill contexts
    # skill_offsets[s]:skill_offsets[s+1]; skill context e inserts section e
    # (section_tokens[section_offsets[e]:section_offsets[e+1]]) into the sample's prompt before token insert_at[e],
    # then loses its first drop[e] tokens (optional, default 0: algo.truncate_skill_context)
    skill_offsets: Optional[np.ndarray] = None
    insert_at: Optional[np.ndarray] = None
    section_offsets: Optional[np.ndarray] = None
    section_tokens: Optional[np.ndarray] = None
    drop: Optional[np.ndarray] = None

    def __post_init__(self):
        self.tokens = np.ascontiguousarray(self.tokens, np.int32)
        self.seq_offsets = np.ascontiguousarray(self.seq_offsets, np.int64)
        self.resp_lens = np.ascontiguousarray(self.resp_lens, np.int64)
        n = self.num_samples
        self._check_skills()
        if self.seq_offsets.ndim != 1 or self.seq_offsets.size < 1 or self.seq_offsets[0] != 0 \
                or self.seq_offsets[-1] != self.tokens.size or np.any(np.diff(self.seq_offsets) < 0):
            raise ValueError(f"seq_offsets must rise from 0 to the {self.tokens.size} tokens")
        if self.resp_lens.shape != (n,):
            raise ValueError(f"resp_lens has shape {self.resp_lens.shape}, expected ({n},)")
        seq_lens = np.diff(self.seq_offsets)
        bad = np.flatnonzero((self.resp_lens < 0) | (self.resp_lens >= np.maximum(seq_lens, 1)))
        if bad.size:
            s = int(bad[0])
            raise ValueError(f"sample {s}: resp_len {int(self.resp_lens[s])} must be in [0, {int(seq_lens[s])}) "
                             "(at least one prompt token)")
        total = int(self.resp_lens.sum())
        for k in ("old_logprobs", "advantages"):
            if k not in self.values:
                raise ValueError(f"TrainData needs {k!r}")
        for k, v in list(self.values.items()):
            if k not in VALUE_KEYS:
                raise ValueError(f"unknown value {k!r}; allowed: {', '.join(VALUE_KEYS)}")
            if v is None:
                del self.values[k]
                continue
            v = self.values[k] = np.ascontiguousarray(v.numpy() if torch.is_tensor(v) else v, np.float32)
            if v.shape != (total,):
                raise ValueError(f"{k} has shape {v.shape}, expected ({total},) (one value per response token)")

    def _check_skills(self) -> None:
        given = [x is not None for x in (self.skill_offsets, self.insert_at, self.section_offsets,
                                         self.section_tokens)]
        if not any(given):
            if self.drop is not None:
                raise ValueError("drop is given without skill contexts")
            return
        if not all(given):
            raise ValueError("skill contexts need skill_offsets, insert_at, section_offsets and section_tokens "
                             "together")
        self.skill_offsets, self.insert_at, self.section_offsets = (
            np.ascontiguousarray(x, np.int64) for x in (self.skill_offsets, self.insert_at, self.section_offsets))
        self.section_tokens = np.ascontiguousarray(self.section_tokens, np.int32)
        self.drop = (np.zeros(self.insert_at.size, np.int64) if self.drop is None
                     else np.ascontiguousarray(self.drop, np.int64))
        self.contexts()  # every error of the columns, named, at construction

    def contexts(self):
        """Every sample's original context then its skill contexts (`opid_mega.batching.layout.skill_contexts`)."""
        from opid_mega.batching.layout import skill_contexts

        return skill_contexts(self.tokens, self.seq_offsets, np.diff(self.seq_offsets) - self.resp_lens,
                              self.skill_offsets, self.insert_at, self.section_offsets, self.section_tokens,
                              self.drop)

    @property
    def has_skills(self) -> bool:
        return self.skill_offsets is not None and int(self.skill_offsets[-1]) > 0

    @classmethod
    def from_sequences(cls, seqs: Sequence[Sequence[int]], resp_lens: Sequence[int],
                       skills: Optional[Sequence[dict]] = None, **values) -> "TrainData":
        """From token lists (prompt + response each) and response lengths; values flat over responses.
        ``skills[s]``: sample s's skill contexts as {kind: (insert_at, section token list)}, in sorted kind order."""
        lens = np.fromiter(map(len, seqs), np.int64, count=len(seqs))
        tokens = _int32_tokens(seqs, lens)
        cols = {}
        if skills is not None:
            if len(skills) != len(seqs):
                raise ValueError(f"skills has {len(skills)} entries for {len(seqs)} samples")
            sections = [sec for per in skills for _, sec in (per[k] for k in sorted(per))]
            slens = np.fromiter(map(len, sections), np.int64, count=len(sections))
            cols = dict(skill_offsets=csr_offsets(np.fromiter(map(len, skills), np.int64, count=len(skills))),
                        insert_at=np.array([per[k][0] for per in skills for k in sorted(per)], np.int64),
                        section_offsets=csr_offsets(slens), section_tokens=_int32_tokens(sections, slens))
        return cls(tokens, csr_offsets(lens), np.asarray(resp_lens, np.int64), values, **cols)

    @property
    def num_samples(self) -> int:
        return int(self.seq_offsets.size - 1)

    def subset(self, idx) -> "TrainData":
        """The samples ``idx`` (in that order), by vectorised gathers."""
        idx = np.asarray(idx, np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise IndexError(f"sample indices must lie in [0, {self.num_samples})")
        seq_lens = np.diff(self.seq_offsets)[idx]
        tok = csr_ranges(self.seq_offsets[idx], seq_lens)
        val = csr_ranges(csr_offsets(self.resp_lens)[idx], self.resp_lens[idx])
        skills = {}
        if self.skill_offsets is not None:
            per = np.diff(self.skill_offsets)[idx]
            ctx = csr_ranges(self.skill_offsets[idx], per)
            slens = np.diff(self.section_offsets)[ctx]
            skills = dict(skill_offsets=csr_offsets(per), insert_at=self.insert_at[ctx], section_offsets=csr_offsets(slens),
                          section_tokens=self.section_tokens[csr_ranges(self.section_offsets[ctx], slens)],
                          drop=self.drop[ctx])
        return TrainData(self.tokens[tok], csr_offsets(seq_lens), self.resp_lens[idx],
                         {k: v[val] for k, v in self.values.items()}, **skills)

    def micro_batches(self, budget: int, num_ranks: int = 1, rank: int = 0,
                      backend: Optional[str] = None) -> list[PackedBatch]:
        """This rank's micro-batches of at most ``budget`` tokens (or the longest sequence), balanced over
        ``num_ranks`` ranks; every rank gets the same number (an empty one is :func:`empty_batch`)."""
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} is not in [0, {num_ranks})")
        if self.num_samples == 0:
            return [empty_batch()]
        if self.has_skills:
            return self._fork_micro_batches(budget, num_ranks, rank, backend)
        return plain_batches((self.tokens, self.seq_offsets, self.resp_lens), budget, num_ranks, rank,
                             values=self.values, backend=backend).batches

    def _fork_micro_batches(self, budget: int, num_ranks: int, rank: int, backend: Optional[str]) -> list[PackedBatch]:
        """Fork-layout micro-batches: per sample its original context, then its skill contexts (module docstring)."""
        from opid_mega.batching import build_fork_batches

        ctx = self.contexts()
        sample_offsets = ctx.sample_offsets
        is_orig = np.zeros(ctx.num_contexts, bool)
        is_orig[sample_offsets[:-1]] = True
        owner = np.repeat(np.arange(self.num_samples), np.diff(sample_offsets))
        orig_ctx = sample_offsets[:-1]
        lens = np.diff(ctx.ctx_offsets)
        need = int(np.add.reduceat(lens, sample_offsets[:-1]).max())  # a sample never leaves its micro-batch
        pb = build_fork_batches(ctx, max(int(budget), need), num_ranks, backend=backend)
        f = pb.flat
        pos = csr_ranges(f["ctx_gather_start"][orig_ctx], self.resp_lens)  # the original contexts' gathered rows
        m_total = int(f["gather_rows"].size)
        gathered = {}
        for k, v in list(self.values.items()) + [("loss_mask", np.ones(int(self.resp_lens.sum()), np.float32))]:
            g = np.zeros(m_total, np.float32)
            g[pos] = v
            gathered[k] = torch.from_numpy(g)
        pairs = np.stack([np.flatnonzero(~is_orig), sample_offsets[:-1][owner[~is_orig]]], axis=1)
        per_mb_pairs, _ = pb.pair_positions(pairs)
        return rank_batches(pb, rank, gathered, ctx.resp_lens, per_mb_pairs)


def _int32_tokens(seqs, lens: np.ndarray) -> np.ndarray:
    tokens = np.fromiter(itertools.chain.from_iterable(seqs), np.int64, count=int(lens.sum()))
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must lie in [0, 2^31)")
    return tokens.astype(np.int32)


# ---- the policy --------------------------------------------------------------------------------------------------
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
