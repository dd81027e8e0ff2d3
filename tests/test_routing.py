"""Skill routing gated by λ (OPID.md §4 and "Reference rules in detail: Routing is gated by λ").

critical-first: a step with a non-empty step skill and λ_step > 0 gets the step skill only; otherwise, if
λ_ep > 0, the episode skill; otherwise nothing. additive: critical steps get both (each gated by its λ), the
others the episode skill. Expected tables are written out from those rules."""
import math

import pytest

from opid_mega.algo import route_skills
from opid_mega.config import load_config

STEPS, EP = {1: "s1", 3: "s3"}, "E"

# (lambda_episode, lambda_step) -> expected routes for 4 steps with step skills at 1 and 3
CRITICAL_FIRST = {
    (0.001, 0.001): [{"episode": "E"}, {"step": "s1"}, {"episode": "E"}, {"step": "s3"}],
    (0.001, 0.0): [{"episode": "E"}, {"episode": "E"}, {"episode": "E"}, {"episode": "E"}],
    (0.0, 0.001): [{}, {"step": "s1"}, {}, {"step": "s3"}],
    (0.0, 0.0): [{}, {}, {}, {}],
}
ADDITIVE = {
    (0.001, 0.001): [{"episode": "E"}, {"episode": "E", "step": "s1"}, {"episode": "E"},
                     {"episode": "E", "step": "s3"}],
    (0.001, 0.0): [{"episode": "E"}, {"episode": "E"}, {"episode": "E"}, {"episode": "E"}],
    (0.0, 0.001): [{}, {"step": "s1"}, {}, {"step": "s3"}],
    (0.0, 0.0): [{}, {}, {}, {}],
}


@pytest.mark.parametrize("lams", sorted(CRITICAL_FIRST))
def test_critical_first_gated_by_lambda(lams):
    lam_ep, lam_st = lams
    got = route_skills(4, STEPS, EP, mode="step_priority", lambda_episode=lam_ep, lambda_step=lam_st)
    assert got == CRITICAL_FIRST[lams]


@pytest.mark.parametrize("lams", sorted(ADDITIVE))
def test_additive_gated_by_lambda(lams):
    lam_ep, lam_st = lams
    assert route_skills(4, STEPS, EP, mode="additive", lambda_episode=lam_ep, lambda_step=lam_st) == ADDITIVE[lams]


def test_default_lambdas_route_every_skill():
    assert route_skills(4, STEPS, EP) == CRITICAL_FIRST[(0.001, 0.001)]
    assert route_skills(4, STEPS, EP, mode="additive") == ADDITIVE[(0.001, 0.001)]


def test_mode_switches_equal_zero_lambdas():
    """use_step=False (mode=no_step_skill) routes like λ_step = 0; use_episode=False like λ_ep = 0."""
    assert route_skills(4, STEPS, EP, use_step=False) == CRITICAL_FIRST[(0.001, 0.0)]
    assert route_skills(4, STEPS, EP, use_episode=False) == CRITICAL_FIRST[(0.0, 0.001)]
    assert route_skills(4, STEPS, EP, mode="additive", use_step=False) == ADDITIVE[(0.001, 0.0)]


@pytest.mark.parametrize("empty", ["", "   ", "\n\t", None])
def test_empty_skills_are_never_routed(empty):
    # an empty step skill: the step is not critical, it falls back to the episode skill
    assert route_skills(3, {1: empty}, EP) == [{"episode": "E"}] * 3
    assert route_skills(3, {1: empty}, EP, mode="additive") == [{"episode": "E"}] * 3
    # an empty episode skill: non-critical steps get nothing
    assert route_skills(3, {1: "s1"}, empty) == [{}, {"step": "s1"}, {}]
    assert route_skills(3, {1: "s1"}, empty, mode="additive") == [{}, {"step": "s1"}, {}]
    assert route_skills(2, {0: empty}, empty) == [{}, {}]


def test_failed_analysis_routes_nothing():
    assert route_skills(3, None, None, lambda_episode=0.001, lambda_step=0.001) == [{}, {}, {}]
    assert route_skills(0, {}, EP) == []


@pytest.mark.parametrize("bad", [-0.001, math.nan, math.inf, "0.1", True])
def test_bad_lambda_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="lambda_step"):
        route_skills(2, {}, EP, lambda_step=bad)
    with pytest.raises(ValueError, match="lambda_episode"):
        route_skills(2, {}, EP, lambda_episode=bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="outside"):
        route_skills(2, {5: "x"}, EP)
    with pytest.raises(ValueError, match="mode"):
        route_skills(2, {}, EP, mode="x")
    with pytest.raises(ValueError, match="num_steps"):
        route_skills(-1, {}, EP)
    with pytest.raises(TypeError, match="string"):
        route_skills(2, {0: 3}, EP)


TINY = [
    "model.init_from=", "rollout.tasks_per_iter=1", "rollout.group_size=2", "env.max_steps=2",
    "rollout.max_response_tokens=8", "eval.interval=0", "eval.num_tasks=0", "train.iterations=2",
    "train.save_interval=0", "train.micro_batch_tokens=512", "train.mini_batch_size=2",
    "logging.tensorboard=false", "logging.progress=false", "analyzer.max_step_skills=1",
]


@pytest.mark.slow
def test_trainer_routes_with_the_configured_lambdas(tmp_path):
    """A real iteration (tiny model, TextWorld, rule analyzer): with mode=opid and lambda_step=0 every step-sample
    is scored with the episode skill (critical steps fall back to it); with lambda_episode=0 only critical steps
    are scored, with their step skill."""
    from pathlib import Path

    from opid_mega.skills.audit import read_audit
    from opid_mega.trainer import Trainer

    config = str(Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml")
    cfg = load_config(config, TINY + ["algo.mode=opid", "algo.lambda_episode=0.001", "algo.lambda_step=0"])
    tr = Trainer(cfg, str(tmp_path))
    try:
        m1 = tr.iteration(1)
        tr.cfg.algo.lambda_episode, tr.cfg.algo.lambda_step = 0.0, 0.001
        m2 = tr.iteration(2)
    finally:
        tr.close()
    assert m1["analysis/failure_rate"] == 0.0 and m2["analysis/failure_rate"] == 0.0
    scored = [r for r in read_audit(tmp_path / "audit.jsonl", "augmented_prompt") if r.get("stage") == "scoring"]
    it1 = [r["kind"] for r in scored if r["iteration"] == 1]
    it2 = [r["kind"] for r in scored if r["iteration"] == 2]
    assert it1 == ["episode"] * int(m1["train/step_samples"])
    assert it2 and set(it2) == {"step"} and len(it2) < int(m2["train/step_samples"])
    analyses = [r for r in read_audit(tmp_path / "audit.jsonl", "analysis") if r["iteration"] == 2]
    assert len(it2) == sum(len(r["analysis"]["step_skills"]) for r in analyses)
