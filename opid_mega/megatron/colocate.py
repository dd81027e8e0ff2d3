"""Colocated GPU deployment (deploy.mode=colocated): training and serving take turns on the same GPUs.

    co = Colocation(cfg, policy, engine)     # every rank; engine None off global rank 0
    co.before_rollout()    # whatever the engines still have released comes back (normally nothing: see after_sync)
    ... rollout ...
    co.after_rollout()     # engines release KV cache, weights and CUDA graphs; Adam's moments back to the GPU
    ... reference, scoring, PPO update ...
    co.before_sync()       # Adam's moments to host memory; engines resume their weights (the sync writes into them)
    ... weight transfer ...
    co.after_sync()        # engines resume KV cache and CUDA graphs: the sync's probe decodes, then the next rollout
    co.close()             # (end of a run, Ctrl-C) attached engines get back whatever is still released

SGLang 0.5.23 keeps the released regions in a set (its scheduler's `offload_tags`): resuming a tag that is not
released raises KeyError, releasing a released region raises in torch_memory_saver, and either kills the server;
decoding with the KV cache, the weights or the CUDA graphs' memory released is an illegal memory access. So every
call names its tags, releases only what is held and resumes only what this object released (per engine); nothing is
ever released with the default (None = all) or resumed by it. The KV cache is sized once, at server start, from the
GPU memory free then (see opid_mega.plan): resuming it needs that memory free again, which is why the optimizer's
moments leave the GPU before the engines' memory comes back.

Active with CUDA and deploy.mode=colocated; each half by its switch (deploy.release_engine_memory: the servers are
launched with --enable-memory-saver; deploy.offload_optimizer). Elsewhere every call is a no-op. `force=True`
(testing only) turns the hooks on without CUDA: the optimizer state then moves CPU -> CPU, and the engine calls are
the real ones (tests/rollout/test_colocation.py runs them against a strict fake of SGLang's state machine).
"""
from __future__ import annotations

import sys

import torch

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"  # sglang.srt.constants GPU_MEMORY_TYPE_*
RELEASED_IN_TRAINING = (KV_CACHE, WEIGHTS, CUDA_GRAPH)


def _engines(engine) -> list:
    if engine is None:
        return []
    return list(getattr(engine, "live_engines", None) or [engine])


class Colocation:
    def __init__(self, cfg, policy, engine, force: bool = False):
        on = cfg.deploy.mode == "colocated" and (torch.cuda.is_available() or force)
        self.release = on and cfg.deploy.release_engine_memory
        self.offload = on and cfg.deploy.offload_optimizer
        self.policy, self.engine = policy, engine
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu")) if on else None
        self._released: dict = {}  # id(engine) -> (engine, set of tags this object released on it)

    # ---- optimizer state ----------------------------------------------------------------------------------------
    def _state_tensors(self):
        opt = self.policy.optimizer
        for o in getattr(opt, "chained_optimizers", [opt]):
            inner = getattr(o, "optimizer", o)
            for st in inner.state.values():
                for k, v in st.items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        yield st, k, v

    def _move_optimizer(self, device) -> None:
        """Adam's moments (the torch optimizer's state) to `device`; its parameters (the fp32 master weights under
        Megatron's optimizers) stay where they are."""
        for st, k, v in list(self._state_tensors()):
            st[k] = v.to(device, non_blocking=True) if device.type == "cuda" else \
                (v.to(device).pin_memory() if torch.cuda.is_available() else v.to(device, copy=True))
        if not torch.cuda.is_available():
            return
        torch.cuda.synchronize()
        if device.type == "cpu":
            torch.cuda.empty_cache()

    # ---- engine memory: release only what is held, resume only what was released -------------------------------
    def released(self, e) -> set:
        return set(self._released.get(id(e), (e, set()))[1])

    def _release(self, tags) -> None:
        for e in _engines(self.engine):
            _, done = self._released.setdefault(id(e), (e, set()))
            held = [t for t in tags if t not in done]
            if held:
                e.release_memory(held)
                done.update(held)

    def _resume(self, tags, engines=None) -> None:
        for e in _engines(self.engine) if engines is None else engines:
            _, done = self._released.get(id(e), (e, set()))
            back = [t for t in tags if t in done]
            if back:
                e.resume_memory(back)
                done.difference_update(back)

    # ---- the phases ---------------------------------------------------------------------------------------------
    def before_rollout(self) -> None:
        if self.release:  # normally nothing left: after_sync resumed it (a sync may have been skipped or failed)
            self._resume(RELEASED_IN_TRAINING)

    def after_rollout(self) -> None:
        if self.release:
            self._release(RELEASED_IN_TRAINING)
        if self.offload:
            self._move_optimizer(self.device)

    def before_sync(self) -> None:
        if self.offload:
            self._move_optimizer(torch.device("cpu"))
        if self.release:
            self._resume([WEIGHTS])

    def after_sync(self) -> None:
        if self.release:
            self._resume([KV_CACHE, CUDA_GRAPH])

    def close(self) -> None:
        """End of the run (also after Ctrl-C or an error): engines this process attached to (not launched: those
        are shut down) get back whatever is still released, so that the next user of the server can decode. A
        server that cannot be reached is left as it is, with one line."""
        for e, tags in list(self._released.values()):
            if not tags or getattr(e, "pid", None) is not None:
                continue
            try:
                self._resume(sorted(tags), [e])
            except Exception as exc:  # noqa: BLE001 - shutting down: report, never raise
                print(f"opid-train: could not give {getattr(e, 'url', e)} its {sorted(tags)} memory back: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
