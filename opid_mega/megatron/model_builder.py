"""OPID's model for Megatron-LM >= core_v0.19.0, whose ``pretrain()`` builds the model from a ``ModelConfig`` with
the ``ModelBuilder`` that config names (``megatron.training.models``); a ``model_provider`` is then not used.

``pretrain_gpt.py`` there builds ``gpt_config_from_args(args)`` (a ``GPTModelConfig``) and calls
``pretrain(pretrain_cfg_container_from_args(args, model_cfg), ...)``; ``setup_model_and_optimizer`` resolves
``model_cfg.builder`` and calls ``build_distributed_models``, which builds one chunk per virtual pipeline stage
through ``build_model`` and wraps them (Float16Module, DDP/FSDP) as it does for megatron-core's GPTModel. The one line
a user changes in ``pretrain_gpt.py``::

    model_cfg = gpt_config_from_args(args, model_config_cls=OpidGPTModelConfig)

:class:`OpidGPTModelConfig` is Megatron-LM's ``GPTModelConfig`` (same fields, filled by the same
``gpt_config_from_args``) naming :class:`OpidGPTModelBuilder`, whose ``build_model`` builds an
:class:`opid_mega.megatron.model.OpidGPTModel` chunk instead of megatron-core's GPTModel; the settings are checked
and mapped by :func:`opid_mega.megatron.megatron_lm.args_from_gpt_model_config` (an unsupported one is an error naming
its flag). Megatron-LM up to core_v0.18 builds through a ``model_provider``: :mod:`opid_mega.megatron.provider`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

try:
    from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig
except ImportError as e:  # Megatron-LM < core_v0.19.0, or megatron-core without megatron.training
    raise ImportError("opid_mega.megatron.model_builder needs Megatron-LM >= core_v0.19.0 (megatron.training.models."
                      "gpt); with earlier releases use opid_mega.megatron.provider.model_provider") from e

from opid_mega.megatron.megatron_lm import args_from_gpt_model_config, config_from_args


@dataclass(kw_only=True)
class OpidGPTModelConfig(GPTModelConfig):
    """Megatron-LM's ``GPTModelConfig`` whose builder is :class:`OpidGPTModelBuilder`."""

    builder: ClassVar[str] = "opid_mega.megatron.model_builder.OpidGPTModelBuilder"


class OpidGPTModelBuilder(GPTModelBuilder):
    """Megatron-LM's ``GPTModelBuilder`` building OPID's model; ``build_distributed_models`` is inherited."""

    def build_model(self, pg_collection, pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                    vp_stage: Optional[int] = None):
        """One OpidGPTModel chunk; ``pre_process`` / ``post_process`` default as GPTModelBuilder decides them (first
        / last virtual stage of the first / last pipeline stage)."""
        from megatron.core.pipeline_parallel.utils import (is_pp_first_stage, is_pp_last_stage, is_vp_first_stage,
                                                           is_vp_last_stage)

        from opid_mega.megatron.model import build_chunk
        from opid_mega.megatron.provider import check_parallel_state

        arch, tc = config_from_args(args_from_gpt_model_config(self._model_config))
        check_parallel_state(tc)
        vp_size = tc.virtual_pipeline_model_parallel_size
        if pre_process is None:
            pre_process = is_vp_first_stage(vp_stage=vp_stage, vp_size=vp_size) and is_pp_first_stage(pg_collection.pp)
        if post_process is None:
            post_process = is_vp_last_stage(vp_stage=vp_stage, vp_size=vp_size) and is_pp_last_stage(pg_collection.pp)
        return build_chunk(arch, tc, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                           pg_collection=pg_collection)
