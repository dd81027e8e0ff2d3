"""Weight sync Megatron -> rollout engines (config section `sync`).

    sync = WeightSync(policy, engine, cfg, run_dir)        # every rank (engine None off global rank 0)
    metrics = sync()                                       # a collective: every rank calls it after each update

One sync:
  1. gather: only the ranks of data-parallel replica 0 export (TP shards all-gathered inside the replica's TP group,
     pipeline stages broadcast to global rank 0 over its PP group: opid_mega.megatron.weights.export_hf_weights);
     every other replica returns at once, without a gather.
  2. HF names -> buckets of about sync.bucket_mb, cast to the dtype the engine serves, each checked against the
     served model's manifest (names, shapes, dtype) before it is sent: a bad bucket raises WeightMismatch and the
     engine never sees it.
  3. transfer, by sync.method:
       tensor       update_weights_from_tensor: CPU tensors as shared-memory handles, CUDA tensors as CUDA IPC
                    handles (SGLang's MultiprocessingSerializer); handles open only on the machine that made them,
                    so with servers on several nodes each server is fed by a rank on ITS node (`feeders`: the rank
                    whose training GPU is the server's first GPU, else the node's first rank, which launched it);
                    such a rank that holds no export (not in data-parallel replica 0) gets every bucket from global
                    rank 0 over one broadcast group (gloo on CPU, NCCL on GPU) and feeds its servers from there
       distributed  update_weights_from_distributed: global rank 0 is rank 0 of a process group with each engine's
                    TP ranks (NCCL on GPU, gloo on CPU) and broadcasts every bucket; engines on other GPUs/hosts
       disk         HF safetensors under <sync.disk_dir>/<run id>/v<version> (a filesystem the servers see; the run
                    id is opid_mega.infra.files.run_id, kept across resumes; empty disk_dir: <run_dir>/weight_sync/v<version>),
                    then update_weights_from_disk; afterwards only this run's older v<digits> entries are removed
                    (never anything else in a shared directory); the fallback
       local        an in-process engine (opid_mega.rollout.local_engine): its update_weights copies the tensors
       auto         distributed for a disaggregated GPU deployment, tensor when every server has a feeder on its
                    own node (servers launched by the trainer, any number of nodes; attached ones on this
                    machine), disk otherwise (attached servers elsewhere)
     A method that cannot reach a server is refused before the first sync (one line: tensor for an attached server
     on another host); opid-plan checks the same from the config.
     generation is paused during the transfer and resumed after it; every sync sets the engines' weight version to
     the sync count (SGLang's weight_version, read back to confirm).
  4. check, every sync.check_interval syncs (the first one included): each engine decodes a fixed probe greedily and
     its log-probs must equal the trainer's log-probs of the same tokens within sync.check_tol; else WeightSyncError.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

PROBE_TEXT = "You are in the middle of a room. Looking quickly around you, you see a cabinet, a desk and a drawer."


def gather_servers(cfg, servers: list) -> dict:
    """Every rank's launched rollout servers and where each rank runs (a collective on the control group):
    {"servers": [{"url", "rank", "gpus"}] in node order, "ranks": [{"rank", "node", "gpu"}]}; the URLs are the
    addresses the servers bind (deploy.bind_host), reachable from the other nodes. The weight sync decides from it
    which rank of a server's node feeds it (feeders)."""
    from opid_mega.megatron.parallel import all_gather_control

    rank = dist.get_rank() if dist.is_initialized() else 0
    groups = []
    if servers and torch.cuda.is_available():
        from opid_mega.placement import node_placement

        groups = node_placement(cfg.deploy).rollout_groups
    mine = {"rank": rank, "node": int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")) or 0),
            "gpu": torch.cuda.current_device() if torch.cuda.is_available() else None,
            "servers": [{"url": e.url, "rank": rank, "gpus": list(groups[i]) if i < len(groups) else []}
                        for i, e in enumerate(servers)]}
    everyone = all_gather_control(mine)
    return {"servers": [s for part in everyone for s in part["servers"]],
            "ranks": [{k: part[k] for k in ("rank", "node", "gpu")} for part in everyone]}


