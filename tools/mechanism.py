#!/usr/bin/env python
"""The pre-registered mechanism experiment on footprints, version 2 (docs/experiments.md "Mechanism experiment";
version 1 is archived in docs/mechanism_archive/v1/).

    python tools/mechanism.py probe    [--out DIR]        # warm start + its probe preconditions (archived)
    python tools/mechanism.py lambda   [--out DIR]        # λ from the rule: two warm-start batches, no update
    python tools/mechanism.py prereg   [--out DIR]        # writes docs/mechanism_prereg.json and the committed warm
                                                          # start docs/mechanism_archive/v2/warm_start/ (commit both)
    python tools/mechanism.py run      [--out DIR] [--arms a,b] [--seeds 1,2]   # the arms, gated by the prereg
    python tools/mechanism.py report   [--out DIR]        # docs/mechanism_results.{json,md}, mechanism_curves.png,
                                                          # docs/mechanism_archive/v2/ (the small records of DIR)

The runs refuse any arm, seed, config file or override that docs/mechanism_prereg.json does not hold (the config
file's sha256, the warm start's weights hash and λ are checked too) and watch the machine stays idle while they
run. The warm start is committed (1.6 MB: tiny-qwen3-footprints); on a machine without DIR's record of it, it is
assembled from the committed files and the built-in model's tokenizer. Every step's output is kept under DIR
(default runs/mechanism_v2): the warm start log, probe.json, the λ calibration run with its advantages.jsonl, one
eval-only run per seed (the 0-rollout point, shared by the arms of that seed) and runs/<arm>/seed<k>/. DIR is not
committed; `report` copies its small records (ARCHIVED) into docs/mechanism_archive/v2/, and the committed
docs/mechanism_results.json is the record of every run: on a machine without a run's directory, `run` does not run
it again and `report` keeps its committed values (GRPO seed 1 runs again while the lr guard is not decided on this
machine; a rerun of a committed run is checked against its record).

A positive and a negative control for the pipeline with a privileged hindsight analyzer, not a reproduction of
the paper's LLM-analyzer result.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import experiment as ex  # noqa: E402  (tools/experiment.py: run_logged, run_summary, child_env, ...)

CONFIG = "configs/mechanism_footprints.yaml"
PREREG = ROOT / "docs" / "mechanism_prereg.json"


# Arm -> overrides on top of CONFIG ("{lam}": λ from the pre-registered rule). Written into the prereg; the runs
# read them back from it.
ARMS = {
    "grpo": ["algo.mode=grpo"],
    "opid_rule": ["algo.mode=opid", "algo.placement=faithful", "algo.lambda_episode={lam}",
                  "algo.lambda_step={lam}"],
    "opid_shuffled": ["algo.mode=opid", "algo.placement=faithful", "algo.lambda_episode={lam}",
                      "algo.lambda_step={lam}", "algo.skill_source=shuffled"],
    "skill_grpo": ["algo.mode=skill_grpo", "eval.with_skills=true"],
    "opid_ref": ["algo.mode=opid", "algo.placement=faithful", "algo.lambda_episode=0.001", "algo.lambda_step=0.001"],
    "grpo_mean_norm": ["algo.mode=grpo", "algo.outcome_mode=mean_norm"],
}
# The order of the runs, interleaved by seed so an interrupted experiment leaves complete pairs (EXPERIMENT.md).
# Version 2's amendment 1 (before any OPID result: a run takes ~1.1 min, not the ~8 min the design was sized for):
# seeds 1-10 for the three phase-1 arms, skill_grpo and phase 2 on seeds 1-5.
SCHEDULE = ([(s, a) for s in range(1, 11) for a in ("grpo", "opid_rule", "opid_shuffled")]
            + [(s, "skill_grpo") for s in range(1, 6)]
            + [(s, a) for s in range(1, 6) for a in ("opid_ref", "grpo_mean_norm")])
PHASES = {"1": ["grpo x seeds 1-10", "opid_rule x seeds 1-10", "opid_shuffled x seeds 1-10",
                "skill_grpo x seeds 1-5 (eval with and without skills)"],
          "2": ["opid_ref (λ 0.001) x seeds 1-5", "grpo_mean_norm x seeds 1-5"]}
PRECONDITIONS = {"no_skill_success": [0.08, 0.25], "door_accuracy_with_right_section_min": 0.8,
                 "delta_match_min": 0.5, "delta_mismatch_max": -1.0}
# The door probe scores the first PROBE_GAMES held-out games (64 x 13 contexts x 5 doors: ~2 min on 2 cores; all
# 256 took 7 min in the first probe); the no-skill success precondition uses all 256 (opid-eval).
PROBE_GAMES = 64


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def machine_info() -> dict:
    """The CPU and torch's kernel level: float results (a warm start's bytes) can differ between machines."""
    import platform

    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def weights_hash(model_dir: Path) -> str:
    """sha256 over the warm start's weight files (name and bytes), in name order."""
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")) + sorted(Path(model_dir).glob("*.bin")):
        h.update(f.name.encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()[:16]


def load_cfg(overrides: Sequence[str] = ()):
    return ex.load_base(CONFIG, list(overrides))


# --------------------------------------------------------------------------------------------------------------------
# Warm start and its probe
# --------------------------------------------------------------------------------------------------------------------


ARCHIVE = ROOT / "docs" / "mechanism_archive" / "v2"
# The committed warm start (the pre-registration fixes its weights hash): its weights, config and opid-sft record;
# the tokenizer files come from the built-in model (model.builtin) it was trained from.
WARM_DIR = ARCHIVE / "warm_start"
WARM_FILES = ("config.json", "generation_config.json", "model.safetensors", "sft.json")


TOKENIZER_FINGERPRINT = "tokenizer_fingerprint.json"


def tokenizer_fingerprint(model_dir: Path) -> str:
    """sha256 (16 hex digits) of a model directory's tokenizer: its piece -> id map. The committed warm start's ids
    mean something only with the tokenizer it was trained with."""
    from opid_mega.models import load_tokenizer

    vocab = sorted(load_tokenizer(str(model_dir)).get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def commit_warm_start(warm: Path, dest: Path = WARM_DIR) -> list:
    """Copies the warm start's WARM_FILES into DEST (committed with the pre-registration) and writes its tokenizer's
    fingerprint there; the files copied."""
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in WARM_FILES:
        if (warm / name).exists():
            shutil.copyfile(warm / name, dest / name)
            copied.append(name)
    if "model.safetensors" not in copied:
        raise ex.ExperimentError(f"the warm start {warm} has no model.safetensors")
    (dest / TOKENIZER_FINGERPRINT).write_text(json.dumps({"sha256_16": tokenizer_fingerprint(warm)}) + "\n")
    return copied


def assemble_warm_start(src: Path, base: Path, target: Path) -> Path:
    """TARGET: a complete warm-start model directory from the committed files in SRC and the tokenizer files of the
    built-in model directory BASE (everything of BASE but its weights, config and build marker)."""
    import shutil

    if (target / ".opid_sft_complete").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for f in sorted(base.iterdir()):
        if f.is_file() and f.suffix not in (".safetensors", ".bin") and not f.name.startswith(".") \
                and f.name not in WARM_FILES:
            shutil.copyfile(f, tmp / f.name)
    for name in WARM_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, tmp / name)
    if (src / TOKENIZER_FINGERPRINT).exists():
        want = json.loads((src / TOKENIZER_FINGERPRINT).read_text())["sha256_16"]
        got = tokenizer_fingerprint(tmp)
        if got != want:
            shutil.rmtree(tmp)
            raise ex.ExperimentError(f"the tokenizer of {base} (fingerprint {got}) is not the one the committed warm "
                                     f"start {src} was trained with ({want}): opid_mega/data/footprints_vocab.json "
                                     "changed since")
    (tmp / ".opid_sft_complete").write_text(f"committed warm start {src}\n")
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def warm_start(out: Path, env: dict) -> Path:
    """The warm start: the one OUT/warm_start.json records; else the committed one (WARM_DIR, assembled into
    OUT/warm_start_model); else opid-sft on CONFIG (cached), its log archived in OUT/logs/warm_start.log."""
    record = out / "warm_start.json"
    warm = ex.find_warm_start(record)
    if warm is not None:
        return warm
    if (WARM_DIR / "model.safetensors").exists():
        from opid_mega.models import prepare_model

        cfg = load_cfg()
        path = assemble_warm_start(WARM_DIR, Path(prepare_model(cfg.model.builtin, cfg.model.cache_dir)),
                                   out / "warm_start_model")
        record.write_text(json.dumps({"path": str(path), "from_committed": str(WARM_DIR.relative_to(ROOT)),
                                      "weights_sha256_16": weights_hash(path), "machine": machine_info()}) + "\n")
        return path
    log = out / "logs" / "warm_start.log"
    cmd = [sys.executable, "-c", "import sys; from opid_mega.cli import sft_main; sys.exit(sft_main())",
           "--config", str(ROOT / CONFIG)]
    wall = ex.run_logged("warm start (opid-sft)", cmd, log, env)
    lines = [ln.strip() for ln in log.read_text().splitlines()]
    path = next((ln for ln in reversed(lines) if ln and (Path(ln) / ".opid_sft_complete").exists()), "")
    if not path:
        raise ex.ExperimentError(f"opid-sft finished without a warm start (log {log})")
    record.write_text(json.dumps({"path": path, "wall_s": wall, "weights_sha256_16": weights_hash(Path(path)),
                                  "machine": machine_info()}) + "\n")
    return Path(path)


def door_colour(action: str) -> str:
    return action.split()[1]


def probe_doors(cfg, model_dir: str) -> dict:
    """The warm start at the hall of every held-out game (the expert's routine steps before it): the log-prob of each
    of the five door responses without a section and under sections naming a door (the hindsight analyzer's three
    formats x both placements), at the sampling temperature rollout.temperature.
      door accuracy: the share of (game, format, placement) where the section names the right door R and R's
        response has the highest log-prob of the five (and the same without a section: chance is 0.2);
      Δ on the door token: log π(y_d | h ⊕ s) − log π(y_d | h) on the tokens of the first mention of the colour in
        R's response (the decision; the <action> tag then copies it), 'match' when s names R, 'mismatch' when s names
        another door X (drawn per game)."""
    import torch

    from opid_mega.envs import format_response
    from opid_mega.models import load_model, load_tokenizer
    from opid_mega.rollout.agent_loop import PromptTokenizer
    from opid_mega.sft import end_of_turn_id, expert_episodes, section_analyzer
    from opid_mega.skills.injection import PLACEMENTS, inject_skills

    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, cfg.model.dtype)
    prompts = PromptTokenizer(tok, enable_thinking=cfg.model.enable_thinking)
    end, temp = end_of_turn_id(tok), float(cfg.rollout.temperature)
    analyzer = section_analyzer(cfg)
    rng = random.Random(20261202)

    @torch.no_grad()
    def logprobs(prompt: str, resp_ids: list) -> torch.Tensor:
        p = prompts.encode(prompt)[0]
        ids = torch.tensor([p + resp_ids])
        logits = model(input_ids=ids, logits_to_keep=len(resp_ids) + 1).logits[0, :-1].double() / temp
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp_ids)[:, None])[:, 0]

    def response(action: str) -> tuple[list, list]:
        text = format_response(action, cfg.sft.think.format(action=action))
        ids, mask = ex.response_tokens(tok, text, door_colour(action))
        first = []  # the tokens of the colour's first occurrence only
        for k, m in enumerate(mask):
            if m:
                first.append(k)
            elif first:
                break
        return ids + [end], first

    acc = {"no_section": [], "match": {}, "mismatch": {}}
    correct_with = {}
    games = 0
    for ep in expert_episodes(cfg, split=cfg.env.eval_split)[:PROBE_GAMES]:
        t = next((k for k, d in enumerate(ep["decisions"]) if d), None)
        if t is None:
            continue
        games += 1
        options, prompt, right = ep["decisions"][t], ep["prompts"][t], ep["actions"][t]
        resp = {o: response(o) for o in options}
        base = {o: logprobs(prompt, resp[o][0]) for o in options}
        acc["no_section"].append(float(max(options, key=lambda o: float(base[o].sum())) == right))
        wrong = rng.choice([o for o in options if o != right])
        for f, (sec_r, sec_w) in enumerate(zip(analyzer.decision_sections(right, options, rng),
                                               analyzer.decision_sections(wrong, options, rng))):
            for placement in sorted(PLACEMENTS):
                key = f"format{f}/{placement}"
                with_r = {o: logprobs(inject_skills(prompt, sec_r, placement), resp[o][0]) for o in options}
                correct_with.setdefault(key, []).append(
                    float(max(options, key=lambda o: float(with_r[o].sum())) == right))
                ids, first = resp[right]
                acc["match"].setdefault(key, []).extend((with_r[right] - base[right])[first].tolist())
                d_w = logprobs(inject_skills(prompt, sec_w, placement), ids) - base[right]
                acc["mismatch"].setdefault(key, []).extend(d_w[first].tolist())

    def m(xs):
        return sum(xs) / len(xs) if xs else None

    match = [x for v in acc["match"].values() for x in v]
    mismatch = [x for v in acc["mismatch"].values() for x in v]
    doors = [x for v in correct_with.values() for x in v]
    return {"games": games, "temperature": temp, "model": str(model_dir),
            "door_accuracy_no_section": m(acc["no_section"]),
            "door_accuracy_with_right_section": m(doors),
            "door_accuracy_with_right_section_by_format": {k: m(v) for k, v in correct_with.items()},
            "delta_door_match": m(match), "delta_door_mismatch": m(mismatch),
            "delta_door_match_by_format": {k: m(v) for k, v in acc["match"].items()},
            "delta_door_mismatch_by_format": {k: m(v) for k, v in acc["mismatch"].items()}}


