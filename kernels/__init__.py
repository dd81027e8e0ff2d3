"""Kernels, installed as `opid_mega.kernels` (never import the folder as a top-level `kernels` module).

One kernel per file with its torch reference beside it; the Triton halves (`*_triton.py`) are imported lazily, only
when the Triton backend is chosen, so importing this package needs neither a GPU nor a working triton.

Backend dispatch (every public entry point takes `backend="auto"|"triton"|"torch"`):
  auto   -> Triton on CUDA tensors; Triton under the CPU interpreter when TRITON_INTERPRET=1 AND
            OPID_TRITON_INTERPRET=1 are set (before the first kernel import); the torch path otherwise.
  triton -> Triton (CPU tensors need TRITON_INTERPRET=1).
  torch  -> the torch path (chunked / per-segment; the CPU production path).
"""
from ._dispatch import resolve_backend
from .dual_context_divergence import dual_context_divergence, divergence_reference, naive_divergence
from .fork_attention import (ForkMetadata, build_fork_metadata, fork_attention, fork_attention_mask,
                             fork_attention_reference)
from .logprob import fused_logprobs, logprobs_reference, naive_logprobs

__all__ = [
    "fused_logprobs", "logprobs_reference", "naive_logprobs",
    "dual_context_divergence", "divergence_reference", "naive_divergence",
    "fork_attention", "fork_attention_reference", "fork_attention_mask", "build_fork_metadata", "ForkMetadata",
    "resolve_backend",
]
