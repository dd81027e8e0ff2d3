#!/usr/bin/env python
"""The README main job on several seeds and floating-point paths: does it rise everywhere, or on one machine only?

    python tools/main_job_table.py run    [--out DIR] [--seeds 1-6] [--paths native,default] [--arms opid,grpo]
    python tools/main_job_table.py report [--out DIR]     # docs/main_job/results.{json,md}, records/*.jsonl.gz

`run` trains configs/footprints_cpu.yaml once per (seed, path, arm), one run at a time, interleaved by seed so an
interrupted table leaves complete sets: arm `opid` is the config as shipped, `grpo` the same with algo.mode=grpo.
Path `native` is torch's own choice of CPU kernels on this machine; `default` sets ATEN_CPU_CAPABILITY=default
(torch's scalar kernels: another rounding path on the same machine, about 1.5x slower), so a result that holds on
one rounding path only shows up here. Every run's metrics.jsonl, its wall time, the machine and the load seen during
the run go into DIR (default runs/main_job_table; a finished run is not run again). `report` checks each OPID run
against the bounds below and writes the table with the median and the worst run of each arm, and every run's metrics
compressed into docs/main_job/records/ (committed: nothing of the table lives only in runs/).

Bounds (every OPID run): the last held-out evaluation >= the first + 0.10, and no evaluation below the first - 0.05.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

CONFIG = "configs/footprints_cpu.yaml"
DOCS = ROOT / "docs" / "main_job"
ARMS = {"opid": [], "grpo": ["algo.mode=grpo"]}
PATHS = {"native": {}, "default": {"ATEN_CPU_CAPABILITY": "default"}}
METRIC = "eval/success_rate"
SECONDARY = "eval/first_door_correct"
RISE, DIP = 0.10, 0.05  # the last evaluation >= first + RISE; none below first - DIP


def utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def parse_seeds(text: str) -> list:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def run_dir(out: Path, arm: str, path: str, seed: int) -> Path:
    return out / arm / path / f"seed{seed}"


def evals(records: Sequence[dict], key: str = METRIC) -> list:
    """(iteration, value) of every held-out evaluation in a run's metrics, in order."""
    return [(int(r["step"]), float(r[key])) for r in records if r.get(key) is not None]


def verdict(curve: Sequence[tuple], rise: float = RISE, dip: float = DIP) -> dict:
    """The bounds on one run's held-out curve: gain = last - first >= rise, and worst dip = min - first >= -dip."""
    values = [v for _, v in curve]
    if len(values) < 2:
        return {"ok": False, "why": f"{len(values)} evaluations"}
    gain, low = values[-1] - values[0], min(values) - values[0]
    return {"first": values[0], "last": values[-1], "gain": gain, "worst_dip": low,
            "ok": gain >= rise - 1e-9 and low >= -dip - 1e-9}


def summary(runs: Sequence[dict]) -> dict:
    """Median and worst (the run with the smallest gain) of an arm's runs."""
    if not runs:
        return {}
    gains = [r["verdict"]["gain"] for r in runs]
    worst = min(runs, key=lambda r: r["verdict"]["gain"])
    return {"runs": len(runs), "median_gain": statistics.median(gains),
            "median_last": statistics.median(r["verdict"]["last"] for r in runs),
            "median_door_gain": statistics.median(r["door"]["gain"] for r in runs),
            "worst": {"seed": worst["seed"], "path": worst["path"], "first": worst["verdict"]["first"],
                      "last": worst["verdict"]["last"], "gain": worst["verdict"]["gain"]},
            "all_within_bounds": all(r["verdict"]["ok"] for r in runs),
            "median_wall_s": statistics.median(r["wall_s"] for r in runs if r.get("wall_s") is not None)}


# ------------------------------------------------------------------------------------------------------------------
def cmd_run(out: Path, seeds: list, paths: list, arms: list) -> None:
    import mechanism as v2  # the machine record and the idle monitor of the mechanism experiments

    for seed in seeds:
        for path in paths:
            for arm in arms:
                d = run_dir(out, arm, path, seed)
                done = d / "table_run.json"
                if done.exists():
                    continue
                env = {**os.environ, "PYTHONWARNINGS": "ignore", **PATHS[path]}
                cmd = [sys.executable, "-c", "import sys; from opid_mega.cli import train_main; sys.exit(train_main())",
                       "--config", str(ROOT / CONFIG), "--run-dir", str(d), "--overwrite", f"train.seed={seed}",
                       "logging.progress=false", *ARMS[arm]]
                d.parent.mkdir(parents=True, exist_ok=True)
                print(f"[{utc()}] {arm} {path} seed {seed}", flush=True)
                start = utc()
                t0 = time.time()
                with v2.IdleMonitor() as mon, open(d.parent / f"seed{seed}.log", "w") as log:
                    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
                if rc != 0:
                    raise SystemExit(f"{arm} {path} seed {seed} failed (exit {rc}): {d.parent / f'seed{seed}.log'}")
                done.write_text(json.dumps({"arm": arm, "path": path, "seed": seed, "overrides": ARMS[arm],
                                            "env": PATHS[path], "wall_s": round(time.time() - t0, 1),
                                            "started_utc": start, "ended_utc": utc(), "machine": v2.machine_info(),
                                            "load": mon.record()}, indent=1) + "\n")


