"""The mechanism experiment's pieces (tools/mechanism.py, the negative control's analysis shuffle, the
skill-reading warm start's samples, the env's info metrics), with hand-worked expected values."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import mechanism  # noqa: E402

from opid_mega.algo.routing import shuffle_analyses  # noqa: E402
from opid_mega.experience import outcome_info_means  # noqa: E402


def test_round_down_to_one_significant_figure():
    assert mechanism.round_down_1sig(0.372) == 0.3
    assert mechanism.round_down_1sig(0.0897) == 0.08
    assert mechanism.round_down_1sig(3.9) == 3.0
    assert mechanism.round_down_1sig(0.3) == 0.3  # exact values are not pushed one digit down by float error
    with pytest.raises(ValueError, match="cannot round"):
        mechanism.round_down_1sig(0.0)


def _rec(it, group, score, a_out, deltas):
    return {"iteration": it, "group": group, "score": score, "a_out": a_out,
            "kinds": ["step"] if deltas else [], "delta": {"step": deltas} if deltas else {}}


def test_lambda_rule_hand_worked():
    # group (1, 0): scores 10, 0 -> mixed, |A_out| 1.0, 0.5; group (1, 1): both 10 -> a tie, left out of the median
    # group (2, 0): scores 0, 10, 10 -> mixed, |A_out| 0.25, 0.75, 2.0. Median of {1, .5, .25, .75, 2} = 0.75.
    # version 1 (tokens): routed |Δ| 0.1 0.2 ... 2.0 (20 values): nearest-rank p95 = the 19th = 1.9 -> 0.394 -> 0.3
    # version 2 (per routed sample, its largest |Δ|): 1.0 and 2.0 -> p95 = the 2nd of 2 = 2.0 -> 0.375 -> 0.3;
    # a third routed sample of one token 0.05 gives {0.05, 1.0, 2.0}: p95 = ceil(2.85) = the 3rd = 2.0 again.
    deltas = [round(0.1 * k, 1) for k in range(1, 21)]
    recs = [_rec(1, 0, 10, 1.0, [-d for d in deltas[:10]]), _rec(1, 0, 0, -0.5, deltas[10:]),
            _rec(1, 1, 10, 9.0, []), _rec(1, 1, 10, 9.0, []),
            _rec(2, 0, 0, -0.25, []), _rec(2, 0, 10, 0.75, []), _rec(2, 0, 10, 2.0, [])]
    r = mechanism.lambda_rule(recs)
    assert r["median_abs_a_out_mixed"] == 0.75
    assert r["p95_max_abs_delta_per_routed_sample"] == 2.0
    assert r["lambda"] == 0.3  # 0.75 / 2.0 = 0.375 rounded down
    assert r["v1_rule"]["p95_abs_delta_routed_tokens"] == 1.9
    assert r["v1_rule"]["lambda"] == 0.3  # 0.75 / 1.9 = 0.394... rounded down
    assert (r["groups"], r["mixed_groups"], r["routed_samples"], r["v1_rule"]["routed_tokens"]) == (3, 2, 2, 20)
    # where Δ sits on one token of many, the rules part: 19 routed samples, each with one token of |Δ| 8 among
    # nineteen of 0.01 -> v1's p95 over 380 tokens is the 361st smallest = 0.01 (λ 0.75 / 0.01 = 75), v2's is 8
    # (0.75 / 8 = 0.09375 -> 0.09)
    sharp = [_rec(3, 0, 10 * (k % 2), 0.75 * (1 if k % 2 else -1), [8.0] + [0.01] * 19) for k in range(19)]
    r2 = mechanism.lambda_rule(sharp)
    assert r2["median_abs_a_out_mixed"] == 0.75
    assert r2["v1_rule"]["p95_abs_delta_routed_tokens"] == 0.01 and r2["v1_rule"]["lambda"] == 70.0
    assert r2["p95_max_abs_delta_per_routed_sample"] == 8.0 and r2["lambda"] == 0.09
    with pytest.raises(ValueError, match="mixed-group"):
        mechanism.lambda_rule([_rec(1, 0, 10, 0.0, [0.5]), _rec(1, 0, 10, 0.0, [])])


def test_shuffled_analyses_never_keep_their_own_task():
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    analyses = [f"a{g}.{k}" for g, k in zip(groups, [0, 1] * 4)]
    for seed in range(20):
        out = shuffle_analyses(groups, analyses, seed)
        donors = {}
        for g, a in zip(groups, out):
            donor = int(a[1])
            assert donor != g
            donors.setdefault(g, set()).add(donor)
        assert all(len(d) == 1 for d in donors.values())  # one donor task per task
        assert sorted(d.pop() for d in donors.values()) == [0, 1, 2, 3]  # a cycle: every task donates once
        # trajectory j of a group takes trajectory j of its donor
        assert [a[-1] for a in out] == ["0", "1"] * 4
    # uneven groups: indices wrap around the donor's size; a lone group has no other task
    out = shuffle_analyses([0, 0, 0, 1], ["x0", "x1", "x2", "y0"], 3)
    assert out == ["y0", "y0", "y0", "x0"]
    assert shuffle_analyses([5, 5], ["a", "b"], 1) == [None, None]


class _T:
    def __init__(self, info):
        self.outcome_info = info


def test_outcome_info_means_counts_missing_as_false():
    trajs = [_T({"first_door_correct": True}), _T({"first_door_correct": False}), _T({"first_door_correct": None}),
             _T({})]
    assert outcome_info_means(trajs, "eval") == {"eval/first_door_correct": 0.25}
    assert outcome_info_means([], "eval") == {}


@pytest.mark.parametrize("cue_copies", [0, 2])
def test_blind_decision_samples_of_the_warm_start(cue_copies):
    """At the hall: each of the five doors once without a section (plus the expert's, i.e. the cue's, door
    sft.decision_cue_copies more times), and once with a section naming it; elsewhere the expert's action (with and
    without its section)."""
    from opid_mega.config import load_config
    from opid_mega.envs.footprints_env import CUE_RE
    from opid_mega.sft import expert_episodes, walkthrough_samples

    cfg = load_config(str(mechanism.ROOT / mechanism.CONFIG), ["env.options.pool_size.train=2",
                                                                f"sft.decision_cue_copies={cue_copies}"])

    class Tok:  # text in, text out: the samples' prompts and targets stay readable
        def encode(self, text, add_special_tokens=False):
            return [text]

    import opid_mega.rollout.agent_loop as al

    class PT:
        def __init__(self, tok, enable_thinking=True):
            pass

        def encode(self, prompt):
            return [prompt], None

        def encode_text(self, text):
            return [text]

    orig = al.PromptTokenizer
    al.PromptTokenizer = PT
    try:
        import opid_mega.sft as sft

        end = sft.end_of_turn_id
        sft.end_of_turn_id = lambda tok: "<END>"
        try:
            samples = walkthrough_samples(cfg, Tok())
        finally:
            sft.end_of_turn_id = end
    finally:
        al.PromptTokenizer = orig
    episodes = expert_episodes(cfg)
    for ep in episodes:
        hall = next(k for k, d in enumerate(ep["decisions"]) if d)
        assert ep["decisions"][hall] and all(not d for k, d in enumerate(ep["decisions"]) if k != hall)
        prompt = ep["prompts"][hall]
        hall_obs = ep["view"].steps[hall].raw_obs  # this game's hall (rug, door order, cue)
        at_hall = [(p[0], r[0]) for p, r in samples if hall_obs in p[0] and "<action>open " in r[0]]
        plain = [r for p, r in at_hall if p == prompt]
        with_section = [(p, r) for p, r in at_hall if p != prompt]
        doors = sorted(ep["decisions"][hall])
        right = ep["actions"][hall]
        assert CUE_RE.search(prompt).group(1) == right.split()[1]  # the cue names the expert's door
        targets = sorted(r.split("<action>")[1].split("</action>")[0] for r in plain)
        assert targets == sorted(doors + [right] * cue_copies)
        assert len(with_section) == 5
        for p, r in with_section:
            colour = r.split("<action>")[1].split()[1]
            assert f"Open the {colour} door" in p or f"lead to the {colour} door; the" in p
            assert len(CUE_RE.findall(p)) == 1  # the cue is in the observation, never changed
        # the expert's door is one of the five targets (twice: plain and with a section), plus its cue copies
        assert sum(right in r for _, r in at_hall) == 2 + cue_copies


def test_paired_tests_hand_worked():
    # diffs 0.1, 0.2, 0.3: mean 0.2, sd 0.1, t = 0.2 / (0.1 / sqrt 3) = 2 sqrt 3 = 3.4641; with 2 degrees of freedom
    # the one-sided p has the closed form (1 - t / sqrt(t^2 + 2)) / 2 = (1 - sqrt(12 / 14)) / 2 = 0.037088.
    # Sign flips: of the 8 assignments only (+, +, +) reaches mean 0.2 (the next is (-, +, +): 0.1333): p = 1/8.
    r = mechanism.paired_tests([0.1, 0.2, 0.3])
    assert r["mean"] == pytest.approx(0.2) and r["sd"] == pytest.approx(0.1)
    assert r["t"] == pytest.approx(3.464102, rel=1e-6)
    assert r["p_t_one_sided"] == pytest.approx((1 - (12 / 14) ** 0.5) / 2, rel=1e-9)
    assert r["p_signflip_one_sided"] == 0.125
    # a negative mean: the one-sided p is large; flips of (-0.1, -0.2, +0.05): means >= -0.08333 are 7 of 8
    r = mechanism.paired_tests([-0.1, -0.2, 0.05])
    assert r["p_t_one_sided"] > 0.5 and r["p_signflip_one_sided"] == 7 / 8
    assert mechanism.paired_tests([]) == {"n": 0, "diffs": []}


def test_curve_in_rollouts_auc_and_first_reach():
    records = [{"step": 5, "eval/success_rate": 0.2}, {"step": 10, "eval/success_rate": 0.4},
               {"step": 15, "eval/success_rate": 0.3}, {"step": 3, "train/success_rate": 0.9}]
    curve = mechanism.rollout_curve(0.1, records, 32)
    assert curve == [(0, 0.1), (160, 0.2), (320, 0.4), (480, 0.3)]
    # trapezoids: 160 x (0.15 + 0.30 + 0.35) = 128, over 480 rollouts
    assert mechanism.ex.curve_auc(curve) == pytest.approx(128 / 480)
    assert mechanism.first_reach(curve, 0.35) == 320
    assert mechanism.first_reach(curve, 0.5) is None


def test_tie_group_share_and_colour_tokens():
    recs = [{"iteration": 1, "group": 0, "score": 10.0}, {"iteration": 1, "group": 0, "score": 10.0},
            {"iteration": 1, "group": 1, "score": 10.0}, {"iteration": 1, "group": 1, "score": 0.0},
            {"iteration": 2, "group": 0, "score": 0.0}]
    assert mechanism.tie_group_share(recs) == pytest.approx(2 / 3)  # (1,0) and (2,0) tie, (1,1) does not
    assert mechanism.tie_group_share([]) is None
    pieces = ["<think>", "I", " will", " open", " yellow", " door", ".", "</think>", "<action>", "open", " yellow"]
    assert mechanism.colour_token_positions(pieces, "yellow") == [4]  # the first mention only
    assert mechanism.colour_token_positions(["open", " yel", "low", " door"], "yellow") == [1, 2]
    assert mechanism.colour_token_positions(["open", " door"], "red") == []


def test_door_delta_sign_correctness():
    from opid_mega.envs.footprints_env import make_game

    game = make_game(7)
    wrong = next(c for c in game.doors if c != game.right)
    pieces = {1: "open", 2: f" {game.right}", 3: f" {wrong}", 4: " door"}

    def rec(colour_id, colour, delta, kinds=("step",)):
        return {"task": "footprints/train-7", "action": f"open {colour} door", "kinds": list(kinds),
                "response_ids": [1, colour_id, 4], "delta": {k: [9.0, delta, -9.0] for k in kinds}}

    recs = [rec(2, game.right, 0.5),  # right door, Δ > 0: correct
            rec(3, wrong, 0.2),  # wrong door, Δ > 0: not
            rec(3, wrong, -0.4),  # wrong door, Δ < 0: correct
            rec(2, game.right, 0.5, kinds=()),  # not skill-routed: left out
            {**rec(2, game.right, 0.5), "action": "go east"}]  # not a door step: left out
    r = mechanism.door_delta_signs(recs, pieces.__getitem__)
    assert r["routed_door_steps"] == 3 and r["sign_correct"] == pytest.approx(2 / 3)
    assert r["right_door"] == {"n": 1, "mean_delta": 0.5}
    assert r["wrong_door"]["n"] == 2 and r["wrong_door"]["mean_delta"] == pytest.approx(-0.1)


def test_busy_processes_leaves_out_the_runs_own_tree():
    import os
    import subprocess
    import sys as _sys

    child = subprocess.Popen([_sys.executable, "-c", "import time; time.sleep(30)  # torch"])
    try:
        import time

        time.sleep(0.5)
        mine = [b for b in mechanism.busy_processes(tree_root=os.getpid()) if b.startswith(f"{child.pid}:")]
        assert mine == []  # the run's own processes do not count
        others = [b for b in mechanism.busy_processes() if b.startswith(f"{child.pid}:")]
        assert len(others) == 1  # seen from outside its tree it is another heavy process
    finally:
        child.kill()
        child.wait()


def test_runs_in_the_committed_record_are_kept_not_rerun(tmp_path):
    committed = {"grpo": {"1": {}, "2": {}}, "opid_rule": {"1": {}}}
    gone = tmp_path / "gone"
    assert mechanism.kept_from_record(gone, 2, "grpo", committed, guard_decided=False)
    assert mechanism.kept_from_record(gone, 1, "opid_rule", committed, guard_decided=False)
    assert not mechanism.kept_from_record(gone, 3, "grpo", committed, guard_decided=True)  # not in the record
    # GRPO seed 1 decides the lr guard: without a guard decided here it runs again
    assert not mechanism.kept_from_record(gone, 1, "grpo", committed, guard_decided=False)
    assert mechanism.kept_from_record(gone, 1, "grpo", committed, guard_decided=True)
    started = tmp_path / "started"
    started.mkdir()  # a directory here means this machine started it: it is not replaced by the record
    assert not mechanism.kept_from_record(started, 2, "grpo", committed, guard_decided=True)


def test_reproduction_of_a_committed_run():
    old = {"curve": [[0, 0.125], [160, 0.25]], "auc": 0.1875, "final": 0.25, "first_door_correct": [[160, 0.5]],
           "final_episode_length": 3.5, "skill_share_pooled": 0.0, "tie_group_share": 0.5, "door_delta": None,
           "train_success": 0.25, "wall_s": 400.0}
    same = {**old, "wall_s": 431.0}  # timings are not compared
    assert mechanism.reproduction(same, old) == {"reproduced": True, "differing_keys": []}
    other = {**old, "curve": [[0, 0.125], [160, 0.28125]], "final": 0.28125}
    assert mechanism.reproduction(other, old) == {"reproduced": False, "differing_keys": ["curve", "final"]}
    assert mechanism.reproduction({**old, "door_delta": {"sign_correct": 0.5}}, old)["differing_keys"] == ["door_delta"]


def test_archive_copies_the_small_records(tmp_path):
    out, dest = tmp_path / "out", tmp_path / "archive"
    files = ["warm_start.json", "probe.json", "lr_guard.json", "lambda_calibration/lambda.json",
             "lambda_calibration/advantages.jsonl", "eval0/seed1.json", "eval0/seed1.log",
             "runs/grpo/seed1/metrics.jsonl", "runs/grpo/seed1/experiment_run.json", "runs/grpo/seed1/train.log",
             "runs/grpo/seed1/advantages.jsonl", "logs/warm_start.log"]
    for k, f in enumerate(files):
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        (out / f).write_text(f"record {k}\n")
    copied = mechanism.archive(out, dest)
    kept = ["warm_start.json", "probe.json", "lr_guard.json", "lambda_calibration/lambda.json", "eval0/seed1.json",
            "runs/grpo/seed1/metrics.jsonl", "runs/grpo/seed1/experiment_run.json"]
    assert copied == kept  # logs and advantages stay out (large; the metrics and records carry the results)
    k = files.index("runs/grpo/seed1/metrics.jsonl")
    assert (dest / "runs/grpo/seed1/metrics.jsonl").read_text() == f"record {k}\n"
    assert not (dest / "eval0/seed1.log").exists()


def test_archive_keeps_the_trained_warm_start_record(tmp_path):
    # a machine that started from the committed warm start does not overwrite the record of its training
    out, dest = tmp_path / "out", tmp_path / "archive"
    out.mkdir()
    (out / "warm_start.json").write_text('{"path": "/x", "from_committed": "docs/mechanism_archive/v2/warm_start"}\n')
    dest.mkdir()
    (dest / "warm_start.json").write_text('{"path": "/sft", "wall_s": 370.0}\n')
    assert mechanism.archive(out, dest) == []
    assert (dest / "warm_start.json").read_text() == '{"path": "/sft", "wall_s": 370.0}\n'


def test_committed_warm_start_round_trip(tmp_path, monkeypatch):
    # opid-sft's directory -> the committed files (weights, config, record, the tokenizer's fingerprint; not the
    # tokenizer) -> a complete model directory with the built-in model's tokenizer files, and the same weights hash
    monkeypatch.setattr(mechanism, "tokenizer_fingerprint", lambda d: (Path(d) / "tokenizer.json").read_text())
    sft, base, dest = tmp_path / "sft", tmp_path / "base", tmp_path / "committed"
    for d, files in ((sft, {"config.json": "{sft cfg}", "generation_config.json": "{gen}", "sft.json": "{rec}",
                            "model.safetensors": "sft weights", "tokenizer.json": "{tok}", ".opid_sft_complete": "k"}),
                     (base, {"config.json": "{base cfg}", "model.safetensors": "random weights",
                             "tokenizer.json": "{tok}", "tokenizer_config.json": "{tc}", "chat_template.jinja": "t",
                             ".opid_mega_complete": "tiny"})):
        d.mkdir()
        for name, text in files.items():
            (d / name).write_text(text)
    assert mechanism.commit_warm_start(sft, dest) == ["config.json", "generation_config.json", "model.safetensors",
                                                       "sft.json"]
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                      "sft.json", "tokenizer_fingerprint.json"]
    assert (dest / "tokenizer_fingerprint.json").read_text() == '{"sha256_16": "{tok}"}\n'
    model = mechanism.assemble_warm_start(dest, base, tmp_path / "out" / "warm_start_model")
    assert sorted(p.name for p in model.iterdir()) == [".opid_sft_complete", "chat_template.jinja", "config.json",
                                                       "generation_config.json", "model.safetensors", "sft.json",
                                                       "tokenizer.json", "tokenizer_config.json"]
    assert (model / "model.safetensors").read_text() == "sft weights"
    assert (model / "config.json").read_text() == "{sft cfg}"
    assert mechanism.weights_hash(model) == mechanism.weights_hash(sft) != mechanism.weights_hash(base)
    with pytest.raises(mechanism.ex.ExperimentError, match="no model.safetensors"):
        mechanism.commit_warm_start(base / "nothing", tmp_path / "d2")
    # a built-in tokenizer that changed since the warm start was trained: refused, naming both fingerprints
    (base / "tokenizer.json").write_text("{tok v2}")
    with pytest.raises(mechanism.ex.ExperimentError, match=r"fingerprint \{tok v2\}\) is not the one .* \(\{tok\}\)"):
        mechanism.assemble_warm_start(dest, base, tmp_path / "out2" / "warm_start_model")
    assert not (tmp_path / "out2" / "warm_start_model").exists()


def test_the_committed_warm_start_fits_todays_builtin_tokenizer(tmp_path):
    # the committed weights' token ids are positions in opid_mega/data/footprints_vocab.json: a fresh build of the
    # built-in model must give the tokenizer they were trained with, and the assembled directory loads and scores
    import torch

    from opid_mega.models import load_model, prepare_model

    base = Path(prepare_model("tiny-qwen3-footprints", tmp_path / "models"))
    want = json.loads((mechanism.WARM_DIR / "tokenizer_fingerprint.json").read_text())["sha256_16"]
    assert mechanism.tokenizer_fingerprint(base) == want
    model_dir = mechanism.assemble_warm_start(mechanism.WARM_DIR, base, tmp_path / "warm_start_model")
    prereg = json.loads(mechanism.PREREG.read_text())
    assert mechanism.weights_hash(model_dir) == prereg["warm_start"]["weights_sha256_16"]
    logits = load_model(model_dir)(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[-1] == 896 and torch.isfinite(logits).all()


def test_h2_t_intervals_hand_worked():
    # finals with skills 0.5, 0.7, 0.6 (mean 0.6, sd 0.1), without 0.1, 0.2, 0.3 (mean 0.2, sd 0.1); differences 0.4,
    # 0.5, 0.3 (mean 0.4, sd 0.1). t_{0.975, 2} = 4.302653: half width 4.302653 x 0.1 / sqrt(3) = 0.248414
    seeds = {"1": {"final_with_skills": 0.5, "final": 0.1}, "2": {"final_with_skills": 0.7, "final": 0.2},
             "3": {"final_with_skills": 0.6, "final": 0.3}, "4": {"final_with_skills": None, "final": 0.9}}
    h2 = mechanism.h2_skill_grpo(seeds)
    d = h2["with_minus_without"]
    assert d["n"] == 3 and d["mean"] == pytest.approx(0.4) and d["sd"] == pytest.approx(0.1)
    assert (d["low"], d["high"]) == (pytest.approx(0.4 - 0.248414, abs=1e-6), pytest.approx(0.4 + 0.248414, abs=1e-6))
    assert h2["final_without_skills"]["mean"] == pytest.approx(0.2)
    assert h2["final_with_skills"]["low"] == pytest.approx(0.6 - 0.248414, abs=1e-6)
    assert mechanism.t_interval([0.3]) == {"n": 1, "mean": 0.3}
    assert "95% t interval [+0.152, +0.648]" in mechanism.h2_lines(h2)
