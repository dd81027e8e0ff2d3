"""opid-report: PNGs from a synthetic metrics.jsonl; clear errors for empty runs."""
import json
import random

from opid_mega.metrics import METRICS_FILE
from opid_mega.report import main, make_plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, seed, steps=40, with_skills=False, keep=None):
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / METRICS_FILE, "w") as f:
        for s in range(0, steps + 1):
            rec = {"step": s, "time": 1.7e9 + s, "elapsed_s": 10.0 * s}
            if s % 10 == 0:
                rec["eval/success_rate"] = min(1.0, 0.1 + 0.02 * s + rng.uniform(-0.05, 0.05))
                rec["eval/episode_length"] = 25 - 0.2 * s
                if with_skills:
                    rec["eval/success_rate_with_skills"] = min(1.0, 0.3 + 0.02 * s)
            if s > 0:
                A = rng.uniform(0.5, 1.5)
                D = rng.uniform(1e-4, 1e-3)
                rec.update({
                    "train/success_rate": rng.random(), "train/score": rng.uniform(0, 10),
                    "train/episode_length": rng.uniform(10, 30), "train/invalid_rate": rng.random() * 0.1,
                    "adv/outcome_abs_mean": A, "adv/skill_abs_mean": D, "adv/skill_share": D / (A + D),
                    "analysis/critical_steps_per_traj": rng.uniform(1, 5), "analysis/failure_rate": 0.02,
                    "ppo/clipfrac": rng.random() * 0.05, "ppo/kl": rng.random() * 0.01,
                    "ppo/entropy": rng.uniform(0.3, 1.0), "ppo/loss": rng.gauss(0, 0.1),
                    "rollout/logprob_mismatch": rng.random() * 1e-3, "perf/tokens_per_s": rng.uniform(1e3, 2e3),
                    "time/rollout": rng.uniform(5, 6), "time/analysis": rng.uniform(1, 2),
                    "time/score": rng.uniform(1, 2), "time/update": rng.uniform(2, 3), "time/total": rng.uniform(11, 13),
                    "ppo/nan_metric": None,
                })
            if keep is not None:
                rec = {k: v for k, v in rec.items() if k in ("step", "time", "elapsed_s") or k.startswith(keep)}
            f.write(json.dumps(rec) + "\n")


def _check_pngs(paths):
    for p in paths:
        assert p.exists() and p.stat().st_size > 1000
        assert p.read_bytes()[:8] == PNG_MAGIC


def test_report_single_run(tmp_path, capsys):
    run = tmp_path / "opid"
    _write_run(run, 0, with_skills=True)
    assert main([str(run)]) == 0
    printed = capsys.readouterr().out.split()
    names = {p.split("/")[-1] for p in printed}
    assert names == {"success_rate.png", "train_success.png", "advantages.png", "episode_length.png", "ppo.png",
                     "analysis.png", "rollout.png", "time.png"}
    from pathlib import Path

    paths = [Path(p) for p in printed]
    assert all(p.parent == run / "plots" for p in paths)
    _check_pngs(paths)


def test_report_compare_runs_and_partial_metrics(tmp_path):
    a, b = tmp_path / "opid", tmp_path / "grpo"
    _write_run(a, 1, keep=("train/", "eval/", "ppo/", "time/"))
    b.mkdir()
    # GRPO run with only a few keys, two lines for one step (merged), a torn last line
    with open(b / METRICS_FILE, "w") as f:
        for s in range(1, 6):
            f.write(json.dumps({"step": s, "train/success_rate": 0.1 * s, "ppo/kl": 0.001 * s}) + "\n")
        f.write(json.dumps({"step": 5, "eval/success_rate": 0.3}) + "\n")
        f.write('{"step": 6, "train/')
    out = tmp_path / "cmp"
    paths = make_plots([a, b], out_dir=out, smooth=0.5, labels=["OPID", "GRPO"])
    assert {p.name for p in paths} == {"success_rate.png", "train_success.png", "episode_length.png", "ppo.png",
                                       "time.png"}
    assert all(p.parent == out for p in paths)
    _check_pngs(paths)


def test_report_only_some_figures(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / METRICS_FILE).write_text(json.dumps({"step": 1, "ppo/kl": 0.5}) + "\n")
    paths = make_plots([run])
    assert [p.name for p in paths] == ["ppo.png"]
    _check_pngs(paths)


def test_report_errors(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (empty / METRICS_FILE).write_text("")
    assert main([str(empty)]) == 2
    assert "no metrics recorded" in capsys.readouterr().err
    (empty / METRICS_FILE).write_text(json.dumps({"step": 1, "unknown/x": 1.0}) + "\n")
    assert main([str(empty)]) == 2
    assert "no known metric" in capsys.readouterr().err
    (empty / METRICS_FILE).write_text(json.dumps({"step": 1, "ppo/kl": 1.0}) + "\n")
    assert main([str(empty), "--smooth", "1.5"]) == 2
    assert "--smooth" in capsys.readouterr().err


def test_report_env_info_metrics(tmp_path):
    """An env's info metrics (eval/<key> beyond the common ones, with train/<key>) get env_metrics.png, one panel per
    key; a run without them gets none."""
    from opid_mega.report import env_metric_panels, load_run

    run = tmp_path / "fp"
    run.mkdir()
    with open(run / METRICS_FILE, "w") as f:
        for s in range(0, 21):
            rec = {"step": s, "train/first_door_correct": 0.2 + 0.01 * s}
            if s % 10 == 0:
                rec.update({"eval/success_rate": 0.2 + 0.01 * s, "eval/first_door_correct": 0.25 + 0.015 * s,
                            "eval/episode_length": 3.7})
            f.write(json.dumps(rec) + "\n")
    panels = env_metric_panels([load_run(run)])
    assert panels == [("first door correct", [("eval/first_door_correct", "eval (no skills)", "-"),
                                              ("train/first_door_correct", "train", ":")], False)]
    paths = make_plots([run])
    assert {p.name for p in paths} == {"success_rate.png", "env_metrics.png", "episode_length.png"}
    _check_pngs(paths)
    plain = tmp_path / "plain"
    _write_run(plain, 3)
    assert "env_metrics.png" not in {p.name for p in make_plots([plain])}
