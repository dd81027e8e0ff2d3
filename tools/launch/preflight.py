"""Checks an opid-train command line before a launcher starts any rank (used by torchrun.sh and ray_launch.py).

    python tools/launch/preflight.py [--nnodes N] [--nproc-per-node P] -- [opid-train arguments]

Parses the opid-train arguments exactly as opid-train does (``--config``/``--resume``, ``--run-dir``, ``key=value``),
loads and validates the config, takes the node count and the ranks per node from its ``deploy`` section
(``opid_mega.placement.launch_shape``: deploy.nodes and the node's training GPUs; on a CPU config each "GPU" is one
rank), refuses ``--nnodes`` / ``--nproc-per-node`` values (NNODES / NPROC_PER_NODE of the launchers) that disagree
with it, checks this node's GPUs against deploy.gpus_per_node (GPU configs: fewer is an error) and the parallel
layout (TP/PP/VPP against the model) for that world size (``opid_mega.megatron.layout.config_layout_error``;
opid-train checks the same again in every rank, but only after torchrun has started them), and a model.path given
as a local directory: it exists and holds config.json and a tokenizer. On a problem: one line on
stderr, exit 2. Otherwise one line on stdout, ``NNODES NPROC_PER_NODE THREADS_PER_RANK``: the torch threads a rank
gets are the cores this process may use divided among the node's ranks — what ``opid_mega.infra.runtime.configure_threads``
gives a torchrun rank.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # a checkout that is not pip-installed
    sys.path.insert(0, str(ROOT))


def opid_train_parser() -> argparse.ArgumentParser:
    """opid-train's own arguments (``opid_mega.cli.train_main``)."""
    p = argparse.ArgumentParser(prog="opid-train", add_help=False)
    p.add_argument("--config")
    p.add_argument("--run-dir")
    p.add_argument("--resume", metavar="RUN_DIR|auto")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("overrides", nargs="*")
    return p


def load_train_config(argv: Sequence[str]):
    """The resolved config of an opid-train command line, as opid-train plans it (opid_mega.rundir.plan_run: a
    resume runs with the run's config.yaml, the overrides of its earlier resumes (resume_overrides.jsonl) and then
    this command line's), or raise ValueError(one line)."""
    from opid_mega import rundir
    from opid_mega.config import ConfigError

    args, unknown = opid_train_parser().parse_known_args(list(argv))
    if unknown:
        raise ValueError(f"unknown opid-train argument(s): {' '.join(unknown)}")
    try:
        return rundir.plan_run(args.config, args.run_dir, args.resume, args.overwrite, list(args.overrides)).cfg
    except ConfigError as e:
        raise ValueError(f"config error: {e}") from None
    except rundir.RunDirError as e:
        raise ValueError(str(e)) from None


def layout_error(cfg, world: int) -> Optional[str]:
    from opid_mega.megatron.layout import config_layout_error

    return config_layout_error(cfg, world)


def visible_gpus() -> int:
    """CUDA devices this process sees. Without a GPU driver's device files (NVIDIA's /dev/nvidiactl, ROCm's /dev/kfd)
    torch can see none: 0 without importing torch (seconds of the launch's start on a CPU machine)."""
    if not any(os.path.exists(dev) for dev in ("/dev/nvidiactl", "/dev/kfd")):
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable torch/CUDA: a CPU launch
        return 0


