"""The OPID training loop (docs/algorithm.md "One training iteration"), top to bottom like slime's train.py.

    set up: config -> run dir (config.yaml) -> Megatron parallel state -> policy (HF dir -> Megatron, optimizer,
            frozen reference copy) -> rollout engine -> env -> analyzer -> scorer -> metrics / audit
    per iteration:
        rollout (opid_mega.rollout.AgentLoop: B tasks x G trajectories, one step-sample per env step)
        analysis in the background (analyzer.submit) while the reference log-probs are computed
        routing (algo.route_skills per trajectory, by algo.mode)
        scoring with the OLD weights through the Scorer (original context = PPO's old log-probs; skill contexts -> Δ)
        advantages (the C++ batch builder: outcome_advantage by task group, token_advantages A_out + Σ λ_k Δ_k)
        Megatron PPO update in mini-batches (train.mini_batch_size step-samples; micro-batches of
            train.micro_batch_tokens packed by the C++ builder, balanced over data-parallel ranks; with
            algo.distill_coef > 0 the skill contexts join them in the fork layout for the distillation loss)
        weight sync Megatron -> rollout engine
        evaluation without skills every eval.interval iterations and after the last; metrics; checkpoint every
        train.save_interval

`grpo` and `opid` share everything (tasks, sampling seeds, mini-batch order) except the λΔ term.
Multi-rank (torchrun, any TP x PP x DP): every rank holds its Megatron shard; rollout, analysis, evaluation, metrics
and the audit log run on global rank 0 and the rollout batch and the analyses are broadcast (`broadcast`).
Resume (`Trainer(..., resume=True)`): model, optimizer, RNG, step and the skill bank come from the last checkpoint;
task draws, sampling seeds and mini-batch order depend only on (train.seed, iteration), so a resumed run repeats
the uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from opid_mega import algo
from opid_mega.config import Config
from opid_mega.models import BUILTIN_MODELS
from opid_mega.skills.injection import inject_skills, render_skill_section

KINDS = (algo.EPISODE, algo.STEP)


class RolloutEngineDied(RuntimeError):
    """The rollout engine failed; the message names the iteration and the last checkpoint."""


class AnalyzerFailed(RuntimeError):
    """Every analysis failed in analyzer.max_failed_iterations iterations in a row; the message says where."""


class TrainingInterrupted(Exception):
    """Ctrl-C (SIGINT), SIGTERM or SIGHUP during training (`signum`); the message says where it stopped, the last
    checkpoint and how to resume."""

    def __init__(self, message: str, signum: int = 2):  # 2: SIGINT
        super().__init__(message)
        self.signum = int(signum)


# ----------------------------------------------------------------------------------------------------------------
# Rollout: opid_mega.rollout.AgentLoop (one batched generate per env step; an env that raises ends only its
# trajectory: it is marked `env_error`, left out of the iteration and counted in rollout/env_errors)
# ----------------------------------------------------------------------------------------------------------------


def build_agent_loop(cfg: Config, engine, tokenizer, hf_dir: str):
    from opid_mega.rollout.agent_loop import AgentLoop

    return AgentLoop(engine, tokenizer, env_factory=env_factory(cfg), history_length=cfg.env.history_length,
                     num_workers=cfg.env.num_workers, max_prompt_tokens=cfg.rollout.max_prompt_tokens,
                     enable_thinking=cfg.model.enable_thinking, model_path=hf_dir,
                     step_timeout_s=cfg.env.step_timeout_s)


def play(loop, cfg: Config, tasks, group_size: int, temperature: float, seed: int, skills=None):
    """len(tasks) x group_size trajectories (a RolloutBatch). `skills`: one optional episode skill per trajectory,
    put into the rollout prompt itself (skill_grpo). Engine failures surface as RolloutEngineDied. The rollout ends
    within rollout.deadline_s (the trajectories still running then are deadline failures: AgentLoop)."""
    from opid_mega.rollout.engine import SamplingParams

    sampling = SamplingParams(temperature=temperature, top_p=cfg.rollout.top_p,
                              max_new_tokens=cfg.rollout.max_response_tokens,
                              stop_token_ids=tuple(loop.stop_token_ids), seed=seed)
    try:
        return loop.run(tasks, group_size, sampling, rollout_skills=skills, skill_kind=algo.EPISODE,
                        placement=cfg.algo.placement, deadline_s=cfg.rollout.deadline_s)
    except Exception as exc:  # noqa: BLE001 - env failures are handled inside the loop: this is the engine
        raise RolloutEngineDied(f"rollout engine failed: {type(exc).__name__}: {exc}") from exc


def audit_rollout_skills(audit, batch, it: int, placement: str) -> None:
    for t in batch.trajectories:
        for s in t.steps:
            if s.rollout_skill:
                audit.log_augmented_prompt(iteration=it, sample_id=f"{it}/rollout/{t.traj_id}/s{s.step}",
                                           kind=algo.EPISODE, placement=placement, skill=s.rollout_skill,
                                           prompt=s.prompt_text, stage="rollout")


# ----------------------------------------------------------------------------------------------------------------
# Helpers of one iteration
# ----------------------------------------------------------------------------------------------------------------


def env_factory(cfg: Config):
    from opid_mega.envs import env_factory as factory

    return factory(cfg.env)


def launch_analyzer_server(cfg: Config, run_dir: Path, python: str = sys.executable):
    """An SGLang server for analyzer.model (opid_mega.rollout.sglang_engine's launcher: own process group, CPU flags
    on a machine without CUDA, log under <run_dir>/sglang_analyzer); its OpenAI-compatible endpoint is <url>/v1."""
    from opid_mega.rollout.sglang_engine import SGLangEngine

    if not cfg.analyzer.model:
        raise ValueError("analyzer.backend=llm with an empty analyzer.base_url launches an SGLang server for "
                         "analyzer.model, which is empty: set analyzer.model (an HF directory or hub name) or "
                         "analyzer.base_url (a running OpenAI-compatible server)")
    args, env = list(cfg.analyzer.sglang_args), None
    if torch.cuda.is_available():  # never on a training GPU by accident: deploy.analyzer_gpus, checked
        from opid_mega.placement import node_placement

        gpus = node_placement(cfg.deploy, analyzer_launched=True).analyzer_gpus
        args, env = server_args(cfg, args, gpus, cfg.deploy.analyzer_mem_fraction)
    from opid_mega.hosts import bind_host, run_api_key

    # bound like the rollout servers (deploy.bind_host), with the run's key (random unless $OPID_SGLANG_API_KEY;
    # the analyzer client sends it)
    return SGLangEngine(cfg.analyzer.model, server_args=args, log_dir=str(run_dir / "sglang_analyzer"),
                        python=python, env=env, cpus=list(cfg.deploy.server_cpus) or None,
                        host=bind_host(cfg.deploy.bind_host), api_key=run_api_key())


def build_analyzer(cfg: Config, audit, run_dir: Path, launch=launch_analyzer_server):
    """(analyzer or None, the analyzer server this run launched or None). backend=llm with an empty
    analyzer.base_url launches `launch(cfg, run_dir)` (a server with .url and .shutdown()); else it attaches.
    An import path "package.module:Class" builds that opid_mega.skills.Analyzer subclass with analyzer.options
    (opid_mega.plugins.build_analyzer; the protocol: docs/custom_env.md)."""
    if not cfg.algo.needs_analysis:
        return None, None
    a = cfg.analyzer
    if a.backend == "rules":
        from opid_mega.skills import RuleAnalyzer

        return RuleAnalyzer(max_step_skills=a.max_step_skills), None
    from opid_mega.plugins import is_import_path

    if is_import_path(a.backend):
        from opid_mega.plugins import build_analyzer as build_plugin

        return build_plugin(a), None
    from opid_mega.skills.llm_analyzer import LLMAnalyzer

    if not a.base_url and a.model in BUILTIN_MODELS:  # e.g. smollm2-135m: the offline model, built once and cached
        from opid_mega.models import prepare_model

        a = dataclasses.replace(a, model=prepare_model(a.model))
        cfg = dataclasses.replace(cfg, analyzer=a)
    server = None if a.base_url else launch(cfg, run_dir)
    base_url = a.base_url or server.url + "/v1"
    try:
        from opid_mega.config import resolve_api_key

        # a launched server's own key (Authorization: Bearer), else analyzer.api_key / $analyzer.api_key_env
        key = (getattr(server, "api_key", None) if server is not None else None) or resolve_api_key(a)
        from opid_mega.config import analyzer_response_format

        analyzer = LLMAnalyzer(base_url, model=a.model, api_key=key, concurrency=a.concurrency,
                               timeout_s=a.timeout_s, stall_timeout_s=a.stall_timeout_s, max_retries=a.max_retries,
                               backoff_s=a.backoff_s, backoff_max_s=a.backoff_max_s, temperature=a.temperature,
                               max_tokens=a.max_tokens, response_format=analyzer_response_format(a),
                               parser=a.parser, max_step_skills=a.max_step_skills, gamma=a.gamma,
                               cache_path=a.cache_path or run_dir / "analysis_cache.jsonl", audit=audit)
        try:
            # one short request before the first rollout: a bad key / URL / model is one line now (exit 2), not a
            # run whose every analysis fails (LLMAnalyzer.probe raises AnalyzerUnavailable)
            result = analyzer.probe()
        except BaseException:
            analyzer.close()
            raise
        rate = f", {result.tokens_per_s:.1f} tokens/s" if result.tokens_per_s else ""
        print(f"analyzer: {result.model} at {result.url} answered the probe in {result.seconds:.2f} s{rate}",
              flush=True)
        return analyzer, server
    except BaseException:
        if server is not None:
            server.shutdown()
        raise


def server_args(cfg: Config, extra: list, gpus: list, mem_fraction: float) -> tuple[list, Optional[dict]]:
    """(launch_server arguments, environment) of one server the trainer starts. On a GPU machine the server gets
    its GPUs (CUDA_VISIBLE_DEVICES), --tp and --mem-fraction-static (unless `extra` sets them) and, for colocated
    rollout servers whose memory is released between phases, --enable-memory-saver. On CPU: the CPU defaults of
    opid_mega.rollout.sglang_engine."""
    from opid_mega.rollout.sglang_engine import _has_flag

    args = list(extra)
    if not torch.cuda.is_available():
        return args, None
    for flag, value in (("--tp", str(len(gpus))), ("--mem-fraction-static", str(mem_fraction))):
        if not _has_flag(args, flag) and not (flag == "--tp" and _has_flag(args, "--tp-size")):
            args += [flag, value]
    return args, {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}


def launch_node_servers(cfg: Config, hf_dir: str, api_key: Optional[str] = None) -> list:
    """This node's rollout servers (deploy.rollout_servers_per_node, placed by opid_mega.placement), started by the
    node's first rank; empty when rollout.engine is local or rollout.sglang_url attaches to running servers. They
    bind and advertise the node's address by deploy.bind_host (opid_mega.hosts) and take `api_key` (the run's)."""
    from opid_mega.placement import node_placement
    from opid_mega.rollout.fleet import launch_fleet

    if cfg.rollout.engine != "sglang" or cfg.rollout.sglang_url or not cfg.deploy.rollout_servers_per_node:
        return []
    groups = node_placement(cfg.deploy).rollout_groups if torch.cuda.is_available() \
        else [[] for _ in range(cfg.deploy.rollout_servers_per_node)]
    memory_saver = cfg.deploy.mode == "colocated" and cfg.deploy.release_engine_memory and torch.cuda.is_available()
    launches = [server_args(cfg, list(cfg.rollout.sglang_args) + (["--enable-memory-saver"] if memory_saver else []),
                            g, cfg.deploy.rollout_mem_fraction) for g in groups]
    node = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))
    from opid_mega.hosts import bind_host

    host = bind_host(cfg.deploy.bind_host)  # auto: the interface that routes to the rendezvous host
    # --dtype model.dtype unless rollout.sglang_args set it: SGLang's `auto` serves a float32 checkpoint as float16
    fleet = launch_fleet(hf_dir, len(groups), launches[0][0], dtype=cfg.model.dtype,
                         log_dir=os.path.join(cfg.logging.run_dir, "sglang"),
                         host=host, api_key=api_key,
                         envs=[env for _, env in launches], balancer="client",
                         engine_options={"cpus": list(cfg.deploy.server_cpus) or None,
                                         "request_timeout_s": cfg.rollout.request_timeout_s})
    print(f"opid-train: node {node}: {len(groups)} rollout server(s) at {', '.join(fleet.urls)}", flush=True)
    return list(fleet.engines)


def build_engine(cfg: Config, hf_dir: str, servers: Optional[list] = None, urls: Optional[list] = None,
                 api_key: Optional[str] = None):
    """Global rank 0's rollout engine: the local engine; one SGLang server (launched or attached); or a fleet of
    every node's servers (`urls`, gathered from the nodes' first ranks; those launched here are `servers`) behind
    our client balancer or SGLang's router (deploy.balancer), which binds like the servers (deploy.bind_host).
    `api_key`: the launched servers' key (also the router's). rollout.sglang_url may list several servers,
    comma-separated; their key, if they have one, comes from $OPID_SGLANG_API_KEY."""
    from opid_mega.rollout.factory import make_engine
    from opid_mega.rollout.fleet import FleetEngine, RouterFleet

    if cfg.rollout.engine == "local":
        return make_engine("local", hf_dir, dtype=cfg.model.dtype)
    from opid_mega.hosts import API_KEY_ENV, bind_host, run_api_key

    if servers is None and urls is None:  # one process (opid-eval): this process launches the servers itself
        api_key = api_key or run_api_key()
        servers = launch_node_servers(cfg, hf_dir, api_key)
        urls = [e.url for e in servers]
    servers = servers or []
    if cfg.rollout.sglang_url:
        urls = [u.strip() for u in cfg.rollout.sglang_url.split(",") if u.strip()]
        api_key = os.environ.get(API_KEY_ENV) or None  # servers someone else runs: their key, if any
    own = {e.url: e for e in servers}
    engines = [own.get(u) or make_engine("sglang", None, url=u, request_timeout_s=cfg.rollout.request_timeout_s,
                                         api_key=api_key) for u in urls]
    if len(engines) == 1 and cfg.deploy.balancer == "client":
        return engines[0]
    if cfg.deploy.balancer == "router":
        return RouterFleet(engines, router_args=list(cfg.deploy.router_args),
                           log_dir=os.path.join(cfg.logging.run_dir, "sglang"), host=bind_host(cfg.deploy.bind_host),
                           api_key=api_key or run_api_key(),
                           request_timeout_s=cfg.rollout.request_timeout_s)
    return FleetEngine(engines)


def gather_servers(cfg: Config, servers: list) -> dict:
    """Every rank's launched rollout servers and where each rank runs (a collective on the control group):
    {"servers": [{"url", "rank", "gpus"}] in node order, "ranks": [{"rank", "node", "gpu"}]}; the URLs are the
    addresses the servers bind (deploy.bind_host), reachable from the other nodes. The weight sync decides from it
    which rank of a server's node feeds it (opid_mega.megatron.weight_sync.feeders)."""
    import torch.distributed as dist

    from opid_mega.megatron.parallel import all_gather_control

    rank = dist.get_rank() if dist.is_initialized() else 0
    groups = []
    if servers and torch.cuda.is_available():
        from opid_mega.placement import node_placement

        groups = node_placement(cfg.deploy).rollout_groups
    mine = {"rank": rank, "node": int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")) or 0),
            "gpu": torch.cuda.current_device() if torch.cuda.is_available() else None,
            "servers": [{"url": e.url, "rank": rank, "gpus": list(groups[i]) if i < len(groups) else []}
                        for i, e in enumerate(servers)]}
    everyone = all_gather_control(mine)
    return {"servers": [s for part in everyone for s in part["servers"]],
            "ranks": [{k: part[k] for k in ("rank", "node", "gpu")} for part in everyone]}


