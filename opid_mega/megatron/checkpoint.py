"""Save / resume with megatron-core distributed checkpointing: model, optimizer, RNG state, step.

Layout of ``<dir>/step_<N>/``: megatron's sharded checkpoint (model chunks ``model0..``, ``optimizer``, ``step``
and ``extra``) plus ``rng/rank<R>.pt`` (this rank's python/torch(/cuda) RNG states). ``latest_step`` in ``<dir>``
names the newest complete checkpoint (written last, so a run killed while saving resumes from the previous one).

The model entries are megatron-core's own ``sharded_state_dict`` keys (``embedding.word_embeddings.weight``,
``decoder.layers.self_attention.linear_qkv.weight`` with the layers stacked on a leading axis, ...; the local spec's
norms under the TE spec's names), the keys Megatron-LM writes and reads; the common state carries Megatron-LM's
``iteration`` and ``checkpoint_version``. So :func:`load_model` reads the weights of a Megatron-LM checkpoint (or of
any megatron-core distributed checkpoint) into OPID's model or a plain ``GPTModel``, a plain ``GPTModel`` reads ours
with ``dist_checkpointing.load``, and :func:`export_megatron_lm` lays one of ours out as Megatron-LM's
``iter_<N:07d>`` + ``latest_checkpointed_iteration.txt`` (load it with ``--load DIR --finetune --no-load-optim
--no-load-rng``). CLI: ``tools/convert_checkpoint.py``.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from opid_mega.megatron import extra_state

MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"
MEGATRON_LM_CHECKPOINT_VERSION = 3.0


def _unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


def _optimizer_metadata(optimizer) -> Optional[dict]:
    """The distributed optimizer's state goes in megatron's ``dp_reshardable`` format (Megatron-LM's default: each
    rank writes its own shard; its older default ``fully_sharded_model_space`` no longer saves in megatron-core 0.16);
    a plain optimizer's checkpoint keys stay as they were (None)."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    if any(getattr(getattr(o, "config", None), "use_distributed_optimizer", False) for o in parts):
        return {"distrib_optim_sharding_type": "dp_reshardable"}
    return None


def _sharded_state(chunks, optimizer, is_loading=False):
    sd = {f"model{i}": _unwrap(c).sharded_state_dict(prefix="") for i, c in enumerate(chunks)}
    if optimizer is not None:
        metadata = _optimizer_metadata(optimizer)
        if is_loading and metadata:
            # megatron's distributed optimizer without Apex/TE reads the Adam 'step' out of its (lazily created)
            # state while building the state dict to load: create that state first, as megatron's own loaders do
            # (its values are overwritten by the load)
            for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
                if hasattr(part, "_init_optimizer_states_with_dummy_values") and len(part.optimizer.state) == 0:
                    part._init_optimizer_states_with_dummy_values()
        sd["optimizer"] = optimizer.sharded_state_dict(dict(sd), is_loading=is_loading, metadata=metadata)
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


@contextlib.contextmanager
def _ctrl_c_after_write():
    """Ctrl-C (SIGINT) while a checkpoint is written is held back until the write is complete, then raised as
    KeyboardInterrupt; so are SIGTERM and SIGHUP when opid-train turned them into interrupts
    (opid_mega.shutdown: raised as shutdown.Interrupted). The writer processes megatron forks meanwhile inherit the
    holding handler, so the same signal (a terminal sends Ctrl-C to the whole process group) cannot kill them halfway
    through a file either. The write is marked in opid_mega.shutdown, whose watchdog waits for it."""
    from opid_mega import shutdown

    held = {} if threading.current_thread() is not threading.main_thread() else {
        s: h for s in shutdown.SIGNALS if shutdown.is_interrupt_handler(h := signal.getsignal(s))}
    caught = []
    for s in held:
        signal.signal(s, lambda signum, _frame: caught.append(signum))
    try:
        with shutdown.writing():
            yield
    finally:
        for s, h in held.items():
            signal.signal(s, h)
    if caught:
        raise KeyboardInterrupt if caught[0] == signal.SIGINT else shutdown.Interrupted(caught[0])


