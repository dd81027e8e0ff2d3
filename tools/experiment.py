#!/usr/bin/env python
"""A seeded GRPO-vs-OPID experiment on one machine: `python tools/experiment.py --preset cpu`.

    python tools/experiment.py --preset cpu [--out DIR] [--seeds 1,2,3] [--arms grpo,opid,opid_late] [key=value ...]

Every arm x seed is its own `opid-train` subprocess on the same base config (the preset's YAML file plus its
overrides), with the same seeds, tasks and budget; arms differ only in `algo.mode` / `algo.placement` / λ
(ARMS). The runs go one after another, never two torch jobs at once, with OMP_NUM_THREADS unset so each
takes every core the machine gives it (`--threads N` sets it instead). Steps, each skipped when its output is
already complete (so an interrupted experiment continues where it stopped; an arm x seed whose run dir lacks any of
its metrics is rerun from its start):
  1. games      the TextWorld games of the train and held-out pools (2 generator processes; cached on disk)
  2. warm start `opid-sft` once (the `sft` section, skill sections included), cached under model.cache_dir by the
                hash of its inputs (OUT/warm_start.json names it); every run starts from it
                (`model.init_from=<that directory>`), so the arms are paired per seed
  3. probe      Δ = log π(y | h ⊕ s) − log π(y | h) of the warm start on the expert walkthrough responses of the
                held-out games, under the rule analyzer's skill of that same game (matching) and of another game
                (mismatched), both placements: positive on the expert-action tokens means the model reads skills
  4. runs       OUT/runs/<arm>/seed<k>/ (metrics.jsonl, config.yaml, train.log): held-out success WITHOUT skills at
                the fixed iterations of eval.interval (and before training)
  5. results    OUT/results.json, OUT/table.md (mean ± std over seeds of the final held-out success and of the area
                under the held-out success curve, the paired difference to GRPO, per-iteration scoring tokens and
                seconds, the skill share of the advantage), OUT/curves.png (mean and min–max band per arm); the
                sanity figures are printed.
`--preset smoke` is the same pipeline on a tiny budget (1 seed, 2 arms, 2 iterations) for tests.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python tools/experiment.py` from a checkout
    sys.path.insert(0, str(ROOT))

# Arm -> the overrides that make it (on top of the base config; nothing else differs between arms).
ARMS: dict[str, tuple[str, ...]] = {
    "grpo": ("algo.mode=grpo",),
    # the reference's GRPO baseline scripts (ALFWorld, WebShop; our TextWorld follows ALFWorld): mean_norm outcome
    # advantages, whatever the OPID arms' config uses (its ALFWorld-3B OPID script has mean_std_norm)
    "grpo_paper": ("algo.mode=grpo", "algo.outcome_mode=mean_norm"),
    "opid": ("algo.mode=opid", "algo.placement=faithful"),
    "opid_late": ("algo.mode=opid", "algo.placement=late"),
    "no_routing": ("algo.mode=no_routing", "algo.placement=faithful"),
    # λ 100x the reference's: added after the first table showed the skill term at ~0.01% of the advantage with
    # λ = 0.001 (a question about the scale of λ, not a value tuned on success; one value, never varied)
    "opid_lambda0.1": ("algo.mode=opid", "algo.placement=faithful", "algo.lambda_episode=0.1",
                       "algo.lambda_step=0.1"),
    # the full-distribution signal (docs/algorithm.md "Beyond the sampled token") at the λ of
    # opid_lambda0.1 (at the reference's 0.001 the skill term is ~0.01% of the advantage, so any signal would be GRPO
    # plus noise)
    "full_kl": ("algo.mode=opid", "algo.placement=faithful", "algo.lambda_episode=0.1", "algo.lambda_step=0.1",
                "algo.delta=full_kl"),
    "topk_kl": ("algo.mode=opid", "algo.placement=faithful", "algo.lambda_episode=0.1", "algo.lambda_step=0.1",
                "algo.delta=topk_kl"),
    # the dense version of the same gradient: the distillation loss through the original context (coefficient = that
    # λ; one value, not tuned), on top of opid_lambda0.1
    "distill": ("algo.mode=opid", "algo.placement=faithful", "algo.lambda_episode=0.1", "algo.lambda_step=0.1",
                "algo.distill_coef=0.1"),
}
BASELINE = "grpo"


@dataclass(frozen=True)
class Preset:
    config: str
    seeds: tuple
    arms: tuple
    overrides: tuple = field(default=())


PRESETS: dict[str, Preset] = {
    # ~60 min on 2 idle cores (docs/experiments.md has the measured budget)
    "cpu": Preset("configs/experiment_cpu.yaml", (1, 2, 3), ("grpo", "opid", "opid_late", "opid_lambda0.1")),
    # the full-distribution arms next to GRPO and OPID at the same λ (docs/algorithm.md "Beyond the sampled token")
    "divergence": Preset("configs/experiment_cpu.yaml", (1, 2, 3), ("grpo", "opid_lambda0.1", "full_kl", "topk_kl",
                                                                    "distill")),
    # the whole pipeline on a tiny budget (tests): 4 train / 4 held-out games, 2 iterations
    "smoke": Preset("configs/experiment_cpu.yaml", (1,), ("grpo", "opid"), (
        "env.options.pool_size.train=4", "env.options.pool_size.test=4", "env.max_steps=3",
        "rollout.tasks_per_iter=2", "rollout.group_size=2", "rollout.max_response_tokens=16",
        "train.iterations=2", "train.mini_batch_size=8", "train.micro_batch_tokens=2048",
        "eval.interval=1", "eval.num_tasks=4", "sft.epochs=2", "logging.progress=false")),
}


class ExperimentError(RuntimeError):
    """A step of the experiment failed; the message names the step and its log."""


# --------------------------------------------------------------------------------------------------------------------
# Metrics -> numbers (pure functions: tested on synthetic metrics)
# --------------------------------------------------------------------------------------------------------------------


def eval_steps(iterations: int, interval: int, before_training: bool = True) -> list[int]:
    """The iterations after which the trainer evaluates (opid_mega.trainer.should_evaluate): 0 when
    before_training, every `interval`, and the last one; none with interval 0."""
    if not interval:
        return []
    steps = [0] if before_training else []
    steps += [it for it in range(1, iterations + 1) if it % interval == 0 or it == iterations]
    return steps


def eval_curve(records: Sequence[dict], key: str = "eval/success_rate") -> list[tuple[int, float]]:
    """[(step, value)] of the records that carry `key` (merged per-step records, sorted by step)."""
    return [(int(r["step"]), float(r[key])) for r in sorted(records, key=lambda r: r["step"])
            if r.get(key) is not None]


def curve_auc(curve: Sequence[tuple[int, float]]) -> float:
    """Area under a success curve by the trapezoid rule, divided by its span of iterations: the mean held-out
    success over training, in [0, 1] (a one-point curve: that point)."""
    if not curve:
        return float("nan")
    if len(curve) == 1:
        return float(curve[0][1])
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(curve, curve[1:]))
    return area / (curve[-1][0] - curve[0][0])


def _mean_of(records: Sequence[dict], key: str) -> Optional[float]:
    vals = [float(r[key]) for r in records if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def _pooled_share(records: Sequence[dict]) -> Optional[float]:
    pairs = [(float(r["adv/skill_abs_mean"]), float(r["adv/outcome_abs_mean"])) for r in records
             if r.get("adv/skill_abs_mean") is not None and r.get("adv/outcome_abs_mean") is not None]
    skill, out = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return skill / (skill + out) if pairs and skill + out > 0 else None


def run_summary(records: Sequence[dict], iterations: int) -> dict:
    """One run's numbers: the held-out curve, its start / final / AUC, and per-iteration means over the training
    iterations 1..iterations of the scoring cost (`scoring/tokens`, `time/scoring`), the iteration time (sum of the
    `time/*` stages), the skill share of the advantage and the training success."""
    curve = eval_curve(records)
    train = [r for r in records if 1 <= r["step"] <= iterations]
    stage_sums = [sum(float(v) for k, v in r.items() if k.startswith("time/") and v is not None) for r in train]
    return {
        "curve": curve,
        "start": curve[0][1] if curve else None,
        "final": curve[-1][1] if curve else None,
        "auc": curve_auc(curve) if curve else None,
        "scoring_tokens": _mean_of(train, "scoring/tokens"),
        "scoring_s": _mean_of(train, "time/scoring"),
        "iteration_s": sum(stage_sums) / len(stage_sums) if stage_sums else None,
        "skill_share": _mean_of(train, "adv/skill_share"),
        # the same share from the iterations' pooled magnitudes (an iteration whose groups all tie has A_out = 0 and a
        # per-iteration share of 1)
        "skill_share_pooled": _pooled_share(train),
        "train_success": _mean_of(train, "train/success_rate"),
    }


def mean_std(values: Sequence[Optional[float]]) -> tuple[Optional[float], Optional[float]]:
    """(mean, sample standard deviation (n − 1)) of the non-missing values; std None for fewer than 2."""
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return None, None
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, None
    return m, math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))


def aggregate(summaries: dict[str, dict[int, dict]], baseline: str = BASELINE) -> dict[str, dict]:
    """summaries[arm][seed] -> per arm: seeds, mean/std of start, final, AUC, the paired difference to the
    baseline arm on the seeds both have (final and AUC), and the mean per-iteration costs."""
    out = {}
    base = summaries.get(baseline, {})
    for arm, by_seed in summaries.items():
        seeds = sorted(by_seed)
        row: dict = {"seeds": seeds}
        for key in ("start", "final", "auc", "scoring_tokens", "scoring_s", "iteration_s", "skill_share",
                    "skill_share_pooled", "train_success", "wall_s"):
            row[key] = mean_std([by_seed[s].get(key) for s in seeds])
        common = [s for s in seeds if s in base]
        for key in ("final", "auc"):
            diffs = [by_seed[s][key] - base[s][key] for s in common
                     if by_seed[s].get(key) is not None and base[s].get(key) is not None]
            row[f"{key}_vs_{baseline}"] = mean_std(diffs) if arm != baseline else (None, None)
        out[arm] = row
    return out


def mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, float, float, float, float]]:
    """[(step, mean, std, min, max)] over the seeds' curves, at the steps every curve has."""
    if not curves:
        return []
    common = set(s for s, _ in curves[0])
    for c in curves[1:]:
        common &= set(s for s, _ in c)
    out = []
    for step in sorted(common):
        ys = [dict(c)[step] for c in curves]
        m, sd = mean_std(ys)
        out.append((step, m, sd or 0.0, min(ys), max(ys)))
    return out


