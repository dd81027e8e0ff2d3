#!/usr/bin/env python
"""Mechanism experiment, version 4: can the pipeline tell OPID from GRPO, and how much does an analyzer that errs
cost? (docs/experiments.md "Mechanism experiment v4"; versions 1-3: tools/mechanism.py, tools/mechanism_v3.py.)

    python tools/mechanism_v4.py pilot  --runs DIR [DIR ...]   # docs/mechanism_v4/pilot.json from valid-split runs
    python tools/mechanism_v4.py design                         # docs/mechanism_v4/design.json (commit it first)
    python tools/mechanism_v4.py run    [--out DIR] [--arms a,b] [--seeds 101,102]
    python tools/mechanism_v4.py report [--out DIR]             # results.{json,md}, curves.png, records/

What version 3 taught, and what changes here:
  * no gate that stops the experiment: the budget is the main job's (configs/footprints_cpu.yaml: 100 iterations of
    4 tasks x 8 from a pool of 2,000 training games), where GRPO's own gain was measured on the VALID split with
    seeds that are never reported (the pilot); every arm runs and is reported whatever comes out;
  * fresh seeds (101-108) and the TEST split (all 256 held-out games at every evaluation) for the results; every
    choice (budget, λ, the stability default algo.skill_share_cap) was made on the valid split;
  * besides the privileged analyzer (an oracle: Δ on the door token is close to a correctness label) two arms with
    an analyzer that errs: it believes a WRONG door for 20% / 40% of the trajectories (FootprintsHindsightAnalyzer
    wrong_door_rate) and 5% of its replies are empty and 5% cut mid-JSON. It is served by the OpenAI-compatible
    hosted-analyzer stand-in (opid_mega.skills.standin) and read by the real LLM analyzer client, so the request,
    retry, re-ask and parsing path runs as it does against a hosted model;
  * every run's metrics are committed (docs/mechanism_v4/records/, gzip), with the machine and the load seen.

`run` refuses arms or seeds the design does not hold, and refuses to start unless docs/mechanism_v4/design.json is
committed and this tool and the config still match the hashes in it. DIR (default runs/mechanism_v4) is not
committed; `report` copies every run's metrics into docs/mechanism_v4/records/.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import experiment as ex  # noqa: E402
import mechanism as v2  # noqa: E402  (machine record, idle monitor, paired tests, t interval)
import mechanism_v3 as v3  # noqa: E402  (the MDE)

VERSION = 4
CONFIG = "configs/footprints_cpu.yaml"
DOCS = ROOT / "docs" / "mechanism_v4"
PILOT, DESIGN = DOCS / "pilot.json", DOCS / "design.json"
RESULTS, RESULTS_MD, FIGURE, RECORDS = DOCS / "results.json", DOCS / "results.md", DOCS / "curves.png", DOCS / "records"
SEEDS = tuple(range(101, 109))
ITERATIONS = 100  # the main job's budget (configs/footprints_cpu.yaml), evaluated every 20 iterations
ANALYZER = "opid_mega.skills.hindsight:FootprintsHindsightAnalyzer"
REPLY_FAULTS = {"empty_rate": 0.05, "malformed_rate": 0.05}
STANDIN_KEY_ENV = "OPID_V4_STANDIN_KEY"  # the stand-in checks no key; the client sends one
# arm -> (config overrides, the stand-in's analyzer options or None: the privileged analyzer in process)
ARMS = {
    "grpo": (["algo.mode=grpo"], None),
    "opid": ([], None),
    "opid_shuffled": (["algo.skill_source=shuffled"], None),
    "opid_noisy20": ([], {"wrong_door_rate": 0.2}),
    "opid_noisy40": ([], {"wrong_door_rate": 0.4}),
}
STANDIN_OVERRIDES = ["analyzer.backend=llm", "analyzer.model=standin", "analyzer.backoff_s=0.1",
                     f"analyzer.api_key_env={STANDIN_KEY_ENV}"]
PRIMARY, SECONDARY = "eval/first_door_correct", "eval/success_rate"
# registered comparisons: name -> (arm, baseline); one-sided paired t-test (H1: arm > baseline) and the exact
# sign-flip test on the primary endpoint, each with the MDE from its measured paired sd
TESTS = {"opid_vs_grpo": ("opid", "grpo"), "noisy20_vs_grpo": ("opid_noisy20", "grpo"),
         "noisy40_vs_grpo": ("opid_noisy40", "grpo"), "shuffled_vs_grpo": ("opid_shuffled", "grpo"),
         "opid_vs_noisy40": ("opid", "opid_noisy40")}


def utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


def read_metrics(run: Path) -> list:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def endpoints(records: Sequence[dict]) -> dict:
    """One run's numbers: AUC (trapezoid over the evaluated iterations, divided by their span) and the first and
    last held-out value of the primary (door accuracy) and secondary (success) endpoints, and the largest KL."""
    out = {}
    for name, key in (("door", PRIMARY), ("success", SECONDARY)):
        curve = ex.eval_curve(records, key)
        out[name] = {"curve": curve, "auc": ex.curve_auc(curve), "first": curve[0][1] if curve else None,
                     "last": curve[-1][1] if curve else None}
    out["max_kl"] = max((r.get("ppo/kl") or 0.0) for r in records)
    out["skill_share"] = ex._mean_of(records, "adv/skill_share")
    out["analysis_failure_rate"] = ex._mean_of(records, "analysis/failure_rate")
    return out


def paired(values: dict, arm: str, base: str, key: str = "door") -> dict:
    """The registered test of arm vs base on `key`'s AUC over the seeds both have: diffs, one-sided t and sign-flip
    p-values, and the MDE (one-sided α 0.05, power 0.8) from the measured paired sd."""
    seeds = sorted(set(values.get(arm, {})) & set(values.get(base, {})))
    diffs = [values[arm][s][key]["auc"] - values[base][s][key]["auc"] for s in seeds]
    out = {"arm": arm, "baseline": base, "seeds": seeds, **v2.paired_tests(diffs)}
    out["mde"] = v3.mde(out.get("sd"), len(diffs))
    return out


def seeds_needed(sd: float, effect: float, alpha: float = 0.05, power: float = 0.8, most: int = 40) -> Optional[int]:
    """The fewest seeds n whose MDE (one-sided t, paired sd `sd`) is at most `effect`; None past `most`."""
    for n in range(3, most + 1):
        m = v3.mde(sd, n, alpha, power)
        if m is not None and m <= effect:
            return n
    return None


# ------------------------------------------------------------------------------------------------------------------
def cmd_pilot(runs: Sequence[Path]) -> dict:
    """The pilot: valid-split runs (never reported as results) of the main job's arms, named <arm>_<seed>_<path>
    by their directory (e.g. v_s11_n_grpo, v_s11_n_cap1): GRPO's own gain, and the paired sd of the door AUC of OPID
    (skill_share_cap 1) vs GRPO, hence the seeds the design needs."""
    by: dict = {}
    for run in runs:
        parts = run.name.split("_")  # v, s<seed>, <path>, <arm>
        if len(parts) < 4 or not (run / "metrics.jsonl").exists():
            raise SystemExit(f"pilot: {run} is not a finished pilot run named v_s<seed>_<path>_<arm>")
        records = read_metrics(run)
        if not any(r.get("step") == ITERATIONS and r.get(PRIMARY) is not None for r in records):
            raise SystemExit(f"pilot: {run} has no evaluation after iteration {ITERATIONS}")
        by.setdefault(parts[3], {})[f"{parts[1]}_{parts[2]}"] = endpoints(records)
    grpo, opid = by.get("grpo", {}), by.get("cap1", {})
    gains = {k: v["door"]["last"] - v["door"]["first"] for k, v in grpo.items()}
    both = sorted(set(grpo) & set(opid))
    diffs = [opid[k]["door"]["auc"] - grpo[k]["door"]["auc"] for k in both]
    sd = statistics.stdev(diffs) if len(diffs) >= 2 else None
    pilot = {"split": "valid (256 games, seeds 100000-100255)", "runs": sorted(str(r.name) for r in runs),
             "grpo_door_gain": gains, "grpo_door_gain_mean": statistics.mean(gains.values()) if gains else None,
             "opid_minus_grpo_door_auc": dict(zip(both, diffs)), "paired_sd": sd,
             "seeds_for_mde_0.05": seeds_needed(sd, 0.05) if sd else None, "utc": utc(),
             "by_arm": {arm: {k: {n: (v[n]["auc"], v[n]["first"], v[n]["last"]) for n in ("door", "success")}
                              for k, v in runs_.items()} for arm, runs_ in by.items()}}
    write_json(PILOT, pilot)
    print(json.dumps({k: pilot[k] for k in ("grpo_door_gain_mean", "paired_sd", "seeds_for_mde_0.05")}))
    return pilot


def design() -> dict:
    from opid_mega.envs.footprints_env import VERSION as ENV_VERSION

    if not PILOT.exists():
        raise ex.ExperimentError(f"no {PILOT.relative_to(ROOT)}: run `tools/mechanism_v4.py pilot` first")
    return {
        "version": VERSION,
        "question": "Does OPID beat GRPO at the main job's budget, with the privileged analyzer and with an analyzer "
                    "that errs (a wrong door believed right for 20% / 40% of the trajectories, 5% empty and 5% cut "
                    "replies, through the real client), and not with another task's skills?",
        "env": {"name": "footprints", "version": ENV_VERSION, "train_pool": "2,000 games (seeds 0-1999)",
                "held_out": "test split, all 256 games (seeds 200000-200255) at every evaluation"},
        "config_file": CONFIG, "config_sha256": v2.sha256_file(ROOT / CONFIG),
        "analysis_code": {"file": "tools/mechanism_v4.py", "sha256": v2.sha256_file(Path(__file__))},
        "arms": {a: {"overrides": o, "standin": s} for a, (o, s) in ARMS.items()},
        "standin": {"analyzer": ANALYZER, "reply_faults": REPLY_FAULTS, "overrides": STANDIN_OVERRIDES,
                    "seeding": "the analyzer's and the faults' seed is the run's seed"},
        "seeds": list(SEEDS), "schedule": "interleaved by seed: for each seed every arm, in the order above",
        "budget": {"iterations": ITERATIONS, "tasks_per_iteration": 4, "group_size": 8, "rollouts": 32 * ITERATIONS,
                   "evaluation": "iterations 0, 20, 40, 60, 80, 100; 256 test games, temperature 0.4, no skills",
                   "sized_from": "the pilot (docs/mechanism_v4/pilot.json): valid split, seeds 11-13, native and "
                                 "AVX2 paths, GRPO and OPID (skill_share_cap 1) at kl_coef 0.01; the config's "
                                 "kl_coef 0.05 was chosen after it, on the same split "
                                 "(docs/main_job/selection)"},
        "pilot": json.loads(PILOT.read_text()),
        "endpoints": {"primary": f"held-out door accuracy AUC over iterations 0-{ITERATIONS} (trapezoid / {ITERATIONS}), "
                                 "paired by seed",
                      "secondary": ["held-out success AUC", "final door accuracy and success", "largest KL",
                                    "skill share", "analysis failure rate"]},
        "tests": {name: {"arm": a, "baseline": b, "test": "one-sided paired t (H1: arm > baseline), alpha 0.05; the "
                                                          "exact one-sided sign-flip test beside it; MDE from the "
                                                          "measured paired sd (power 0.8)"}
                  for name, (a, b) in TESTS.items()},
        "negative_control": "shuffled_vs_grpo must not be positive and significant; if it is, a gain of opid is not "
                            "hindsight",
        "decision_rules": ["Every run and seed is reported; no reruns except crashes (reported).",
                           "A non-significant difference is reported as 'none detected above the MDE'.",
                           "Only the tests above are called registered; everything else is descriptive."],
        "registered_utc": utc(),
    }


def cmd_design() -> dict:
    d = design()
    write_json(DESIGN, d)
    print(f"wrote {DESIGN.relative_to(ROOT)}: commit it before any run")
    return d


def committed(path: Path) -> bool:
    """`path` is in git's HEAD and unchanged in the working tree."""
    rel = str(path.relative_to(ROOT))
    known = subprocess.run(["git", "cat-file", "-e", f"HEAD:{rel}"], cwd=ROOT, capture_output=True).returncode == 0
    clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", rel], cwd=ROOT).returncode == 0
    return known and clean


