"""Hugging Face config -> megatron-core TransformerConfig + GPTModel (Qwen2/Qwen2.5, Qwen3, Llama/SmolLM2).

Supported: RMSNorm, SwiGLU MLP, GQA, RoPE (default rope type, any base), QKV bias (Qwen2), q/k RMSNorm (Qwen3),
tied or untied embeddings. The layer spec is megatron's local spec (or the Transformer Engine spec when TE is
installed) with the core attention swapped for :class:`PackedCoreAttention`, so sequence packing and the fork layout
work without forking megatron-core.

:class:`OpidGPTModel` differs from ``GPTModel`` only in its forward:
- RoPE uses explicit per-token ``position_ids`` (packed sequences restart positions, fork branches get their own);
- the last stage returns per-token log-probs (and entropy) of ``score_targets`` at hidden rows ``score_rows``,
  computed vocabulary-parallel by ``opid_mega.kernels.fused_logprobs`` (full-vocab logits are never gathered).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from opid_mega.megatron.attention import PackedCoreAttention, PackedLayout, packed_layout

SUPPORTED = ("qwen2", "qwen3", "llama")


def _rope_theta(hf) -> float:
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type not in ("default", None):
        raise ValueError(f"rope type {rope_type!r} is not supported (only default RoPE)")
    theta = getattr(hf, "rope_theta", None)
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


def arch_of(hf) -> dict:
    """Architecture facts the model and the weight mapping need, validated."""
    mt = getattr(hf, "model_type", None)
    if mt not in SUPPORTED:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED)}")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported")
    if mt == "llama" and (getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False)):
        raise ValueError("Llama with attention_bias/mlp_bias is not supported")
    if mt == "qwen3" and getattr(hf, "attention_bias", False):
        raise ValueError("Qwen3 with attention_bias is not supported")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported (SwiGLU/silu only)")
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return dict(
        model_type=mt,
        hidden=hf.hidden_size,
        ffn=hf.intermediate_size,
        layers=hf.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab=hf.vocab_size,
        eps=hf.rms_norm_eps,
        rope_theta=_rope_theta(hf),
        qkv_bias=mt == "qwen2",
        qk_norm=mt == "qwen3",
        tied=bool(getattr(hf, "tie_word_embeddings", False)),
        max_pos=getattr(hf, "max_position_embeddings", 4096),
    )


def transformer_config(hf, *, tp: int = 1, pp: int = 1, vpp: Optional[int] = None,
                       dtype: torch.dtype = torch.float32, **overrides) -> TransformerConfig:
    """TransformerConfig for the HF config ``hf`` under the given parallel sizes."""
    a = arch_of(hf)
    if a["heads"] % tp or a["kv_heads"] % tp:
        raise ValueError(f"tp={tp} must divide heads ({a['heads']}) and kv heads ({a['kv_heads']})")
    if a["vocab"] % tp:
        raise ValueError(f"tp={tp} must divide the vocabulary size ({a['vocab']})")
    if a["layers"] % (pp * (vpp or 1)):
        raise ValueError(f"pp*vpp={pp}*{vpp or 1} must divide the number of layers ({a['layers']})")
    cpu = not torch.cuda.is_available()
    kw = dict(
        num_layers=a["layers"], hidden_size=a["hidden"], ffn_hidden_size=a["ffn"],
        num_attention_heads=a["heads"], num_query_groups=a["kv_heads"], kv_channels=a["head_dim"],
        normalization="RMSNorm", layernorm_epsilon=a["eps"], gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=a["qkv_bias"], qk_layernorm=a["qk_norm"],
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=cpu, batch_p2p_comm=False,
        # packed micro-batches vary in length (the interleaved schedule gets them padded to one length instead)
        variable_seq_lengths=not (vpp and vpp > 1), moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=True, init_method_std=getattr(hf, "initializer_range", 0.02),
    )
    import dataclasses

    if "cuda_graph_scope" in {f.name for f in dataclasses.fields(TransformerConfig)}:
        # megatron-core's own default ("full") triggers its own deprecation warning; [] means the same (no graphs)
        kw["cuda_graph_scope"] = []
    kw.update(overrides)
    if kw.get("sequence_parallel"):
        raise ValueError("sequence_parallel is not supported by the OPID log-prob path yet")
    return TransformerConfig(**kw)


def layer_spec(config: TransformerConfig):
    """Local spec (TE spec when Transformer Engine is importable) with PackedCoreAttention."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    except ImportError:
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    return spec


class OpidGPTModel(GPTModel):
    """GPTModel with explicit-position RoPE, packed layouts and a vocabulary-parallel log-prob head."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None, *,
                layout: Optional[PackedLayout] = None, score_rows: Optional[torch.Tensor] = None,
                score_targets: Optional[torch.Tensor] = None, return_entropy: bool = False, temperature: float = 1.0,
                **unused):
        """input_ids, position_ids: [B, S]. Non-last stages return hidden states [S, B, H]; the last stage returns
        ``[1 or 2, n]`` (log-probs, and entropy when asked) of ``score_targets`` [n] at rows ``score_rows`` [n]
        (flat indices into the [B*S] tokens, batch-major), or the final hidden states when no rows are given.
        ``temperature``: log-probs and entropy of softmax(logits / temperature) (the sampling temperature)."""
        bad = input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size)
        if self.pre_process and bad:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{int(input_ids.min())}, "
                             f"{int(input_ids.max())}]")
        decoder_input = self.embedding(input_ids=input_ids, position_ids=None) if self.pre_process else None
        freqs = self.rotary_pos_emb(int(position_ids.max()) + 1)  # [P, 1, 1, D]
        rotary = freqs[:, 0][position_ids.t()]  # [S, B, 1, D]: each token's own position
        with packed_layout(layout):
            hidden = self.decoder(hidden_states=decoder_input, attention_mask=None, rotary_pos_emb=rotary)
        if not self.post_process or score_rows is None:
            return hidden
        return self.score(hidden, score_rows, score_targets, return_entropy, temperature)

    def output_weight(self) -> torch.Tensor:
        return self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
            else self.output_layer.weight

    def score(self, hidden, rows, targets, return_entropy=False, temperature: float = 1.0):
        from opid_mega.kernels.logprob import fused_logprobs

        if rows.numel() == 0:  # nothing to score: keep the graph connected for the pipeline backward
            return hidden.new_zeros(2 if return_entropy else 1, 0) + hidden.sum() * 0.0
        h = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])[rows]
        w = self.output_weight()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        out = fused_logprobs(h, w, targets, vocab_start=tp_rank * w.shape[0],
                             tp_group=parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None,
                             return_entropy=return_entropy, temperature=temperature)
        return torch.stack(out) if return_entropy else out[None]


def build_model(hf, config: TransformerConfig) -> list[OpidGPTModel]:
    """One OpidGPTModel per (virtual) pipeline chunk on this rank (a list of length vpp, or 1)."""
    a = arch_of(hf)
    spec = layer_spec(config)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp in range(vpp or 1):
        vp_stage = vp if vpp else None
        m = OpidGPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=a["vocab"], max_sequence_length=a["max_pos"],
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True, share_embeddings_and_output_weights=a["tied"],
            position_embedding_type="rope", rotary_percent=1.0, rotary_base=a["rope_theta"], vp_stage=vp_stage,
        )
        if not torch.cuda.is_available():
            m = m.float() if config.params_dtype == torch.float32 else m.to(config.params_dtype)
        else:
            m = m.cuda()
        chunks.append(m)
    return chunks
