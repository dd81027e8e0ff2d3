"""Checks an opid-train command line before a launcher starts any rank (used by torchrun.sh and ray_launch.py).

    python tools/launch/preflight.py --world N [--nproc-per-node P|auto] -- [opid-train arguments]

Parses the opid-train arguments exactly as opid-train does (``--config``/``--resume``, ``--run-dir``, ``key=value``),
loads and validates the config and checks its parallel layout (TP/PP/VPP against the model) for the world size
the launch will have (``opid_mega.megatron.layout.config_layout_error``; opid-train checks the same again in every
rank, but only after torchrun has started them). On a problem: one line on stderr, exit 2. Otherwise one line on
stdout, ``NPROC_PER_NODE THREADS_PER_RANK``: the processes per node (``auto``: the visible GPUs, else 1) and the
torch threads a rank gets (the cores this process may use, divided among the node's ranks — what
``opid_mega.cli.configure_threads`` gives a torchrun rank).
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
    p.add_argument("--resume", metavar="RUN_DIR")
    p.add_argument("overrides", nargs="*")
    return p


def load_train_config(argv: Sequence[str]):
    """The resolved config of an opid-train command line (as opid-train builds it), or raise ValueError(one line)."""
    from opid_mega.config import ConfigError, load_config

    args, unknown = opid_train_parser().parse_known_args(list(argv))
    if unknown:
        raise ValueError(f"unknown opid-train argument(s): {' '.join(unknown)}")
    try:
        if args.resume:
            saved = Path(args.resume) / "config.yaml"
            if not saved.exists():
                raise ValueError(f"--resume {args.resume}: no config.yaml there (not a run directory)")
            cfg = load_config(str(saved), list(args.overrides))
            cfg.logging.run_dir = args.resume
        else:
            if not args.config:
                raise ValueError("--config is required (or --resume RUN_DIR)")
            cfg = load_config(args.config, list(args.overrides))
            if args.run_dir:
                cfg.logging.run_dir = args.run_dir
    except ConfigError as e:
        raise ValueError(f"config error: {e}") from None
    return cfg


def layout_error(cfg, world: int) -> Optional[str]:
    from opid_mega.megatron.layout import config_layout_error

    return config_layout_error(cfg, world)


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable torch/CUDA: a CPU launch
        return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, train_args = argv[:i], argv[i + 1:]
    else:
        own, train_args = argv, []
    p = argparse.ArgumentParser(prog="preflight", description=__doc__.splitlines()[0])
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--nproc-per-node", default="auto")
    a = p.parse_args(own)
    nproc = (visible_gpus() or 1) if a.nproc_per_node in ("", "auto") else int(a.nproc_per_node)
    world = a.nnodes * nproc
    try:
        cfg = load_train_config(train_args)
    except ValueError as e:
        print(f"opid-train: {e}", file=sys.stderr)
        return 2
    msg = layout_error(cfg, world)
    if msg:
        print(f"opid-train ({a.nnodes} node(s) x {nproc} rank(s) = world {world}): {msg}", file=sys.stderr)
        return 2
    from opid_mega.cli import available_cores

    print(nproc, max(1, available_cores() // nproc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
