"""Process groups for the Megatron backend: TP, PP (incl. virtual/interleaved), DP.

NCCL on GPU, gloo on CPU (``parallel.backend``; on a machine without a GPU :mod:`opid_mega.megatron.cpu_compat` is
applied first).
Works under torchrun (reads the usual env vars) and in processes spawned by :func:`spawn`.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from opid_mega.megatron import cpu_compat


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_backend(backend: str = "auto") -> str:
    """``parallel.backend``: auto = nccl with a GPU, gloo without; nccl without a GPU is an error."""
    if backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"parallel.backend={backend!r}, allowed: auto, nccl, gloo")
    gpu = torch.cuda.is_available()
    if backend == "nccl" and not gpu:
        raise ValueError("parallel.backend=nccl needs a GPU and this machine has none (use auto or gloo)")
    if backend == "auto":
        return "nccl" if gpu else "gloo"
    return backend


_CONTROL = None  # the gloo control group (see control_group)
_CONTROL_TIMEOUT_S = 86400.0  # its timeout (deploy.control_timeout_s, opid_mega.config.control_timeout)
_PEERS: list = []  # (host, node) of every global rank, gathered once on the control group
ROLL_CALL_S = 120.0  # how long rank 0 waits for every rank to answer after a broadcast (capped by the timeout)
NODE_LOST_EXIT = 5  # opid-train's exit code when a node is lost


class NodeLost(RuntimeError):
    """A rank of the job gave no answer on the control group within its bound (a node down, cut off or stopped), or
    global rank 0 ended without a word. `str(e)` is one line naming the node, its host and the rank(s); `report`:
    whether this rank prints it (one rank per job says it; the others leave quietly)."""

    def __init__(self, message: str, report: bool = True):
        super().__init__(message)
        self.report = report


def _peer(rank: int) -> str:
    if 0 <= rank < len(_PEERS):
        host, node = _PEERS[rank]
        return f"node {node} (host {host}, global rank {rank})"
    return f"global rank {rank}"


def _lost_line(ranks: list, seconds: float, what: str, where: str = "on the control group",
               bound: str = "deploy.control_timeout_s") -> str:
    if not ranks:
        who = "a rank of the job"
    else:
        nodes: dict = {}
        for r in ranks:
            host, node = _PEERS[r] if 0 <= r < len(_PEERS) else ("?", "?")
            nodes.setdefault((node, host), []).append(r)
        who = "; ".join(f"node {n} (host {h}, global rank{'s' if len(rs) > 1 else ''} "
                        f"{', '.join(str(r) for r in rs)})" for (n, h), rs in nodes.items())
    return (f"lost {who}: {what} within {seconds:g} s {where} (the node is down, cut off or stopped; "
            f"bound: {bound}, docs/multi-node.md); the job ends, exit 5; resume with --resume auto")


def _reporter_for(lost: int) -> bool:
    """Whether this rank is the one that reports `lost` (rank 0) gone: the lowest rank on another host than it
    (the lowest other rank on a one-host job)."""
    me = dist.get_rank()
    host = _PEERS[lost][0] if 0 <= lost < len(_PEERS) else None
    others = [r for r in range(dist.get_world_size()) if r != lost and (not _PEERS or _PEERS[r][0] != host)]
    if not others:
        others = [r for r in range(dist.get_world_size()) if r != lost]
    return bool(others) and me == others[0]


def _control_error(exc: BaseException, waited: float) -> NodeLost:
    """A failed wait on the control group of a rank other than 0, which waits there for rank 0 only: a wait that
    lasted the control timeout is rank 0's node lost; a shorter one (the connection closed) is rank 0 gone without a
    word (its own output says why)."""
    if waited >= 0.9 * _CONTROL_TIMEOUT_S:
        return NodeLost(_lost_line([0], _CONTROL_TIMEOUT_S, "no word from it"), report=_reporter_for(0))
    text = " ".join(str(exc).split())[:200]
    return NodeLost(f"global rank 0 ({_peer(0)}) left the control group ({text}); the job ends, see its output",
                    report=_reporter_for(0))


def _roll_call() -> None:
    """Every rank meets global rank 0 on the control group (gloo's monitored barrier). The other ranks wait there for
    rank 0 (its rollout, analysis, evaluation) up to the control timeout; rank 0, when its work is done, waits at most
    min(ROLL_CALL_S, the control timeout) for every rank's answer (they are waiting already) and names the ranks that
    give none: a node stopped or cut off meanwhile is one line (NodeLost), not a send that never completes or a
    training collective's timeout later. (gloo sends an unbound buffer only when the receiver asks for it: a stopped
    or cut-off rank never answers, whenever it arrived.)"""
    import time

    if dist.get_rank() == 0:
        wait = min(ROLL_CALL_S, _CONTROL_TIMEOUT_S)
        try:
            dist.monitored_barrier(group=_CONTROL, timeout=datetime.timedelta(seconds=wait), wait_all_ranks=True)
        except RuntimeError as exc:
            import re

            m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(exc))
            ranks = [int(x) for x in re.findall(r"\d+", m.group(1))] if m else []
            raise NodeLost(_lost_line(ranks, wait, "no answer when rank 0's work was done")) from None
        return
    t0 = time.monotonic()
    try:
        dist.monitored_barrier(group=_CONTROL, timeout=datetime.timedelta(seconds=_CONTROL_TIMEOUT_S))
    except RuntimeError as exc:
        raise _control_error(exc, time.monotonic() - t0) from None


def initialize(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234, timeout_s: float = 300,
               backend: str = "auto", control_timeout_s: float = 86400, gpu_ids: list | None = None,
               heartbeat_timeout_s: float | None = None, prog: str = "opid-train") -> None:
    """Initialise torch.distributed (if needed) and megatron's model-parallel groups; DP = world / (tp*pp).
    ``backend``: "auto" | "nccl" | "gloo" (:func:`resolve_backend`). ``timeout_s`` bounds every collective of the
    training groups (a hung rank fails the run after it); ``control_timeout_s`` bounds the waits on the control
    group (:func:`control_group`), where ranks wait for rank 0's rollout, analysis and evaluation.
    ``heartbeat_timeout_s`` (several ranks): every rank's heartbeat (opid_mega.megatron.heartbeat); a node silent
    that long ends the job with one line (`prog`: its prefix) naming it, wherever the ranks are."""
    global _CONTROL, _CONTROL_TIMEOUT_S, _PEERS
    backend = resolve_backend(backend)
    cpu_compat.apply()
    if not dist.is_initialized():
        from opid_mega.infra.hosts import set_socket_ifname

        # gloo's and NCCL's interface, unless set (every launcher): never the host name's address, which a stock
        # /etc/hosts maps to 127.0.1.1 (opid_mega.infra.hosts; BindHostError names the fix when none can be told)
        set_socket_ifname()
        # NCCL only: a gloo run needs no device of its own (several gloo ranks on a machine with fewer GPUs than
        # ranks would otherwise ask for a GPU that does not exist: "invalid device ordinal")
        if backend == "nccl":  # local rank i -> gpu_ids[i] (opid_mega.placement: the node's training GPUs), else GPU i
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if gpu_ids and local >= len(gpu_ids):
                raise ValueError(f"local rank {local} has no training GPU: this node's training GPUs are {gpu_ids} "
                                 "(deploy.train_gpus_per_node); start as many ranks per node as training GPUs")
            torch.cuda.set_device(gpu_ids[local] if gpu_ids else local)
        timeout = datetime.timedelta(seconds=timeout_s)
        if int(os.environ.get("WORLD_SIZE", "1")) == 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # A lone process meets no one: an in-process store, nothing listening (env:// would serve an
            # unauthenticated TCPStore on every address, [::]:MASTER_PORT, for the whole run). Under torchrun's
            # agent store a one-rank world keeps the agent's store, where it already listens.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            dist.init_process_group(backend, rank=int(os.environ.get("RANK", "0")),
                                    world_size=int(os.environ.get("WORLD_SIZE", "1")), timeout=timeout)
    world = dist.get_world_size()
    # every rank creates every group in the same order: the control group first, before megatron's
    _CONTROL = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s)) \
        if world > 1 else None
    _CONTROL_TIMEOUT_S = float(control_timeout_s)
    # every rank's host and node (torchrun's GROUP_RANK), to name a lost node in one line (NodeLost)
    _PEERS = []
    _PEERS = all_gather_control((socket.gethostname(), int(os.environ.get("GROUP_RANK", "0"))))
    if world > 1 and heartbeat_timeout_s:
        _start_heartbeat(float(heartbeat_timeout_s), prog)
    if world % (tp * pp) != 0:
        raise ValueError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}")
    if vpp is not None and vpp > 1 and pp < 2:
        raise ValueError("virtual pipeline parallelism (vpp > 1) needs pp >= 2")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


_HEARTBEAT = None  # this rank's opid_mega.megatron.heartbeat.Heartbeat


def _start_heartbeat(timeout_s: float, prog: str) -> None:
    """This rank's heartbeat in the job's rendezvous store (MASTER_ADDR:MASTER_PORT: torchrun's agent store, or global
    rank 0's), through a connection of its own, its keys under a per-run secret prefix drawn by rank 0."""
    global _HEARTBEAT
    import secrets

    from torch.distributed import PrefixStore, TCPStore

    from opid_mega.config import beat_interval
    from opid_mega.megatron.heartbeat import Heartbeat

    stop_heartbeat()
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    prefix = broadcast(lambda: f"opid_heartbeat_{secrets.token_hex(16)}")
    if not addr or not port:
        return  # no rendezvous store to beat in (a process group made some other way)
    client = TCPStore(addr, int(port), is_master=False, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=max(1.0, beat_interval(timeout_s))))
    _HEARTBEAT = Heartbeat(PrefixStore(prefix, client), dist.get_rank(), dist.get_world_size(), timeout_s,
                           describe=lambda ranks, s: _lost_line(ranks, s, "no heartbeat", "in the rendezvous store",
                                                                "deploy.heartbeat_timeout_s"),
                           reports=_reporter_for, prog=prog).start()


