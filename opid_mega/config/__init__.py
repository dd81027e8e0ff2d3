"""Typed run configuration: dataclasses, YAML files, dotted CLI overrides, validation.

    cfg = load_config("configs/tiny_cpu.yaml", ["algo.lambda_episode=0.001", "parallel.tp=2"])

Every key is declared in opid_mega/config/schema.py (one dataclass per section); an unknown key, a value of the wrong type, or a value outside its allowed set is a
`ConfigError` whose one-line message names the dotted key and what is allowed.

`python -m opid_mega.config FILE [key=value ...]` prints the resolved config as YAML (exit 0) or the error (exit 2).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import typing
from typing import Any, Literal, Optional

import yaml

# the sections (opid_mega/config/schema.py), importable from here
from opid_mega.config.schema import (AlgoConfig, AnalyzerConfig, Config, DeployConfig, EnvConfig,  # noqa: F401
                                      EvalConfig, LoggingConfig, ModelConfig, ParallelConfig, RolloutConfig,
                                      ScoringConfig, SftConfig, SyncConfig, TrainConfig)


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key."""


class YAMLLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader (YAML 1.1) with YAML 1.2's floats: `1e-6`, `1E6`, `-2e-3`, `.5`, `-.5`, `1.`, `5e+3` are
    numbers (1.1 needs a dot and a signed exponent: it reads `1e-6` as the string '1e-6'). Everything else is as
    safe_load reads it; integers stay integers. Every config file and key=value override is read with it."""


# YAML 1.2 core schema floats (with a dot or an exponent: "10" stays an int; 1.1's forms still resolve first)
_FLOAT_12 = re.compile(r"^(?=[^.eE]*[.eE])[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$")
YAMLLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def yaml_load(stream):
    """yaml.safe_load with YAML 1.2 floats (YAMLLoader)."""
    return yaml.load(stream, Loader=YAMLLoader)  # noqa: S506 - a SafeLoader subclass


# --------------------------------------------------------------------------------------------------------------------
# Range checks beyond types: (dotted key, predicate, what is allowed)
# --------------------------------------------------------------------------------------------------------------------

# Every number is finite (inf / nan are refused by type, _coerce) and every integer lies in [-INT_LIMIT, INT_LIMIT];
# every numeric field has its range here (tests/test_config_numbers.py checks that none is missing).
INT_LIMIT = 2**31 - 1
MAX_SECONDS = 1e7  # ~116 days: longer is no timeout any caller can wait for (threading/socket limits are ~1e9 s)
_POSITIVE_INT = (lambda v: v >= 1, "an integer >= 1")
_NON_NEG = (lambda v: v >= 0, "a number >= 0")
_POSITIVE = (lambda v: v > 0, "a number > 0")
_PROB = (lambda v: 0 < v <= 1, "a number in (0, 1]")
_SECONDS = (lambda v: 0 < v <= MAX_SECONDS, f"a number of seconds in (0, {MAX_SECONDS:g}]")
_BACKOFF = (lambda v: 0 <= v <= 3600, "a number of seconds in [0, 3600]")
_BETA = (lambda v: 0 <= v < 1, "a number in [0, 1)")
_ENV_NAME = (lambda v: v == "" or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v) is not None,
             "an environment variable name (letters, digits, _) or empty")

_CHECKS: dict[str, tuple] = {
    "parallel.tp": _POSITIVE_INT,
    "parallel.pp": _POSITIVE_INT,
    "parallel.vpp": _POSITIVE_INT,
    "parallel.cp": (lambda v: v == 1, "1 (context parallelism is not supported)"),
    "env.max_steps": _POSITIVE_INT,
    "env.history_length": (lambda v: v >= 0, "an integer >= 0"),
    "env.num_workers": _POSITIVE_INT,
    "env.step_timeout_s": _SECONDS,
    "rollout.tasks_per_iter": _POSITIVE_INT,
    "rollout.group_size": _POSITIVE_INT,
    "rollout.temperature": _POSITIVE,
    "rollout.top_p": _PROB,
    "rollout.max_prompt_tokens": _POSITIVE_INT,
    "rollout.max_response_tokens": _POSITIVE_INT,
    "rollout.request_timeout_s": _SECONDS,
    "rollout.deadline_s": _SECONDS,
    "analyzer.deadline_s": _SECONDS,
    "analyzer.max_step_skills": (lambda v: v >= 0, "an integer >= 0"),
    "analyzer.gamma": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "analyzer.concurrency": (lambda v: 1 <= v <= 1024, "an integer in [1, 1024]"),
    "analyzer.max_in_flight": (lambda v: v >= 0, "an integer >= 0 (0: no limit beyond analyzer.concurrency)"),
    "analyzer.timeout_s": (lambda v: v is None or 0 < v <= MAX_SECONDS,
                           f"null or a number of seconds in (0, {MAX_SECONDS:g}]"),
    "analyzer.stall_timeout_s": _SECONDS,
    "analyzer.max_retries": (lambda v: 0 <= v <= 100, "an integer in [0, 100]"),
    "analyzer.max_failed_iterations": (lambda v: v >= 0, "an integer >= 0 (0: never stop)"),
    "analyzer.backoff_s": _BACKOFF,
    "analyzer.backoff_max_s": _BACKOFF,
    "analyzer.temperature": (lambda v: v is None or 0 <= v <= 2, "null (the server's default) or a number in [0, 2]"),
    "analyzer.max_tokens": _POSITIVE_INT,
    "analyzer.max_skill_tokens": _POSITIVE_INT,
    "analyzer.api_key_env": _ENV_NAME,
    "algo.lambda_episode": _NON_NEG,
    "algo.lambda_step": _NON_NEG,
    "algo.invalid_penalty": _NON_NEG,
    "algo.delta_clip": (lambda v: v is None or v > 0, "null or a number > 0"),
    "algo.skill_share_cap": (lambda v: v is None or v >= 0, "null or a number >= 0"),
    "algo.distill_coef": _NON_NEG,
    "algo.delta_topk": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
    "algo.clip_low": _NON_NEG,
    "algo.clip_high": _NON_NEG,
    "algo.dual_clip": (lambda v: v is None or v > 1, "null or a number > 1"),
    "algo.log_ratio_clamp": (lambda v: v is None or v > 0, "null or a number > 0"),
    "algo.kl_coef": _NON_NEG,
    "algo.entropy_coef": _NON_NEG,
    "train.iterations": (lambda v: v >= 0, "an integer >= 0"),
    "train.lr": _NON_NEG,
    "train.lr_warmup_ratio": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "train.weight_decay": _NON_NEG,
    "train.adam_beta1": _BETA,
    "train.adam_beta2": _BETA,
    "train.grad_clip": _NON_NEG,
    "train.seed": (lambda v: v >= 0, "an integer >= 0"),
    "train.mini_batch_size": _POSITIVE_INT,
    "train.micro_batch_tokens": _POSITIVE_INT,
    "train.micro_batch_size": (lambda v: v >= 0, "an integer >= 0 (0: the packed micro-batches)"),
    "train.pad_multiple": (lambda v: v >= 0, "an integer >= 0 (0: no padding)"),
    "train.balance_ranks": (lambda v: v >= 0, "an integer >= 0 (0: rollout order)"),
    "train.ppo_epochs": _POSITIVE_INT,
    "train.max_staleness": (lambda v: v >= 0, "an integer >= 0"),
    "train.behavior_weight_cap": (lambda v: v > 0, "a number > 0"),
    "train.save_interval": (lambda v: v >= 0, "an integer >= 0"),
    "train.keep_checkpoints": (lambda v: v >= 0, "an integer >= 0 (0 keeps all)"),
    "sft.epochs": _POSITIVE_INT,
    "sft.lr": _NON_NEG,
    "sft.mini_batch_size": _POSITIVE_INT,
    "sft.skill_share": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "sft.decision_cue_copies": (lambda v: v >= 0, "an integer >= 0"),
    "eval.interval": (lambda v: v >= 0, "an integer >= 0"),
    "eval.num_tasks": (lambda v: v >= 0, "an integer >= 0"),
    "eval.temperature": _POSITIVE,
    "deploy.nodes": _POSITIVE_INT,
    "deploy.gpus_per_node": _POSITIVE_INT,
    "deploy.train_gpus_per_node": (lambda v: v >= 0, "an integer >= 0 (0: by deploy.mode)"),
    "deploy.rollout_servers_per_node": (lambda v: v >= 0, "an integer >= 0"),
    "deploy.rollout_tp": _POSITIVE_INT,
    "deploy.rollout_gpus": (lambda v: all(isinstance(g, list) and g and all(isinstance(i, int) and i >= 0 for i in g)
                                          for g in v), "a list of non-empty lists of GPU ids (integers >= 0)"),
    "deploy.rollout_mem_fraction": _PROB,
    "deploy.analyzer_gpus": (lambda v: all(isinstance(i, int) and i >= 0 for i in v), "a list of GPU ids (integers >= 0)"),
    "deploy.analyzer_mem_fraction": _PROB,
    "deploy.control_timeout_s": (lambda v: v is None or 0 < v <= MAX_SECONDS,
                                 f"null (derived from the deadlines) or a number of seconds in (0, {MAX_SECONDS:g}]"),
    "deploy.trainer_cpus": (lambda v: all(isinstance(i, int) and i >= 0 for i in v), "a list of CPU core ids"),
    "deploy.server_cpus": (lambda v: all(isinstance(i, int) and i >= 0 for i in v), "a list of CPU core ids"),
    "deploy.train_timeout_s": _SECONDS,
    "deploy.heartbeat_timeout_s": (lambda v: 1 <= v <= 3600, "a number of seconds in [1, 3600]"),
    "deploy.bind_host": (lambda v: bool(re.fullmatch(r"[A-Za-z0-9_.:%-]+", v)) and v not in ("0.0.0.0", "::"),
                         "auto, an address of the node (not a wildcard such as 0.0.0.0) or an interface name"),
    "sync.bucket_mb": _POSITIVE_INT,
    "sync.check_interval": (lambda v: v >= 0, "an integer >= 0 (0: never)"),
    "sync.check_tokens": _POSITIVE_INT,
    "sync.check_tol": _NON_NEG,
    "logging.wandb_tags": (lambda v: all(isinstance(t, str) and 0 < len(t) <= 64 for t in v),
                           "a list of strings of 1 to 64 characters"),
}


# --------------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string", dict: "a mapping",
            list: "a list"}.get(tp, getattr(tp, "__name__", str(tp)))


def _show(value: Any, limit: int = 80) -> str:
    """repr(value) for a one-line message: cut to `limit` characters; never raises (a 5000-digit int has no repr)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - e.g. ValueError: int too large to convert to str
        text = f"<{type(value).__name__} too large to print>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; returns the value (ints widen to float). Numbers are finite
    (inf / nan are refused) and integers lie in [-INT_LIMIT, INT_LIMIT]."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) is type(typing.get_args(tp)[0]):
            return value
        raise ConfigError(f"{key}: got {_show(value)}, allowed: {_type_name(tp)}")
    if origin is typing.Union:
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(arms) < len(typing.get_args(tp)):
            return None
        errors = []
        for arm in arms:
            try:
                return _coerce(key, value, arm)
            except ConfigError as e:
                errors.append(e)
        if len(arms) == 1 and len(arms) < len(typing.get_args(tp)):  # Optional[X]: X's own reason
            raise ConfigError(f"{errors[0]} or null") from None
        raise ConfigError(f"{key}: got {_show(value)}, expected {_type_name(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -INT_LIMIT <= value <= INT_LIMIT:
                raise ConfigError(f"{key}: got {_show(value)}, allowed: an integer in [{-INT_LIMIT}, {INT_LIMIT}]")
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int beyond the float range
                number = math.inf
            if not math.isfinite(number):
                raise ConfigError(f"{key}: got {_show(value)}, allowed: a finite number")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
    elif tp is list or origin is list:
        if isinstance(value, list):
            return list(value)
    else:  # pragma: no cover - every field above uses one of these
        raise TypeError(f"unsupported config type {tp!r} for {key}")
    raise ConfigError(f"{key}: got {_show(value)} ({type(value).__name__}), expected {_type_name(tp)}")


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown key; allowed keys in {prefix.rstrip('.') or 'the root'}: "
                              + ", ".join(sorted(names)))
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        key, tp = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name] if data[f.name] is not None else {}, key + ".")
        else:
            kwargs[f.name] = _coerce(key, data[f.name], tp)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """`algo.lambda_episode=0.001` -> ("algo.lambda_episode", 0.001); the value is read as YAML."""
    if "=" not in item:
        raise ConfigError(f"{item}: an override must look like key.sub=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"{item}: an override must look like key.sub=value")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except Exception:  # noqa: BLE001 - YAMLError, and ValueError for a 4300+ digit integer: the text as a string
        value = raw
    return key, value


def validate(cfg: Config, plugins: bool = True) -> Config:
    """Range and cross-key checks; `plugins` (default): also env.name / analyzer.backend imported and the options
    checked against the constructors (off only for readers that build no env or analyzer: opid-export)."""
    for dotted, (ok, allowed) in _CHECKS.items():
        section, name = dotted.split(".")
        value = getattr(getattr(cfg, section), name)
        if not ok(value):
            raise ConfigError(f"{dotted}: got {_show(value)}, allowed: {allowed}")
    if cfg.algo.mode == "skill_grpo" and cfg.scoring.scorer == "fork":
        pass  # skill_grpo scores only the rollout context; the scorer choice is irrelevant but allowed
    if "{action}" not in cfg.sft.think:
        raise ConfigError(f"sft.think: got {cfg.sft.think!r}, allowed: a string containing {{action}}")
    if cfg.sft.decision_cue_copies and not cfg.sft.blind_decision:
        raise ConfigError(f"sft.decision_cue_copies: got {cfg.sft.decision_cue_copies!r} with sft.blind_decision="
                          "false, allowed: 0 unless sft.blind_decision is true (the copies lean its decision samples)")
    if (cfg.train.lr_scheduler == "warmup") != (cfg.train.lr_warmup_ratio > 0):
        raise ConfigError(f"train.lr_warmup_ratio: got {cfg.train.lr_warmup_ratio!r} with train.lr_scheduler="
                          f"{cfg.train.lr_scheduler}, allowed: a number in (0, 1] with lr_scheduler=warmup, 0 with "
                          "lr_scheduler=constant")
    # docs/algorithm.md "Beyond the sampled token": both need a skill term (routing) and the divergence kernel's inputs
    no_skill_term = cfg.algo.mode in ("grpo", "skill_grpo")
    if cfg.algo.delta != "sampled" and no_skill_term:
        raise ConfigError(f"algo.delta: got {cfg.algo.delta!r} with algo.mode={cfg.algo.mode}, allowed: 'sampled' "
                          "(this mode has no skill term for the divergence to change)")
    if cfg.algo.delta != "sampled" and cfg.scoring.scorer != "fork":
        raise ConfigError(f"algo.delta: got {cfg.algo.delta!r} with scoring.scorer={cfg.scoring.scorer}, allowed: "
                          "'sampled' (the divergences come from the fork scorer, which has both contexts' hidden "
                          "rows in one forward: set scoring.scorer=fork)")
    if cfg.algo.distill_coef > 0 and no_skill_term:
        raise ConfigError(f"algo.distill_coef: got {cfg.algo.distill_coef!r} with algo.mode={cfg.algo.mode}, allowed: "
                          "0 (this mode routes no skill to distil from)")
    if cfg.train.micro_batch_size and cfg.algo.loss_agg != "token-mean-micro":
        raise ConfigError(f"train.micro_batch_size: got {cfg.train.micro_batch_size} with algo.loss_agg="
                          f"{cfg.algo.loss_agg}, allowed: 0 (it sets the micro-batches of algo.loss_agg="
                          "token-mean-micro only)")
    tr = cfg.train
    if tr.balance_ranks and (not tr.pad_multiple or tr.pad_multiple % tr.balance_ranks
                             or tr.mini_batch_size % tr.balance_ranks or tr.shuffle_minibatches):
        raise ConfigError(f"train.balance_ranks: got {tr.balance_ranks} with train.pad_multiple={tr.pad_multiple}, "
                          f"train.mini_batch_size={tr.mini_batch_size}, train.shuffle_minibatches="
                          f"{str(tr.shuffle_minibatches).lower()}; allowed: 0, or a divisor of both (equal-size "
                          "partitions of a padded batch) without the shuffle")
    if cfg.parallel.sequence_parallel and cfg.parallel.tp == 1:
        raise ConfigError("parallel.sequence_parallel: got true with parallel.tp=1, allowed: true only with "
                          "parallel.tp > 1")
    d = cfg.deploy
    if d.rollout_gpus and any(len(g) != d.rollout_tp for g in d.rollout_gpus):
        raise ConfigError(f"deploy.rollout_gpus: got {d.rollout_gpus!r}, allowed: groups of deploy.rollout_tp="
                          f"{d.rollout_tp} GPU ids each")
    if d.rollout_gpus and len(d.rollout_gpus) != d.rollout_servers_per_node:
        raise ConfigError(f"deploy.rollout_gpus: got {len(d.rollout_gpus)} groups, allowed: one per rollout server "
                          f"(deploy.rollout_servers_per_node={d.rollout_servers_per_node})")
    if cfg.parallel.vpp > 1 and cfg.parallel.pp == 1:
        raise ConfigError("parallel.vpp: got %d, allowed: 1 unless parallel.pp > 1" % cfg.parallel.vpp)
    if cfg.analyzer.json_mode is not None and cfg.analyzer.response_format != "none":
        raise ConfigError(f"analyzer.json_mode: got {cfg.analyzer.json_mode!r} with analyzer.response_format="
                          f"{cfg.analyzer.response_format}, allowed: null (json_mode is the deprecated alias of "
                          "response_format: set only response_format)")
    if plugins:
        _check_plugins(cfg)
    return cfg


def _check_plugins(cfg: Config) -> None:
    """env.name / env.options and analyzer.backend / analyzer.options: import paths imported and checked, options
    checked against the constructors; algo.advantage_fn / algo.loss_fn imported and their signatures checked
    (opid_mega.plugins), before anything is built. The built-in functions (the defaults) are not imported here: they
    are part of the package, and importing them would import torch (~1 s) into every config load."""
    from opid_mega.envs import check_env_config
    from opid_mega.plugins import PluginError, advantage_function, is_import_path, loss_function

    a = cfg.analyzer
    try:
        if cfg.algo.advantage_fn != AlgoConfig.advantage_fn:
            advantage_function(cfg.algo.advantage_fn)
        if cfg.algo.loss_fn != AlgoConfig.loss_fn:
            loss_function(cfg.algo.loss_fn)
        check_env_config(cfg.env)
        if is_import_path(a.backend):
            from opid_mega.skills.plugins import check_analyzer  # only for a plug-in: opid_mega.skills imports torch

            check_analyzer(a.backend, a.options)
        elif a.backend not in ("rules", "llm"):
            raise ConfigError(f"analyzer.backend: got {a.backend!r}, allowed: 'rules', 'llm' or an import path "
                              "'package.module:Class' (a subclass of opid_mega.skills.Analyzer)")
        elif a.options:
            raise ConfigError(f"analyzer.options: got {_show(a.options)} with analyzer.backend={a.backend}, allowed: "
                              "{} (the options of a plug-in analyzer's constructor)")
    except PluginError as e:
        raise ConfigError(str(e)) from None


def config_from_dict(data: dict | None, plugins: bool = True) -> Config:
    return validate(_build(Config, data or {}, ""), plugins=plugins)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# Options belong to one class: a layer (a file over its `base:`, or the overrides over the file) that changes the
# class key starts from no options instead of the earlier layer's (a plug-in env never gets TextWorld's options).
_CLASS_OPTIONS = (("env", "name", "options"), ("analyzer", "backend", "options"))
_CLASS_DEFAULTS = {"env": "textworld", "analyzer": "rules"}  # EnvConfig.name, AnalyzerConfig.backend


def _drop_foreign_options(base: dict, names: dict) -> dict:
    """`base` without the options of each section whose class key `names` ({section: new class key}) changes."""
    out = dict(base)
    for section, key, options in _CLASS_OPTIONS:
        old = out.get(section)
        if section in names and isinstance(old, dict) and options in old and names[section] != old.get(key, _CLASS_DEFAULTS[section]):
            out[section] = {k: v for k, v in old.items() if k != options}
    return out


def _read_yaml(path: str, seen: tuple = ()) -> dict:
    """A config file as a dict. A top-level `base: other.yaml` (relative to this file) is read first and this file's
    sections are merged over it, key by key (lists and scalars replace)."""
    import os

    if os.path.abspath(path) in seen:
        raise ConfigError(f"{path}: `base:` includes itself ({' -> '.join(seen + (path,))})")
    try:
        with open(path) as f:
            data = yaml_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except (ValueError, RecursionError) as e:  # e.g. an integer of 4300+ digits, nesting deeper than Python's stack
        raise ConfigError(f"{path}: not a readable config ({_show(str(e), 120)})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config file ({type(e).__name__}: {_show(str(e), 120)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base: got {base!r}, allowed: the path of another config file")
    parent = os.path.join(os.path.dirname(os.path.abspath(path)), base)
    names = {sec: data[sec][key] for sec, key, _ in _CLASS_OPTIONS
             if isinstance(data.get(sec), dict) and key in data[sec]}
    return _merge(_drop_foreign_options(_read_yaml(parent, seen + (os.path.abspath(path),)), names), data)


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML file (or the defaults when `path` is None), apply `key.sub=value` overrides, validate."""
    data: dict = _read_yaml(path) if path else {}
    parsed = [parse_override(item) for item in overrides]
    names = {k.split(".")[0]: v for k, v in parsed if k in ("env.name", "analyzer.backend")}
    data = _drop_foreign_options(data, names)  # env.name=other:Env: the file's env.options are not its options
    for key, value in parsed:
        _set_dotted(data, key, value)
    return config_from_dict(data)


# Keys whose values are secrets: never written by dump_config (config.yaml, `python -m opid_mega.config`, experiment
# records) and shown as *** in logged command lines (opid_mega.infra.redact).
SECRET_KEYS = ("analyzer.api_key",)


def analyzer_response_format(analyzer: AnalyzerConfig) -> str:
    """analyzer.response_format, or what the deprecated analyzer.json_mode stands for when it is set (true:
    json_object, false: none)."""
    if analyzer.json_mode is None:
        return analyzer.response_format
    return "json_object" if analyzer.json_mode else "none"


def resolve_api_key(analyzer: AnalyzerConfig, environ: Optional[dict] = None) -> str:
    """The analyzer endpoint's API key, resolved at run time: a non-empty `analyzer.api_key` as given (an explicit
    key beats the environment; "EMPTY" is what local SGLang/vLLM servers accept); else the environment variable named
    by `analyzer.api_key_env` when it is set and non-empty; else "EMPTY"."""
    if analyzer.api_key:
        return analyzer.api_key
    env = os.environ if environ is None else environ
    value = env.get(analyzer.api_key_env, "") if analyzer.api_key_env else ""
    return value.strip() or "EMPTY"


CONTROL_MARGIN_S = 600.0  # on top of the deadlines: an SGLang server's start (600 s) and the waits' own slack


BEAT_MAX_S = 5.0  # the longest interval between two heartbeats of a rank (opid_mega.megatron.heartbeat)
NODE_LOST_SHUTDOWN_S = 10.0  # what the ending takes once a lost node is named: servers and children stopped, exit


def beat_interval(heartbeat_timeout_s: float) -> float:
    """Seconds between two heartbeats: six or more within the timeout, at most BEAT_MAX_S."""
    return min(BEAT_MAX_S, float(heartbeat_timeout_s) / 6.0)


def node_lost_bound(cfg: Config) -> float:
    """How long a job runs on after one of its nodes is lost (down, cut off or stopped), wherever its ranks are: the
    heartbeat timeout (deploy.heartbeat_timeout_s), one beat and the shutdown (opid_mega.megatron.heartbeat)."""
    timeout = float(cfg.deploy.heartbeat_timeout_s)
    return timeout + beat_interval(timeout) + NODE_LOST_SHUTDOWN_S


def control_timeout(cfg: Config) -> float:
    """The control group's timeout (deploy.control_timeout_s; null: derived) — the longest a rank waits for global
    rank 0, so the bound on a node lost during a rollout or an analysis. Derived: the longest stretch rank 0 works
    alone is a rollout (rollout.deadline_s), two when the evaluation replays its tasks with skills, then an analysis
    (analyzer.deadline_s, when anything is analysed), plus CONTROL_MARGIN_S."""
    if cfg.deploy.control_timeout_s is not None:
        return float(cfg.deploy.control_timeout_s)
    replay = cfg.eval.with_skills or cfg.algo.mode == "skill_grpo"
    analysed = cfg.algo.needs_analysis or replay
    return ((2 if replay else 1) * cfg.rollout.deadline_s + (cfg.analyzer.deadline_s if analysed else 0.0)
            + CONTROL_MARGIN_S)


def redacted(cfg: Config) -> dict:
    """cfg.to_dict() with every SECRET_KEYS value emptied (loading it back reads the key from the environment)."""
    data = cfg.to_dict()
    for dotted in SECRET_KEYS:
        section, name = dotted.split(".")
        data[section][name] = ""
    return data


def dump_config(cfg: Config, redact: bool = True) -> str:
    """The resolved config as YAML. `redact` (the default: every dump is shown or written somewhere) writes the
    SECRET_KEYS (analyzer.api_key) as "", so a file written from it never holds a key."""
    return yaml.safe_dump(redacted(cfg) if redact else cfg.to_dict(), sort_keys=False, default_flow_style=False)


class _DisplayDumper(yaml.SafeDumper):
    """`python -m opid_mega.config`'s output: finite floats as Python writes them (1e-06, 0.1, 3e+30), which YAML 1.2
    and this module's loader read back as the same floats. config.yaml keeps PyYAML's form (1.0e-06), which plain
    YAML 1.1 readers (yaml.safe_load) also read as a float."""


def _display_float(dumper, value: float):
    if math.isfinite(value):
        return dumper.represent_scalar("tag:yaml.org,2002:float", repr(value))
    return dumper.represent_float(value)


_DisplayDumper.add_representer(float, _display_float)
_DisplayDumper.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m opid_mega.config FILE [key.sub=value ...]", file=sys.stderr)
        return 2
    try:
        cfg = load_config(argv[0], argv[1:])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.dump(redacted(cfg), Dumper=_DisplayDumper, sort_keys=False, default_flow_style=False))
    return 0