def eval_only(out: Path, warm: Path, seed: int, env: dict) -> dict:
    """The held-out success of the warm start without skills (opid-eval: the same tasks and sampling seed as a
    training run's evaluation before training), archived as OUT/eval0/seed<k>.json: the 0-rollout point of seed k."""
    path = out / "eval0" / f"seed{seed}.json"
    if path.exists():
        return json.loads(path.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    log = out / "eval0" / f"seed{seed}.log"
    cmd = [sys.executable, "-c", "import sys; from opid_mega.cli import eval_main; sys.exit(eval_main())",
           "--config", str(ROOT / CONFIG), "--model", str(warm), f"train.seed={seed}"]
    wall = ex.run_logged(f"eval-only seed {seed}", cmd, log, env)
    line = next(ln for ln in reversed(log.read_text().splitlines()) if ln.startswith("{"))
    result = {**json.loads(line), "wall_s": wall, "seed": seed}
    path.write_text(json.dumps(result) + "\n")
    return result


def cmd_probe(out: Path, env: dict) -> dict:
    warm = warm_start(out, env)
    probe_file = out / "probe.json"
    if not probe_file.exists():
        from opid_mega.infra.runtime import configure_threads

        configure_threads()
        probe = probe_doors(load_cfg(), str(warm))
        probe_file.write_text(json.dumps(probe, indent=1) + "\n")
    probe = json.loads(probe_file.read_text())
    probe["no_skill_success_seed1"] = eval_only(out, warm, 1, env)["eval/success_rate"]
    checks = preconditions(probe)
    probe["preconditions"] = checks
    probe_file.write_text(json.dumps(probe, indent=1) + "\n")
    print(json.dumps(probe, indent=1))
    return probe


def preconditions(probe: dict) -> dict:
    lo, hi = PRECONDITIONS["no_skill_success"]
    s = probe["no_skill_success_seed1"]
    return {"no_skill_success_in_range": lo <= s <= hi,
            "door_accuracy_with_right_section": probe["door_accuracy_with_right_section"]
            >= PRECONDITIONS["door_accuracy_with_right_section_min"],
            "delta_match": probe["delta_door_match"] > PRECONDITIONS["delta_match_min"],
            "delta_mismatch": probe["delta_door_mismatch"] < PRECONDITIONS["delta_mismatch_max"]}


# --------------------------------------------------------------------------------------------------------------------
# λ from the rule
# --------------------------------------------------------------------------------------------------------------------


def round_down_1sig(x: float) -> float:
    """x rounded DOWN to one significant figure (0.372 -> 0.3, 0.0897 -> 0.08, 3.9 -> 3)."""
    if not x > 0 or math.isinf(x):
        raise ValueError(f"λ rule: cannot round {x!r} to one significant figure")
    e = math.floor(math.log10(x))
    d = math.floor(x / 10 ** e + 1e-9)
    return float(f"{d}e{e}")


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The q-quantile of VALUES by nearest rank (the ceil(q n)-th smallest)."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def lambda_rule(records: Sequence[dict]) -> dict:
    """λ = median |A_out| over the step-samples of mixed groups (groups whose trajectory scores differ) ÷ the 95th
    percentile, over skill-routed step-samples (one value per sample and routed kind), of the sample's largest
    token |Δ|; rounded down to one significant figure. (Version 2 of the rule. Version 1, EXPERIMENT.md's, took the
    95th percentile of |Δ| over skill-routed TOKENS: where Δ sits on one decision token per sample, that percentile
    is the noise of the other tokens, and version 1's λ = 6 drove both OPID arms, the negative control too, to 0
    held-out success. Its value is computed and recorded here as well.)"""
    by_group: dict = {}
    for r in records:
        by_group.setdefault((r["iteration"], r["group"]), []).append(r)
    mixed = [r for g in by_group.values() if len({x["score"] for x in g}) > 1 for r in g]
    a_out = [abs(r["a_out"]) for r in mixed]
    tokens = [abs(d) for r in records for kind in r["kinds"] for d in r["delta"][kind]]
    samples = [max(abs(d) for d in r["delta"][kind]) for r in records for kind in r["kinds"] if r["delta"][kind]]
    if not a_out or not samples:
        raise ValueError(f"λ rule: {len(a_out)} mixed-group samples, {len(samples)} skill-routed samples")
    med = statistics.median(a_out)
    p95_sample, p95_token = nearest_rank(samples, 0.95), nearest_rank(tokens, 0.95)
    return {"median_abs_a_out_mixed": med, "p95_max_abs_delta_per_routed_sample": p95_sample,
            "ratio": med / p95_sample, "lambda": round_down_1sig(med / p95_sample),
            "mixed_group_samples": len(a_out), "routed_samples": len(samples),
            "groups": len(by_group), "mixed_groups": sum(len({x["score"] for x in g}) > 1 for g in by_group.values()),
            "v1_rule": {"p95_abs_delta_routed_tokens": p95_token, "ratio": med / p95_token,
                        "lambda": round_down_1sig(med / p95_token), "routed_tokens": len(tokens)}}


def cmd_lambda(out: Path, env: dict) -> dict:
    warm = warm_start(out, env)
    run_dir = out / "lambda_calibration"
    adv = run_dir / "advantages.jsonl"
    if not (run_dir / "lambda.json").exists():
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        # two warm-start batches with no update (lr 0), the OPID arm's scoring; λ does not enter Δ or A_out
        cmd = [sys.executable, "-m", "opid_mega.cli", "--config", str(ROOT / CONFIG), "--run-dir", str(run_dir),
               f"model.init_from={warm}", "train.iterations=2", "train.lr=0", "eval.interval=0", "train.seed=1"]
        ex.run_logged("λ calibration", cmd, run_dir / "train.log", env)
        records = [json.loads(ln) for ln in adv.read_text().splitlines() if ln.strip()]
        result = lambda_rule(records)
        (run_dir / "lambda.json").write_text(json.dumps(result, indent=1) + "\n")
    result = json.loads((run_dir / "lambda.json").read_text())
    print(json.dumps(result, indent=1))
    return result


# --------------------------------------------------------------------------------------------------------------------
# Pre-registration and the gated runs
# --------------------------------------------------------------------------------------------------------------------


def arm_overrides(arm: str, lam: float) -> list:
    return [o.replace("{lam}", repr(lam)) for o in ARMS[arm]]


def _last_elapsed(run_dir: Path) -> Optional[float]:
    lines = [ln for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return json.loads(lines[-1]).get("elapsed_s") if lines else None


def cmd_prereg(out: Path) -> dict:
    probe = json.loads((out / "probe.json").read_text())
    lam = json.loads((out / "lambda_calibration" / "lambda.json").read_text())
    warm = json.loads((out / "warm_start.json").read_text())
    if not all(probe["preconditions"].values()):
        raise ex.ExperimentError(f"the probe preconditions do not hold: {probe['preconditions']}")
    import yaml

    from opid_mega.config import dump_config
    from opid_mega.envs.footprints_env import VERSION

    cfg = load_cfg()
    copied = commit_warm_start(Path(warm["path"]))
    prereg = {
        "version": 2,
        "history": {
            "v1": "docs/mechanism_archive/v1/ (pre-registration f1e579b, 10 of its 24 runs: both OPID arms collapsed "
                  "to 0 held-out success at λ = 6; its warm start, the 151k-vocabulary tiny-qwen3, was lost with its "
                  "machine and its rebuild on another CPU never left the NLL plateau, so the schedule stopped)",
            "changes_in_v2": [
                "model.builtin tiny-qwen3-footprints (the same shapes on the footprints token subset, 896 rows): the "
                "warm start is 1.6 MB and committed (warm_start.committed), so runs on other machines and in later "
                "sessions start from the same bytes",
                "λ rule version 2: the 95th percentile of each routed sample's largest token |Δ| instead of |Δ| over "
                "routed tokens (the version 1 rule's value is recorded in lambda_computation.v1_rule)",
                "everything else as version 1: env, analyzer, SFT recipe, arms, schedule, budget, endpoints, tests, "
                "decision rules"]},
        "question": "Does the pipeline turn correct hindsight into sample efficiency, and NOT when the hindsight is "
                    "wrong? A positive and a negative control with a privileged hindsight analyzer; not a "
                    "reproduction of the paper's LLM-analyzer result.",
        "env": {"name": "footprints", "version": VERSION, "train_pool": "seeds 0-47", "held_out": "seeds 200000-200255"},
        "config_file": CONFIG, "config_sha256": sha256_file(ROOT / CONFIG),
        "config": yaml.safe_load(dump_config(cfg)),
        "warm_start": {"dir_name": Path(warm["path"]).name, "weights_sha256_16": warm["weights_sha256_16"],
                       "committed": {"dir": str(WARM_DIR.relative_to(ROOT)), "files": copied},
                       "machine": warm.get("machine"), "sft": yaml.safe_load(dump_config(cfg))["sft"]},
        "probe": probe, "preconditions": PRECONDITIONS,
        "lambda": lam["lambda"], "lambda_computation": {**lam, "rule": lambda_rule.__doc__.strip()},
        "arms": {a: arm_overrides(a, lam["lambda"]) for a in ARMS},
        "schedule": [[s, a] for s, a in SCHEDULE],
        "phases": PHASES,
        "evaluation": {"held_out_games": 256, "temperature": 0.4, "skills": False,
                       "rollouts": [0, 160, 320, 480],
                       "rollout_0": "one eval-only run of the warm start per seed, shared by the arms of that seed "
                                    "(opid-eval: the same tasks and sampling seed as a training run's evaluation "
                                    "before training)"},
        "endpoints": {"primary": "AUC of held-out success over rollouts 0-480 (trapezoid, divided by 480), paired by "
                                 "seed: opid_rule - grpo",
                      "secondary": ["held-out first_door_correct (door accuracy)", "final held-out success",
                                    "rollouts to reach held-out success 0.35 (first evaluation point; none: not "
                                    "reached)", "held-out episode length", "skill share of the advantage",
                                    "tie-group share (groups whose trajectories all score the same)",
                                    "sign-correctness of Δ on door tokens (Δ > 0 on the right door, < 0 on a wrong "
                                    "one, over skill-routed door steps)"],
                      "negative_control": "opid_shuffled - grpo AUC: must not be positive and significant; if it "
                                          "is, a gain of opid_rule is not hindsight",
                      "h2": "skill_grpo held-out success with vs without skills: descriptive, 95% t intervals"},
        "tests": {"primary": "one-sided paired t-test (opid_rule > grpo) and exact one-sided sign-flip test over the "
                             "paired seed differences, alpha 0.05",
                  "negative_control": "the same tests for opid_shuffled > grpo"},
        "decision_rules": ["Every run and seed is reported; no reruns except crashes (reported).",
                           "The only change allowed after seeing data: the lr guard on GRPO seed 1 alone (invalid "
                           "rate > 30% or KL > 0.1 by iteration 5 -> lr 1e-4 for every arm, restart).",
                           "If no arm moves held-out success by >= 0.1 (|mean paired final or AUC difference|), the "
                           "report says 'budget too small', not a verdict.",
                           "The runs go in schedule order (interleaved by seed) and may span sessions (an interrupted "
                           "run restarts from its beginning); the report lists the runs completed and names the "
                           "missing ones."],
        "lr_guard": {**LR_GUARD, "decided_on": "grpo seed 1, the first run of the schedule; tripped -> every arm "
                                               "(GRPO seed 1 included, its first run archived) runs with train.lr "
                                               "= the guard's lr"},
        "measured_before_registration": {
            "warm_start_wall_s": warm.get("wall_s"), "sft_epochs": cfg.sft.epochs,
            "note": "version 2's first warm start, the version 1 SFT recipe (40 epochs) on tiny-qwen3-footprints",
            "lambda_calibration_elapsed_s": _last_elapsed(out / "lambda_calibration"),
            "eval_only_seed1_s": json.loads((out / "eval0" / "seed1.json").read_text()).get("wall_s")},
        "idle_machine": "the runs are one opid-train subprocess at a time; the tool refuses to start while another "
                        "torch/opid process runs (tools/mechanism.py busy_processes), records the load average "
                        "before each run and samples, every 15 s during it, the load and any heavy process outside "
                        "the run's own process tree (IdleMonitor, written into the run's experiment_run.json)",
    }
    PREREG.write_text(json.dumps(prereg, indent=1) + "\n")
    print(f"wrote {PREREG} and {WARM_DIR.relative_to(ROOT)}/: λ = {lam['lambda']}; commit both before any OPID arm "
          "runs")
    return prereg


def _ppid_map() -> dict:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return out


def busy_processes(tree_root: Optional[int] = None) -> list:
    """Other heavy processes on this machine (python running torch / pytest / opid / sglang), by /proc scan: every
    such process except this one, its parent and, with tree_root, that process and all its descendants (the run)."""
    me = {os.getpid(), os.getppid()}
    if tree_root is not None:
        parents = _ppid_map()
        mine = {tree_root}
        grew = True
        while grew:
            new = {p for p, pp in parents.items() if pp in mine and p not in mine}
            mine |= new
            grew = bool(new)
        me |= mine
    busy = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "python" in cmd and any(k in cmd for k in ("pytest", "opid_mega", "opid-", "sglang", "torch")):
            busy.append(f"{d.name}: {cmd[:120]}")
    return busy


class IdleMonitor:
    """Samples, every `period` s while a run goes on, the load average and the heavy processes outside this process's
    own tree (busy_processes(tree_root=this pid)); `record()` is written into the run's experiment_run.json."""

    def __init__(self, period: float = 15.0):
        import threading

        self.period, self.samples, self.others, self.max_load1 = period, 0, [], 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.wait(self.period):
            self.samples += 1
            self.max_load1 = max(self.max_load1, os.getloadavg()[0])
            for b in busy_processes(tree_root=os.getpid()):
                if b not in self.others:
                    self.others.append(b)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def record(self) -> dict:
        return {"period_s": self.period, "samples": self.samples, "max_load1": round(self.max_load1, 2),
                "other_heavy_processes_seen": self.others}


def check_prereg(prereg: dict, arm: str, seed: int, warm: Path) -> list:
    """The overrides of arm x seed from the pre-registration, after checking the config file, the warm start and the
    arm against it (ExperimentError on any difference)."""
    if arm not in prereg["arms"]:
        raise ex.ExperimentError(f"arm {arm!r} is not in {PREREG.name} (its arms: {', '.join(prereg['arms'])})")
    if [seed, arm] not in prereg["schedule"]:
        raise ex.ExperimentError(f"{arm} seed {seed} is not in {PREREG.name}'s schedule")
    if sha256_file(ROOT / prereg["config_file"]) != prereg["config_sha256"]:
        raise ex.ExperimentError(f"{prereg['config_file']} differs from the pre-registered one (sha256)")
    if weights_hash(warm) != prereg["warm_start"]["weights_sha256_16"]:
        raise ex.ExperimentError(f"the warm start {warm} is not the pre-registered one (weights hash "
                                 f"{weights_hash(warm)}, pre-registered {prereg['warm_start']['weights_sha256_16']})")
    if prereg["arms"][arm] != arm_overrides(arm, prereg["lambda"]):
        raise ex.ExperimentError(f"arm {arm}: this tool's overrides {arm_overrides(arm, prereg['lambda'])} differ "
                                 f"from the pre-registered {prereg['arms'][arm]}")
    return list(prereg["arms"][arm])


LR_GUARD = {"by_iteration": 5, "invalid_rate_max": 0.3, "kl_max": 0.1, "lr": 1.0e-4}


def lr_guard(records: Sequence[dict]) -> dict:
    """The one change allowed after seeing data, decided on GRPO seed 1 alone: tripped when by iteration 5 the
    training invalid-action rate exceeds 0.3 or the KL to the reference exceeds 0.1 (then every arm runs at lr 1e-4)."""
    early = [r for r in records if 1 <= r["step"] <= LR_GUARD["by_iteration"]]
    inv = max((float(r["train/invalid_rate"]) for r in early if r.get("train/invalid_rate") is not None), default=0.0)
    kl = max((float(r["ppo/kl"]) for r in early if r.get("ppo/kl") is not None), default=0.0)
    return {"max_invalid_rate": inv, "max_kl": kl, "iterations_seen": len(early),
            "tripped": inv > LR_GUARD["invalid_rate_max"] or kl > LR_GUARD["kl_max"]}


def guard_overrides(out: Path) -> list:
    """The overrides the lr guard adds to every run (none unless GRPO seed 1 tripped it)."""
    f = out / "lr_guard.json"
    return [f"train.lr={LR_GUARD['lr']!r}"] if f.exists() and json.loads(f.read_text())["tripped"] else []


def cmd_run(out: Path, env: dict, arms: Optional[list], seeds: Optional[list]) -> None:
    import yaml

    from opid_mega.config import dump_config

    if not PREREG.exists():
        raise ex.ExperimentError(f"no {PREREG}: run `tools/mechanism.py prereg` and commit it first")
    prereg = json.loads(PREREG.read_text())
    warm = ex.find_warm_start(out / "warm_start.json")
    if warm is None:
        raise ex.ExperimentError(f"no warm start recorded in {out / 'warm_start.json'}")
    todo = [(s, a) for s, a in prereg["schedule"] if (arms is None or a in arms) and (seeds is None or s in seeds)]
    for a in arms or []:
        if a not in prereg["arms"]:
            raise ex.ExperimentError(f"arm {a!r} is not in {PREREG.name} (its arms: {', '.join(prereg['arms'])})")
    cfg = load_cfg()
    iterations = cfg.train.iterations
    steps = ex.eval_steps(iterations, cfg.eval.interval, cfg.eval.before_training)
    # A run the committed results hold is not run again when its directory is gone (a new machine): its values stay
    # the record. GRPO seed 1 is the exception while this OUT has no lr_guard.json: the guard is decided on a run here.
    committed = committed_runs()
    for k, (seed, arm) in enumerate(todo, 1):
        if (seed, arm) != (1, "grpo") and not (out / "lr_guard.json").exists():
            raise ex.ExperimentError("GRPO seed 1 decides the lr guard and runs first: run it before any other arm")
        extra = check_prereg(prereg, arm, seed, warm) + guard_overrides(out)
        eval_only(out, warm, seed, env)
        run_dir = out / "runs" / arm / f"seed{seed}"
        extra = extra + [f"train.seed={seed}", f"model.init_from={warm}", f"logging.run_dir={run_dir}"]
        expected = yaml.safe_load(dump_config(load_cfg(extra)))
        if ex.run_is_complete(run_dir, expected, iterations, steps):
            print(f"[{k}/{len(todo)}] {arm} seed {seed}: complete, skipped", flush=True)
            continue
        if kept_from_record(run_dir, seed, arm, committed, (out / "lr_guard.json").exists()):
            print(f"[{k}/{len(todo)}] {arm} seed {seed}: in {RESULTS.name} (its run directory is not on this "
                  "machine), skipped", flush=True)
            continue
        busy = busy_processes()
        if busy:
            raise ex.ExperimentError("the machine is not idle; other heavy processes: " + "; ".join(busy))
        load = os.getloadavg()
        print(f"[{k}/{len(todo)}] {arm} seed {seed}: opid-train (load {load[0]:.2f}; log {run_dir / 'train.log'})",
              flush=True)
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)  # an incomplete run (a crash, an interruption) restarts from its beginning
        run_dir.mkdir(parents=True)
        cmd = [sys.executable, "-m", "opid_mega.cli", "--config", str(ROOT / CONFIG), "--run-dir", str(run_dir), *extra]
        with IdleMonitor() as monitor:
            wall = ex.run_logged(f"{arm} seed {seed}", cmd, run_dir / "train.log", env)
        idle = monitor.record()
        (run_dir / "experiment_run.json").write_text(json.dumps({"wall_s": wall, "overrides": extra,
                                                                 "loadavg_before": load, "idle_monitor": idle,
                                                                 "machine": machine_info()}) + "\n")
        if idle["other_heavy_processes_seen"]:
            print(f"    WARNING: other heavy processes ran during this run: {idle['other_heavy_processes_seen']}",
                  flush=True)
        if not ex.run_is_complete(run_dir, expected, iterations, steps):
            raise ex.ExperimentError(f"{arm} seed {seed} finished without all its metrics ({run_dir})")
        print(f"    done in {wall / 60:.1f} min", flush=True)
        if (seed, arm) == (1, "grpo") and not (out / "lr_guard.json").exists():
            from opid_mega.metrics import read_metrics

            g = {**lr_guard(read_metrics(run_dir)), "rule": LR_GUARD, "lr_of_the_decided_run": cfg.train.lr}
            (out / "lr_guard.json").write_text(json.dumps(g, indent=1) + "\n")
            print(f"    lr guard (GRPO seed 1): {g}", flush=True)
            if g["tripped"]:  # archived, then every arm (this one first) at the guard's lr
                os.replace(run_dir, out / "runs" / "grpo" / "seed1_lr_guard_tripped")
                return cmd_run(out, env, arms, seeds)


# --------------------------------------------------------------------------------------------------------------------
# The report: docs/mechanism_results.json, docs/mechanism_results.md (table + tests), docs/mechanism_curves.png
# --------------------------------------------------------------------------------------------------------------------

RESULTS = ROOT / "docs" / "mechanism_results.json"
RESULTS_MD = ROOT / "docs" / "mechanism_results.md"
FIGURE = ROOT / "docs" / "mechanism_curves.png"
REACH = 0.35  # the pre-registered threshold of "rollouts to reach held-out success"


def rollout_curve(start: float, records: Sequence[dict], rollouts_per_iteration: int,
                  key: str = "eval/success_rate") -> list:
    """[(rollouts, value)]: the 0-rollout point (the seed's eval-only run of the warm start), then the run's held-out
    evaluations at iteration k as k x rollouts_per_iteration."""
    return [(0, float(start))] + [(s * rollouts_per_iteration, v) for s, v in ex.eval_curve(records, key)]


def first_reach(curve: Sequence[tuple], threshold: float) -> Optional[int]:
    """The first evaluation point (rollouts) whose value is >= threshold; None when none is."""
    return next((x for x, y in curve if y >= threshold), None)


def tie_group_share(records: Sequence[dict]) -> Optional[float]:
    """The share of (iteration, group) whose step-samples all carry the same trajectory score (no outcome signal)."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["iteration"], r["group"]), set()).add(r["score"])
    return sum(len(v) == 1 for v in groups.values()) / len(groups) if groups else None


def colour_token_positions(pieces: Sequence[str], colour: str) -> list:
    """The positions of the tokens that spell the FIRST occurrence of `colour` in a response given as its decoded
    token pieces (a piece may carry a leading space or merge with neighbours' characters)."""
    text = "".join(pieces)
    at = text.find(colour)
    if at < 0:
        return []
    out, pos = [], 0
    for k, piece in enumerate(pieces):
        lo, hi = pos, pos + len(piece)
        if hi > at and lo < at + len(colour):
            out.append(k)
        pos = hi
    return out


def door_delta_signs(records: Sequence[dict], decode) -> dict:
    """Over skill-routed door steps ("open <colour> door" actions of footprints tasks): the mean Δ over the door
    colour's tokens and whether its sign is right (> 0 when the door is the game's right one, < 0 when it is not).
    `decode(token_id) -> str` gives a token's piece."""
    from opid_mega.envs.footprints_env import make_game

    right_n = wrong_n = right_ok = wrong_ok = 0
    right_sum = wrong_sum = 0.0
    for r in records:
        words = str(r.get("action", "")).split()
        if not r["kinds"] or len(words) != 3 or words[0] != "open" or words[2] != "door":
            continue
        colour = words[1]
        game = make_game(int(str(r["task"]).rsplit("-", 1)[1]))
        pos = colour_token_positions([decode(t) for t in r["response_ids"]], colour)
        if not pos:
            continue
        for kind in r["kinds"]:
            d = sum(r["delta"][kind][k] for k in pos) / len(pos)
            if colour == game.right:
                right_n, right_sum, right_ok = right_n + 1, right_sum + d, right_ok + (d > 0)
            else:
                wrong_n, wrong_sum, wrong_ok = wrong_n + 1, wrong_sum + d, wrong_ok + (d < 0)
    n = right_n + wrong_n
    return {"routed_door_steps": n, "sign_correct": (right_ok + wrong_ok) / n if n else None,
            "right_door": {"n": right_n, "mean_delta": right_sum / right_n if right_n else None},
            "wrong_door": {"n": wrong_n, "mean_delta": wrong_sum / wrong_n if wrong_n else None}}


def paired_tests(diffs: Sequence[float]) -> dict:
    """One-sided tests that the mean paired difference is > 0: Student's t (n - 1 degrees of freedom) and the exact
    sign-flip permutation test (every one of the 2^n sign assignments; p = the share whose mean is >= the observed)."""
    import itertools

    from scipy import stats

    n = len(diffs)
    out: dict = {"n": n, "diffs": list(diffs)}
    if n == 0:
        return out
    mean = sum(diffs) / n
    out["mean"] = mean
    if n >= 2:
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
        out["sd"] = sd
        if sd > 0:
            t = mean / (sd / math.sqrt(n))
            out["t"], out["p_t_one_sided"] = t, float(stats.t.sf(t, n - 1))
        else:
            out["t"], out["p_t_one_sided"] = None, None
    flips = [sum(s * d for s, d in zip(signs, diffs)) / n for signs in itertools.product((1, -1), repeat=n)]
    out["p_signflip_one_sided"] = sum(f >= mean - 1e-12 for f in flips) / len(flips)
    return out


def t_interval(values: Sequence[float], level: float = 0.95) -> dict:
    """Mean and two-sided Student-t confidence interval (n - 1 degrees of freedom) of VALUES."""
    from scipy import stats

    n = len(values)
    if n == 0:
        return {"n": 0}
    mean = sum(values) / n
    if n < 2:
        return {"n": n, "mean": mean}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "level": level, "low": mean - half, "high": mean + half}


def h2_skill_grpo(by_seed: dict) -> dict:
    """H2, descriptive: skill_grpo's final held-out success with skills, without, and their paired difference (with
    minus without), each with its 95% t interval."""
    both = [v for v in by_seed.values() if v.get("final_with_skills") is not None]
    return {"final_with_skills": t_interval([v["final_with_skills"] for v in both]),
            "final_without_skills": t_interval([v["final"] for v in both]),
            "with_minus_without": t_interval([v["final_with_skills"] - v["final"] for v in both])}


# The small records of OUT that are committed (runs/ is not: a new machine starts without it): the warm start's
# record, the probe, the λ calibration, the lr guard, the eval-only starts and each run's metrics and idle record.
ARCHIVED = ("warm_start.json", "probe.json", "lr_guard.json", "lambda_calibration/lambda.json", "eval0/seed*.json",
            "runs/*/seed*/metrics.jsonl", "runs/*/seed*/experiment_run.json")


def archive(out: Path, dest: Path = ARCHIVE) -> list:
    """Copies OUT's small records (ARCHIVED) to DEST, keeping their relative paths; the list of files copied."""
    import shutil

    copied = []
    for pattern in ARCHIVED:
        for f in sorted(out.glob(pattern)):
            rel = f.relative_to(out)
            if rel.name == "warm_start.json" and '"from_committed"' in f.read_text():
                continue  # a machine that used the committed warm start: the record of its training stays
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest / rel)
            copied.append(str(rel))
    return copied


