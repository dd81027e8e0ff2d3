"""opid-plan: check a run's layout and placement against the model and the cluster, and estimate memory and time.

    opid-plan --config FILE [--nodes N --gpus-per-node G] [--gpu-mem-gib 80] [--mfu 0.35] [--gpu-tflops 989]
              [--sync-gbps 100] [--json] [key.sub=value ...]

Reads the config like opid-train (``base:`` includes, dotted overrides), the model's Hugging Face config.json
(``model.path`` / ``model.init_from``; when that directory does not exist here, the copy shipped under
``opid_mega/data/hf_configs/<basename>.json``; the built-in models from their definitions in ``opid_mega.models``),
and the ``deploy`` section. Nothing is built or launched: no torch, no GPU.

It checks the parallel layout (TP/PP/VPP/SP/CP/DP against the world size and the model shape, the rules of
``opid_mega.megatron.layout``, TP kept inside a node), the placement (training GPUs, rollout servers, the analyzer
server, GPU ids, overlaps) and the memory of every GPU of node 0 (node 0 holds everything the other nodes hold
plus the analyzer), prints a per-GPU memory table for the fullest GPU and an iteration-time estimate, and every
assumption with its value. Every problem is one line in ``errors`` naming the key to change.

Exit status: 0 the plan is ok, 1 it is not (the errors are printed), 2 a usage or config error (one line).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional

from opid_mega.config import Config, ConfigError, control_timeout, load_config, node_lost_bound

GIB = 1 << 30
HF_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_configs")
SUPPORTED = ("qwen2", "qwen3", "llama")  # opid_mega.megatron.model.SUPPORTED (not imported: it pulls in megatron)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LOGPROB_CHUNK = 4096  # opid_mega.kernels.logprob.DEFAULT_CHUNK: vocabulary chunk of the torch log-prob head

DEFAULTS = dict(gpu_mem_gib=80.0, mfu=0.35, gpu_tflops=989.0, sync_gbps=100.0, host_gbps=200.0, decode_mfu=0.05,
                decode_tok_s=0.0)


class PlanError(ValueError):
    """The plan cannot be made at all (unknown model, unreadable config.json): a usage error, exit 2."""


# --------------------------------------------------------------------------------------------------------------------
# The model: Hugging Face config.json -> architecture facts -> parameter counts
# --------------------------------------------------------------------------------------------------------------------


def shipped_configs() -> list[str]:
    """Basenames of the Hugging Face configs shipped under opid_mega/data/hf_configs."""
    return sorted(f[:-5] for f in os.listdir(HF_CONFIG_DIR) if f.endswith(".json"))


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise PlanError(f"{path} is not valid JSON ({e})") from None


def resolve_hf_config(source: str, key: str) -> tuple[dict, str]:
    """(config.json dict, where it came from) for a model directory ``source``: its config.json when it exists,
    else the shipped copy named by the directory's basename."""
    own = os.path.join(os.path.expanduser(source), "config.json")
    if os.path.isfile(own):
        return _read_json(own), own
    base = os.path.basename(os.path.normpath(source))
    shipped = os.path.join(HF_CONFIG_DIR, base + ".json")
    if os.path.isfile(shipped):
        return _read_json(shipped), f"shipped {os.path.relpath(shipped, os.path.dirname(HF_CONFIG_DIR))}"
    raise PlanError(f"{key}: {source} has no config.json here and no shipped config is named {base!r} "
                    f"(shipped: {', '.join(shipped_configs())})")


def builtin_hf_config(name: str) -> tuple[dict, str]:
    """The config.json of a built-in model (opid_mega.models), from its definition: the tiny models from
    ``_TINY_SHAPES`` (as ``_build_tiny_*`` build them), smollm2-135m from the shipped SmolLM2-135M-Instruct config."""
    if name.startswith("tiny-"):
        from opid_mega.models import _TINY_SHAPES

        shapes = dict(_TINY_SHAPES)
        if name == "tiny-qwen3":
            return dict(shapes, model_type="qwen3", tie_word_embeddings=True, attention_bias=False), \
                "opid_mega.models._TINY_SHAPES (tiny-qwen3)"
        if name == "tiny-qwen3-footprints":
            from opid_mega.models import footprints_vocab_size

            return dict(shapes, vocab_size=footprints_vocab_size(), model_type="qwen3", tie_word_embeddings=True,
                        attention_bias=False), "opid_mega.models._TINY_SHAPES (tiny-qwen3-footprints)"
        if name == "tiny-qwen2":
            shapes.pop("head_dim")  # Qwen2 derives head_dim = hidden / heads
            return dict(shapes, model_type="qwen2", tie_word_embeddings=True), "opid_mega.models._TINY_SHAPES (tiny-qwen2)"
        if name == "tiny-llama":
            return dict(shapes, model_type="llama", tie_word_embeddings=False, attention_bias=False, mlp_bias=False), \
                "opid_mega.models._TINY_SHAPES (tiny-llama)"
    if name == "smollm2-135m":
        return resolve_hf_config("SmolLM2-135M-Instruct", "model.builtin")
    raise PlanError(f"model.builtin: no known architecture for {name!r}")


def model_source(cfg: Config) -> tuple[dict, str]:
    m = cfg.model
    src = m.init_from if m.init_from not in ("", "sft") else m.path  # the sft warm start keeps the base architecture
    if src.startswith("shipped:"):
        from opid_mega.warm_starts import model_dir

        src = model_dir(src)
    if src:
        return resolve_hf_config(src, "model.init_from" if src == m.init_from else "model.path")
    return builtin_hf_config(m.builtin)


