"""Save / resume with megatron-core distributed checkpointing: model, optimizer, RNG state, step.

Layout of ``<dir>/step_<N>/``: megatron's sharded checkpoint (model chunks ``model0..``, ``optimizer``, ``step``
and ``extra``) plus ``rng/rank<R>.pt`` (this rank's python/torch(/cuda) RNG states). ``latest_step`` in ``<dir>``
names the newest complete checkpoint (written last, so a run killed while saving resumes from the previous one).
"""
from __future__ import annotations

import os
import random
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing


def _unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


def _sharded_state(chunks, optimizer, is_loading=False):
    sd = {f"model{i}": _unwrap(c).sharded_state_dict(prefix="") for i, c in enumerate(chunks)}
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(dict(sd), is_loading=is_loading)
    return sd


def _rng_state() -> dict:
    st = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        st["tracker"] = get_cuda_rng_tracker().get_states()
    return st


def _set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    torch.set_rng_state(st["torch"])
    if torch.cuda.is_available() and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"])
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(st["tracker"])


def save(ckpt_dir: str, step: int, chunks, optimizer=None, extra: Optional[dict] = None, keep: int = 0) -> str:
    """Collective: save everything for ``step``; returns the step directory. ``keep`` > 0: afterwards only the
    newest ``keep`` complete checkpoints stay on disk (older ``step_<N>`` directories are removed; 0 keeps all)."""
    path = os.path.join(ckpt_dir, f"step_{step}")
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    sd = _sharded_state(chunks, optimizer)
    sd["step"] = step
    sd["extra"] = extra or {}
    dist_checkpointing.save(sd, path)
    if rank == 0:
        os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    dist.barrier()
    torch.save(_rng_state(), os.path.join(path, "rng", f"rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(ckpt_dir, "latest_step.tmp"), "w") as f:
            f.write(str(step))
        os.replace(os.path.join(ckpt_dir, "latest_step.tmp"), os.path.join(ckpt_dir, "latest_step"))
        if keep > 0:
            prune(ckpt_dir, keep)
    dist.barrier()
    return path


def saved_steps(ckpt_dir: str) -> list[int]:
    """Steps with a ``step_<N>`` directory in ``ckpt_dir``, ascending."""
    if not os.path.isdir(ckpt_dir):
        return []
    steps = []
    for name in os.listdir(ckpt_dir):
        if name.startswith("step_") and name[5:].isdigit() and os.path.isdir(os.path.join(ckpt_dir, name)):
            steps.append(int(name[5:]))
    return sorted(steps)


def prune(ckpt_dir: str, keep: int) -> list[int]:
    """Remove all but the newest ``keep`` checkpoints up to the latest complete one (never the latest itself, never
    a newer, possibly incomplete one). Returns the removed steps."""
    import shutil

    if keep < 1:
        raise ValueError(f"prune: keep={keep} must be >= 1")
    latest = latest_step(ckpt_dir)
    if latest is None:
        return []
    done = [s for s in saved_steps(ckpt_dir) if s <= latest]
    removed = done[:-keep]
    for s in removed:
        shutil.rmtree(os.path.join(ckpt_dir, f"step_{s}"), ignore_errors=True)
    return removed


def latest_step(ckpt_dir: str) -> Optional[int]:
    p = os.path.join(ckpt_dir, "latest_step")
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return int(f.read().strip())


def load(ckpt_dir: str, chunks, optimizer=None, step: Optional[int] = None) -> tuple[int, dict]:
    """Collective: restore model, optimizer and RNG from ``step`` (default: the latest). Returns (step, extra)."""
    step = latest_step(ckpt_dir) if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir} (missing latest_step)")
    path = os.path.join(ckpt_dir, f"step_{step}")
    sd = _sharded_state(chunks, optimizer, is_loading=True)
    sd["step"] = step
    sd["extra"] = {}
    loaded = dist_checkpointing.load(sd, path)
    for i, c in enumerate(chunks):
        _unwrap(c).load_state_dict(loaded[f"model{i}"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    _set_rng_state(torch.load(os.path.join(path, "rng", f"rank{dist.get_rank()}.pt"), weights_only=False))
    return int(loaded["step"]), loaded.get("extra", {})
