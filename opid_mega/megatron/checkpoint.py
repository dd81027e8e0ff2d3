"""Save / resume with megatron-core distributed checkpointing: model, optimizer, RNG state, step.

Layout of ``<dir>/step_<N>/``: megatron's sharded checkpoint (model chunks ``model0..``, ``optimizer``, ``step``
and ``extra``) plus ``rng/rank<R>.pt`` (this rank's python/torch(/cuda) RNG states; a rank resuming from a checkpoint
that has no file for it, on more ranks than saved it, starts from states seeded by (step, rank): rank_rng_state). A
save writes everything into ``step_<N>.tmp/``, renames it to ``step_<N>`` once every rank is done (after the last barrier), and then writes
``latest_step`` (atomically), which names the newest committed checkpoint. So a run killed while saving leaves a
``step_<N>.tmp`` (or a ``step_<N>`` above ``latest_step``) that :func:`clean_uncommitted` removes at resume, and
resumes from the previous one. Before a save the free disk space is checked against the size of the previous
checkpoint (the first one: an estimate from the parameter and optimizer bytes): too little is a
:class:`CheckpointError` naming both numbers, raised before anything is written. Loading without an explicit step
takes the newest committed checkpoint that is complete (:func:`checkpoint_problem`: metadata, common state, tensor
files, every rank's RNG file); an unreadable one is skipped with one warning line (:func:`select_step`).

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
import errno
import json
import os
import random
import shutil
import signal
import sys
import threading
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from opid_mega.megatron import extra_state
from opid_mega.infra.files import fsync_path
from opid_mega.megatron.checkpoint_steps import latest_step, saved_steps  # noqa: F401  (part of this module's API)

MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"
MEGATRON_LM_CHECKPOINT_VERSION = 3.0

# Fault injection for the run-integrity tests: OPID_CKPT_FAULT="<point>[@<step>]" SIGKILLs the saving process at that
# point of a save (of that step only, with @<step>). In-process tests may append callables (point, step, path) to
# FAULT_HOOKS instead.
FAULT_ENV = "OPID_CKPT_FAULT"
FAULT_POINTS = ("tmp_made", "tensors_written", "rng_written", "before_rename", "renamed")
FAULT_HOOKS: list = []
DISK_FULL_BYTES = 4 << 20  # a save that fails with less free space than this failed for lack of space


class CheckpointError(RuntimeError):
    """A checkpoint that could not be saved (e.g. too little disk space); the message says why, with the numbers. The
    previous committed checkpoint is untouched and nothing of the failed one is left behind."""


def _fault(point: str, step: int, path: str) -> None:
    for hook in FAULT_HOOKS:
        hook(point, step, path)
    spec = os.environ.get(FAULT_ENV, "")
    if spec:
        name, _, at = spec.partition("@")
        if name == point and (not at or int(at) == step):
            os.kill(os.getpid(), signal.SIGKILL)


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
    (opid_mega.infra.shutdown: raised as shutdown.Interrupted). The writer processes megatron forks meanwhile inherit the
    holding handler, so the same signal (a terminal sends Ctrl-C to the whole process group) cannot kill them halfway
    through a file either. The write is marked in opid_mega.infra.shutdown, whose watchdog waits for it."""
    from opid_mega.infra import shutdown

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


_WRITER_QUEUE: Optional[threading.Thread] = None


