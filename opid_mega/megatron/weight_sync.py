"""Weight sync Megatron -> rollout engines (issue 14 item 4; config section `sync`).

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
                    handles (SGLang's MultiprocessingSerializer); engines on this machine (colocated, CPU)
       distributed  update_weights_from_distributed: global rank 0 is rank 0 of a process group with each engine's
                    TP ranks (NCCL on GPU, gloo on CPU) and broadcasts every bucket; engines on other GPUs/hosts
       disk         HF safetensors under sync.disk_dir/v<version> (a filesystem the servers see), then
                    update_weights_from_disk; the fallback
       local        an in-process engine (opid_mega.rollout.local_engine): its update_weights copies the tensors
       auto         distributed for a disaggregated GPU deployment, tensor when every engine runs on this machine,
                    disk otherwise
     generation is paused during the transfer and resumed after it; every sync sets the engines' weight version to
     the sync count (SGLang's weight_version, read back to confirm).
  4. check, every sync.check_interval syncs (the first one included): each engine decodes a fixed probe greedily and
     its log-probs must equal the trainer's log-probs of the same tokens within sync.check_tol; else WeightSyncError.
"""
from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

PROBE_TEXT = "You are in the middle of a room. Looking quickly around you, you see a cabinet, a desk and a drawer."


class WeightSyncError(RuntimeError):
    """A sync that did not leave the engines on the trainer's weights (the message says which engine and why)."""


def _engines(engine) -> list:
    """The engines a sync feeds: a fleet's servers still in rotation, or the one engine."""
    if engine is None:
        return []
    if hasattr(engine, "live_engines"):
        return list(engine.live_engines)
    return [engine]


def _is_local(url: str) -> bool:
    return any(h in url for h in ("//127.0.0.1", "//localhost", "//0.0.0.0", f"//{socket.gethostname()}"))


def resolve_method(method: str, mode: str, engines: list) -> str:
    if engines and not all(hasattr(e, "begin_update") for e in engines):
        return "local"  # an in-process engine (LocalEngine): its update_weights copies the tensors
    if method != "auto":
        return method
    if mode == "disaggregated" and torch.cuda.is_available():
        return "distributed"
    if all(_is_local(e.url) for e in engines):
        return "tensor"
    return "disk"


def check_tolerance(tol: float, dtype: str) -> float:
    return tol if tol > 0 else (1e-3 if dtype == "float32" else 5e-2)


class WeightSync:
    def __init__(self, policy, engine, cfg, run_dir: str, tokenizer=None):
        self.policy, self.cfg = policy, cfg
        self.engine = engine
        self.engines = _engines(engine)
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self.method = resolve_method(cfg.sync.method, cfg.deploy.mode, self.engines) if self.rank0 else None
        self.bucket_bytes = cfg.sync.bucket_mb << 20
        self.disk_dir = Path(cfg.sync.disk_dir or os.path.join(run_dir, "weight_sync"))
        self.tol = check_tolerance(cfg.sync.check_tol, cfg.model.dtype)
        self.version = 0
        self.groups: dict = {}  # engine url -> its update process group (distributed)
        self.probe = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]) if tokenizer else [1, 2, 3]
        if self.rank0 and self.method == "tensor":
            remote = [e.url for e in self.engines if not _is_local(e.url)]
            if remote:
                raise ValueError(f"sync.method=tensor sends shared-memory / CUDA IPC handles, but {remote} run on "
                                 "another host: use sync.method=distributed or disk")

    # ---- the collective -----------------------------------------------------------------------------------------
    def __call__(self, version: Optional[int] = None, after_transfer=None) -> dict:
        """One sync (a collective). `after_transfer()` runs on every rank between the transfer and the probe check
        (colocated: the engines' KV cache and CUDA graphs come back before the probe decodes)."""
        self.version = self.version + 1 if version is None else int(version)
        self.engines = _engines(self.engine)  # a fleet may have lost a server since the last sync
        t0 = time.perf_counter()
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
        for old in self.disk_dir.glob("v*"):  # keep only the version the engines now serve
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
        return sent

    def _group(self, e):
        if e.url in self.groups:
            return self.groups[e.url]
        import threading

        from sglang.srt.utils.common import init_custom_process_group

        host = "127.0.0.1" if _is_local(e.url) else socket.gethostbyname(socket.gethostname())
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        name = f"opid_weights_{port}"
        err: dict = {}

        def join():
            try:
                e.init_weights_update_group(host, port, 1, 1 + e.tp_size, group_name=name, backend=backend)
            except BaseException as exc:  # noqa: BLE001
                err["e"] = exc

        th = threading.Thread(target=join, daemon=True)
        th.start()
        group = init_custom_process_group(backend=backend, init_method=f"tcp://{host}:{port}",
                                          world_size=1 + e.tp_size, rank=0, group_name=name)
        th.join()
        if "e" in err:
            raise err["e"]
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
        return sent

    # ---- the probe check ----------------------------------------------------------------------------------------
    def check(self) -> float:
        """Every engine's greedy continuation of the probe, scored by the trainer: max |engine - trainer| log-prob
        over all engines (a collective: every rank scores). Raises WeightSyncError past sync.check_tol."""
        from opid_mega.rollout.engine import SamplingParams
        from opid_mega.trainer import broadcast

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
