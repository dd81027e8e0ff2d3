"""The run configuration's sections: one dataclass per section of a config file, every key with its type and default
(the YAML keys are the field names). Loading, overrides and validation: opid_mega.config."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

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