def launch_shape(cfg, nnodes: str = "", nproc: str = "", names=("NNODES", "NPROC_PER_NODE")) -> tuple[int, int]:
    """(nodes, ranks per node) from the config's deploy section; `nnodes` / `nproc` (the launcher's values, named
    `names` in messages; "" or "auto": not given) must agree with it. Raises ValueError(one line)."""
    from opid_mega.placement import PlacementError
    from opid_mega.placement import launch_shape as shape

    try:
        nodes, ranks = shape(cfg)
    except PlacementError as e:
        raise ValueError(f"placement: {e}") from None
    if ranks < 1:
        raise ValueError("deploy: no training GPU is left on a node (deploy.train_gpus_per_node / "
                         "deploy.rollout_gpus / deploy.analyzer_gpus)")
    for given, want, env, key, fix in (
            (nnodes, nodes, names[0], "deploy.nodes", "deploy.nodes"),
            (nproc, ranks, names[1], "the config's ranks per node (deploy.train_gpus_per_node, else what the placement "
                                     "leaves of deploy.gpus_per_node)", "deploy.train_gpus_per_node")):
        if given not in ("", "auto", None) and int(given) != want:
            raise ValueError(f"{env}={given} disagrees with {key} = {want}; leave {env} unset (the launchers take "
                             f"it from the config) or change the config ({fix}={given})")
    return nodes, ranks


def model_problem(cfg) -> Optional[str]:
    """model.path given as a local directory (absolute, ./, ../ or ~) must exist here and hold an HF model: its
    config.json and a tokenizer (tokenizer.json, tokenizer.model or tokenizer_config.json). A hub name or a built-in
    model (no path) is not checked here. None: fine."""
    path = str(cfg.model.path or "")
    if not path or not (os.path.isabs(path) or path.startswith(("./", "../", "~"))):
        return None
    d = os.path.expanduser(path)
    if not os.path.isdir(d):
        return f"model.path={path}: no such directory on this node ({os.uname().nodename})"
    if not os.path.isfile(os.path.join(d, "config.json")):
        return f"model.path={path}: no config.json there (not a Hugging Face model directory)"
    if not any(os.path.isfile(os.path.join(d, f)) for f in ("tokenizer.json", "tokenizer.model",
                                                            "tokenizer_config.json")):
        return f"model.path={path}: no tokenizer there (tokenizer.json, tokenizer.model or tokenizer_config.json)"
    return None


def gpu_problem(cfg, visible: int) -> Optional[str]:
    """A GPU config (parallel.backend not gloo) needs deploy.gpus_per_node GPUs on this node (None: fine)."""
    if cfg.parallel.backend == "gloo":
        return None
    want = cfg.deploy.gpus_per_node
    if cfg.parallel.backend == "auto" and visible == 0:
        return None  # auto on a machine without GPUs: a CPU run (gloo)
    if visible < want:
        return (f"this node has {visible} visible GPU(s), the config's deploy.gpus_per_node is {want} "
                f"(parallel.backend={cfg.parallel.backend}; CUDA_VISIBLE_DEVICES, or deploy.gpus_per_node)")
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, train_args = argv[:i], argv[i + 1:]
    else:
        own, train_args = argv, []
    p = argparse.ArgumentParser(prog="preflight", description=__doc__.splitlines()[0])
    p.add_argument("--nnodes", default="", help="NNODES given to the launcher (must agree with deploy.nodes)")
    p.add_argument("--nproc-per-node", default="", help="NPROC_PER_NODE given to the launcher (must agree with "
                                                         "the config's ranks per node)")
    a = p.parse_args(own)
    for name, v in (("NNODES", a.nnodes), ("NPROC_PER_NODE", a.nproc_per_node)):
        if v not in ("", "auto") and not (v.isdigit() and int(v) >= 1):
            print(f"preflight: {name}={v}, allowed: an integer >= 1", file=sys.stderr)
            return 2
    try:
        cfg = load_train_config(train_args)
        nnodes, nproc = launch_shape(cfg, a.nnodes, a.nproc_per_node)
    except ValueError as e:
        print(f"opid-train: {e}", file=sys.stderr)
        return 2
    msg = model_problem(cfg) or gpu_problem(cfg, visible_gpus())
    if msg:
        print(f"opid-train: {msg}", file=sys.stderr)
        return 2
    world = nnodes * nproc
    msg = layout_error(cfg, world)
    if msg:
        print(f"opid-train ({nnodes} node(s) x {nproc} rank(s) = world {world}): {msg}", file=sys.stderr)
        return 2
    from opid_mega.infra.runtime import available_cores

    print(nnodes, nproc, max(1, available_cores() // nproc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