def arch_facts(hf: dict, name: str = "the model") -> dict:
    """The shapes the planner needs, with the rules of opid_mega.megatron.model.arch_of (supported types, no sliding
    window, SwiGLU) plus what decides the exact Hugging Face parameter count (biases, q/k norms, tied embeddings)."""
    mt = hf.get("model_type")
    if mt not in SUPPORTED:
        raise PlanError(f"model_type {mt!r} of {name} is not supported; supported: {', '.join(SUPPORTED)}")
    if hf.get("use_sliding_window", False):
        raise PlanError(f"{name}: sliding-window attention is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise PlanError(f"{name}: hidden_act {hf.get('hidden_act')!r} is not supported (SwiGLU/silu only)")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if hf.get(k) is None]
    if missing:
        raise PlanError(f"the config of {name} has no {', '.join(missing)}")
    heads = int(hf["num_attention_heads"])
    h = int(hf["hidden_size"])
    attn_bias = bool(hf.get("attention_bias", False))
    return dict(
        name=name, model_type=mt, hidden=h, ffn=int(hf["intermediate_size"]), layers=int(hf["num_hidden_layers"]),
        heads=heads, kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or h // heads), vocab=int(hf["vocab_size"]),
        tied=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=mt == "qwen2" or attn_bias,  # Qwen2: q/k/v always carry a bias
        o_bias=mt != "qwen2" and attn_bias,
        mlp_bias=mt == "llama" and bool(hf.get("mlp_bias", False)),
        qk_norm=mt == "qwen3",
    )


def _layer_params(a: dict) -> tuple[int, int]:
    """(parameters of one transformer layer split over TP, parameters replicated on every TP rank)."""
    h, f, d, q, kv = a["hidden"], a["ffn"], a["head_dim"], a["heads"] * a["head_dim"], a["kv_heads"] * a["head_dim"]
    split = h * q + 2 * h * kv + q * h + 3 * h * f  # q, k, v, o projections; gate, up, down
    if a["qkv_bias"]:
        split += q + 2 * kv
    if a["mlp_bias"]:
        split += 2 * f  # gate and up biases (column parallel)
    replicated = 2 * h  # input and post-attention RMSNorm
    if a["o_bias"]:
        replicated += h  # a row-parallel bias is replicated
    if a["mlp_bias"]:
        replicated += h
    if a["qk_norm"]:
        replicated += 2 * d
    return split, replicated


def param_count(a: dict) -> int:
    """Parameters of the Hugging Face model (tied embeddings counted once): equals
    ``sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())``."""
    split, rep = _layer_params(a)
    emb = a["vocab"] * a["hidden"]
    return emb * (1 if a["tied"] else 2) + a["layers"] * (split + rep) + a["hidden"]


def rank_params(a: dict, tp: int, pp: int) -> dict:
    """Megatron parameters held by one rank of each pipeline stage (the largest is what a GPU must hold).

    Layers are split evenly over the pp stages (vpp chunks do not change a rank's share); the first stage holds the
    vocabulary-parallel embedding (vocab/tp rows), the last the final norm and the output layer (vocab/tp rows;
    with tied embeddings and pp > 1 megatron keeps a second copy there, kept equal by an all-reduce)."""
    split, rep = _layer_params(a)
    per_layer = split // tp + rep
    layers = a["layers"] // pp if a["layers"] % pp == 0 else -(-a["layers"] // pp)
    emb = -(-a["vocab"] // tp) * a["hidden"]
    stages = []
    for s in range(pp):
        n = layers * per_layer
        if s == 0:
            n += emb
        if s == pp - 1:
            n += a["hidden"] + (emb if (not a["tied"] or pp > 1) else 0)
        stages.append(n)
    return dict(stages=stages, largest=max(stages), largest_stage=stages.index(max(stages)))


# --------------------------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------------------------


def activation_bytes_per_token_layer(a: dict, tp: int, sp: bool, e: int) -> dict:
    """Activation bytes one transformer layer keeps for its backward, per token, on one TP rank.

    The accounting of Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
    whose per-layer total is ``s*b*h*(34 + 5*a*s/h)`` bytes for fp16 GPT (``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` with
    TP t, ``s*b*h*(34/t + 5*a*s/(h*t))`` with sequence parallel), adapted to this architecture:

    * replicated over TP (divided by t with sequence parallel): the inputs of the two RMSNorms and of the two
      column-parallel linears (QKV, FC1): ``4 * h * e``;
    * split over TP: Q, K, V (``(a_q + 2*a_kv) * d * e``), the q/k-norm inputs for Qwen3 (``(a_q + a_kv) * d * e``),
      the attention output (= the output projection's input, ``a_q * d * e``), the SwiGLU input (gate and up,
      ``2 * f * e``) and the down projection's input (``f * e``), plus the attention's log-sum-exp (``a_q * 4``);
    * no dropout masks (dropout is 0) and no ``5*a*s/h`` softmax term: training attention is flash / varlen (THD),
      which never materialises the ``s x s`` scores.

    ``e``: bytes per element of model.dtype. Selective recompute (megatron's core-attention recompute) drops only
    the log-sum-exp (there is no s x s softmax to drop); full recompute keeps each layer's input (``h * e``, divided
    by t with sequence parallel) and re-creates one layer's activations at a time in the backward."""
    h, f, d = a["hidden"], a["ffn"], a["head_dim"]
    rep = 4 * h * e / (tp if sp else 1)
    qkv = (a["heads"] + 2 * a["kv_heads"]) * d * e
    qkn = (a["heads"] + a["kv_heads"]) * d * e if a["qk_norm"] else 0
    split = (qkv + qkn + a["heads"] * d * e + 3 * f * e) / tp
    lse = a["heads"] * 4 / tp
    full_layer = rep + split + lse
    return dict(none=full_layer, selective=full_layer - lse, full_input=h * e / (tp if sp else 1),
                full_layer=full_layer)


def kv_bytes_per_token(a: dict, tp: int, e: int) -> float:
    """K and V of every layer for one token on one of ``tp`` ranks (KV heads split over TP, replicated below one)."""
    return 2 * a["layers"] * max(a["kv_heads"] / tp, 1) * a["head_dim"] * e


def _gib(x: float) -> float:
    return round(x / GIB, 3)


# --------------------------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------------------------


def plan(cfg: Config, gpu_mem_gib: float = DEFAULTS["gpu_mem_gib"], mfu: float = DEFAULTS["mfu"],
         gpu_tflops: float = DEFAULTS["gpu_tflops"], sync_gbps: float = DEFAULTS["sync_gbps"],
         host_gbps: float = DEFAULTS["host_gbps"], decode_mfu: float = DEFAULTS["decode_mfu"],
         decode_tok_s: float = DEFAULTS["decode_tok_s"]) -> dict:
    """The plan of ``cfg`` as a dict (what ``opid-plan --json`` prints). Raises :class:`PlanError` when the model
    cannot be known. The plan is worked out part by part (:class:`_Plan`): placement, parallel layout, a training
    rank's memory, the SGLang servers' pools, every GPU of node 0, the time of one iteration."""
    for name, v in (("--gpu-mem-gib", gpu_mem_gib), ("--mfu", mfu), ("--gpu-tflops", gpu_tflops),
                    ("--sync-gbps", sync_gbps), ("--host-gbps", host_gbps), ("--decode-mfu", decode_mfu)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise PlanError(f"{name}: got {v!r}, allowed: a number > 0")
    if decode_tok_s < 0 or not math.isfinite(decode_tok_s):
        raise PlanError(f"--decode-tok-s: got {decode_tok_s!r}, allowed: a number >= 0 (0: from --decode-mfu)")
    if mfu > 1 or decode_mfu > 1:
        raise PlanError("--mfu / --decode-mfu: allowed: a number in (0, 1]")
    p = _Plan(cfg, gpu_mem_gib=gpu_mem_gib, mfu=mfu, gpu_tflops=gpu_tflops, sync_gbps=sync_gbps,
              host_gbps=host_gbps, decode_mfu=decode_mfu, decode_tok_s=decode_tok_s)
    p.placement()
    p.layout()
    p.training_memory()
    p.servers()
    p.gpus()
    p.iteration_time()
    return p.result()


class _Plan:
    """One plan's working state: each method reads what the earlier ones set and adds its part (errors and notes
    collect as it goes)."""

    def __init__(self, cfg: Config, **rates):
        self.cfg, self.rates = cfg, rates
        self.hf, self.hf_source = model_source(cfg)
        self.a = arch_facts(self.hf, name=os.path.basename(os.path.normpath(cfg.model.path)) if cfg.model.path
                            else cfg.model.builtin)
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.gpu_bytes = rates["gpu_mem_gib"] * GIB
        self.e = DTYPE_BYTES[cfg.model.dtype]
        self.gpu_cluster = cfg.parallel.backend != "gloo"

    # ---------------------------------------------------------------- placement
    def placement(self) -> None:
        cfg, d, r, notes = self.cfg, self.cfg.deploy, self.cfg.rollout, self.notes
        self.launched_servers = r.engine == "sglang" and not r.sglang_url
        n_srv = d.rollout_servers_per_node if self.launched_servers else 0
        self.rtp = d.rollout_tp
        self.analyzer_launched = cfg.algo.needs_analysis and cfg.analyzer.backend == "llm" and not cfg.analyzer.base_url
        self.analyzer_ids = list(d.analyzer_gpus) if self.analyzer_launched else []
        if not self.launched_servers:
            notes.append("rollout: " + ("the embedded local engine on rank 0 (no SGLang server placed)"
                                        if r.engine == "local" else f"an external SGLang server ({r.sglang_url}), not placed"))
        if cfg.analyzer.backend == "llm" and cfg.analyzer.base_url:
            notes.append(f"analyzer: external endpoint {cfg.analyzer.base_url}, not placed")
        if d.analyzer_gpus and not self.analyzer_launched:
            notes.append("deploy.analyzer_gpus is set but no analyzer server is launched: those GPUs stay idle")

        # the launcher's own rules (opid_mega.placement), every problem collected; analyzer GPUs stay off training
        # even when no analyzer is launched, as in the launcher
        from opid_mega.placement import placement_problems

        placed, problems = placement_problems(d, servers=n_srv,
                                              analyzer_launched=self.analyzer_launched and self.gpu_cluster)
        self.errors.extend(problems)
        self.train_ids, self.groups = placed.train_gpus, placed.rollout_groups

        # GPUs the layout leaves idle: every node gets the same placement; the launched analyzer is on node 0 only,
        # so its GPUs sit idle on the other nodes (the launcher keeps deploy.analyzer_gpus off training on every node)
        idle = []
        if self.gpu_cluster:
            busy = set(self.train_ids) | {g for grp in self.groups for g in grp}
            for n in range(d.nodes):
                free = [g for g in range(d.gpus_per_node)
                        if g not in busy and not (n == 0 and g in self.analyzer_ids)]
                if free:
                    idle.append(dict(node=n, gpus=free))
        self.idle_gpus = dict(count=sum(len(x["gpus"]) for x in idle), of=d.nodes * d.gpus_per_node, per_node=idle)

    # ---------------------------------------------------------------- parallel layout
    def layout(self) -> None:
        from opid_mega.megatron.layout import layout_error

        p, a, T, errors = self.cfg.parallel, self.a, len(self.train_ids), self.errors
        self.world = self.cfg.deploy.nodes * T
        tp, pp = p.tp, p.pp
        facts = dict(name=a["name"], heads=a["heads"], kv_heads=a["kv_heads"], layers=a["layers"], vocab=a["vocab"],
                     ffn=a["ffn"], hidden=a["hidden"])
        msg = layout_error(facts, tp=tp, pp=pp, vpp=p.vpp, sp=p.sequence_parallel, cp=p.cp, world=None)
        if msg:
            key = ("parallel.pp" if msg.startswith("pp*vpp") else "parallel.vpp" if msg.startswith("vpp") else
                   "parallel.cp" if msg.startswith("cp") else "parallel.sequence_parallel" if msg.startswith("sequence")
                   else "parallel.tp")
            errors.append(f"{key}: {msg}")
        if T and T % tp:
            errors.append(f"parallel.tp: tp={tp} does not divide the {T} training GPUs of a node: a tensor-parallel "
                          "group would span nodes (keep TP inside a node)")
        if self.world and self.world % (tp * pp * p.cp):
            errors.append(f"deploy.nodes: the world size {self.cfg.deploy.nodes} nodes x {T} training GPUs = "
                          f"{self.world} is not divisible by tp*pp*cp = {tp}*{pp}*{p.cp} = {tp * pp * p.cp} "
                          "(deploy.train_gpus_per_node / parallel.tp / parallel.pp)")
        self.dp = max(self.world // (tp * pp * p.cp), 1)

    # ---------------------------------------------------------------- memory of a training rank
    def training_memory(self) -> None:
        cfg, a, e, p, t, r = self.cfg, self.a, self.e, self.cfg.parallel, self.cfg.train, self.cfg.rollout
        tp, pp, vpp, dp = p.tp, p.pp, p.vpp, self.dp
        self.N = param_count(a)
        self.rp = rank_params(a, tp, pp)
        P = self.P = self.rp["largest"]
        main_weights = 4 if e != 4 else 0  # fp32 main weights: only for a bf16/fp16 model (fp32: the weights themselves)
        self.opt_per_param = main_weights + 8  # + Adam exp_avg and exp_avg_sq in fp32
        self.weights = P * e
        self.grads = P * 4  # megatron DDP grad buffer, grad_reduce_in_fp32 (opid_mega.megatron.train_step.wrap_ddp)
        self.opt_full = P * self.opt_per_param
        self.opt_sharded = math.ceil(P / dp) * self.opt_per_param
        self.optimizer = self.opt_sharded if t.distributed_optimizer else self.opt_full
        opt_params = math.ceil(P / dp) if t.distributed_optimizer else P
        self.master = opt_params * main_weights  # fp32 master weights: the optimizer's parameters, on the GPU always
        self.moments = opt_params * 8  # Adam exp_avg + exp_avg_sq: the only state colocation moves to the host
        act = self.act = activation_bytes_per_token_layer(a, tp, p.sequence_parallel, e)
        s = t.micro_batch_tokens
        layers_per_rank = a["layers"] // pp if a["layers"] % pp == 0 else -(-a["layers"] // pp)
        # 1F1B: the first stage holds min(pp, micro-batches) micro-batches in flight = pp x (layers/pp) layers = all
        # layers of one micro-batch; interleaved (vpp > 1): x (1 + (pp - 1) / (pp * vpp)) (Narayanan et al. 2021)
        in_flight = pp * (1 + (pp - 1) / (pp * vpp) if vpp > 1 else 1)
        self.act_layers = layers_per_rank * in_flight
        vocab_shard = -(-a["vocab"] // tp)
        head = 2 * s * min(LOGPROB_CHUNK, vocab_shard) * 4  # two [tokens, chunk] fp32 buffers (the torch head)
        self.act_by_recompute = {"none": self.act_layers * s * act["none"] + head,
                                 "selective": self.act_layers * s * act["selective"] + head,
                                 "full": self.act_layers * s * act["full_input"] + s * act["full_layer"] + head}
        self.activations = self.act_by_recompute[t.recompute]
        # fork scoring (forward only): the trainer's scoring micro-batch budget, one layer's working set at a time,
        # the K/V of the micro-batch (shared prefixes computed once, attended by every branch) and the head chunk
        # (the trainer's bound: original + two skill contexts, each section capped at analyzer.max_skill_tokens plus
        # its frame, ~30 tokens of title and instruction with the Qwen/Llama tokenizers)
        from opid_mega.batching.layout import fork_sample_bound

        self.score_tokens = max(s, fork_sample_bound(r.max_prompt_tokens, r.max_response_tokens,
                                                     [cfg.analyzer.max_skill_tokens + 40] * 2)) \
            if cfg.scoring.scorer == "fork" else s
        self.score_layer = self.score_tokens * act["full_layer"]
        self.score_kv = self.score_tokens * 2 * max(a["kv_heads"] / tp, 1) * a["head_dim"] * e
        self.score_head = 2 * self.score_tokens * min(LOGPROB_CHUNK, vocab_shard) * 4
        self.scoring = self.score_layer + self.score_kv + self.score_head
        self.train_peak = self.weights + self.grads + self.optimizer + max(self.activations, self.scoring)

    # ---------------------------------------------------------------- SGLang servers
    def servers(self) -> None:
        """SGLang sizes its pool (weights + KV cache) once, at start, as --mem-fraction-static x the GPU memory FREE
        then (0.5.23: pool = f x free before its weights load; KV = pool - weights). A colocated server starts after
        the trainer's Policy on the same GPU: its weights, DDP grad buffer and fp32 master weights are resident then
        and stay resident in every phase; Adam's moments too unless deploy.offload_optimizer (they do not exist yet on
        a fresh start, and a resumed run moves them to the host before the servers start)."""
        cfg, d, r, errors = self.cfg, self.cfg.deploy, self.cfg.rollout, self.errors
        self.colocated = d.mode == "colocated"
        offloaded = self.colocated and d.offload_optimizer
        self.resident_in_rollout = self.weights + self.grads + self.master + (0 if offloaded else self.moments)
        srv_on_train = self.colocated and any(g in self.train_ids for grp in self.groups for g in grp)
        self.srv_free = self.gpu_bytes - (self.resident_in_rollout if srv_on_train else 0.0)
        self.srv_weights = self.N * self.e / self.rtp
        self.srv_pool = d.rollout_mem_fraction * self.srv_free
        self.srv_kv = self.srv_pool - self.srv_weights
        self.kv_tok = kv_bytes_per_token(self.a, self.rtp, self.e)
        seq_tokens = r.max_prompt_tokens + r.max_response_tokens
        if self.groups and self.srv_kv < self.kv_tok * seq_tokens:
            errors.append(f"deploy.rollout_mem_fraction: a rollout server's pool ({d.rollout_mem_fraction} x "
                          f"{_gib(self.srv_free):g} GiB free at its start = {_gib(self.srv_pool)} GiB per GPU) minus its "
                          f"weights ({_gib(self.srv_weights)} GiB per GPU at rollout_tp={self.rtp}) leaves "
                          f"{_gib(max(self.srv_kv, 0))} GiB of KV cache, less than one sequence of {seq_tokens} tokens "
                          f"({_gib(self.kv_tok * seq_tokens)} GiB); raise it or deploy.rollout_tp")
        self.an_weights = self.an_pool = self.an_kv = 0.0
        self.an_N = None
        if self.analyzer_ids:
            self.an_pool = d.analyzer_mem_fraction * self.gpu_bytes
            try:
                an_hf, _ = resolve_hf_config(cfg.analyzer.model, "analyzer.model") if cfg.analyzer.model else \
                    (self.hf, self.hf_source)
                an_a = arch_facts(an_hf, name=os.path.basename(os.path.normpath(cfg.analyzer.model or self.a["name"])))
                self.an_N = param_count(an_a)
                self.an_weights = self.an_N * 2 / len(self.analyzer_ids)  # served in bf16, TP = its GPUs
                self.an_kv = self.an_pool - self.an_weights
                need = kv_bytes_per_token(an_a, len(self.analyzer_ids), 2) * (cfg.analyzer.max_tokens +
                                                                              r.max_prompt_tokens)
                if self.an_kv < need:
                    errors.append(f"deploy.analyzer_mem_fraction: the analyzer's pool ({_gib(self.an_pool)} GiB per "
                                  f"GPU) minus its weights ({_gib(self.an_weights)} GiB) leaves "
                                  f"{_gib(max(self.an_kv, 0))} GiB of KV cache, less than one request ({_gib(need)} "
                                  "GiB); raise it or add deploy.analyzer_gpus")
            except PlanError as err:
                self.notes.append(f"analyzer model not known ({err}); its KV cache is not checked")

    # ---------------------------------------------------------------- every GPU of node 0
    def gpus(self) -> None:
        d, gpu_mem_gib = self.cfg.deploy, self.rates["gpu_mem_gib"]
        self.per_gpu = []
        for g in range(d.gpus_per_node):
            is_train = g in self.train_ids
            n_pools = sum(1 for grp in self.groups if g in grp)
            pools = n_pools * self.srv_pool + (self.an_pool if g in self.analyzer_ids else 0.0)
            if is_train:
                training = self.train_peak + (pools if (not d.release_engine_memory or not self.colocated) else 0.0)
                rollout = self.resident_in_rollout + pools
                total = max(training, rollout)
            else:
                training = rollout = total = pools
            self.per_gpu.append(dict(gpu=g, train=is_train, rollout_servers=n_pools, analyzer=g in self.analyzer_ids,
                                     training_phase_gib=_gib(training), rollout_phase_gib=_gib(rollout),
                                     peak_gib=_gib(total)))
            if total > self.gpu_bytes:
                what = []
                if is_train:
                    what.append("train.micro_batch_tokens / train.recompute / train.distributed_optimizer / "
                                "parallel.tp / parallel.pp")
                if pools:
                    what.append("deploy.rollout_mem_fraction / deploy.analyzer_mem_fraction")
                self.errors.append(f"memory: GPU {g} of node 0 needs {_gib(total)} GiB > {gpu_mem_gib:g} GiB "
                                   f"(--gpu-mem-gib); lower {' or '.join(what)}")
        self.fullest = max(self.per_gpu, key=lambda x: x["peak_gib"]) if self.per_gpu else dict(gpu=0, peak_gib=0.0)

    def memory(self) -> dict:
        t, groups, colocated = self.cfg.train, self.groups, self.colocated
        act = self.act_by_recompute
        return dict(
            gpu=self.fullest["gpu"], gpu_mem_gib=self.rates["gpu_mem_gib"],
            params_rank=self.P, params_stages=self.rp["stages"],
            weights_bytes=int(self.weights), grads_bytes=int(self.grads), optimizer_bytes=int(self.optimizer),
            master_bytes=int(self.master), moments_bytes=int(self.moments), master_gib=_gib(self.master),
            moments_gib=_gib(self.moments),
            resident_in_rollout_bytes=int(self.resident_in_rollout) if colocated else 0,
            resident_in_rollout_gib=_gib(self.resident_in_rollout) if colocated else 0.0,
            weights_gib=_gib(self.weights), grads_gib=_gib(self.grads),
            optimizer_gib=_gib(self.optimizer), optimizer_unsharded_gib=_gib(self.opt_full),
            optimizer_sharded_gib=_gib(self.opt_sharded),
            activations_gib=_gib(self.activations), activations_none_gib=_gib(act["none"]),
            activations_selective_gib=_gib(act["selective"]), activations_full_gib=_gib(act["full"]),
            activation_bytes_per_token_layer=round(self.act["none"], 1),
            scoring_gib=_gib(self.scoring), scoring_layer_gib=_gib(self.score_layer),
            scoring_prefix_kv_gib=_gib(self.score_kv), scoring_head_gib=_gib(self.score_head),
            scoring_tokens=self.score_tokens,
            train_peak_gib=_gib(self.train_peak),
            rollout_servers_per_node=len(groups), rollout_groups=groups,
            sglang_free_at_start_bytes=int(self.srv_free) if groups else 0,
            sglang_pool_bytes=int(self.srv_pool) if groups else 0,
            sglang_kv_bytes=int(max(self.srv_kv, 0)) if groups else 0,
            sglang_free_at_start_gib=_gib(self.srv_free) if groups else 0.0,
            sglang_pool_gib=_gib(self.srv_pool) if groups else 0.0,
            sglang_weights_gib=_gib(self.srv_weights) if groups else 0.0,
            sglang_kv_gib=_gib(max(self.srv_kv, 0)) if groups else 0.0,
            sglang_kv_tokens=int(max(self.srv_kv, 0) // self.kv_tok) if groups else 0,
            analyzer_gpus=self.analyzer_ids, analyzer_pool_gib=_gib(self.an_pool),
            analyzer_weights_gib=_gib(self.an_weights), analyzer_kv_gib=_gib(max(self.an_kv, 0)),
            host_reference_gib=_gib(self.P * self.e) if (t.use_reference and self.cfg.algo.kl_coef > 0) else 0.0,
            per_gpu=self.per_gpu,
        )

    # ---------------------------------------------------------------- time of one iteration
    def iteration_time(self) -> None:
        cfg, r, t, d, rates = self.cfg, self.cfg.rollout, self.cfg.train, self.cfg.deploy, self.rates
        N, nodes = self.N, d.nodes
        B, Gs, S = r.tasks_per_iter, r.group_size, cfg.env.max_steps
        rollout_tokens = B * Gs * S * r.max_response_tokens
        self.per_gpu_decode = rates["decode_tok_s"] or rates["decode_mfu"] * rates["gpu_tflops"] * 1e12 / (2 * N)
        self.rollout_gpus = nodes * len(self.groups) * self.rtp if self.groups else 1
        t_rollout = rollout_tokens / (self.per_gpu_decode * self.rollout_gpus)
        t_analysis = 0.0
        analyzer_tokens = 0
        if cfg.algo.needs_analysis and cfg.analyzer.backend == "llm":
            analyzer_tokens = B * Gs * cfg.analyzer.max_tokens
            if self.analyzer_launched:
                an_rate = rates["decode_tok_s"] or rates["decode_mfu"] * rates["gpu_tflops"] * 1e12 / (2 * (self.an_N or N))
                t_analysis = analyzer_tokens / (an_rate * max(len(self.analyzer_ids), 1))
            else:
                self.notes.append("analysis time: external analyzer endpoint, not estimated")
        samples = B * Gs * S
        sample_tokens = r.max_prompt_tokens + r.max_response_tokens
        mode = cfg.algo.mode
        self.skill_ctx = 0 if mode in ("grpo", "skill_grpo") else 2 if mode == "no_routing" else 1
        self.ref = 1 if (t.use_reference and cfg.algo.kl_coef > 0) else 0
        self.score_passes = 1 + self.skill_ctx + self.ref
        score_flops = 2 * N * samples * sample_tokens * self.score_passes
        train_flops = (8 if t.recompute == "full" else 6) * N * samples * sample_tokens * t.ppo_epochs
        cluster_flops = max(self.world, 1) * rates["gpu_tflops"] * 1e12 * rates["mfu"]
        t_score = score_flops / cluster_flops
        t_train = train_flops / cluster_flops
        self.sync_bytes = N * self.e
        self.method = sync_method(cfg, self.gpu_cluster)
        self.errors.extend(sync_problems(cfg, self.method, self.gpu_cluster, self.train_ids, self.groups))
        if self.method == "disk" and nodes > 1:
            self.notes.append("sync.method=disk with several nodes: sync.disk_dir (empty: the run directory) must be "
                              "on a file system every node's servers see")
        t_sync = self.sync_bytes * 8 / (rates["sync_gbps"] * 1e9) * (2 if self.method == "disk" else 1)
        self.t_offload = 2 * self.moments * 8 / (rates["host_gbps"] * 1e9) \
            if (self.colocated and d.offload_optimizer and self.gpu_cluster) else 0.0
        sequential_t = t_rollout + t_analysis + t_score + t_train + t_sync + self.t_offload
        # train.max_staleness >= 1 (opid_mega.pipeline): each stage below runs beside the others; the analyzer (its
        # own GPUs) is a stage of its own, so an iteration takes the longest chain, not the sum
        if t.max_staleness == 0:
            total_t, self.overlap = sequential_t, "none (train.max_staleness=0): every phase after the other"
        elif self.colocated:  # the next rollout before this iteration's scoring and update; only the analysis beside
            total_t = max(t_rollout + t_score + t_train + t_sync + self.t_offload, t_analysis)
            self.overlap = (f"train.max_staleness={t.max_staleness}, colocated: the analysis beside the next rollout, "
                            "scoring and training: max(rollout + scoring + training + sync + offload, analysis)")
        else:  # the next rollout on the rollout GPUs beside this iteration's scoring and update, joined before sync
            total_t = max(max(t_rollout, t_score + t_train) + t_sync, t_analysis)
            self.overlap = (f"train.max_staleness={t.max_staleness}, disaggregated: the next rollout beside scoring "
                            "and training, the analysis beside both: max(max(rollout, scoring + training) + sync, "
                            "analysis)")
        self.time = dict(
            rollout_tokens=rollout_tokens, decode_tok_s_per_gpu=round(self.per_gpu_decode, 1),
            rollout_gpus=self.rollout_gpus, rollout_s=round(t_rollout, 2), analyzer_tokens=analyzer_tokens,
            analysis_s=round(t_analysis, 2), step_samples=samples, sample_tokens=sample_tokens,
            scoring_passes=self.score_passes, scoring_tflop=round(score_flops / 1e12, 1), scoring_s=round(t_score, 2),
            training_tflop=round(train_flops / 1e12, 1), training_s=round(t_train, 2),
            sync_method=self.method, sync_gb=round(self.sync_bytes / 1e9, 3), sync_s=round(t_sync, 2),
            offload_s=round(self.t_offload, 2), sequential_s=round(sequential_t, 1), iteration_s=round(total_t, 1),
            iterations=t.iterations, run_h=round(total_t * t.iterations / 3600, 2),
        )

    def assumptions(self) -> dict:
        cfg, r, t, rates, e, act = self.cfg, self.cfg.rollout, self.cfg.train, self.rates, self.e, self.act
        B, Gs, S = r.tasks_per_iter, r.group_size, cfg.env.max_steps
        return {
            "gpu memory": f"{rates['gpu_mem_gib']:g} GiB per GPU (--gpu-mem-gib)",
            "model dtype": f"{cfg.model.dtype}: {e} bytes per weight (model.dtype)",
            "gradients": "fp32 main-grad buffer, 4 bytes per parameter (megatron DDP, grad_reduce_in_fp32)",
            "optimizer": (f"Adam: fp32 main weights (4 B, bf16/fp16 models only) + exp_avg + exp_avg_sq (4 B each) = "
                          f"{self.opt_per_param} B per parameter, / DP={self.dp} with train.distributed_optimizer "
                          f"({'on' if t.distributed_optimizer else 'off'}); Adam's step scalars ignored"),
            "activations": (f"per layer and token {act['none']:.0f} B on a TP rank (Korthikanti et al. 2022, adapted: "
                            "GQA, SwiGLU, RMSNorm, flash attention, no dropout), x micro_batch_tokens "
                            f"{t.micro_batch_tokens} x {self.act_layers:g} layers in flight (1F1B: pp micro-batches; "
                            f"interleaved x (1+(pp-1)/(pp*vpp))); train.recompute={t.recompute}; + log-prob head 2 x "
                            f"tokens x {LOGPROB_CHUNK}-column fp32 chunks"),
            "fork scoring": (f"forward only, {self.score_tokens} tokens per micro-batch: one layer's working set + the "
                             "K/V of the micro-batch (shared prefixes once) + the head chunk"),
            "sglang": ("each server takes deploy.rollout_mem_fraction (analyzer: deploy.analyzer_mem_fraction) x the "
                       "GPU memory free when it starts (SGLang's --mem-fraction-static; colocated: the GPU minus the "
                       "trainer's resident weights, grads and fp32 master weights) for weights + KV cache; weights in "
                       "model.dtype split over rollout_tp; analyzer in bf16 with TP = its GPUs"),
            "placement": ("colocated: training phase: SGLang memory released (deploy.release_engine_memory); rollout "
                          "phase: weights, grads and fp32 master weights stay, Adam's moments on the host "
                          "(deploy.offload_optimizer)") if self.colocated else
                         "disaggregated: servers on their own GPUs, training GPUs hold only Megatron",
            "reference": "the frozen reference is a host-memory copy (ReferenceWeights), not on the GPU",
            "rollout": (f"upper bound tasks_per_iter x group_size x max_steps x max_response_tokens = {B}x{Gs}x{S}x"
                        f"{r.max_response_tokens}; decode {self.per_gpu_decode:.0f} tok/s per rollout GPU "
                        + ("(--decode-tok-s)" if rates["decode_tok_s"] else
                           f"(--decode-mfu {rates['decode_mfu']:g} x {rates['gpu_tflops']:g} TFLOP/s / 2N)")
                        + f" on {self.rollout_gpus} GPUs"),
            "analysis": (f"one call per trajectory, analyzer.max_tokens={cfg.analyzer.max_tokens} tokens each (upper "
                         "bound), same decode model on deploy.analyzer_gpus"),
            "compute": (f"{rates['gpu_tflops']:g} TFLOP/s per GPU (--gpu-tflops, bf16 dense H100) at MFU "
                        f"{rates['mfu']:g} (--mfu) on {self.world} training GPUs; scoring 2N FLOPs/token x "
                        f"{self.score_passes} passes (old policy" + (", skill context" if self.skill_ctx else "")
                        + (", reference" if self.ref else "")
                        + f"), training {'8' if t.recompute == 'full' else '6'}N FLOPs/token x ppo_epochs; tokens = "
                        "step-samples x (max_prompt + max_response), attention FLOPs ignored"),
            "weight sync": (f"{self.sync_bytes / 1e9:.2f} GB (N x {e} B) per iteration at {rates['sync_gbps']:g} "
                            f"Gbit/s (--sync-gbps), method {self.method}"
                            + (" (written and read: x2)" if self.method == "disk" else "")),
            "offload": (f"Adam's moments to host and back at {rates['host_gbps']:g} Gbit/s (--host-gbps)"
                        if self.t_offload else "no optimizer offload"),
            "phases": self.overlap,
        }

    def result(self) -> dict:
        cfg, p, d = self.cfg, self.cfg.parallel, self.cfg.deploy
        return dict(
            ok=not self.errors, errors=self.errors, notes=self.notes,
            config=dict(model=self.a["name"], hf_config=self.hf_source, dtype=cfg.model.dtype, mode=d.mode,
                        nodes=d.nodes, gpus_per_node=d.gpus_per_node, backend=p.backend),
            layout=dict(tp=p.tp, pp=p.pp, vpp=p.vpp, sp=p.sequence_parallel, cp=p.cp, dp=self.dp, world=self.world,
                        train_gpus_per_node=len(self.train_ids), train_gpus=self.train_ids,
                        rollout_groups=self.groups, rollout_tp=self.rtp, analyzer_gpus=self.analyzer_ids),
            idle_gpus=self.idle_gpus if self.gpu_cluster else None,
            params_total=self.N, per_gpu_gib=self.fullest["peak_gib"],
            memory=self.memory(), time=self.time, assumptions=self.assumptions(),
            node_lost_bound_s=node_lost_bound(cfg), control_timeout_s=control_timeout(cfg),
        )


def sync_method(cfg: Config, gpu_cluster: bool) -> str:
    """sync.method as the trainer resolves it (opid_mega.megatron.weight_sync.resolve_method) from the config alone:
    auto = distributed for disaggregated GPU servers, tensor for launched servers (every node's fed on that node)
    and attached ones on this machine, disk for attached servers elsewhere."""
    method = cfg.sync.method
    if cfg.rollout.engine == "local":
        return "local"
    if method != "auto":
        return method
    if cfg.deploy.mode == "disaggregated" and gpu_cluster:
        return "distributed"
    return "disk" if _remote_attached(cfg) else "tensor"


def _remote_attached(cfg: Config) -> list[str]:
    """The hosts of rollout.sglang_url (attached servers) that are not this machine's loopback."""
    from opid_mega.infra.hosts import url_host

    hosts = [url_host(u) for u in cfg.rollout.sglang_url.split(",") if u.strip()] if cfg.rollout.sglang_url else []
    return [h for h in hosts if h not in ("localhost", "127.0.0.1", "::1") and not h.startswith("127.")]


def sync_problems(cfg: Config, method: str, gpu_cluster: bool, train_ids: list, groups: list) -> list[str]:
    """Weight-sync methods that cannot reach the servers (one line each, naming the key)."""
    out = []
    remote = _remote_attached(cfg)
    if method == "tensor" and remote:
        out.append(f"sync.method: tensor sends shared-memory / CUDA IPC handles, which open only on the machine that "
                   f"made them, and rollout.sglang_url names servers on {sorted(set(remote))}, where no rank of this "
                   "run feeds them; use sync.method=distributed or disk (auto picks disk)")
    launched = cfg.rollout.engine == "sglang" and not cfg.rollout.sglang_url
    if method == "distributed" and launched and gpu_cluster and cfg.deploy.mode == "colocated" and train_ids:
        shared = [g for g in groups if train_ids[0] in g]
        if shared:
            out.append(f"sync.method: distributed puts global rank 0 (GPU {train_ids[0]} of node 0) and the colocated "
                       f"rollout server on GPUs {shared[0]} in one NCCL group, and NCCL refuses two ranks of a group "
                       "on one GPU; use sync.method=tensor (each node's servers fed by CUDA IPC on that node) or auto")
    return out


def launch_lines(config: str, overrides: list, nodes: int, ranks: int, gpus_per_node: int) -> dict:
    """The exact commands that launch this plan (tools/launch/*): torchrun on each node, SLURM, Ray."""
    import shlex

    tail = " ".join(shlex.quote(x) for x in ["--config", config, *overrides])
    if nodes == 1:
        torchrun = f"tools/launch/torchrun.sh {tail}"
    else:
        torchrun = (f"NNODES={nodes} NPROC_PER_NODE={ranks} NODE_RANK=<0..{nodes - 1}> NODE_ADDR=<this node's "
                    f"address> RDZV_ENDPOINT=<node 0's address>:29400 RDZV_ID=<job id> tools/launch/torchrun.sh "
                    f"{tail}")
    return {"torchrun": torchrun + ("" if nodes == 1 else "   # on every node"),
            "slurm": f"sbatch --nodes {nodes} --gpus-per-node {gpus_per_node} tools/launch/opid.sbatch {tail}",
            "ray": f"python tools/launch/ray_launch.py --address auto --nodes {nodes} --trainers-per-node {ranks} "
                   f"{tail}"}


# --------------------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------------------


def layout_line(res: dict) -> str:
    lay, c = res["layout"], res["config"]
    sp = " SP" if lay["sp"] else ""
    vpp = f" VPP{lay['vpp']}" if lay["vpp"] > 1 else ""
    srv = ", ".join(str(g) for g in lay["rollout_groups"]) or "none"
    an = f", analyzer GPUs {lay['analyzer_gpus']} on node 0" if lay["analyzer_gpus"] else ""
    return (f"{c['nodes']}x{c['gpus_per_node']} {c['mode']}: TP{lay['tp']} PP{lay['pp']}{vpp}{sp} DP{lay['dp']} on "
            f"{lay['train_gpus_per_node']} training GPUs per node (world {lay['world']}); rollout servers per node "
            f"{srv}{an}")


def idle_line(res: dict) -> Optional[str]:
    """The GPUs no training rank, rollout server or analyzer uses, over every node (None: a CPU config)."""
    idle = res.get("idle_gpus")
    if idle is None:
        return None
    if not idle["count"]:
        return f"idle GPUs: none of {idle['of']}"
    where = "; ".join(f"node {x['node']}: GPU{'s' if len(x['gpus']) > 1 else ''} "
                      + ", ".join(str(g) for g in x["gpus"]) for x in idle["per_node"])
    return (f"idle GPUs: {idle['count']} of {idle['of']} ({where}): no training rank, rollout server or analyzer "
            "is placed on them (deploy.train_gpus_per_node / deploy.rollout_gpus / deploy.analyzer_gpus)")


def render(res: dict) -> str:
    m, t = res["memory"], res["time"]
    out = [f"model: {res['config']['model']} ({res['config']['hf_config']}), {res['params_total']:,} parameters, "
           f"{res['config']['dtype']}", "layout: " + layout_line(res)]
    if idle_line(res):
        out.append(idle_line(res))
    out.append("")
    out.append(f"memory per GPU, GiB (of {m['gpu_mem_gib']:g}): a training rank of the largest pipeline stage, "
               "then the SGLang servers, then every GPU of node 0")
    rows = [
        ("weights", m["weights_gib"], f"{m['params_rank']:,} parameters on the largest rank"),
        ("grads", m["grads_gib"], "fp32 main grads"),
        ("optimizer (used)", m["optimizer_gib"], "train.distributed_optimizer"),
        ("  unsharded", m["optimizer_unsharded_gib"], "fp32 main weights + 2 Adam moments"),
        ("  sharded over DP", m["optimizer_sharded_gib"], ""),
        ("  fp32 master (stays)", m["master_gib"], "on the GPU in every phase"),
        ("  Adam moments", m["moments_gib"], "to the host during rollout (colocated, deploy.offload_optimizer)"),
        ("activations (used)", m["activations_gib"], "train.recompute"),
        ("  no recompute", m["activations_none_gib"], f"{m['activation_bytes_per_token_layer']:.0f} B/token/layer"),
        ("  selective", m["activations_selective_gib"], ""),
        ("  full", m["activations_full_gib"], ""),
        ("fork scoring", m["scoring_gib"], f"{m['scoring_tokens']} tokens: layer {m['scoring_layer_gib']}, "
                                           f"prefix KV {m['scoring_prefix_kv_gib']}, head {m['scoring_head_gib']}"),
        ("training rank peak", m["train_peak_gib"], "weights + grads + optimizer + max(activations, scoring)"),
        ("trainer resident (rollout)", m["resident_in_rollout_gib"], "weights + grads + fp32 master (+ moments "
                                                                      "unless offloaded); colocated"),
        ("SGLang pool / server GPU", m["sglang_pool_gib"], f"weights {m['sglang_weights_gib']} + KV "
                                                          f"{m['sglang_kv_gib']} ({m['sglang_kv_tokens']:,} tokens); "
                                                          f"fraction of {m['sglang_free_at_start_gib']} GiB free"),
        ("analyzer pool", m["analyzer_pool_gib"], f"weights {m['analyzer_weights_gib']} + KV {m['analyzer_kv_gib']}"),
        ("reference (host)", m["host_reference_gib"], "CPU copy, not on the GPU"),
    ]
    for name, v, note in rows:
        out.append(f"  {name:<26}{v:>9.2f}  {note}")
    out.append("  per GPU of node 0 (training phase / rollout phase / peak):")
    for g in m["per_gpu"]:
        role = "+".join(x for x, on in (("train", g["train"]), (f"rollout x{g['rollout_servers']}", g["rollout_servers"]),
                                         ("analyzer", g["analyzer"])) if on) or "idle"
        out.append(f"    GPU {g['gpu']}: {g['training_phase_gib']:7.2f} / {g['rollout_phase_gib']:7.2f} / "
                   f"{g['peak_gib']:7.2f}  {role}")
    out.append(f"  largest GPU: GPU {m['gpu']} of node 0, {res['per_gpu_gib']:.2f} GiB")
    out.append("")
    out.append("iteration time (upper bounds), s:")
    for name, v, note in (
        ("rollout", t["rollout_s"], f"{t['rollout_tokens']:,} tokens at {t['decode_tok_s_per_gpu']:,.0f} tok/s x "
                                    f"{t['rollout_gpus']} GPUs"),
        ("analysis", t["analysis_s"], f"{t['analyzer_tokens']:,} tokens"),
        ("scoring", t["scoring_s"], f"{t['scoring_tflop']:,} TFLOP ({t['scoring_passes']} forward passes)"),
        ("training", t["training_s"], f"{t['training_tflop']:,} TFLOP"),
        ("weight sync", t["sync_s"], f"{t['sync_gb']} GB, {t['sync_method']}"),
        ("optimizer offload", t["offload_s"], ""),
        ("one after the other", t["sequential_s"], "the sum of the phases"),
        ("iteration", t["iteration_s"], f"x {t['iterations']} iterations = {t['run_h']} h; {res['assumptions']['phases']}"),
    ):
        out.append(f"  {name:<20}{v:>10.1f}  {note}")
    out.append("")
    out.append("assumptions:")
    out.extend(f"  {k}: {v}" for k, v in res["assumptions"].items())
    for n in res["notes"]:
        out.append(f"note: {n}")
    if res["config"]["nodes"] > 1 or res["layout"]["world"] > 1:
        out.append(f"a lost node ends the job within {res['node_lost_bound_s']:g} s, wherever its ranks are "
                   f"(deploy.heartbeat_timeout_s, one heartbeat, the shutdown); rank 0's own rollout, analysis and "
                   f"evaluation may take {res['control_timeout_s']:g} s (deploy.control_timeout_s)")
    if res.get("launch"):
        out.append("")
        out.append("launch (tools/launch/; the ranks per node and node count come from the config's deploy section):")
        out.extend(f"  {k:<9}{v}" for k, v in res["launch"].items())
    out.append("")
    if res["ok"]:
        out.append("plan: ok")
    else:
        out.append(f"plan: NOT ok ({len(res['errors'])} problem(s)):")
        out.extend(f"  error: {x}" for x in res["errors"])
    return "\n".join(out)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="opid-plan", description="Check an opid-train config's layout and placement "
                                 "against the model and the cluster; estimate per-GPU memory and iteration time.")
    ap.add_argument("--config", required=True, help="run config (YAML; `base:` includes allowed)")
    ap.add_argument("--nodes", type=int, default=None, help="override deploy.nodes")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="override deploy.gpus_per_node")
    ap.add_argument("--gpu-mem-gib", type=float, default=DEFAULTS["gpu_mem_gib"], help="GPU memory [80]")
    ap.add_argument("--mfu", type=float, default=DEFAULTS["mfu"], help="model FLOPs utilisation of scoring and "
                    "training [0.35]")
    ap.add_argument("--gpu-tflops", type=float, default=DEFAULTS["gpu_tflops"], help="peak dense TFLOP/s per GPU "
                    "[989: bf16 H100]")
    ap.add_argument("--sync-gbps", type=float, default=DEFAULTS["sync_gbps"], help="weight-sync bandwidth, Gbit/s [100]")
    ap.add_argument("--host-gbps", type=float, default=DEFAULTS["host_gbps"], help="GPU<->host bandwidth for the "
                    "optimizer offload, Gbit/s [200]")
    ap.add_argument("--decode-mfu", type=float, default=DEFAULTS["decode_mfu"], help="decode throughput as a fraction "
                    "of the GPU's peak FLOP/s at 2N FLOPs per token [0.05]")
    ap.add_argument("--decode-tok-s", type=float, default=DEFAULTS["decode_tok_s"], help="decode tokens/s per rollout "
                    "GPU (overrides --decode-mfu) [0: from --decode-mfu]")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return ap.parse_args(argv)


def main(argv: Optional[list] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    overrides = list(args.overrides)
    if args.nodes is not None:
        overrides.append(f"deploy.nodes={args.nodes}")
    if args.gpus_per_node is not None:
        overrides.append(f"deploy.gpus_per_node={args.gpus_per_node}")
    try:
        cfg = load_config(args.config, overrides)
        res = plan(cfg, gpu_mem_gib=args.gpu_mem_gib, mfu=args.mfu, gpu_tflops=args.gpu_tflops,
                   sync_gbps=args.sync_gbps, host_gbps=args.host_gbps, decode_mfu=args.decode_mfu,
                   decode_tok_s=args.decode_tok_s)
    except (ConfigError, PlanError) as e:
        print(f"opid-plan: {e}", file=sys.stderr)
        return 2
    if res["ok"]:
        lay = res["layout"]
        res["launch"] = launch_lines(args.config, overrides, res["config"]["nodes"], lay["train_gpus_per_node"],
                                     res["config"]["gpus_per_node"])
    try:
        print(json.dumps(res) if args.json else render(res))
    except BrokenPipeError:  # `opid-plan ... | head`
        sys.stderr.close()
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
