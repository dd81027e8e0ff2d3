"""Start-up checks of an opid-train run: what it needs from this machine, checked before any model is built.

    problems = model_problems(cfg)      # every rank: model.path / model.init_from hold an HF model and its tokenizer
    problems += env_problems(cfg)       # global rank 0: the env's data (ALFWorld games, WebShop server, Search corpus)

Each problem is ONE line naming the config key, what is missing and the fix; opid-train prints each on stderr and
exits 2 (docs/runs.md "Start-up checks"). Nothing here imports torch or builds anything: the checks take seconds at
most (a WebShop server gets one GET / with a short timeout).

    warning = collapse_warning(cfg)     # global rank 0: one line when the config sits in the collapse regime
"""
from __future__ import annotations

import os
import socket
from typing import Optional

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
WEBSHOP_PING_S = 10.0  # the start-up ping of a WebShop server (its own env.options.timeout if shorter)


def model_dir_problem(path: str, key: str) -> Optional[str]:
    """One line when the directory `path` (config key `key`) is not a Hugging Face model directory with a tokenizer
    on this node; None when it is."""
    d = os.path.abspath(os.path.expanduser(path))
    where = f"{path} ({d})" if d != path else path
    host = socket.gethostname()
    if not os.path.isdir(d):
        return (f"{key}={where}: no such directory on this node ({host}); put the Hugging Face model there "
                f"(e.g. `huggingface-cli download <org>/<model> --local-dir {path}`) or set {key}")
    if not os.path.isfile(os.path.join(d, "config.json")):
        return f"{key}={where}: no config.json there (not a Hugging Face model directory)"
    if not any(os.path.isfile(os.path.join(d, f)) for f in TOKENIZER_FILES):
        return (f"{key}={where}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)}); copy the model's "
                "tokenizer files into it")
    return None


def model_problems(cfg) -> list[str]:
    """The model directories the run starts from: model.init_from when it names a directory (not `sft`), and
    model.path when given (the opid-sft warm start is built from it). A built-in model (empty model.path) is built
    on first use and not checked."""
    m, out = cfg.model, []
    if m.init_from.startswith("shipped:"):
        from opid_mega.warm_starts import shipped_model

        try:
            out.append(model_dir_problem(shipped_model(m.init_from[len("shipped:"):]), "model.init_from"))
        except FileNotFoundError as e:
            out.append(f"model.init_from={e}")
    elif m.init_from and m.init_from != "sft":
        out.append(model_dir_problem(m.init_from, "model.init_from"))
    elif m.path:
        out.append(model_dir_problem(m.path, "model.path"))
    return [p for p in out if p]


def env_splits(cfg) -> list[str]:
    """The env splits a run reads: the training split, and the evaluation split when it evaluates."""
    splits = [cfg.env.train_split]
    if cfg.eval.num_tasks and cfg.env.eval_split not in splits:
        splits.append(cfg.env.eval_split)
    return splits


def env_problems(cfg) -> list[str]:
    """The env's data for the run's splits (its `data_problem(splits)`: ALFWorld games, a WebShop server that
    answers, the Search-QA corpus and questions; a plug-in env may define one too). The env is built in this
    process (no worker), as the trainer's first env would be; a constructor that raises is reported as one line."""
    from opid_mega.envs import make_env

    opts = {**dict(cfg.env.options), "process": False}
    try:
        env = make_env(cfg.env.name, max_steps=cfg.env.max_steps, step_timeout_s=cfg.env.step_timeout_s, **opts)
    except Exception as e:  # noqa: BLE001 - a bad option or a missing package: one line
        return [f"env {cfg.env.name}: cannot build it with env.options {dict(cfg.env.options)}: "
                f"{type(e).__name__}: {' '.join(str(e).split())}"]
    try:
        check = getattr(env, "data_problem", None)
        msg = check(env_splits(cfg)) if check is not None else None
    except Exception as e:  # noqa: BLE001
        msg = f"env {cfg.env.name}: its data check failed: {type(e).__name__}: {' '.join(str(e).split())}"
    finally:
        try:
            env.close()
        except Exception:  # noqa: BLE001
            pass
    return [" ".join(msg.split())] if msg else []


def collapse_warning(cfg) -> Optional[str]:
    """One line when the config lets an optimizer step train on the skill term alone: an OPID mode with λ > 0 and
    algo.skill_share_cap null (the reference's behaviour). A group whose scores all tie has A_out = 0, so its
    step-samples' advantages are λΔ alone; Adam takes a full-size step on them whatever λ is, and on CPU such steps
    drove runs from rising held-out success to 0 (docs/algorithm.md "Stability"). None otherwise."""
    a = cfg.algo
    lam = max(a.lambda_episode if a.use_episode else 0.0, a.lambda_step if a.use_step else 0.0)
    if a.mode in ("grpo", "skill_grpo") or lam <= 0 or a.skill_share_cap is not None:
        return None
    return (f"warning: algo.skill_share_cap=null with λ={lam:g}: a group whose scores all tie trains on λΔ alone, "
            "which collapsed OPID runs (docs/algorithm.md \"Stability\"); algo.skill_share_cap=1.0 bounds the skill "
            "term by the outcome term in every group")