def _fmt(ms: tuple, digits: int = 3, signed: bool = False) -> str:
    m, sd = ms
    if m is None:
        return "–"
    text = f"{m:+.{digits}f}" if signed else f"{m:.{digits}f}"
    return text + (f" ± {sd:.{digits}f}" if sd is not None else "")


def markdown_table(agg: dict[str, dict], baseline: str = BASELINE) -> str:
    """The results table (mean ± sample std over seeds)."""
    head = ("| arm | seeds | held-out success, start | final | AUC (mean success over training) | final − "
            f"{baseline} (paired) | AUC − {baseline} (paired) | scoring tokens / iter | scoring s / iter | "
            "iteration s | skill share of the advantage (pooled) |")
    lines = [head, "|" + "---|" * 11]
    for arm, row in agg.items():
        tokens = row["scoring_tokens"][0]
        lines.append("| " + " | ".join([
            arm, str(len(row["seeds"])), _fmt(row["start"]), _fmt(row["final"]), _fmt(row["auc"]),
            _fmt(row[f"final_vs_{baseline}"], signed=True), _fmt(row[f"auc_vs_{baseline}"], signed=True),
            f"{tokens:,.0f}" if tokens is not None else "–", _fmt(row["scoring_s"], 2), _fmt(row["iteration_s"], 1),
            _fmt(row["skill_share_pooled"] if row["skill_share_pooled"][0] is not None else row["skill_share"], 4)])
            + " |")
    return "\n".join(lines) + "\n"


