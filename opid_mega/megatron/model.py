"""Hugging Face config -> megatron-core TransformerConfig + GPTModel (Qwen2/Qwen2.5, Qwen3, Llama/SmolLM2).

Supported: RMSNorm, SwiGLU MLP, GQA, RoPE (default rope type, any base), QKV bias (Qwen2), q/k RMSNorm (Qwen3),
tied or untied embeddings. The layer spec is megatron's local spec (or the Transformer Engine spec when TE is
installed) with the core attention swapped for :class:`PackedCoreAttention`, so sequence packing and the fork layout
work without forking megatron-core.

:class:`OpidGPTModel` differs from ``GPTModel`` only in its forward:
- RoPE uses explicit per-token ``position_ids`` (packed sequences restart positions, fork branches get their own);
- the last stage returns per-token log-probs (and entropy) of ``score_targets`` at hidden rows ``score_rows``,
  computed vocabulary-parallel by ``opid_mega.kernels.fused_logprobs`` (full-vocab logits are never gathered);
  under sequence parallel it first gathers the hidden rows from the sequence-parallel region.

``kernel_backend`` ("auto" | "triton" | "torch", the run config's ``scoring.kernel_backend``) reaches every
``opid_mega.kernels`` call as its ``backend`` argument: :func:`build_model` / :func:`build_chunk` hand it to
:class:`OpidGPTModel` (log-prob head, divergence) and, through the layer spec's ``ModuleSpec.params``, to every
layer's :class:`PackedCoreAttention` (fork attention).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from opid_mega.megatron.attention import KERNEL_BACKENDS, PackedCoreAttention

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


ARCH_KEYS = ("hidden", "ffn", "layers", "heads", "kv_heads", "head_dim", "vocab", "eps", "rope_theta", "qkv_bias",
             "qk_norm", "tied", "max_pos")


def check_arch(a: dict) -> dict:
    """An architecture dict (the keys of :func:`arch_of`, e.g. from ``opid_mega.megatron.megatron_lm``), checked."""
    missing = [k for k in ARCH_KEYS if k not in a]
    if missing:
        raise ValueError(f"architecture dict lacks {', '.join(missing)}")
    for k in ("hidden", "ffn", "layers", "heads", "kv_heads", "head_dim", "vocab", "max_pos"):
        if not isinstance(a[k], int) or isinstance(a[k], bool) or a[k] < 1:
            raise ValueError(f"architecture: {k}={a[k]!r} must be a positive integer")
    if a["heads"] % a["kv_heads"]:
        raise ValueError(f"architecture: kv_heads={a['kv_heads']} must divide heads={a['heads']}")
    return dict(a, model_type=a.get("model_type", "megatron"))


def arch_of(hf) -> dict:
    """Architecture facts the model and the weight mapping need, validated. ``hf``: a HF config, or an architecture
    dict (:func:`check_arch`)."""
    if isinstance(hf, dict):
        return check_arch(hf)
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
                       dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                       **overrides) -> TransformerConfig:
    """TransformerConfig for the HF config ``hf`` under the given parallel sizes.

    ``sequence_parallel`` (needs tp > 1): the residual stream, norms and dropout run on 1/tp of the tokens; packed
    micro-batches are padded to a multiple of tp (``logprobs.run_schedule``)."""
    a = arch_of(hf)
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel needs tp > 1 (got tp=1)")
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
        sequence_parallel=bool(sequence_parallel),
    )
    import dataclasses

    if "cuda_graph_scope" in {f.name for f in dataclasses.fields(TransformerConfig)}:
        # megatron-core's own default ("full") triggers its own deprecation warning; [] means the same (no graphs)
        kw["cuda_graph_scope"] = []
    kw.update(overrides)
    if kw.get("context_parallel_size", 1) != 1:
        raise ValueError(f"cp={kw['context_parallel_size']}: context parallelism is not supported")
    return TransformerConfig(**kw)


class TorchNorm:
    """megatron's local ``WrappedTorchNorm`` (torch RMSNorm/LayerNorm) that also builds under sequence parallel.

    Its weights are marked ``sequence_parallel`` so that ``finalize_model_grads`` sums their gradients over the TP
    ranks (under sequence parallel each rank normalises only its slice of the tokens)."""

    residual_stream = True  # False: q/k norms, which see every token (megatron all-reduces them by name)

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                normalization=None):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel and cls.residual_stream)
        return norm


class TorchQKNorm(TorchNorm):
    residual_stream = False


RECOMPUTE = ("none", "selective", "full")


def recompute_config(mode: str) -> dict:
    """TransformerConfig overrides for ``train.recompute``: none | selective (megatron re-runs the core attention in
    the backward) | full (every layer re-run from its input: uniform, one layer per checkpoint)."""
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute={mode!r}, allowed: {', '.join(RECOMPUTE)}")
    if mode == "none":
        return {}
    if mode == "selective":
        return dict(recompute_granularity="selective")
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _check_kernel_backend(kernel_backend: str) -> str:
    if kernel_backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {kernel_backend!r}")
    return kernel_backend


def layer_spec(config: TransformerConfig, kernel_backend: str = "auto"):
    """Local spec (TE spec when Transformer Engine imports: any import problem of TE means the local spec,
    :mod:`opid_mega.megatron.te_guard`) with PackedCoreAttention as the core attention, built with
    ``kernel_backend`` (its ``ModuleSpec.params``)."""
    _check_kernel_backend(kernel_backend)
    from opid_mega.megatron import te_guard

    spec = None
    if te_guard.usable():
        try:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
        except Exception as exc:  # noqa: BLE001 - a TE that imports but whose megatron spec cannot be built
            import warnings

            warnings.warn(f"Transformer Engine layer spec unavailable ({type(exc).__name__}: {exc}); using "
                          "megatron-core's local layers", RuntimeWarning, stacklevel=2)
    if spec is None:
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
        if config.sequence_parallel:  # megatron's torch norms refuse sequence parallel; ours mark their weights
            sub = spec.submodules
            sub.input_layernorm = sub.pre_mlp_layernorm = TorchNorm
            if config.qk_layernorm:
                sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = TorchQKNorm
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=PackedCoreAttention, params={"kernel_backend": kernel_backend})
    return spec


class OpidGPTModel(GPTModel):
    """GPTModel with explicit-position RoPE, packed layouts and a vocabulary-parallel log-prob head.

    ``kernel_backend``: the ``backend`` of the ``opid_mega.kernels`` calls of the head (log-probs, divergence); the
    layers' core attention gets its own from the layer spec (:func:`layer_spec`)."""

    def __init__(self, *args, kernel_backend: str = "auto", **kwargs):
        _check_kernel_backend(kernel_backend)
        super().__init__(*args, **kwargs)
        self.kernel_backend = kernel_backend

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None, *,
                packed_seq_params: Optional[PackedSeqParams] = None, score_rows: Optional[torch.Tensor] = None,
                score_targets: Optional[torch.Tensor] = None, return_entropy: bool = False, temperature: float = 1.0,
                pairs: Optional[torch.Tensor] = None, topk: int = 0, **unused):
        """input_ids, position_ids: [B, S]. Non-last stages return hidden states [S, B, H]; the last stage returns
        ``[1 or 2, n]`` (log-probs, and entropy when asked) of ``score_targets`` [n] at rows ``score_rows`` [n]
        (flat indices into the [B*S] tokens, batch-major), or the final hidden states when no rows are given.
        ``temperature``: log-probs and entropy of softmax(logits / temperature) (the sampling temperature).
        ``packed_seq_params``: the packed layout of a batch-size-1 row (``opid_mega.megatron.attention.
        packed_seq_params``; a plain thd ``PackedSeqParams`` works too), handed to every layer's core attention by
        megatron (recompute included). megatron's THD RoPE then finds per-token frequencies (one row per packed
        token) and applies them as they are; None: every batch row is one causal sequence.
        ``pairs`` int64 [2, P] (indices into the n scored rows: a skill-context row and the original-context row
        of the same response token): the last stage returns ``(scores, divergences)``, the second the dict of
        ``opid_mega.kernels.dual_context_divergence`` over the pairs (KL both ways; ``topk`` > 0: the top-k of the
        skill side), differentiable through the original-context rows only."""
        if packed_seq_params is not None:
            n = int(packed_seq_params.cu_seqlens_q[-1])
            if input_ids.shape[0] != 1 or n != input_ids.shape[1]:
                raise ValueError(f"packed_seq_params covers {n} tokens of one row; the batch is "
                                 f"{tuple(input_ids.shape)}")
        bad = input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size)
        if self.pre_process and bad:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{int(input_ids.min())}, "
                             f"{int(input_ids.max())}]")
        decoder_input = self.embedding(input_ids=input_ids, position_ids=None) if self.pre_process else None
        freqs = self.rotary_pos_emb(int(position_ids.max()) + 1)  # [P, 1, 1, D]
        rotary = freqs[:, 0][position_ids.t()]  # [S, B, 1, D]: each token's own position
        hidden = self.decoder(hidden_states=decoder_input, attention_mask=None, rotary_pos_emb=rotary,
                              packed_seq_params=packed_seq_params)
        if not self.post_process:
            return hidden  # model dtype: the next pipeline stage's input (pipeline_dtype)
        if score_rows is None:
            return hidden.float()  # the last stage's outputs are fp32 (Float16Module's fp32_output)
        return self.score(hidden, score_rows, score_targets, return_entropy, temperature, pairs, topk)

    def output_weight(self) -> torch.Tensor:
        return self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
            else self.output_layer.weight

    def score(self, hidden, rows, targets, return_entropy=False, temperature: float = 1.0, pairs=None, topk: int = 0):
        from opid_mega.kernels.logprob import fused_logprobs

        if rows.numel() == 0:  # nothing to score: keep the graph connected for the pipeline backward (and the
            # output weight's, so that overlap_grad_reduce's per-parameter ready counts are those of any micro-batch)
            empty = hidden.new_zeros(2 if return_entropy else 1, 0) + (hidden.sum() + self.output_weight().sum()) * 0.0
            if pairs is None:
                return empty
            return empty, self._divergence(hidden.new_zeros(0, hidden.shape[-1]), targets, pairs, temperature, topk)
        sp = self.config.sequence_parallel
        if sp:  # [S/tp, B, H] -> [S, B, H]; the backward reduce-scatters the vocab-shard partial gradients
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
        h = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])[rows]
        w = self.output_weight()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        out = fused_logprobs(h, w, targets, vocab_start=tp_rank * w.shape[0],
                             tp_group=parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None,
                             return_entropy=return_entropy, temperature=temperature, reduce_hidden_grad=not sp,
                             backend=self.kernel_backend)
        scores = torch.stack(out) if return_entropy else out[None]
        if pairs is None:
            return scores
        return scores, self._divergence(h, targets, pairs, temperature, topk)

    def _divergence(self, h, targets, pairs, temperature: float, topk: int) -> dict:
        """Divergences of the (skill row, original row) ``pairs`` of the scored rows ``h`` [n, H], vocabulary-parallel
        (the same TP all-reduce pattern as the log-prob head; under sequence parallel the hidden-state gradient is
        left to the sequence-parallel gather's reduce-scatter)."""
        from opid_mega.kernels.dual_context_divergence import dual_context_divergence

        pairs = pairs.to(device=h.device, dtype=torch.long)
        if pairs.dim() != 2 or pairs.shape[0] != 2:
            raise ValueError(f"pairs must be [2, P] indices into the scored rows, got {tuple(pairs.shape)}")
        if pairs.numel() and (int(pairs.min()) < 0 or int(pairs.max()) >= h.shape[0]):
            raise ValueError(f"pairs index the {h.shape[0]} scored rows, got [{int(pairs.min())}, {int(pairs.max())}]")
        if pairs.numel() and not torch.equal(targets[pairs[0]], targets[pairs[1]]):
            raise ValueError("pairs: a skill row and its original row score different target tokens")
        w = self.output_weight()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        return dual_context_divergence(
            h[pairs[0]], h[pairs[1]], w, targets[pairs[1]],
            vocab_start=parallel_state.get_tensor_model_parallel_rank() * w.shape[0],
            tp_group=parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None, topk=topk,
            temperature=temperature, reduce_hidden_grad=not self.config.sequence_parallel, backend=self.kernel_backend)


