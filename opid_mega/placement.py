"""GPU placement on one node from the `deploy` config section (no torch; used by the trainer's launcher code).

    p = node_placement(cfg.deploy, analyzer_launched=True)
    p.train_gpus      # GPU ids of this node's Megatron ranks (local rank i -> p.train_gpus[i])
    p.rollout_groups  # one list of GPU ids per rollout server of this node (its CUDA_VISIBLE_DEVICES, its --tp)
    p.analyzer_gpus   # GPU ids of the analyzer server (node 0)

colocated: the rollout servers share the training GPUs (default: the training GPUs in order, rollout_tp per server).
disaggregated: servers get GPUs of their own (default: the node's last GPUs not given to the analyzer); every node
keeps the same number of training GPUs (torchrun starts the same number of ranks per node), so analyzer GPUs are left
out of training on every node. The analyzer server may never share a training GPU: it must be placed explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass


class PlacementError(ValueError):
    """A placement that cannot work; the message names the deploy key."""


@dataclass
class NodePlacement:
    train_gpus: list
    rollout_groups: list
    analyzer_gpus: list


def node_placement(deploy, analyzer_launched: bool = False) -> NodePlacement:
    g = deploy.gpus_per_node
    tp, n = deploy.rollout_tp, deploy.rollout_servers_per_node
    analyzer = list(deploy.analyzer_gpus)
    for key, ids in (("deploy.analyzer_gpus", analyzer),
                     ("deploy.rollout_gpus", [i for grp in deploy.rollout_gpus for i in grp])):
        bad = [i for i in ids if i >= g]
        if bad:
            raise PlacementError(f"{key}: GPU ids {bad} do not exist on a node of deploy.gpus_per_node={g}")
    if deploy.mode == "colocated":
        train = list(range(deploy.train_gpus_per_node or g))
        if len(train) > g:
            raise PlacementError(f"deploy.train_gpus_per_node={len(train)} exceeds deploy.gpus_per_node={g}")
        groups = [list(grp) for grp in deploy.rollout_gpus] or [train[i * tp:(i + 1) * tp] for i in range(n)]
        if any(len(grp) != tp for grp in groups):
            raise PlacementError(f"deploy.rollout_servers_per_node={n} x deploy.rollout_tp={tp} needs {n * tp} "
                                 f"GPUs; colocated servers share the {len(train)} training GPUs")
    else:
        free = [i for i in range(g) if i not in analyzer]
        groups = [list(grp) for grp in deploy.rollout_gpus]
        if not groups:
            if n * tp > len(free):
                raise PlacementError(f"deploy.rollout_servers_per_node={n} x deploy.rollout_tp={tp} GPUs do not fit "
                                     f"the {len(free)} GPUs of a node left by deploy.analyzer_gpus={analyzer}")
            tail = free[len(free) - n * tp:]
            groups = [tail[i * tp:(i + 1) * tp] for i in range(n)]
        used = {i for grp in groups for i in grp}
        left = [i for i in free if i not in used]
        want = deploy.train_gpus_per_node or len(left)
        if want > len(left) or want == 0:
            raise PlacementError(f"deploy.train_gpus_per_node={deploy.train_gpus_per_node}: only {len(left)} GPUs "
                                 f"of a node are left for training after the rollout servers {groups} and the "
                                 f"analyzer {analyzer}")
        train = left[:want]
        overlap = sorted(used & set(train))
        if overlap:
            raise PlacementError(f"deploy.rollout_gpus: GPUs {overlap} are training GPUs; disaggregated servers need "
                                 "their own")
    flat = [i for grp in groups for i in grp]
    if len(set(flat)) != len(flat):
        raise PlacementError(f"deploy.rollout_gpus: two servers share a GPU in {groups}")
    clash = sorted(set(analyzer) & set(train))
    if clash:
        raise PlacementError(f"deploy.analyzer_gpus: GPUs {clash} are training GPUs; the analyzer server needs GPUs "
                             "that no training rank uses")
    if analyzer_launched and not analyzer:
        raise PlacementError("deploy.analyzer_gpus: empty, but the trainer launches an analyzer server "
                             "(analyzer.backend=llm, analyzer.base_url empty) on this GPU machine: give it GPU ids "
                             "that no training rank uses, or point analyzer.base_url at a running server")
    return NodePlacement(train, groups, analyzer)