def plot_curves(curves: dict[str, list], path: Path, title: str = "Held-out success (no skills)",
                ylabel: str = "held-out success rate") -> Path:
    """One line per arm (mean over seeds) with its min–max band; matplotlib Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for arm, seed_curves in curves.items():
        pts = mean_curve(seed_curves)
        if not pts:
            continue
        x = [p[0] for p in pts]
        line, = ax.plot(x, [p[1] for p in pts], marker="o", label=f"{arm} (n={len(seed_curves)})")
        ax.fill_between(x, [p[3] for p in pts], [p[4] for p in pts], color=line.get_color(), alpha=0.15)
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title + ": mean over seeds, band = min–max")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def sanity_lines(agg: dict[str, dict], summaries: dict[str, dict[int, dict]], probe: Optional[dict]) -> list[str]:
    """The printed sanity figures: GRPO's held-out success start -> end, Δ of the warm start under the matching
    skill, the skill share of the advantage per OPID arm."""
    lines = []
    if BASELINE in summaries:
        per = ", ".join(f"seed {s}: {r['start']:.3f} -> {r['final']:.3f}"
                        for s, r in sorted(summaries[BASELINE].items())
                        if r.get("start") is not None and r.get("final") is not None)
        row = agg[BASELINE]
        gain = mean_std([r["final"] - r["start"] for r in summaries[BASELINE].values()
                         if r.get("final") is not None and r.get("start") is not None])
        lines.append(f"GRPO held-out success: start {_fmt(row['start'])} -> end {_fmt(row['final'])} "
                     f"(change {_fmt(gain, signed=True)}; {per})")
    if probe:
        parts = []
        for placement in ("faithful", "late"):
            p = probe.get(placement)
            if p:
                parts.append(f"{placement} {p['match']['action_mean']:+.3f} (mismatched skill "
                             f"{p['mismatch']['action_mean']:+.3f}; all response tokens "
                             f"{p['match']['response_mean']:+.3f})")
        lines.append(f"warm start Δ on expert-action tokens under the matching skill ({probe['steps']} steps of "
                     f"{probe['episodes']} held-out games, nats/token): " + "; ".join(parts))
    shares = [f"{arm} {row['skill_share_pooled'][0]:.4f} (mean of per-iteration shares {row['skill_share'][0]:.4f})"
              if row["skill_share_pooled"][0] is not None else f"{arm} {row['skill_share'][0]:.4f} (per iteration)"
              for arm, row in agg.items() if arm != BASELINE and row["skill_share"][0] is not None]
    if shares:
        lines.append("skill share of the advantage, Σ|λΔ| / (Σ|A_out| + Σ|λΔ|) pooled over iterations: "
                     + ", ".join(shares) + " (an iteration whose groups all tie has A_out = 0: share 1)")
    return lines


# --------------------------------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------------------------------


def child_env(threads: Optional[int]) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # the CLIs then take every core this process may use
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# The analyzer key never travels on a child's command line (visible in `ps`) nor into a record: an
# `analyzer.api_key=K` override is replaced by `analyzer.api_key=` + `analyzer.api_key_env=SECRET_ENV` and K is passed
# in the children's environment (opid_mega.config.resolve_api_key reads it there).
SECRET_ENV = "OPID_EXPERIMENT_ANALYZER_API_KEY"


def move_secrets(overrides: Sequence[str]) -> tuple[list, dict]:
    """(overrides without the analyzer key, the environment variables that carry it instead)."""
    out, env = [], {}
    for o in overrides:
        key, _, value = str(o).partition("=")
        if key.strip() == "analyzer.api_key":
            if value.strip():
                env[SECRET_ENV] = value.strip()
            else:
                env.pop(SECRET_ENV, None)
            continue
        out.append(str(o))
    if env:
        out += ["analyzer.api_key=", f"analyzer.api_key_env={SECRET_ENV}"]
    return out, env


def run_logged(name: str, cmd: list, log_path: Path, env: dict) -> float:
    """Run one step as a subprocess with its output in log_path; its wall seconds, or ExperimentError."""
    from opid_mega.infra.redact import redact_args

    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log_path, "w") as f:
        f.write("$ " + " ".join(redact_args(cmd)) + "\n")  # a secret in an override is shown as ***
        f.flush()
        rc = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if rc != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-25:])
        raise ExperimentError(f"{name} failed (exit {rc}); log {log_path}, last lines:\n{tail}")
    return time.time() - t0


def spec_of(config: str, overrides: Sequence[str]) -> dict:
    from opid_mega.infra.redact import redact_args

    text = (ROOT / config).read_text() if not Path(config).is_absolute() else Path(config).read_text()
    return {"config": config, "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "overrides": redact_args(overrides)}


def check_spec(out: Path, spec: dict) -> None:
    """OUT/experiment.json records the base config and overrides; a different spec in the same OUT is an error
    (its warm start and runs would not belong to this experiment)."""
    path = out / "experiment.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old != spec:
            raise ExperimentError(f"{out} holds an experiment with another base config or overrides ({path}: {old}); "
                                  f"use another --out, or delete {out}")
    else:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(spec, indent=1) + "\n")


def find_warm_start(record: Path) -> Optional[Path]:
    """The warm start OUT/warm_start.json names, when that directory is complete (opid-sft's marker file)."""
    if not record.exists():
        return None
    path = Path(json.loads(record.read_text())["path"])
    return path if (path / ".opid_sft_complete").exists() else None


def task_pools(cfg):
    """(env, the train and eval pools' tasks) of an env with task pools (TextWorld, ALFWorld), else (env, [])."""
    from opid_mega.envs import make_env

    env = make_env(cfg.env.name, max_steps=cfg.env.max_steps, **dict(cfg.env.options))
    if not hasattr(env, "task_pool"):
        return env, []
    return env, [t for split in (cfg.env.train_split, cfg.env.eval_split) for t in env.task_pool(split)]


def load_base(config: str, overrides: Sequence[str]):
    from opid_mega.config import load_config

    return load_config(str(config if Path(config).is_absolute() else ROOT / config), list(overrides))


def generate_shard(config: str, overrides: Sequence[str], shard: int, nshards: int) -> int:
    """Generate (or find cached) the games of tasks shard, shard + nshards, ... of the train + eval pools."""
    env, tasks = task_pools(load_base(config, overrides))
    mine = tasks[shard::nshards]
    if mine and hasattr(env, "prepare"):
        env.prepare(mine)
    env.close()
    return len(mine)


def missing_games(cfg) -> int:
    env, tasks = task_pools(cfg)
    n = env.unprepared(tasks) if tasks and hasattr(env, "unprepared") else 0
    env.close()
    return n


def prepare_games(config: str, overrides: Sequence[str], cfg, env: dict, logs: Path, jobs: int = 2) -> float:
    """Generate the missing games of the train and eval pools with `jobs` processes (no torch in them)."""
    missing = missing_games(cfg)
    if not missing:
        return 0.0
    print(f"[games] generating {missing} {cfg.env.name} games with {jobs} processes (cached on disk)", flush=True)
    t0 = time.time()
    procs = []
    logs.mkdir(parents=True, exist_ok=True)
    for k in range(jobs):
        log = logs / f"games_{k}.log"
        f = open(log, "w")
        cmd = [sys.executable, str(Path(__file__).resolve()), "_games", config, str(k), str(jobs), *overrides]
        procs.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT), f, log))
    failed = []
    for p, f, log in procs:
        if p.wait() != 0:
            failed.append(str(log))
        f.close()
    if failed:
        raise ExperimentError(f"game generation failed; logs: {', '.join(failed)}")
    return time.time() - t0


