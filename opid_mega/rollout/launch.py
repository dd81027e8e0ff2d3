"""Launching what a run serves from: this node's rollout servers, the rollout engine rank 0 drives (one server, a
fleet behind our client balancer, or SGLang's router), the agent loop over it and the envs, and the analyzer (rules,
a plug-in, or an LLM behind an OpenAI-compatible server this run may launch). Called by the trainer and by opid-eval
(a rollout is played by opid_mega.pipeline.play)."""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Optional

import torch

from opid_mega.config import Config
from opid_mega.models import BUILTIN_MODELS


class RolloutEngineDied(RuntimeError):
    """The rollout engine failed; the trainer's message names the iteration and the last checkpoint."""


def env_factory(cfg: Config):
    from opid_mega.envs import env_factory as factory

    return factory(cfg.env)


def build_agent_loop(cfg: Config, engine, tokenizer, hf_dir: str):
    from opid_mega.rollout.agent_loop import AgentLoop

    return AgentLoop(engine, tokenizer, env_factory=env_factory(cfg), history_length=cfg.env.history_length,
                     num_workers=cfg.env.num_workers, max_prompt_tokens=cfg.rollout.max_prompt_tokens,
                     enable_thinking=cfg.model.enable_thinking, model_path=hf_dir,
                     step_timeout_s=cfg.env.step_timeout_s)


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
    from opid_mega.infra.hosts import bind_host, run_api_key

    # bound like the rollout servers (deploy.bind_host), with the run's key (random unless $OPID_SGLANG_API_KEY;
    # the analyzer client sends it)
    return SGLangEngine(cfg.analyzer.model, server_args=args, log_dir=str(run_dir / "sglang_analyzer"),
                        python=python, env=env, cpus=list(cfg.deploy.server_cpus) or None,
                        host=bind_host(cfg.deploy.bind_host), api_key=run_api_key())


def build_analyzer(cfg: Config, audit, run_dir: Path, launch=launch_analyzer_server):
    """(analyzer or None, the analyzer server this run launched or None). backend=llm with an empty
    analyzer.base_url launches `launch(cfg, run_dir)` (a server with .url and .shutdown()); else it attaches.
    An import path "package.module:Class" builds that opid_mega.skills.Analyzer subclass with analyzer.options
    (opid_mega.skills.plugins.build_analyzer; the protocol: docs/custom_env.md)."""
    if not cfg.algo.needs_analysis:
        return None, None
    a = cfg.analyzer
    if a.backend == "rules":
        from opid_mega.skills import RuleAnalyzer

        return RuleAnalyzer(max_step_skills=a.max_step_skills), None
    from opid_mega.plugins import is_import_path

    if is_import_path(a.backend):
        from opid_mega.skills.plugins import build_analyzer as build_plugin

        return build_plugin(a), None
    if not a.base_url and a.model in BUILTIN_MODELS:  # e.g. smollm2-135m: the offline model, built once and cached
        from opid_mega.models import prepare_model

        a = dataclasses.replace(a, model=prepare_model(a.model))
        cfg = dataclasses.replace(cfg, analyzer=a)
    server = None if a.base_url else launch(cfg, run_dir)
    base_url = a.base_url or server.url + "/v1"
    try:
        # a launched server's own key (Authorization: Bearer), else analyzer.api_key / $analyzer.api_key_env
        analyzer = llm_analyzer(a, base_url, cache_path=a.cache_path or run_dir / "analysis_cache.jsonl", audit=audit,
                                api_key=getattr(server, "api_key", None) if server is not None else None)
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


def llm_analyzer(a, base_url: Optional[str] = None, cache_path=None, audit=None, api_key: Optional[str] = None,
                 sglang: Optional[bool] = None):
    """An LLMAnalyzer from analyzer.* (`a`, an AnalyzerConfig) at `base_url` (default analyzer.base_url); `api_key`
    overrides the resolved analyzer.api_key / $analyzer.api_key_env (e.g. a launched server's own key)."""
    from opid_mega.config import analyzer_response_format, resolve_api_key
    from opid_mega.skills.llm_analyzer import LLMAnalyzer

    url = base_url or a.base_url
    if not url:
        raise ValueError("analyzer.base_url is empty: launch an OpenAI-compatible server first and pass its URL")
    return LLMAnalyzer(url, model=a.model, api_key=api_key or resolve_api_key(a), concurrency=a.concurrency,
                       timeout_s=a.timeout_s, stall_timeout_s=a.stall_timeout_s, max_retries=a.max_retries,
                       backoff_s=a.backoff_s, backoff_max_s=a.backoff_max_s, temperature=a.temperature,
                       max_tokens=a.max_tokens, response_format=analyzer_response_format(a), parser=a.parser,
                       max_step_skills=a.max_step_skills, gamma=a.gamma, cache_path=cache_path, audit=audit,
                       sglang=sglang, max_tokens_field=a.max_tokens_field, max_in_flight=a.max_in_flight)


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
    bind and advertise the node's address by deploy.bind_host (opid_mega.infra.hosts) and take `api_key` (the run's)."""
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
    from opid_mega.infra.hosts import bind_host

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
    from opid_mega.infra.hosts import API_KEY_ENV, bind_host, run_api_key

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
