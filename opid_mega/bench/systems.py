"""opid-bench ops of the systems around the model: the C++ batch builder, weight sync, environment workers."""
from __future__ import annotations

OPS: dict = {}