# --------------------------------------------------------------------------------------------------------------------
# Probe: does the warm start read skills?
# --------------------------------------------------------------------------------------------------------------------


def response_tokens(tokenizer, response: str, action: str) -> tuple[list[int], list[bool]]:
    """The response's token ids (as the warm start and the rollout tokenize it) and which of them overlap an
    occurrence of the action text (in the <think> line and in the <action> tag)."""
    enc = tokenizer(response, add_special_tokens=False, return_offsets_mapping=True)
    spans, start = [], 0
    while action and (k := response.find(action, start)) >= 0:
        spans.append((k, k + len(action)))
        start = k + 1
    mask = [any(a < e and b > s for s, e in spans) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def probe_delta(cfg, model_dir: str, split: Optional[str] = None) -> dict:
    """Δ_t = log π(y_t | h ⊕ s, y_<t) − log π(y_t | h, y_<t) of the model in `model_dir` (HF forward, logits at
    the sampling temperature rollout.temperature) on the expert walkthrough responses of the split's pool (default: the
    held-out eval split). s: the rule analyzer's skill of that same expert episode routed critical-first
    (`opid_mega.sft.expert_skill_routes`, "match"), or the skill another game routes to the same step index where
    that game's expert action differs ("mismatch"); both placements. Means in nats per token."""
    import torch

    from opid_mega.models import load_model, load_tokenizer
    from opid_mega.rollout.agent_loop import PromptTokenizer
    from opid_mega.sft import end_of_turn_id, expert_episodes, expert_skill_routes
    from opid_mega.skills.injection import PLACEMENTS, inject_skills

    split = split or cfg.env.eval_split
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, cfg.model.dtype)
    prompts = PromptTokenizer(tok, enable_thinking=cfg.model.enable_thinking)
    end, temp = end_of_turn_id(tok), float(cfg.rollout.temperature)
    episodes = expert_episodes(cfg, split=split)
    routes = [expert_skill_routes(cfg, ep) for ep in episodes]

    @torch.no_grad()
    def logprobs(prompt_ids: list, resp_ids: list) -> torch.Tensor:
        ids = torch.tensor([prompt_ids + resp_ids])
        logits = model(input_ids=ids, logits_to_keep=len(resp_ids) + 1).logits[0, :-1].double() / temp
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp_ids)[:, None])[:, 0]

    acc = {p: {c: {"action": [], "response": [], "step_means": [], "episode": [], "step": []}
               for c in ("match", "mismatch")} for p in PLACEMENTS}
    steps = 0
    for e, ep in enumerate(episodes):
        for t, (prompt, response, action) in enumerate(zip(ep["prompts"], ep["responses"], ep["actions"])):
            route = routes[e][t]
            if not route:
                continue
            other = next((routes[j][t] for j in list(range(e + 1, len(episodes))) + list(range(e))
                          if t < len(routes[j]) and routes[j][t] and episodes[j]["actions"][t] != action), None)
            ids, amask = response_tokens(tok, response, action)
            ids, amask = ids + [end], torch.tensor(amask + [False])
            base = logprobs(prompts.encode(prompt)[0], ids)
            steps += 1
            for placement in PLACEMENTS:
                for case, skill in (("match", route), ("mismatch", other)):
                    if not skill:
                        continue
                    d = logprobs(prompts.encode(inject_skills(prompt, skill, placement))[0], ids) - base
                    a = acc[placement][case]
                    a["action"] += d[amask].tolist()
                    a["response"] += d.tolist()
                    a["step_means"].append(float(d[amask].mean()))
                    kind = "step" if "step" in skill else "episode"
                    a[kind] += d[amask].tolist()

    def avg(xs):
        return sum(xs) / len(xs) if xs else None

    out = {"split": split, "episodes": len(episodes), "steps": steps, "temperature": temp, "model": str(model_dir)}
    for placement in PLACEMENTS:
        out[placement] = {case: {"action_mean": avg(a["action"]), "response_mean": avg(a["response"]),
                                 "positive_step_share": avg([float(m > 0) for m in a["step_means"]]),
                                 "episode_skill_action_mean": avg(a["episode"]),
                                 "step_skill_action_mean": avg(a["step"]), "steps": len(a["step_means"])}
                          for case, a in acc[placement].items()}
    return out