def stop_heartbeat() -> None:
    """This rank ended its work (its peers must not count it as lost)."""
    global _HEARTBEAT
    if _HEARTBEAT is not None:
        _HEARTBEAT.stop()
        _HEARTBEAT = None


def control_group():
    """A gloo group over every rank with a long timeout (deploy.control_timeout_s): the channel on which ranks wait
    for work that only global rank 0 does (rollout, analysis, evaluation) and receive its result as Python objects
    (:func:`broadcast`, :func:`wait_for_rank0`, :func:`all_gather_control`).
    Waiting there cannot trip the training groups' timeout (deploy.train_timeout_s), however long rank 0 takes; on
    GPU it keeps NCCL's watchdog out of it too. None in a single process or before :func:`initialize`."""
    return _CONTROL


def broadcast(produce):
    """`produce()` on global rank 0, its result (or its error) sent to every rank over the control group
    (:func:`control_group`: gloo, deploy.control_timeout_s), so the other ranks may wait for rank 0's rollout and
    analysis far longer than the training groups' timeout. Single process: just the call."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return produce()
    import time

    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", produce())]
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank
            box = [("error", exc)]
    _roll_call()  # the others wait here for rank 0; a node lost meanwhile is named
    t0 = time.monotonic()
    try:  # every rank is here now: the data follows at once
        dist.broadcast_object_list(box, src=0, group=control_group())
    except RuntimeError as exc:
        if dist.get_rank() != 0:
            raise _control_error(exc, time.monotonic() - t0) from None
        raise NodeLost(_lost_line([], _CONTROL_TIMEOUT_S, f"rank 0's broadcast not taken "
                                                          f"({' '.join(str(exc).split())[:200]})")) from None
    status, value = box[0]
    if status == "error":
        raise value
    return value


def wait_for_rank0() -> None:
    """Every rank waits here, on the control group, until global rank 0 has finished work only it does (launching
    servers, evaluation): the next training collective then starts together on every rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        _roll_call()


