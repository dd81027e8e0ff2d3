"""Megatron-LM arguments (or a megatron-core ``TransformerConfig``) -> OPID's model: an architecture dict
(:func:`opid_mega.megatron.model.arch_of`) and the ``TransformerConfig`` OPID's model is built with.

The arguments are read under the names Megatron-LM's parser stores them (its destinations: ``--norm-epsilon`` lands in
``layernorm_epsilon``, ``--apply-layernorm-1p`` in ``layernorm_zero_centered_gamma``, because Megatron-LM declares both
through ``TransformerConfig``'s field metadata) and, where one is missing, Megatron-LM's default (so a Namespace means
what it would mean to Megatron-LM: e.g. no ``position_embedding_type`` is ``learned_absolute``, which OPID rejects).
:data:`MEGATRON_LM_FLAGS` is the flag -> destination table (checked against Megatron-LM's own parser at core_v0.16.1,
core_v0.19.0 and main by tests/megatron/test_megatron_lm_args.py); a namespace holding a flag-shaped name Megatron-LM
never stores (``norm_epsilon``, ``apply_layernorm_1p``) is an error naming the destination, not an ignored value.
The model-shape fields map as Megatron-LM's ``core_transformer_config_from_args`` maps them (``num_query_groups`` only
with ``group_query_attention``; ``kv_channels`` defaults to hidden / heads; ``ffn_hidden_size`` to Megatron-LM's rule;
``padded_vocab_size``, else ``vocab_size`` padded to ``make_vocab_size_divisible_by`` x TP as Megatron-LM pads it).

OPID's model is a dense pre-norm decoder with RMSNorm, SwiGLU, RoPE (full rotary dimension, no scaling), optional
QKV bias, optional q/k RMSNorm, GQA, tied or untied embeddings, no other biases and no dropout (on-policy RL compares
log-probs of the same weights: dropout would make them differ). Every other setting is an error that names the flag
and, for a ``TransformerConfig``, the field. The ``TransformerConfig`` itself is rebuilt by
:func:`opid_mega.megatron.model.transformer_config` from the shape, the parallel sizes (TP, PP, VPP, sequence
parallel), the dtype and the recompute settings; Megatron-LM's performance switches (fusions etc.) are not carried.
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch

# (name, Megatron-LM default) of everything read here; a Namespace lacking a name gets the default.
MEGATRON_LM_DEFAULTS = dict(
    num_layers=None, hidden_size=None, ffn_hidden_size=None, num_attention_heads=None, group_query_attention=False,
    num_query_groups=1, kv_channels=None, padded_vocab_size=None, vocab_size=None, make_vocab_size_divisible_by=128,
    max_position_embeddings=None, seq_length=None, position_embedding_type="learned_absolute", rotary_base=10000,
    rotary_percent=1.0, use_rope_scaling=False, rotary_interleaved=False, rotary_seq_len_interpolation_factor=None,
    normalization="LayerNorm", layernorm_epsilon=1e-5, layernorm_zero_centered_gamma=False, swiglu=False,
    squared_relu=False, quick_geglu=False, add_bias_linear=True, add_qkv_bias=False, qk_layernorm=False,
    qk_l2_norm=False,
    untie_embeddings_and_output_weights=False, hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.02,
    num_experts=None, mtp_num_layers=None, multi_latent_attention=False, window_size=None,
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
    num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None, sequence_parallel=False,
    context_parallel_size=1, expert_model_parallel_size=1, decoder_first_pipeline_num_layers=None,
    decoder_last_pipeline_num_layers=None, bf16=False, fp16=False, recompute_granularity=None,
    recompute_method=None, recompute_num_layers=None,
)

# Megatron-LM's flag for each destination read here (every one above except virtual_pipeline_model_parallel_size,
# which Megatron-LM's validate_args derives and no flag sets).
MEGATRON_LM_FLAGS = {name: "--" + name.replace("_", "-") for name in MEGATRON_LM_DEFAULTS
                     if name != "virtual_pipeline_model_parallel_size"}
MEGATRON_LM_FLAGS.update(layernorm_epsilon="--norm-epsilon", layernorm_zero_centered_gamma="--apply-layernorm-1p",
                         add_bias_linear="--disable-bias-linear")

# Names shaped like a flag that Megatron-LM's parser never stores: a namespace carrying one was not made by it.
NOT_MEGATRON_LM_DESTINATIONS = dict(norm_epsilon="layernorm_epsilon",
                                    apply_layernorm_1p="layernorm_zero_centered_gamma")


_ABSENT = object()


class UnsupportedSettings(ValueError):
    """Megatron-LM settings OPID's model cannot honour (the message lists every one, with the fix)."""