class WeightSyncError(RuntimeError):
    """A sync that did not leave the engines on the trainer's weights (the message says which engine and why)."""


def _engines(engine) -> list:
    """The engines a sync feeds: a fleet's servers still in rotation, or the one engine."""
    if engine is None:
        return []
    if hasattr(engine, "live_engines"):
        return list(engine.live_engines)
    return [engine]


def feeders(servers: list, ranks: list) -> dict:
    """url -> the global rank that feeds that server with sync.method=tensor (shared memory / CUDA IPC work only
    within a machine). `servers`: [{"url", "rank" (the rank that launched it, its node's first), "gpus"}];
    `ranks`: [{"rank", "node", "gpu" (its training GPU id, None on CPU)}]. A server is fed by the rank of its node
    whose training GPU is the server's first GPU (colocated: the CUDA IPC handles then name the GPU the server
    itself runs on), else by the rank that launched it."""
    node_of = {r["rank"]: r["node"] for r in ranks}
    out = {}
    for srv in servers:
        node = node_of.get(srv["rank"])
        gpus = list(srv.get("gpus") or [])
        same_gpu = [r["rank"] for r in ranks if r["node"] == node and gpus and r.get("gpu") == gpus[0]]
        out[srv["url"]] = same_gpu[0] if same_gpu else srv["rank"]
    return out


class GroupStore(dist.Store):
    """The store a weight-update group forms on: served by this process on one address (`open_store`) while the
    group's members meet, then let go (`close`) once the group has formed and carried its first update (NCCL creates
    its communicator at the first collective, through the store). After `close` the TCPStore is gone: its listening
    socket closed, its event loop ended (a store whose listening socket is merely shut spins its event loop at ~0.9 of
    a core for as long as it lives), so nobody can connect any more and nothing polls; the group keeps its
    connections. A store call after `close` is an error that says so."""

    def __init__(self, inner, port: int):
        super().__init__()
        self._inner, self.port = inner, int(port)

    def _store(self):
        if self._inner is None:
            raise RuntimeError("the weight-update group's store was closed once the group had formed")
        return self._inner

    def close(self) -> None:
        self._inner = None  # the last reference: the TCPStore's server stops and closes its socket

    def set(self, key, value):
        return self._store().set(key, value)

    def get(self, key):
        return self._store().get(key)

    def add(self, key, amount):
        return self._store().add(key, amount)

    def compare_set(self, key, expected, desired):
        return self._store().compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        return self._store().wait(keys) if timeout is None else self._store().wait(keys, timeout)

    def check(self, keys):
        return self._store().check(keys)

    def delete_key(self, key):
        return self._store().delete_key(key)

    def num_keys(self):
        return self._store().num_keys()

    def set_timeout(self, timeout):
        return self._store().set_timeout(timeout)


