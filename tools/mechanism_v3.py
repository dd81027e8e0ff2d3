#!/usr/bin/env python
"""The pre-registered mechanism experiment on footprints, version 3 (docs/experiments.md "Mechanism experiment";
versions 1 and 2: tools/mechanism.py and docs/mechanism_archive/).

    python tools/mechanism_v3.py design                  # docs/mechanism_v3/design.json: arms, endpoints, budget,
                                                         # λ rule, gate, tests, decision rules (commit it first)
    python tools/mechanism_v3.py calibrate [--out DIR]   # warm start, its probe, its held-out door accuracy, λ by
                                                         # the rule -> docs/mechanism_v3/prereg.json and the
                                                         # committed warm start (commit both, after the design)
    python tools/mechanism_v3.py gate      [--out DIR]   # GRPO seeds 1-2 (with the pre-declared retry) -> gate.json
    python tools/mechanism_v3.py run       [--out DIR] [--arms a,b] [--seeds 1,2]   # the arms, once the gate passed
    python tools/mechanism_v3.py report    [--out DIR]   # docs/mechanism_v3/results.{json,md}, curves.png, records

Version 2 came back null because its design could not show an effect: GRPO itself did not learn at its budget (so
"does OPID speed learning up?" had nothing to speed up), its warm start was trained to ignore the cue, and its primary
endpoint (held-out success) diluted the one decision the hindsight is about. Version 3 changes exactly those:
  * a GRPO gate before any OPID run: GRPO must raise held-out door accuracy by GATE["margin"] over two pilot seeds,
    with one pre-declared retry (a higher learning rate for every arm); otherwise the experiment stops and says so;
  * a warm start that leans toward the cue (sft.decision_cue_copies: the cue's door is the no-section target 2 times
    in 6), so RL strengthens an existing cue -> door path instead of creating one;
  * the primary endpoint is held-out door accuracy (the share of all 256 held-out games whose first door is the right
    one), its AUC over 0-960 rollouts; twice v2's iterations;
  * λ from a rule that sets the skill term's size ON THE DECISION TOKENS (the door colour) to the outcome term's.

The runs refuse any arm, seed, config file or warm start that docs/mechanism_v3/prereg.json does not hold and watch
that the machine stays idle (tools/mechanism.py's IdleMonitor). Every record carries its UTC time. DIR (default
runs/mechanism_v3) is not committed; `report` copies its small records into docs/mechanism_v3/records/.

A positive and a negative control for the pipeline with a privileged hindsight analyzer (it reads the closet's
reveal), not a reproduction of the paper's LLM-analyzer result.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import experiment as ex  # noqa: E402
import mechanism as v2  # noqa: E402  (the helpers versions 2 and 3 share: warm start files, probe, tests, idle watch)

VERSION = 3
CONFIG = "configs/mechanism_v3.yaml"
DOCS = ROOT / "docs" / "mechanism_v3"
DESIGN = DOCS / "design.json"
PREREG = DOCS / "prereg.json"
RESULTS = DOCS / "results.json"
RESULTS_MD = DOCS / "results.md"
FIGURE = DOCS / "curves.png"
WARM_DIR = DOCS / "warm_start"
RECORDS = DOCS / "records"

# Arm -> overrides on top of CONFIG ("{lam}": λ from the rule, fixed at calibration).
ARMS = {
    "grpo": ["algo.mode=grpo"],
    "opid": ["algo.mode=opid", "algo.lambda_episode={lam}", "algo.lambda_step={lam}"],
    "opid_shuffled": ["algo.mode=opid", "algo.lambda_episode={lam}", "algo.lambda_step={lam}",
                      "algo.skill_source=shuffled"],
    "opid_episode_only": ["algo.mode=no_step_skill", "algo.lambda_episode={lam}", "algo.lambda_step={lam}"],
}
SEEDS = tuple(range(1, 9))
# The gate's runs are GRPO seeds 1 and 2 of the schedule; the rest is interleaved by seed so an interrupted experiment
# leaves complete sets.
GATE = {"arm": "grpo", "seeds": [1, 2], "endpoint": "held-out door accuracy (first_door_correct over all 256 games)",
        "statistic": "mean over the two seeds of (door accuracy after 960 rollouts - door accuracy at 0 rollouts)",
        "margin": 0.15,
        "retry": {"overrides": ["train.lr=0.001"],
                  "rule": "if the gate fails at the config's lr (3e-4), both seeds run once more with train.lr=1e-3; "
                          "passing then makes 1e-3 the lr of every arm. Failing again ends the experiment: the "
                          "report says GRPO does not learn at this budget, and no OPID arm runs."}}
SCHEDULE = [(s, "grpo") for s in GATE["seeds"]] + [(s, a) for s in SEEDS for a in ARMS
                                                   if not (a == "grpo" and s in GATE["seeds"])]
PRECONDITIONS = {
    "door_accuracy_with_right_section_min": 0.8,
    "no_section_held_out_door_accuracy": [0.25, 0.75],
    "rule": "checked on the warm start before any RL (tools/mechanism.py probe_doors on 64 held-out games; opid-eval "
            "seed 1 on all 256). Below 0.25 without a section: one rebuild with sft.decision_cue_copies=2; any other "
            "failure ends the experiment (reported).",
}
ROLLOUTS = [0, 320, 640, 960]


def utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


def load_cfg(overrides: Sequence[str] = ()):
    return ex.load_base(CONFIG, list(overrides))


# --------------------------------------------------------------------------------------------------------------------
# Pure functions (tested on hand-worked records)
# --------------------------------------------------------------------------------------------------------------------


def door_sample(r: dict) -> Optional[str]:
    """The door colour of a step-sample whose action opened a door ('open <colour> door'), else None."""
    words = str(r.get("action", "")).split()
    return words[1] if len(words) == 3 and words[0] == "open" and words[2] == "door" else None


def door_delta(r: dict, decode) -> Optional[float]:
    """Σ over the routed kinds of the mean Δ on the door colour's tokens (its first mention in the response): the
    skill term's Δ on the decision, per unit λ. None for a step that is not a routed door step."""
    colour = door_sample(r)
    if colour is None or not r["kinds"]:
        return None
    pos = v2.colour_token_positions([decode(t) for t in r["response_ids"]], colour)
    if not pos:
        return None
    return sum(sum(r["delta"][k][i] for i in pos) / len(pos) for k in r["kinds"])


