"""The mechanism experiment's version 3 (tools/mechanism_v3.py): its λ rule, decision-token share, gate and MDE on
hand-worked records, its refusals, and the warm start that leans toward the cue (sft.decision_cue_copies)."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import mechanism_v3 as v3  # noqa: E402

# token id -> piece: "<action>open " + colour + " door</action>"; id 7 and 8 split "blue" in two pieces
PIECES = {1: "<action>open ", 2: "blue", 3: " door</action>", 5: "red", 6: "green", 7: "bl", 8: "ue"}


def decode(t):
    return PIECES[t]


def rec(iteration, group, score, a_out, action, kinds, delta, ids=None):
    colour = action.split()[1] if action.startswith("open") else None
    ids = ids or ([1, {"blue": 2, "red": 5, "green": 6}[colour], 3] if colour else [9, 9, 9])
    return {"iteration": iteration, "group": group, "score": score, "a_out": a_out, "action": action,
            "kinds": kinds, "response_ids": ids, "delta": delta}


RECORDS = [
    # group (0, 0) is mixed (scores 1 and 0): its door samples give |A_out| 0.8 and 0.4
    rec(0, 0, 1.0, 0.8, "open blue door", ["step"], {"step": [0.1, 3.0, 0.5]}),
    rec(0, 0, 0.0, -0.4, "open red door", ["step"], {"step": [0.2, -1.5, 0.1]}),
    rec(0, 0, 1.0, 0.8, "go north", ["episode"], {"episode": [5.0, 5.0, 5.0]}),  # not a door step
    # group (0, 1) ties: its routed door sample counts for Δ, not for A_out
    rec(0, 1, 0.0, 0.0, "open green door", ["episode"], {"episode": [0.0, -6.0, 0.0]}),
    rec(0, 1, 0.0, 0.0, "open green door", [], {}),  # not routed
]


def test_door_delta_sums_the_kinds_over_the_colour_tokens():
    # one kind: the colour's token
    assert v3.door_delta(RECORDS[0], decode) == 3.0
    # two kinds, the colour over two pieces ("bl" + "ue"): mean over its tokens, summed over kinds
    r = rec(0, 0, 1.0, 0.5, "open blue door", ["episode", "step"],
            {"episode": [9.0, -1.0, -3.0, 9.0], "step": [9.0, -2.0, -2.0, 9.0]}, ids=[1, 7, 8, 3])
    assert v3.door_delta(r, decode) == pytest.approx((-1 - 3) / 2 + (-2 - 2) / 2)
    assert v3.door_delta(RECORDS[2], decode) is None and v3.door_delta(RECORDS[4], decode) is None


def test_lambda_rule_hand_worked():
    # median |A_out| over door samples of mixed groups: median(0.8, 0.4) = 0.6; median |Δ_door| over routed door
    # samples: median(3.0, 1.5, 6.0) = 3.0; 0.6 / 3.0 = 0.2
    r = v3.lambda_rule(RECORDS, decode)
    assert r["median_abs_a_out_door_mixed"] == pytest.approx(0.6)
    assert r["median_abs_delta_door_routed"] == pytest.approx(3.0)
    assert r["lambda"] == 0.2 and r["door_samples_mixed"] == 2 and r["routed_door_samples"] == 3
    assert r["expected_decision_share_at_medians"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="λ rule"):
        v3.lambda_rule(RECORDS[3:], decode)  # no mixed group


def test_decision_share_hand_worked():
    # λ 0.2: (A, λΔ) = (0.8, 0.6), (0.4, 0.3), (0.0, 1.2): shares 3/7, 3/7, 1; pooled 2.1 / 3.3
    s = v3.decision_share(RECORDS, 0.2, decode)
    assert s["routed_door_samples"] == 3
    assert s["mean"] == pytest.approx((3 / 7 + 3 / 7 + 1) / 3)
    assert s["pooled"] == pytest.approx(2.1 / 3.3)
    assert v3.decision_share(RECORDS[2:3], 0.2, decode) == {"routed_door_samples": 0, "mean": None, "pooled": None}


def test_gate_decision_at_and_below_the_margin():
    g = v3.gate_decision({1: 0.50, 2: 0.40}, {1: 0.70, 2: 0.50})  # gains 0.2 and 0.1: mean 0.15 = the margin
    assert g["passed"] and g["mean_gain"] == pytest.approx(0.15)
    g = v3.gate_decision({1: 0.50, 2: 0.40}, {1: 0.60, 2: 0.50})
    assert not g["passed"] and g["mean_gain"] == pytest.approx(0.10)


def test_mde_from_t_tables():
    # n = 8 (7 df): t_0.95 = 1.8946, t_0.80 = 0.8960 (tables); sd 0.05: 2.7906 x 0.05 / sqrt(8) = 0.04933
    assert v3.mde(0.05, 8) == pytest.approx(2.7906 * 0.05 / 8 ** 0.5, rel=2e-4)
    assert v3.mde(0.05, 1) is None


def test_schedule_runs_the_gate_first_and_every_arm_on_every_seed():
    assert v3.SCHEDULE[:2] == [(1, "grpo"), (2, "grpo")]
    assert sorted(v3.SCHEDULE) == sorted((s, a) for s in v3.SEEDS for a in v3.ARMS)
    assert len(v3.SEEDS) >= 8


def test_the_committed_design_matches_the_tool_and_config():
    d = v3.check_design()
    assert d["version"] == 3 and d["gate"]["margin"] == 0.15 and d["arms"] == v3.ARMS


def test_run_refuses_before_the_gate_and_after_it_failed(tmp_path):
    if not v3.PREREG.exists():
        pytest.fail(f"{v3.PREREG} is not committed")
    with pytest.raises(v3.ex.ExperimentError, match="gate has not run"):
        v3.cmd_run(tmp_path, {}, None, None)
    (tmp_path / "gate.json").write_text(json.dumps({"passed": False}))
    with pytest.raises(v3.ex.ExperimentError, match="gate failed"):
        v3.cmd_run(tmp_path, {}, None, None)
    with pytest.raises(v3.ex.ExperimentError, match="not registered"):
        (tmp_path / "gate.json").write_text(json.dumps({"passed": True}))
        v3.cmd_run(tmp_path, {}, ["opid_rule"], None)


def test_decision_cue_copies_needs_blind_decision():
    """The cue copies lean the blind decision samples (tests/test_mechanism.py checks the samples); without
    sft.blind_decision they are refused with one line."""
    from opid_mega.config import ConfigError, load_config

    assert load_config(str(ROOT / v3.CONFIG)).sft.decision_cue_copies == 1
    with pytest.raises(ConfigError, match="sft.decision_cue_copies"):
        load_config(str(ROOT / v3.CONFIG), ["sft.blind_decision=false"])
