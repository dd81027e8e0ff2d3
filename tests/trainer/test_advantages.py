"""The trainer's advantage assembly: GRPO vs OPID differ only by λΔ; checked against a float64 reference."""
import math

import numpy as np
import pytest
import torch

from opid_mega.config import load_config
from opid_mega.experience import compute_advantages
from opid_mega.scoring.scorer import ScoreResult
from tolerance import assert_close_scaled


def _batch(seed, n=12, same=False):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 9, (n,), generator=g).tolist()
    scored = []
    for i, r in enumerate(lens):
        orig = -torch.rand(r, generator=g) * 5 - 0.1
        skill = {}
        if i % 3 != 2:  # every third sample: no skill (analysis failed)
            kind = "step" if i % 3 == 0 else "episode"
            skill[kind] = orig.clone() if same else orig - torch.randn(r, generator=g)
        if i % 4 == 0 and not same:
            skill["episode"] = orig + torch.randn(r, generator=g)
        scored.append(ScoreResult(orig=orig, skill=skill))
    rewards = [10.0 * float(torch.rand(1, generator=g) < 0.5) for _ in range(n)]
    invalid = (torch.rand(n, generator=g) < 0.3).tolist()
    groups = [i % 3 for i in range(n)]
    return scored, rewards, invalid, groups


def _reference(scored, rewards, invalid, groups, penalty, lam_ep, lam_step, mode):
    s = [r - penalty * float(b) for r, b in zip(rewards, invalid)]
    out = []
    for i, r in enumerate(scored):
        members = [s[j] for j in range(len(s)) if groups[j] == groups[i]]
        mu = sum(members) / len(members)
        sd = math.sqrt(sum((x - mu) ** 2 for x in members) / (len(members) - 1)) if len(members) > 1 else 1.0
        a = (s[i] - mu) / (sd + 1e-6) if mode == "mean_std_norm" else s[i] - mu
        row = []
        for t in range(r.orig.numel()):
            v = a
            for kind, lam in (("episode", lam_ep), ("step", lam_step)):
                if kind in r.skill:
                    v += lam * (float(r.skill[kind][t].double()) - float(r.orig[t].double()))
            row.append(v)
        out.append(row)
    return out


def _rows(adv):
    """Per-sample rows of a flat per-token array."""
    return np.split(adv.token_advantages, np.cumsum(adv.resp_lens)[:-1])


@pytest.mark.parametrize("backend", ["cpp", "python"])
@pytest.mark.parametrize("outcome_mode", ["mean_std_norm", "mean_norm"])
def test_opid_equals_grpo_when_all_deltas_are_zero(outcome_mode, backend):
    scored, rewards, invalid, groups = _batch(0, same=True)
    outs = {}
    for mode in ("grpo", "opid", "no_routing", "no_step_skill"):
        cfg = load_config(None, [f"algo.mode={mode}", f"algo.outcome_mode={outcome_mode}"])
        outs[mode] = compute_advantages(cfg.algo, scored, rewards, invalid, groups, backend=backend)
    for mode in ("opid", "no_routing", "no_step_skill"):
        assert np.array_equal(outs[mode].token_advantages, outs["grpo"].token_advantages)
    assert np.abs(outs["grpo"].token_advantages).sum() > 0  # a non-trivial batch


@pytest.mark.parametrize("backend", ["cpp", "python"])
@pytest.mark.parametrize("mode,lam_ep_on,lam_step_on", [("opid", 1, 1), ("no_episode_skill", 0, 1),
                                                        ("no_step_skill", 1, 0), ("grpo", 0, 0)])
def test_advantages_match_float64_reference(mode, lam_ep_on, lam_step_on, backend):
    scored, rewards, invalid, groups = _batch(1)
    cfg = load_config(None, [f"algo.mode={mode}", "algo.lambda_episode=0.3", "algo.lambda_step=0.7"])
    adv = compute_advantages(cfg.algo, scored, rewards, invalid, groups, backend=backend)
    ref = _reference(scored, rewards, invalid, groups, 0.1, 0.3 * lam_ep_on, 0.7 * lam_step_on, "mean_std_norm")
    assert adv.resp_lens.tolist() == [r.orig.numel() for r in scored]
    for i, (row, got) in enumerate(zip(ref, _rows(adv))):
        assert_close_scaled(got, row, floor=1.0, msg=f"row {i}")  # float32 vs float64; advantages are O(1)
    assert np.array_equal(adv.old_logprobs, torch.cat([r.orig for r in scored]).numpy())
    if mode == "grpo":
        assert_close_scaled(adv.token_advantages, adv.outcome_per_token, rel=1e-6, msg="grpo: token = outcome")


def test_advantages_reject_misaligned_skill_logprobs():
    scored, rewards, invalid, groups = _batch(2)
    k = next(i for i, r in enumerate(scored) if r.skill)
    kind = next(iter(scored[k].skill))
    scored[k].skill[kind] = scored[k].skill[kind][:-1] if scored[k].orig.numel() > 1 else torch.zeros(2)
    cfg = load_config(None, ["algo.mode=opid"])
    with pytest.raises(ValueError, match=f"step-sample {k} has"):
        compute_advantages(cfg.algo, scored, rewards, invalid, groups)


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_skill_share_cap_drops_the_skill_term_of_a_tied_group(backend):
    """algo.skill_share_cap (default 1.0): a group whose scores all tie trains on nothing (no λΔ-only update); in the
    others the skill term's mass is at most cap x the outcome term's; cap null is the reference (λΔ everywhere)."""
    assert load_config(None, []).algo.skill_share_cap == 1.0
    scored, rewards, invalid, groups = _batch(5)
    for i, g in enumerate(groups):  # group 0 ties: every sample 0 and valid
        if g == 0:
            rewards[i], invalid[i] = 0.0, False
    base = ["algo.mode=opid", "algo.lambda_episode=0.3", "algo.lambda_step=0.7"]
    free = compute_advantages(load_config(None, base + ["algo.skill_share_cap=null"]).algo, scored, rewards, invalid,
                              groups, backend=backend)
    capped = compute_advantages(load_config(None, base + ["algo.skill_share_cap=0.2"]).algo, scored, rewards,
                                invalid, groups, backend=backend)
    rows_free, rows_cap = _rows(free), _rows(capped)
    tied = [i for i, g in enumerate(groups) if g == 0]
    assert any(np.abs(rows_free[i]).sum() > 0 for i in tied)  # without the cap λΔ alone moves the tied group
    for i in tied:
        assert not np.any(rows_cap[i])
    for g in set(groups) - {0}:
        members = [i for i, x in enumerate(groups) if x == g]
        out = sum(abs(float(free.a_out[i])) * len(rows_cap[i]) for i in members)
        skill = sum(float(np.abs(rows_cap[i].astype(np.float64) - free.a_out[i]).sum()) for i in members)
        assert out > 0 and skill <= 0.2 * out * (1 + 1e-5)