def kept_from_record(run_dir: Path, seed: int, arm: str, committed: dict, guard_decided: bool) -> bool:
    """Whether `run` keeps arm x seed's committed values instead of running it: the record holds it and its run
    directory is not here (a directory, even an incomplete one, means it was started on this machine), except GRPO
    seed 1 while the lr guard is not decided here."""
    return (not run_dir.exists() and str(seed) in committed.get(arm, {})
            and ((seed, arm) != (1, "grpo") or guard_decided))


def committed_runs() -> dict:
    """arm -> seed -> values of the committed docs/mechanism_results.json ({} without one)."""
    if not RESULTS.exists():
        return {}
    return json.loads(RESULTS.read_text()).get("arms", {})


# The values a rerun must reproduce exactly for its committed record to count as reproduced (the run's own timings
# and idle record differ from machine to machine).
REPRODUCED_KEYS = ("curve", "auc", "final", "first_door_correct", "final_episode_length", "skill_share_pooled",
                   "tie_group_share", "door_delta", "train_success")


def reproduction(new: dict, old: dict) -> dict:
    """Whether a rerun on this machine gave the committed values: the keys that differ (beyond 1e-9), if any."""
    def same(a, b):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return abs(a - b) <= 1e-9
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b

    differ = [k for k in REPRODUCED_KEYS if not same(new.get(k), old.get(k))]
    return {"reproduced": not differ, "differing_keys": differ}


