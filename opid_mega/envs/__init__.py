"""Environments for OPID rollouts: one protocol (`Env`), four backends, verl-agent style prompts.

    from opid_mega.envs import make_env
    env = make_env("textworld")                # offline default: locally generated TextWorld games
    task = env.tasks("train", n=1, seed=0)[0]
    obs = env.reset(task)
    prompt = env.build_prompt(history=[], current_obs=obs, history_length=5)
    action, valid = env.project_action(response)  # the reference's rules; valid=False: the step is penalised
    obs, reward, done, info = env.step(env.noop_action if action is None else action)

Backends: "textworld" (offline default), "alfworld" (real ALFWorld data, or locally generated ALFWorld PDDL games
with `generated=True`), "search_qa" (BM25 over a local corpus; a country-facts corpus ships in opid_mega/data),
"webshop" (HTTP client for a running WebShop server).
"""
from __future__ import annotations

from opid_mega.envs.base import Env, EnvError, Task
from opid_mega.envs.prompts import (CLOSING_ANCHOR, PROMPT_BUILDERS, build_prompt, format_response,
                                    get_prompt_builder, parse_action, project_action)

ENV_NAMES = ("textworld", "alfworld", "search_qa", "webshop")
DEFAULT_ENV = "textworld"  # the offline default

# Defaults the rollout/trainer should use per env (OPID.md setups; TextWorld follows ALFWorld).
ENV_DEFAULTS = {
    "textworld": {"max_steps": 30, "history_length": 5, "success_reward": 10.0, "invalid_penalty": 0.1},
    "alfworld": {"max_steps": 30, "history_length": 5, "success_reward": 10.0, "invalid_penalty": 0.1},
    "webshop": {"max_steps": 15, "history_length": 2, "success_reward": 10.0, "invalid_penalty": 0.1},
    "search_qa": {"max_steps": 4, "history_length": 4, "success_reward": 1.0, "invalid_penalty": 0.01},
}


def env_factory(env_cfg):
    """A zero-argument callable that builds one env as a config's `env` section says (name, max_steps, options)."""
    opts = dict(env_cfg.options)
    return lambda: make_env(env_cfg.name, max_steps=env_cfg.max_steps, **opts)


def make_env(name: str, process: bool = False, **options) -> Env:
    """Build one environment instance (one episode at a time). See each backend for its options.

    process=True runs it in a worker process (`ProcessEnv`, same protocol): real parallelism for TextWorld/ALFWorld,
    whose calls are serialised inside one process."""
    key = name.lower().replace("-", "_")
    if key not in ENV_NAMES + ("search",):
        raise ValueError(f"unknown env {name!r}; expected one of {list(ENV_NAMES)}")
    if process:
        from opid_mega.envs.process import ProcessEnv

        return ProcessEnv(key, **options)
    if key == "textworld":
        from opid_mega.envs.textworld_env import TextWorldEnv

        return TextWorldEnv(**options)
    if key == "alfworld":
        from opid_mega.envs.alfworld_env import AlfWorldEnv

        return AlfWorldEnv(**options)
    if key in ("search_qa", "search"):
        from opid_mega.envs.search_qa import SearchQAEnv

        return SearchQAEnv(**options)
    if key == "webshop":
        from opid_mega.envs.webshop import WebShopEnv

        return WebShopEnv(**options)
    raise ValueError(f"unknown env {name!r}; expected one of {list(ENV_NAMES)}")


__all__ = [
    "CLOSING_ANCHOR", "DEFAULT_ENV", "ENV_DEFAULTS", "ENV_NAMES", "Env", "EnvError", "PROMPT_BUILDERS", "Task", "build_prompt",
    "format_response", "get_prompt_builder", "make_env", "parse_action", "project_action",
]
