"""make_engine: the one place that knows every rollout engine (engine.py holds only the interface they share)."""
from __future__ import annotations

from opid_mega.rollout.engine import RolloutEngine


def make_engine(kind: str, model_path: str, **options) -> RolloutEngine:
    """Build a rollout engine: "local" (LocalEngine(model_path, **options)) or "sglang"
    (SGLangEngine(model_path, **options): launches a server, or attaches with url=...)."""
    if kind == "local":
        from opid_mega.rollout.local_engine import LocalEngine

        return LocalEngine(model_path, **options)
    if kind == "sglang":
        from opid_mega.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(model_path, **options)
    raise ValueError(f"unknown rollout engine {kind!r}; expected 'local' or 'sglang'")
