"""The OPID training loop (docs/algorithm.md "One training iteration"), top to bottom like slime's train.py.

    set up: config -> run dir (config.yaml) -> Megatron parallel state -> policy (HF dir -> Megatron, optimizer,
            frozen reference copy) -> rollout engine -> env -> analyzer -> scorer -> metrics / audit
    per iteration, stages over one record (opid_mega.experience.Experience, built once from the rollout):
        rollout (opid_mega.pipeline.RolloutStage: B tasks x G trajectories by the AgentLoop, one step-sample per env
            step -> the record; train.max_staleness records in flight) and its analysis in the background
            (opid_mega.pipeline.AnalysisStage: submitted with the rollout, collected by analyzer.deadline_s) while
            the reference log-probs are computed
        experience: routing (algo.route_skills per trajectory, by algo.mode), skill sections fitted and audited
        score with the OLD weights through the Scorer (original context = PPO's old log-probs; skill contexts -> Δ)
        advantages (the C++ batch builder: outcome_advantage by task group, token_advantages A_out + Σ λ_k Δ_k)
        train: Megatron PPO update in mini-batches (train.mini_batch_size step-samples; micro-batches of
            train.micro_batch_tokens packed by the C++ builder, balanced over data-parallel ranks; with
            algo.distill_coef > 0 the skill contexts join them in the fork layout for the distillation loss)
        sync: weights Megatron -> rollout engine
        metrics (a function of the record); evaluation without skills every eval.interval iterations and after the
        last; checkpoint every train.save_interval
Launching servers, the engine and the analyzer: opid_mega.rollout.launch. The files one iteration passes through:
docs/architecture.md "One iteration, file by file".

`grpo` and `opid` share everything (tasks, sampling seeds, mini-batch order) except the λΔ term.
Multi-rank (torchrun, any TP x PP x DP): every rank holds its Megatron shard; rollout, analysis, evaluation, metrics
and the audit log run on global rank 0 and the rollout batch and the analyses are broadcast (`broadcast`).
Resume (`Trainer(..., resume=True)`): model, optimizer, RNG, step and the skill bank come from the last checkpoint;
task draws, sampling seeds and mini-batch order depend only on (train.seed, iteration), so a resumed run repeats
the uninterrupted one.
"""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Optional

import torch

from opid_mega import experience, rundir
from opid_mega.algo.routing import shuffle_analyses
from opid_mega.algo.schedule import learning_rate
from opid_mega.batching.layout import fork_sample_bound
from opid_mega.config import Config, redacted
from opid_mega.experience import Experience, SectionFitter, mean
from opid_mega.infra import files, shutdown
from opid_mega.infra.hosts import run_api_key
from opid_mega.metrics import MetricsLogger, Timer, wandb_settings
from opid_mega.models import load_tokenizer, resolve_model_path
from opid_mega.pipeline import AnalysisStage, RolloutStage, broadcast
from opid_mega.plugins import advantage_function
from opid_mega.rollout.launch import (RolloutEngineDied, build_agent_loop, build_analyzer, build_engine, env_factory,
                                      launch_node_servers)
from opid_mega.scoring.scorer import ForkScorer, NaiveScorer
from opid_mega.skills.audit import AuditLog


class TrainingInterrupted(Exception):
    """Ctrl-C (SIGINT), SIGTERM or SIGHUP during training (`signum`); the message says where it stopped, the last
    checkpoint and how to resume."""

    def __init__(self, message: str, signum: int = 2):  # 2: SIGINT
        super().__init__(message)
        self.signum = int(signum)


def resolve_init(cfg: Config) -> str:
    """The HF directory the policy starts from: model.init_from (an HF dir, or "sft": the cached opid-sft warm start
    of this config, built when missing), else model.path / the built-in model."""

    if cfg.model.init_from == "sft":
        from opid_mega.sft import ensure_sft

        return ensure_sft(cfg)
    if cfg.model.init_from:
        return resolve_model_path(cfg.model.init_from)
    return resolve_model_path(cfg.model.path, cfg.model.builtin, cfg.model.cache_dir)


def divergence_topk(a) -> Optional[int]:
    """The scorer's divergence_topk for an AlgoConfig: None (log-probs only) for the paper's Δ, 0 for full_kl, k for
    topk_kl."""
    return {"sampled": None, "full_kl": 0, "topk_kl": a.delta_topk}[a.delta]


def should_evaluate(cfg: Config, it: int) -> bool:
    """Whether the no-skill evaluation runs after iteration `it` (0: before the first iteration): every
    eval.interval iterations and after the last one (the reference validates at its last step too), before training
    when eval.before_training; never with eval.interval = 0."""
    if not cfg.eval.interval:
        return False
    if it == 0:
        return cfg.eval.before_training
    return it % cfg.eval.interval == 0 or it == cfg.train.iterations