def gather_server_urls(servers: list) -> list:
    """Every node's rollout server URLs, in node order (a collective on the control group)."""
    from opid_mega.megatron.parallel import all_gather_control

    return [u for part in all_gather_control([e.url for e in servers]) for u in part]


def resolve_init(cfg: Config) -> str:
    """The HF directory the policy starts from: model.init_from (an HF dir, or "sft": the cached opid-sft warm start
    of this config, built when missing), else model.path / the built-in model."""
    from opid_mega.models import resolve_model_path

    if cfg.model.init_from == "sft":
        from opid_mega.sft import ensure_sft

        return ensure_sft(cfg)
    if cfg.model.init_from:
        return resolve_model_path(cfg.model.init_from)
    return resolve_model_path(cfg.model.path, cfg.model.builtin, cfg.model.cache_dir)


@dataclass
class Advantages:
    """Per step-sample outcome advantages and per response token (flat, sample order) A and old log-probs."""
    a_out: np.ndarray  # float64 [S]
    token: np.ndarray  # float32 [sum resp_lens]: A = A_out + Σ λ_k Δ_k
    old: np.ndarray  # float32 [sum resp_lens]: log π_old of the original context
    resp_lens: np.ndarray  # int64 [S]

    @property
    def outcome_per_token(self) -> np.ndarray:
        return np.repeat(self.a_out, self.resp_lens)


