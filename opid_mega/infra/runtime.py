"""A process's runtime: the cores it may use, torch's thread count, and a quiet console (dependency warnings a user
can do nothing about filtered). Every command calls `quiet()` first."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def available_cores() -> int:
    """CPU cores this process may run on: its affinity mask (taskset, cpusets), capped by a cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:  # cgroup v2 quota, e.g. "200000 100000" = 2 cores ("max 100000" = no quota)
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def configure_threads() -> int:
    """torch's intra-op threads: OMP_NUM_THREADS when set, else the available cores split among the local ranks.

    torch's OpenMP threads spin while they wait, so two processes that each take every core slow each other down
    several-fold; a torchrun rank gets its share of the cores (LOCAL_WORLD_SIZE). Returns the thread count."""
    import torch

    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return torch.get_num_threads()  # the user's choice (torch read it at start)
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))))
    n = max(1, available_cores() // local)
    torch.set_num_threads(n)
    return n


def apply_core_budget(prog: str, cfg) -> bool:
    """deploy.trainer_cpus: pin this rank to those cores (before torch starts its threads) and size torch's threads
    to them. A core that does not exist here is one line and False."""
    cores = list(cfg.deploy.trainer_cpus)
    have = os.cpu_count() or 1
    bad = [c for c in list(cores) + list(cfg.deploy.server_cpus) if c >= have]
    if bad:
        print(f"{prog}: deploy.trainer_cpus / deploy.server_cpus: cores {bad} do not exist on this machine "
              f"({have} cores: 0-{have - 1})", file=sys.stderr)
        return False
    if cores:
        os.sched_setaffinity(0, cores)
        configure_threads()
    return True


def filter_dependency_warnings() -> None:
    """Warnings that dependencies raise and a user can do nothing about (see also pyproject's pytest filters)."""
    import warnings

    # SWIG-generated modules (TextWorld's / jericho's / fast-downward's bindings) on import
    warnings.filterwarnings("ignore", message=r"builtin type [Ss]wig\w* has no __module__ attribute",
                            category=DeprecationWarning)
    # megatron-core's own deprecation notices for arguments we do not pass
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\.core")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.core")
    # megatron-core's notices that it falls back to plain torch without Transformer Engine / Apex (always, on CPU)
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    # megatron-core's distributed optimizer / sequence parallel: torch's deprecation of the collectives megatron calls
    # (all_gather_into_tensor, reduce_scatter_tensor), and its zero_grad touching the .grad of fp32 shard views
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor",
                            category=UserWarning, module=r"megatron\.core")


def quiet() -> None:
    """A command's console: dependency warnings filtered, torch's threads set, no tokenizer fork warnings, no
    progress-bar redraws in a log file."""
    filter_dependency_warnings()
    configure_threads()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not sys.stderr.isatty():  # a log file: no Hugging Face "Loading weights" / "Writing shards" bar redraws
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
