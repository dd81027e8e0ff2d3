#!/usr/bin/env python
"""OPID in a Megatron-LM-style training script: the model from OPID's ``model_provider`` (or its ``ModelBuilder``),
megatron-core DDP and optimizer, and OPID's PPO loss (with the skill term) through megatron-core's
``get_forward_backward_func``, on synthetic rollouts.

    python examples/megatron_lm_opid.py --train-iters 2                                   # 1 process: CPU/gloo or 1 GPU
    torchrun --nproc-per-node 2 examples/megatron_lm_opid.py --tensor-model-parallel-size 2
    torchrun --nproc-per-node 2 examples/megatron_lm_opid.py --pipeline-model-parallel-size 2

Model flags are Megatron-LM's (``opid_mega.megatron.megatron_lm.add_megatron_lm_args``, stored where Megatron-LM's
parser stores them); the defaults make a tiny Llama-like model. ``--model-builder`` builds it the way Megatron-LM from
core_v0.19.0 does (``OpidGPTModelConfig`` -> its ``ModelBuilder``); the default is the ``model_provider`` path of the
releases before. In a Megatron-LM checkout, the one line changed in ``pretrain_gpt.py``::

    # core_v0.16 - core_v0.18: pretrain(..., partial(model_provider, gpt_builder), ...) becomes
    from opid_mega.megatron.provider import opid_gpt_builder
    pretrain(..., partial(model_provider, opid_gpt_builder), ...)

    # core_v0.19.0 and later: model_cfg = gpt_config_from_args(args) becomes
    from opid_mega.megatron.model_builder import OpidGPTModelConfig
    model_cfg = gpt_config_from_args(args, model_config_cls=OpidGPTModelConfig)

and OPID's loss goes into the forward step (``--calculate-per-token-loss``: ``ppo_loss_func`` returns the loss summed
over tokens, the token count and metrics)::

    from opid_mega.megatron.logprobs import forward_step
    from opid_mega.megatron.train_step import LossConfig, ppo_loss_func
    partial(forward_step, return_entropy=True, loss_func=partial(ppo_loss_func, cfg=LossConfig()))

What ``pretrain()`` can host, and what it cannot: docs/megatron.md ("Megatron-LM's pretrain()").

megatron.training is not needed here (except by ``--model-builder``): :func:`get_model` below calls the provider the
way Megatron-LM's does.
"""
import argparse
import math
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    from opid_mega.megatron.megatron_lm import add_megatron_lm_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_megatron_lm_args(p)
    t = p.add_argument_group("training (Megatron-LM flags)")
    t.add_argument("--train-iters", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--load", default=None, help="start from the model weights of this megatron-core distributed "
                   "checkpoint (OPID's or a Megatron-LM --save directory; like --finetune --no-load-optim --no-load-rng)")
    t.add_argument("--model-builder", action="store_true",
                   help="build the model as Megatron-LM >= core_v0.19.0's pretrain() does: OpidGPTModelConfig and its "
                   "ModelBuilder's build_distributed_models (needs megatron.training.models; default: the "
                   "model_provider path of Megatron-LM <= core_v0.18)")
    t.add_argument("--save", default=None, help="write an OPID/megatron-core distributed checkpoint here at the end")
    o = p.add_argument_group("OPID (synthetic rollouts)")
    o.add_argument("--tasks", type=int, default=2, help="GRPO groups per step")
    o.add_argument("--group-size", type=int, default=4, help="trajectories per task")
    o.add_argument("--response-len", type=int, default=12)
    o.add_argument("--skill-len", type=int, default=8, help="tokens of the skill section put into the prompt")
    o.add_argument("--skill-lambda", type=float, default=0.1, help="λ of the skill term A = A_out + λ·Δ")
    o.add_argument("--kl-coef", type=float, default=0.01)
    o.add_argument("--entropy-coef", type=float, default=0.001)
    o.add_argument("--micro-batch-tokens", type=int, default=128, help="token budget of a packed micro-batch")
    p.set_defaults(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, group_query_attention=True,
                   num_query_groups=2, kv_channels=16, vocab_size=512, max_position_embeddings=256,
                   position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                   hidden_dropout=0.0, attention_dropout=0.0)
    return p.parse_args(argv)


def get_model(model_provider_func, wrap_with_ddp: bool = True):
    """What ``megatron.training.get_model`` does, without Megatron-LM's globals: one provider call per (virtual)
    pipeline stage with the same keyword arguments, tensor-parallel defaults on every parameter, megatron-core DDP."""
    from megatron.core import parallel_state as ps, tensor_parallel

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if ps.get_pipeline_model_parallel_world_size() > 1 and vpp is not None:
        model = [model_provider_func(pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                                     post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
                                     vp_stage=i, config=None, pg_collection=None) for i in range(vpp)]
    else:
        model = [model_provider_func(pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                                     config=None, pg_collection=None)]
    for m in model:
        for param in m.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    return wrap_ddp(model) if wrap_with_ddp else model