def build_chunk(hf, config: TransformerConfig, pre_process: bool = True, post_process: bool = True,
                vp_stage: Optional[int] = None, pg_collection=None, kernel_backend: str = "auto") -> OpidGPTModel:
    """One OpidGPTModel: the pipeline stage (``vp_stage``: its virtual chunk) that ``pre_process`` / ``post_process``
    say. ``hf``: a HF config or an architecture dict (:func:`arch_of`). ``pg_collection``: megatron-core's process
    groups (None: the global ones). ``kernel_backend``: the backend of its kernels (module docstring)."""
    a = arch_of(hf)
    spec = layer_spec(config, kernel_backend=kernel_backend)
    block = spec
    if config.sequence_parallel and spec.submodules.input_layernorm is TorchNorm:  # and the final norm too
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        block = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                           layer_norm=TorchNorm)
    m = OpidGPTModel(
        config=config, transformer_layer_spec=block, vocab_size=a["vocab"], max_sequence_length=a["max_pos"],
        pre_process=pre_process, post_process=post_process,
        parallel_output=True, share_embeddings_and_output_weights=a["tied"],
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=a["rope_theta"], vp_stage=vp_stage,
        pg_collection=pg_collection, kernel_backend=kernel_backend,
    )
    if torch.cuda.is_available():
        m = m.cuda()
    return to_model_dtype(m, config)