def prepare_writer() -> None:
    """Start creating megatron's checkpoint-writer results queue in the background (idempotent). megatron's
    FileSystemWriterAsync makes it on a process's first save from a *spawn*-context Manager: a fresh interpreter that
    re-imports the main module (opid-train: ~4 s on the 2-core CI machine), inside the save's collectives, where a
    rank that much later than the others trips deploy.train_timeout_s. The trainer calls this at start-up, so the
    first save finds it ready. (A fork-context Manager would be instant but inherits the rank's file descriptors:
    a forked server that outlives a killed rank keeps the launcher from seeing that rank die.)

    A process that ends while the Manager is still starting must not hang at exit: multiprocessing's exit function
    joins every child process it started, the Manager's server among them, which serves until told to stop; its
    stop is registered only once it has started. So the thread is not a daemon (an interpreter's exit joins it
    first), and an exit finalizer that runs before that join (`_stop_writer`) waits for the start and stops the
    Manager: a process started by multiprocessing (a `parallel.spawn` rank) runs the exit function without joining
    its threads."""
    global _WRITER_QUEUE
    if _WRITER_QUEUE is not None:
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is not None:  # made already (or megatron changed)
        return
    from multiprocessing import util

    _WRITER_QUEUE = threading.Thread(target=_make_writer_queue, args=(filesystem_async,), name="ckpt-writer-queue",
                                     daemon=False)
    _WRITER_QUEUE.start()
    util.Finalize(None, _stop_writer, exitpriority=10)  # before the exit function's join of child processes


def _stop_writer() -> None:
    """At exit: the writer's Manager, once started, stopped (no more saves come)."""
    _writer_ready()
    if _WRITER_MANAGER is not None:
        _WRITER_MANAGER.shutdown()


_WRITER_MANAGER = None


def _make_writer_queue(filesystem_async) -> None:
    """megatron's results queue (filesystem_async._get_write_results_queue: a queue of a spawn-context Manager), from
    a Manager whose server process ends with this one: a Manager serves until it is told to stop, so a rank killed
    without a chance to stop it (SIGKILL, the OOM killer, a lost node's kill) would leave it running for good. The
    server imports torch.distributed.checkpoint in the background as it starts: it unpickles the write results (its
    classes) that each save puts on the queue, and importing them on the first save's put cost that save ~1.7 s."""
    global _WRITER_MANAGER
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from opid_mega.infra.tether import POLL_S, exit_with_owner, start_time

    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=exit_with_owner,
                  initargs=(os.getpid(), start_time(os.getpid()), POLL_S, ("torch.distributed.checkpoint",)))
    _WRITER_MANAGER = manager
    filesystem_async._results_queue = manager.Queue()


def _writer_ready() -> None:
    """Wait for prepare_writer's queue (the first save only); without it megatron makes the queue itself."""
    if _WRITER_QUEUE is not None:
        _WRITER_QUEUE.join()