def mixed_groups(records: Sequence[dict]) -> set:
    """The (iteration, group) keys whose step-samples carry more than one trajectory score (outcome signal)."""
    by: dict = {}
    for r in records:
        by.setdefault((r["iteration"], r["group"]), set()).add(r["score"])
    return {k for k, v in by.items() if len(v) > 1}


def lambda_rule(records: Sequence[dict], decode) -> dict:
    """λ = median |A_out| over the door step-samples of mixed groups ÷ median |Δ_door| over the routed door
    step-samples (Δ_door: door_delta), rounded down to one significant figure: at the median the skill term on the
    decision tokens is at most the size of the outcome term there (a decision-token share of at most about 1/2)."""
    mixed = mixed_groups(records)
    a_out = [abs(r["a_out"]) for r in records if door_sample(r) and (r["iteration"], r["group"]) in mixed]
    deltas = [abs(d) for d in (door_delta(r, decode) for r in records) if d is not None]
    if not a_out or not deltas:
        raise ValueError(f"λ rule: {len(a_out)} door samples of mixed groups, {len(deltas)} routed door samples")
    med_a, med_d = statistics.median(a_out), statistics.median(deltas)
    lam = v2.round_down_1sig(med_a / med_d)
    return {"median_abs_a_out_door_mixed": med_a, "median_abs_delta_door_routed": med_d, "ratio": med_a / med_d,
            "lambda": lam, "door_samples_mixed": len(a_out), "routed_door_samples": len(deltas),
            "expected_decision_share_at_medians": lam * med_d / (med_a + lam * med_d)}


def decision_share(records: Sequence[dict], lam: float, decode) -> dict:
    """The skill term's share of the advantage on the decision tokens: over routed door step-samples, mean of
    |λ Δ_door| / (|A_out| + |λ Δ_door|), and the pooled Σ|λ Δ_door| / Σ(|A_out| + |λ Δ_door|)."""
    pairs = [(abs(r["a_out"]), abs(lam * d)) for r in records for d in [door_delta(r, decode)] if d is not None]
    pairs = [(a, s) for a, s in pairs if a + s > 0]
    if not pairs:
        return {"routed_door_samples": 0, "mean": None, "pooled": None}
    return {"routed_door_samples": len(pairs), "mean": sum(s / (a + s) for a, s in pairs) / len(pairs),
            "pooled": sum(s for _, s in pairs) / sum(a + s for a, s in pairs)}


def gate_decision(starts: dict, finals: dict, margin: float = GATE["margin"]) -> dict:
    """seed -> door accuracy at 0 and after the last rollout: passed when the mean gain over the seeds >= margin."""
    gains = {s: finals[s] - starts[s] for s in sorted(finals)}
    mean = sum(gains.values()) / len(gains)
    return {"gains": gains, "mean_gain": mean, "margin": margin, "passed": mean >= margin - 1e-9}