def save(ckpt_dir: str, step: int, chunks, optimizer=None, extra: Optional[dict] = None, keep: int = 0) -> str:
    """Collective: save everything for ``step``; returns the step directory. ``keep`` > 0: afterwards only the
    newest ``keep`` complete checkpoints stay on disk (older ``step_<N>`` directories are removed; 0 keeps all).
    A Ctrl-C during the save takes effect once the checkpoint is complete."""
    with _ctrl_c_after_write():
        return _save(ckpt_dir, step, chunks, optimizer, extra, keep)


def _fork_results_queue() -> None:
    """megatron's FileSystemWriterAsync collects its writers' results on a queue from a *spawn*-context Manager,
    created on a process's first save: a fresh interpreter that re-imports the main module (opid-train: torch,
    megatron), ~4 s on the 2-core CI machine, inside the save's collectives (a rank that is that much later than
    the others trips deploy.train_timeout_s). A fork-context Manager gives the same queue proxy in milliseconds;
    megatron forks its writer processes anyway."""
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:  # megatron's lazily created global
        filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()


def _save(ckpt_dir: str, step: int, chunks, optimizer, extra: Optional[dict], keep: int) -> str:
    path = os.path.join(ckpt_dir, f"step_{step}")
    _fork_results_queue()
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    sd = _sharded_state(chunks, optimizer)
    sd["step"] = step
    sd["extra"] = extra or {}
    sd["iteration"], sd["checkpoint_version"] = step, MEGATRON_LM_CHECKPOINT_VERSION  # what Megatron-LM reads
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
    # extra states the checkpoint lacks (written without TE's, or before PackedCoreAttention had its own) load as None
    absent = {i: extra_state.drop_absent(sd[f"model{i}"], path) for i in range(len(chunks))}
    sd["step"] = step
    sd["extra"] = {}
    loaded = dist_checkpointing.load(sd, path)
    for i, c in enumerate(chunks):
        _unwrap(c).load_state_dict(extra_state.fill_none(loaded[f"model{i}"], absent[i]))
    if optimizer is not None:
        with torch.no_grad():  # the distributed optimizer's fp32 main params are views of the model's parameters
            optimizer.load_state_dict(loaded["optimizer"])
        for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            # megatron's distributed optimizer (torch Adam, no Apex/TE) loads ONE 'step' tensor into every parameter's
            # state; torch's Adam increments each parameter's step in place, so a shared tensor would count every
            # parameter. Give each its own copy.
            inner = getattr(part, "optimizer", None)
            for st in getattr(inner, "state", {}).values():
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].clone()
    _set_rng_state(torch.load(os.path.join(path, "rng", f"rank{dist.get_rank()}.pt"), weights_only=False))
    return int(loaded["step"]), loaded.get("extra", {})


def checkpoint_dir(path: str, step: Optional[int] = None) -> str:
    """The megatron-core distributed checkpoint directory ``path`` names: OPID's checkpoint directory
    (``latest_step`` -> ``step_<N>``), Megatron-LM's ``--save`` directory (``latest_checkpointed_iteration.txt`` ->
    ``iter_<N:07d>`` or ``release``), or a checkpoint directory itself (it holds ``metadata.json``). ``step``: that
    step / iteration instead of the latest."""
    if os.path.exists(os.path.join(path, "metadata.json")) and step is None:
        return path
    ours = os.path.exists(os.path.join(path, "latest_step")) or (step is not None and saved_steps(path))
    mlm_tracker = os.path.join(path, MEGATRON_LM_TRACKER)
    if ours:
        found = os.path.join(path, f"step_{latest_step(path) if step is None else step}")
    elif os.path.exists(mlm_tracker) or step is not None:
        if step is None:
            with open(mlm_tracker) as f:
                text = f.read().strip()
            found = os.path.join(path, "release" if text == "release" else f"iter_{int(text):07d}")
        else:
            found = os.path.join(path, f"iter_{step:07d}")
    else:
        raise FileNotFoundError(f"{path} is no distributed checkpoint: no metadata.json, latest_step or "
                                f"{MEGATRON_LM_TRACKER}")
    if not os.path.exists(os.path.join(found, "metadata.json")):
        raise FileNotFoundError(f"{found} (named by {path}) is no complete distributed checkpoint (no metadata.json)")
    return found


