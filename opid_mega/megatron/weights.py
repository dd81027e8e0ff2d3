"""Hugging Face safetensors <-> sharded Megatron model (per TP rank and PP stage), exact both ways.

Explicit mapping for Qwen2/Qwen2.5 (QKV bias), Qwen3 (q/k norm) and Llama (they share HF names):

  megatron (per layer L, global index)            HF                                          TP split
  embedding.word_embeddings.weight                 model.embed_tokens.weight                   rows (vocab)
  decoder.layers.L.input_layernorm.weight          model.layers.L.input_layernorm.weight       -
  decoder.layers.L.self_attention.linear_qkv.{weight,bias}
                                                   self_attn.{q,k,v}_proj.{weight,bias}        per query group:
                                                   rows grouped as [q heads of group g | k_g | v_g] for g in groups
  decoder.layers.L.self_attention.{q,k}_layernorm.weight   self_attn.{q,k}_norm.weight          -
  decoder.layers.L.self_attention.linear_proj.weight       self_attn.o_proj.weight              columns
  decoder.layers.L.pre_mlp_layernorm.weight        model.layers.L.post_attention_layernorm     -
  decoder.layers.L.mlp.linear_fc1.weight           [mlp.gate_proj ; mlp.up_proj]               each half by rows
  decoder.layers.L.mlp.linear_fc2.weight           mlp.down_proj.weight                        columns
  decoder.final_layernorm.weight                   model.norm.weight                           -
  output_layer.weight                              lm_head.weight (embed_tokens when tied)     rows (vocab)

With the Transformer Engine spec the two layer norms live at ``linear_qkv.layer_norm_weight`` and
``linear_fc1.layer_norm_weight``; both spellings are mapped.
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from opid_mega.megatron.model import arch_of

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LAYER_MAP = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def _unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


def _global_layer(chunk, local_idx: int) -> int:
    return chunk.decoder.layers[local_idx].layer_number - 1


def hf_names(chunk, name: str, a: dict) -> list[str]:
    """HF tensor names that make up Megatron parameter ``name`` of ``chunk`` (empty: not exported)."""
    if name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if name == "output_layer.weight":
        return [] if a["tied"] else ["lm_head.weight"]
    if name == "decoder.final_layernorm.weight":
        return ["model.norm.weight"]
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"no HF mapping for Megatron parameter {name!r}")
    p = f"model.layers.{_global_layer(chunk, int(m.group(1)))}."
    rest = m.group(2)
    if rest in _LAYER_MAP:
        return [p + _LAYER_MAP[rest]]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"]
    if rest == "mlp.linear_fc1.weight":
        return [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    raise KeyError(f"no HF mapping for Megatron parameter {name!r}")


def _qkv_merge(q, k, v, a):
    g, d = a["kv_heads"], a["head_dim"]
    tail = q.shape[1:]
    parts = [q.reshape(g, -1, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)]
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _qkv_split(full, a):
    g, d = a["kv_heads"], a["head_dim"]
    r = a["heads"] // g
    x = full.reshape(g, (r + 2) * d, *full.shape[1:])
    q, k, v = torch.split(x, [r * d, d, d], dim=1)
    return [t.reshape(-1, *full.shape[1:]).contiguous() for t in (q, k, v)]


def _tp():
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _shard(name: str, param, full: torch.Tensor) -> torch.Tensor:
    """This TP rank's piece of the full Megatron-layout tensor."""
    rank, size = _tp()
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(size, dim=param.partition_dim)[rank]


def megatron_param_from_hf(chunk, name, param, get: Callable[[str], torch.Tensor], a: dict) -> torch.Tensor:
    """The local shard of Megatron parameter ``name`` built from HF tensors (``get(hf_name)``)."""
    names = hf_names(chunk, name, a)
    if name == "output_layer.weight" and a["tied"]:
        names = ["model.embed_tokens.weight"]
    ts = [get(n) for n in names]
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return _shard(name, param, _qkv_merge(*ts, a))
    if name.endswith("linear_fc1.weight"):  # each rank holds [gate shard ; up shard]
        rank, size = _tp()
        return torch.cat([t.chunk(size, dim=0)[rank] for t in ts], dim=0)
    return _shard(name, param, ts[0])


