"""Rollouts: engines (embedded `local`, `sglang` server), the agent loop over environments, step-sample records.

    from opid_mega.rollout import AgentLoop, SamplingParams, make_engine
    engine = make_engine("local", model_path)                     # or make_engine("sglang", model_path, ...)
    loop = AgentLoop(engine, tokenizer, env_name="textworld", history_length=5)
    batch = loop.run(tasks, group_size=8, sampling=SamplingParams(temperature=1.0, max_new_tokens=512,
                                                                  stop_token_ids=loop.stop_token_ids))

`cpu_shims/` is not a Python package of opid_mega: it is put on the SGLang server's PYTHONPATH for CPU serving.
"""
from opid_mega.rollout.agent_loop import (AgentLoop, PromptTokenizer, default_stop_token_ids, run_rollout,
                                         step_seed)
from opid_mega.rollout.engine import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, EngineError, GenerationResult,
                                      RolloutEngine, SamplingParams)
from opid_mega.rollout.factory import make_engine
from opid_mega.rollout.types import RolloutBatch, StepSample, Trajectory

__all__ = [
    "AgentLoop", "EngineError", "FINISH_ABORT", "FINISH_LENGTH", "FINISH_STOP", "GenerationResult", "PromptTokenizer",
    "RolloutBatch", "RolloutEngine", "SamplingParams", "StepSample", "Trajectory", "default_stop_token_ids",
    "make_engine", "run_rollout", "step_seed",
]
