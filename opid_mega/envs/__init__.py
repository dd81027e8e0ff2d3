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

Deadlines: every reset/step has one (`step_timeout_s`, 60 s; the config's `env.step_timeout_s`). TextWorld and ALFWorld
run in a worker process by default (`opid_mega.envs.process.ProcessEnv`), killed and restarted when a call passes it;
`process=False` (config: `env.options: {process: false}`) keeps them in the caller's process (see base.py).
"""
from __future__ import annotations

from typing import Optional

from opid_mega.envs.base import Env, EnvError, Task
from opid_mega.envs.prompts import (CLOSING_ANCHOR, DEFAULT_TEMPLATE, PROMPT_BUILDERS, TEMPLATES, build_prompt,
                                    format_response, get_prompt_builder, parse_action, project_action)

ENV_NAMES = ("textworld", "alfworld", "search_qa", "webshop")
DEFAULT_ENV = "textworld"  # the offline default

# Defaults the rollout/trainer should use per env (OPID.md setups; TextWorld follows ALFWorld).
ENV_DEFAULTS = {
    "textworld": {"max_steps": 30, "history_length": 5, "success_reward": 10.0, "invalid_penalty": 0.1},
    "alfworld": {"max_steps": 30, "history_length": 5, "success_reward": 10.0, "invalid_penalty": 0.1},
    "webshop": {"max_steps": 15, "history_length": 2, "success_reward": 10.0, "invalid_penalty": 0.1},
    "search_qa": {"max_steps": 4, "history_length": 4, "success_reward": 1.0, "invalid_penalty": 0.01},
}


PROCESS_BY_DEFAULT = ("textworld", "alfworld")  # native simulators: only a worker process can be stopped
DEFAULT_STEP_TIMEOUT_S = 60.0  # = EnvConfig.step_timeout_s


def env_factory(env_cfg):
    """A zero-argument callable that builds one env as a config's `env` section says (name, max_steps, options,
    step_timeout_s, template). `env.options.process` (true/false) overrides where it runs (make_env)."""
    opts = dict(env_cfg.options)
    template = getattr(env_cfg, "template", DEFAULT_TEMPLATE)
    return lambda: make_env(env_cfg.name, max_steps=env_cfg.max_steps, step_timeout_s=env_cfg.step_timeout_s,
                            template=template, **opts)


def make_env(name: str, process: Optional[bool] = None, step_timeout_s: Optional[float] = DEFAULT_STEP_TIMEOUT_S,
             template: str = DEFAULT_TEMPLATE, **options) -> Env:
    """Build one environment instance (one episode at a time). See each backend for its options.

    process: run it in a worker process (`ProcessEnv`, same protocol); None (the default) = True for TextWorld and
    ALFWorld, False for Search-QA and WebShop. A worker gives a hard deadline (a call past `step_timeout_s` kills
    it and raises EnvTimeout; the next call runs in a fresh worker) and real parallelism for TextWorld/ALFWorld,
    whose calls are serialised inside one process.
    step_timeout_s: the deadline of each reset/step (None: none). In-process, the call runs in a daemon thread that
    is abandoned past it (the env is then unusable); Search-QA is pure Python and WebShop's HTTP requests also
    carry their own `timeout` option.
    template: the prompt template set, "reference" (default) or "ours" (opid_mega.envs.prompts; config
    env.template); TextWorld's first observation ends with a task line under "reference", as ALFWorld's does."""
    key = name.lower().replace("-", "_")
    if template not in TEMPLATES:
        raise ValueError(f"env template must be one of {', '.join(TEMPLATES)}, got {template!r}")
    if key not in ENV_NAMES + ("search",):
        raise ValueError(f"unknown env {name!r}; expected one of {list(ENV_NAMES)}")
    if process is None:
        process = key in PROCESS_BY_DEFAULT
    if not isinstance(process, bool):
        raise ValueError(f"env option process must be true or false, got {process!r}")
    if step_timeout_s is not None and not (isinstance(step_timeout_s, (int, float)) and not isinstance(
            step_timeout_s, bool) and 0 < step_timeout_s < float("inf")):
        raise ValueError(f"env step_timeout_s must be a finite number of seconds > 0 or None, got {step_timeout_s!r}")
    if process:
        from opid_mega.envs.process import ProcessEnv

        return ProcessEnv(key, step_timeout_s=step_timeout_s, template=template, **options)
    if key == "textworld":
        from opid_mega.envs.textworld_env import TextWorldEnv

        env = TextWorldEnv(template=template, **options)
    elif key == "alfworld":
        from opid_mega.envs.alfworld_env import AlfWorldEnv

        env = AlfWorldEnv(**options)
    elif key in ("search_qa", "search"):
        from opid_mega.envs.search_qa import SearchQAEnv

        env = SearchQAEnv(**options)
    else:
        from opid_mega.envs.webshop import WebShopEnv

        env = WebShopEnv(**options)
    env.step_timeout_s = step_timeout_s
    env.prompt_template = template
    return env


__all__ = [
    "CLOSING_ANCHOR", "DEFAULT_ENV", "ENV_DEFAULTS", "ENV_NAMES", "Env", "EnvError", "PROMPT_BUILDERS", "TEMPLATES",
    "Task", "build_prompt",
    "format_response", "get_prompt_builder", "make_env", "parse_action", "project_action",
]