def run_values(run_dir: Path, start: dict, rollouts_per_iteration: int, iterations: int, decode) -> dict:
    """One arm x seed: its held-out curves in rollouts and every pre-registered endpoint."""
    from opid_mega.metrics import read_metrics

    records = read_metrics(run_dir)
    curve = rollout_curve(start["eval/success_rate"], records, rollouts_per_iteration)
    door = ex.eval_curve(records, "eval/first_door_correct")
    lengths = ex.eval_curve(records, "eval/episode_length")
    summary = ex.run_summary(records, iterations)
    adv_file = run_dir / "advantages.jsonl"
    adv = [json.loads(ln) for ln in adv_file.read_text().splitlines() if ln.strip()] if adv_file.exists() else []
    with_skills = ex.eval_curve(records, "eval/success_rate_with_skills")
    info = json.loads((run_dir / "experiment_run.json").read_text()) if (run_dir / "experiment_run.json").exists() \
        else {}
    return {"curve": curve, "auc": ex.curve_auc(curve), "final": curve[-1][1],
            "first_door_correct": [(s * rollouts_per_iteration, v) for s, v in door],
            "final_first_door_correct": door[-1][1] if door else None,
            "rollouts_to_reach": first_reach(curve, REACH),
            "final_episode_length": lengths[-1][1] if lengths else None,
            "skill_share_pooled": summary["skill_share_pooled"], "tie_group_share": tie_group_share(adv),
            "door_delta": door_delta_signs(adv, decode) if any(r["kinds"] for r in adv) else None,
            "final_with_skills": with_skills[-1][1] if with_skills else None,
            "train_success": summary["train_success"], "wall_s": info.get("wall_s"), "machine": info.get("machine"),
            "idle_monitor": info.get("idle_monitor"), "loadavg_before": info.get("loadavg_before")}