def _safetensors_getter(hf_dir: str) -> Callable[[str], torch.Tensor]:
    from safetensors import safe_open

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            where = {k: os.path.join(hf_dir, v) for k, v in json.load(f)["weight_map"].items()}
    else:
        where = {}
        for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
            with safe_open(path, framework="pt") as f:
                where.update({k: path for k in f.keys()})
    if not where:
        raise FileNotFoundError(f"no *.safetensors weights in {hf_dir}")
    handles = {}

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise KeyError(f"HF checkpoint {hf_dir} has no tensor {name!r}")
        path = where[name]
        if path not in handles:
            handles[path] = safe_open(path, framework="pt")
        return handles[path].get_tensor(name)

    return get


@torch.no_grad()
def load_hf_weights(chunks, hf_config, source) -> None:
    """Copy HF weights into this rank's model chunks. ``source``: a HF model dir (safetensors) or a
    ``{hf_name: tensor}`` dict."""
    a = arch_of(hf_config)
    get = source.__getitem__ if isinstance(source, dict) else _safetensors_getter(source)
    for chunk in chunks:
        chunk = _unwrap(chunk)
        for name, param in chunk.named_parameters():
            shard = megatron_param_from_hf(chunk, name, param, get, a)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: HF gives shape {tuple(shard.shape)}, model expects {tuple(param.shape)}")
            param.data.copy_(shard.to(param.dtype))


def _gather_tp(name, param) -> torch.Tensor:
    rank, size = _tp()
    t = param.detach()
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    if name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=param.partition_dim)


def _hf_tensors(chunk, name, param, a) -> list[tuple[str, torch.Tensor]]:
    names = hf_names(chunk, name, a)
    if not names:
        return []
    full = _gather_tp(name, param)
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return list(zip(names, _qkv_split(full, a)))
    if name.endswith("linear_fc1.weight"):
        return list(zip(names, [t.contiguous() for t in full.chunk(2, dim=0)]))
    return [(names[0], full.contiguous())]


def export_hf_weights(chunks, hf_config, bucket_bytes: int = 256 << 20, all_stages: bool = True,
                      ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Stream the model as HF-named full tensors, in buckets of about ``bucket_bytes`` (a generator of
    ``[(hf_name, tensor), ...]``). A collective: every rank must iterate it to the end. TP shards are
    all-gathered; with ``all_stages`` every pipeline stage's tensors are broadcast over the PP group so each
    rank sees the whole model (else a rank yields only its own stage's tensors)."""
    from opid_mega.infra.buckets import size_buckets

    return size_buckets(_stream_hf_tensors(chunks, arch_of(hf_config), all_stages), bucket_bytes)


@torch.no_grad()
def _stream_hf_tensors(chunks, a: dict, all_stages: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """export_hf_weights' (hf_name, tensor) pairs, one at a time (the collectives run as the stream is read)."""
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp_size > 1 else [dist.get_rank()]
    local = [(_unwrap(c), n, p) for c in chunks for n, p in _unwrap(c).named_parameters()]
    dev = local[0][2].device
    for stage in range(pp_size if all_stages else 1):
        owner = stage == pp_rank if all_stages else True
        count = [len(local) if owner else 0]
        if all_stages and pp_size > 1:
            dist.broadcast_object_list(count, src=pp_ranks[stage], group=pp_group)
        for i in range(count[0]):
            pairs = _hf_tensors(*local[i][:2], local[i][2], a) if owner else []
            if all_stages and pp_size > 1:
                meta = [[(n, t.shape, t.dtype) for n, t in pairs]]
                dist.broadcast_object_list(meta, src=pp_ranks[stage], group=pp_group)
                if not owner:
                    pairs = [(n, torch.empty(s, dtype=d, device=dev)) for n, s, d in meta[0]]
                for _, t in pairs:
                    dist.broadcast(t, src=pp_ranks[stage], group=pp_group)
            yield from pairs


def hf_state_dict(chunks, hf_config) -> dict[str, torch.Tensor]:
    """The whole model as one HF state dict (collective; for tests, conversion and small models)."""
    out = {}
    for bucket in export_hf_weights(chunks, hf_config):
        for n, t in bucket:
            out[n] = t.cpu().clone()
    return out