def mde(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> Optional[float]:
    """The paired mean difference a one-sided t-test at `alpha` detects with probability `power`, for a paired sd
    and n seeds: (t_{1-α, n-1} + t_{power, n-1}) · sd / √n."""
    from scipy import stats

    if n < 2 or sd is None:
        return None
    return (float(stats.t.ppf(1 - alpha, n - 1)) + float(stats.t.ppf(power, n - 1))) * sd / math.sqrt(n)


# --------------------------------------------------------------------------------------------------------------------
# Design (committed before any calibration or run)
# --------------------------------------------------------------------------------------------------------------------


def design() -> dict:
    from opid_mega.envs.footprints_env import VERSION as ENV_VERSION

    return {
        "version": VERSION,
        "question": "Does the pipeline turn correct hindsight into faster learning of the decision it is about, and "
                    "NOT when the hindsight belongs to another task? A positive and a negative control with a "
                    "privileged hindsight analyzer; not a reproduction of the paper's LLM-analyzer result.",
        "env": {"name": "footprints", "version": ENV_VERSION, "train_pool": "seeds 0-47",
                "held_out": "seeds 200000-200255 (all 256 at every evaluation)"},
        "config_file": CONFIG, "config_sha256": v2.sha256_file(ROOT / CONFIG),
        "analysis_code": {"file": "tools/mechanism_v3.py", "sha256": v2.sha256_file(Path(__file__))},
        "warm_start": "opid-sft on the config's sft section (40 epochs, lr 2e-3, skill share 1, blind_decision with "
                      "decision_cue_copies 1: at the hall each door once without a section plus the cue's door once "
                      "more, and each door once with a section naming it); committed with the calibration",
        "preconditions": PRECONDITIONS,
        "lambda_rule": lambda_rule.__doc__.strip() + " Computed on two warm-start batches with no update (train.lr=0, "
                       "the opid arm's scoring, seed 1).",
        "arms": ARMS, "seeds": list(SEEDS), "schedule": [[s, a] for s, a in SCHEDULE],
        "gate": GATE,
        "budget": {"iterations": 30, "tasks_per_iteration": 4, "group_size": 8, "rollouts": 960,
                   "evaluation": {"rollouts": ROLLOUTS, "held_out_games": 256, "temperature": 0.4, "skills": False,
                                  "rollout_0": "one opid-eval run of the warm start per seed (the same tasks and "
                                               "sampling seed as a training run's evaluation before training), shared "
                                               "by the arms of that seed"},
                   "expected_wall": "about 1.8 min a run, 32 runs: about 60 min on 2 idle cores"},
        "endpoints": {
            "primary": "door-accuracy AUC: held-out door accuracy over rollouts 0-960 (trapezoid, divided by 960), "
                       "paired by seed",
            "secondary": ["final held-out door accuracy", "held-out success AUC and final",
                          "skill term's share on the decision tokens (decision_share) and pooled over all tokens",
                          "Δ sign-correct on door tokens (tools/mechanism.py door_delta_signs)",
                          "tie-group share"]},
        "tests": {
            "primary": "opid - grpo door-accuracy AUC: one-sided paired t-test (H1: > 0), alpha 0.05; the exact "
                       "one-sided sign-flip test reported beside it",
            "negative_control": "opid_shuffled - grpo door-accuracy AUC, the same tests: must not be positive and "
                                "significant (if it is, a gain of opid is not hindsight)",
            "hindsight": "opid - opid_shuffled door-accuracy AUC, the same tests",
            "episode_only": "opid_episode_only - grpo door-accuracy AUC, the same tests",
            "called_pre_registered": "these four only; every other comparison in the report is descriptive"},
        "decision_rules": [
            "The gate runs first; if it fails after its one retry, no OPID arm runs and the report says so.",
            "Every run and seed is reported; no reruns except crashes (reported).",
            "The minimum detectable effect (one-sided alpha 0.05, power 0.8) is computed from each test's measured "
            "paired sd and reported; a non-significant difference is reported as 'none detected above the MDE', "
            "not as 'no effect'.",
            "The runs go in schedule order and may span sessions (an interrupted run restarts from its beginning)."],
        "idle_machine": "one opid-train subprocess at a time; the tool refuses to start a run while another "
                        "torch/opid process runs and samples the load every 15 s during each run",
        "registered_utc": utc(),
    }


def cmd_design() -> dict:
    d = design()
    write_json(DESIGN, d)
    print(f"wrote {DESIGN.relative_to(ROOT)}: commit it before any calibration")
    return d


def check_design() -> dict:
    """The committed design, after checking the config file and this tool still match it."""
    if not DESIGN.exists():
        raise ex.ExperimentError(f"no {DESIGN.relative_to(ROOT)}: run `tools/mechanism_v3.py design` and commit it")
    d = json.loads(DESIGN.read_text())
    if v2.sha256_file(ROOT / CONFIG) != d["config_sha256"]:
        raise ex.ExperimentError(f"{CONFIG} differs from the registered design (sha256)")
    if d["arms"] != ARMS or d["schedule"] != [[s, a] for s, a in SCHEDULE] or d["gate"] != GATE:
        raise ex.ExperimentError("this tool's arms, schedule or gate differ from the registered design")
    return d


# --------------------------------------------------------------------------------------------------------------------
# Calibration: warm start, probe, held-out door accuracy at 0 rollouts, λ
# --------------------------------------------------------------------------------------------------------------------


def warm_start(out: Path, env: dict) -> Path:
    """OUT/warm_start.json's warm start; else the committed one (assembled); else opid-sft on CONFIG (cached)."""
    record = out / "warm_start.json"
    warm = ex.find_warm_start(record)
    if warm is not None:
        return warm
    if (WARM_DIR / "model.safetensors").exists():
        from opid_mega.models import prepare_model

        cfg = load_cfg()
        path = v2.assemble_warm_start(WARM_DIR, Path(prepare_model(cfg.model.builtin, cfg.model.cache_dir)),
                                      out / "warm_start_model")
        write_json(record, {"path": str(path), "from_committed": str(WARM_DIR.relative_to(ROOT)),
                            "weights_sha256_16": v2.weights_hash(path), "machine": v2.machine_info(), "utc": utc()})
        return path
    log = out / "logs" / "warm_start.log"
    cmd = [sys.executable, "-c", "import sys; from opid_mega.cli import sft_main; sys.exit(sft_main())",
           "--config", str(ROOT / CONFIG)]
    wall = ex.run_logged("warm start (opid-sft)", cmd, log, env)
    lines = [ln.strip() for ln in log.read_text().splitlines()]
    path = next((ln for ln in reversed(lines) if ln and (Path(ln) / ".opid_sft_complete").exists()), "")
    if not path:
        raise ex.ExperimentError(f"opid-sft finished without a warm start (log {log})")
    write_json(record, {"path": path, "wall_s": wall, "weights_sha256_16": v2.weights_hash(Path(path)),
                        "machine": v2.machine_info(), "utc": utc()})
    return Path(path)


def eval_only(out: Path, warm: Path, seed: int, env: dict) -> dict:
    """opid-eval of the warm start on all held-out games (OUT/eval0/seed<k>.json): seed k's 0-rollout point."""
    path = out / "eval0" / f"seed{seed}.json"
    if path.exists():
        return json.loads(path.read_text())
    log = out / "eval0" / f"seed{seed}.log"
    cmd = [sys.executable, "-c", "import sys; from opid_mega.cli import eval_main; sys.exit(eval_main())",
           "--config", str(ROOT / CONFIG), "--model", str(warm), f"train.seed={seed}"]
    wall = ex.run_logged(f"eval-only seed {seed}", cmd, log, env)
    line = next(ln for ln in reversed(log.read_text().splitlines()) if ln.startswith("{"))
    result = {**json.loads(line), "wall_s": wall, "seed": seed, "utc": utc()}
    write_json(path, result)
    return result


def cmd_calibrate(out: Path, env: dict) -> dict:
    d = check_design()
    warm = warm_start(out, env)
    probe_file = out / "probe.json"
    if not probe_file.exists():
        from opid_mega.infra.runtime import configure_threads

        configure_threads()
        write_json(probe_file, {**v2.probe_doors(load_cfg(), str(warm)), "utc": utc()})
    probe = json.loads(probe_file.read_text())
    e0 = eval_only(out, warm, 1, env)
    lo, hi = PRECONDITIONS["no_section_held_out_door_accuracy"]
    checks = {"door_accuracy_with_right_section": probe["door_accuracy_with_right_section"]
              >= PRECONDITIONS["door_accuracy_with_right_section_min"],
              "no_section_held_out_door_accuracy": lo <= e0["eval/first_door_correct"] <= hi}
    lam_file = out / "lambda_calibration" / "lambda.json"
    if not lam_file.exists():
        run_dir = out / "lambda_calibration"
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        lam_arm = [o.replace("{lam}", "0.1") for o in ARMS["opid"]]  # λ enters neither Δ nor A_out
        cmd = [sys.executable, "-m", "opid_mega.cli", "--config", str(ROOT / CONFIG), "--run-dir", str(run_dir),
               *lam_arm, f"model.init_from={warm}", "train.iterations=2", "train.lr=0", "eval.interval=0",
               "train.seed=1"]
        ex.run_logged("λ calibration", cmd, run_dir / "train.log", env)
        from opid_mega.models import load_tokenizer

        tok = load_tokenizer(str(warm))
        records = [json.loads(ln) for ln in (run_dir / "advantages.jsonl").read_text().splitlines() if ln.strip()]
        write_json(lam_file, {**lambda_rule(records, lambda t: tok.decode([t])), "utc": utc()})
    lam = json.loads(lam_file.read_text())
    w = json.loads((out / "warm_start.json").read_text())
    copied = v2.commit_warm_start(Path(w["path"]), WARM_DIR)
    prereg = {"design": d, "design_file": str(DESIGN.relative_to(ROOT)),
              "warm_start": {**w, "committed": {"dir": str(WARM_DIR.relative_to(ROOT)), "files": copied}},
              "probe": probe, "eval0_seed1": e0, "preconditions": checks, "lambda": lam["lambda"],
              "lambda_computation": lam,
              "arms": {a: [o.replace("{lam}", repr(lam["lambda"])) for o in ARMS[a]] for a in ARMS},
              "calibrated_utc": utc()}
    write_json(PREREG, prereg)
    print(json.dumps({"preconditions": checks, "door_accuracy_no_section_held_out": e0["eval/first_door_correct"],
                      "success_no_section_held_out": e0["eval/success_rate"],
                      "door_accuracy_with_right_section": probe["door_accuracy_with_right_section"],
                      "lambda": lam}, indent=1))
    print(f"wrote {PREREG.relative_to(ROOT)} and {WARM_DIR.relative_to(ROOT)}/: commit both before the gate")
    return prereg


# --------------------------------------------------------------------------------------------------------------------
# The gate and the runs
# --------------------------------------------------------------------------------------------------------------------


def load_prereg() -> dict:
    check_design()
    if not PREREG.exists():
        raise ex.ExperimentError(f"no {PREREG.relative_to(ROOT)}: run `tools/mechanism_v3.py calibrate` and commit it")
    p = json.loads(PREREG.read_text())
    if not all(p["preconditions"].values()):
        raise ex.ExperimentError(f"the warm start's preconditions do not hold: {p['preconditions']}")
    return p


def gate_overrides(out: Path) -> list:
    """The overrides the gate adds to every run: the retry's when the gate passed only on it."""
    f = out / "gate.json"
    if not f.exists():
        return []
    g = json.loads(f.read_text())
    return list(GATE["retry"]["overrides"]) if g.get("passed_on") == "retry" else []


def run_dir_of(out: Path, arm: str, seed: int, attempt: str = "") -> Path:
    return out / "runs" / (arm + attempt) / f"seed{seed}"


def run_one(out: Path, env: dict, prereg: dict, warm: Path, arm: str, seed: int, extra_overrides: list,
            run_dir: Path, label: str) -> dict:
    import yaml

    from opid_mega.config import dump_config

    if v2.weights_hash(warm) != prereg["warm_start"]["weights_sha256_16"]:
        raise ex.ExperimentError(f"the warm start {warm} is not the pre-registered one")
    cfg = load_cfg()
    steps = ex.eval_steps(cfg.train.iterations, cfg.eval.interval, cfg.eval.before_training)
    eval_only(out, warm, seed, env)
    extra = list(prereg["arms"][arm]) + extra_overrides + [f"train.seed={seed}", f"model.init_from={warm}",
                                                           f"logging.run_dir={run_dir}"]
    expected = yaml.safe_load(dump_config(load_cfg(extra)))
    if ex.run_is_complete(run_dir, expected, cfg.train.iterations, steps):
        print(f"{label}: complete, skipped", flush=True)
        return json.loads((run_dir / "experiment_run.json").read_text())
    busy = v2.busy_processes()
    if busy:
        raise ex.ExperimentError("the machine is not idle; other heavy processes: " + "; ".join(busy))
    load = os.getloadavg()
    print(f"{label}: opid-train (load {load[0]:.2f}; log {run_dir / 'train.log'})", flush=True)
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "opid_mega.cli", "--config", str(ROOT / CONFIG), "--run-dir", str(run_dir), *extra]
    started = utc()
    with v2.IdleMonitor() as monitor:
        wall = ex.run_logged(label, cmd, run_dir / "train.log", env)
    rec = {"arm": arm, "seed": seed, "wall_s": wall, "overrides": extra, "loadavg_before": load,
           "idle_monitor": monitor.record(), "machine": v2.machine_info(), "started_utc": started, "utc": utc()}
    write_json(run_dir / "experiment_run.json", rec)
    if rec["idle_monitor"]["other_heavy_processes_seen"]:
        print(f"    WARNING: other heavy processes ran: {rec['idle_monitor']['other_heavy_processes_seen']}", flush=True)
    if not ex.run_is_complete(run_dir, expected, cfg.train.iterations, steps):
        raise ex.ExperimentError(f"{label} finished without all its metrics ({run_dir})")
    print(f"    done in {wall / 60:.1f} min", flush=True)
    return rec


