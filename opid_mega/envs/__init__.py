"""Environments for OPID rollouts: one protocol (`Env`), five backends, verl-agent style prompts.

    from opid_mega.envs import make_env
    env = make_env("textworld")                # offline default: locally generated TextWorld games
    task = env.tasks("train", n=1, seed=0)[0]
    obs = env.reset(task)
    prompt = env.build_prompt(history=[], current_obs=obs, history_length=5)
    action, valid = env.project_action(response)  # the reference's rules; valid=False: the step is penalised
    obs, reward, done, info = env.step(env.noop_action if action is None else action)

Backends: "textworld" (offline default), "alfworld" (real ALFWorld data, or locally generated ALFWorld PDDL games
with `generated=True`), "search_qa" (BM25 over a local corpus; a country-facts corpus ships in opid_mega/data),
"webshop" (HTTP client for a running WebShop server), "footprints" (a pure-Python game with one critical door
decision, the mechanism experiment's task family: footprints_env).

Plug-ins: `name` may be an import path "package.module:Class" naming a subclass of `Env` defined anywhere on
`sys.path` (config `env.name`); its `env.options` go to the class's constructor (docs/custom_env.md).
`check_env_config(env_cfg)` checks a config's env section (name, options against the constructor) without building.

Deadlines: every reset/step has one (`step_timeout_s`, 60 s; the config's `env.step_timeout_s`). TextWorld and ALFWorld
run in a worker process by default (`opid_mega.envs.process.ProcessEnv`), killed and restarted when a call passes it;
`process=False` (config: `env.options: {process: false}`) keeps them in the caller's process (see base.py).
"""
from __future__ import annotations

from typing import Optional

from opid_mega.envs.base import Env, EnvError, Task
from opid_mega.envs.prompts import (CLOSING_ANCHOR, DEFAULT_TEMPLATE, PROMPT_BUILDERS, TEMPLATES, build_prompt,
                                    format_response, get_prompt_builder, parse_action, project_action)
from opid_mega.plugins import PluginError, check_options, constructor_options, is_import_path, load_class

ENV_NAMES = ("textworld", "alfworld", "search_qa", "webshop", "footprints")
DEFAULT_ENV = "textworld"  # the offline default

# Defaults the rollout/trainer should use per env (docs/algorithm.md "Setups in the paper"; TextWorld follows ALFWorld).
ENV_DEFAULTS = {
    "textworld": {"max_steps": 30, "history_length": 5, "success_reward": 10.0, "invalid_penalty": 0.1},
    "alfworld": {"max_steps": 30, "history_length": 5, "success_reward": 10.0, "invalid_penalty": 0.1},
    "webshop": {"max_steps": 15, "history_length": 2, "success_reward": 10.0, "invalid_penalty": 0.1},
    "search_qa": {"max_steps": 4, "history_length": 4, "success_reward": 1.0, "invalid_penalty": 0.01},
    # the mechanism experiment's game: each game's own budget (expert length + 1) is 4 or 5 steps
    "footprints": {"max_steps": 5, "history_length": 5, "success_reward": 10.0, "invalid_penalty": 0.1},
}


PROCESS_BY_DEFAULT = ("textworld", "alfworld")  # native simulators: only a worker process can be stopped
DEFAULT_STEP_TIMEOUT_S = 60.0  # = EnvConfig.step_timeout_s


ENV_BASE = "opid_mega.envs.Env"  # how messages name the base class of plug-in envs
_BUILTIN_CLASSES = {"textworld": ("opid_mega.envs.textworld_env", "TextWorldEnv"),
                    "alfworld": ("opid_mega.envs.alfworld_env", "AlfWorldEnv"),
                    "search_qa": ("opid_mega.envs.search_qa", "SearchQAEnv"),
                    "webshop": ("opid_mega.envs.webshop", "WebShopEnv"),
                    "footprints": ("opid_mega.envs.footprints_env", "FootprintsEnv")}
# make_env's own keywords, set from other config keys (never in env.options)
_RESERVED = {"max_steps": "env.max_steps", "step_timeout_s": "env.step_timeout_s", "template": "env.template"}
_WORKER_OPTIONS = ("start_method", "timeout")  # ProcessEnv's own options (env.options when it runs in a worker)


def env_class(name: str) -> type:
    """The Env subclass `name` stands for: a built-in name, or an import path "package.module:Class" (PluginError,
    one line naming env.name, when it cannot be imported or is no Env subclass)."""
    if is_import_path(name):
        return load_class(name, "env.name", Env, ENV_BASE)
    key = name.lower().replace("-", "_")
    key = "search_qa" if key == "search" else key
    if key not in _BUILTIN_CLASSES:
        raise ValueError(f"unknown env {name!r}; expected one of {list(ENV_NAMES)}")
    import importlib

    module, attr = _BUILTIN_CLASSES[key]
    return getattr(importlib.import_module(module), attr)


