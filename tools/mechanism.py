#!/usr/bin/env python
"""The pre-registered mechanism experiment on footprints (docs/experiments.md "Mechanism experiment").

    python tools/mechanism.py probe    [--out DIR]        # warm start + its probe preconditions (archived)
    python tools/mechanism.py lambda   [--out DIR]        # λ from the rule: two warm-start batches, no update
    python tools/mechanism.py prereg   [--out DIR]        # writes docs/mechanism_prereg.json (commit it first)
    python tools/mechanism.py run      [--out DIR] [--arms a,b] [--seeds 1,2]   # the arms, gated by the prereg

Not built yet: the report (docs/mechanism_results.json, table, figure). The runs refuse any arm, seed, config
file or override that docs/mechanism_prereg.json does not hold (the config file's sha256, the warm start's
weights hash and λ are checked too). Every step's output is archived under DIR (default runs/mechanism): the
warm start log, probe.json, the λ calibration run with its advantages.jsonl, one eval-only run per seed (the
0-rollout point, shared by the arms of that seed) and runs/<arm>/seed<k>/.

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
SCHEDULE = ([(s, a) for s in (1, 2, 3) for a in ("grpo", "opid_rule", "opid_shuffled")]
            + [(s, a) for s in (4, 5) for a in ("grpo", "opid_rule")]
            + [(s, "skill_grpo") for s in (1, 2, 3)]
            + [(s, "opid_shuffled") for s in (4, 5)]
            + [(s, a) for s in (1, 2, 3) for a in ("opid_ref", "grpo_mean_norm")])
PRECONDITIONS = {"no_skill_success": [0.08, 0.25], "door_accuracy_with_right_section_min": 0.8,
                 "delta_match_min": 0.5, "delta_mismatch_max": -1.0}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


def warm_start(out: Path, env: dict) -> Path:
    """The cached skill-reading warm start (opid-sft on CONFIG), its log archived in OUT/logs/warm_start.log."""
    record = out / "warm_start.json"
    warm = ex.find_warm_start(record)
    if warm is not None:
        return warm
    log = out / "logs" / "warm_start.log"
    cmd = [sys.executable, "-c", "import sys; from opid_mega.cli import sft_main; sys.exit(sft_main())",
           "--config", str(ROOT / CONFIG)]
    wall = ex.run_logged("warm start (opid-sft)", cmd, log, env)
    lines = [ln.strip() for ln in log.read_text().splitlines()]
    path = next((ln for ln in reversed(lines) if ln and (Path(ln) / ".opid_sft_complete").exists()), "")
    if not path:
        raise ex.ExperimentError(f"opid-sft finished without a warm start (log {log})")
    record.write_text(json.dumps({"path": path, "wall_s": wall, "weights_sha256_16": weights_hash(Path(path))}) + "\n")
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
    for ep in expert_episodes(cfg, split=cfg.env.eval_split):
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
        from opid_mega.cli import configure_threads

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


def lambda_rule(records: Sequence[dict]) -> dict:
    """λ = median |A_out| over the step-samples of mixed groups (groups whose trajectory scores differ) ÷ the 95th
    percentile of |Δ| over skill-routed tokens, rounded down to one significant figure."""
    by_group: dict = {}
    for r in records:
        by_group.setdefault((r["iteration"], r["group"]), []).append(r)
    mixed = [r for g in by_group.values() if len({x["score"] for x in g}) > 1 for r in g]
    a_out = [abs(r["a_out"]) for r in mixed]
    deltas = sorted(abs(d) for r in records for kind in r["kinds"] for d in r["delta"][kind])
    if not a_out or not deltas:
        raise ValueError(f"λ rule: {len(a_out)} mixed-group samples, {len(deltas)} skill-routed tokens")
    p95 = deltas[min(len(deltas) - 1, math.ceil(0.95 * len(deltas)) - 1)]  # nearest rank
    med = statistics.median(a_out)
    return {"median_abs_a_out_mixed": med, "p95_abs_delta_routed": p95, "ratio": med / p95,
            "lambda": round_down_1sig(med / p95), "mixed_group_samples": len(a_out),
            "groups": len(by_group), "mixed_groups": sum(len({x["score"] for x in g}) > 1 for g in by_group.values()),
            "routed_tokens": len(deltas)}


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
    prereg = {
        "question": "Does the pipeline turn correct hindsight into sample efficiency, and NOT when the hindsight is "
                    "wrong? A positive and a negative control with a privileged hindsight analyzer; not a "
                    "reproduction of the paper's LLM-analyzer result.",
        "env": {"name": "footprints", "version": VERSION, "train_pool": "seeds 0-47", "held_out": "seeds 200000-200255"},
        "config_file": CONFIG, "config_sha256": sha256_file(ROOT / CONFIG),
        "config": yaml.safe_load(dump_config(cfg)),
        "warm_start": {"dir_name": Path(warm["path"]).name, "weights_sha256_16": warm["weights_sha256_16"],
                       "sft": yaml.safe_load(dump_config(cfg))["sft"]},
        "probe": probe, "preconditions": PRECONDITIONS,
        "lambda": lam["lambda"], "lambda_computation": {**lam, "rule": lambda_rule.__doc__.strip()},
        "arms": {a: arm_overrides(a, lam["lambda"]) for a in ARMS},
        "schedule": [[s, a] for s, a in SCHEDULE],
        "phases": {"1": ["grpo x seeds 1-5", "opid_rule x seeds 1-5", "opid_shuffled x seeds 1-3 (4-5 if time)",
                         "skill_grpo x seeds 1-3 (eval with and without skills)"],
                   "2": ["opid_ref (λ 0.001) x seeds 1-3", "grpo_mean_norm x seeds 1-3"]},
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
                           "The runs stop at the session's time limit; the pairs completed are reported, the "
                           "missing ones named."],
        "idle_machine": "the runs are one opid-train subprocess at a time; the tool refuses to start while another "
                        "torch/opid process runs (tools/mechanism.py busy_processes) and records the load average "
                        "before each run",
    }
    PREREG.write_text(json.dumps(prereg, indent=1) + "\n")
    print(f"wrote {PREREG}: λ = {lam['lambda']}; commit it before any OPID arm runs")
    return prereg


def busy_processes() -> list:
    """Other heavy processes on this machine (python running torch / pytest / opid), by /proc scan."""
    me = {os.getpid(), os.getppid()}
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
        raise ex.ExperimentError(f"the warm start {warm} is not the pre-registered one (weights hash)")
    if prereg["arms"][arm] != arm_overrides(arm, prereg["lambda"]):
        raise ex.ExperimentError(f"arm {arm}: this tool's overrides {arm_overrides(arm, prereg['lambda'])} differ "
                                 f"from the pre-registered {prereg['arms'][arm]}")
    return list(prereg["arms"][arm])


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
    for k, (seed, arm) in enumerate(todo, 1):
        extra = check_prereg(prereg, arm, seed, warm)
        eval_only(out, warm, seed, env)
        run_dir = out / "runs" / arm / f"seed{seed}"
        extra = extra + [f"train.seed={seed}", f"model.init_from={warm}", f"logging.run_dir={run_dir}"]
        expected = yaml.safe_load(dump_config(load_cfg(extra)))
        if ex.run_is_complete(run_dir, expected, iterations, steps):
            print(f"[{k}/{len(todo)}] {arm} seed {seed}: complete, skipped", flush=True)
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
        wall = ex.run_logged(f"{arm} seed {seed}", cmd, run_dir / "train.log", env)
        (run_dir / "experiment_run.json").write_text(json.dumps({"wall_s": wall, "overrides": extra,
                                                                 "loadavg_before": load}) + "\n")
        if not ex.run_is_complete(run_dir, expected, iterations, steps):
            raise ex.ExperimentError(f"{arm} seed {seed} finished without all its metrics ({run_dir})")
        print(f"    done in {wall / 60:.1f} min", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="tools/mechanism.py", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("probe", "lambda", "prereg", "run"))
    p.add_argument("--out", default=str(ROOT / "runs" / "mechanism"))
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
        else:
            cmd_run(out, env, ex.parse_list(args.arms), ex.parse_list(args.seeds, int))
    except ex.ExperimentError as e:
        print(f"mechanism: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
