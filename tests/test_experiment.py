"""tools/experiment.py: the GRPO-vs-OPID experiment's numbers (curves, AUC, mean ± std over seeds, paired
differences, table, plot) on synthetic metrics, its resume / error rules, and the whole `--preset smoke` pipeline."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "experiment.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("experiment_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


ex = _load_tool()


def _records(evals: dict, iterations: int, tokens=1000.0, scoring_s=2.0, stages=(1.0, 3.0), share=None,
             magnitudes=None):
    """Merged per-step metrics as the trainer writes them: eval at the given steps, training records 1..iterations
    (`magnitudes`: one (|A_out|, |λΔ|) per iteration)."""
    recs = {s: {"step": s} for s in range(0, iterations + 1)}
    for s in range(1, iterations + 1):
        recs[s].update({"train/success_rate": 0.5, "scoring/tokens": tokens, "time/scoring": scoring_s,
                        "time/rollout": stages[0], "time/update": stages[1]})
        if share is not None:
            recs[s]["adv/skill_share"] = share
        if magnitudes is not None:
            recs[s]["adv/outcome_abs_mean"], recs[s]["adv/skill_abs_mean"] = magnitudes[s - 1]
    for s, v in evals.items():
        recs[s]["eval/success_rate"] = v
    return [recs[s] for s in sorted(recs) if len(recs[s]) > 1]


def test_eval_steps_match_the_trainers_rule():
    assert ex.eval_steps(12, 3) == [0, 3, 6, 9, 12]
    assert ex.eval_steps(10, 4) == [0, 4, 8, 10]  # and after the last iteration
    assert ex.eval_steps(10, 4, before_training=False) == [4, 8, 10]
    assert ex.eval_steps(5, 0) == []
    from opid_mega.config import load_config
    from opid_mega.trainer import should_evaluate

    for iters, interval, before in ((12, 3, True), (7, 2, False), (4, 5, True)):
        cfg = load_config(None, [f"train.iterations={iters}", f"eval.interval={interval}",
                                 f"eval.before_training={str(before).lower()}"])
        assert ex.eval_steps(iters, interval, before) == [it for it in range(iters + 1) if should_evaluate(cfg, it)]


def test_auc_is_the_trapezoid_mean_over_the_span():
    # (3·0.6 + 3·0.8 + 3·1.1 + 3·1.2) / 2 / 12 = 5.55 / 12
    assert ex.curve_auc([(0, 0.2), (3, 0.4), (6, 0.4), (9, 0.7), (12, 0.5)]) == pytest.approx(0.4625)
    assert ex.curve_auc([(0, 0.0), (2, 1.0), (10, 1.0)]) == pytest.approx(0.9)  # (2·0.5 + 8·1) / 10, uneven steps
    assert ex.curve_auc([(4, 0.3)]) == pytest.approx(0.3)
    assert math.isnan(ex.curve_auc([]))


def test_run_summary_reads_curve_and_per_iteration_costs():
    recs = _records({0: 0.25, 2: 0.5, 4: 0.75}, 4, tokens=1200.0, scoring_s=1.5, stages=(2.0, 4.0), share=0.01)
    s = ex.run_summary(recs, 4)
    assert s["curve"] == [(0, 0.25), (2, 0.5), (4, 0.75)]
    assert (s["start"], s["final"]) == (0.25, 0.75)
    assert s["auc"] == pytest.approx((2 * 0.75 / 2 + 2 * 1.25 / 2) / 4)  # 0.5
    assert s["scoring_tokens"] == pytest.approx(1200.0)
    assert s["scoring_s"] == pytest.approx(1.5)
    assert s["iteration_s"] == pytest.approx(2.0 + 4.0 + 1.5)  # the sum of the time/* stages
    assert s["skill_share"] == pytest.approx(0.01)
    assert s["train_success"] == pytest.approx(0.5)
    assert s["skill_share_pooled"] is None  # no magnitudes logged
    # an iteration whose groups all tie (|A_out| = 0) counts by its magnitudes: (0.002 + 0.001) / (1.0 + 0.003)
    s = ex.run_summary(_records({0: 0.25}, 2, magnitudes=[(1.0, 0.002), (0.0, 0.001)]), 2)
    assert s["skill_share_pooled"] == pytest.approx(0.003 / 1.003)


def test_mean_std_is_the_sample_std():
    m, sd = ex.mean_std([0.5, 0.25, 0.75])
    assert m == pytest.approx(0.5) and sd == pytest.approx(0.25)  # sqrt((0 + 0.0625 + 0.0625) / 2)
    assert ex.mean_std([0.4]) == (pytest.approx(0.4), None)
    assert ex.mean_std([None, float("nan")]) == (None, None)


def test_aggregate_pairs_arms_by_seed_and_table_shows_mean_std():
    summ = {
        "grpo": {1: ex.run_summary(_records({0: 0.25, 2: 0.5}, 2), 2),
                 2: ex.run_summary(_records({0: 0.25, 2: 0.25}, 2), 2)},
        "opid": {1: ex.run_summary(_records({0: 0.25, 2: 0.75}, 2, share=0.002), 2),
                 2: ex.run_summary(_records({0: 0.25, 2: 0.25}, 2, share=0.004), 2),
                 3: ex.run_summary(_records({0: 0.25, 2: 1.0}, 2, share=0.003), 2)},  # no GRPO partner: unpaired
    }
    agg = ex.aggregate(summ)
    assert agg["grpo"]["final"] == (pytest.approx(0.375), pytest.approx(math.sqrt(2 * 0.125 ** 2)))
    assert agg["opid"]["seeds"] == [1, 2, 3]
    assert agg["opid"]["final"][0] == pytest.approx(2.0 / 3)
    # paired on seeds 1 and 2: differences 0.25 and 0 -> mean 0.125, sample std 0.1767767
    assert agg["opid"]["final_vs_grpo"] == (pytest.approx(0.125), pytest.approx(0.1767767, rel=1e-6))
    # AUC of a 2-point curve over [0, 2] is the mean of its ends: grpo (0.375, 0.25), opid seeds 1, 2: (0.5, 0.25)
    assert agg["opid"]["auc_vs_grpo"] == (pytest.approx(0.0625), pytest.approx(0.0883883, rel=1e-6))
    assert agg["grpo"]["final_vs_grpo"] == (None, None)
    assert agg["opid"]["skill_share"][0] == pytest.approx(0.003)
    table = ex.markdown_table(agg)
    lines = table.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("| arm | seeds |")
    opid = [ln for ln in lines if ln.startswith("| opid |")][0]
    assert "| 3 |" in opid and "0.667 ± 0.382" in opid and "+0.125 ± 0.177" in opid and "1,000" in opid
    grpo = [ln for ln in lines if ln.startswith("| grpo |")][0]
    assert "0.375 ± 0.177" in grpo and "| – |" in grpo


def test_mean_curve_and_plot(tmp_path):
    curves = [[(0, 0.2), (3, 0.4), (6, 0.6)], [(0, 0.4), (3, 0.2), (6, 0.8)]]
    pts = ex.mean_curve(curves)
    assert [p[0] for p in pts] == [0, 3, 6]
    assert pts[1][1] == pytest.approx(0.3) and (pts[1][3], pts[1][4]) == (0.2, 0.4)  # mean, min, max
    # only the steps every seed has
    assert ex.mean_curve([[(0, 0.1), (3, 0.2)], [(0, 0.3)]]) == [
        (0, pytest.approx(0.2), pytest.approx(0.1414213, rel=1e-6), 0.1, 0.3)]
    out = ex.plot_curves({"grpo": curves, "opid": curves[::-1]}, tmp_path / "c.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_response_tokens_mark_both_occurrences_of_the_action():
    from opid_mega.models import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path("", "tiny-qwen3"))
    resp = "<think>I will go west.</think>\n<action>go west</action>"
    ids, mask = ex.response_tokens(tok, resp, "go west")
    assert ids == list(tok(resp, add_special_tokens=False)["input_ids"])  # as the warm start tokenizes it
    picked = "".join(tok.decode([i]) for i, m in zip(ids, mask) if m)
    assert " ".join(picked.split()) == "go westgo west" or " ".join(picked.split()) == "go west go west"
    assert not any(m for i, m in zip(ids, mask) if "think" in tok.decode([i]) or "action" in tok.decode([i]))


def _cfg_dict(run_dir):
    import yaml

    from opid_mega.config import dump_config, load_config

    return yaml.safe_load(dump_config(load_config(None, [f"logging.run_dir={run_dir}"])))


def _write_run(run_dir, records, config):
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_run_is_complete_only_with_its_config_and_every_metric(tmp_path):
    run = tmp_path / "r"
    cfg = _cfg_dict(run)
    _write_run(run, _records({0: 0.25, 2: 0.5, 4: 0.5}, 4), cfg)
    assert ex.run_is_complete(run, cfg, 4, [0, 2, 4])
    assert not ex.run_is_complete(run, cfg, 4, [0, 2, 3, 4])  # an evaluation is missing
    assert not ex.run_is_complete(run, cfg, 5, [0, 2, 4])  # the last iteration is missing
    assert not ex.run_is_complete(run, {**cfg, "train": {**cfg["train"], "seed": 9}}, 4, [0, 2, 4])  # other config
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"no step": 1}\n{"step": 1}\n')  # a corrupt middle line
    assert not ex.run_is_complete(run, cfg, 4, [0, 2, 4])
    assert not ex.run_is_complete(tmp_path / "missing", cfg, 4, [0])


def _tool(*args, timeout=120):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def test_bad_arguments_are_clear_errors(tmp_path):
    r = _tool("--preset", "smoke", "--out", str(tmp_path / "a"), "--arms", "grpo,opdi")
    assert r.returncode == 1 and "unknown arm(s) opdi" in r.stderr and "no_routing" in r.stderr
    r = _tool("--preset", "smoke", "--out", str(tmp_path / "a"), "--seeds", "1,x")
    assert r.returncode == 1 and "'1,x'" in r.stderr
    r = _tool("--preset", "smoke", "--out", str(tmp_path / "a"), "--seeds", "1,1")
    assert r.returncode == 1 and "must not repeat" in r.stderr
    r = _tool("--preset", "smoke", "--out", str(tmp_path / "a"), "algo.lambda_step=-1")
    assert r.returncode == 1 and "config error: algo.lambda_step" in r.stderr
    r = _tool("--preset", "nope")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = _tool("--preset", "smoke", "--out", str(tmp_path / "a"), "--jobs", "0")
    assert r.returncode == 2 and "--jobs must be at least 1, got 0" in r.stderr


def test_report_only_aggregates_existing_runs_and_refuses_a_foreign_out_dir(tmp_path):
    out = tmp_path / "exp"
    evals = {1: {0: 0.25, 1: 0.5, 2: 0.5}, 2: {0: 0.25, 1: 0.25, 2: 0.5}}
    for arm, bump in (("grpo", 0.0), ("opid", 0.25)):
        for seed, ev in evals.items():
            run = out / "runs" / arm / f"seed{seed}"
            _write_run(run, _records({k: v + (bump if k else 0) for k, v in ev.items()}, 2,
                                     share=0.01 if arm == "opid" else 0.0), _cfg_dict(run))
    r = _tool("--preset", "smoke", "--out", str(out), "--seeds", "1,2", "--report-only")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert res["aggregate"]["opid"]["final_vs_grpo"][0] == pytest.approx(0.25)
    assert res["aggregate"]["grpo"]["final"][0] == pytest.approx(0.5)
    assert (out / "curves.png").stat().st_size > 5000 and "| opid | 2 |" in (out / "table.md").read_text()
    assert "sanity: GRPO held-out success: start 0.250 ± 0.000 -> end 0.500 ± 0.000" in r.stdout
    assert "sanity: skill share of the advantage" in r.stdout and "opid 0.0100" in r.stdout
    # the same OUT with another base config is refused (its warm start and runs belong to another experiment)
    r = _tool("--preset", "smoke", "--out", str(out), "--report-only", "train.lr=0.5")
    assert r.returncode == 1 and "another base config or overrides" in r.stderr


@pytest.mark.slow
def test_smoke_preset_end_to_end_and_resume(tmp_path):
    out = tmp_path / "smoke"
    r = _tool("--preset", "smoke", "--out", str(out), "--threads", "1", "--jobs", "2", timeout=900)  # arms side by side
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    res = json.loads((out / "results.json").read_text())
    assert sorted(res["runs"]) == ["grpo", "opid"] and list(res["runs"]["grpo"]) == ["1"]
    from opid_mega.metrics import read_metrics

    for arm in ("grpo", "opid"):
        run = res["runs"][arm]["1"]
        assert [s for s, _ in run["curve"]] == [0, 1, 2]  # held-out evaluations before training and after 1, 2
        # the per-iteration means of what the trainer logged in iterations 1 and 2 (read back here); every
        # iteration scored its rollouts
        train = [r for r in read_metrics(out / "runs" / arm / "seed1") if 1 <= r["step"] <= 2]
        assert len(train) == 2 and all(r["scoring/tokens"] > 0 for r in train)
        assert run["scoring_tokens"] == pytest.approx(sum(r["scoring/tokens"] for r in train) / 2)
        assert run["scoring_s"] == pytest.approx(sum(r["time/scoring"] for r in train) / 2)
    assert res["runs"]["grpo"]["1"]["skill_share"] == 0.0
    # both arms start from the same warm start and evaluate the same held-out games with the same seed
    assert res["runs"]["grpo"]["1"]["curve"][0] == res["runs"]["opid"]["1"]["curve"][0]
    probe = res["probe_delta"]
    assert probe["steps"] > 0 and math.isfinite(probe["faithful"]["match"]["action_mean"])
    assert (out / "curves.png").stat().st_size > 5000 and (out / "table.md").exists()
    assert "sanity: warm start Δ on expert-action tokens" in r.stdout
    # resume: everything is complete, nothing runs again
    r2 = _tool("--preset", "smoke", "--out", str(out), "--threads", "1", timeout=300)
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert r2.stdout.count("complete, skipped") == 2 and "[warm start] opid-sft" not in r2.stdout
    assert "[probe]" not in r2.stdout
