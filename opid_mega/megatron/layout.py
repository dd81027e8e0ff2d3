"""Parallel layout validation before any rank starts: TP/PP/VPP/SP/CP/DP against the world size and the model.

Reads only the Hugging Face config (a ``config.json``, a dict or a transformers config object): no torch, no
megatron, no torch.distributed, so the command-line tools can refuse a bad layout in a fraction of a second with one
line instead of a traceback from every spawned rank.

    msg = layout_error(model_facts("path/to/hf_dir"), tp=3)   # "tp=3 does not divide the 4 attention heads of ..."

The rules are megatron-core's (heads, KV heads, FFN and vocabulary split over TP; layers split over PP x VPP;
DP = world / (TP x PP x CP)) plus ours: sequence parallel needs TP > 1, context parallel is not supported, and the
vocabulary is not padded (``transformer_config`` builds the output layer with the model's own vocabulary size).
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Union


class LayoutError(ValueError):
    """A parallel layout that cannot run this model on this world; the message is one line."""


def model_facts(model: Union[str, Mapping, Any], name: Optional[str] = None) -> dict:
    """The sizes the layout depends on: heads, kv_heads, layers, vocab, ffn, hidden and a display name.

    ``model``: an HF directory (its config.json is read), a dict of config.json keys, or a transformers config."""
    if isinstance(model, (str, os.PathLike)):
        path = os.path.join(os.path.expanduser(str(model)), "config.json")
        try:
            with open(path) as f:
                cfg = json.load(f)
        except FileNotFoundError:
            raise LayoutError(f"{model} has no config.json (expected a Hugging Face model directory)") from None
        except json.JSONDecodeError as e:
            raise LayoutError(f"{path} is not valid JSON ({e})") from None
        name = name or os.path.basename(os.path.normpath(str(model)))
    elif isinstance(model, Mapping):
        cfg = dict(model)
    else:
        cfg = model.to_dict() if hasattr(model, "to_dict") else vars(model)
    get = cfg.get
    missing = [k for k in ("num_attention_heads", "num_hidden_layers", "vocab_size") if get(k) is None]
    if missing:
        raise LayoutError(f"the config of {name or 'the model'} has no {', '.join(missing)}")
    heads = int(get("num_attention_heads"))
    return dict(
        name=name or get("_name_or_path") or get("model_type") or "the model",
        heads=heads,
        kv_heads=int(get("num_key_value_heads") or heads),
        layers=int(get("num_hidden_layers")),
        vocab=int(get("vocab_size")),
        ffn=int(get("intermediate_size") or 0),
        hidden=int(get("hidden_size") or 0),
    )


def layout_error(facts: Optional[dict], *, tp: int = 1, pp: int = 1, vpp: Optional[int] = 1, sp: bool = False,
                 cp: int = 1, world: Optional[int] = None) -> Optional[str]:
    """One line naming the first problem of this layout, or None when it can run.

    ``facts``: :func:`model_facts` (None: check the world and the sizes only). ``world``: the number of ranks
    (None: not known yet; DP is then whatever the launcher makes it). ``vpp`` None or 1: no interleaving."""
    vpp = vpp or 1
    for key, v in (("tp", tp), ("pp", pp), ("vpp", vpp), ("cp", cp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return f"{key}={v!r} must be an integer >= 1"
    if world is not None and (not isinstance(world, int) or world < 1):
        return f"world size {world!r} must be an integer >= 1"
    if cp != 1:
        return f"cp={cp}: context parallelism is not supported (use cp=1; long sequences: sequence parallel, tp > 1)"
    if sp and tp == 1:
        return "sequence parallel needs tp > 1 (got tp=1)"
    if vpp > 1 and pp < 2:
        return f"vpp={vpp} (interleaved pipeline) needs pp >= 2 (got pp={pp})"
    world_msg = None
    if world is not None and world % (tp * pp * cp):
        world_msg = f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}"
    if facts is None:
        return world_msg
    name = facts.get("name", "the model")
    if facts["heads"] % tp:
        return f"tp={tp} does not divide the {facts['heads']} attention heads of {name}"
    if facts["kv_heads"] % tp:
        return f"tp={tp} does not divide the {facts['kv_heads']} KV heads (query groups) of {name}"
    if facts.get("ffn") and facts["ffn"] % tp:
        return f"tp={tp} does not divide the FFN size {facts['ffn']} of {name}"
    if facts["vocab"] % tp:
        return f"tp={tp} does not divide the vocabulary size {facts['vocab']} of {name} (the vocabulary is not padded)"
    if facts["layers"] % (pp * vpp):
        return f"pp*vpp = {pp}*{vpp} does not divide the {facts['layers']} layers of {name}"
    return world_msg


def check_layout(facts: Optional[dict], **layout) -> None:
    """:func:`layout_error`, raised as :class:`LayoutError`."""
    msg = layout_error(facts, **layout)
    if msg:
        raise LayoutError(msg)


def config_model_facts(cfg) -> Optional[dict]:
    """The model facts of an opid-train config (``opid_mega.config.Config``) without building anything: the config.json
    of model.init_from / model.path, or of the built-in model (its cached directory, or its known shapes for the
    tiny models). None when the architecture cannot be known before it is built (an unbuilt smollm2-135m)."""
    m = cfg.model
    src = m.init_from if m.init_from not in ("", "sft") else m.path  # the sft warm start keeps the base architecture
    if src.startswith("shipped:"):
        from opid_mega.warm_starts import model_dir

        src = model_dir(src)
    if src:
        return model_facts(src)
    cached = os.path.join(os.path.expanduser(m.cache_dir), m.builtin)
    if os.path.isfile(os.path.join(cached, "config.json")):
        return model_facts(cached, name=m.builtin)
    if m.builtin.startswith("tiny-"):
        from opid_mega.models import _TINY_SHAPES

        return model_facts(dict(_TINY_SHAPES), name=m.builtin)
    return None


def config_layout_error(cfg, world: Optional[int] = None) -> Optional[str]:
    """:func:`layout_error` for an opid-train config on ``world`` ranks (None: WORLD_SIZE, else 1)."""
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    p = cfg.parallel
    if p.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            return "parallel.backend=nccl needs a GPU and this machine has none (use auto or gloo)"
    try:
        facts = config_model_facts(cfg)
    except LayoutError as e:
        return str(e)
    return layout_error(facts, tp=p.tp, pp=p.pp, vpp=p.vpp, sp=p.sequence_parallel, cp=getattr(p, "cp", 1),
                        world=world)
