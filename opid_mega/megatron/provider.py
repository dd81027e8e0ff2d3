"""Megatron-LM's ``model_provider`` for OPID's model (:class:`opid_mega.megatron.model.OpidGPTModel`), for Megatron-LM
up to core_v0.18 (from core_v0.19.0 ``pretrain()`` builds the model through a ``ModelBuilder``:
:mod:`opid_mega.megatron.model_builder`).

There ``get_model(model_provider_func, ModelType.encoder_or_decoder)`` calls, once per virtual pipeline stage (or once
without interleaving)::

    model_provider_func(pre_process=..., post_process=..., [vp_stage=i,] config=None, pg_collection=...)

and ``pretrain_gpt.py`` passes ``partial(model_provider, gpt_builder)`` to ``pretrain`` (core_v0.16/0.17:
``pretrain(datasets_provider, partial(model_provider, gpt_builder), ...)``; core_v0.18:
``pretrain(full_config, datasets_provider, partial(model_provider, gpt_builder), ...)``) with
``gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None)``. Both shapes
exist here:

- :func:`model_provider` -- the provider itself; the arguments come from ``megatron.training.get_args()`` (as in
  Megatron-LM) unless bound with ``args=`` (:func:`make_model_provider`, for scripts without megatron.training);
- :func:`opid_gpt_builder` -- a drop-in for ``gpt_builder``: ``partial(model_provider, opid_gpt_builder)`` with
  Megatron-LM's own ``model_provider``, the one change in ``pretrain_gpt.py``.

The arguments are Megatron-LM's (:mod:`opid_mega.megatron.megatron_lm` maps and checks them); a ``config`` that
Megatron-LM hands over (a megatron-core ``TransformerConfig``) is checked and mapped the same way, with the vocabulary,
positions, RoPE base and tying taken from the arguments.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

from opid_mega.megatron.megatron_lm import (config_from_args, config_from_transformer_config, get_arg,
                                            padded_vocab_size)


def _megatron_lm_args():
    try:
        from megatron.training import get_args
    except ImportError as e:
        raise RuntimeError("model_provider: megatron.training (Megatron-LM) is not installed; bind the arguments with "
                           "make_model_provider(args) or pass args=") from e
    return get_args()


def check_parallel_state(tc) -> None:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("model_provider: megatron's model parallelism is not initialised "
                           "(megatron.training.initialize_megatron or opid_mega.megatron.parallel.initialize)")
    have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
    want = (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size)
    if have != want:
        raise ValueError(f"model_provider: the arguments say tp={want[0]} pp={want[1]} but the process groups are "
                         f"tp={have[0]} pp={have[1]}")


def opid_gpt_builder(args, pre_process: bool, post_process: bool, vp_stage: Optional[int] = None, config=None,
                     pg_collection=None):
    """Megatron-LM's ``gpt_builder`` signature: one OpidGPTModel chunk for this pipeline stage."""
    from opid_mega.megatron.model import build_chunk

    if config is None:
        arch, tc = config_from_args(args)
    else:
        arch, tc = config_from_transformer_config(
            config, padded_vocab_size=padded_vocab_size(args),
            max_position_embeddings=get_arg(args, "max_position_embeddings") or get_arg(args, "seq_length"),
            rotary_base=get_arg(args, "rotary_base"),
            untie_embeddings_and_output_weights=get_arg(args, "untie_embeddings_and_output_weights"),
            position_embedding_type=get_arg(args, "position_embedding_type"))
    check_parallel_state(tc)
    return build_chunk(arch, tc, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                       pg_collection=pg_collection)


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None, config=None,
                   pg_collection=None, *, args=None):
    """Megatron-LM's ``model_provider``: builds this stage's OpidGPTModel (``get_model`` calls it per chunk).
    ``args``: Megatron-LM arguments (default: ``megatron.training.get_args()``)."""
    return opid_gpt_builder(args if args is not None else _megatron_lm_args(), pre_process, post_process,
                            vp_stage=vp_stage, config=config, pg_collection=pg_collection)


def make_model_provider(args):
    """:func:`model_provider` bound to ``args`` (Megatron-LM's argument names; an argparse Namespace or a dict)."""
    return partial(model_provider, args=args)