def door_curve(out: Path, run_dir: Path, seed: int, key: str = "eval/first_door_correct") -> list:
    from opid_mega.metrics import read_metrics

    start = json.loads((out / "eval0" / f"seed{seed}.json").read_text())[key]
    cfg = load_cfg()
    per_iter = cfg.rollout.tasks_per_iter * cfg.rollout.group_size
    return [(0, float(start))] + [(s * per_iter, v) for s, v in ex.eval_curve(read_metrics(run_dir), key)]


def cmd_gate(out: Path, env: dict) -> dict:
    prereg = load_prereg()
    warm = ex.find_warm_start(out / "warm_start.json") or warm_start(out, env)
    gate_file = out / "gate.json"
    if gate_file.exists():
        g = json.loads(gate_file.read_text())
        print(json.dumps(g, indent=1))
        return g
    attempts = {}
    for attempt, overrides in (("first", []), ("retry", list(GATE["retry"]["overrides"]))):
        starts, finals = {}, {}
        for seed in GATE["seeds"]:
            rd = run_dir_of(out, "grpo", seed, "" if attempt == "first" else "_gate_retry")
            run_one(out, env, prereg, warm, "grpo", seed, overrides, rd, f"gate ({attempt}) grpo seed {seed}")
            curve = door_curve(out, rd, seed)
            starts[seed], finals[seed] = curve[0][1], curve[-1][1]
        attempts[attempt] = {**gate_decision(starts, finals), "overrides": overrides, "utc": utc()}
        print(f"gate ({attempt}): {attempts[attempt]}", flush=True)
        if attempts[attempt]["passed"]:
            break
    passed_on = next((a for a, v in attempts.items() if v["passed"]), None)
    g = {"rule": GATE, "attempts": attempts, "passed": passed_on is not None, "passed_on": passed_on, "utc": utc()}
    write_json(gate_file, g)
    if passed_on == "retry":  # the retry's runs are GRPO seeds 1-2 of the experiment at the retry's lr
        for seed in GATE["seeds"]:
            src, dst = run_dir_of(out, "grpo", seed, "_gate_retry"), run_dir_of(out, "grpo", seed)
            if dst.exists():
                os.replace(dst, run_dir_of(out, "grpo_gate_first", seed))
            os.replace(src, dst)
    print(json.dumps(g, indent=1))
    return g