def get_arg(args, name):
    """``args.name`` (a Namespace or a dict), or Megatron-LM's default when it is missing."""
    if isinstance(args, dict):
        v = args.get(name, MEGATRON_LM_DEFAULTS[name])
    else:
        v = getattr(args, name, MEGATRON_LM_DEFAULTS[name])
    return MEGATRON_LM_DEFAULTS[name] if v is None and name in ("rotary_base", "rotary_percent") else v


def _vpp(args) -> Optional[int]:
    """Virtual pipeline size as Megatron-LM's validate_args derives it (None: no interleaving)."""
    vpp = get_arg(args, "virtual_pipeline_model_parallel_size")
    pp = get_arg(args, "pipeline_model_parallel_size")
    per_stage = get_arg(args, "num_layers_per_virtual_pipeline_stage")
    if vpp is None and per_stage is not None:
        layers = get_arg(args, "num_layers")
        if layers % (pp * per_stage):
            raise UnsupportedSettings(f"--num-layers-per-virtual-pipeline-stage={per_stage} x "
                                      f"--pipeline-model-parallel-size={pp} must divide --num-layers={layers}")
        vpp = layers // (pp * per_stage)
    if vpp is None:
        vpp = get_arg(args, "num_virtual_stages_per_pipeline_rank")
    return vpp if vpp and vpp > 1 else None


