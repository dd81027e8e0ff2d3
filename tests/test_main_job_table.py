"""The main job's seed x rounding-path table (tools/main_job_table.py): the bounds, the median and worst run, and the
report's records, on hand-made runs."""
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import main_job_table as mj  # noqa: E402


def test_verdict_bounds():
    assert mj.verdict([(0, 0.2), (20, 0.18), (80, 0.31)])["ok"]  # +0.11, dip -0.02
    v = mj.verdict([(0, 0.2), (20, 0.14), (80, 0.40)])
    assert not v["ok"] and abs(v["worst_dip"] + 0.06) < 1e-12  # a dip below first - 0.05
    v = mj.verdict([(0, 0.2), (40, 0.25), (80, 0.29)])
    assert not v["ok"] and abs(v["gain"] - 0.09) < 1e-12  # rose too little
    assert not mj.verdict([(0, 0.2)])["ok"]
    assert mj.parse_seeds("1-3,7") == [1, 2, 3, 7]


def _run(seed, path, curve, wall=100.0):
    return {"seed": seed, "path": path, "wall_s": wall, "curve": curve, "verdict": mj.verdict(curve),
            "door": mj.verdict([(s, v + 0.05) for s, v in curve])}


def test_summary_takes_the_median_and_the_worst_run():
    runs = [_run(1, "native", [(0, 0.2), (80, 0.5)]), _run(1, "default", [(0, 0.2), (80, 0.25)]),
            _run(2, "native", [(0, 0.2), (80, 0.4)], wall=300.0)]
    s = mj.summary(runs)
    assert abs(s["median_gain"] - 0.2) < 1e-12 and abs(s["median_last"] - 0.4) < 1e-12
    assert s["worst"]["seed"] == 1 and s["worst"]["path"] == "default" and abs(s["worst"]["gain"] - 0.05) < 1e-12
    assert not s["all_within_bounds"] and s["median_wall_s"] == 100.0


def test_report_writes_the_table_and_every_runs_metrics(tmp_path, monkeypatch):
    monkeypatch.setattr(mj, "DOCS", tmp_path / "docs")
    for arm, seed, path, last in (("opid", 1, "native", 0.35), ("grpo", 1, "native", 0.22)):
        d = mj.run_dir(tmp_path / "out", arm, path, seed)
        d.mkdir(parents=True)
        rows = [{"step": 0, "eval/success_rate": 0.2, "eval/first_door_correct": 0.25}] + \
            [{"step": i, "ppo/kl": 0.001 * i} for i in range(1, 80)] + \
            [{"step": 80, "ppo/kl": 0.5, "eval/success_rate": last, "eval/first_door_correct": last + 0.1}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "table_run.json").write_text(json.dumps({"arm": arm, "path": path, "seed": seed, "wall_s": 200.0,
                                                      "started_utc": "x", "machine": {}, "load": {}}))
    res = mj.cmd_report(tmp_path / "out")
    assert res["summary"]["opid"]["all_within_bounds"] and not res["summary"]["grpo"]["all_within_bounds"]
    assert res["runs"]["opid"][0]["max_kl"] == 0.5
    with gzip.open(tmp_path / "docs" / "records" / "opid_native_seed1.jsonl.gz", "rt") as f:
        assert len(f.read().splitlines()) == 81
    md = (tmp_path / "docs" / "results.md").read_text()
    assert "| opid | 1 | native | 0.200 / 0.350 | +0.150 |" in md and "MISSED" in md
