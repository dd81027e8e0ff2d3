"""opid-train on a Ray cluster: one Ray actor per Megatron rank, placed by placement groups.

    python tools/launch/ray_launch.py --config FILE [--run-dir D | --resume RUN_DIR] [--address auto|HOST:PORT|ray://...]
                                      [--nodes N] [--trainers-per-node K] [--cpus-per-trainer C] [key=value ...]

Without ``--address`` it starts a local Ray instance for the run (and stops it at the end); ``--address auto``
joins the cluster started on this machine with ``ray start``; ``ray://host:10001`` goes through Ray Client. The
config arguments are opid-train's, verbatim; they are checked (config and parallel layout for the world size
N x K, ``tools/launch/preflight.py``) before Ray starts. ``--resume auto`` goes first (unless they say ``--resume`` or
``--overwrite``), so running the same command again after a failure continues the run from its last complete
checkpoint (docs/runs.md).

Nodes and ranks per node come from the config's ``deploy`` section (deploy.nodes; the node's training GPUs,
``opid_mega.placement.launch_shape``), as for torchrun.sh; ``--nodes`` / ``--trainers-per-node`` that disagree are an
error (one line, exit 2), and so is a Ray GPU node with fewer GPUs than deploy.gpus_per_node.

Placement. Every node of the run gets one placement group with strategy STRICT_PACK (all its bundles on one Ray
node): K bundles, one per trainer rank, ``{"GPU": 1, "CPU": C}`` on a cluster with GPUs, ``{"CPU": C}`` without.
Ranks are numbered node by node (rank = node * K + local rank), so the usual Megatron layout (TP innermost) keeps a
TP group inside a node, exactly as under torchrun.

SGLang engines. The engines of a node run on that node, as child processes of the node's trainers (opid-train
launches them; today global rank 0 does, see ``deploy`` in ``opid_mega/config/schema.py``), never as separate Ray actors:

* GPU, ``deploy.mode: colocated``: the engines share the training GPUs the node's group already holds.
* GPU, ``deploy.mode: disaggregated``: the node's group gets one more bundle, ``{"GPU": G}`` with G the engines'
  GPUs (``deploy.rollout_servers_per_node * deploy.rollout_tp``, or the ids in ``deploy.rollout_gpus``), so Ray
  reserves them on the same node; no actor runs in it.
* On GPU the actors see all the node's GPUs (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``) and use them as under
  torchrun: ``LOCAL_RANK`` = the GPU of the rank, the engines' GPUs from the ``deploy`` section. This is exact when a
  node's group holds the whole node (K + G = its GPUs, the planner's layout); a warning says when it does not.
* CPU: rank 0 launches its own engine as today (the embedded local engine, or an SGLang server process) on the CPUs
  of its node, outside the bundles' accounting.

Each actor sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``GROUP_WORLD_SIZE``
(the node count, as torchrun does), ``MASTER_ADDR`` (the node IP of rank 0's actor) and ``MASTER_PORT`` (a free port that rank 0's actor found on its node), sets its
torch/OpenMP threads to its bundle's CPUs, then runs ``opid_mega.cli.train_main`` in its own process — the same
function as the ``opid-train`` command (argument parsing, layout check, ``opid_mega.trainer.train``, the same exit
codes). The launcher waits for all ranks; when one fails (an exception or a non-zero exit code) it names the rank,
kills the others (which would otherwise wait on collectives until their timeout), removes the placement groups and
exits with that rank's exit code (1 for an exception).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import preflight  # noqa: E402  (tools/launch/preflight.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TrainerRank:
    """One Megatron rank: a Ray actor whose process runs ``opid_mega.cli.train_main``."""

    def __init__(self, threads: int, cwd: str):
        os.environ["OMP_NUM_THREADS"] = str(threads)  # before torch is imported in this process
        if os.path.isdir(cwd):  # the driver's directory (a shared file system on a multi-node cluster)
            os.chdir(cwd)
        self.threads = threads

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return _free_port()

    def run(self, env: dict, argv: list) -> int:
        os.environ.update({k: str(v) for k, v in env.items()})
        import torch

        torch.set_num_threads(self.threads)  # opid_mega.infra.runtime.configure_threads keeps it (OMP_NUM_THREADS is set)
        from opid_mega.cli import train_main

        try:
            return int(train_main(argv) or 0)
        except SystemExit as e:  # argparse / config errors exit like the command would
            return e.code if isinstance(e.code, int) else 1


def engine_gpus(cfg) -> int:
    d = cfg.deploy
    if d.mode != "disaggregated":
        return 0
    return len({g for group in d.rollout_gpus for g in group}) if d.rollout_gpus \
        else d.rollout_servers_per_node * d.rollout_tp


def parse(argv: Optional[Sequence[str]]):
    p = argparse.ArgumentParser(prog="ray_launch.py", description="opid-train on Ray (one actor per rank)",
                                epilog="Other arguments go to opid-train verbatim (--config, --run-dir, --resume, "
                                       "key=value).")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join: auto | HOST:PORT | ray://HOST:PORT (default: start a local one)")
    p.add_argument("--nodes", type=int, default=None,
                   help="nodes (one placement group each) [deploy.nodes of the config; a different value is an error]")
    p.add_argument("--trainers-per-node", type=int, default=None,
                   help="trainer ranks per node [the config's training GPUs per node (deploy); a different value is "
                        "an error]")
    p.add_argument("--cpus-per-trainer", type=float, default=None,
                   help="CPUs of a rank's bundle = its torch threads [local CPU run: cores / ranks; else 1]")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the whole run is killed [none]")
    return p.parse_known_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, train_argv = parse(argv)
    if (args.nodes is not None and args.nodes < 1) or (args.trainers_per_node is not None and args.trainers_per_node < 1):
        print("ray_launch.py: --nodes and --trainers-per-node must be >= 1", file=sys.stderr)
        return 2
    try:
        cfg = preflight.load_train_config(with_resume_auto(train_argv))  # what the ranks will run
        # nodes and ranks per node come from the config's deploy section (the same rule as torchrun.sh)
        args.nodes, args.trainers_per_node = preflight.launch_shape(
            cfg, str(args.nodes or ""), str(args.trainers_per_node or ""), names=("--nodes", "--trainers-per-node"))
    except ValueError as e:
        print(f"opid-train: {e}", file=sys.stderr)
        return 2
    # run directory and config as absolute paths: the actors may start in another directory
    train_argv = with_resume_auto(absolute_paths(train_argv))

    from opid_mega.infra.runtime import available_cores

    if args.trainers_per_node is not None:  # check the layout before starting anything
        world = args.nodes * args.trainers_per_node
        msg = preflight.layout_error(cfg, world)
        if msg:
            print(f"opid-train ({args.nodes} node(s) x {args.trainers_per_node} rank(s) = world {world}): {msg}",
                  file=sys.stderr)
            return 2

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    local = args.address is None
    t0 = time.monotonic()
    if local:
        k = args.trainers_per_node or 1
        per = args.cpus_per_trainer or max(1, available_cores() // (args.nodes * k))
        # logical CPUs: enough for every bundle even when the ranks oversubscribe the cores
        ray.init(address="local", num_cpus=max(available_cores(), int(per * args.nodes * k + 0.999)),
                 include_dashboard=False, object_store_memory=200 * 1024 ** 2, log_to_driver=True)
    else:
        try:
            ray.init(address=args.address, log_to_driver=True)
        except Exception as e:  # Ray >= 2.52: a cluster started with a token refuses a driver without one
            if "token" in str(e).lower() or type(e).__name__ == "AuthenticationError":
                sys.exit(f"ray_launch.py: the Ray cluster at {args.address} wants an authentication token: run with "
                         f"RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)")
            raise
    print(f"ray_launch.py: Ray {ray.__version__} {'started locally' if local else 'at ' + args.address} "
          f"in {time.monotonic() - t0:.1f} s; cluster: {ray.cluster_resources()}", file=sys.stderr, flush=True)
    groups, actors = [], []
    try:
        gpu_nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("GPU", 0) > 0]
        gpus = bool(gpu_nodes)
        k = args.trainers_per_node
        if gpus and cfg.parallel.backend != "gloo":
            short = [n["NodeManagerAddress"] for n in gpu_nodes if n["Resources"]["GPU"] < cfg.deploy.gpus_per_node]
            if short:
                print(f"opid-train: Ray node(s) {short} have fewer GPUs than the config's deploy.gpus_per_node = "
                      f"{cfg.deploy.gpus_per_node}", file=sys.stderr)
                return 2
        world = args.nodes * k
        msg = preflight.layout_error(cfg, world)
        if msg:
            print(f"opid-train ({args.nodes} node(s) x {k} rank(s) = world {world}): {msg}", file=sys.stderr)
            return 2
        cpus = args.cpus_per_trainer or (max(1, available_cores() // world) if local and not gpus else 1)
        bundle = {"CPU": cpus, **({"GPU": 1} if gpus else {})}
        extra = engine_gpus(cfg) if gpus else 0
        for node in range(args.nodes):
            bundles = [dict(bundle) for _ in range(k)] + ([{"GPU": extra}] if extra else [])
            groups.append(placement_group(bundles, strategy="STRICT_PACK", name=f"opid-node{node}"))
        try:
            ray.get([g.ready() for g in groups], timeout=600)
        except ray.exceptions.GetTimeoutError:
            print(f"ray_launch.py: the cluster cannot place {args.nodes} node group(s) of {bundles} within 600 s "
                  f"(cluster: {ray.cluster_resources()})", file=sys.stderr)
            return 2
        if gpus:
            for n in gpu_nodes:
                if n["Resources"]["GPU"] > k + extra:
                    print(f"ray_launch.py: warning: node {n['NodeManagerAddress']} has {int(n['Resources']['GPU'])} "
                          f"GPUs and a group holds {k + extra}; LOCAL_RANK = GPU id assumes the whole node",
                          file=sys.stderr)
        env_vars = {"OMP_NUM_THREADS": str(max(1, int(cpus))), "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", ""),
                    **({"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if gpus else {})}
        Actor = ray.remote(TrainerRank)
        for node, g in enumerate(groups):
            for local_rank in range(k):
                actors.append(Actor.options(
                    num_cpus=cpus, num_gpus=1 if gpus else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(g, placement_group_bundle_index=local_rank),
                    runtime_env={"env_vars": env_vars}, name=None,
                ).remote(max(1, int(cpus)), os.getcwd()))
        master_addr = ray.get(actors[0].node_ip.remote())
        master_port = ray.get(actors[0].free_port.remote())
        ips = ray.get([a.node_ip.remote() for a in actors])
        print(f"ray_launch.py: {world} rank(s) ({args.nodes} x {k}), bundles {bundle}; master {master_addr}:"
              f"{master_port}; rank nodes {ips}", file=sys.stderr, flush=True)
        runs = {}
        for rank, a in enumerate(actors):
            env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank % k, "LOCAL_WORLD_SIZE": k,
                   "NODE_RANK": rank // k, "GROUP_RANK": rank // k, "GROUP_WORLD_SIZE": args.nodes,
                   "MASTER_ADDR": master_addr,
                   "MASTER_PORT": master_port}
            print(f"ray_launch.py: rank {rank}: node {rank // k} local rank {rank % k}/{k} on {ips[rank]}",
                  file=sys.stderr, flush=True)
            runs[a.run.remote(env, list(train_argv))] = rank
        return wait_all(ray, runs, actors, args.timeout)
    finally:
        for a in actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001
                pass
        for g in groups:
            try:
                remove_placement_group(g)
            except Exception:  # noqa: BLE001
                pass
        ray.shutdown()


def wait_all(ray, runs: dict, actors: list, timeout: Optional[float]) -> int:
    """Wait for every rank; the first failure (exception or exit code != 0) ends the run with its rank named."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = list(runs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            print(f"ray_launch.py: ranks {sorted(runs[r] for r in pending)} still running after {timeout} s; "
                  "stopping the run", file=sys.stderr)
            return 124
        ref = done[0]
        rank = runs[ref]
        try:
            rc = ray.get(ref)
        except ray.exceptions.RayError as e:
            print(f"ray_launch.py: rank {rank} failed: {first_line(e)}\n{e}", file=sys.stderr)
            return 1
        if rc != 0:
            print(f"ray_launch.py: rank {rank} exited with code {rc}; stopping the other ranks", file=sys.stderr)
            return rc
    print(f"ray_launch.py: all {len(runs)} rank(s) finished", file=sys.stderr)
    return 0


def first_line(e: Exception) -> str:
    cause = getattr(e, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(e).splitlines()[0]


def with_resume_auto(argv: Sequence[str]) -> list:
    """opid-train's arguments with ``--resume auto`` first, unless they say --resume or --overwrite themselves: a re-run
    of the same launch continues the run (or starts it when it has no checkpoint yet)."""
    own = any(a in ("--resume", "--overwrite") or a.startswith("--resume=") for a in argv)
    return list(argv) if own else ["--resume", "auto", *argv]


def absolute_paths(argv: Sequence[str]) -> list:
    out, argv = [], list(argv)

    def absolute(flag: str, value: str) -> str:
        return value if flag == "--resume" and value == "auto" else os.path.abspath(value)

    i = 0
    while i < len(argv):
        a = argv[i]
        for flag in ("--config", "--run-dir", "--resume"):
            if a == flag and i + 1 < len(argv):
                out += [a, absolute(flag, argv[i + 1])]
                i += 2
                break
            if a.startswith(flag + "="):
                out.append(f"{flag}={absolute(flag, a.split('=', 1)[1])}")
                i += 1
                break
        else:
            out.append(a)
            i += 1
    return out


if __name__ == "__main__":
    sys.exit(main())
