"""``_extra_state`` entries across checkpoints written with and without Transformer Engine.

TE modules keep an ``_extra_state`` (fp8 metadata; empty without fp8) in every state dict; megatron-core's local
linears write a None one under the same names, so those keys match between the TE and the local spec. The core
attention did not: megatron's TE GPTModel writes ``...core_attention._extra_state`` (its TEDotProductAttention), its
local GPTModel nothing, and OPID's :class:`~opid_mega.megatron.attention.PackedCoreAttention` used to write
``...core_attention.te_attention._extra_state`` with TE and nothing without. PackedCoreAttention now always writes
``...core_attention._extra_state`` (None without TE) and reads the older key too; a checkpoint that lacks an
``_extra_state`` a model asks for (older ones, a local-spec GPTModel's) loads it as None -- never an error: an extra
state carries no weights. Used by :func:`opid_mega.megatron.checkpoint.load` and ``load_model``.
"""
from __future__ import annotations

SUFFIX = "_extra_state"


def _extra_state_objects(model_sd: dict) -> dict:
    """{local name: ShardedObject} of the ``_extra_state`` entries of one model's (flat) sharded state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {k: v for k, v in model_sd.items() if k.endswith(SUFFIX) and isinstance(v, ShardedObject)}


LEGACY = ("core_attention._extra_state", "core_attention.te_attention._extra_state")  # (now, before)


def drop_absent(model_sd: dict, ckpt_dir: str) -> list:
    """Fit ``model_sd`` (one model's flat sharded state dict, changed in place) to the checkpoint ``ckpt_dir``
    before a load: an ``_extra_state`` the checkpoint lacks is read from its older key where the checkpoint has that
    (``core_attention.te_attention._extra_state``), else removed from the request. Returns the local names removed
    (give them None after the load: :func:`fill_none`)."""
    import dataclasses

    wanted = _extra_state_objects(model_sd)
    if not wanted:
        return []
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    # ShardedObjects are listed by their unique keys ("<key>/shard_<offset>_<shape>"), tensors by their keys
    have = {k.split("/shard_")[0] for k in load_sharded_metadata(ckpt_dir)}
    gone = []
    for k, obj in wanted.items():
        if obj.key in have:
            continue
        now, before = LEGACY
        old = obj.key[:-len(now)] + before if obj.key.endswith(now) else None
        if old in have:
            model_sd[k] = dataclasses.replace(obj, key=old)
        else:
            del model_sd[k]
            gone.append(k)
    return gone


def fill_none(loaded_sd: dict, names) -> dict:
    """``loaded_sd`` with None for each of ``names`` (absent extra states), ready for a strict ``load_state_dict``."""
    for k in names:
        loaded_sd.setdefault(k, None)
    return loaded_sd