def model_sharded_state(chunks) -> dict:
    """The model entries as Megatron-LM nests them: ``{"model": ...}``, or ``{"model0": ..., "model1": ...}`` for
    interleaved chunks. (The checkpoint's tensor keys do not depend on this nesting.)"""
    if len(chunks) == 1:
        return {"model": _unwrap(chunks[0]).sharded_state_dict(prefix="")}
    return {f"model{i}": _unwrap(c).sharded_state_dict(prefix="") for i, c in enumerate(chunks)}


def load_model(path: str, chunks, step: Optional[int] = None) -> str:
    """Collective: only the model weights of ``chunks`` (OpidGPTModel or a plain megatron-core GPTModel, wrapped or
    not, any TP/PP layout) from the distributed checkpoint ``path`` names (:func:`checkpoint_dir`: OPID's or
    Megatron-LM's). Optimizer, RNG and trainer state are left alone. A tensor the model needs that the checkpoint
    lacks, or one of another shape, is an error naming it. Returns the checkpoint directory read."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    ckpt = checkpoint_dir(path, step)
    sd = model_sharded_state(chunks)
    no_extra = {key: extra_state.drop_absent(sd[key], ckpt) for key in sd}  # None for extra states it lacks
    try:
        loaded, _, absent = dist_checkpointing.load(sd, ckpt, strict=StrictHandling.RETURN_UNEXPECTED)
    except (CheckpointingException, CheckpointException) as e:  # e.g. "Global shape mismatch ... for key ..."
        causes = [f[0] for f in getattr(e, "failures", {}).values()] or [e]  # torch wraps each rank's exception
        raise ValueError(f"{ckpt} does not fit the model: {causes[0]}") from e
    if absent:
        names = sorted(absent)
        raise ValueError(f"{ckpt} lacks {len(names)} tensor(s) the model needs, e.g. {', '.join(names[:4])}")
    for key, c in zip(sd, chunks):
        _unwrap(c).load_state_dict(extra_state.fill_none(loaded[key], no_extra[key]))
    return ckpt


def export_megatron_lm(ckpt_dir: str, out_dir: str, step: Optional[int] = None) -> str:
    """Lay OPID checkpoint ``step`` (default: the latest) of ``ckpt_dir`` out as Megatron-LM's: ``out_dir/iter_<N:07d>``
    (the tensor files hard-linked, copied where links fail; the common state rewritten with ``iteration`` and
    ``checkpoint_version``; our per-rank RNG files left out) and ``out_dir/latest_checkpointed_iteration.txt``. No
    process group needed. Returns the new iteration directory."""
    import shutil

    src = checkpoint_dir(ckpt_dir, step)
    with open(os.path.join(src, "metadata.json")) as f:
        meta = json.load(f)
    if meta.get("common_backend", "torch") != "torch":
        raise ValueError(f"{src}: common state backend {meta.get('common_backend')!r} (expected torch)")
    common = torch.load(os.path.join(src, "common.pt"), map_location="cpu", weights_only=False)
    it = int(common.get("step", common.get("iteration", 0))) if step is None else step
    dst = os.path.join(out_dir, f"iter_{it:07d}")
    if os.path.exists(dst):
        raise FileExistsError(f"{dst} exists")
    for root, dirs, files in os.walk(src):
        rel = os.path.relpath(root, src)
        if rel == ".":
            dirs[:] = [d for d in dirs if d != "rng"]  # OPID's per-rank RNG files: not Megatron-LM's format
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        for name in files:
            if rel == "." and name == "common.pt":
                continue
            a, b = os.path.join(root, name), os.path.join(dst, rel, name)
            try:
                os.link(a, b)
            except OSError:
                shutil.copy2(a, b)
    common["iteration"], common["checkpoint_version"] = it, MEGATRON_LM_CHECKPOINT_VERSION
    torch.save(common, os.path.join(dst, "common.pt"))
    tmp = os.path.join(out_dir, MEGATRON_LM_TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(it))
    os.replace(tmp, os.path.join(out_dir, MEGATRON_LM_TRACKER))
    return dst