def wrap_ddp(model):
    """megatron-core DDP around each chunk, as Megatron-LM's ``get_model`` wraps them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    return [DistributedDataParallel(config=m.config, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
            for i, m in enumerate(model)]


def get_model_from_builder(arch: dict, tc):
    """What Megatron-LM >= core_v0.19.0's ``setup_model_and_optimizer`` does with a model config: resolve its builder
    and call ``build_distributed_models`` (one chunk per virtual stage). The config is the ``GPTModelConfig`` that
    ``gpt_config_from_args(args, model_config_cls=OpidGPTModelConfig)`` makes in ``pretrain_gpt.py``, written out here
    from the same flags. Megatron-LM's own DDP wrapping there needs CUDA streams, so the chunks are wrapped here as
    :func:`get_model` wraps them."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from opid_mega.megatron.model_builder import OpidGPTModelConfig

    cfg = OpidGPTModelConfig(transformer=tc, vocab_size=arch["vocab"], should_pad_vocab=False,
                             seq_length=arch["max_pos"], share_embeddings_and_output_weights=arch["tied"],
                             position_embedding_type="rope", rotary_base=arch["rope_theta"])
    chunks = cfg.get_builder_cls()(cfg).build_distributed_models(  # the chunks are already in the model's dtype
        ProcessGroupCollection.use_mpu_process_groups(), wrap_with_ddp=False, mixed_precision_wrapper=None)
    return wrap_ddp(chunks)


def synthetic_rollouts(args, chunks, reference, gen: torch.Generator):
    """Random tasks x trajectories, scored like OPID scores a real rollout: old log-probs of each response in its own
    context, log-probs in the context with a skill section inserted (the Δ of OPID's skill term), reference log-probs
    for the KL term; advantages A = A_out (GRPO over the group) + λ·Δ per token."""
    from opid_mega import batching
    from opid_mega.megatron.logprobs import Sample, compute_logprobs

    v, r = args.vocab_size, args.response_len
    orig, with_skill, group_ids = [], [], []
    for task in range(args.tasks):
        head = torch.randint(0, v, (int(torch.randint(6, 20, (1,), generator=gen)),), generator=gen).tolist()
        tail = torch.randint(0, v, (4,), generator=gen).tolist()  # the prompt's closing lines
        skill = torch.randint(0, v, (args.skill_len,), generator=gen).tolist()
        for _ in range(args.group_size):
            resp = torch.randint(0, v, (r,), generator=gen).tolist()
            orig.append(Sample(head + tail + resp, len(head) + len(tail)))
            with_skill.append(Sample(head + skill + tail + resp, len(head) + len(skill) + len(tail)))
            group_ids.append(task)
    old = torch.stack(compute_logprobs(chunks, orig, max_tokens=args.micro_batch_tokens))  # [N, R]
    skill_lp = torch.stack(compute_logprobs(chunks, with_skill, max_tokens=args.micro_batch_tokens))
    ref = torch.stack(reference.logprobs(chunks, orig, max_tokens=args.micro_batch_tokens))
    rewards = torch.randint(0, 2, (len(orig),), generator=gen).double().numpy()
    # the advantage maths of opid-train (the C++ batch builder): A_out by group, A = A_out + λ·Δ per token
    a_out = batching.outcome_advantage(rewards, np.asarray(group_ids, np.int64), "mean_std_norm")
    delta = skill_lp - old
    lens, routed = np.full(len(orig), r, np.int64), np.ones(len(orig), bool)
    adv = torch.from_numpy(batching.token_advantages(a_out, lens, [delta.reshape(-1).double().numpy()], [routed],
                                                     [args.skill_lambda])).view(-1, r)
    samples = [Sample(s.tokens, s.score_from, old_logprobs=old[i].tolist(), advantages=adv[i].tolist(),
                      ref_logprobs=ref[i].tolist()) for i, s in enumerate(orig)]
    return samples, float(delta.abs().mean())


