"""Every algo.mode runs through a real iteration; the fork scorer (through the trainer's Megatron adapter) equals the
naive scorer; skill_grpo puts skills into the rollout prompt and evaluates with and without them."""
import pytest
import torch

from opid_mega.scoring.scorer import NaiveScorer, ScoreRequest, score_requests
from opid_mega.skills.audit import read_audit
from opid_mega.trainer import Trainer
from tolerance import assert_close_scaled


@pytest.mark.slow
def test_all_modes_and_scorers(tiny_cfg, tmp_path):
    # no cap on the skill term: with 2 trajectories a group often ties, and every mode's skill term is what is checked
    cfg = tiny_cfg("eval.with_skills=true", "eval.num_tasks=1", "analyzer.max_step_skills=1", "algo.skill_share_cap=null")
    tr = Trainer(cfg, str(tmp_path))
    try:
        m = tr.iteration(1)  # opid: analyses fill the skill bank
        assert m["adv/skill_abs_mean"] > 0 and tr.rollouts.skill_bank
        for it, (mode, skill_term) in enumerate([("no_routing", True), ("no_episode_skill", None),
                                                 ("no_step_skill", True), ("grpo", False),
                                                 ("skill_grpo", False)], start=2):
            tr.cfg.algo.mode = mode
            m = tr.iteration(it)
            if skill_term is not None:
                assert (m["adv/skill_abs_mean"] > 0) == skill_term, mode
            assert m["ppo/loss"] is not None and torch.isfinite(torch.tensor(m["ppo/loss"]))
        ev = tr.rollouts.evaluate(7)
        assert set(ev) == {"eval/success_rate", "eval/episode_length", "eval/success_rate_with_skills"}
        # fork layout (one forward, shared prefix) == naive two-pass scoring, through the trainer's adapters
        sec = tr.encode_text("**Episode-Level Skill**\nhint\n[go east]\n\n")
        prompt, ep, st = tr.loop.prompt_tokenizer.encode("Task line\nobs\n\nNow it's your turn to act.\n")
        reqs = [ScoreRequest(prompt, [40, 686, 34216, 151645], {"episode": (ep, sec)}),
                ScoreRequest(prompt, [40, 12, 13], {"step": (st, sec), "episode": (ep, sec)})]
        fork = score_requests(tr.scorer, reqs)
        naive = score_requests(NaiveScorer(tr.policy.logprobs), reqs)
        for f, n in zip(fork, naive):
            assert_close_scaled(f.orig, n.orig, msg="orig")  # two fp32 paths: 1e-5 of the largest |log-prob|
            for k in n.skill:
                assert_close_scaled(f.skill[k], n.skill[k], msg=k)
    finally:
        tr.close()
    rollout_aug = [r for r in read_audit(tmp_path / "audit.jsonl", "augmented_prompt") if r.get("stage") == "rollout"]
    assert rollout_aug and all("**Episode-Level Skill**" in r["prompt"] for r in rollout_aug)