def _save(ckpt_dir: str, step: int, chunks, optimizer, extra: Optional[dict], keep: int) -> str:
    final = os.path.join(ckpt_dir, f"step_{step}")
    tmp = final + ".tmp"
    _writer_ready()
    rank = dist.get_rank()
    check_disk_space(ckpt_dir, step, chunks, optimizer)  # a collective; raises on every rank, before any write
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    _fault("tmp_made", step, tmp)
    try:
        sd = _sharded_state(chunks, optimizer)
        sd["step"] = step
        sd["extra"] = {**(extra or {}), "world_size": dist.get_world_size()}
        sd["iteration"], sd["checkpoint_version"] = step, MEGATRON_LM_CHECKPOINT_VERSION  # what Megatron-LM reads
        dist_checkpointing.save(sd, tmp)
        _fault("tensors_written", step, tmp)
        if rank == 0:
            os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        dist.barrier()
        rng_file = os.path.join(tmp, "rng", f"rank{rank}.pt")
        torch.save(_rng_state(), rng_file)
        _fsync_file(rng_file)
    except (Exception, CheckpointException) as exc:  # (torch's CheckpointException is a BaseException)
        # torch's zip writer reports a short write as "unexpected pos ..." without the errno: a file system left
        # (nearly) without space counts as full too
        full = _is_disk_full(exc) or shutil.disk_usage(ckpt_dir).free < DISK_FULL_BYTES
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if full:
            free = shutil.disk_usage(ckpt_dir).free
            raise CheckpointError(f"checkpoint step_{step}: no space left on the device of {ckpt_dir} while writing "
                                  f"it ({free} bytes free now, after removing the partial {os.path.basename(tmp)}); "
                                  f"{_last_words(ckpt_dir)}") from exc
        raise
    dist.barrier()  # every rank's part is on disk
    _fault("rng_written", step, tmp)
    if rank == 0:
        _fault("before_rename", step, tmp)
        old = final + ".old"
        if os.path.exists(final):  # an uncommitted leftover of a killed run (above latest_step)
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_path(ckpt_dir)
        shutil.rmtree(old, ignore_errors=True)
        _fault("renamed", step, final)
        with open(os.path.join(ckpt_dir, "latest_step.tmp"), "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(ckpt_dir, "latest_step.tmp"), os.path.join(ckpt_dir, "latest_step"))
        fsync_path(ckpt_dir)
        if keep > 0:
            prune(ckpt_dir, keep)
    dist.barrier()
    return final


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _is_disk_full(exc: BaseException) -> bool:
    """Whether an exception (or one it wraps: torch.distributed.checkpoint gathers each rank's) is ENOSPC / EDQUOT."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        todo += [e.__cause__, e.__context__]
        for f in (getattr(e, "failures", None) or {}).values():  # CheckpointException: {rank: (exc, traceback)}
            todo.append(f[0] if isinstance(f, tuple) else f)
    return False


def _last_words(ckpt_dir: str) -> str:
    last = latest_step(ckpt_dir)
    return f"the last complete checkpoint is step_{last}" if last is not None else "no checkpoint was saved yet"


def dir_bytes(path: str) -> int:
    """Bytes a directory tree takes on disk (file sizes, or allocated blocks where larger)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += max(st.st_size, getattr(st, "st_blocks", 0) * 512)
    return total


def _local_state_bytes(chunks, optimizer) -> tuple[int, int]:
    """(model parameter bytes, optimizer state bytes) held by this rank."""
    model = sum(p.numel() * p.element_size() for c in chunks for p in _unwrap(c).parameters())
    opt = 0
    for part in (getattr(optimizer, "chained_optimizers", None) or [optimizer]) if optimizer is not None else []:
        inner = getattr(part, "optimizer", part)
        for st in getattr(inner, "state", {}).values():
            opt += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        for group in getattr(part, "shard_fp32_from_float16_groups", None) or \
                getattr(part, "fp32_from_float16_groups", None) or []:
            opt += sum(p.numel() * p.element_size() for p in group)
    return model, opt


def needed_bytes(ckpt_dir: str, chunks, optimizer) -> tuple[int, str]:
    """Collective: (bytes the next checkpoint needs, where that number comes from): the size of the latest committed
    checkpoint plus 1% and 1 MiB, or, before the first one, an estimate from every rank's parameter and optimizer
    state bytes (data-parallel replicas counted once; a distributed optimizer's shards each)."""
    last = latest_step(ckpt_dir) if dist.get_rank() == 0 else None
    prev = os.path.join(ckpt_dir, f"step_{last}") if last is not None else None
    model, opt = _local_state_bytes(chunks, optimizer)
    if dist.get_world_size() > 1:
        from megatron.core import parallel_state as ps

        from opid_mega.megatron.parallel import control_group

        dp = ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        sharded = _optimizer_metadata(optimizer) is not None if optimizer is not None else False
        t = torch.tensor([model / dp, opt if sharded else opt / dp], dtype=torch.float64)
        dist.all_reduce(t, group=control_group())
        model, opt = int(t[0]), int(t[1])
    if prev is not None and os.path.isdir(prev):
        size = dir_bytes(prev)
        basis = f"the size of step_{last}"
    else:
        size = model + opt
        basis = f"an estimate from the parameter ({model} bytes) and optimizer state ({opt} bytes)"
    return int(size * 1.01) + (1 << 20), basis


def check_disk_space(ckpt_dir: str, step: int, chunks, optimizer) -> None:
    """Collective: raise :class:`CheckpointError` on every rank when the file system of ``ckpt_dir`` has less free
    space than checkpoint ``step`` needs (:func:`needed_bytes`); decided by global rank 0."""
    need, basis = needed_bytes(ckpt_dir, chunks, optimizer)
    msg = None
    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        free = shutil.disk_usage(ckpt_dir).free
        if free < need:
            msg = (f"checkpoint step_{step} needs about {need} bytes ({basis}) but {ckpt_dir} has only {free} bytes "
                   f"free: nothing of it was written; {_last_words(ckpt_dir)}; free some space (or lower "
                   "train.keep_checkpoints) and resume")
    if dist.get_world_size() > 1:
        from opid_mega.megatron.parallel import control_group

        box = [msg]
        dist.broadcast_object_list(box, src=0, group=control_group())
        msg = box[0]
    if msg:
        raise CheckpointError(msg)


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


def checkpoint_problem(path: str) -> Optional[str]:
    """Why the checkpoint directory ``path`` cannot be resumed from (a few words), or None when it is complete:
    metadata.json, the common state (common.pt), torch's .metadata and every tensor file range it lists, and the RNG
    file of every rank that saved it."""
    if not os.path.isdir(path):
        return "missing"
    try:
        with open(os.path.join(path, "metadata.json")) as f:
            json.load(f)
    except FileNotFoundError:
        return "no metadata.json"
    except (OSError, ValueError):
        return "unreadable metadata.json"
    try:
        common = torch.load(os.path.join(path, "common.pt"), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        # megatron-core >= 0.19 keeps the common state inside the torch_dist files (a "common_state" object) and
        # writes no common.pt: read it the way that megatron-core does (0.16's reader looks for common.pt only)
        try:
            common = dist_checkpointing.load_common_state_dict(path)
        except Exception:  # noqa: BLE001 - an older megatron-core, or the object is missing / unreadable
            return "no common.pt"
    except Exception as e:  # noqa: BLE001 - any unpickling failure
        return f"unreadable common.pt ({type(e).__name__})"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001
        return f"unreadable .metadata ({type(e).__name__})"
    need: dict = {}
    for info in (getattr(meta, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in need.items():
        try:
            if os.path.getsize(os.path.join(path, rel)) < size:
                return f"truncated {rel}"
        except OSError:
            return f"no {rel}"
    extra = common.get("extra") if isinstance(common, dict) else None
    world = int(extra.get("world_size", 1)) if isinstance(extra, dict) else 1
    for r in range(world):
        f = os.path.join(path, "rng", f"rank{r}.pt")
        try:
            torch.load(f, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            return f"no rng/rank{r}.pt"
        except Exception as e:  # noqa: BLE001
            return f"unreadable rng/rank{r}.pt ({type(e).__name__})"
    return None


def select_step(ckpt_dir: str) -> tuple[Optional[int], Optional[str]]:
    """(the step to resume from, a warning line or None): the newest committed checkpoint (<= ``latest_step``; all of
    them when latest_step is missing) that :func:`checkpoint_problem` finds complete. The warning names the newer
    checkpoints skipped and why."""
    latest = latest_step(ckpt_dir)
    skipped = []
    for s in reversed([s for s in saved_steps(ckpt_dir) if latest is None or s <= latest]):
        why = checkpoint_problem(os.path.join(ckpt_dir, f"step_{s}"))
        if why is None:
            warn = None
            if skipped:
                warn = (f"warning: {'checkpoints' if len(skipped) > 1 else 'checkpoint'} "
                        f"{', '.join(f'step_{k} ({w})' for k, w in skipped)} in {ckpt_dir} unreadable; "
                        f"resuming from step_{s}, the newest complete one")
            return s, warn
        skipped.append((s, why))
    if skipped:
        return None, (f"warning: no complete checkpoint in {ckpt_dir}: "
                      f"{', '.join(f'step_{k} ({w})' for k, w in skipped)}")
    return None, None


def clean_uncommitted(ckpt_dir: str) -> list[str]:
    """Remove what a killed save left behind: ``step_<N>.tmp`` / ``step_<N>.old`` directories, ``latest_step.tmp``,
    and ``step_<N>`` directories above ``latest_step`` (renamed but not yet committed). Nothing is removed above a
    missing latest_step except the temporaries. Returns the names removed. (Global rank 0 only.)"""
    if not os.path.isdir(ckpt_dir):
        return []
    latest = latest_step(ckpt_dir)
    removed = []
    for name in sorted(os.listdir(ckpt_dir)):
        full = os.path.join(ckpt_dir, name)
        base, dot, suffix = name.partition(".")
        temp = base.startswith("step_") and base[5:].isdigit() and dot and suffix in ("tmp", "old")
        above = name.startswith("step_") and name[5:].isdigit() and latest is not None and int(name[5:]) > latest
        if temp or above:
            shutil.rmtree(full, ignore_errors=True)
            removed.append(name)
        elif name == "latest_step.tmp":
            os.remove(full)
            removed.append(name)
    if removed:
        fsync_path(ckpt_dir)
    return removed


def load(ckpt_dir: str, chunks, optimizer=None, step: Optional[int] = None) -> tuple[int, dict]:
    """Collective: restore model, optimizer and RNG from ``step`` (default: the newest complete committed checkpoint,
    :func:`select_step`; global rank 0 prints its warning line when it skips one). Returns (step, extra)."""
    if step is None:
        step, warn = select_step(ckpt_dir)
        if warn and dist.get_rank() == 0:
            print(f"opid-train: {warn}", file=sys.stderr, flush=True)
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint in {ckpt_dir}")
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
    rank, extra = dist.get_rank(), loaded.get("extra", {})
    saved_world = int(extra.get("world_size", 1)) if isinstance(extra, dict) else 1
    if rank == 0 and dist.get_world_size() > saved_world:
        print(f"opid-train: checkpoint step {step} was saved by {saved_world} rank(s), this run has "
              f"{dist.get_world_size()}: ranks {saved_world}..{dist.get_world_size() - 1} start from RNG states seeded "
              f"by (step, rank) (opid_mega.megatron.checkpoint.rank_rng_state)", flush=True)
    _set_rng_state(rank_rng_state(path, rank, int(loaded["step"])))
    return int(loaded["step"]), extra


def fallback_seed(step: int, rank: int) -> int:
    """The seed of a rank that has no RNG file in the checkpoint it resumes from (a resume on more ranks than saved
    it): a fixed function of (step, rank), so the same resume draws the same numbers, and no two ranks share one."""
    return (int(step) * 1_000_003 + int(rank) * 7_919 + 12_345) % (2 ** 31 - 1)


def rank_rng_state(path: str, rank: int, step: int) -> dict:
    """The RNG states rank `rank` resumes with from checkpoint directory `path`: its own ``rng/rank<R>.pt`` when the
    checkpoint has one (the same world size, or a rank below the saved world size when shrinking), else states
    seeded by ``fallback_seed(step, rank)``: python's and torch's generators from that seed and, on CUDA, the
    model-parallel tracker as Megatron seeds it (``model_parallel_cuda_manual_seed``) from ``fallback_seed(step, 0)``
    plus 100 x the pipeline rank, the same on every rank of a tensor-parallel group."""
    f = os.path.join(path, "rng", f"rank{int(rank)}.pt")
    if os.path.exists(f):
        return torch.load(f, weights_only=True)
    seed = fallback_seed(step, rank)
    py = random.Random(seed)
    st = {"python": py.getstate(), "torch": torch.Generator().manual_seed(seed).get_state()}
    if torch.cuda.is_available():
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

        saved_cuda = torch.cuda.get_rng_state()
        model_parallel_cuda_manual_seed(fallback_seed(step, 0) + 100 * parallel_state.get_pipeline_model_parallel_rank())
        st["cuda"] = torch.cuda.get_rng_state()
        st["tracker"] = get_cuda_rng_tracker().get_states()
        torch.cuda.set_rng_state(saved_cuda)
    return st


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
    common = torch.load(os.path.join(src, "common.pt"), map_location="cpu", weights_only=True)
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