def results_table(arms: dict) -> str:
    """Markdown: per arm, n seeds and mean ± sd of each endpoint."""
    def fmt(vals, d=3):
        m, sd = ex.mean_std(vals)
        return "–" if m is None else f"{m:.{d}f}" + (f" ± {sd:.{d}f}" if sd is not None else "")

    head = ("| arm | seeds | held-out success, 0 rollouts | after 480 | AUC 0-480 | first door correct, final | "
            "episode length, final | skill share (pooled) | tie groups | Δ sign-correct on door tokens |")
    lines = [head, "|" + "---|" * 10]
    for arm, by_seed in arms.items():
        v = list(by_seed.values())
        lines.append("| " + " | ".join([
            arm, str(len(v)), fmt([x["curve"][0][1] for x in v]), fmt([x["final"] for x in v]),
            fmt([x["auc"] for x in v]), fmt([x["final_first_door_correct"] for x in v]),
            fmt([x["final_episode_length"] for x in v], 2), fmt([x["skill_share_pooled"] for x in v], 4),
            fmt([x["tie_group_share"] for x in v]),
            fmt([(x["door_delta"] or {}).get("sign_correct") for x in v])]) + " |")
    return "\n".join(lines) + "\n"


def h2_lines(h2: dict) -> str:
    def one(name, t):
        if t.get("low") is None:
            return f"- {name}: n = {t['n']}" + (f", mean {t['mean']:.3f}" if "mean" in t else "")
        return f"- {name}: n = {t['n']}, mean {t['mean']:+.3f}, 95% t interval [{t['low']:+.3f}, {t['high']:+.3f}]"

    return ("\nH2 (descriptive): skill_grpo's final held-out success with and without skills at evaluation:\n\n"
            + "\n".join(one(k, v) for k, v in h2.items()) + "\n")