def open_store(host: str, world_size: int, timeout) -> GroupStore:
    """A GroupStore served by this process on `host` only (an IP address: loopback when every member runs on this
    machine, else this node's cluster address), never on every address as TCPStore(host, 0, ...) listens: the socket
    is bound here and handed to the TCPStore (master_listen_fd: the store owns the fd and closes it when it ends).
    `close()` it once the group has formed."""
    import socket

    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(128)
        store = TCPStore(host, listener.getsockname()[1], world_size, is_master=True, timeout=timeout,
                         wait_for_workers=False, master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    port = listener.getsockname()[1]
    listener.detach()
    return GroupStore(store, port)


def _is_local(url: str) -> bool:
    """The engine at `url` runs on this machine (opid_mega.infra.hosts: exact host comparison, never a substring)."""
    from opid_mega.infra.hosts import is_local_url

    return is_local_url(url)


def resolve_method(method: str, mode: str, engines: list, fed: Optional[set] = None) -> str:
    """sync.method for these engines. `fed`: the urls a rank on their own node feeds (launched servers, see
    `feeders`); any other engine must be on this machine for tensor."""
    if engines and not all(hasattr(e, "begin_update") for e in engines):
        return "local"  # an in-process engine (LocalEngine): its update_weights copies the tensors
    if method != "auto":
        return method
    if mode == "disaggregated" and torch.cuda.is_available():
        return "distributed"
    if all(e.url in (fed or set()) or _is_local(e.url) for e in engines):
        return "tensor"
    return "disk"


def disk_dir(base: str, run_dir: str) -> Path:
    """Where the disk method writes this run's weight versions: <base>/<run id>/ (the run's own directory inside a
    directory the servers share; the id is fixed at the run's start and reused by its resumes), or
    <run_dir>/weight_sync when ``base`` is empty. (Global rank 0: it may create the run id.)"""
    if not base:
        return Path(run_dir) / "weight_sync"
    from opid_mega.infra.files import run_id

    return Path(base) / run_id(run_dir)


_VERSION = re.compile(r"v\d+|\.v\d+\.tmp")


def remove_old_versions(directory: Path, keep: Path) -> list:
    """Remove this run's weight versions (``v<digits>`` directories, and ``.v<digits>.tmp`` ones a killed sync left)
    in ``directory`` except ``keep``; nothing else there is touched. Returns the names removed."""
    removed = []
    for old in sorted(directory.iterdir()):
        if old != keep and old.is_dir() and not old.is_symlink() and _VERSION.fullmatch(old.name):
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old.name)
    return removed


def check_tolerance(tol: float, dtype: str) -> float:
    return tol if tol > 0 else (1e-3 if dtype == "float32" else 5e-2)