def gate_run_dir(out: Path, gate: dict, attempt: str, seed: int) -> Path:
    """Where an attempt's gate run lies once the gate decided (cmd_gate moves a passing retry's runs into place)."""
    if attempt == "first":
        return run_dir_of(out, "grpo", seed, "_gate_first" if gate.get("passed_on") == "retry" else "")
    return run_dir_of(out, "grpo", seed, "" if gate.get("passed_on") == "retry" else "_gate_retry")


def cmd_run(out: Path, env: dict, arms: Optional[list], seeds: Optional[list]) -> None:
    prereg = load_prereg()
    gate_file = out / "gate.json"
    if not gate_file.exists():
        raise ex.ExperimentError("the GRPO gate has not run: `tools/mechanism_v3.py gate` first")
    if not json.loads(gate_file.read_text())["passed"]:
        raise ex.ExperimentError("the GRPO gate failed (gate.json): by the registered rule no OPID arm runs")
    for a in arms or []:
        if a not in prereg["arms"]:
            raise ex.ExperimentError(f"arm {a!r} is not registered (arms: {', '.join(prereg['arms'])})")
    warm = ex.find_warm_start(out / "warm_start.json")
    todo = [(s, a) for s, a in SCHEDULE if (arms is None or a in arms) and (seeds is None or s in seeds)]
    for k, (seed, arm) in enumerate(todo, 1):
        run_one(out, env, prereg, warm, arm, seed, gate_overrides(out), run_dir_of(out, arm, seed),
                f"[{k}/{len(todo)}] {arm} seed {seed}")


