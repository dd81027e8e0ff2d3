"""Typed run configuration: dataclasses, YAML files, dotted CLI overrides, validation.

    cfg = load_config("configs/tiny_cpu.yaml", ["algo.lambda_episode=0.001", "parallel.tp=2"])

Every key is declared below; an unknown key, a value of the wrong type, or a value outside its allowed set is a
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
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml


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
# Sections
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    # A Hugging Face model directory (config.json + safetensors + tokenizer). Empty: build `builtin`.
    path: str = ""
    # A model built offline by tools/prepare_models.py when `path` is empty.
    builtin: Literal["tiny-qwen3", "tiny-qwen2", "tiny-llama", "smollm2-135m", "tiny-qwen3-footprints"] = "tiny-qwen3"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Where built models are cached.
    cache_dir: str = "~/.cache/opid_mega/models"
    # Start from this HF directory instead of `path`; `sft`: the opid-sft warm start of this config (the `sft`
    # section, on expert walkthroughs of env.train_split), built on first use and cached under
    # `<cache_dir>/sft-<hash of its inputs>`; `shipped:NAME`: a warm start shipped with the package
    # (opid_mega/data/warm_starts/NAME; `shipped:footprints`: the footprints main job's).
    init_from: str = ""
    # Chat template switch for Qwen3-style templates (the paper runs Qwen3 with thinking off). Used identically by the
    # rollout prompts, evaluation and the opid-sft warm-start data (part of its cache key).
    enable_thinking: bool = False


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual pipeline stages per rank (interleaved schedule when > 1)
    # Megatron sequence parallelism (needs tp > 1): activations outside attention/MLP are split over the TP ranks.
    sequence_parallel: bool = False
    # Context parallelism: not supported; any value but 1 is rejected (kept so that configs can say so explicitly).
    cp: int = 1
    # torch.distributed backend: auto = nccl on a GPU machine, gloo without one (nccl without a GPU is an error).
    backend: Literal["auto", "nccl", "gloo"] = "auto"


@dataclass
class EnvConfig:
    # textworld | alfworld | search_qa | webshop, or a plug-in: an import path "package.module:Class" naming a subclass
    # of opid_mega.envs.Env (importable: PYTHONPATH or an installed package; docs/custom_env.md)
    name: str = "textworld"
    max_steps: int = 30
    history_length: int = 5
    # Step-prompt templates (opid_mega/envs/prompts.py): reference = the reference's shapes (ALFWorld/TextWorld step 0
    # without a task line of its own, the task ending the first observation; actions joined by a newline and a space;
    # WebShop's own closing paragraph); ours = this project's earlier templates (task line at every step, ", "
    # joins), which the first CPU experiment used
    template: Literal["reference", "ours"] = "reference"
    # Backend-specific options passed to opid_mega.envs.make_env(name, **options), i.e. to the env class's
    # constructor (plus make_env's `process` and, in a worker process, `start_method` / `timeout`); checked against
    # the constructor's signature when the config is loaded (a constructor with **kwargs accepts any option).
    options: dict = field(default_factory=dict)
    train_split: str = "train"
    eval_split: str = "test"
    num_workers: int = 8  # environments stepped in parallel threads (the AgentLoop's thread pool)
    # Deadline of each env reset/step; past it the trajectory ends as an env error (rollout/env_errors) and the loop
    # moves on. TextWorld/ALFWorld run in worker processes by default: the worker is killed, the slot's next reset
    # runs in a fresh one. `options: {process: false}` keeps an env in-process (the stuck call is left in a thread).
    step_timeout_s: float = 60.0


@dataclass
class RolloutConfig:
    engine: Literal["local", "sglang"] = "local"
    # Attach to a running SGLang server instead of launching one.
    sglang_url: str = ""
    # Extra `python -m sglang.launch_server` arguments, passed through verbatim.
    sglang_args: list = field(default_factory=list)
    tasks_per_iter: int = 16  # B
    group_size: int = 8  # G
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompt_tokens: int = 2048
    max_response_tokens: int = 512
    # Deadlines (docs/runs.md "Deadlines"). request_timeout_s: one HTTP generate request to an SGLang server (or the
    # router) that gets no reply in this time is a server failure, never retried on that server: in a fleet the
    # server leaves rotation like a dead one and its prompts go to the others; a lone server ends the run
    # (RolloutEngineDied). deadline_s: the whole rollout of one iteration (and each evaluation rollout); when it
    # passes, the trajectories still running end as deadline failures (left out like env errors, counted in
    # rollout/deadline_trajectories) and the finished ones train; none finished ends the run (RolloutEngineDied).
    # Sizing for the paper configs (configs/qwen*.yaml, GPU decode): a step is one generate call of up to 128
    # (16x8) or 1024 (128x8) prompts x <= 512 new tokens. A fleet sends chunks of <= 64 prompts and keeps <= 256
    # prompts in flight per server: a chunk waits for at most 256 x 512 = 131k tokens of its server, ~2 min at a
    # conservative 1,000 tok/s (an H100 serving 1.7B-7B decodes several thousand tok/s at batch >= 64); a lone
    # server takes a whole step in one request: 128 x 512 = 65k tokens (~1 min), 1024 x 512 = 524k tokens (~9 min
    # at 1,000 tok/s, ~3 min at 3,000). 600 s covers these with margin and still finds a wedged server in 10 min.
    # A rollout is <= 30 steps (ALFWorld; WebShop 15, Search-QA 4 of 1024 prompts): 30 x ~20 s (128 prompts over
    # 2 servers) or 4 x ~4.5 min (1024 prompts) = ~10-20 min plus env time; 7200 s leaves room for that x 5 and for
    # one wedged server found after request_timeout_s and its prompts re-sent. The CPU configs (local engine, or a
    # tiny model on a CPU SGLang server: a step of <= 8 prompts x <= 64 tokens at >= 20 tok/s, < 30 s) fit both.
    request_timeout_s: float = 600.0
    deadline_s: float = 7200.0


@dataclass
class AnalyzerConfig:
    # rules | llm, or a plug-in: an import path "package.module:Class" naming a subclass of opid_mega.skills.Analyzer,
    # built as Class(**analyzer.options) (docs/custom_env.md, "Analyzer plug-ins")
    backend: str = "rules"
    # Keyword arguments of a plug-in analyzer's constructor (checked against its signature at load); {} otherwise.
    # A constructor with a max_step_skills parameter also gets analyzer.max_step_skills unless options set it.
    options: dict = field(default_factory=dict)
    # OpenAI-compatible endpoint. Empty with backend=llm: the trainer launches an SGLang server for `model`
    # (opid_mega.rollout.sglang_engine's launcher, endpoint <url>/v1) and shuts it down at the end of the run.
    base_url: str = ""
    # The analyzer model: the served model's name, or for a launched server an HF directory, a hub name, or one of
    # the built-in offline models (opid_mega.models.BUILTIN_MODELS, e.g. smollm2-135m: built once and cached).
    model: str = ""
    # Extra `python -m sglang.launch_server` arguments for that launched analyzer server, passed through verbatim.
    sglang_args: list = field(default_factory=list)
    # The endpoint's API key (resolve_api_key): a non-empty api_key is used as given ("EMPTY" included: what local
    # SGLang/vLLM servers expect); empty, the environment variable named by api_key_env is read at run time; neither
    # set: "EMPTY". The key is a secret: dump_config (config.yaml, `python -m opid_mega.config`) writes api_key as ""
    # and logged command lines show it as ***, so a resumed run needs the variable (or the override) again.
    api_key: str = ""
    api_key_env: str = "OPENAI_API_KEY"
    max_step_skills: int = 5  # K (ALFWorld/WebShop 5, Search 2)
    gamma: float = 0.95
    concurrency: int = 16  # the analyzer's worker threads: trajectories analysed at once
    # At most this many HTTP requests open at once to the endpoint (one limit per base_url, shared by every analyzer
    # of the process: training and evaluation): a hosted endpoint's rate limit. 0: no limit beyond concurrency. A
    # slot is held only while a request is open, never through a backoff or Retry-After wait.
    max_in_flight: int = 0
    # Replies are streamed; a request with no new token for stall_timeout_s (the wait for the first token included)
    # is given up, aborted on the server (SGLang: /abort_request with its rid) and retried. timeout_s: an optional cap
    # on one whole reply (null: none; the start-up probe warns when it is shorter than a max_tokens reply).
    stall_timeout_s: float = 120.0
    timeout_s: Optional[float] = None
    # The reference's retry policy: 1 + max_retries attempts (5 in all), every error retried (an empty reply too),
    # waits backoff_s x 2^(r-1) capped at backoff_max_s (1, 2, 4, 8 s). A 429 or 503 with a Retry-After header
    # (seconds or an HTTP date) waits what it asks instead, capped at backoff_max_s; one that would end past
    # deadline_s ends that analysis at once as a deadline failure.
    max_retries: int = 4
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    # Sampling as the reference: temperature null = not sent (the server's default), no response format. Ours:
    # temperature 0.0, response_format json_object (JSON mode) or json_schema (the analysis schema).
    temperature: Optional[float] = None
    response_format: Literal["none", "json_object", "json_schema"] = "none"
    # Deprecated alias of response_format (kept so older config.yaml files still load): true = json_object,
    # false = none; null (default): unused. Setting it together with a response_format other than none is an error.
    json_mode: Optional[bool] = None
    # Reply parsing: reference (its edge cases: null step values -> "None", the last duplicate key wins, int() keys,
    # str() of a non-string episode_skill, python-literal fallback only without any JSON object) or ours (stricter:
    # opid_mega/skills/parser.py).
    parser: Literal["reference", "ours"] = "reference"
    max_tokens: int = 4096  # the analyzer's completion budget, as in the reference
    # The request field that carries max_tokens (the start-up probe's too): max_tokens (the reference's; SGLang,
    # vLLM) or max_completion_tokens (OpenAI's newer models reject max_tokens; some servers know only max_tokens).
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
    # The run stops (one line, exit 3) after this many iterations in a row in which every analysis failed (0: never)
    max_failed_iterations: int = 3
    # Skills (episode and step) longer than this many tokens of the policy tokenizer are cut at a word boundary
    # (metric analysis/skills_truncated); the fork scorer's budget is derived from it (docs/runs.md "Untrusted analyzer output")
    max_skill_tokens: int = 256
    # On-disk analysis cache (JSONL, keyed by the trajectory text); empty: <run_dir>/analysis_cache.jsonl.
    cache_path: str = ""
    # Deadline of one iteration's analysis, from its submission (docs/runs.md "Deadlines"): the analyses not done
    # by then are failures (no skill signal, counted in analysis/deadline_failures and analysis/failures_total,
    # audited) and the iteration goes on. Sizing for the paper configs: 128 (or 1024) calls, concurrency 64 (128),
    # one reply <= max_tokens 4096; typical replies of a few hundred tokens take ~10-40 s on a GPU server, so 2 (8)
    # waves take minutes; a stalled request is given up after stall_timeout_s and retried (at most 5 attempts and
    # 15 s of backoff). 3600 s covers several slow waves and bounds an iteration whose analyzer answers nothing.
    deadline_s: float = 3600.0


@dataclass
class AlgoConfig:
    mode: Literal["opid", "grpo", "no_routing", "no_episode_skill", "no_step_skill", "skill_grpo"] = "opid"
    lambda_episode: float = 0.001
    lambda_step: float = 0.001
    outcome_mode: Literal["mean_std_norm", "mean_norm"] = "mean_std_norm"
    placement: Literal["faithful", "late"] = "faithful"
    invalid_penalty: float = 0.1
    delta_normalize: bool = False
    delta_clip: Optional[float] = None
    # the token-level skill signal added with λ (docs/algorithm.md "Beyond the sampled token"): sampled = the paper's
    # Δ = log p_s(y) - log p_o(y); full_kl / topk_kl = Δ + KL(p_o || p_s) (exact / top-k), its conditional mean removed
    delta: Literal["sampled", "full_kl", "topk_kl"] = "sampled"
    delta_topk: int = 32  # k of topk_kl: the top-k ids of p_s, plus one bucket for the rest
    # weight of the distillation loss KL(p_o || p_s) through the original context, on skill-routed tokens (0: off)
    distill_coef: float = 0.0
    # an augmented prompt longer than rollout.max_prompt_tokens: false = scored whole (ours: every skill context keeps
    # the prompt's start, chat header and task included); true = left-truncated to its last max_prompt_tokens tokens
    # after the section is inserted, as the reference does
    truncate_skill_context: bool = False
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = 3.0
    # PPO loss aggregation (all four work, in opid_mega.algo.agg_loss and the Megatron loss alike):
    # token-mean-micro = the reference's: the token mean of each micro-batch, averaged over the micro-batches of all
    #   data-parallel ranks (= per-rank mean divided by the gradient-accumulation count, averaged over the ranks);
    #   the paper configs use it. The result depends on how step-samples fall into micro-batches.
    # token-mean = ours (the default): one token mean over the whole mini-batch across ranks, independent of the
    #   micro-batch and data-parallel layout. seq-mean-token-sum / seq-mean-token-mean: per sequence sum / mean,
    #   then the mean over the mini-batch's sequences.
    loss_agg: Literal["token-mean", "token-mean-micro", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    # PPO log-ratio clamp: null = not clamped (the reference); c > 0 clamps log(π/π_old) to ±c before exp
    log_ratio_clamp: Optional[float] = None
    kl_coef: float = 0.01
    kl_kind: Literal["low_var_kl", "k1", "k2", "mse"] = "low_var_kl"
    entropy_coef: float = 0.001
    # Whose analysis a trajectory's skills come from: own = its own (OPID); shuffled = the mechanism experiment's
    # negative control: every trajectory of task i gets the analysis of a trajectory of another task of the same batch
    # (the batch's tasks in a seeded random cycle), so the skills are fluent but carry no hindsight about this episode.
    skill_source: Literal["own", "shuffled"] = "own"
    # The skill term's bound (docs/algorithm.md "Stability"): in every GRPO group, Σ|λΔ| over its tokens is scaled
    # down to at most skill_share_cap x Σ|A_out|, so a group whose scores all tie (A_out = 0) trains on no skill term
    # and no optimizer step is driven by λΔ alone. null: no bound (the reference; the paper configs keep it).
    skill_share_cap: Optional[float] = 1.0
    # The advantage and policy-loss functions, as import paths "package.module:function" (docs/custom_algo.md):
    # advantage_fn(exp, algo_cfg) fills exp.a_out and exp.token_advantages of the iteration's record; loss_fn is
    # called like opid_mega.algo.ppo_policy_loss by the Megatron loss on every rank. The defaults are the built-ins.
    advantage_fn: str = "opid_mega.experience:advantages"
    loss_fn: str = "opid_mega.algo.loss:ppo_policy_loss"

    # The mode decides routing and which skill types carry signal (docs/algorithm.md §4 "Critical-first routing"); routing is
    # also gated by λ as in the reference: lambda_step=0 routes like mode=no_step_skill, lambda_episode=0 like
    # mode=no_episode_skill (algo.route_skills).
    @property
    def routing(self) -> str:
        return "additive" if self.mode == "no_routing" else "step_priority"

    @property
    def use_episode(self) -> bool:
        return self.mode != "no_episode_skill"

    @property
    def use_step(self) -> bool:
        return self.mode != "no_step_skill"

    @property
    def needs_analysis(self) -> bool:
        return self.mode != "grpo"


@dataclass
class TrainConfig:
    iterations: int = 160
    lr: float = 1e-6
    # constant: train.lr at every iteration. warmup (the reference's Search-QA scripts): linear warm-up over the
    # first W = int(lr_warmup_ratio * iterations) iterations, then constant; iteration it (1-based) trains with
    # lr * min(1, (it - 1) / W), the reference's constant-with-warm-up schedule stepped once per iteration.
    lr_scheduler: Literal["constant", "warmup"] = "constant"
    lr_warmup_ratio: float = 0.0  # fraction of train.iterations (warmup only)
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0
    mini_batch_size: int = 256  # step-samples per optimizer step
    # Mini-batches are not shuffled, as the reference's: in rollout order (trajectory by trajectory, each trajectory's
    # steps in order), or in the reference's token-balanced order with train.balance_ranks; true: a seeded shuffle of
    # the step-samples before each PPO epoch (this project's earlier default)
    shuffle_minibatches: bool = False
    micro_batch_tokens: int = 8192  # token budget per packed micro-batch
    # Step-samples per micro-batch of the reference's loss aggregation (algo.loss_agg=token-mean-micro only; the paper's
    # 32 ALFWorld / 8 WebShop / 16 Search-QA): the mini-batch's step-samples in order, that many per micro-batch,
    # each micro-batch's token mean averaged over them, independent of the packing above. 0: the packed micro-batches
    # are the loss's micro-batches.
    micro_batch_size: int = 0
    # The reference's batch padding: N > 0 appends copies of randomly drawn distinct step-samples (seeded by
    # train.seed and the iteration) until their count is a multiple of N, before the advantage, so the copies enter
    # their group's statistics and the loss (the reference pads to a multiple of its micro-batch size x 8 GPUs: 256
    # ALFWorld and Search-QA, 128 WebShop). 0: no copies (ours: every step-sample counts once).
    pad_multiple: int = 0
    # The reference's mini-batch composition (its balance_batch): N > 0 balances the step-samples' tokens over N
    # equal-size partitions (its data-parallel ranks: 8 GPUs) and mini-batch j takes the j-th slice of
    # mini_batch_size / N samples of every partition; needs train.pad_multiple a multiple of N. 0: rollout order.
    balance_ranks: int = 0
    ppo_epochs: int = 1
    seed: int = 1
    save_interval: int = 10
    # Checkpoints kept on disk (the newest N; older ones are deleted after each save); 0 keeps every checkpoint.
    keep_checkpoints: int = 2
    use_reference: bool = True  # compute reference log-probs for the KL term (kl_coef > 0)
    # megatron-core's distributed optimizer: optimizer state (and the fp32 main weights) sharded over the data-parallel
    # ranks, gradients reduce-scattered instead of all-reduced. Works on gloo (CPU) and NCCL.
    distributed_optimizer: bool = False
    # Overlap the data-parallel gradient reduce with the backward (buckets are reduced as their gradients are ready).
    overlap_grad_reduce: bool = False
    # Activation recompute in the PPO update (megatron-core's names): none | selective (the core attention of every
    # layer is recomputed in the backward) | full (every transformer layer is recomputed from its input: uniform,
    # one layer per checkpoint). Saves activation memory at the cost of a second forward; same gradients.
    recompute: Literal["none", "selective", "full"] = "none"
    # Bounded staleness (docs/algorithm.md "Bounded staleness"): 0 = on-policy, every rollout drawn with the weights
    # just trained. N > 0: the rollouts of the next N iterations are drawn before this one trains (with the weights
    # the engines hold), so this iteration's analysis waits while they run; a sample is trained on at most N weight
    # versions after the one that drew it.
    max_staleness: int = 0
    # The correction for stale samples: decoupled (their policy-gradient term weighted by min(π_prox / π_behaviour,
    # behavior_weight_cap), π_prox the current weights that rescore them, π_behaviour the engines' log-probs) or
    # none (the PPO ratio against the rescored log-probs only). On-policy samples are never weighted.
    off_policy_correction: Literal["decoupled", "none"] = "decoupled"
    behavior_weight_cap: float = 2.0


@dataclass
class SftConfig:
    """opid-sft (the `model.init_from: sft` warm start): token-mean NLL on expert walkthrough step-samples."""

    epochs: int = 60
    lr: float = 2e-3
    mini_batch_size: int = 64  # step-samples per optimizer step
    # The <think> text of every target response; `{action}` is replaced by the expert action.
    think: str = "I will {action}."
    # Share of the expert step-samples that appear a second time with a skill section in the prompt (same target):
    # the RuleAnalyzer's analysis of that expert trajectory, routed critical-first (step skill at its critical steps,
    # else the episode skill), placed faithful or late at random (seeded), so the warm start learns that sections
    # are informative. 0: no sections (and no change to the warm start's cache key).
    skill_share: float = 0.0
    # The skill-reading warm start of the mechanism experiment (docs/experiments.md): at the step where the env offers
    # its one critical decision (env.decision_options(), e.g. the footprints hall's five doors) the target is NOT the
    # expert's action: without a section, each option once (a uniformly random choice: blind to the cue); with a
    # section naming option X (the analyzer's decision_sections(X, options): every skill format, faithful or late
    # placement at random), X. The env and the analyzer (a plug-in's) must provide those two methods.
    blind_decision: bool = False
    # With blind_decision: this many extra no-section samples per decision whose target is the expert's choice (the
    # option the task's own cue names), so the warm start leans toward the cue without being sure of it: on its
    # training data the cue's option is the target with probability (1 + k) / (n + k) for n options (footprints,
    # k = 1: 1/3 instead of 1/5). 0: blind to the cue (and no change to the warm start's cache key).
    decision_cue_copies: int = 0


@dataclass
class EvalConfig:
    interval: int = 10  # iterations between evaluations (0: never); also after the last iteration (the reference's)
    before_training: bool = True  # also evaluate before the first iteration (when interval > 0)
    num_tasks: int = 32
    temperature: float = 0.4
    # Also evaluate WITH skills (always on for skill_grpo): each eval task is played a second time with the episode
    # skill the analyzer wrote from that task's own no-skill eval trajectory (no skill if that analysis failed).
    with_skills: bool = False


@dataclass
class ScoringConfig:
    scorer: Literal["naive", "fork"] = "naive"
    # Backend of opid_mega.kernels (fused log-prob, fork attention) in the Megatron path: auto = Triton on GPU, torch on
    # CPU; triton on CPU needs TRITON_INTERPRET=1 (slow, for testing). Reaches the kernels as the Megatron model's
    # `kernel_backend` argument (opid_mega.megatron.model.build_model), on every rank.
    kernel_backend: Literal["auto", "triton", "torch"] = "auto"


@dataclass
class DeployConfig:
    """Where every process runs (docs/multi-node.md; `opid-plan` checks it against the model and the cluster).

    GPU ids are local to a node. Rollout servers are launched per node by the node's first trainer rank (the same
    `rollout_gpus` on every node); the analyzer server (when the trainer launches one) runs on node 0."""

    # colocated: rollout engines on the training GPUs; between phases SGLang releases its weights and KV cache
    # (memory saver) and the optimizer state goes to host memory during rollout. disaggregated: engines on own GPUs.
    mode: Literal["colocated", "disaggregated"] = "colocated"
    nodes: int = 1
    gpus_per_node: int = 8  # GPUs of one node (the planner's default; a launched run checks it against the node)
    # GPUs per node used by Megatron ranks (0: all of them in colocated mode; in disaggregated mode all GPUs that
    # no server is given). The Megatron world size is nodes * train_gpus_per_node.
    train_gpus_per_node: int = 0
    # SGLang servers of the rollout fleet per node, each with rollout_tp GPUs (its --tp)
    rollout_servers_per_node: int = 1
    rollout_tp: int = 1
    # explicit GPU ids of each rollout server on a node, e.g. [[6], [7]]; empty: colocated -> the training GPUs
    # in order, disaggregated -> the node's last GPUs
    rollout_gpus: list = field(default_factory=list)
    # SGLang --mem-fraction-static of each rollout server: its weights + KV cache take this fraction of the GPU memory
    # FREE when it starts (colocated: what the trainer's weights, grads and fp32 master weights leave; opid-plan)
    rollout_mem_fraction: float = 0.85
    # GPU ids of the analyzer server the trainer launches (node 0); a launched analyzer needs them on a GPU machine
    # and they may not overlap the training GPUs
    analyzer_gpus: list = field(default_factory=list)
    analyzer_mem_fraction: float = 0.85
    # How rollout requests reach the fleet: client = our balancer (least load, dead server out of rotation, its
    # in-flight requests retried elsewhere); router = SGLang's router (sglang-router) in front of the servers
    balancer: Literal["client", "router"] = "client"
    # Extra `python -m sglang_router.launch_router` arguments, verbatim
    router_args: list = field(default_factory=list)
    # The address every server and the router the trainer launches bind and advertise (opid_mega.infra.hosts): auto = the
    # address of this node's interface that routes to the rendezvous host (MASTER_ADDR; 127.0.0.1 in a one-node
    # run), or an address of the node, or an interface name (eth0, ib0: the same config on every node). Every
    # launched server and the router also get a per-run random API key, sent by every client, logged nowhere.
    bind_host: str = "auto"
    # Ranks waiting for global rank 0 (rollout, analysis, evaluation) wait on a gloo control group with this timeout;
    # the training process groups keep train_timeout_s. It is the bound on a node lost during a rollout or an
    # analysis (docs/multi-node.md "Bound on a lost node"): past it the job ends with one line naming the node
    # (exit 5). null: derived, control_timeout(cfg) = rollout.deadline_s (x 2 when the evaluation replays with
    # skills) + analyzer.deadline_s (when anything is analysed) + CONTROL_MARGIN_S (600 s)
    control_timeout_s: Optional[float] = None
    train_timeout_s: float = 300.0
    # Every rank beats in the rendezvous store (opid_mega.megatron.heartbeat); a rank silent this long is a lost node
    # wherever the job is (rollout, analysis, the PPO update's collectives, the weight sync): the job ends with one
    # line naming it (exit 5) within node_lost_bound(cfg) = this + one beat (<= 5 s) + the shutdown (10 s)
    heartbeat_timeout_s: float = 60.0
    # colocated on GPU: move the optimizer state to host memory during rollout and release SGLang's memory in training
    offload_optimizer: bool = True
    release_engine_memory: bool = True
    # CPU machines: the cores of the trainer's ranks and of the SGLang servers it launches (their OpenMP threads are
    # bound there: SGLANG_CPU_OMP_THREADS_BIND). Empty: every core, shared by phase (servers sleep while idle,
    # the trainer waits on HTTP during rollout). docs/performance.md "CPU core budget" has the measured trade-off.
    trainer_cpus: list = field(default_factory=list)
    server_cpus: list = field(default_factory=list)


@dataclass
class SyncConfig:
    """Weight sync Megatron -> rollout engines (docs/multi-node.md, weight sync)."""

    # auto: distributed (NCCL group) for disaggregated GPU engines, tensor for engines on this machine (colocated,
    # CPU), disk otherwise. distributed = SGLang update_weights_from_distributed; tensor =
    # update_weights_from_tensor (SGLang's serializer); disk = HF safetensors + update_weights_from_disk
    method: Literal["auto", "distributed", "tensor", "disk"] = "auto"
    bucket_mb: int = 512  # tensors per transfer, in MiB
    disk_dir: str = ""  # disk method: where the HF weights are written (empty: <run_dir>/weight_sync); shared by servers
    # Every N syncs, check that the engine's greedy log-probs on a fixed probe equal the trainer's (0: never)
    check_interval: int = 10
    check_tokens: int = 16  # probe response length
    # largest allowed |engine - trainer| log-prob on the probe (0: by model.dtype: 1e-3 float32, 5e-2 bf16/fp16)
    check_tol: float = 0.0


@dataclass
class LoggingConfig:
    """What a run records besides its checkpoints (docs/runs.md, Logging). Rank 0 also writes everything the console
    shows to <run_dir>/train.log (appended on resume)."""

    run_dir: str = "runs/default"
    tensorboard: bool = True  # <run_dir>/tensorboard: the metrics, the resolved config (text) and its hparams
    progress: bool = True
    # Weights & Biases (pip package wandb): the metrics of metrics.jsonl at every step and the resolved config;
    # WANDB_MODE=offline (or wandb_mode: offline) writes the run to disk without a network (`wandb sync` later)
    wandb: bool = False
    wandb_project: str = "opid-mega"
    wandb_name: str = ""  # the W&B run's display name (empty: the run directory's name)
    wandb_entity: str = ""  # team or user (empty: wandb's default entity)
    wandb_tags: list = field(default_factory=list)  # e.g. [opid, qwen3-8b]
    wandb_mode: Literal["", "online", "offline", "disabled"] = ""  # empty: WANDB_MODE, else online
    # <run_dir>/advantages.jsonl: per step-sample and iteration the task, group, score, A_out, routed skill kinds,
    # response token ids and Δ per token of each routed kind (the mechanism experiment's λ rule and Δ-sign checks)
    dump_advantages: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    analyzer: AnalyzerConfig = field(default_factory=AnalyzerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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


if __name__ == "__main__":
    sys.exit(main())