class WeightSync:
    def __init__(self, policy, engine, cfg, run_dir: str, tokenizer=None, servers: Optional[dict] = None,
                 own: Optional[list] = None, api_key: Optional[str] = None):
        """Every rank (a collective when `servers` is given). `servers`: the trainer's map of the launched servers,
        {"servers": [{"url", "rank", "gpus"}], "ranks": [{"rank", "node", "gpu"}]} (opid_mega.trainer
        .gather_servers), for per-node feeding; `own`: the engines this rank launched; `api_key`: the servers' key
        (a feeder attaches to a server of its node that another rank launched)."""
        self.policy, self.cfg = policy, cfg
        self.engine = engine
        self.engines = _engines(engine)
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0
        multi = dist.is_initialized() and dist.get_world_size() > 1
        self.feeders = feeders(servers["servers"], servers["ranks"]) if servers else {}
        fed = {u for u, r in self.feeders.items()}
        method = resolve_method(cfg.sync.method, cfg.deploy.mode, self.engines, fed) if self.rank0 else None
        if multi and servers is not None:  # every rank must know it: feeders take part in tensor syncs
            from opid_mega.megatron.parallel import broadcast

            method = broadcast(lambda: method)
        self.method = method
        self.node_feeding = self.method == "tensor" and any(r != 0 for r in self.feeders.values())
        self.my_engines: list = []  # the servers this rank feeds (node feeding, ranks other than 0)
        self.receivers: list = []  # feeders outside data-parallel replica 0: they get the buckets from rank 0
        self.bucket_group = None
        if self.node_feeding:
            self._setup_node_feeding(own or [], api_key)
        self.bucket_bytes = cfg.sync.bucket_mb << 20
        self.disk_dir = disk_dir(cfg.sync.disk_dir, run_dir) if self.rank0 else None
        self.tol = check_tolerance(cfg.sync.check_tol, cfg.model.dtype)
        self.version = 0
        self.groups: dict = {}  # engine url -> its update process group (distributed)
        self.probe = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]) if tokenizer else [1, 2, 3]
        if self.rank0 and self.method == "tensor":
            remote = [e.url for e in self.engines if e.url not in fed and not _is_local(e.url)]
            if remote:
                raise ValueError(f"sync.method=tensor sends shared-memory / CUDA IPC handles, but {remote} run on "
                                 "another host and no rank of this run is on it: use sync.method=distributed or disk")

    def _setup_node_feeding(self, own: list, api_key: Optional[str]) -> None:
        """Every rank: the broadcast group of rank 0 and the feeders that hold no export, and this rank's engines."""
        from opid_mega.megatron.parallel import all_gather_control

        me = dist.get_rank()
        senders = all_gather_control(self._sender())
        feeding = sorted(set(self.feeders.values()))
        self.receivers = [r for r in feeding if r != 0 and not senders[r]]
        if self.receivers:  # new_group is a collective of every rank, whether in the group or not
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            self.bucket_group = dist.new_group(ranks=[0] + self.receivers, backend=backend)
        if me == 0:
            return
        mine = [u for u, r in self.feeders.items() if r == me]
        by_url = {e.url: e for e in own}
        for u in mine:
            if u in by_url:
                self.my_engines.append(by_url[u])
            else:  # a server of this node that the node's first rank launched (colocated GPU: the one on our GPU)
                from opid_mega.rollout.sglang_engine import SGLangEngine

                self.my_engines.append(SGLangEngine(url=u, api_key=api_key))

    # ---- the collective -----------------------------------------------------------------------------------------
    def __call__(self, version: Optional[int] = None, after_transfer=None) -> dict:
        """One sync (a collective). `after_transfer()` runs on every rank between the transfer and the probe check
        (colocated: the engines' KV cache and CUDA graphs come back before the probe decodes)."""
        self.version = self.version + 1 if version is None else int(version)
        self.engines = _engines(self.engine)  # a fleet may have lost a server since the last sync
        t0 = time.perf_counter()
        if self.node_feeding:
            sent = self._node_feed_sync()
        else:
            sent = self._transfer() if self._sender() else 0
        out = {"weight_sync/version": self.version, "weight_sync/bytes": sent,
               "weight_sync/transfer_s": time.perf_counter() - t0}
        if after_transfer is not None:
            after_transfer()
        every = self.cfg.sync.check_interval
        if every and (self.version - 1) % every == 0:
            out["weight_sync/probe_max_abs_diff"] = self.check()
        return out if self.rank0 else {}

    @staticmethod
    def _sender() -> bool:
        """Ranks of data-parallel replica 0 take part in the export; the other replicas hold the same weights."""
        if not dist.is_initialized():
            return True
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank() == 0

    def _buckets(self):
        from opid_mega.megatron.weights import export_hf_weights

        dtype = getattr(torch, self.cfg.model.dtype)
        manifest = getattr(self.engines[0], "manifest", None) if self.rank0 and self.engines else None
        for bucket in export_hf_weights(self.policy.chunks, self.policy.hf_config, bucket_bytes=self.bucket_bytes):
            if not self.rank0:
                continue
            out = []
            for name, t in bucket:
                want = getattr(torch, manifest[name][1]) if manifest and name in manifest else dtype
                out.append((name, t.to(want)))
            yield out

    def _transfer(self) -> int:
        buckets = self._buckets()
        if not self.rank0 or not self.engines:
            for _ in buckets:  # the collective must run to its end on every sender
                pass
            return 0
        version = str(self.version)
        try:
            if self.method == "disk":
                return self._via_disk(buckets, version)
            if self.method == "distributed":
                return self._via_distributed(buckets, version)
            if self.method == "local":
                sent = 0
                for bucket in buckets:
                    for e in self.engines:
                        e.update_weights(bucket)
                    sent += sum(t.numel() * t.element_size() for _, t in bucket)
                return sent
            return self._via_tensor(buckets, version)
        finally:
            for _ in buckets:  # an engine failed mid-way: finish the collective so the other senders do not hang
                pass

    # ---- tensor syncs with servers on several nodes ------------------------------------------------------------
    def _served(self, bucket: list, engines: list) -> list:
        """`bucket` cast to the dtype the engines serve (their manifest; else model.dtype)."""
        manifest = getattr(engines[0], "manifest", None) if engines else None
        dtype = getattr(torch, self.cfg.model.dtype)
        return [(n, t.to(getattr(torch, manifest[n][1]) if manifest and n in manifest else dtype)) for n, t in bucket]

    _ALIGN = 16  # bytes: every tensor of a broadcast bucket starts at a multiple (so any dtype can view it)

    def _send_to_receivers(self, bucket: Optional[list]) -> None:
        """Global rank 0: one bucket (None: the end) to the feeders that hold no export, as one byte buffer."""
        header = None if bucket is None else [(n, tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in bucket]
        dist.broadcast_object_list([header], src=0, group=self.bucket_group)
        if bucket is None:
            return
        parts = []
        for _, t in bucket:
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            pad = (-raw.numel()) % self._ALIGN
            parts.append(raw)
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8, device=raw.device))
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=self.bucket_group)

    def _receive_bucket(self) -> Optional[list]:
        """A feeder outside replica 0: the next bucket from global rank 0 (None at the end)."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.bucket_group)
        header = box[0]
        if header is None:
            return None
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        sizes = [torch.Size(shape).numel() * torch.empty(0, dtype=getattr(torch, d)).element_size()
                 for _, shape, d in header]
        total = sum(n + (-n) % self._ALIGN for n in sizes)
        flat = torch.empty(total, dtype=torch.uint8, device=dev)
        dist.broadcast(flat, src=0, group=self.bucket_group)
        out, offset = [], 0
        for (name, shape, d), n in zip(header, sizes):
            out.append((name, flat[offset:offset + n].view(getattr(torch, d)).reshape(shape)))
            offset += n + (-n) % self._ALIGN
        return out

    def _node_feed_sync(self) -> int:
        """sync.method=tensor with servers on several nodes (a collective of every rank): each feeder sends the
        buckets to the servers it feeds (rank 0 its own node's; the others theirs, from their own export or from rank
        0's broadcast); then rank 0 learns every feeder's failures and takes those servers out of rotation (a bucket
        the served model does not have stops the sync: WeightMismatch). Returns the bytes rank 0's feeding sent plus
        every other feeder's."""
        from opid_mega.megatron.parallel import all_gather_control, broadcast
        from opid_mega.megatron.weights import export_hf_weights
        from opid_mega.rollout.sglang_engine import WeightMismatch

        me = dist.get_rank()
        version = str(self.version)
        live = set(broadcast(lambda: [e.url for e in self.engines]))  # rank 0's fleet decides who is in rotation
        mine = [e for e in self.engines if self.feeders.get(e.url, 0) == 0] if me == 0 \
            else [e for e in self.my_engines if e.url in live]
        failures: dict = {}  # url -> (fatal, message)
        started, sent = [], 0

        def fail(e, exc):
            failures.setdefault(e.url, (isinstance(exc, WeightMismatch), f"{type(exc).__name__}: {exc}"))

        for e in mine:
            try:
                e.begin_update()
                started.append(e)
            except Exception as exc:  # noqa: BLE001 - reported to rank 0 below
                fail(e, exc)

        def feed(bucket):
            nonlocal sent
            todo = [e for e in started if e.url not in failures]
            if not todo:
                return
            served = self._served(bucket, todo)
            for e in todo:
                try:
                    e.send_bucket(served)
                except Exception as exc:  # noqa: BLE001
                    fail(e, exc)
            sent += sum(t.numel() * t.element_size() for _, t in served)

        error = None
        try:
            if self._sender():
                stream = export_hf_weights(self.policy.chunks, self.policy.hf_config, bucket_bytes=self.bucket_bytes)
                try:
                    for bucket in stream:  # every sender sees every bucket (TP all-gather, PP broadcast)
                        if me == 0 and self.bucket_group is not None:
                            self._send_to_receivers(bucket)
                        feed(bucket)
                finally:
                    for _ in stream:  # the export is a collective: run it to its end
                        pass
            elif me in self.receivers:
                while True:
                    bucket = self._receive_bucket()
                    if bucket is None:
                        break
                    feed(bucket)
        except BaseException as exc:  # noqa: BLE001 - the protocol still completes on every rank, then it is raised
            error = exc
        finally:
            if me == 0 and self.bucket_group is not None:
                self._send_to_receivers(None)
            for e in started:
                try:
                    e.end_update(version if error is None and e.url not in failures else None)
                except Exception as exc:  # noqa: BLE001
                    fail(e, exc)
        reports = all_gather_control((failures, sent))
        if error is not None:
            raise error
        if me != 0:
            return 0
        total = sum(n for _, n in reports)
        bad = {u: f for part, _ in reports for u, f in part.items()}
        fatal = [f"{u}: {msg}" for u, (is_fatal, msg) in bad.items() if is_fatal]
        if fatal:
            raise WeightMismatch("; ".join(fatal))
        by_url = {e.url: e for e in self.engines}
        for u, (_, msg) in bad.items():
            if u in by_url:
                feeder = self.feeders.get(u, 0)
                self._drop(by_url[u], RuntimeError(f"fed by rank {feeder}: {msg}"))
        return total

    def _drop(self, e, exc: BaseException) -> None:
        """A fleet's server that failed its part of a sync leaves the rotation (it would serve stale weights); the
        sync goes on with the others. A lone engine, the last server, or a refused bucket: the error is raised."""
        from opid_mega.rollout.sglang_engine import WeightMismatch

        if isinstance(exc, WeightMismatch) or not hasattr(self.engine, "mark_dead") or len(self.engines) <= 1:
            raise exc
        self.engine.mark_dead(e, f"weight sync {self.version} failed: {type(exc).__name__}: {exc}")
        self.engines = [x for x in self.engines if x is not e]

    def _each(self, fn, engines=None) -> list:
        """fn(e) for every engine, dropping (see _drop) the ones that fail; returns the results of the others."""
        out = []
        for e in list(engines if engines is not None else self.engines):
            try:
                out.append(fn(e))
            except Exception as exc:  # noqa: BLE001 - _drop re-raises what must stop the sync
                self._drop(e, exc)
        return out

    def _via_tensor(self, buckets, version: str) -> int:
        sent = 0
        started = self._each(lambda e: (e.begin_update(), e)[1])
        ok = False
        try:
            for bucket in buckets:
                sent += sum(self._each(lambda e: e.send_bucket(bucket), [e for e in started if e in self.engines]))
            ok = True
        finally:
            for e in started:
                try:
                    e.end_update(version if ok and e in self.engines else None)
                except Exception as exc:  # noqa: BLE001
                    if e in self.engines:
                        self._drop(e, exc)
        return sent

    def _via_disk(self, buckets, version: str) -> int:
        from safetensors.torch import save_file

        out = self.disk_dir / f"v{version}"
        tmp = self.disk_dir / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        sent, index = 0, {}
        for i, bucket in enumerate(buckets):
            for e in self.engines:
                e.check_bucket(bucket)
            name = f"model-{i:05d}.safetensors"
            save_file({n: t.contiguous().cpu() for n, t in bucket}, str(tmp / name), metadata={"format": "pt"})
            index.update({n: name for n, _ in bucket})
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
        import json

        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": sent},
                                                                      "weight_map": index}))
        for f in Path(self.policy.hf_dir).iterdir():  # config, generation config, tokenizer
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy(f, tmp / f.name)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        self._each(lambda e: e.update_weights_from_disk(str(out), version=version))
        remove_old_versions(self.disk_dir, out)  # keep only the version the engines now serve
        return sent

    def _group(self, e):
        if e.url in self.groups:
            return self.groups[e.url]
        import threading

        from sglang.srt.utils.common import init_custom_process_group

        # the address the server connects to: loopback for a server on this machine, else the address of our
        # interface that routes to the server's host (deploy.bind_host's rule; never gethostbyname(gethostname()),
        # which is 127.0.1.1 on a stock Debian/Ubuntu host)
        from opid_mega.infra.hosts import LOOPBACK, bind_host, url_host

        host = LOOPBACK if _is_local(e.url) else bind_host(self.cfg.deploy.bind_host, target=url_host(e.url))
        import datetime

        from torch.distributed import PrefixStore

        from opid_mega.config import control_timeout

        timeout = datetime.timedelta(seconds=min(600.0, control_timeout(self.cfg)))
        # Rank 0 hosts the group's store itself: init_custom_process_group's tcp:// rendezvous would not, under
        # torchrun (TORCHELASTIC_USE_AGENT_STORE makes every rank a client of a store nobody serves: both sides
        # then wait until the timeout). On `host` alone (open_store), and only until the group's first update.
        store = open_store(host, 1 + e.tp_size, timeout)
        port = store.port
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # the group's keys in the store are under its name: a secret, so that no one who reaches the store while it
        # is open can guess them (the server learns it over its authenticated HTTP endpoint)
        name = f"opid_weights_{secrets.token_hex(16)}"
        err: dict = {}

        def join():
            try:
                e.init_weights_update_group(host, port, 1, 1 + e.tp_size, group_name=name, backend=backend)
            except BaseException as exc:  # noqa: BLE001
                err["e"] = exc

        th = threading.Thread(target=join, daemon=True)
        th.start()
        # the server side wraps the store as PrefixStore(group name, ...): the same keys here; a gloo group listens
        # on `host`'s interface, where the server reaches it (not the interface of the trainer's own groups)
        from opid_mega.infra.hosts import gloo_interface

        with gloo_interface(host):
            group = init_custom_process_group(backend=backend, store=PrefixStore(name, store),
                                              world_size=1 + e.tp_size, rank=0, group_name=name, timeout=timeout)
        th.join(timeout.total_seconds())
        if th.is_alive():
            raise RuntimeError(f"{e.url}: init_weights_update_group did not return within {timeout.total_seconds():g} s")
        if "e" in err:
            raise err["e"]
        self._open_stores = getattr(self, "_open_stores", {})
        self._open_stores[e.url] = store  # until the group's first update went through (_via_distributed)
        self.groups[e.url] = (group, name)
        return self.groups[e.url]

    def _via_distributed(self, buckets, version: str) -> int:
        sent = 0
        groups = {e.url: self._group(e) for e in self.engines}
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        started = []
        ok = False
        try:
            for e in self.engines:
                e.begin_update()
                started.append(e)
            for bucket in buckets:
                b = [(n, t.to(dev)) for n, t in bucket]
                for e in self.engines:
                    group, name = groups[e.url]
                    try:
                        sent += e.update_weights_from_distributed(
                            b, lambda ts, g=group: [dist.broadcast(t, src=0, group=g, async_op=True) for t in ts],
                            group_name=name)
                    except BaseException:
                        self.groups.pop(e.url, None)  # left mid-broadcast: a new group next time
                        raise
            ok = True
        finally:
            for e in started:
                e.end_update(version if ok else None)
        for url in groups:  # these groups have formed and carried an update: their stores go
            store = getattr(self, "_open_stores", {}).pop(url, None)
            if store is not None:
                store.close()
        return sent

    # ---- the probe check ----------------------------------------------------------------------------------------
    def check(self) -> float:
        """Every engine's greedy continuation of the probe, scored by the trainer: max |engine - trainer| log-prob
        over all engines (a collective: every rank scores). Raises WeightSyncError past sync.check_tol."""
        from opid_mega.rollout.engine import SamplingParams
        from opid_mega.megatron.parallel import broadcast

        n = self.cfg.sync.check_tokens
        probe = SamplingParams(temperature=0.0, max_new_tokens=n)
        outs = broadcast(lambda: self._each(lambda e: (getattr(e, "url", type(e).__name__),
                                                       e.generate([self.probe], probe)[0])))
        seqs = [(self.probe + list(r.response_ids), len(self.probe)) for _, r in outs]
        mine = self.policy.logprobs(seqs, temperature=1.0) if seqs else []
        worst = 0.0
        for (url, r), lp in zip(outs, mine):
            diff = (torch.tensor(r.logprobs, dtype=torch.float64) - lp.double()).abs().max().item() \
                if len(r.logprobs) else 0.0
            if diff > self.tol:
                raise WeightSyncError(f"after weight sync {self.version}, engine {url} gives log-probs up to "
                                      f"{diff:.3g} away from the trainer's on the probe (sync.check_tol={self.tol:g}): "
                                      "the engine does not serve the trainer's weights")
            worst = max(worst, diff)
        return worst