# --------------------------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------------------------

ARCHIVED = ("warm_start.json", "probe.json", "gate.json", "lambda_calibration/lambda.json", "eval0/seed*.json",
            "runs/*/seed*/metrics.jsonl", "runs/*/seed*/experiment_run.json")


def run_values(out: Path, arm: str, seed: int, lam: Optional[float], decode) -> dict:
    from opid_mega.metrics import read_metrics

    rd = run_dir_of(out, arm, seed)
    records = read_metrics(rd)
    door, success = door_curve(out, rd, seed), door_curve(out, rd, seed, "eval/success_rate")
    adv_file = rd / "advantages.jsonl"
    adv = [json.loads(ln) for ln in adv_file.read_text().splitlines() if ln.strip()] if adv_file.exists() else []
    routed = any(r["kinds"] for r in adv)
    info = json.loads((rd / "experiment_run.json").read_text())
    return {"door_curve": door, "door_auc": ex.curve_auc(door), "door_final": door[-1][1],
            "success_curve": success, "success_auc": ex.curve_auc(success), "success_final": success[-1][1],
            "skill_share_pooled": ex.run_summary(records, len(records))["skill_share_pooled"],
            "decision_share": decision_share(adv, lam, decode) if routed and lam else None,
            "door_delta_signs": v2.door_delta_signs(adv, decode) if routed else None,
            "tie_group_share": v2.tie_group_share(adv), "wall_s": info["wall_s"],
            "idle_monitor": info["idle_monitor"], "started_utc": info.get("started_utc")}