def check_env_config(env_cfg) -> None:
    """Check a config's `env` section before anything is built: `name` is a built-in env or an importable Env
    subclass whose prompt and action families exist (or that builds its own prompts / parses its own actions), and
    every `options` key is a keyword of its constructor (or of make_env: process; of a worker process:
    start_method, timeout). Raises PluginError with one line naming the key."""
    name, options = env_cfg.name, env_cfg.options
    if not is_import_path(name) and name not in ENV_NAMES:
        raise PluginError(f"env.name: got {name!r}, allowed: one of {', '.join(repr(n) for n in ENV_NAMES)} or an "
                          f"import path 'package.module:Class' (a subclass of {ENV_BASE})")
    cls = env_class(name)
    if is_import_path(name):
        from opid_mega.envs import prompts as _prompts

        if cls.build_prompt is Env.build_prompt and cls.prompt_family is Env.prompt_family \
                and cls.name not in _prompts.PROMPT_BUILDERS:
            raise PluginError(f"env.name: {name}: its name {cls.name!r} is no prompt family of "
                              "opid_mega.envs.prompts; override build_prompt (or prompt_family: one of "
                              f"{', '.join(sorted(_prompts.PROMPT_BUILDERS))})")
        families = _prompts.ACTION_FAMILIES + _prompts.SEARCH_FAMILIES
        if cls.project_action is Env.project_action and cls.family not in families:
            raise PluginError(f"env.name: {name}: family {cls.family!r} is not one of {', '.join(families)}; set "
                              "family, or override project_action")
    process = options.get("process") if isinstance(options, dict) else None
    if process is not None and not isinstance(process, bool):
        raise PluginError(f"env.options.process: got {process!r}, allowed: true or false")
    worker = process if process is not None else name in PROCESS_BY_DEFAULT
    check_options(cls, options, "env.options", reserved=_RESERVED,
                  extra=("process",) + (_WORKER_OPTIONS if worker else ()), label=name)


def _build_plugin(cls: type, template: str, options: dict) -> Env:
    """cls(**options), with max_steps (env.max_steps) and template (env.template) passed when its constructor
    takes them; max_steps is set on the instance either way."""
    kwargs = dict(options)
    max_steps = kwargs.pop("max_steps", None)
    spec = constructor_options(cls)
    names = None if spec is None else spec[0]
    if max_steps is not None and (names is None or "max_steps" in names):
        kwargs["max_steps"] = max_steps
    if names is not None and "template" in names:
        kwargs["template"] = template
    env = cls(**kwargs)
    if max_steps is not None:
        env.max_steps = int(max_steps)
    return env


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
    plugin = is_import_path(name)
    key = name if plugin else name.lower().replace("-", "_")
    if template not in TEMPLATES:
        raise ValueError(f"env template must be one of {', '.join(TEMPLATES)}, got {template!r}")
    if not plugin and key not in ENV_NAMES + ("search",):
        raise ValueError(f"unknown env {name!r}; expected one of {list(ENV_NAMES)}")
    cls = env_class(key) if plugin else None  # a bad import path: PluginError (one line) before any worker starts
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
    if plugin:
        env = _build_plugin(cls, template, options)
    elif key == "textworld":
        from opid_mega.envs.textworld_env import TextWorldEnv

        env = TextWorldEnv(template=template, **options)
    elif key == "alfworld":
        from opid_mega.envs.alfworld_env import AlfWorldEnv

        env = AlfWorldEnv(**options)
    elif key in ("search_qa", "search"):
        from opid_mega.envs.search_qa import SearchQAEnv

        env = SearchQAEnv(**options)
    elif key == "footprints":
        from opid_mega.envs.footprints_env import FootprintsEnv

        env = FootprintsEnv(template=template, **options)
    else:
        from opid_mega.envs.webshop import WebShopEnv

        env = WebShopEnv(**options)
    env.step_timeout_s = step_timeout_s
    env.prompt_template = template
    return env


__all__ = [
    "CLOSING_ANCHOR", "DEFAULT_ENV", "ENV_DEFAULTS", "ENV_NAMES", "Env", "EnvError", "PROMPT_BUILDERS", "TEMPLATES",
    "Task", "build_prompt", "check_env_config", "env_class",
    "format_response", "get_prompt_builder", "make_env", "parse_action", "project_action",
]