def cmd_report(out: Path) -> dict:
    if not PREREG.exists():
        raise ex.ExperimentError(f"no {PREREG}: nothing was pre-registered")
    prereg = json.loads(PREREG.read_text())
    from opid_mega.models import load_tokenizer

    warm = ex.find_warm_start(out / "warm_start.json")
    tok = load_tokenizer(str(warm))
    cfg = load_cfg()
    per_iter = cfg.rollout.tasks_per_iter * cfg.rollout.group_size
    iterations = cfg.train.iterations
    steps = ex.eval_steps(iterations, cfg.eval.interval, cfg.eval.before_training)
    import yaml

    from opid_mega.config import dump_config

    committed = committed_runs()
    arms: dict = {}
    missing = []
    for seed, arm in prereg["schedule"]:
        run_dir = out / "runs" / arm / f"seed{seed}"
        extra = list(prereg["arms"][arm]) + guard_overrides(out) + [f"train.seed={seed}", f"model.init_from={warm}",
                                                                    f"logging.run_dir={run_dir}"]
        start_file = out / "eval0" / f"seed{seed}.json"
        old = committed.get(arm, {}).get(str(seed))
        if not start_file.exists() or not ex.run_is_complete(run_dir, yaml.safe_load(dump_config(load_cfg(extra))),
                                                               iterations, steps):
            if old is not None and not run_dir.exists():  # run on an earlier machine: its committed values stay
                arms.setdefault(arm, {})[str(seed)] = {**old, "from_committed_record": True}
            else:
                missing.append([seed, arm])
            continue
        values = run_values(run_dir, json.loads(start_file.read_text()), per_iter, iterations,
                            lambda t: tok.decode([t]))
        if old is not None and old.get("wall_s") != values["wall_s"]:  # another execution of a committed run
            values["rerun_of_committed"] = {**reproduction(values, old), "committed_wall_s": old.get("wall_s")}
        elif old is not None and "rerun_of_committed" in old:
            values["rerun_of_committed"] = old["rerun_of_committed"]
        arms.setdefault(arm, {})[str(seed)] = values

    def paired(arm, base="grpo", key="auc"):
        common = sorted(set(arms.get(arm, {})) & set(arms.get(base, {})), key=int)
        return {"seeds": [int(s) for s in common],
                **paired_tests([arms[arm][s][key] - arms[base][s][key] for s in common])}

    tests = {"primary_auc_opid_rule_vs_grpo": paired("opid_rule"),
             "negative_control_auc_opid_shuffled_vs_grpo": paired("opid_shuffled"),
             "final_opid_rule_vs_grpo": paired("opid_rule", key="final"),
             "final_opid_shuffled_vs_grpo": paired("opid_shuffled", key="final")}
    for extra_arm in ("opid_ref", "grpo_mean_norm", "skill_grpo"):
        if extra_arm in arms:
            tests[f"auc_{extra_arm}_vs_grpo"] = paired(extra_arm)
    diffs = [abs(t.get("mean", 0.0)) for k, t in tests.items() if k.startswith(("primary", "final_opid_rule"))]
    verdict_budget = "budget too small" if diffs and max(diffs) < 0.1 else None
    h2 = h2_skill_grpo(arms["skill_grpo"]) if "skill_grpo" in arms else None
    results = {"prereg": PREREG.name, "prereg_lambda": prereg["lambda"], "rollouts_per_iteration": per_iter,
               "arms": arms, "tests": tests, "h2_skill_grpo": h2, "missing_runs": missing, "reach_threshold": REACH,
               "decision_rule_budget": verdict_budget}
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    table = results_table(arms)
    test_lines = []
    for name, t in tests.items():
        if t.get("n"):
            test_lines.append(f"- {name}: n = {t['n']} (seeds {t['seeds']}), mean difference {t['mean']:+.4f}"
                              + (f", sd {t['sd']:.4f}" if t.get("sd") is not None else "")
                              + (f", t = {t['t']:.3f}, one-sided p = {t['p_t_one_sided']:.4f}"
                                 if t.get("t") is not None else "")
                              + f", exact sign-flip one-sided p = {t['p_signflip_one_sided']:.4f}")
        else:
            test_lines.append(f"- {name}: no paired seeds")
    RESULTS_MD.write_text("# Mechanism experiment: results (written by `python tools/mechanism.py report`)\n\n"
                          f"λ = {prereg['lambda']} (pre-registered). Mean ± sample sd over seeds.\n\n" + table
                          + "\nPaired tests (pre-registered: one-sided, α 0.05):\n\n" + "\n".join(test_lines) + "\n"
                          + (h2_lines(h2) if h2 else "")
                          + (f"\nMissing runs (seed, arm): {missing}\n" if missing else "")
                          + (f"\nDecision rule: {verdict_budget} (no arm moved held-out success by 0.1).\n"
                             if verdict_budget else ""))
    archived = archive(out)
    print(f"archived {len(archived)} records under {ARCHIVE.relative_to(ROOT)}")
    curves = {arm: [[(x / per_iter, y) for x, y in v["curve"]] for v in by_seed.values()]
              for arm, by_seed in arms.items()}
    if curves:
        ex.plot_curves(curves, FIGURE, title="Footprints held-out success")
    print(table + "\n".join(test_lines))
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="tools/mechanism.py", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("probe", "lambda", "prereg", "run", "report"))
    p.add_argument("--out", default=str(ROOT / "runs" / "mechanism_v2"))
    p.add_argument("--arms")
    p.add_argument("--seeds")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = ex.child_env(None)
    try:
        if args.command == "probe":
            cmd_probe(out, env)
        elif args.command == "lambda":
            cmd_lambda(out, env)
        elif args.command == "prereg":
            cmd_prereg(out)
        elif args.command == "report":
            cmd_report(out)
        else:
            cmd_run(out, env, ex.parse_list(args.arms), ex.parse_list(args.seeds, int))
    except ex.ExperimentError as e:
        print(f"mechanism: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
