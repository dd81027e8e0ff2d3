"""Colocated GPU deployment (deploy.mode=colocated): training and serving take turns on the same GPUs.

    co = Colocation(cfg, policy, engine)     # every rank; engine None off global rank 0
    co.before_rollout()    # (after the weight sync) the engines' KV cache back; optimizer state already on the host
    ... rollout ...
    co.after_rollout()     # engines release weights + KV cache (SGLang memory saver); optimizer state back to the GPU
    ... reference, scoring, PPO update ...
    co.before_sync()       # optimizer state to host memory; engines resume their weights (the sync writes into them)

Active only with CUDA, deploy.mode=colocated; each half by its switch (deploy.release_engine_memory: the servers are
launched with --enable-memory-saver; deploy.offload_optimizer). Elsewhere every call is a no-op.
"""
from __future__ import annotations

import torch


def _engines(engine) -> list:
    if engine is None:
        return []
    return list(getattr(engine, "live_engines", None) or [engine])


class Colocation:
    def __init__(self, cfg, policy, engine):
        on = cfg.deploy.mode == "colocated" and torch.cuda.is_available()
        self.release = on and cfg.deploy.release_engine_memory
        self.offload = on and cfg.deploy.offload_optimizer
        self.policy, self.engine = policy, engine
        self.device = torch.device("cuda", torch.cuda.current_device()) if on else None

    def _state_tensors(self):
        opt = self.policy.optimizer
        for o in getattr(opt, "chained_optimizers", [opt]):
            inner = getattr(o, "optimizer", o)
            for st in inner.state.values():
                for k, v in st.items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        yield st, k, v

    def _move_optimizer(self, device) -> None:
        for st, k, v in list(self._state_tensors()):
            st[k] = v.to(device, non_blocking=True) if device.type == "cuda" else v.to(device).pin_memory()
        torch.cuda.synchronize()
        if device.type == "cpu":
            torch.cuda.empty_cache()

    def before_rollout(self) -> None:
        if self.release:
            for e in _engines(self.engine):
                e.resume_memory(["kv_cache"])

    def after_rollout(self) -> None:
        if self.release:
            for e in _engines(self.engine):
                e.release_memory(None)
        if self.offload:
            self._move_optimizer(self.device)

    def before_sync(self) -> None:
        if self.offload:
            self._move_optimizer(torch.device("cpu"))
        if self.release:
            for e in _engines(self.engine):
                e.resume_memory(["weights"])