def _problems(args) -> list[str]:
    """Every setting OPID's model cannot honour, as 'flag=value: reason' lines."""
    g = lambda n: get_arg(args, n)  # noqa: E731
    out = []

    def need(ok, flag, value, why):
        if not ok:
            out.append(f"{flag}={value!r}: {why}")

    for name, dest in NOT_MEGATRON_LM_DESTINATIONS.items():
        value = args.get(name, _ABSENT) if isinstance(args, dict) else getattr(args, name, _ABSENT)
        need(value is _ABSENT, f"args.{name}", value,
             f"not a Megatron-LM destination: its parser stores --{name.replace('_', '-')} as args.{dest}")
    for name, flag in (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
                       ("num_attention_heads", "--num-attention-heads")):
        need(isinstance(g(name), int) and g(name) > 0, flag, g(name), "a positive integer is required")
    vocab = g("padded_vocab_size") or g("vocab_size")
    need(isinstance(vocab, int) and vocab > 0, "padded_vocab_size/--vocab-size", vocab,
         "the (padded) vocabulary size is required")
    need(g("position_embedding_type") == "rope", "--position-embedding-type", g("position_embedding_type"),
         "OPID's model needs rope (TransformerConfig: GPTModel position_embedding_type='rope')")
    need(float(g("rotary_percent")) == 1.0, "--rotary-percent", g("rotary_percent"),
         "only the full rotary dimension (1.0) is supported")
    need(not g("use_rope_scaling"), "--use-rope-scaling", g("use_rope_scaling"), "RoPE scaling is not supported")
    need(not g("rotary_interleaved"), "--rotary-interleaved", g("rotary_interleaved"),
         "interleaved RoPE is not supported (TransformerConfig.rotary_interleaved)")
    need(g("rotary_seq_len_interpolation_factor") is None, "--rotary-seq-len-interpolation-factor",
         g("rotary_seq_len_interpolation_factor"), "RoPE interpolation is not supported")
    need(g("normalization") == "RMSNorm", "--normalization", g("normalization"),
         "OPID's model needs RMSNorm (TransformerConfig.normalization)")
    need(not g("layernorm_zero_centered_gamma"), "--apply-layernorm-1p (layernorm_zero_centered_gamma)",
         g("layernorm_zero_centered_gamma"),
         "zero-centred norm weights are not supported (TransformerConfig.layernorm_zero_centered_gamma)")
    need(g("swiglu") and not g("squared_relu") and not g("quick_geglu"), "--swiglu", g("swiglu"),
         "OPID's model needs a SwiGLU MLP: pass --swiglu (TransformerConfig: gated_linear_unit=True, "
         "activation_func=F.silu)")
    need(not g("add_bias_linear"), "--disable-bias-linear (add_bias_linear)", g("add_bias_linear"),
         "linear-layer biases are not supported: pass --disable-bias-linear (QKV bias: --add-qkv-bias)")
    need(not g("qk_l2_norm"), "--qk-l2-norm", g("qk_l2_norm"), "q/k L2 norm is not supported (use --qk-layernorm)")
    need(float(g("hidden_dropout")) == 0.0, "--hidden-dropout", g("hidden_dropout"),
         "must be 0: dropout makes the recomputed old log-probs differ from the rollout's")
    need(float(g("attention_dropout")) == 0.0, "--attention-dropout", g("attention_dropout"),
         "must be 0: dropout makes the recomputed old log-probs differ from the rollout's")
    need(not g("num_experts"), "--num-experts", g("num_experts"), "mixture-of-experts is not supported")
    need(not g("mtp_num_layers"), "--mtp-num-layers", g("mtp_num_layers"), "multi-token prediction is not supported")
    need(not g("multi_latent_attention"), "--multi-latent-attention", g("multi_latent_attention"),
         "MLA is not supported")
    need(g("window_size") is None, "--window-size", g("window_size"), "sliding-window attention is not supported")
    need(int(g("context_parallel_size")) == 1, "--context-parallel-size", g("context_parallel_size"),
         "context parallelism is not supported by OPID's packed attention")
    need(int(g("expert_model_parallel_size")) == 1, "--expert-model-parallel-size", g("expert_model_parallel_size"),
         "expert parallelism is not supported (no MoE)")
    for name, flag in (("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
                       ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers")):
        need(g(name) is None, flag, g(name), "uneven pipeline stages are not supported")
    need(not (g("bf16") and g("fp16")), "--bf16/--fp16", (g("bf16"), g("fp16")), "choose one")
    need(g("recompute_granularity") in (None, "full", "selective"), "--recompute-granularity",
         g("recompute_granularity"), "allowed: full, selective")
    return out


def padded_vocab_size(args) -> int:
    """``padded_vocab_size``, else ``vocab_size`` padded to a multiple of ``make_vocab_size_divisible_by`` x TP
    (Megatron-LM's ``_vocab_size_with_padding``)."""
    if get_arg(args, "padded_vocab_size"):
        return get_arg(args, "padded_vocab_size")
    vocab = get_arg(args, "vocab_size")
    if not vocab:
        raise UnsupportedSettings("padded_vocab_size/--vocab-size: the (padded) vocabulary size is required")
    multiple = get_arg(args, "make_vocab_size_divisible_by") * get_arg(args, "tensor_model_parallel_size")
    return -(-vocab // multiple) * multiple


def arch_from_args(args) -> dict:
    """OPID's architecture dict from Megatron-LM arguments (a Namespace or a dict); :class:`UnsupportedSettings`
    lists everything OPID's model cannot honour."""
    problems = _problems(args)
    if problems:
        raise UnsupportedSettings("Megatron-LM settings OPID's model does not support:\n  " + "\n  ".join(problems))
    g = lambda n: get_arg(args, n)  # noqa: E731
    hidden, heads = g("hidden_size"), g("num_attention_heads")
    ffn = g("ffn_hidden_size")
    if ffn is None:  # Megatron-LM's validate_args rule for --swiglu
        ffn = int((4 * hidden * 2 / 3) / 64) * 64
    return dict(
        model_type="megatron", hidden=hidden, ffn=ffn, layers=g("num_layers"), heads=heads,
        kv_heads=g("num_query_groups") if g("group_query_attention") else heads,
        head_dim=g("kv_channels") or hidden // heads, vocab=padded_vocab_size(args), eps=float(g("layernorm_epsilon")),
        rope_theta=float(g("rotary_base")), qkv_bias=bool(g("add_qkv_bias")), qk_norm=bool(g("qk_layernorm")),
        tied=not g("untie_embeddings_and_output_weights"),
        max_pos=g("max_position_embeddings") or g("seq_length") or 4096,
    )


def config_from_args(args):
    """``(arch, TransformerConfig)`` for Megatron-LM arguments: the shape from :func:`arch_from_args`, the parallel
    sizes, dtype (--bf16 / --fp16) and recompute settings from the same arguments."""
    from opid_mega.megatron.model import transformer_config

    arch = arch_from_args(args)
    g = lambda n: get_arg(args, n)  # noqa: E731
    dtype = torch.bfloat16 if g("bf16") else torch.float16 if g("fp16") else torch.float32
    overrides = dict(init_method_std=float(g("init_method_std")))
    for name in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        if g(name) is not None:
            overrides[name] = g(name)
    tc = transformer_config(arch, tp=int(g("tensor_model_parallel_size")), pp=int(g("pipeline_model_parallel_size")),
                            vpp=_vpp(args), dtype=dtype, sequence_parallel=bool(g("sequence_parallel")), **overrides)
    return arch, tc


def args_from_transformer_config(tc, *, padded_vocab_size: int, max_position_embeddings: Optional[int] = None,
                                 rotary_base: float = 10000, untie_embeddings_and_output_weights: bool = False,
                                 position_embedding_type: str = "rope") -> argparse.Namespace:
    """The Megatron-LM arguments a megatron-core ``TransformerConfig`` stands for (plus what the config does not
    hold: vocabulary, positions, RoPE base, tying -- GPTModel's constructor arguments)."""
    import torch.nn.functional as F

    act = getattr(tc, "activation_func", None)
    return argparse.Namespace(
        num_layers=tc.num_layers, hidden_size=tc.hidden_size, ffn_hidden_size=tc.ffn_hidden_size,
        num_attention_heads=tc.num_attention_heads, group_query_attention=tc.num_query_groups is not None,
        num_query_groups=tc.num_query_groups, kv_channels=tc.kv_channels, padded_vocab_size=padded_vocab_size,
        max_position_embeddings=max_position_embeddings, position_embedding_type=position_embedding_type,
        rotary_base=rotary_base, rotary_interleaved=getattr(tc, "rotary_interleaved", False),
        normalization=tc.normalization, layernorm_epsilon=tc.layernorm_epsilon,
        layernorm_zero_centered_gamma=getattr(tc, "layernorm_zero_centered_gamma", False),
        swiglu=bool(tc.gated_linear_unit and act is F.silu),
        add_bias_linear=tc.add_bias_linear, add_qkv_bias=tc.add_qkv_bias, qk_layernorm=tc.qk_layernorm,
        qk_l2_norm=getattr(tc, "qk_l2_norm", False),
        untie_embeddings_and_output_weights=untie_embeddings_and_output_weights,
        hidden_dropout=tc.hidden_dropout, attention_dropout=tc.attention_dropout, init_method_std=tc.init_method_std,
        num_experts=tc.num_moe_experts, mtp_num_layers=getattr(tc, "mtp_num_layers", None),
        multi_latent_attention=getattr(tc, "multi_latent_attention", False),
        window_size=getattr(tc, "window_size", None),
        tensor_model_parallel_size=tc.tensor_model_parallel_size,
        pipeline_model_parallel_size=tc.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=tc.virtual_pipeline_model_parallel_size,
        sequence_parallel=tc.sequence_parallel, context_parallel_size=tc.context_parallel_size,
        expert_model_parallel_size=tc.expert_model_parallel_size,
        decoder_first_pipeline_num_layers=getattr(tc, "num_layers_in_first_pipeline_stage", None),
        decoder_last_pipeline_num_layers=getattr(tc, "num_layers_in_last_pipeline_stage", None),
        bf16=tc.bf16, fp16=tc.fp16, recompute_granularity=tc.recompute_granularity,
        recompute_method=tc.recompute_method, recompute_num_layers=tc.recompute_num_layers,
    )


def config_from_transformer_config(tc, **gpt_model_args):
    """``(arch, TransformerConfig)`` for a megatron-core ``TransformerConfig`` (e.g. Megatron-LM's
    ``core_transformer_config_from_args``); ``gpt_model_args``: see :func:`args_from_transformer_config`."""
    return config_from_args(args_from_transformer_config(tc, **gpt_model_args))


def args_from_gpt_model_config(cfg) -> argparse.Namespace:
    """The Megatron-LM arguments a ``GPTModelConfig`` (Megatron-LM >= core_v0.19.0, ``megatron.training.models.gpt``;
    what ``gpt_config_from_args`` builds) stands for: its ``transformer`` config plus its GPT-level fields. The
    vocabulary is padded as its ``GPTModelBuilder`` pads it (``should_pad_vocab``: to a multiple of
    ``make_vocab_size_divisible_by`` x TP). A custom ``transformer_layer_spec`` (``--spec``) or
    ``fp16_lm_cross_entropy`` cannot be honoured and is an error naming the flag."""
    tc = cfg.transformer
    if cfg.transformer_layer_spec is not None:
        raise UnsupportedSettings(f"--spec ({cfg.transformer_layer_spec!r}): OPID's model has its own layer spec")
    if cfg.fp16_lm_cross_entropy:
        raise UnsupportedSettings("--fp16-lm-cross-entropy=True: OPID computes log-probs and its loss in fp32")
    if cfg.vocab_size is None:
        raise UnsupportedSettings("vocab_size: the GPTModelConfig has no vocabulary size (--vocab-size)")
    vocab = cfg.vocab_size
    if cfg.should_pad_vocab:
        multiple = cfg.make_vocab_size_divisible_by * tc.tensor_model_parallel_size
        vocab = -(-vocab // multiple) * multiple
    ns = args_from_transformer_config(
        tc, padded_vocab_size=vocab, max_position_embeddings=cfg.seq_length, rotary_base=cfg.rotary_base,
        untie_embeddings_and_output_weights=not cfg.share_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type)
    ns.rotary_percent = cfg.rotary_percent
    ns.use_rope_scaling = cfg.rope_scaling
    ns.rotary_seq_len_interpolation_factor = cfg.seq_len_interpolation_factor
    return ns


def add_megatron_lm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's command-line flags (names, destinations, defaults) for everything this module reads: the same
    flag -> destination pairs as Megatron-LM's parser (:data:`MEGATRON_LM_FLAGS`)."""
    d = MEGATRON_LM_DEFAULTS
    g = parser.add_argument_group("model (Megatron-LM flags)")
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "vocab_size", "make_vocab_size_divisible_by", "max_position_embeddings", "seq_length",
                 "rotary_base", "num_experts", "mtp_num_layers", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                 "context_parallel_size", "expert_model_parallel_size", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers", "recompute_num_layers"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=d[name])
    for name in ("rotary_percent", "hidden_dropout", "attention_dropout", "init_method_std"):
        g.add_argument("--" + name.replace("_", "-"), type=float, default=d[name])
    g.add_argument("--norm-epsilon", dest="layernorm_epsilon", type=float, default=d["layernorm_epsilon"])
    g.add_argument("--apply-layernorm-1p", dest="layernorm_zero_centered_gamma", action="store_true")
    g.add_argument("--padded-vocab-size", type=int, default=None)
    for name in ("group_query_attention", "use_rope_scaling", "rotary_interleaved", "swiglu",
                 "squared_relu", "quick_geglu", "add_qkv_bias", "qk_layernorm", "qk_l2_norm",
                 "untie_embeddings_and_output_weights", "multi_latent_attention", "sequence_parallel", "bf16", "fp16"):
        g.add_argument("--" + name.replace("_", "-"), action="store_true")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--position-embedding-type", default=d["position_embedding_type"],
                   choices=["learned_absolute", "rope", "yarn", "mrope", "relative", "none"])
    g.add_argument("--normalization", default=d["normalization"], choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    return parser