# --------------------------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------------------------


def run_overrides(arm: str, seed: int, warm: Path, run_dir: Path) -> list[str]:
    return list(ARMS[arm]) + [f"train.seed={seed}", f"model.init_from={warm}", f"logging.run_dir={run_dir}"]


def run_is_complete(run_dir: Path, expected_config: dict, iterations: int, steps: Sequence[int]) -> bool:
    """The run dir holds this exact config and every metric the table needs: a training record at the last
    iteration and a held-out success at each evaluation step."""
    import yaml

    from opid_mega.metrics import read_metrics

    cfg_file, metrics = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    if not (cfg_file.exists() and metrics.exists()):
        return False
    if yaml.safe_load(cfg_file.read_text()) != expected_config:
        return False
    try:
        by_step = {r["step"]: r for r in read_metrics(run_dir)}
    except ValueError:
        return False
    if iterations and by_step.get(iterations, {}).get("train/success_rate") is None:
        return False
    return all(by_step.get(s, {}).get("eval/success_rate") is not None for s in steps)


def collect(out: Path, arms: Sequence[str], seeds: Sequence[int], iterations: int) -> dict[str, dict[int, dict]]:
    """summaries[arm][seed] of the runs that exist (run_summary + the run's wall seconds)."""
    from opid_mega.metrics import read_metrics

    summaries: dict[str, dict[int, dict]] = {}
    for arm in arms:
        for seed in seeds:
            run_dir = out / "runs" / arm / f"seed{seed}"
            if not (run_dir / "metrics.jsonl").exists():
                continue
            s = run_summary(read_metrics(run_dir), iterations)
            info = run_dir / "experiment_run.json"
            s["wall_s"] = json.loads(info.read_text()).get("wall_s") if info.exists() else None
            summaries.setdefault(arm, {})[seed] = s
    return summaries