def collect(out: Path) -> dict:
    runs: dict = {arm: [] for arm in ARMS}
    for done in sorted(out.glob("*/*/seed*/table_run.json")):
        meta = json.loads(done.read_text())
        records = [json.loads(ln) for ln in (done.parent / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        curve, door = evals(records), evals(records, SECONDARY)
        runs[meta["arm"]].append({**{k: meta[k] for k in ("seed", "path", "wall_s", "started_utc", "machine")},
                                  "curve": curve, "door_curve": door, "verdict": verdict(curve),
                                  "door": verdict(door), "max_kl": max((r.get("ppo/kl") or 0.0) for r in records),
                                  "load": meta["load"], "records": records})
    for arm in runs:
        runs[arm].sort(key=lambda r: (r["seed"], r["path"]))
    return runs


def markdown(runs: dict) -> str:
    steps = next((" / ".join(str(i) for i, _ in r["curve"]) for rs in runs.values() for r in rs), "")
    lines = [f"| arm | seed | path | held-out success at iterations {steps} | gain | worst dip | door accuracy gain "
             "| max KL | wall s | bounds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, rs in runs.items():
        for r in rs:
            v = r["verdict"]
            lines.append(f"| {arm} | {r['seed']} | {r['path']} | {' / '.join(f'{x:.3f}' for _, x in r['curve'])} | "
                         f"{v['gain']:+.3f} | {v['worst_dip']:+.3f} | {r['door']['gain']:+.3f} | {r['max_kl']:.2f} | "
                         f"{r['wall_s']:.0f} | {'ok' if v['ok'] else 'MISSED'} |")
    lines += ["", "| arm | runs | median gain | worst run (seed, path: first -> last) | median final | median door "
                  "gain | all within bounds | median wall s |", "|---|---|---|---|---|---|---|---|"]
    for arm, rs in runs.items():
        s = summary(rs)
        if not s:
            continue
        w = s["worst"]
        lines.append(f"| {arm} | {s['runs']} | {s['median_gain']:+.3f} | {w['gain']:+.3f} (seed {w['seed']}, "
                     f"{w['path']}: {w['first']:.3f} -> {w['last']:.3f}) | {s['median_last']:.3f} | "
                     f"{s['median_door_gain']:+.3f} | {'yes' if s['all_within_bounds'] else 'no'} | "
                     f"{s['median_wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def cmd_report(out: Path) -> dict:
    runs = collect(out)
    records = DOCS / "records"
    records.mkdir(parents=True, exist_ok=True)
    for arm, rs in runs.items():
        for r in rs:
            text = "".join(json.dumps(x) + "\n" for x in r["records"]).encode()
            with open(records / f"{arm}_{r['path']}_seed{r['seed']}.jsonl.gz", "wb") as raw, \
                    gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:  # the same bytes every time
                f.write(text)
    result = {"config": CONFIG, "bounds": {"rise": RISE, "dip": DIP, "metric": METRIC}, "reported_utc": utc(),
              "command": "python tools/main_job_table.py run && python tools/main_job_table.py report",
              "summary": {arm: summary(rs) for arm, rs in runs.items()},
              "runs": {arm: [{k: v for k, v in r.items() if k != "records"} for r in rs] for arm, rs in runs.items()}}
    (DOCS / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (DOCS / "results.md").write_text(markdown(runs))
    print(markdown(runs))
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["run", "report"])
    ap.add_argument("--out", default=str(ROOT / "runs" / "main_job_table"))
    ap.add_argument("--seeds", default="1-6")
    ap.add_argument("--paths", default="native,default")
    ap.add_argument("--arms", default="opid,grpo")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.command == "run":
        paths, arms = args.paths.split(","), args.arms.split(",")
        bad = [p for p in paths if p not in PATHS] + [a for a in arms if a not in ARMS]
        if bad:
            ap.error(f"unknown path or arm: {', '.join(bad)} (paths: {', '.join(PATHS)}; arms: {', '.join(ARMS)})")
        cmd_run(out, parse_seeds(args.seeds), paths, arms)
    else:
        cmd_report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
