"""The rollout engine protocol, shared by the embedded `local` engine and the `sglang` server engine.

    engine = make_engine("local", model_path)                       # or "sglang" (launch or attach)
    results = engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=512, stop_token_ids=[eos]))
    results[i].response_ids, results[i].logprobs, results[i].finish_reason
    engine.update_weights(model.named_parameters())                 # HF-named tensors, streamed
    engine.health(); engine.shutdown()

Log-prob convention (the same for every engine, and the one SGLang uses by default): `logprobs[t]` is the log-prob
of the sampled token under the distribution the engine sampled from BEFORE top-p truncation, i.e.
`log_softmax(logits / temperature)[token]`; greedy decoding (temperature 0) reports `log_softmax(logits)[token]`.
OPID samples rollouts and scores both contexts at temperature 1.0, so at training time these are exactly the
model's log-probs `log π(y_t | prompt, y_<t)` that the trainer recomputes as `old_log_probs` (step-0 invariant).
At the evaluation temperature (0.4) they are the tempered distribution's log-probs (used for metrics only).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol, Sequence, runtime_checkable

import torch

FINISH_STOP = "stop"  # a stop token was generated (it is the last response token)
FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_ABORT = "abort"  # the engine aborted the request (e.g. a weight update interrupted it)


class EngineError(RuntimeError):
    """The rollout engine cannot serve (dead server, bad request, weight update refused...)."""


class RolloutDeadline(EngineError):
    """A generate call was cut short by the rollout's deadline (rollout.deadline_s): no server failure — the
    agent loop ends the trajectories still running as deadline failures."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one batched generate call.

    temperature: 0 means greedy. top_p in (0, 1]. stop_token_ids: generation ends after one of these tokens is
    sampled (it is kept as the last response token, and its log-prob returned). seed: makes the local engine's
    sampling reproducible (the SGLang engine forwards it as `sampling_seed`, honoured when the server allows it).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    stop_token_ids: tuple = ()
    seed: Optional[int] = None

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerationResult:
    """One generated response: its token ids, the per-token log-probs (see the module docstring), and why it ended
    (FINISH_STOP / FINISH_LENGTH / FINISH_ABORT)."""

    response_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str = FINISH_LENGTH

    def __post_init__(self):
        if len(self.response_ids) != len(self.logprobs):
            raise ValueError(
                f"GenerationResult: {len(self.response_ids)} response ids but {len(self.logprobs)} log-probs")


@runtime_checkable
class RolloutEngine(Protocol):
    """What the agent loop and the trainer need from a rollout engine."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerationResult]:
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        ...

    def health(self) -> bool:
        ...

    def shutdown(self) -> None:
        ...


def check_prompts(prompt_ids: Sequence[Sequence[int]], vocab_size: Optional[int] = None) -> list[list[int]]:
    """Validate a batch of prompts (non-empty lists of ints in [0, vocab_size)) and return plain lists."""
    out = []
    for i, ids in enumerate(prompt_ids):
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if vocab_size is not None:
            bad = [t for t in ids if t < 0 or t >= vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")
        out.append(ids)
    return out