def check_design() -> dict:
    if not DESIGN.exists() or not committed(DESIGN):
        raise ex.ExperimentError(f"{DESIGN.name} is not committed: run `design` and commit it first")
    d = json.loads(DESIGN.read_text())
    if v2.sha256_file(ROOT / CONFIG) != d["config_sha256"]:
        raise ex.ExperimentError(f"{CONFIG} differs from the registered design (sha256)")
    if v2.sha256_file(Path(__file__)) != d["analysis_code"]["sha256"]:
        raise ex.ExperimentError("tools/mechanism_v4.py differs from the registered design (sha256)")
    if d["arms"] != {a: {"overrides": o, "standin": s} for a, (o, s) in ARMS.items()} or d["seeds"] != list(SEEDS):
        raise ex.ExperimentError("this tool's arms or seeds differ from the registered design")
    return d


# ------------------------------------------------------------------------------------------------------------------
def run_one(out: Path, arm: str, seed: int) -> Optional[dict]:
    """One registered run (skipped when its record exists): opid-train on the config with the arm's overrides; the
    noisy arms against a stand-in started here for the run."""
    from opid_mega.skills.standin import StandinServer

    run = out / "runs" / arm / f"seed{seed}"
    record = run / "v4_run.json"
    if record.exists():
        return None
    overrides, standin = ARMS[arm]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", STANDIN_KEY_ENV: "standin"}
    cmd = [sys.executable, "-c", "import sys; from opid_mega.cli import train_main; sys.exit(train_main())",
           "--config", str(ROOT / CONFIG), "--run-dir", str(run), "--overwrite", "logging.progress=false",
           f"train.seed={seed}", *overrides]
    server = StandinServer(analyzer=ANALYZER, analyzer_options={**standin, "seed": seed}, seed=seed,
                           **REPLY_FAULTS) if standin else None
    if server is not None:
        cmd += STANDIN_OVERRIDES + [f"analyzer.base_url={server.base_url}"]
    run.parent.mkdir(parents=True, exist_ok=True)
    start, t0 = utc(), time.time()
    try:
        if server is not None:
            server.start()
        with v2.IdleMonitor() as mon, open(run.parent / f"seed{seed}.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    finally:
        if server is not None:
            server.close()
    if rc != 0:
        raise ex.ExperimentError(f"{arm} seed {seed} failed (exit {rc}): {run.parent / f'seed{seed}.log'}")
    rec = {"arm": arm, "seed": seed, "wall_s": round(time.time() - t0, 1), "started_utc": start, "ended_utc": utc(),
           "machine": v2.machine_info(), "load": mon.record(),
           "standin": {"requests": server.requests, "faults": server.faults} if server is not None else None}
    write_json(record, rec)
    return rec


def cmd_run(out: Path, arms: Optional[list], seeds: Optional[list]) -> None:
    d = check_design()
    bad = [a for a in (arms or []) if a not in d["arms"]] + [str(s) for s in (seeds or []) if s not in d["seeds"]]
    if bad:
        raise ex.ExperimentError(f"not in the registered design: {', '.join(bad)}")
    for seed in seeds or d["seeds"]:
        for arm in arms or list(d["arms"]):
            print(f"[{utc()}] {arm} seed {seed}", flush=True)
            rec = run_one(out, arm, seed)
            if rec:
                print(f"  {rec['wall_s']:.0f} s, max load {rec['load']['max_load1']}", flush=True)


# ------------------------------------------------------------------------------------------------------------------
def collect(out: Path) -> dict:
    values: dict = {}
    for rec_file in sorted((out / "runs").glob("*/seed*/v4_run.json")):
        meta = json.loads(rec_file.read_text())
        records = read_metrics(rec_file.parent)
        values.setdefault(meta["arm"], {})[meta["seed"]] = {**endpoints(records), "meta": meta, "records": records}
    return values


def markdown(values: dict, tests: dict) -> str:
    lines = ["| arm | seeds | door AUC (mean ± sd) | door first -> last (mean) | success AUC | success last | "
             "largest KL (max) | analysis failures |", "|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        rs = list(values.get(arm, {}).values())
        if not rs:
            continue

        def ms(xs):
            xs = [x for x in xs if x is not None]
            return (f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1
                    else f"{xs[0]:.3f}" if xs else "-")
        fails = [r["analysis_failure_rate"] for r in rs if r["analysis_failure_rate"] is not None]
        lines.append(f"| {arm} | {len(rs)} | {ms([r['door']['auc'] for r in rs])} | "
                     f"{statistics.mean(r['door']['first'] for r in rs):.3f} -> "
                     f"{statistics.mean(r['door']['last'] for r in rs):.3f} | "
                     f"{ms([r['success']['auc'] for r in rs])} | {ms([r['success']['last'] for r in rs])} | "
                     f"{max(r['max_kl'] for r in rs):.2f} | {ms(fails)} |")
    lines += ["", "| registered test | n | mean diff (door AUC) | sd | one-sided p (t) | p (sign-flip) | MDE |",
              "|---|---|---|---|---|---|---|"]
    for name, t in tests.items():
        def f(x, d=3):
            return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"
        lines.append(f"| {name} ({t['arm']} − {t['baseline']}) | {t['n']} | {f(t.get('mean'))} | {f(t.get('sd'))} | "
                     f"{f(t.get('p_t_one_sided'), 4)} | {f(t.get('p_signflip_one_sided'), 4)} | {f(t.get('mde'))} |")
    return "\n".join(lines) + "\n"


def cmd_report(out: Path) -> dict:
    d = json.loads(DESIGN.read_text())
    values = collect(out)
    tests = {name: paired(values, a, b) for name, (a, b) in TESTS.items()}
    secondary = {name: paired(values, a, b, "success") for name, (a, b) in TESTS.items()}
    RECORDS.mkdir(parents=True, exist_ok=True)
    for arm, by_seed in values.items():
        for seed, v in by_seed.items():
            with gzip.open(RECORDS / f"{arm}_seed{seed}.jsonl.gz", "wt", compresslevel=9) as f:
                f.writelines(json.dumps(x) + "\n" for x in v["records"])
    result = {"design_file": str(DESIGN.relative_to(ROOT)), "registered_utc": d["registered_utc"],
              "reported_utc": utc(), "tests": tests, "secondary_success_auc": secondary,
              "arms": {arm: {str(s): {k: v for k, v in r.items() if k != "records"} for s, r in by_seed.items()}
                       for arm, by_seed in values.items()}}
    write_json(RESULTS, result)
    RESULTS_MD.write_text(markdown(values, tests))
    for key, name in ((PRIMARY, "door"), (SECONDARY, "success")):
        curves = {arm: [ex.eval_curve(r["records"], key) for r in by_seed.values()] for arm, by_seed in values.items()}
        ex.plot_curves(curves, FIGURE if name == "door" else DOCS / "curves_success.png",
                       title=f"Held-out {'door accuracy' if name == 'door' else 'success'} (test split)",
                       ylabel=f"held-out {'first-door accuracy' if name == 'door' else 'success rate'}")
    print(RESULTS_MD.read_text())
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["pilot", "design", "run", "report"])
    ap.add_argument("--out", default=str(ROOT / "runs" / "mechanism_v4"))
    ap.add_argument("--runs", nargs="*", default=[])
    ap.add_argument("--arms")
    ap.add_argument("--seeds")
    args = ap.parse_args(argv)
    try:
        if args.command == "pilot":
            cmd_pilot([Path(r) for r in args.runs])
        elif args.command == "design":
            cmd_design()
        elif args.command == "run":
            cmd_run(Path(args.out), ex.parse_list(args.arms), ex.parse_list(args.seeds, int))
        else:
            cmd_report(Path(args.out))
    except ex.ExperimentError as e:
        print(f"mechanism_v4: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