def paired(arms: dict, arm: str, base: str, key: str = "door_auc") -> dict:
    common = sorted(set(arms.get(arm, {})) & set(arms.get(base, {})), key=int)
    t = v2.paired_tests([arms[arm][s][key] - arms[base][s][key] for s in common])
    return {"seeds": [int(s) for s in common], **t, "mde_80": mde(t.get("sd"), t["n"]) if t["n"] >= 2 else None}


def table(arms: dict) -> str:
    def fmt(vals, d=3):
        m, sd = ex.mean_std(vals)
        return "–" if m is None else f"{m:.{d}f}" + (f" ± {sd:.{d}f}" if sd is not None else "")

    lines = ["| arm | seeds | door accuracy, 0 rollouts | door accuracy, 960 | door AUC 0-960 | success, 0 | "
             "success, 960 | skill share on door tokens | skill share pooled | Δ sign-correct on door tokens |",
             "|" + "---|" * 10]
    for arm, by_seed in arms.items():
        v = list(by_seed.values())
        lines.append("| " + " | ".join([
            arm, str(len(v)), fmt([x["door_curve"][0][1] for x in v]), fmt([x["door_final"] for x in v]),
            fmt([x["door_auc"] for x in v]), fmt([x["success_curve"][0][1] for x in v]),
            fmt([x["success_final"] for x in v]), fmt([(x["decision_share"] or {}).get("mean") for x in v]),
            fmt([x["skill_share_pooled"] for x in v], 4),
            fmt([(x["door_delta_signs"] or {}).get("sign_correct") for x in v])]) + " |")
    return "\n".join(lines) + "\n"