def _flat(tensors: list, lens: np.ndarray, what: str) -> np.ndarray:
    got = np.fromiter((t.numel() for t in tensors), np.int64, count=len(tensors))
    bad = np.flatnonzero(got != lens)
    if bad.size:
        raise ValueError(f"{what} of step-sample {int(bad[0])} has {int(got[bad[0]])} values, its response "
                         f"{int(lens[bad[0]])} tokens")
    return torch.cat([t.reshape(-1).float() for t in tensors]).numpy() if tensors else np.zeros(0, np.float32)


def compute_advantages(cfg: Config, scored: list, rewards, invalid, groups, backend: Optional[str] = None):
    """:class:`Advantages` from the scorer's results (docs/algorithm.md §2, §6, §7), by the batch builder's
    `outcome_advantage` / `token_advantages` (`opid_mega._C` when built; `backend` forces one). `grpo` /
    `skill_grpo` take no Δ; every other mode adds λ_k Δ_k with the mode's λs, Δ_k = skill − original log-prob on
    the step-samples routed to skill type k (algo.delta=sampled, the paper), or that plus KL(p_o‖p_s) (full_kl) or
    its top-k estimate (topk_kl) from the scorer's `divergence` (`opid_mega.algo.divergence_delta`). Identical to
    GRPO whenever every Δ is 0."""
    from opid_mega import batching

    lens = np.fromiter((r.orig.numel() for r in scored), np.int64, count=len(scored))
    old = _flat([r.orig for r in scored], lens, "the original log-probs")
    scores = np.asarray(rewards, np.float64) - cfg.algo.invalid_penalty * np.asarray(invalid, bool)
    a_out = batching.outcome_advantage(scores, np.asarray(groups, np.int64), cfg.algo.outcome_mode, backend=backend)
    deltas, masks, lambdas = [], [], []
    if cfg.algo.mode not in ("grpo", "skill_grpo"):
        lam = {algo.EPISODE: cfg.algo.lambda_episode if cfg.algo.use_episode else 0.0,
               algo.STEP: cfg.algo.lambda_step if cfg.algo.use_step else 0.0}
        for kind in KINDS:
            masks.append(np.fromiter((kind in r.skill for r in scored), bool, count=len(scored)))
            skill = _flat([r.skill.get(kind, r.orig) for r in scored], lens, f"the {kind}-skill log-probs")
            delta = skill.astype(np.float64) - old
            if cfg.algo.delta != "sampled":  # + the divergence term (its conditional mean removed)
                delta = delta + _flat([divergence_term(r, kind, cfg.algo.delta) for r in scored], lens,
                                      f"the {kind}-skill divergence").astype(np.float64)
            deltas.append(delta)
            lambdas.append(lam[kind])
    token = batching.token_advantages(a_out, lens, deltas, masks, lambdas, normalize=cfg.algo.delta_normalize,
                                      clip=cfg.algo.delta_clip, backend=backend)
    return Advantages(a_out, token, old, lens)


def divergence_topk(a) -> Optional[int]:
    """The scorer's divergence_topk for an AlgoConfig: None (log-probs only) for the paper's Δ, 0 for full_kl, k for
    topk_kl."""
    return {"sampled": None, "full_kl": 0, "topk_kl": a.delta_topk}[a.delta]


def divergence_term(r, kind: str, delta: str) -> torch.Tensor:
    """What `delta` (full_kl / topk_kl) adds to the sampled Δ on one step-sample's tokens for skill type `kind`:
    KL(p_o‖p_s) or its top-k estimate (zeros where the sample has no such skill: masked anyway)."""
    if kind not in r.skill:
        return torch.zeros_like(r.orig)
    if kind not in r.divergence:
        raise ValueError(f"algo.delta={delta}: the scorer returned no divergence for skill type {kind!r} "
                         "(scoring.scorer must be fork)")
    return algo.delta_baseline({k: v.double() for k, v in r.divergence[kind].items() if k != "topk_ids"}, delta)


