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
from typing import Optional


class PlacementError(ValueError):
    """A placement that cannot work; the message names the deploy key."""


@dataclass
class NodePlacement:
    train_gpus: list
    rollout_groups: list
    analyzer_gpus: list


def placement_problems(deploy, *, servers: Optional[int] = None,
                       analyzer_launched: bool = False) -> tuple[NodePlacement, list[str]]:
    """This node's placement and EVERY problem with it (each message starts with the deploy key it names); the
    placement is filled in as far as the rules allow, so the planner can report it beside the problems.
    `servers`: rollout servers this node launches (default deploy.rollout_servers_per_node; 0: none, e.g. the run
    attaches to running servers); `analyzer_launched`: the trainer starts an analyzer server on this GPU machine."""
    errors: list[str] = []
    g, tp = deploy.gpus_per_node, deploy.rollout_tp
    n = deploy.rollout_servers_per_node if servers is None else servers
    analyzer = list(deploy.analyzer_gpus)
    explicit = [list(grp) for grp in deploy.rollout_gpus] if n else []
    for key, ids in (("deploy.rollout_gpus", [i for grp in explicit for i in grp]), ("deploy.analyzer_gpus", analyzer)):
        bad = sorted({i for i in ids if i >= g})
        if bad:
            errors.append(f"{key}: GPU ids {bad} do not exist on a node of deploy.gpus_per_node={g} GPUs "
                          f"(ids 0..{g - 1})")
    if len(set(analyzer)) != len(analyzer):
        errors.append(f"deploy.analyzer_gpus: {analyzer} lists a GPU twice")
    if deploy.mode == "colocated":  # training GPUs 0..T-1, servers on the training GPUs in order
        want = deploy.train_gpus_per_node or g
        if want > g:
            errors.append(f"deploy.train_gpus_per_node: {want} training GPUs on a node of deploy.gpus_per_node={g}")
        train = list(range(min(want, g)))
        groups = explicit or [train[i * tp:(i + 1) * tp] for i in range(n) if (i + 1) * tp <= len(train)]
        if not explicit and n * tp > len(train):
            errors.append(f"deploy.rollout_servers_per_node: {n} servers x deploy.rollout_tp={tp} = {n * tp} GPUs do "
                          f"not fit the {len(train)} training GPUs of a node (colocated: servers go on the training "
                          "GPUs in order)")
    else:  # servers on the node's last GPUs not given to the analyzer (or rollout_gpus), training on the first left
        free = [i for i in range(g) if i not in analyzer]
        groups = explicit
        if not groups and n:
            if n * tp > len(free):
                errors.append(f"deploy.rollout_servers_per_node: {n} servers x deploy.rollout_tp={tp} = {n * tp} GPUs "
                              f"do not fit the {len(free)} GPUs of a node left by deploy.analyzer_gpus={analyzer}")
            tail = free[max(len(free) - n * tp, 0):]
            groups = [tail[i * tp:(i + 1) * tp] for i in range(n) if (i + 1) * tp <= len(tail)]
        used = {i for grp in groups for i in grp}
        left = [i for i in free if i not in used]
        want = deploy.train_gpus_per_node or len(left)
        if want == 0 or want > len(left):
            errors.append(f"deploy.train_gpus_per_node: {deploy.train_gpus_per_node} asked, {len(left)} GPUs of a node "
                          f"are left for training after the rollout servers {groups} and the analyzer {analyzer} "
                          "(disaggregated mode: servers need their own GPUs)")
        train = left[:want]
        overlap = sorted(used & set(train))
        if overlap:
            errors.append(f"deploy.rollout_gpus: GPUs {overlap} are training GPUs; disaggregated servers need their own")
    if any(len(grp) != tp for grp in explicit):
        errors.append(f"deploy.rollout_gpus: {explicit} must be groups of deploy.rollout_tp={tp} GPU ids")
    flat = [i for grp in groups for i in grp]
    if len(set(flat)) != len(flat) or any(len(set(grp)) != len(grp) for grp in groups):
        errors.append(f"deploy.rollout_gpus: {groups} puts a GPU in two rollout servers")
    if analyzer_launched and not analyzer:
        errors.append("deploy.analyzer_gpus: the trainer launches an SGLang analyzer server (analyzer.backend=llm, "
                      f"analyzer.base_url empty) and needs its GPU ids on node 0, outside the training GPUs {train} "
                      "(or set analyzer.base_url)")
    clash = sorted(set(analyzer) & set(train))
    if clash:
        errors.append(f"deploy.analyzer_gpus: analyzer GPUs {clash} are training GPUs {train} (lower "
                      "deploy.train_gpus_per_node)")
    return NodePlacement(train, groups, analyzer), errors


def node_placement(deploy, analyzer_launched: bool = False) -> NodePlacement:
    """The launcher's placement of this node; PlacementError with the first problem (`placement_problems` has all)."""
    placement, errors = placement_problems(deploy, analyzer_launched=analyzer_launched)
    if errors:
        raise PlacementError(errors[0])
    return placement


def launch_shape(cfg) -> tuple[int, int]:
    """(nodes, ranks per node) of a run, from its config (what the launchers start; tools/launch/preflight.py):
    deploy.nodes, and the training GPUs of a node by the placement rules above (deploy.train_gpus_per_node, or what
    the placement leaves for training). On a CPU config each "GPU" is one rank. PlacementError with the first
    problem of the placement."""
    d, r = cfg.deploy, cfg.rollout
    servers = d.rollout_servers_per_node if (r.engine == "sglang" and not r.sglang_url) else 0
    gpu = cfg.parallel.backend != "gloo"
    analyzer = gpu and cfg.algo.needs_analysis and cfg.analyzer.backend == "llm" and not cfg.analyzer.base_url
    placement, errors = placement_problems(d, servers=servers, analyzer_launched=analyzer)
    if errors:
        raise PlacementError(errors[0])
    return d.nodes, len(placement.train_gpus)
