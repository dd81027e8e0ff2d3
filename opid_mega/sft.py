"""`opid-sft`: supervised warm start on expert walkthroughs, through the same Megatron path as the PPO update.

For every task of the config's training pool, the env's walkthrough (planner/expert actions) is played; each step
becomes a step-sample with the same prompt the rollout builds (same template, history window, chat format) and the
target response `<think>...</think>\n<action>A</action><|im_end|>`. The prompts are tokenized by the rollout's
PromptTokenizer with the same `model.enable_thinking` chat-template switch. Settings: the config's `sft` section
(epochs, lr, mini_batch_size, think, skill_share), overridable by opid-sft's flags. With `sft.skill_share > 0` that
share of the step-samples appears a second time with a skill section the rule analyzer wrote from the expert
trajectory itself (routed critical-first, faithful or late placement), so the model learns that sections are
informative. The loss is the token-mean NLL of the response
tokens (a plain megatron loss_func in the same forward_step / schedule as PPO). The result is an HF directory usable
as `model.init_from`; it is cached under `<model.cache_dir>/sft-<hash of its inputs>`, so a config with
`model.init_from: sft` builds it once.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from opid_mega.config import Config
from opid_mega.infra.progress import progress

SFT_VERSION = 2
_MARKER = ".opid_sft_complete"


def end_of_turn_id(tokenizer) -> int:
    """The token that closes an assistant turn (<|im_end|> for ChatML templates, else eos)."""
    im_end = tokenizer.get_vocab().get("<|im_end|>")
    return int(im_end if im_end is not None else tokenizer.eos_token_id)


def expert_episodes(cfg: Config, think: Optional[str] = None, split: Optional[str] = None) -> list[dict]:
    """Play the expert walkthrough of every task in the split's pool. One dict per task: `task` (its id),
    `prompts` (the rollout's prompt text of each step: same template and history window), `actions`, `responses`
    (the target response text of each step), `decisions` (per step the env's decision_options() before it, [] for an
    env without them) and `view` (the analyzer's TrajectoryView of the expert episode)."""
    from opid_mega.envs import format_response
    from opid_mega.skills.types import StepView, TrajectoryView
    from opid_mega.envs import env_factory

    think = cfg.sft.think if think is None else think
    env = env_factory(cfg.env)()
    pool = env.task_pool(split or cfg.env.train_split) if hasattr(env, "task_pool") else \
        env.tasks(split or cfg.env.train_split, cfg.rollout.tasks_per_iter, seed=cfg.train.seed)
    out = []
    for task in pool:
        obs = env.reset(task)
        raw = getattr(env, "raw_obs", "") or obs
        actions = env.walkthrough()
        if not actions:
            raise RuntimeError(f"opid-sft: env {cfg.env.name} has no walkthrough for task {task.id}")
        hist, ep = [], {"task": str(task.id), "prompts": [], "actions": [], "responses": [], "decisions": []}
        steps, won = [], False
        for action in actions:
            prompt = env.build_prompt(hist, obs, cfg.env.history_length)
            response = format_response(action, think.format(action=action))
            ep["prompts"].append(prompt)
            ep["actions"].append(action)
            ep["responses"].append(response)
            ep["decisions"].append(list(env.decision_options()) if hasattr(env, "decision_options") else [])
            new_obs, reward, done, info = env.step(action)
            steps.append(StepView(raw, response, float(reward), action, True))
            won = bool(info.get("won", won))
            hist.append((obs, action))
            obs, raw = new_obs, info.get("raw_obs", new_obs)
            if done:
                break
        ep["view"] = TrajectoryView(task=env.task_description, won=won, steps=steps, traj_id=f"expert/{task.id}")
        out.append(ep)
    env.close()
    return out


def section_analyzer(cfg: Config):
    """The analyzer that writes the warm start's sections: a plug-in analyzer.backend ("package.module:Class", e.g.
    the footprints hindsight analyzer) when the config names one, else the RuleAnalyzer (K = analyzer.max_step_skills;
    an LLM analyzer is never called for the warm start)."""
    from opid_mega.plugins import is_import_path
    from opid_mega.skills.plugins import build_analyzer
    from opid_mega.skills import RuleAnalyzer

    if is_import_path(cfg.analyzer.backend):
        return build_analyzer(cfg.analyzer)
    return RuleAnalyzer(max_step_skills=cfg.analyzer.max_step_skills)


def expert_skill_routes(cfg: Config, episode: dict, analyzer=None) -> list[dict]:
    """One {kind: skill} per step of an expert episode: the section analyzer's analysis of that episode
    (`section_analyzer`), routed critical-first (algo.route_skills: the step skill at a critical step, else the
    episode skill)."""
    from opid_mega import algo

    n = len(episode["prompts"])
    analysis = (analyzer or section_analyzer(cfg)).analyze([episode["view"]])[0]
    if analysis is None:
        return [{} for _ in range(n)]
    return algo.route_skills(n, analysis.step_skills, analysis.episode_skill)


def walkthrough_samples(cfg: Config, tokenizer, think: Optional[str] = None, split: Optional[str] = None,
                        skill_share: Optional[float] = None) -> list:
    """[(prompt_ids, response_ids)] from playing the expert walkthrough of every task in the split's pool.

    `skill_share` (default sft.skill_share): the share of step-samples that also appear a second time, right after
    themselves, with a prompt that carries the skill section `expert_skill_routes` gives that step, inserted with the
    faithful or the late placement (a seeded coin flip per sample, so the warm start reads sections in both places).
    The target response is the expert's in both copies: every no-skill sample stays, and a pair differs only by the
    section, whose information the model can then learn to use.

    sft.blind_decision: a step whose `decisions` list options (the env's one critical decision) gives, instead of
    the expert's samples, one sample per option X without a section (target X: the warm start's choice there is
    uniform, blind to any cue) and one per option X with a section naming X (the section analyzer's
    decision_sections(X, options, rng), one of its formats at random, placement at random; target X).
    sft.decision_cue_copies k: then also k more no-section samples with the expert's choice as target (the option
    the task's cue names), so without a section the cue's option is the target (1 + k) / (n + k) of the time."""
    import random

    from opid_mega.envs import format_response
    from opid_mega.rollout.agent_loop import PromptTokenizer
    from opid_mega.skills.injection import PLACEMENTS, inject_skills

    prompts = PromptTokenizer(tokenizer, enable_thinking=cfg.model.enable_thinking)
    share = cfg.sft.skill_share if skill_share is None else float(skill_share)
    if not 0 <= share <= 1:
        raise ValueError(f"opid-sft: skill_share={share!r}, allowed: a number in [0, 1]")
    rng = random.Random(cfg.train.seed * 1_000_003 + 17)
    end = end_of_turn_id(tokenizer)
    out = []
    think = cfg.sft.think if think is None else think
    analyzer = section_analyzer(cfg) if share > 0 or cfg.sft.blind_decision else None
    if cfg.sft.blind_decision and not hasattr(analyzer, "decision_sections"):
        raise ValueError(f"opid-sft: sft.blind_decision needs an analyzer with decision_sections(choice, options, "
                         f"rng); analyzer.backend {cfg.analyzer.backend!r} has none")
    for ep in expert_episodes(cfg, think, split):
        routes = expert_skill_routes(cfg, ep, analyzer) if share > 0 else [{} for _ in ep["prompts"]]
        for prompt, response, route, options in zip(ep["prompts"], ep["responses"], routes, ep["decisions"]):
            if cfg.sft.blind_decision and options:
                for choice in options:
                    resp = prompts.encode_text(format_response(choice, think.format(action=choice))) + [end]
                    out.append((prompts.encode(prompt)[0], resp))
                    section = rng.choice(analyzer.decision_sections(choice, options, rng))
                    out.append((prompts.encode(inject_skills(prompt, section, rng.choice(sorted(PLACEMENTS))))[0],
                                resp))
                expert = prompts.encode_text(response) + [end]
                out.extend((prompts.encode(prompt)[0], expert) for _ in range(cfg.sft.decision_cue_copies))
                continue
            resp = prompts.encode_text(response) + [end]
            out.append((prompts.encode(prompt)[0], resp))
            if share > 0 and route and rng.random() < share:
                out.append((prompts.encode(inject_skills(prompt, route, rng.choice(sorted(PLACEMENTS))))[0], resp))
    return out


def nll_loss_func(batch, output):
    """megatron loss_func: summed NLL over the scored tokens (token-mean through calculate_per_token_loss)."""
    mask = batch.extras["loss_mask"]
    nll = -(output[0] * mask).sum()
    ntok = mask.sum()
    return nll, ntok.to(torch.int), {"nll": torch.stack([nll.detach().clone(), ntok])}


def sft_step(policy, samples: list) -> float:
    from opid_mega.megatron.logprobs import forward_step, plain_batches, run_schedule

    for c in policy.ddp:
        c.train()
        c.zero_grad_buffer()
    policy.optimizer.zero_grad()
    outs = run_schedule(policy.ddp, plain_batches(samples, policy.cfg.train.micro_batch_tokens).batches,
                        partial(forward_step, loss_func=nll_loss_func), forward_only=False)
    policy.optimizer.step()
    tot = sum(d["nll"] for d in outs)
    return float(tot[0] / tot[1].clamp(min=1)) if outs else float("nan")


# The prompt-template fingerprint (opid_mega.envs.prompts.template_fingerprint) of each env's templates before
# env.template existed (= env.template=ours). A warm start whose prompts render like these keeps its old key; any
# other prompt text (env.template=reference for TextWorld/ALFWorld/WebShop, any later edit of a template) puts its
# fingerprint into the key, so a warm start tokenized from other prompts is never reused.
PROMPTS_BEFORE_TEMPLATES = {"textworld": "6ed74abfcfc6c00a", "alfworld": "292770e01a244ebb",
                            "webshop": "23f38c262820cef8", "search_qa": "c85e0a341ee20b5e"}


def sft_key(cfg: Config, base_dir: str, opts: dict) -> str:
    """The warm start's cache key. sft.skill_share enters it only when non-zero (with the analyzer's K, which decides
    the sections), so warm starts built before that option keep their keys; likewise the prompt templates enter it
    only when their text differs from the one before env.template existed (PROMPTS_BEFORE_TEMPLATES)."""
    from opid_mega.envs.prompts import template_fingerprint

    from opid_mega.plugins import is_import_path, source_fingerprint

    opts = dict(opts)
    if opts.get("skill_share"):
        opts["skill_max_step_skills"] = cfg.analyzer.max_step_skills
    else:
        opts.pop("skill_share", None)
    if not opts.get("blind_decision"):
        opts.pop("blind_decision", None)
    if not opts.get("decision_cue_copies"):
        opts.pop("decision_cue_copies", None)
    if (opts.get("skill_share") or opts.get("blind_decision")) and is_import_path(cfg.analyzer.backend):
        # a plug-in analyzer writes the sections: its name, options and source
        opts["section_analyzer"] = [cfg.analyzer.backend, cfg.analyzer.options,
                                    source_fingerprint(cfg.analyzer.backend)]

    # a plug-in env (env.name "package.module:Class") renders its own prompts: the hash of its module's source
    prompts = source_fingerprint(cfg.env.name) if is_import_path(cfg.env.name) \
        else template_fingerprint(cfg.env.template, cfg.env.name)
    if prompts != PROMPTS_BEFORE_TEMPLATES.get(cfg.env.name):
        opts["prompt_templates"] = f"{cfg.env.template}:{prompts}"
    cfg_file = Path(base_dir) / "config.json"
    spec = dict(version=SFT_VERSION, base=str(Path(base_dir).resolve()),
                base_config=cfg_file.read_text() if cfg_file.exists() else "", env=cfg.env.name,
                options=cfg.env.options, history=cfg.env.history_length, max_steps=cfg.env.max_steps,
                split=cfg.env.train_split, dtype=cfg.model.dtype, seed=cfg.train.seed,
                enable_thinking=cfg.model.enable_thinking,
                micro=cfg.train.micro_batch_tokens, **opts)
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def is_cached(cfg: Config, **overrides) -> bool:
    """True when the warm start of this config is already built (run_sft would return at once)."""
    from opid_mega.models import resolve_model_path

    opts = {**dataclasses.asdict(cfg.sft), **{k: v for k, v in overrides.items() if v is not None}}
    base = resolve_model_path(cfg.model.path, cfg.model.builtin, cfg.model.cache_dir)
    out = Path(os.path.expanduser(cfg.model.cache_dir)) / f"sft-{sft_key(cfg, base, opts)}"
    return (out / _MARKER).exists()


def run_sft(cfg: Config, out_dir: Optional[str] = None, log=print, **overrides) -> str:
    """Train the warm start and save it as an HF directory (cached: returns at once when it exists)."""
    from opid_mega.models import load_tokenizer, resolve_model_path
    from opid_mega.megatron.logprobs import Sample
    from opid_mega.megatron.policy import Policy

    opts = {**dataclasses.asdict(cfg.sft), **{k: v for k, v in overrides.items() if v is not None}}
    base = resolve_model_path(cfg.model.path, cfg.model.builtin, cfg.model.cache_dir)
    key = sft_key(cfg, base, opts)
    out = Path(out_dir or Path(os.path.expanduser(cfg.model.cache_dir)) / f"sft-{key}")
    if (out / _MARKER).exists():
        log(f"opid-sft: cached warm start {out}")
        return str(out)
    scfg = copy.deepcopy(cfg)
    scfg.train.lr, scfg.train.weight_decay, scfg.train.grad_clip = float(opts["lr"]), 0.0, 1.0
    scfg.algo.kl_coef, scfg.algo.entropy_coef = 0.0, 0.0
    data = walkthrough_samples(cfg, load_tokenizer(base), opts["think"], skill_share=opts.get("skill_share", 0.0))
    samples = [Sample(p + r, len(p)) for p, r in data]
    log(f"opid-sft: {len(samples)} expert step-samples, {sum(len(s.tokens) for s in samples)} tokens, "
        f"{opts['epochs']} epochs, lr {opts['lr']}, skill share {opts.get('skill_share', 0.0)}")
    policy = Policy(scfg, base, prog="opid-sft")
    g = torch.Generator().manual_seed(cfg.train.seed)
    t0 = time.time()
    epochs = int(opts["epochs"])
    # one progress update per epoch (a bar with ETA on a terminal, one line per epoch in a log file), rank 0 only
    bar = progress(total=epochs, desc="opid-sft epoch", unit="ep") if torch.distributed.get_rank() == 0 else None
    for ep in range(epochs):
        order = torch.randperm(len(samples), generator=g).tolist()
        mb = int(opts["mini_batch_size"])
        losses = [sft_step(policy, [samples[i] for i in order[s:s + mb]]) for s in range(0, len(order), mb)]
        if bar is not None:
            bar.update(1, nll=f"{sum(losses) / len(losses):.4f}")
    if bar is not None:
        bar.close()
        log(f"opid-sft: {epochs} epochs in {time.time() - t0:.0f} s, final nll {sum(losses) / len(losses):.4f}")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    policy.save_hf(str(tmp))  # collective; rank 0 writes
    if torch.distributed.get_rank() == 0:
        (tmp / "sft.json").write_text(json.dumps({"key": key, "base": base, **opts, "samples": len(samples)}))
        (tmp / _MARKER).write_text(key)
        if out.exists():
            import shutil

            shutil.rmtree(out)
        os.replace(tmp, out)
        log(f"opid-sft: saved {out}")
    torch.distributed.barrier()
    return str(out)


def ensure_sft(cfg: Config) -> str:
    return run_sft(cfg)
