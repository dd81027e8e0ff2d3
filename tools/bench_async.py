"""What a hosted analyzer's latency costs an OPID iteration, on-policy and with bounded staleness.

A GRPO run (no analyzer; `train.max_staleness=0`) sets the baseline: its mean iteration time and its median rollout
time. OPID then runs against `opid_mega.skills.standin` (an OpenAI-compatible server on loopback that answers every
analyzer prompt with the rule analyzer's analysis, in the reference's JSON format, after `latency` seconds per reply)
at each latency and each `train.max_staleness`. An iteration's time is the wall-clock time between two consecutive
metrics records (everything the user pays: rollout, waits, scoring, update, weight sync), with evaluation and
checkpoints switched off; the mean over iterations 2..N-s with staleness s (the first iteration draws s extra
rollouts, the last s draw none) -- a mean, since with several analyses in flight the iteration times alternate
between waiting and not (the analysis wait: a mean too; the rollout time: a median). Each run is one `opid-train`
process; nothing else should run meanwhile.

    python tools/bench_async.py                                   # latencies 0 10 30 60 s, staleness 0 1 2
    python tools/bench_async.py --latency-factors 0.75 --staleness 0 1 2   # latency = 0.75 x GRPO's median rollout
    python tools/bench_async.py --config configs/smollm2_textworld.yaml --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opid_mega.skills.standin import StandinServer  # noqa: E402


def run(config: str, iterations: int, overrides: list, out: Path, staleness: int = 0) -> dict:
    """One opid-train run; mean iteration time and analysis wait, median rollout time over iterations 2..N-staleness."""
    cmd = [sys.executable, "-m", "opid_mega.cli", "--config", config, "--run-dir", str(out),
           f"train.iterations={iterations}", "train.save_interval=0", "eval.interval=0", "eval.before_training=false",
           "logging.tensorboard=false", "logging.progress=false", *overrides]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if r.returncode != 0:
        raise SystemExit(f"bench_async: {' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [x for x in recs if x.get("step", 0) >= 1]
    times = {x["step"]: x["time"] for x in recs}
    last = iterations - staleness
    its = [times[k] - times[k - 1] for k in range(2, last + 1) if k in times and k - 1 in times]
    mid = [x for x in recs if 2 <= x["step"] <= last]
    # the mean, not the median: with analyses of several iterations in flight the iteration times alternate (one
    # iteration waits for its reply, the next finds its own already there), and a median of such a series is either
    # phase, not what a run pays per iteration
    return {"iteration_s": statistics.fmean(its), "iteration_median_s": statistics.median(its),
            "rollout_s": statistics.median(x["time/rollout"] for x in mid),
            "analysis_wait_s": statistics.fmean(x.get("time/analysis_wait", 0.0) for x in mid),
            "staleness": max(x.get("rollout/staleness", 0) for x in mid),
            "iterations_s": [round(v, 2) for v in its], "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    ap.add_argument("--iterations", type=int, default=6, help="per run (iteration time: mean over 2..N-staleness)")
    ap.add_argument("--latencies", type=float, nargs="*", default=None,
                    help="seconds per reply (default 0 10 30 60 unless --latency-factors is given)")
    ap.add_argument("--latency-factors", type=float, nargs="*", default=[],
                    help="latencies as multiples of the GRPO run's median rollout time (added to --latencies)")
    ap.add_argument("--staleness", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--modes", nargs="*", default=["colocated"], choices=["colocated", "disaggregated"],
                    help="deploy.mode of the OPID runs at staleness >= 1 (disaggregated: the next rollout plays "
                         "beside the update); staleness 0 runs once, colocated")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--baseline", help="take the GRPO baseline from this earlier --json of the same config instead of "
                                       "running it (another sitting: the ratios are less exact; the table says so)")
    ap.add_argument("override", nargs="*", help="key=value config overrides for every run")
    a = ap.parse_args(argv)
    if a.iterations < 3 + max(a.staleness, default=0):
        raise SystemExit("bench_async: --iterations must be >= 3 + the largest --staleness (iteration time over "
                         "iterations 2..N-staleness)")
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        if a.baseline:
            prev = json.loads(Path(a.baseline).read_text())
            if Path(prev.get("config", "")).resolve() != Path(a.config).resolve() or "grpo" not in prev:
                raise SystemExit(f"bench_async: --baseline {a.baseline} holds no GRPO run of {a.config}")
            grpo = dict(prev["grpo"], baseline_from=a.baseline)
            grpo["iteration_s"] = statistics.fmean(grpo["iterations_s"])  # a mean, as run() computes it
        else:
            grpo = run(a.config, a.iterations, ["algo.mode=grpo", "analyzer.backend=rules", *a.override],
                       Path(tmp) / "grpo")
        print(f"GRPO (staleness 0): iteration {grpo['iteration_s']:.2f} s, rollout {grpo['rollout_s']:.2f} s "
              f"(iteration: mean, rollout: median over iterations 2..{a.iterations})", flush=True)
        latencies = [(f"{f:g} x rollout", f * grpo["rollout_s"]) for f in a.latency_factors] + \
                    [(f"{x:g} s", x) for x in (a.latencies if a.latencies is not None else
                                               [] if a.latency_factors else [0, 10, 30, 60])]
        rows = []
        for label, latency in latencies:
            with StandinServer(latency_s=latency) as server:
                for s, mode in [(s, m) for s in a.staleness for m in (a.modes if s else ["colocated"])]:
                    name = f"opid_l{latency:.2f}_s{s}_{mode}"
                    res = run(a.config, a.iterations,
                              ["algo.mode=opid", "analyzer.backend=llm", f"analyzer.base_url={server.base_url}",
                               "analyzer.model=standin", f"train.max_staleness={s}", f"deploy.mode={mode}",
                               *a.override], Path(tmp) / name, s)
                    res.update(latency_label=label, latency_s=round(latency, 3), max_staleness=s, mode=mode,
                               ratio_to_grpo=res["iteration_s"] / grpo["iteration_s"])
                    rows.append(res)
                    print(f"OPID latency {label:>14} ({latency:6.2f} s) staleness {s} {mode}: iteration "
                          f"{res['iteration_s']:.2f} s = {res['ratio_to_grpo']:.2f} x GRPO, analysis wait "
                          f"{res['analysis_wait_s']:.2f} s", flush=True)
    print("\n| analyzer latency per reply | max_staleness | deploy.mode | OPID iteration (s) | / GRPO | "
          "analysis wait (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['latency_label']} ({r['latency_s']:.1f} s) | {r['max_staleness']} | {r['mode']} | "
              f"{r['iteration_s']:.2f} | {r['ratio_to_grpo']:.2f} | {r['analysis_wait_s']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"config": a.config, "grpo": grpo, "opid": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
