"""Which checkpoints a checkpoint directory holds, from its file names and ``latest_step`` alone: no torch, no
megatron-core, so a launcher's preflight and the run-directory plan (``--resume auto`` on a fresh run) answer in
a fraction of a second. opid_mega.megatron.checkpoint writes these names and re-exports both functions."""
from __future__ import annotations

import os
from typing import Optional


def saved_steps(ckpt_dir: str) -> list[int]:
    """Steps with a ``step_<N>`` directory in ``ckpt_dir``, ascending."""
    if not os.path.isdir(ckpt_dir):
        return []
    steps = []
    for name in os.listdir(ckpt_dir):
        if name.startswith("step_") and name[5:].isdigit() and os.path.isdir(os.path.join(ckpt_dir, name)):
            steps.append(int(name[5:]))
    return sorted(steps)


def latest_step(ckpt_dir: str) -> Optional[int]:
    """The step ``latest_step`` names (the newest committed checkpoint); None when there is none (or it is not a
    number: it is written atomically, so that is foreign content)."""
    p = os.path.join(ckpt_dir, "latest_step")
    try:
        with open(p) as f:
            text = f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return int(text) if text.isdigit() else None