def skill_section_cap(encode, kind: str, max_skill_tokens: int) -> int:
    """Tokens a skill section of `kind` may take: its fixed frame (title, instruction, brackets; measured with a
    one-character skill) plus analyzer.max_skill_tokens for the skill plus 4 for tokenizer merges at the frame's
    edges. `Trainer.fit_section` enforces it, and the fork scorer's budget is derived from it."""
    return len(encode(render_skill_section("x", kind))) + int(max_skill_tokens) + 4


def shuffle_analyses(groups: list, analyses: list, seed: int) -> list:
    """The negative control's analyses (algo.skill_source=shuffled), one per trajectory: trajectory j of group g
    gets the analysis of trajectory j (modulo that group's size) of the group after g in a seeded random cycle of
    the batch's groups, so no trajectory keeps an analysis of its own task and every analysis stays one an analyzer
    wrote for a trajectory of this batch. A batch of a single group has no other task: no analyses (all None)."""
    order = list(dict.fromkeys(groups))
    if len(order) < 2:
        return [None] * len(analyses)
    random.Random(seed).shuffle(order)
    donor_of = {g: order[(k + 1) % len(order)] for k, g in enumerate(order)}
    by_group: dict = {}
    for g, a in zip(groups, analyses):
        by_group.setdefault(g, []).append(a)
    taken: dict = {}
    out = []
    for g in groups:
        donors = by_group[donor_of[g]]
        out.append(donors[taken.get(g, 0) % len(donors)])
        taken[g] = taken.get(g, 0) + 1
    return out


def outcome_info_means(trajs: list, prefix: str) -> dict:
    """{prefix/key: share of trajectories whose last value of the env's info key was truthy} for every key of the
    trajectories' outcome_info (the env's `info_metrics`; a trajectory without the key counts as False)."""
    keys = sorted({k for t in trajs for k in t.outcome_info})
    return {f"{prefix}/{k}": mean(bool(t.outcome_info.get(k)) for t in trajs) for k in keys} if trajs else {}


def advantage_records(it: int, samples: list, trajs: list, scored: list, adv) -> list:
    """logging.dump_advantages: one JSON-able record per step-sample of an iteration (task, group, score, A_out, the
    skill kinds it was scored with, response token ids and Δ = skill − original log-prob per token of each kind)."""
    out = []
    for k, ((ti, si, s), r) in enumerate(zip(samples, scored)):
        t = trajs[ti]
        out.append({"iteration": it, "sample": f"{it}/{t.task_id}/{ti}/s{si}", "task": t.task_id,
                    "group": int(t.group_id), "score": float(t.score), "won": bool(t.won), "step": si,
                    "action": s.action, "valid": bool(s.valid), "a_out": round(float(adv.a_out[k]), 6),
                    "kinds": sorted(r.skill), "response_ids": [int(x) for x in s.response_ids],
                    "delta": {kind: [round(float(x), 5) for x in (r.skill[kind].double() - r.orig.double())]
                              for kind in sorted(r.skill)}})
    return out


def skill_key(task) -> str:
    """The skill bank's key of a task: the same string as `Trajectory.task_id` of its rollouts (the AgentLoop sets
    task_id = str(task.id)), so a task's rollouts find the skill of that task's own latest analysis."""
    return str(getattr(task, "id", task))


def should_evaluate(cfg: Config, it: int) -> bool:
    """Whether the no-skill evaluation runs after iteration `it` (0: before the first iteration): every
    eval.interval iterations and after the last one (the reference validates at its last step too), before training
    when eval.before_training; never with eval.interval = 0."""
    if not cfg.eval.interval:
        return False
    if it == 0:
        return cfg.eval.before_training
    return it % cfg.eval.interval == 0 or it == cfg.train.iterations


def learning_rate(train, it: int) -> float:
    """The learning rate of iteration `it` (1-based) under `train.lr_scheduler` (a TrainConfig): constant ->
    train.lr; warmup -> train.lr * min(1, (it - 1) / W) with W = int(train.lr_warmup_ratio * train.iterations), the
    reference's constant schedule with linear warm-up, stepped once per iteration after the update (so its first
    update runs at 0). Every mini-batch of an iteration uses the same rate."""
    if train.lr_scheduler == "constant":
        return train.lr
    if train.lr_scheduler != "warmup":
        raise ValueError(f"train.lr_scheduler={train.lr_scheduler!r}, allowed: constant, warmup")
    warmup = int(train.lr_warmup_ratio * train.iterations)
    if warmup <= 0 or it - 1 >= warmup:
        return train.lr
    return train.lr * (it - 1) / warmup


def broadcast(produce):
    """`produce()` on global rank 0, its result (or error) on every rank over the control group: the control channel
    lives with the parallel state (opid_mega.megatron.parallel.broadcast); kept here for the trainer's callers."""
    from opid_mega.megatron.parallel import broadcast as control_broadcast

    return control_broadcast(produce)


def wait_for_rank0() -> None:
    """Every rank waits for global rank 0 on the control group (opid_mega.megatron.parallel.wait_for_rank0)."""
    from opid_mega.megatron.parallel import wait_for_rank0 as control_barrier

    control_barrier()


def mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else float("nan")


# ----------------------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------------------


