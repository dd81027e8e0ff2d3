"""Megatron-core backend of opid-mega: model from a HF config, parallel state, HF<->Megatron weights,
vocabulary-parallel packed log-probs, the OPID/PPO training step, checkpoints and the opid-logprobs CLI.

Import the submodules directly (``opid_mega.megatron.model`` ...); this package imports nothing heavy itself, except
that where Transformer Engine is installed it is imported once here, before megatron-core, so that a broken one is
reported in one line and left out instead of crashing megatron-core's import (:mod:`opid_mega.megatron.te_guard`), and
megatron-core's torch.compile ``jit_fuser``, which our models never use, is set to its no-op before megatron-core is
imported, so that no process imports dynamo and inductor for it (:mod:`opid_mega.megatron.fuser_guard`).
"""
from opid_mega.megatron import fuser_guard as _fuser_guard
from opid_mega.megatron import te_guard as _te_guard

_fuser_guard.install()

_te_guard.guard()
