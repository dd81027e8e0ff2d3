"""Plug-ins by import path: `env.name: "package.module:Class"` and `analyzer.backend: "package.module:Class"`.

    cls = load_class("mypkg.envs:GuessEnv", "env.name", Env, "opid_mega.envs.Env")
    check_options(cls, {"size": 8}, "env.options", reserved={"max_steps": "env.max_steps"})

An import path is `module:attribute` (the attribute may be dotted: `mod:Outer.Inner`); the module is imported with
`importlib.import_module`, so it must be on `sys.path` (PYTHONPATH, an installed package, the working directory of
`python -m`). Every problem is a `PluginError` (a ValueError) whose ONE-line message starts with the config key:

    env.name: cannot import 'mypkg.envs:Foo': No module named 'mypkg'
    env.name: cannot import 'mymod:Foo': module 'mymod' has no attribute 'Foo'
    env.name: 'mymod:Foo' is not a subclass of opid_mega.envs.Env
    env.options.sizee: not an option of mymod:GuessEnv; accepted: seed, size, success_reward

opid_mega.config checks both keys when a config is loaded (so opid-train exits 2 with that line before anything is
built); opid_mega.envs.make_env and opid_mega.rollout.launch.build_analyzer build the classes (docs/custom_env.md).
The analyzer-specific part is opid_mega.skills.plugins; this module imports nothing else of opid_mega.

Functions by import path, the same way: `algo.advantage_fn` and `algo.loss_fn` (`advantage_function`,
`loss_function`: importable, callable, and their signatures accept the documented call; docs/custom_algo.md).
"""
from __future__ import annotations

import importlib
import inspect
from typing import Callable, Optional


class PluginError(ValueError):
    """A plug-in import path or its options are unusable; the message is one line naming the config key."""