def cmd_report(out: Path) -> dict:
    import shutil

    from opid_mega.models import load_tokenizer

    prereg = load_prereg()
    gate = json.loads((out / "gate.json").read_text()) if (out / "gate.json").exists() else None
    warm = ex.find_warm_start(out / "warm_start.json")
    tok = load_tokenizer(str(warm))
    decode = lambda t: tok.decode([t])  # noqa: E731
    lam = prereg["lambda"]
    arms: dict = {}
    missing = []
    for seed, arm in SCHEDULE:
        rd = run_dir_of(out, arm, seed)
        if not (rd / "experiment_run.json").exists():
            missing.append([seed, arm])
            continue
        arms.setdefault(arm, {})[str(seed)] = run_values(out, arm, seed, None if arm == "grpo" else lam, decode)
    gate_runs = {}  # the gate's runs of each attempt (the first attempt's, when the retry passed, are archived)
    if gate is not None:
        for attempt in gate["attempts"]:
            for seed in GATE["seeds"]:
                rd = gate_run_dir(out, gate, attempt, seed)
                if (rd / "experiment_run.json").exists():
                    door, success = door_curve(out, rd, seed), door_curve(out, rd, seed, "eval/success_rate")
                    gate_runs.setdefault(attempt, {})[str(seed)] = {
                        "run_dir": str(rd.relative_to(out)), "door_curve": door, "success_curve": success,
                        "wall_s": json.loads((rd / "experiment_run.json").read_text())["wall_s"]}
    tests = {"primary_opid_vs_grpo": paired(arms, "opid", "grpo"),
             "negative_control_opid_shuffled_vs_grpo": paired(arms, "opid_shuffled", "grpo"),
             "hindsight_opid_vs_opid_shuffled": paired(arms, "opid", "opid_shuffled"),
             "episode_only_vs_grpo": paired(arms, "opid_episode_only", "grpo")}
    descriptive = {"success_auc_opid_vs_grpo": paired(arms, "opid", "grpo", "success_auc"),
                   "door_final_opid_vs_grpo": paired(arms, "opid", "grpo", "door_final")}
    results = {"prereg": str(PREREG.relative_to(ROOT)), "lambda": lam, "gate": gate, "gate_runs": gate_runs,
               "arms": arms, "tests": tests,
               "descriptive": descriptive, "missing_runs": missing, "utc": utc()}
    write_json(RESULTS, results)
    lines = []
    for name, t in {**tests, **descriptive}.items():
        if not t.get("n"):
            lines.append(f"- {name}: no paired seeds")
            continue
        lines.append(f"- {name}: n = {t['n']}, mean difference {t['mean']:+.4f}"
                     + (f", sd {t['sd']:.4f}" if t.get("sd") is not None else "")
                     + (f", t = {t['t']:.3f}, one-sided p = {t['p_t_one_sided']:.4f}" if t.get("t") is not None
                        else "")
                     + f", exact sign-flip one-sided p = {t['p_signflip_one_sided']:.4f}"
                     + (f", MDE (power 0.8) {t['mde_80']:.4f}" if t.get("mde_80") is not None else ""))
    gate_line = "not run" if gate is None else (
        f"{'passed' if gate['passed'] else 'FAILED'}" + (f" on the {gate['passed_on']} attempt" if gate["passed"]
                                                         else "")
        + "; " + "; ".join(f"{a} attempt: mean door-accuracy gain {v['mean_gain']:+.3f} ("
                           + ", ".join(f"seed {s} {g:+.3f}" for s, g in v["gains"].items()) + ")"
                           for a, v in gate["attempts"].items()))
    gate_table = ["| attempt | seed | door accuracy at 0 / 320 / 640 / 960 rollouts | success at 0 / 320 / 640 / 960 |",
                  "|---|---|---|---|"]
    for attempt, by_seed in gate_runs.items():
        for seed, v in by_seed.items():
            gate_table.append(f"| {attempt} ({', '.join(gate['attempts'][attempt]['overrides']) or 'config lr'}) | "
                              f"{seed} | " + " / ".join(f"{y:.3f}" for _, y in v["door_curve"]) + " | "
                              + " / ".join(f"{y:.3f}" for _, y in v["success_curve"]) + " |")
    stopped = gate is not None and not gate["passed"]
    RESULTS_MD.write_text(
        "# Mechanism experiment v3: results (written by `python tools/mechanism_v3.py report`)\n\n"
        f"λ = {lam} (rule, at calibration). GRPO gate (margin +{GATE['margin']} held-out door accuracy): {gate_line}."
        "\n\nThe gate's runs (held-out, 256 games, no skills, temperature 0.4):\n\n" + "\n".join(gate_table) + "\n"
        + ("\nBy the registered rule the experiment stops here: GRPO does not raise held-out door accuracy by the "
           "margin at this budget, so no OPID arm ran and no test is computed.\n" if stopped else
           "\nMean ± sample sd over seeds.\n\n" + table(arms))
        + ("" if stopped else
           "\nPre-registered tests (one-sided, α 0.05, door-accuracy AUC over 0-960 rollouts):\n\n"
           + "\n".join(lines[:4]) + "\n\nDescriptive (not pre-registered):\n\n" + "\n".join(lines[4:]) + "\n"
           + (f"\nMissing runs (seed, arm): {missing}\n" if missing else "")))
    for pattern in ARCHIVED:
        for f in sorted(out.glob(pattern)):
            dest = RECORDS / f.relative_to(out)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
    per_iter = load_cfg().rollout.tasks_per_iter * load_cfg().rollout.group_size
    curves = {arm: [[(x / per_iter, y) for x, y in v["door_curve"]] for v in by_seed.values()]
              for arm, by_seed in arms.items()}
    if stopped:
        curves = {f"grpo gate, {attempt}": [[(x / per_iter, y) for x, y in v["door_curve"]] for v in by_seed.values()]
                  for attempt, by_seed in gate_runs.items()}
    if curves:
        ex.plot_curves(curves, FIGURE, title="Footprints", ylabel="held-out door accuracy (no skills)")
    print(RESULTS_MD.read_text())
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="tools/mechanism_v3.py", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("design", "calibrate", "gate", "run", "report"))
    p.add_argument("--out", default=str(ROOT / "runs" / "mechanism_v3"))
    p.add_argument("--arms")
    p.add_argument("--seeds")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = ex.child_env(None)
    commands = {"design": cmd_design, "calibrate": lambda: cmd_calibrate(out, env), "gate": lambda: cmd_gate(out, env),
                "report": lambda: cmd_report(out),
                "run": lambda: cmd_run(out, env, ex.parse_list(args.arms), ex.parse_list(args.seeds, int))}
    try:
        commands[args.command]()
    except ex.ExperimentError as e:
        print(f"mechanism_v3: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
