"""The learning-rate schedules of a run, as the reference steps them."""
from __future__ import annotations


def learning_rate(train, it: int) -> float:
    """The learning rate of iteration `it` (1-based) under `train.lr_scheduler` (a TrainConfig): constant ->
    train.lr; warmup -> train.lr * min(1, (it - 1) / W) with W = int(train.lr_warmup_ratio * train.iterations), the
    reference's constant schedule with linear warm-up, stepped once per iteration after the update (so its first
    update runs at 0). Every mini-batch of an iteration uses the same rate."""
    if train.lr_scheduler == "constant":
        return train.lr
    if train.lr_scheduler != "warmup":
        raise ValueError(f"train.lr_scheduler={train.lr_scheduler!r}, allowed: constant, warmup")
    warmup = int(train.lr_warmup_ratio * train.iterations)
    if warmup <= 0 or it - 1 >= warmup:
        return train.lr
    return train.lr * (it - 1) / warmup
