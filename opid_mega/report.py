"""`opid-report RUN_DIR [RUN_DIR ...]`: training curves from metrics.jsonl as PNG files.

One run: the plots go to RUN_DIR/plots/. Several runs (e.g. OPID vs GRPO, like the paper's figures): one line per
run in every plot, written to the first run's plots/ unless `--out DIR` is given. A figure is drawn only when at
least one of its metrics is present. The paths of the written files are printed, one per line.

Figures (file: metrics):
  success_rate.png    eval/success_rate (validation WITHOUT skills), eval/success_rate_with_skills (skill_grpo)
  train_success.png   train/success_rate, train/score
  advantages.png      adv/outcome_abs_mean (|A_out|) vs adv/skill_abs_mean (|λΔ|), adv/skill_share
  episode_length.png  train/episode_length, eval/episode_length, train/invalid_rate
  ppo.png             ppo/kl, ppo/clipfrac, ppo/entropy, ppo/loss
  analysis.png        analysis/critical_steps_per_traj, analysis/failure_rate
  rollout.png         rollout/logprob_mismatch, perf/tokens_per_s
  time.png            time/<stage>: seconds per iteration, stacked per stage (time/total etc. as a line)
  env_metrics.png     the env's own outcome metrics (its `info_metrics`, e.g. footprints' first_door_correct):
                      eval/<key> (held-out, no skills) and train/<key>, one panel per key
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from opid_mega.metrics import METRICS_FILE, read_metrics

# (file stem, title, [panels]); a panel is (y label, [(metric key, legend label, line style)], log y?)
FIGURES: list[tuple[str, str, list[tuple[str, list[tuple[str, str, str]], bool]]]] = [
    ("success_rate", "Validation success rate", [
        ("success rate", [("eval/success_rate", "eval (no skills)", "-"),
                          ("eval/success_rate_with_skills", "eval (with skills)", "--")], False),
    ]),
    ("train_success", "Training rollouts", [
        ("success rate", [("train/success_rate", "train success", "-")], False),
        ("score", [("train/score", "train score", "-")], False),
    ]),
    ("advantages", "Advantage magnitudes", [
        ("mean |advantage|", [("adv/outcome_abs_mean", "|A_out|", "-"),
                              ("adv/skill_abs_mean", "|λΔ|", "--")], True),
        ("skill share", [("adv/skill_share", "|λΔ| share", "-")], False),
    ]),
    ("episode_length", "Episode length", [
        ("steps", [("train/episode_length", "train", "-"), ("eval/episode_length", "eval", "--")], False),
        ("invalid rate", [("train/invalid_rate", "invalid actions", "-")], False),
    ]),
    ("ppo", "PPO statistics", [
        ("KL", [("ppo/kl", "KL to reference", "-")], False),
        ("clip fraction", [("ppo/clipfrac", "clipfrac", "-")], False),
        ("entropy", [("ppo/entropy", "entropy", "-")], False),
        ("loss", [("ppo/loss", "loss", "-")], False),
    ]),
    ("analysis", "Hindsight analysis", [
        ("critical steps / traj", [("analysis/critical_steps_per_traj", "critical steps", "-")], False),
        ("failure rate", [("analysis/failure_rate", "analysis failures", "-")], False),
    ]),
    ("rollout", "Rollout engine", [
        ("|logprob mismatch|", [("rollout/logprob_mismatch", "engine vs trainer", "-")], False),
        ("tokens / s", [("perf/tokens_per_s", "throughput", "-")], False),
    ]),
]


# eval/ metrics every run has; any other eval/<key> is one of the env's info_metrics (env_metrics.png).
COMMON_EVAL_KEYS = ("eval/success_rate", "eval/success_rate_with_skills", "eval/episode_length", "eval/invalid_rate")


def env_metric_panels(data: list) -> list:
    """The panels of env_metrics.png: one per env info metric found as eval/<key> in any run."""
    keys = sorted({k[len("eval/"):] for recs in data for r in recs for k in r
                   if k.startswith("eval/") and k not in COMMON_EVAL_KEYS})
    return [(key.replace("_", " "), [(f"eval/{key}", "eval (no skills)", "-"), (f"train/{key}", "train", ":")],
             False) for key in keys]


# Whole-iteration times: drawn as a line over the stacked stages, not stacked themselves.
TOTAL_TIME_KEYS = ("time/total", "time/iteration", "time/iter", "time/step")


class ReportError(RuntimeError):
    """A run directory that cannot be reported on; the message names it."""


def load_run(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir)
    if not path.exists():
        raise ReportError(f"{run_dir}: no such run directory")
    file = path / METRICS_FILE if path.is_dir() else path
    if not file.exists():
        raise ReportError(f"{run_dir}: no {METRICS_FILE} (has the run logged an iteration yet?)")
    try:
        recs = read_metrics(file)
    except ValueError as e:
        raise ReportError(str(e)) from None
    if not recs:
        raise ReportError(f"{file}: no metrics recorded yet")
    return recs


def series(recs: list[dict], key: str, smooth: float = 0.0) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, skipping missing/null; `smooth` in [0, 1): EMA weight of the past."""
    xs, ys = [], []
    ema = None
    for r in recs:
        v = r.get(key)
        if v is None or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        ema = v if ema is None or smooth <= 0 else smooth * ema + (1 - smooth) * v
        xs.append(r["step"])
        ys.append(ema)
    return xs, ys