def all_gather_control(obj) -> list:
    """Every rank's `obj`, in rank order, over the control group (a collective; single process: [obj])."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, obj, group=control_group())
    except RuntimeError as exc:
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            raise NodeLost(_lost_line([], _CONTROL_TIMEOUT_S, "a rank did not join a gather"),
                           report=dist.get_rank() == 0) from None
        raise
    return out


def destroy() -> None:
    global _CONTROL, _PEERS
    stop_heartbeat()
    _CONTROL, _PEERS = None, []
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def device() -> torch.device:
    return torch.device("cpu") if cpu_compat.needed() else torch.device("cuda", torch.cuda.current_device())


def _spawn_entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    fn(*args)


# What every rank imports anyway: a forkserver imports it once and forks the ranks from there (a spawned rank spends
# ~4 s importing torch, megatron-core and transformers before it starts its work).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "megatron.core", "transformers",
                      "opid_mega.megatron.parallel"]


def spawn(world: int, fn, *args, timeout_s: float = 600, start_method: str = "forkserver") -> None:
    """Run ``fn(*args)`` in ``world`` fresh processes with the torch.distributed env vars set (gloo on CPU).

    The ranks fork from a forkserver that has imported FORKSERVER_PRELOAD once (``start_method="spawn"``: each rank
    a fresh interpreter). A rank that fails makes this raise; ``timeout_s`` bounds the whole run so a hang fails
    instead of blocking.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    ctx = mp.start_processes(_spawn_entry, args=(world, _free_port(), fn, args), nprocs=world,
                             join=False, start_method=start_method)
    import time

    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"{world}-rank run did not finish within {timeout_s} s")


def destroy_all() -> None:
    """:func:`destroy` and undo the CPU shims (in-process tests)."""
    destroy()
    cpu_compat.remove()