class Trainer:
    def __init__(self, cfg: Config, run_dir: Optional[str] = None, resume: bool = False,
                 resume_overrides: tuple = (), config_digest: Optional[dict] = None):
        """`resume`: continue from the run directory's newest complete checkpoint (what a killed save left is
        removed first). `resume_overrides`: the key=value overrides of this resume, recorded in
        resume_overrides.jsonl (config.yaml is never rewritten on resume). `config_digest`: the digest of the run's
        config.yaml (opid_mega.rundir.config_digest), stored in every checkpoint (default: of `cfg` on a fresh start,
        of the saved config.yaml on a resume)."""
        from opid_mega.metrics import MetricsLogger
        from opid_mega.models import load_tokenizer
        from opid_mega.scoring.fork_scorer import ForkScorer
        from opid_mega.scoring.scorer import NaiveScorer
        from opid_mega.skills.audit import AuditLog

        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.logging.run_dir)
        self.ckpt_dir = str(self.run_dir / "checkpoints")
        os.environ["OPID_KERNEL_BACKEND"] = cfg.scoring.kernel_backend  # opid_mega.kernels' "auto" on every rank
        torch.manual_seed(cfg.train.seed)
        random.seed(cfg.train.seed)

        hf_dir = resolve_init(cfg)
        from opid_mega.megatron.policy import Policy

        self.policy = Policy(cfg, hf_dir)  # every rank: Megatron TP/PP/DP
        # Rollout, analysis, evaluation, metrics and the audit log live on global rank 0; the batch is broadcast.
        self.rank0 = torch.distributed.get_rank() == 0
        from opid_mega import rundir

        if config_digest is None:
            saved = self.run_dir / rundir.CONFIG_FILE
            config_digest = rundir.config_digest(rundir.read_saved_config(self.run_dir) if resume and saved.exists()
                                                 else cfg)
        self.config_digest = config_digest
        self.start, resumed = 0, {}
        if resume:  # model, optimizer, RNG and step from the newest complete checkpoint
            from opid_mega.megatron.checkpoint import clean_uncommitted

            if self.rank0:
                removed = clean_uncommitted(self.ckpt_dir)
                if removed:
                    print(f"opid-train: removed what a killed save left in {self.ckpt_dir}: {', '.join(removed)}",
                          flush=True)
            wait_for_rank0()
            self.start, resumed = self.policy.load(self.ckpt_dir)
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if resume:  # config.yaml stays as the run started; this resume's overrides get their own record
                rundir.run_id(self.run_dir)  # (a run from before run ids gets one)
                rundir.record_resume(self.run_dir, self.start, list(resume_overrides))
            else:  # a fresh start (the CLI refused a directory holding checkpoints): a new run in this directory
                rundir.write_config(self.run_dir, cfg)
                self.config_digest = rundir.config_digest(cfg)  # exactly what config.yaml now holds
                rundir.new_run_id(self.run_dir)
                for name in ("audit.jsonl", rundir.OVERRIDES_FILE):  # a predecessor that never saved a checkpoint
                    rundir.move_file_aside(self.run_dir / name)
        self.tokenizer = load_tokenizer(hf_dir)
        env = env_factory(cfg)()
        self.eval_tasks = env.tasks(cfg.env.eval_split, cfg.eval.num_tasks, seed=cfg.train.seed) \
            if cfg.eval.num_tasks else []
        self.env0 = env
        # resumed: the records of iterations after the checkpoint are dropped (they are re-run), a torn line cut
        self.audit = AuditLog(self.run_dir / "audit.jsonl" if self.rank0 else None,
                              resume_iteration=self.start if resume else None)
        self.analyzer, self.analyzer_server = build_analyzer(cfg, self.audit, self.run_dir) if self.rank0 \
            else (None, None)
        # Analyzer output is untrusted: every skill is cut to analyzer.max_skill_tokens tokens (cut_analyses), so a
        # skill section never exceeds section_caps[kind] tokens (fit_section), and one step-sample's fork group (the
        # original context and one per section, each at most prompt + section + response) always fits the scoring
        # budget: no analyzer output can make the fork scorer refuse a sample.
        from opid_mega.scoring.layout import fork_sample_bound

        self.section_caps = {k: skill_section_cap(self.encode_text, k, cfg.analyzer.max_skill_tokens) for k in KINDS}
        fork_budget = max(cfg.train.micro_batch_tokens,
                          fork_sample_bound(cfg.rollout.max_prompt_tokens, cfg.rollout.max_response_tokens,
                                            list(self.section_caps.values())))
        # every context is scored at the sampling temperature (old log-probs and Δ as the sampler saw them)
        # algo.delta = full_kl / topk_kl: the fork scorer also returns each skill context's divergences (one pass)
        self.scorer = ForkScorer(self.policy.packed_logprobs, fork_budget, temperature=cfg.rollout.temperature,
                                 divergence_topk=divergence_topk(cfg.algo)) \
            if cfg.scoring.scorer == "fork" else NaiveScorer(self.policy.logprobs, temperature=cfg.rollout.temperature)
        self.skill_bank: dict = {}  # task id -> latest episode skill (skill_grpo rollouts, eval with skills)
        self.analysis_failures = 0
        self.failed_iterations = 0  # iterations in a row in which every analysis failed (analyzer.max_failed_iterations)
        self.deadline_failures = 0  # analyses of the current iteration that missed analyzer.deadline_s
        self.skills_truncated = 0  # skills of the current iteration's analyses cut to analyzer.max_skill_tokens
        self.current = 0  # the iteration in progress (0: none yet)
        if resume:  # the checkpoint's trainer state (loaded above)
            self.skill_bank = resumed.get("skill_bank", {})
            self.analysis_failures = resumed.get("analysis_failures", 0)
        # colocated on GPU: a resumed optimizer's Adam moments go to the host before the rollout servers start
        # (SGLang sizes its KV cache from the memory free then, as opid-plan assumes; during rollout they are on the
        # host anyway, see Colocation)
        if resume and cfg.deploy.mode == "colocated" and cfg.deploy.offload_optimizer and torch.cuda.is_available():
            from opid_mega.megatron.colocate import Colocation

            Colocation(cfg, self.policy, None).before_sync()
        # every node's first rank launches that node's rollout servers; global rank 0 drives all of them
        # one random API key per run for every server and the router it launches (rank 0 draws it; it travels only
        # over the control group and into the servers through a pipe: opid_mega.keyed), the servers bound to the
        # node's cluster address (deploy.bind_host)
        from opid_mega.hosts import run_api_key

        self.api_key = broadcast(run_api_key)
        self.servers = launch_node_servers(cfg, hf_dir, self.api_key) \
            if int(os.environ.get("LOCAL_RANK", "0")) == 0 else []
        self.server_map = gather_servers(cfg, self.servers)
        urls = [srv["url"] for srv in self.server_map["servers"]]
        self.engine = build_engine(cfg, hf_dir, self.servers, urls, api_key=self.api_key) if self.rank0 else None
        self.loop = build_agent_loop(cfg, self.engine, self.tokenizer, hf_dir) if self.rank0 else None
        wait_for_rank0()  # rank 0 may have spent minutes launching servers
        from opid_mega.megatron.weight_sync import WeightSync

        from opid_mega.megatron.colocate import Colocation

        self.weight_sync = WeightSync(self.policy, self.engine, cfg, str(self.run_dir), self.tokenizer,
                                      servers=self.server_map, own=self.servers, api_key=self.api_key)
        self.colocation = Colocation(cfg, self.policy, self.engine)  # no-op unless colocated on GPU
        if resume:
            self.sync_weights(self.start)
        # the resolved config (secrets emptied) goes to TensorBoard (text + hparams) and W&B (wandb.init(config=))
        from opid_mega.config import redacted
        from opid_mega.metrics import wandb_settings

        self.log = MetricsLogger(self.run_dir, tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress,
                                 total=cfg.train.iterations, resume_step=self.start if resume else None,
                                 config=redacted(cfg), wandb=wandb_settings(cfg.logging, self.run_dir)) \
            if self.rank0 else None

    # ---- the loop -----------------------------------------------------------------------------------------------
    def fit(self) -> None:
        cfg = self.cfg
        try:
            if self.start == 0 and should_evaluate(cfg, 0) and self.eval_tasks and self.rank0:
                self.log.log(0, self.evaluate(0))
            wait_for_rank0()
            for it in range(self.start + 1, cfg.train.iterations + 1):
                self.current = it
                try:
                    metrics = self.iteration(it)
                except RolloutEngineDied as exc:
                    from opid_mega.megatron.checkpoint import latest_step

                    last = latest_step(self.ckpt_dir)
                    where = f"{self.ckpt_dir}/step_{last}" if last is not None else "none yet"
                    raise RolloutEngineDied(f"iteration {it}: {exc}. Last checkpoint: {where} "
                                            f"(resume with: opid-train --resume {self.run_dir})") from exc
                if should_evaluate(cfg, it) and self.eval_tasks and self.rank0:
                    metrics.update(self.evaluate(it))
                if self.rank0:
                    self.log.log(it, metrics)
                wait_for_rank0()  # before the checkpoint's collectives: rank 0 may have been evaluating
                if cfg.train.save_interval and (it % cfg.train.save_interval == 0 or it == cfg.train.iterations):
                    self.policy.save(self.ckpt_dir, it, {"skill_bank": self.skill_bank,
                                                         "analysis_failures": self.analysis_failures},
                                     meta={"config": json.dumps(self.config_digest)})
        finally:
            self.close()

    def iteration(self, it: int) -> dict:
        from opid_mega.megatron.train_batches import TrainData
        from opid_mega.metrics import Timer
        from opid_mega.scoring.scorer import ScoreRequest

        cfg, timer = self.cfg, Timer()
        t0 = time.perf_counter()

        # 1. rollout: B tasks x G trajectories (task draw and sampling seeds depend only on seed and iteration)
        with timer("rollout"):
            self.colocation.before_rollout()
            tasks = self.env0.tasks(cfg.env.train_split, cfg.rollout.tasks_per_iter, seed=cfg.train.seed * 7919 + it)
            G = cfg.rollout.group_size
            # skill_grpo: every rollout of task t carries the episode skill of t's OWN latest analysis (none yet: none)
            skills = [self.skill_bank.get(skill_key(t)) for t in tasks for _ in range(G)] \
                if cfg.algo.mode == "skill_grpo" else None
            batch = broadcast(lambda: play(self.loop, cfg, tasks, G, cfg.rollout.temperature,
                                           seed=cfg.train.seed * 100_003 + it, skills=skills))
            audit_rollout_skills(self.audit, batch, it, cfg.algo.placement)
            self.colocation.after_rollout()
        # a trajectory whose env raised was ended by the loop; it is left out (a simulator fault is no outcome)
        # so is one the rollout deadline ended (rollout.deadline_s: counted in rollout/deadline_trajectories)
        trajs = [t for t in batch.trajectories if not t.env_error and not t.deadline_failure]
        samples = [(ti, si, s) for ti, t in enumerate(trajs) for si, s in enumerate(t.steps)]
        late = sum(t.deadline_failure for t in batch.trajectories)
        if not trajs and late:
            raise RolloutEngineDied(f"the rollout passed rollout.deadline_s={cfg.rollout.deadline_s:g} s with none of "
                                    f"its {len(batch.trajectories)} trajectories finished ({late} cut by the "
                                    "deadline)")
        if not samples:
            raise RuntimeError(f"iteration {it}: the rollout produced no step-samples (every env raised: see "
                               "rollout/env_errors and the trajectories' errors)")
        orig = [(s.prompt_ids + s.response_ids, len(s.prompt_ids)) for _, _, s in samples]

        # 2. analysis in the background while the reference log-probs are computed
        views = [t.to_view(f"{it}/{t.task_id}/{ti}") for ti, t in enumerate(trajs)]
        job = self._submit(views, it)
        with timer("reference"):
            ref_lps = self.policy.reference_logprobs(orig) if self.policy.reference else None
        with timer("analysis_wait"):
            analyses = broadcast(lambda: self._collect(job, views, it))

        # 3. routing: one {kind: skill} per step-sample (algo.skill_source=shuffled: the negative control's analyses of
        # other tasks)
        if cfg.algo.skill_source == "shuffled":
            analyses = shuffle_analyses([t.group_id for t in trajs], analyses, seed=cfg.train.seed * 65_537 + it)
        routes = []
        for t, an in zip(trajs, analyses):
            if an is None:
                routes.extend({} for _ in t.steps)
                continue
            steps = {k: v for k, v in an.step_skills.items() if 0 <= k < len(t.steps)}
            routes.extend(algo.route_skills(len(t.steps), steps, an.episode_skill, mode=cfg.algo.routing,
                                            use_episode=cfg.algo.use_episode, use_step=cfg.algo.use_step,
                                            lambda_episode=cfg.algo.lambda_episode,
                                            lambda_step=cfg.algo.lambda_step))
            if cfg.algo.mode == "skill_grpo" or cfg.eval.with_skills:
                self.skill_bank[t.task_id] = an.episode_skill  # t.task_id == skill_key(its task)

        # 4. scoring with the old weights: original context (= PPO old log-probs) and every routed skill context
        with timer("scoring"):
            if cfg.algo.mode in ("grpo", "skill_grpo"):  # no λΔ term: only the original context is scored
                routes = [{} for _ in routes]
            requests = []
            for (ti, si, s), route in zip(samples, routes):
                skills = {}
                for kind, skill in route.items():
                    at = s.episode_insert_at if kind == algo.EPISODE and cfg.algo.placement != "late" \
                        else s.step_insert_at
                    skill, ids = self.fit_section(skill, kind)
                    if not ids:
                        continue
                    skills[kind] = (at, ids)
                    self.audit.log_augmented_prompt(iteration=it, sample_id=f"{it}/{trajs[ti].task_id}/{ti}/s{si}",
                                                    kind=kind, placement=cfg.algo.placement, skill=skill,
                                                    prompt=inject_skills(s.prompt_text, {kind: skill},
                                                                         cfg.algo.placement),
                                                    stage="scoring")
                requests.append(ScoreRequest(s.prompt_ids, s.response_ids, skills))
            scored = self.scorer.score(requests)

        # 5. advantages: A = A_out + Σ λ_k Δ_k per response token (flat arrays, the C++ batch builder)
        rewards = [trajs[ti].score for ti, _, _ in samples]
        invalid = np.fromiter((not s.valid for _, _, s in samples), bool, count=len(samples))
        groups = [trajs[ti].group_id for ti, _, _ in samples]
        adv = compute_advantages(cfg, scored, rewards, invalid, groups)
        if cfg.logging.dump_advantages and self.rank0:
            with open(self.run_dir / "advantages.jsonl", "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in advantage_records(it, samples, trajs, scored, adv))

        # 6. PPO update on the original context (mini-batches packed by the C++ batch builder)
        with timer("update"):
            # algo.distill_coef > 0: the skill contexts ride along (fork layout) as the distillation's teacher
            skill_ctx = [[r.context(k) for k in sorted(r.skills)] for r in requests] if cfg.algo.distill_coef > 0 \
                else None
            data = TrainData.from_sequences([t for t, _ in orig], adv.resp_lens, skill_contexts=skill_ctx,
                                            old_logprobs=adv.old, advantages=adv.token,
                                            ref_logprobs=torch.cat(ref_lps) if ref_lps is not None else None)
            lr = learning_rate(cfg.train, it)
            self.policy.set_lr(lr)
            ppo = self.policy.train(data, seed=cfg.train.seed * 31 + it)

        # 7. weight sync to the rollout engine
        with timer("weight_sync"):
            self.colocation.before_sync()
            sync = self.sync_weights(it)

        # 8. metrics
        ntok = max(int(adv.resp_lens.sum()), 1)
        out_tok = adv.outcome_per_token
        out_abs = float(np.abs(out_tok).sum() / ntok)
        # A is rounded to float32 once: against A_out in float32, GRPO's skill part is exactly 0
        skill_abs = float(np.abs(adv.token.astype(np.float64) - out_tok.astype(np.float32)).sum() / ntok)
        eng = np.fromiter(itertools.chain.from_iterable(s.response_logprobs for _, _, s in samples), np.float64)
        analyzed = [a for a in analyses if a is not None]
        elapsed = time.perf_counter() - t0
        return {
            "train/success_rate": mean(t.won for t in trajs),
            "train/score": mean(t.score for t in trajs),
            "train/episode_length": mean(len(t.steps) for t in trajs),
            "train/invalid_rate": float(invalid.mean()),
            **outcome_info_means(trajs, "train"),
            "train/step_samples": len(samples),
            "rollout/trajectories": len(batch.trajectories),
            "rollout/env_errors": sum(t.env_error for t in batch.trajectories),
            "rollout/deadline_trajectories": late,
            "adv/outcome_abs_mean": out_abs,
            "adv/skill_abs_mean": skill_abs,
            "adv/skill_share": skill_abs / (out_abs + skill_abs) if out_abs + skill_abs > 0 else 0.0,
            "analysis/critical_steps_per_traj": mean(len(a.step_skills) for a in analyzed) if analyzed else None,
            "analysis/failure_rate": (len(analyses) - len(analyzed)) / len(analyses) if cfg.algo.needs_analysis
            else None,
            "analysis/failures_total": self.analysis_failures,
            "analysis/deadline_failures": self.deadline_failures if cfg.algo.needs_analysis else None,
            "analysis/skills_truncated": self.skills_truncated if cfg.algo.needs_analysis else None,
            "ppo/clipfrac": ppo.get("clipfrac"),
            "ppo/kl": ppo.get("kl"),
            "ppo/approx_kl": ppo.get("approx_kl"),
            "ppo/approx_kl_first": ppo.get("approx_kl_first"),
            "ppo/entropy": ppo.get("entropy"),
            "ppo/loss": ppo.get("loss"),
            "ppo/grad_norm": ppo.get("grad_norm"),
            **({"ppo/distill_kl": ppo.get("distill_kl")} if cfg.algo.distill_coef > 0 else {}),
            "train/lr": lr,
            "rollout/logprob_mismatch": float(np.abs(eng - adv.old).sum() / ntok) if eng.size == adv.old.size
            else None,
            "perf/tokens_per_s": sum(len(t) for t, _ in orig) / elapsed,
            "scoring/tokens": getattr(self.scorer, "last_tokens", 0),
            **sync,
            **(self.engine.stats() if hasattr(self.engine, "stats") else {}),
            **timer.pop(),
        }

    def sync_weights(self, version: int) -> dict:
        """Megatron -> rollout engine(s) as weight version `version` (opid_mega.megatron.weight_sync: a collective of
        data-parallel replica 0; rank 0 feeds its engines; the probe check every sync.check_interval syncs)."""
        try:
            # colocated: the engines' KV cache and CUDA graphs come back after the transfer, before the probe
            return self.weight_sync(version, after_transfer=self.colocation.after_sync)
        except Exception as exc:  # noqa: BLE001
            if not self.rank0:
                raise
            raise RolloutEngineDied(f"weight update failed: {type(exc).__name__}: {exc}") from exc

    # ---- analysis -----------------------------------------------------------------------------------------------
    def _submit(self, views, it):
        """Start the analysis of `views` in the background; it must be done within analyzer.deadline_s from now."""
        if self.analyzer is None:
            return None
        from opid_mega.skills.llm_analyzer import LLMAnalyzer

        deadline_s = self.cfg.analyzer.deadline_s
        job = self.analyzer.submit(views, iteration=it, deadline_s=deadline_s) \
            if isinstance(self.analyzer, LLMAnalyzer) else self.analyzer.submit(views, iteration=it)
        # the LLM analyzer ends its own job at the deadline (partial results); a little slack for it to return
        job.opid_deadline = time.monotonic() + deadline_s + (30.0 if isinstance(self.analyzer, LLMAnalyzer) else 0.0)
        return job

    def _collect(self, job, views, it, count_failures: bool = True) -> list:
        """The analyses of a job from _submit, one per view (None: no skill signal). Past analyzer.deadline_s the
        analyses not done are failures (audited; counted in analysis/deadline_failures); the run goes on."""
        if count_failures:
            self.deadline_failures = 0
        if job is None:
            return [None] * len(views)
        late = 0
        try:
            analyses = list(job.result(timeout=max(0.0, getattr(job, "opid_deadline", math.inf) - time.monotonic())))
            late = sum(str(getattr(r, "failure", "") or "").startswith(("deadline:", "transport: deadline:"))
                       for r in getattr(job, "records", []))
        except TimeoutError:  # an analyzer that does not keep the deadline itself: the whole batch is late
            job.cancel()
            analyses, late = [None] * len(views), len(views)
            for v in views:
                self.audit.log_analysis(iteration=it, traj_id=v.traj_id, task=v.task, won=v.won, prompt=None,
                                        raw_reply=None, failure=f"deadline: analyzer.deadline_s="
                                                                f"{self.cfg.analyzer.deadline_s:g} s passed")
        except Exception as exc:  # noqa: BLE001 - an analyzer crash costs the skill term, never the run
            analyses = [None] * len(views)
            for v in views:
                self.audit.log_analysis(iteration=it, traj_id=v.traj_id, task=v.task, won=v.won, prompt=None,
                                        raw_reply=None, failure=f"{type(exc).__name__}: {exc}")
        analyses, cut = self.cut_analyses(analyses, len(views))
        if count_failures:
            self.skills_truncated = cut
        from opid_mega.skills.llm_analyzer import LLMAnalyzer

        if not isinstance(self.analyzer, LLMAnalyzer):  # the LLM analyzer writes its own audit records
            for v, a in zip(views, analyses):
                self.audit.log_analysis(iteration=it, traj_id=v.traj_id, task=v.task, won=v.won, prompt=None,
                                        raw_reply=None, analysis=a, failure=None if a else "no analysis",
                                        analyzer=type(self.analyzer).__name__)
        if count_failures:
            self.analysis_failures += sum(a is None for a in analyses)
            self.deadline_failures = late
            # analyzer.max_failed_iterations iterations in a row with every analysis failed stop the run
            if analyses:  # (an iteration with nothing to analyse leaves the count as it is)
                self.failed_iterations = self.failed_iterations + 1 if all(a is None for a in analyses) else 0
            limit = self.cfg.analyzer.max_failed_iterations
            if limit and self.failed_iterations >= limit:
                raise AnalyzerFailed(f"iteration {it}: every analysis failed in {self.failed_iterations} iterations "
                                     f"in a row (analyzer.max_failed_iterations={limit}; the reasons are in "
                                     f"{self.run_dir / 'audit.jsonl'})")
        return analyses

    # ---- evaluation ---------------------------------------------------------------------------------------------
    def evaluate(self, it: int) -> dict:
        """Held-out tasks, one episode each, WITHOUT skills (docs/algorithm.md §9). With eval.with_skills (always for
        skill_grpo) each eval task is then played once more WITH an episode skill of its own: eval tasks are never
        analysed during training, so the analyzer analyses the task's no-skill eval trajectory just played and
        that analysis' episode skill is put into the second episode's prompts (a task whose analysis failed, or
        with no analyzer, is replayed without a skill). No task ever gets another task's skill."""
        cfg, seed = self.cfg, self.cfg.train.seed * 100_003 + 77_777 + it
        trajs = play(self.loop, cfg, self.eval_tasks, 1, cfg.eval.temperature, seed).trajectories
        out = {"eval/success_rate": mean(t.won for t in trajs), "eval/episode_length": mean(t.length for t in trajs),
               **outcome_info_means(trajs, "eval")}
        if (cfg.eval.with_skills or cfg.algo.mode == "skill_grpo") and self.analyzer is not None:
            skills = self.eval_skills(trajs, it)
            batch = play(self.loop, cfg, self.eval_tasks, 1, cfg.eval.temperature, seed, skills=skills)
            audit_rollout_skills(self.audit, batch, it, cfg.algo.placement)
            out["eval/success_rate_with_skills"] = mean(t.won for t in batch.trajectories)
        return out

    def eval_skills(self, trajs: list, it: int) -> list:
        """One optional episode skill per eval trajectory: the analyzer's analysis of that very trajectory (eval
        analyses are audited, not counted in analysis/failures_total)."""
        keep = [i for i, t in enumerate(trajs) if t.steps and not t.env_error]
        views = [trajs[i].to_view(f"eval{it}/{trajs[i].task_id}/{i}") for i in keep]
        analyses = self._collect(self._submit(views, it), views, it, count_failures=False) if views else []
        skills: list = [None] * len(trajs)
        for i, an in zip(keep, analyses):
            if an is not None and an.episode_skill.strip():
                skills[i] = an.episode_skill
        return skills

    def cut_analyses(self, analyses: list, n: int) -> tuple[list, int]:
        """(analyses, skills cut): analyzer output is untrusted, so each of the `n` analyses is sanitised
        (opid_mega.skills.sanitize; an unusable one, or one whose handling fails, becomes None: it costs only itself)
        and every skill is cut to analyzer.max_skill_tokens tokens of the policy tokenizer at a word boundary."""
        from opid_mega.skills.sanitize import cut_analysis, sanitize_analysis

        def count(text: str) -> int:
            return len(self.encode_text(text))

        analyses = (list(analyses) + [None] * n)[:n]  # an analyzer that returned too few or too many entries
        out, cut = [], 0
        for a in analyses:
            try:
                a = sanitize_analysis(a)
                if a is not None:
                    a, k = cut_analysis(a, self.cfg.analyzer.max_skill_tokens, count)
                    cut += k
                    if not a.episode_skill.strip():
                        a = None
            except Exception as exc:  # noqa: BLE001
                print(f"opid-train: an analysis could not be prepared ({type(exc).__name__}: {exc}); no skill "
                      "signal for its trajectory", file=sys.stderr)
                a = None
            out.append(a)
        return out, cut

    def fit_section(self, skill: str, kind: str) -> tuple[str, list]:
        """(skill, token ids of its section) with the section at most section_caps[kind] tokens. A skill already cut
        to analyzer.max_skill_tokens fits; should tokenizer merges at the frame's edges make it longer, the skill is
        cut further (word boundary), so the fork scorer's budget always holds."""
        ids = self.encode_text(render_skill_section(skill, kind))
        cap = self.section_caps[kind]
        if len(ids) > cap:
            from opid_mega.skills.sanitize import cut_to_tokens

            skill, _ = cut_to_tokens(skill, cap, lambda t: len(self.encode_text(render_skill_section(t, kind))))
            ids = self.encode_text(render_skill_section(skill, kind))
        return skill, ids

    def encode_text(self, text: str) -> list:
        """Token ids of a prompt piece (a skill section), tokenized like the rollout prompts' pieces."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def close(self) -> None:
        # colocated: an attached server gets back the memory this run released (Ctrl-C mid-iteration included)
        for closer in (getattr(getattr(self, "colocation", None), "close", None),
                       getattr(self.analyzer, "close", None), getattr(self.analyzer_server, "shutdown", None),
                       getattr(self.log, "close", None), self.audit.close, getattr(self.loop, "close", None),
                       getattr(getattr(self, "env0", None), "close", None)):  # env worker processes end here
            if closer:
                try:
                    closer()
                except Exception:  # noqa: BLE001
                    pass


def train(cfg: Config, run_dir: Optional[str] = None, resume: bool = False, **trainer_kw) -> Path:
    """Build the trainer (`trainer_kw`: Trainer's resume_overrides / config_digest) and run it; the servers it
    launched are shut down however it ends. Ctrl-C raises :class:`TrainingInterrupted` naming the iteration it
    stopped in and the last checkpoint."""
    trainer = None
    try:
        trainer = Trainer(cfg, run_dir, resume, **trainer_kw)
        trainer.fit()
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP (opid_mega.shutdown.Interrupted)
        from opid_mega import shutdown
        from opid_mega.megatron.checkpoint import latest_step

        run = Path(run_dir or cfg.logging.run_dir)
        where = f"in iteration {trainer.current} of {cfg.train.iterations}" if getattr(trainer, "current", 0) \
            else "before the first iteration"
        last = latest_step(run / "checkpoints")
        ckpt = f"last checkpoint {run / 'checkpoints'}/step_{last}" if last is not None else "no checkpoint yet"
        how = f"resume with: opid-train --resume {run}" if last is not None else "nothing to resume: start it again"
        signum = shutdown.signal_of(exc)
        raise TrainingInterrupted(f"{shutdown.describe(signum)} {where}; {ckpt}; {how}", signum) from None
    finally:
        owned = ([trainer.engine] + list(getattr(trainer, "servers", []))) if trainer is not None else []
        shutdown_all([o for o in owned if o is not None])
    return trainer.run_dir


def shutdown_all(owned: list) -> None:
    """shutdown() of each, concurrently (a server takes seconds to stop: one after another, a node's 7 servers would
    not fit the ~30 s between torchrun's or SLURM's SIGTERM and its SIGKILL). Errors are ignored."""
    import threading

    def stop(o):
        try:
            o.shutdown()
        except Exception:  # noqa: BLE001 - stop the others anyway
            pass

    threads = [threading.Thread(target=stop, args=(o,), name="opid-shutdown", daemon=True) for o in owned]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