def _run_label(path: str | os.PathLike) -> str:
    p = Path(path).resolve()
    return (p.parent.name if p.is_file() else p.name) or str(path)


def _figure(plt, title: str, n_panels: int):
    cols = min(n_panels, 2)
    rows = math.ceil(n_panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.8 * rows), squeeze=False)
    fig.suptitle(title)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    return fig, flat[:n_panels]


def make_plots(runs: Sequence[str | os.PathLike], out_dir: Optional[str | os.PathLike] = None,
               smooth: float = 0.0, labels: Optional[Sequence[str]] = None) -> list[Path]:
    """Draw every figure that has data; returns the written PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ReportError("no run directory given")
    if not 0 <= smooth < 1:
        raise ReportError(f"--smooth must be in [0, 1), got {smooth}")
    data = [load_run(r) for r in runs]
    labels = list(labels) if labels else [_run_label(r) for r in runs]
    if len(labels) != len(runs):
        raise ReportError(f"{len(labels)} labels for {len(runs)} runs")
    many = len(runs) > 1
    first = Path(runs[0])
    out = Path(out_dir) if out_dir is not None else (first if first.is_dir() else first.parent) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig, stem: str) -> None:
        path = out / f"{stem}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    figures = FIGURES + ([("env_metrics", "Env metrics", env_metric_panels(data))] if env_metric_panels(data) else [])
    for stem, title, panels in figures:
        # Eval curves are never smoothed: they are measured every `eval.interval` steps and should read as measured.
        sm = 0.0 if stem in ("success_rate", "env_metrics") else smooth
        present = [p for p in panels if any(series(recs, key)[0] for recs in data for key, _, _ in p[1])]
        if not present:
            continue
        fig, axes = _figure(plt, title, len(present))
        for ax, (ylabel, lines, logy) in zip(axes, present):
            for ri, recs in enumerate(data):
                for key, label, style in lines:
                    xs, ys = series(recs, key, sm)
                    if not xs:
                        continue
                    name = f"{labels[ri]}: {label}" if many else label
                    marker = "o" if len(xs) <= 30 else None
                    ax.plot(xs, ys, linestyle=style, marker=marker, markersize=3, label=name,
                            color=f"C{ri}" if many else None)
            if logy and all(y > 0 for recs in data for key, _, _ in lines for y in series(recs, key)[1]):
                ax.set_yscale("log")
            ax.set_xlabel("training step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        save(fig, stem)

    # Time per stage: stacked areas (one run) or total seconds per iteration (several runs). A whole-iteration time
    # (time/total, time/iteration, ...) is drawn as a line, never stacked.
    time_keys = sorted({k for recs in data for r in recs for k in r if k.startswith("time/")})
    total_key = next((k for k in TOTAL_TIME_KEYS if k in time_keys), None)
    stage_keys = [k for k in time_keys if k not in TOTAL_TIME_KEYS]
    if time_keys:
        fig, (ax,) = _figure(plt, "Time per iteration", 1)
        if not many:
            if stage_keys:
                steps = sorted({r["step"] for r in data[0] if any(r.get(k) is not None for k in stage_keys)})
                by_step = {r["step"]: r for r in data[0]}
                stacks = [[float(by_step[s].get(k) or 0.0) for s in steps] for k in stage_keys]
                ax.stackplot(steps, stacks, labels=[k[len("time/"):] for k in stage_keys], alpha=0.85)
            if total_key:
                xs, ys = series(data[0], total_key)
                ax.plot(xs, ys, color="black", linewidth=1.2, label=total_key[len("time/"):])
            ax.legend(fontsize=8, loc="upper left", ncol=2)
        else:
            for ri, recs in enumerate(data):
                if total_key:
                    xs, ys = series(recs, total_key)
                else:
                    pts = [(r["step"], sum(float(r.get(k) or 0.0) for k in stage_keys)) for r in recs
                           if any(r.get(k) is not None for k in stage_keys)]
                    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                ax.plot(xs, ys, label=labels[ri], color=f"C{ri}")
            ax.legend(fontsize=8)
        ax.set_xlabel("training step")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3)
        save(fig, "time")

    if not written:
        raise ReportError(f"{runs[0]}: metrics.jsonl has no known metric to plot")
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="opid-report", description="Plot training curves from RUN_DIR/metrics.jsonl.")
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (several: compared in one plot)")
    ap.add_argument("--out", default=None, help="output directory (default: FIRST_RUN_DIR/plots)")
    ap.add_argument("--smooth", type=float, default=0.0,
                    help="EMA weight in [0, 1) for training curves (eval success is never smoothed)")
    ap.add_argument("--labels", default=None, help="comma-separated legend names, one per run")
    args = ap.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    try:
        paths = make_plots(args.runs, args.out, smooth=args.smooth, labels=labels)
    except ReportError as e:
        print(f"opid-report: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
