"""The mechanism experiment's version 4 (tools/mechanism_v4.py): its endpoints and registered tests on hand-made runs,
the seeds a paired sd needs, and its refusals (no committed design, an arm or seed outside it, a changed tool)."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import mechanism_v4 as v4  # noqa: E402


def _records(door, success, kl=0.1):
    rows = [{"step": s, "eval/first_door_correct": d, "eval/success_rate": w}
            for s, d, w in zip((0, 20, 40, 60, 80), door, success)]
    return rows + [{"step": 5, "ppo/kl": kl, "adv/skill_share": 0.02, "analysis/failure_rate": 0.1}]


def test_endpoints_auc_first_last():
    e = v4.endpoints(_records([0.2, 0.3, 0.4, 0.4, 0.6], [0.1, 0.1, 0.2, 0.3, 0.5], kl=0.7))
    # trapezoid over 0-80 / 80: (0.25 + 0.35 + 0.4 + 0.5) * 20 / 80
    assert abs(e["door"]["auc"] - 0.375) < 1e-12 and e["door"]["first"] == 0.2 and e["door"]["last"] == 0.6
    assert abs(e["success"]["auc"] - (0.1 + 0.15 + 0.25 + 0.4) / 4) < 1e-12
    assert e["max_kl"] == 0.7 and e["analysis_failure_rate"] == 0.1


def test_paired_tests_and_mde_on_hand_made_arms():
    values = {"opid": {s: v4.endpoints(_records([0.2, 0.3, 0.4, 0.5, 0.6 + 0.01 * s], [0.1] * 5)) for s in (1, 2, 3)},
              "grpo": {s: v4.endpoints(_records([0.2, 0.25, 0.25, 0.3, 0.3], [0.1] * 5)) for s in (1, 2, 3, 4)}}
    t = v4.paired(values, "opid", "grpo")
    assert t["seeds"] == [1, 2, 3] and t["n"] == 3
    want = [values["opid"][s]["door"]["auc"] - values["grpo"][s]["door"]["auc"] for s in (1, 2, 3)]
    assert t["diffs"] == pytest.approx(want) and t["mean"] > 0 and t["p_signflip_one_sided"] == 1 / 8
    assert t["mde"] is not None and t["mde"] > 0
    n = v4.seeds_needed(0.05, 0.05)
    assert v4.v3.mde(0.05, n) <= 0.05 < v4.v3.mde(0.05, n - 1)
    assert v4.seeds_needed(1.0, 0.01, most=10) is None


def test_run_refuses_without_a_committed_design_and_outside_it(tmp_path, monkeypatch):
    monkeypatch.setattr(v4, "DESIGN", tmp_path / "design.json")
    monkeypatch.setattr(v4, "committed", lambda path: False)
    with pytest.raises(v4.ex.ExperimentError, match="is not committed"):
        v4.cmd_run(tmp_path / "out", None, None)
    monkeypatch.setattr(v4, "committed", lambda path: True)
    design = {"config_sha256": v4.v2.sha256_file(ROOT / v4.CONFIG),
              "analysis_code": {"sha256": v4.v2.sha256_file(ROOT / "tools" / "mechanism_v4.py")},
              "arms": {a: {"overrides": o, "standin": s} for a, (o, s) in v4.ARMS.items()},
              "seeds": list(v4.SEEDS)}
    (tmp_path / "design.json").write_text(json.dumps(design))
    with pytest.raises(v4.ex.ExperimentError, match="not in the registered design: opid_late, 7"):
        v4.cmd_run(tmp_path / "out", ["opid", "opid_late"], [101, 7])
    (tmp_path / "design.json").write_text(json.dumps({**design, "analysis_code": {"sha256": "0" * 64}}))
    with pytest.raises(v4.ex.ExperimentError, match="differs from the registered design"):
        v4.cmd_run(tmp_path / "out", None, None)
    (tmp_path / "design.json").write_text(json.dumps({**design, "seeds": [1, 2]}))
    with pytest.raises(v4.ex.ExperimentError, match="arms or seeds differ"):
        v4.cmd_run(tmp_path / "out", None, None)
