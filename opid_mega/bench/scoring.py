"""opid-bench ops on a megatron-core model: rescoring (naive vs fork) and training attention."""
from __future__ import annotations

OPS: dict = {}