def write_results(out: Path, spec: dict, summaries: dict, probe: Optional[dict], timings: dict) -> dict:
    agg = aggregate(summaries)
    table = markdown_table(agg)
    (out / "table.md").write_text(table)
    curves = {arm: [s["curve"] for _, s in sorted(by_seed.items())] for arm, by_seed in summaries.items()}
    if any(curves.values()):
        plot_curves(curves, out / "curves.png")
    sanity = sanity_lines(agg, summaries, probe)
    results = {"spec": spec, "arms": {a: list(ARMS[a]) for a in summaries}, "aggregate": agg,
               "runs": {a: {str(s): v for s, v in by.items()} for a, by in summaries.items()},
               "probe_delta": probe, "sanity": sanity, "timings_s": timings}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return results


def parse_list(text: Optional[str], kind=str) -> Optional[list]:
    if text is None:
        return None
    items = [x.strip() for x in text.split(",") if x.strip()]
    try:
        return [kind(x) for x in items]
    except ValueError:
        raise ExperimentError(f"cannot read {text!r} as a comma-separated list of {kind.__name__}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_games":  # internal: one game-generation shard
        config, shard, nshards, *overrides = argv[1:]
        generate_shard(config, overrides, int(shard), int(nshards))
        return 0
    if argv and argv[0] == "_probe":  # internal: the Δ probe of a model directory, as JSON
        config, model_dir, out_json, *overrides = argv[1:]
        from opid_mega.infra.runtime import configure_threads, filter_dependency_warnings

        filter_dependency_warnings()
        configure_threads()
        result = probe_delta(load_base(config, overrides), model_dir)
        Path(out_json).write_text(json.dumps(result, indent=1) + "\n")
        return 0

    p = argparse.ArgumentParser(prog="tools/experiment.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--out", help="output directory (default: runs/experiment_<preset>)")
    p.add_argument("--seeds", help="comma-separated seeds (default: the preset's)")
    p.add_argument("--arms", help=f"comma-separated arms out of {', '.join(ARMS)} (default: the preset's)")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of every subprocess (default: unset, all cores)")
    p.add_argument("--gen-jobs", type=int, default=2, help="game-generation processes (default 2)")
    p.add_argument("--jobs", type=int, default=1,
                   help="training runs at once (default 1; give each its cores with --threads: their wall times are "
                        "then measured side by side)")
    p.add_argument("--report-only", action="store_true", help="only aggregate the runs that exist")
    p.add_argument("overrides", nargs="*", help="extra key.sub=value overrides of the base config (every arm)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    try:
        return _run(args)
    except ExperimentError as e:
        print(f"experiment: {e}", file=sys.stderr)
        return 1


def _run(args) -> int:
    import yaml

    from opid_mega.config import ConfigError, dump_config

    preset = PRESETS[args.preset]
    seeds = parse_list(args.seeds, int) or list(preset.seeds)
    arms = parse_list(args.arms) or list(preset.arms)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ExperimentError(f"unknown arm(s) {', '.join(unknown)}; allowed: {', '.join(ARMS)}")
    if len(set(seeds)) != len(seeds) or len(set(arms)) != len(arms):
        raise ExperimentError("--seeds and --arms must not repeat an item")
    overrides, secret_env = move_secrets(list(preset.overrides) + list(args.overrides))
    try:
        cfg = load_base(preset.config, overrides)
    except ConfigError as e:
        raise ExperimentError(f"config error: {e}") from None
    out = Path(args.out or ROOT / "runs" / f"experiment_{args.preset}").resolve()
    spec = spec_of(preset.config, overrides)
    check_spec(out, spec)
    logs, warm_file, probe_file = out / "logs", out / "warm_start.json", out / "probe_delta.json"
    warm = find_warm_start(warm_file)
    timings_file = out / "timings.json"
    timings = json.loads(timings_file.read_text()) if timings_file.exists() else {}
    iterations = cfg.train.iterations
    steps = eval_steps(iterations, cfg.eval.interval, cfg.eval.before_training)
    if not steps or not cfg.eval.num_tasks:
        raise ExperimentError("the experiment needs held-out evaluations: eval.interval > 0 and eval.num_tasks > 0")
    env = {**child_env(args.threads), **secret_env}
    py = sys.executable
    config_path = str(ROOT / preset.config)

    def save_timings():
        timings_file.write_text(json.dumps(timings, indent=1) + "\n")

    if not args.report_only:
        print(f"experiment: {out} — arms {', '.join(arms)}; seeds {', '.join(map(str, seeds))}; {iterations} "
              f"iterations, held-out evaluation at {steps} on {cfg.eval.num_tasks} tasks", flush=True)
        t = prepare_games(preset.config, overrides, cfg, env, logs, args.gen_jobs)
        if t:
            timings["games"] = timings.get("games", 0.0) + t
            save_timings()
        warm = find_warm_start(warm_file)
        if warm is None:
            print(f"[warm start] opid-sft (cached under model.cache_dir; log {logs / 'warm_start.log'})", flush=True)
            cmd = [py, "-c", "import sys; from opid_mega.cli import sft_main; sys.exit(sft_main())",
                   "--config", config_path, *overrides]
            timings["warm_start"] = run_logged("warm start (opid-sft)", cmd, logs / "warm_start.log", env)
            save_timings()
            # opid-sft prints the directory of the warm start (built or found in the cache) as its last line
            lines = [ln.strip() for ln in (logs / "warm_start.log").read_text().splitlines()]
            path = next((ln for ln in reversed(lines) if ln and (Path(ln) / ".opid_sft_complete").exists()), "")
            warm_file.write_text(json.dumps({"path": path}) + "\n")
            warm = find_warm_start(warm_file) if path else None
            if warm is None:
                raise ExperimentError(f"opid-sft finished without a complete warm start ({warm_file}, "
                                      f"log {logs / 'warm_start.log'})")
        print(f"[warm start] {warm}", flush=True)
        if not probe_file.exists():
            print("[probe] Δ of the warm start under matching / mismatched skills", flush=True)
            cmd = [py, str(Path(__file__).resolve()), "_probe", preset.config, warm, probe_file, *overrides]
            timings["probe"] = run_logged("Δ probe", cmd, logs / "probe.log", env)
            save_timings()
        todo = [(seed, arm) for seed in seeds for arm in arms]
        runs = []  # (label, run directory, its overrides, its expected config): the runs still to train
        for k, (seed, arm) in enumerate(todo, 1):
            run_dir = out / "runs" / arm / f"seed{seed}"
            extra = run_overrides(arm, seed, warm, run_dir)
            expected = yaml.safe_load(dump_config(load_base(preset.config, overrides + extra)))
            if run_is_complete(run_dir, expected, iterations, steps):
                print(f"[{k}/{len(todo)}] {arm} seed {seed}: complete, skipped", flush=True)
            else:
                runs.append((f"[{k}/{len(todo)}] {arm} seed {seed}", run_dir, extra, expected))

        def train(label: str, run_dir: Path, extra: list, expected: dict) -> float:
            from opid_mega.metrics import read_metrics

            print(f"{label}: opid-train (log {run_dir / 'train.log'})", flush=True)
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = [py, "-m", "opid_mega.cli", "--config", config_path, "--run-dir", run_dir, *overrides, *extra]
            wall = run_logged(label, cmd, run_dir / "train.log", env)
            (run_dir / "experiment_run.json").write_text(json.dumps({"wall_s": wall, "overrides": extra}) + "\n")
            if not run_is_complete(run_dir, expected, iterations, steps):
                raise ExperimentError(f"{label} finished without all its metrics ({run_dir})")
            s = run_summary(read_metrics(run_dir), iterations)
            print(f"{label}: done in {wall / 60:.1f} min: held-out success {s['start']:.3f} -> {s['final']:.3f}, "
                  f"AUC {s['auc']:.3f}", flush=True)
            return wall

        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(args.jobs)  # --jobs runs at once, each a subprocess; their results in order
        try:
            for (label, run_dir, extra, expected), done in [(r, pool.submit(train, *r)) for r in runs]:
                timings.setdefault("runs", {})[f"{run_dir.parent.name}/{run_dir.name}"] = done.result()
                save_timings()
        finally:  # a failed run: the runs not started yet are not started, those running finish
            pool.shutdown(cancel_futures=True)

    probe = json.loads(probe_file.read_text()) if probe_file.exists() else None
    summaries = collect(out, arms, seeds, iterations)
    if not summaries:
        raise ExperimentError(f"no runs in {out / 'runs'} yet")
    timings["total_measured"] = (timings.get("games", 0.0) + timings.get("warm_start", 0.0) + timings.get("probe", 0.0)
                                 + sum(timings.get("runs", {}).values()))
    if not args.report_only:
        save_timings()
    results = write_results(out, spec, summaries, probe, timings)
    print()
    print((out / "table.md").read_text())
    for line in results["sanity"]:
        print("sanity: " + line)
    print(f"measured time: {timings['total_measured'] / 60:.1f} min in all (games {timings.get('games', 0) / 60:.1f}, "
          f"warm start {timings.get('warm_start', 0) / 60:.1f}, probe {timings.get('probe', 0) / 60:.1f}, runs "
          f"{sum(timings.get('runs', {}).values()) / 60:.1f})")
    print(f"results: {out / 'results.json'}, {out / 'table.md'}, {out / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