def is_import_path(name) -> bool:
    """True for a `module:Class` import path (the built-in names have no colon)."""
    return isinstance(name, str) and ":" in name


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _import(spec: str, key: str, expected: str):
    """The object `spec` ("package.module:attr") names; `expected` is how the message shows a valid path
    ('package.module:Class'). Raises PluginError (one line starting with `key`)."""
    module_name, _, attr = spec.partition(":")
    parts = attr.split(".") if attr else []
    if not module_name or not parts or not all(p.isidentifier() for p in parts) or not all(
            p.isidentifier() for p in module_name.split(".")):
        raise PluginError(f"{key}: {spec!r} is not an import path; expected {expected!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise PluginError(f"{key}: cannot import {spec!r}: {_one_line(e)}") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any error while the module runs (SyntaxError, its raise)
        raise PluginError(f"{key}: cannot import {spec!r}: {type(e).__name__}: {_one_line(e)}") from None
    where = module_name
    for p in parts:
        if not hasattr(obj, p):
            raise PluginError(f"{key}: cannot import {spec!r}: module {where!r} has no attribute {p!r}")
        obj, where = getattr(obj, p), f"{where}.{p}"
    return obj


def load_class(spec: str, key: str, base: type, base_name: str) -> type:
    """The class `spec` ("package.module:Class") names, checked to be a subclass of `base` (`base_name` is how the
    messages name it). Raises PluginError (one line starting with `key`)."""
    obj = _import(spec, key, "package.module:Class")
    if not inspect.isclass(obj):
        raise PluginError(f"{key}: {spec!r} is a {type(obj).__name__}, not a class (expected a subclass of "
                          f"{base_name})")
    if not issubclass(obj, base):
        raise PluginError(f"{key}: {spec!r} is not a subclass of {base_name}")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise PluginError(f"{key}: {spec!r} is abstract (implement {missing})")
    return obj


def source_fingerprint(spec: str) -> str:
    """A short hash of the source file of the module `spec` names (a cache key that follows edits of a plug-in:
    the opid-sft warm start of a plug-in env is rebuilt when its module changes)."""
    import hashlib
    import sys

    module = sys.modules.get(spec.partition(":")[0]) or importlib.import_module(spec.partition(":")[0])
    try:
        path = inspect.getsourcefile(module) or ""
    except TypeError:  # a namespace package or a built-in module: no file
        path = ""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        data = spec.encode()
    return hashlib.sha256(data).hexdigest()[:16]


def constructor_options(cls: type) -> Optional[tuple[set, set]]:
    """(keyword parameters of cls's constructor, the required ones among them), or None when it takes **kwargs
    (anything goes). Positional-only and *args parameters cannot be given by name and are left out."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):  # a C-implemented constructor without a signature: no check possible
        return None
    names, required = set(), set()
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            return None
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            names.add(p.name)
            if p.default is p.empty:
                required.add(p.name)
    return names, required


def check_options(cls: type, options: dict, key: str, reserved: Optional[dict] = None, extra: tuple = (),
                  provided: tuple = (), label: str = "") -> None:
    """Check `options` (keyword arguments for cls's constructor, the config's `key` mapping) before anything is
    built: every name must be a constructor parameter (or in `extra`: options the builder itself takes), none may be
    in `reserved` ({name: the config key that sets it}), and the constructor's required parameters must be given
    (by the options, or by the builder: `reserved` and `provided`). A constructor with **kwargs accepts any name."""
    label = label or f"{cls.__module__}:{cls.__qualname__}"
    if not isinstance(options, dict):
        raise PluginError(f"{key}: got {_one_line(repr(options), 80)}, allowed: a mapping of constructor options")
    reserved = dict(reserved or {})
    for name in options:
        if not isinstance(name, str):
            raise PluginError(f"{key}: option names are strings, got {name!r}")
        if name in reserved:
            raise PluginError(f"{key}.{name}: set by {reserved[name]}, not in {key}")
    spec = constructor_options(cls)
    if spec is None:
        return
    names, required = spec
    accepted = (names | set(extra)) - set(reserved)
    for name in options:
        if name not in accepted:
            raise PluginError(f"{key}.{name}: not an option of {label}; accepted: "
                              + (", ".join(sorted(accepted)) or "none"))
    missing = sorted(required - set(options) - set(reserved) - set(provided))
    if missing:
        raise PluginError(f"{key}: {label} needs option{'s' if len(missing) > 1 else ''} {', '.join(missing)}")


# ---- algorithm functions: algo.advantage_fn, algo.loss_fn ----------------------------------------------------------
# How each is called (docs/custom_algo.md): positional argument names, then keyword argument names.
ADVANTAGE_FN_CALL = (("exp", "algo_cfg"), ())
LOSS_FN_CALL = (("logp", "old_logp", "advantages", "mask"),
                ("clip_low", "clip_high", "dual_clip", "log_ratio_clamp", "normalizer"))


def load_function(spec: str, key: str, call: tuple) -> Callable:
    """The function `spec` ("package.module:function") names, checked to be callable (not a class) with a signature
    that accepts `call` ((positional names, keyword names): the arguments it will get). Raises PluginError (one line
    starting with `key`)."""
    fn = _import(spec, key, "package.module:function")
    if inspect.isclass(fn) or not callable(fn):
        what = "class" if inspect.isclass(fn) else type(fn).__name__
        raise PluginError(f"{key}: {spec!r} is a {what}, not a function")
    positional, keywords = call
    shown = "fn(" + ", ".join(list(positional) + [f"{k}=" for k in keywords]) + ")"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a C-implemented callable without a signature: no check possible
        return fn
    try:
        sig.bind(*positional, **{k: None for k in keywords})
    except TypeError as e:
        raise PluginError(f"{key}: {spec!r} cannot be called as {shown}: {_one_line(e)}") from None
    return fn


def advantage_function(spec: str) -> Callable:
    """The function `algo.advantage_fn` names: fn(exp, algo_cfg) fills exp.a_out and exp.token_advantages."""
    return load_function(spec, "algo.advantage_fn", ADVANTAGE_FN_CALL)


def loss_function(spec: str) -> Callable:
    """The function `algo.loss_fn` names, called like opid_mega.algo.ppo_policy_loss (LOSS_FN_CALL)."""
    return load_function(spec, "algo.loss_fn", LOSS_FN_CALL)