def model_dtype(config: TransformerConfig) -> torch.dtype:
    """The dtype every parameter and floating buffer of the model has: fp16 / bf16 when the config says so (as
    megatron's Float16Module decides), else ``params_dtype``."""
    return torch.float16 if config.fp16 else torch.bfloat16 if config.bf16 else config.params_dtype


def to_model_dtype(m: torch.nn.Module, config: TransformerConfig) -> torch.nn.Module:
    """megatron's ``Float16Module`` semantics without the wrapper (its ``module.`` prefix would change every
    checkpoint key and attribute path): the WHOLE module goes to fp16 / bf16 -- norms, biases and embeddings too
    (megatron builds linear weights in ``params_dtype`` on the GPU but leaves torch norms in fp32) -- and the last
    stage's outputs are fp32 (:meth:`OpidGPTModel.forward`; the log-prob head computes in fp32 and returns fp32).
    The same on CPU and GPU. The optimizer keeps fp32 main weights beside the bf16 ones (megatron's mixed-precision
    optimizer) and the DDP grad buffers are fp32 (``grad_reduce_in_fp32``)."""
    return m.to(model_dtype(config))


def build_model(hf, config: TransformerConfig, kernel_backend: str = "auto") -> list[OpidGPTModel]:
    """One OpidGPTModel per (virtual) pipeline chunk on this rank (a list of length vpp, or 1); ``kernel_backend``:
    the backend of their kernels (module docstring)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp in range(vpp or 1):
        vp_stage = vp if vpp else None
        chunks.append(build_chunk(
            hf, config, pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage, kernel_backend=kernel_backend))
    return chunks