def wait_for_rank0() -> None:
    """Every rank waits for global rank 0 on the control group (opid_mega.megatron.parallel.wait_for_rank0)."""
    from opid_mega.megatron.parallel import wait_for_rank0 as control_barrier

    control_barrier()


def ppo_metrics(ppo: dict, cfg: Config) -> dict:
    keys = ["clipfrac", "kl", "approx_kl", "approx_kl_first", "entropy", "loss", "grad_norm"]
    return {f"ppo/{k}": ppo.get(k) for k in keys + (["distill_kl"] if cfg.algo.distill_coef > 0 else [])}


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
        # megatron-core is imported where it is used, here and below: importing the trainer (opid-eval takes
        # resolve_init from it) does not import it
        from opid_mega.megatron.checkpoint import clean_uncommitted
        from opid_mega.megatron.colocate import Colocation
        from opid_mega.megatron.policy import Policy
        from opid_mega.megatron.weight_sync import WeightSync, gather_servers

        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.logging.run_dir)
        self.ckpt_dir = str(self.run_dir / "checkpoints")
        torch.manual_seed(cfg.train.seed)
        random.seed(cfg.train.seed)

        hf_dir = resolve_init(cfg)
        self.policy = Policy(cfg, hf_dir)  # every rank: Megatron TP/PP/DP
        # Rollout, analysis, evaluation, metrics and the audit log live on global rank 0; the batch is broadcast.
        self.rank0 = torch.distributed.get_rank() == 0
        if config_digest is None:
            saved = self.run_dir / rundir.CONFIG_FILE
            config_digest = rundir.config_digest(rundir.read_saved_config(self.run_dir) if resume and saved.exists()
                                                 else cfg)
        self.config_digest = config_digest
        self.start, resumed = 0, {}
        if resume:  # model, optimizer, RNG and step from the newest complete checkpoint
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
                files.run_id(self.run_dir)  # (a run from before run ids gets one)
                rundir.record_resume(self.run_dir, self.start, list(resume_overrides))
            else:  # a fresh start (the CLI refused a directory holding checkpoints): a new run in this directory
                rundir.write_config(self.run_dir, cfg)
                self.config_digest = rundir.config_digest(cfg)  # exactly what config.yaml now holds
                files.new_run_id(self.run_dir)
                for name in ("audit.jsonl", rundir.OVERRIDES_FILE):  # a predecessor that never saved a checkpoint
                    rundir.move_file_aside(self.run_dir / name)
        self.tokenizer = load_tokenizer(hf_dir)
        self.env0 = env_factory(cfg)()
        # resumed: the records of iterations after the checkpoint are dropped (they are re-run), a torn line cut
        self.audit = AuditLog(self.run_dir / "audit.jsonl" if self.rank0 else None,
                              resume_iteration=self.start if resume else None)
        analyzer, self.analyzer_server = build_analyzer(cfg, self.audit, self.run_dir) if self.rank0 else (None, None)
        self.analysis = AnalysisStage(analyzer, self.audit, cfg.analyzer, lambda t: len(self.encode_text(t)),
                                      self.run_dir)
        # Analyzer output is untrusted: every skill is cut to analyzer.max_skill_tokens tokens (AnalysisStage.cut), so a
        # skill section never exceeds fit_section.caps[kind] tokens, and one step-sample's fork group (the original
        # context and one per section, each at most prompt + section + response) always fits the scoring budget: no
        # analyzer output can make the fork scorer refuse a sample.
        self.fit_section = SectionFitter(self.encode_text, cfg.analyzer.max_skill_tokens)
        fork_budget = max(cfg.train.micro_batch_tokens,
                          fork_sample_bound(cfg.rollout.max_prompt_tokens, cfg.rollout.max_response_tokens,
                                            list(self.fit_section.caps.values())))
        # every context is scored at the sampling temperature (old log-probs and Δ as the sampler saw them)
        # algo.delta = full_kl / topk_kl: the fork scorer also returns each skill context's divergences (one pass)
        self.scorer = ForkScorer(self.policy.packed_logprobs, fork_budget, temperature=cfg.rollout.temperature,
                                 divergence_topk=divergence_topk(cfg.algo)) \
            if cfg.scoring.scorer == "fork" else NaiveScorer(self.policy.logprobs, temperature=cfg.rollout.temperature)
        self.advantage_fn = advantage_function(cfg.algo.advantage_fn)  # the advantages stage (every rank)
        self.current = 0  # the iteration in progress (0: none yet)
        if resume:  # the checkpoint's trainer state (loaded above)
            self.analysis.failures = resumed.get("analysis_failures", 0)
        # colocated on GPU: a resumed optimizer's Adam moments go to the host before the rollout servers start
        # (SGLang sizes its KV cache from the memory free then, as opid-plan assumes; during rollout they are on the
        # host anyway, see Colocation)
        if resume and cfg.deploy.mode == "colocated" and cfg.deploy.offload_optimizer and torch.cuda.is_available():
            Colocation(cfg, self.policy, None).before_sync()
        # every node's first rank launches that node's rollout servers; global rank 0 drives all of them
        # one random API key per run for every server and the router it launches (rank 0 draws it; it travels only
        # over the control group and into the servers through a pipe: opid_mega.infra.keyed), the servers bound to
        # the node's cluster address (deploy.bind_host)
        self.api_key = broadcast(run_api_key)
        self.servers = launch_node_servers(cfg, hf_dir, self.api_key) \
            if int(os.environ.get("LOCAL_RANK", "0")) == 0 else []
        self.server_map = gather_servers(cfg, self.servers)
        urls = [srv["url"] for srv in self.server_map["servers"]]
        self.engine = build_engine(cfg, hf_dir, self.servers, urls, api_key=self.api_key) if self.rank0 else None
        self.loop = build_agent_loop(cfg, self.engine, self.tokenizer, hf_dir) if self.rank0 else None
        wait_for_rank0()  # rank 0 may have spent minutes launching servers
        self.weight_sync = WeightSync(self.policy, self.engine, cfg, str(self.run_dir), self.tokenizer,
                                      servers=self.server_map, own=self.servers, api_key=self.api_key)
        self.colocation = Colocation(cfg, self.policy, self.engine)  # no-op unless colocated on GPU
        # the rollout stage: records drawn and analysed, train.max_staleness of them in flight (disaggregated engines
        # play the next ones beside the update), the evaluation
        self.rollouts = RolloutStage(cfg, self.loop, self.env0, self.analysis, self.audit, self.colocation, self.rank0)
        if resume:
            self.rollouts.skill_bank.update(resumed.get("skill_bank", {}))
            self.rollouts.restore(resumed.get("in_flight"))
            self.sync_weights(self.start)
        # the resolved config (secrets emptied) goes to TensorBoard (text + hparams) and W&B (wandb.init(config=))
        self.log = MetricsLogger(self.run_dir, tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress,
                                 desc=cfg.algo.mode,  # the progress bar names the run's mode (grpo, opid, ...)
                                 total=cfg.train.iterations, resume_step=self.start if resume else None,
                                 config=redacted(cfg), wandb=wandb_settings(cfg.logging, self.run_dir)) \
            if self.rank0 else None

    @property
    def analyzer(self):
        return getattr(getattr(self, "analysis", None), "analyzer", None)

    @analyzer.setter
    def analyzer(self, analyzer) -> None:
        self.analysis.analyzer = analyzer

    # ---- the loop -----------------------------------------------------------------------------------------------
    def fit(self) -> None:
        cfg = self.cfg
        try:
            if self.start == 0 and should_evaluate(cfg, 0) and self.rollouts.eval_tasks and self.rank0:
                self.log.log(0, self.rollouts.evaluate(0))
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
                if should_evaluate(cfg, it) and self.rollouts.eval_tasks and self.rank0:
                    metrics.update(self.rollouts.evaluate(it))
                if self.rank0:
                    self.log.log(it, metrics)
                wait_for_rank0()  # before the checkpoint's collectives: rank 0 may have been evaluating
                if cfg.train.save_interval and (it % cfg.train.save_interval == 0 or it == cfg.train.iterations):
                    self.policy.save(self.ckpt_dir, it, {"skill_bank": self.rollouts.skill_bank,
                                                         "analysis_failures": self.analysis.failures,
                                                         "in_flight": self.rollouts.state()},
                                     meta={"config": json.dumps(self.config_digest)})
        finally:
            self.close()

    def iteration(self, it: int) -> dict:
        """One iteration as its stages over one record (opid_mega.experience; docs/architecture.md)."""
        cfg, timer, t0 = self.cfg, Timer(), time.perf_counter()
        with timer("rollout"):  # this iteration's rollout and, with train.max_staleness N, those of the next N
            took = self.rollouts.take(it)  # disaggregated: the next rollouts then play while this one trains
        # the analysis runs in the background (since the rollout) while the next rollouts and the reference log-probs
        exp, views, pending = took.exp, took.views, took.pending
        with timer("reference"):
            if self.policy.reference:  # the original contexts, packed and scored like the old log-probs
                with self.policy.reference_weights():
                    experience.reference(exp, self.scorer)
        with timer("analysis_wait"):
            analyses = broadcast(lambda: self.analysis.collect(pending, views, it))
        with timer("scoring"):
            self.add_skills(exp, analyses)
            experience.score(exp, self.scorer, cfg.algo.delta)
        self.advantage_fn(exp, cfg.algo)  # algo.advantage_fn, default experience.advantages
        experience.check_advantages(exp, cfg.algo.advantage_fn)
        # whatever train.max_staleness is now: a resume may train on records in flight drawn under a larger bound
        experience.off_policy(exp, cfg.train.off_policy_correction, cfg.train.behavior_weight_cap)
        if cfg.logging.dump_advantages and self.rank0:
            with open(self.run_dir / "advantages.jsonl", "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in experience.advantage_records(exp))
        with timer("update"):
            lr = learning_rate(cfg.train, it)
            self.policy.set_lr(lr)
            ppo = self.policy.train(self.train_data(exp), seed=cfg.train.seed * 31 + it)
        if self.rollouts.queue.overlap:
            with timer("rollout_wait"):  # never a weight sync while an engine generates
                self.rollouts.land()
        with timer("weight_sync"):
            self.colocation.before_sync()
            sync = self.sync_weights(it)
        return {**experience.metrics(exp, elapsed=time.perf_counter() - t0), **self.analysis_metrics(exp),
                **ppo_metrics(ppo, cfg), "train/lr": lr, **sync,
                **(self.engine.stats() if hasattr(self.engine, "stats") else {}), **timer.pop()}

    # ---- stages -------------------------------------------------------------------------------------------------
    def add_skills(self, exp: Experience, analyses: list) -> None:
        """The experience stage: the analyses routed to the step-samples, their sections fitted and audited
        (algo.skill_source=shuffled: the negative control's analyses of other tasks); the skill bank keeps each
        task's latest episode skill (skill_grpo rollouts, evaluation with skills)."""
        cfg = self.cfg
        if cfg.algo.skill_source == "shuffled":
            analyses = shuffle_analyses([t.group_id for t in exp.trajectories], analyses,
                                        seed=cfg.train.seed * 65_537 + exp.iteration)
        if cfg.algo.mode == "skill_grpo" or cfg.eval.with_skills:
            for t, an in zip(exp.trajectories, analyses):
                if an is not None:
                    self.rollouts.skill_bank[t.task_id] = an.episode_skill  # t.task_id == pipeline.skill_key(its task)
        experience.add_skills(exp, analyses, cfg.algo, self.fit_section, self.audit,
                              max_prompt_tokens=cfg.rollout.max_prompt_tokens)

    def train_data(self, exp: Experience):
        """The policy's view of the record: sequences, response lengths, old log-probs, advantages, reference
        log-probs and (algo.distill_coef > 0) the skill contexts as the distillation's teacher."""
        from opid_mega.megatron.policy import TrainData

        skills = exp.skill_columns() if self.cfg.algo.distill_coef > 0 else {}
        adv = exp.token_advantages if exp.behavior_weights is None else exp.token_advantages * exp.behavior_weights
        values = {"old_logprobs": exp.old_logprobs, "advantages": adv}
        if exp.ref_logprobs is not None:
            values["ref_logprobs"] = exp.ref_logprobs
        data = TrainData(exp.tokens, exp.seq_offsets, exp.resp_lens, values, **skills)
        if self.cfg.train.balance_ranks:  # the reference's token-balanced mini-batch composition
            data = data.subset(experience.minibatch_order(exp, self.cfg.train.balance_ranks,
                                                          self.cfg.train.mini_batch_size))
        return data

    def analysis_metrics(self, exp: Experience) -> dict:
        on, a = self.cfg.algo.needs_analysis, self.analysis
        analyzed = [x for x in exp.analyses if x is not None]
        return {"analysis/critical_steps_per_traj": mean(len(x.step_skills) for x in analyzed) if analyzed else None,
                "analysis/failure_rate": (len(exp.analyses) - len(analyzed)) / len(exp.analyses) if on else None,
                "analysis/failures_total": a.failures,
                "analysis/deadline_failures": a.deadline_failures if on else None,
                "analysis/skills_truncated": a.skills_truncated if on else None,
                "scoring/tokens": exp.scored_tokens}

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

    def encode_text(self, text: str) -> list:
        """Token ids of a prompt piece (a skill section), tokenized like the rollout prompts' pieces."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def close(self) -> None:
        # colocated: an attached server gets back the memory this run released (Ctrl-C mid-iteration included)
        # a rollout still playing in the background is asked to stop first (it uses the engines and the env workers)
        # and given seconds, never its deadline: every closer below runs, whatever it does
        for closer in (getattr(getattr(self, "rollouts", None), "close", None),
                       getattr(getattr(self, "colocation", None), "close", None),
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
        from opid_mega.megatron.parallel import stop_heartbeat

        stop_heartbeat()  # done: the other ranks do not count this one as lost while they finish
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP (opid_mega.infra.shutdown.Interrupted)
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