def schedule_inputs(batches, model, sequence_parallel: bool):
    """Micro-batches as the schedule needs them: a multiple of pp for the interleaved schedule, one length for it
    and, under sequence parallel, a multiple of tp (opid_mega.megatron.logprobs.run_schedule does the same)."""
    from megatron.core import parallel_state as ps

    from opid_mega.megatron.logprobs import empty_batch, pad_batch

    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    if len(model) > 1 and len(batches) % pp:
        batches = batches + [empty_batch() for _ in range(pp - len(batches) % pp)]
    seq = max(int(b.input_ids.shape[1]) for b in batches)
    if sequence_parallel:
        seq = -(-seq // tp) * tp
        batches = [pad_batch(b, -(-int(b.input_ids.shape[1]) // tp) * tp) for b in batches]
    if len(model) > 1:
        batches = [pad_batch(b, seq) for b in batches]
    return batches, seq


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from opid_mega.megatron import checkpoint, parallel
    from opid_mega.megatron.layout import layout_error
    from opid_mega.megatron.logprobs import forward_step, plain_batches
    from opid_mega.megatron.megatron_lm import config_from_args
    from opid_mega.megatron.provider import make_model_provider
    from opid_mega.megatron.train_step import LossConfig, ReferenceWeights, ppo_loss_func

    try:  # the flags and the layout, checked before any process group exists: a message, not a traceback per rank
        arch, tc = config_from_args(args)
    except ValueError as e:
        print(f"megatron_lm_opid: {e}", file=sys.stderr)
        return 2
    facts = dict(name="the model", heads=arch["heads"], kv_heads=arch["kv_heads"], layers=arch["layers"],
                 vocab=arch["vocab"], ffn=arch["ffn"], hidden=arch["hidden"])
    msg = layout_error(facts, tp=tc.tensor_model_parallel_size, pp=tc.pipeline_model_parallel_size,
                       vpp=tc.virtual_pipeline_model_parallel_size, sp=tc.sequence_parallel,
                       world=int(os.environ.get("WORLD_SIZE", "1")))
    if msg:
        print(f"megatron_lm_opid: {msg}", file=sys.stderr)
        return 2
    # torch.distributed from RANK / WORLD_SIZE (torchrun), gloo without a GPU; megatron's TP/PP/DP groups
    parallel.initialize(tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size,
                        tc.virtual_pipeline_model_parallel_size, seed=args.seed)
    last_rank = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    model = get_model_from_builder(arch, tc) if args.model_builder else get_model(make_model_provider(args))
    chunks = [m.module for m in model]
    if args.load:  # weights only, resharded to this layout; before the optimizer copies the parameters
        loaded = checkpoint.load_model(args.load, chunks)
        if last_rank:
            print(f"loaded model weights from {loaded}", flush=True)
    config = get_model_config(model[0])
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr, weight_decay=args.weight_decay,
                        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16, params_dtype=tc.params_dtype),
        model)
    config.finalize_model_grads_func = finalize_model_grads  # as Megatron-LM's train() sets them
    config.grad_scale_func = optimizer.scale_loss
    reference = ReferenceWeights(chunks)  # the frozen initial policy, swapped in for the KL term's log-probs
    loss_cfg = LossConfig(kl_coef=args.kl_coef, entropy_coef=args.entropy_coef)
    forward_backward = get_forward_backward_func()
    dp_rank = ps.get_data_parallel_rank()

    for it in range(1, args.train_iters + 1):
        gen = torch.Generator().manual_seed(args.seed * 1000 + it * 16 + dp_rank)  # same data on TP/PP peers
        samples, delta_abs = synthetic_rollouts(args, chunks, reference, gen)
        batches, seq = schedule_inputs(plain_batches(samples, args.micro_batch_tokens).batches, model,
                                       tc.sequence_parallel)

        for m in model:  # Megatron-LM's train_step
            m.train()
            m.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=partial(forward_step, return_entropy=args.entropy_coef > 0,
                                      loss_func=partial(ppo_loss_func, cfg=loss_cfg)),
            data_iterator=[iter(batches) for _ in model] if len(model) > 1 else iter(batches),
            model=model if len(model) > 1 else model[0], num_microbatches=len(batches), seq_length=seq,
            micro_batch_size=1, forward_only=False)
        ok, grad_norm, _ = optimizer.step()

        keys = ("loss", "pg_loss", "kl", "entropy", "clipfrac")
        acc = torch.zeros(len(keys), 2, dtype=torch.float64)
        for d in losses:  # the last pipeline stage's per-micro-batch [sum, tokens] pairs (empty elsewhere)
            for i, k in enumerate(keys):
                if k in d:
                    acc[i] += d[k].detach().double().cpu()
        acc = acc.to(torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu")
        torch.distributed.all_reduce(acc, group=ps.get_data_parallel_group())  # token-weighted over DP ranks
        if last_rank:
            vals = " | ".join(f"{k} {float(acc[i, 0] / acc[i, 1].clamp(min=1)):.6E}" for i, k in enumerate(keys))
            gn = float(grad_norm) if grad_norm is not None else math.nan
            print(f" iteration {it:8d}/{args.train_iters:8d} | {vals} | grad norm {gn:.6f} | |skill Δ| "
                  f"{delta_abs:.4f} | update ok {bool(ok)}", flush=True)
    if args.save:
        checkpoint.save(args.save, args.train_iters, model, optimizer)
        if last_rank:
            print(f"saved {args.save}/step_{args.train_iters}", flush=True)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
