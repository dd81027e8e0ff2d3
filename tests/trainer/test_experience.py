"""The iteration's record (opid_mega.experience): built once from a rollout, filled by the stages. Expected values are
written out by hand from the rollout's own step-samples (the reference's rule: a skill section goes into the prompt
at the kind's insertion point; step_priority routing; kept trajectories only)."""
import dataclasses

import numpy as np
import pytest
import torch

from opid_mega.config import load_config
from opid_mega.experience import (Experience, add_skills, advantage_records, fill_scores, metrics,
                                  scores_of_results)
from opid_mega.batching.layout import csr_offsets
from opid_mega.megatron.policy import TrainData
from opid_mega.rollout.types import RolloutBatch, StepSample, Trajectory
from opid_mega.scoring.scorer import ScoreResult
from opid_mega.skills.types import Analysis


def _step(rng, task, group, traj, k):
    p = rng.integers(5, 12)
    prompt = rng.integers(1, 900, p).tolist()
    resp = rng.integers(1, 900, rng.integers(1, 6)).tolist()
    ep, st = int(rng.integers(1, p // 2)), int(rng.integers(p // 2, p + 1))
    return StepSample(task_id=task, group_id=group, traj_id=traj, step=k, prompt_text=f"prompt {traj}/{k}",
                      prompt_ids=prompt, episode_insert_at=ep, step_insert_at=st, response_ids=resp,
                      response_logprobs=(-rng.random(len(resp)) - 0.01).tolist(), response_text="r",
                      finish_reason="stop", action="go", valid=bool(rng.random() < 0.7), raw_obs="o", reward=0.0,
                      done=False)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    trajs = []
    for j in range(6):
        g = j // 2
        t = Trajectory(task_id=f"t{g}", group_id=g, traj_id=j, steps=[_step(rng, f"t{g}", g, j, k)
                                                                      for k in range(1 + j % 3)],
                       won=bool(j % 2), score=float(rng.normal() * 3 + 1))
        trajs.append(t)
    trajs[1].env_error = True  # left out, counted
    trajs[4].deadline_failure = True
    return RolloutBatch(trajectories=trajs)


def test_from_rollout_keeps_finished_trajectories_as_columns():
    batch = _batch()
    exp = Experience.from_rollout(batch, iteration=3, policy_version=2)
    kept = [t for j, t in enumerate(batch.trajectories) if j not in (1, 4)]
    steps = [s for t in kept for s in t.steps]
    assert exp.trajectories == kept and exp.rollout_trajectories == 6
    assert (exp.env_errors, exp.deadline_trajectories) == (1, 1)
    assert exp.num_samples == len(steps) == 1 + 3 + 1 + 3  # trajectories 0, 2, 3, 5 of 1 + j % 3 steps
    assert exp.tokens.dtype == np.int32
    assert exp.tokens.tolist() == [x for s in steps for x in s.prompt_ids + s.response_ids]
    assert np.diff(exp.seq_offsets).tolist() == [len(s.prompt_ids) + len(s.response_ids) for s in steps]
    assert exp.prompt_lens.tolist() == [len(s.prompt_ids) for s in steps]
    assert exp.resp_lens.tolist() == [len(s.response_ids) for s in steps]
    assert exp.groups.tolist() == [t.group_id for t in kept for _ in t.steps]
    assert exp.scores.tolist() == [t.score for t in kept for _ in t.steps]
    assert exp.invalid.tolist() == [not s.valid for s in steps]
    assert exp.engine_logprobs.tolist() == [x for s in steps for x in s.response_logprobs]
    assert exp.policy_version.tolist() == [2] * len(steps)
    assert [exp.sample_id(i) for i in range(exp.num_samples)] == \
        [f"3/{t.task_id}/{ti}/s{si}" for ti, t in enumerate(kept) for si in range(len(t.steps))]
    assert [(exp.prompt(i).tolist(), exp.response(i).tolist()) for i in range(exp.num_samples)] == \
        [(s.prompt_ids, s.response_ids) for s in steps]


@pytest.mark.parametrize("mode,placement", [("opid", "faithful"), ("opid", "late"), ("grpo", "faithful")])
def test_skill_contexts_are_routed_fitted_and_audited_once(mode, placement):
    exp = Experience.from_rollout(_batch(1), iteration=1, policy_version=0)
    cfg = load_config(None, [f"algo.mode={mode}", f"algo.placement={placement}"]).algo
    # kept trajectories: 1, 3, 1 and 3 steps; an empty step skill and one past the last step fall back to the episode
    # skill; "ep two" fits to no section (dropped)
    analyses = [Analysis("sum", "episode skill text", {0: "step zero"}),
                Analysis("sum", "second episode skill", {1: "", 5: "outside"}), None,
                Analysis("sum", "ep two", {2: "fix it"})]

    def fit(skill, kind):  # a section of 2 + len(words) ids; "ep two" fits to nothing (dropped)
        return (skill, []) if skill == "ep two" else (skill, [7000 + len(skill), 7001] + [7002] * len(skill.split()))

    logged = []

    class Audit:
        def log_augmented_prompt(self, **kw):
            logged.append(kw)

    add_skills(exp, analyses, cfg, fit, Audit())
    want, want_log = [], []
    for ti, (t, an) in enumerate(zip(exp.trajectories, analyses)):
        for si, s in enumerate(t.steps):
            ctx = {}
            if mode != "grpo" and an is not None:
                # step_priority: a step with a non-empty step skill gets it only; else the episode skill
                skill, kind = (an.step_skills[si], "step") if an.step_skills.get(si, "").strip() \
                    else (an.episode_skill, "episode")
                at = s.episode_insert_at if kind == "episode" and placement != "late" else s.step_insert_at
                _, ids = fit(skill, kind)
                if ids:
                    ctx[kind] = (at, ids)
                    want_log.append((f"1/{t.task_id}/{ti}/s{si}", kind, skill))
            want.append(ctx)
    assert [exp.contexts(i) for i in range(exp.num_samples)] == want
    kinds = [k for ctx in want for k in ctx]
    assert (kinds.count("episode"), kinds.count("step")) == ((3, 2) if mode != "grpo" else (0, 0))
    assert [(r["sample_id"], r["kind"], r["skill"]) for r in logged] == want_log
    assert all(r["stage"] == "scoring" and r["placement"] == placement for r in logged)
    # the scorer's contexts and the distillation teacher's contexts are views of the same columns
    from opid_mega.megatron.policy import TrainData

    teacher = TrainData(exp.tokens, exp.seq_offsets, exp.resp_lens,
                        dict(old_logprobs=np.zeros(int(exp.resp_lens.sum())),
                             advantages=np.zeros(int(exp.resp_lens.sum()))), **exp.skill_columns()).contexts()
    scored = exp.scoring_contexts()
    for ctx in (teacher, scored):
        got = [ctx.tokens[ctx.ctx_offsets[c]:ctx.ctx_offsets[c + 1]].tolist() for c in range(ctx.num_contexts)]
        assert got == [c for i, s in enumerate(exp.steps)
                       for c in [s.prompt_ids + s.response_ids,
                                 *(s.prompt_ids[:at] + sec + s.prompt_ids[at:] + s.response_ids
                                   for _, (at, sec) in sorted(want[i].items()))]]
    assert scored.sample_offsets.tolist() == csr_offsets([1 + len(w) for w in want]).tolist()
    assert scored.resp_lens.tolist() == [len(s.response_ids) for i, s in enumerate(exp.steps) for _ in
                                         range(1 + len(want[i]))]
    plain = exp.scoring_contexts(skills=False)  # the reference stage: the original contexts only
    assert plain.sample_offsets.tolist() == list(range(exp.num_samples + 1))
    assert plain.tokens.tolist() == exp.tokens.tolist() and plain.resp_lens.tolist() == exp.resp_lens.tolist()


def test_scores_fill_columns_and_the_policy_view_matches_the_sequences():
    exp = Experience.from_rollout(_batch(2), iteration=2, policy_version=1)
    g = torch.Generator().manual_seed(5)
    results = []
    for i in range(exp.num_samples):
        orig = -torch.rand(int(exp.resp_lens[i]), generator=g) - 0.05
        skill = {"episode": orig - torch.rand(orig.numel(), generator=g)} if i % 2 else {}
        results.append(ScoreResult(orig=orig, skill=skill))
    fill_scores(exp, scores_of_results(exp, results))
    assert exp.old_logprobs.tolist() == torch.cat([r.orig for r in results]).tolist()
    assert exp.routed["episode"].tolist() == [bool(i % 2) for i in range(exp.num_samples)]
    assert not exp.routed["step"].any()
    assert exp.skill_logprobs["step"].tolist() == exp.old_logprobs.tolist()
    exp.a_out = np.linspace(-1.3, 2.1, exp.num_samples)
    exp.token_advantages = (np.repeat(exp.a_out, exp.resp_lens) + 0.25).astype(np.float32)
    m = metrics(exp, elapsed=2.0)
    ntok = exp.resp_lens.sum()
    assert m["adv/outcome_abs_mean"] == pytest.approx(np.abs(np.repeat(exp.a_out, exp.resp_lens)).sum() / ntok)
    assert m["adv/skill_abs_mean"] == pytest.approx(0.25, rel=1e-6)
    assert m["rollout/logprob_mismatch"] == pytest.approx(
        np.abs(exp.engine_logprobs - exp.old_logprobs.astype(np.float64)).sum() / ntok)
    assert m["perf/tokens_per_s"] == exp.tokens.size / 2.0
    assert m["train/step_samples"] == exp.num_samples and m["rollout/env_errors"] == 1
    recs = advantage_records(exp)
    odd = recs[1]
    sl = exp.response_slice(1)
    assert odd["kinds"] == ["episode"] and odd["response_ids"] == exp.response(1).tolist()
    assert odd["delta"]["episode"] == [round(float(a) - float(b), 5) for a, b in
                                       zip(results[1].skill["episode"].double(), results[1].orig.double())]
    assert sl.stop - sl.start == exp.resp_lens[1]
    data = TrainData(exp.tokens, exp.seq_offsets, exp.resp_lens,
                     {"old_logprobs": exp.old_logprobs, "advantages": exp.token_advantages})
    ref = TrainData.from_sequences([exp.sequence(i).tolist() for i in range(exp.num_samples)], exp.resp_lens,
                                   old_logprobs=exp.old_logprobs, advantages=exp.token_advantages)
    assert np.array_equal(data.tokens, ref.tokens) and np.array_equal(data.seq_offsets, ref.seq_offsets)


def test_a_result_of_the_wrong_length_names_its_sample():
    exp = Experience.from_rollout(_batch(3), iteration=1, policy_version=0)
    results = [ScoreResult(orig=torch.full((int(n),), -0.5), skill={}) for n in exp.resp_lens]
    results[2] = dataclasses.replace(results[2], orig=torch.full((int(exp.resp_lens[2]) + 1,), -0.5))
    with pytest.raises(ValueError, match=f"original log-probs of step-sample 2 has {int(exp.resp_lens[2]) + 1} "
                                         f"values, its response {int(exp.resp_lens[2])} tokens"):
        scores_of_results(exp, results)


@pytest.mark.parametrize("delta", ["sampled", "full_kl"])
def test_score_stage_fills_the_columns_from_the_scorers_flat_output(delta):
    """experience.score: the scorer gets the record's contexts as one CSR batch and returns one flat array; the
    columns (old log-probs, each kind's skill log-probs, routed masks, the divergence term) are what a per-sample
    reading of that array gives, for a record with both kinds on one sample (no_routing) and samples without any."""
    from opid_mega.experience import score
    from opid_mega.scoring.scorer import Scores, per_sample, skill_context_index

    exp = Experience.from_rollout(_batch(1), iteration=1, policy_version=0)
    cfg = load_config(None, ["algo.mode=no_routing"]).algo
    analyses = [Analysis("sum", "episode skill text", {0: "step zero"}), None,
                Analysis("sum", "second episode skill", {2: "fix it"}), None]
    add_skills(exp, analyses, cfg, lambda skill, kind: (skill, [7] * (2 + len(skill.split()))))
    seen = {}

    class Flat:  # a scorer whose every value names its context and token
        def score(self, ctx):
            seen["ctx"] = ctx
            at = csr_offsets(ctx.resp_lens)
            vals = np.concatenate([-(c + 1) - np.arange(n) / 100 for c, n in enumerate(ctx.resp_lens)])
            skill = skill_context_index(ctx)
            div = {"kl_orig_skill": np.concatenate([np.full(ctx.resp_lens[c], 0.5 * c) for c in skill]),
                   "kl_skill_orig": np.zeros(int(ctx.resp_lens[skill].sum()))}
            assert vals.size == at[-1]
            return Scores(vals.astype(np.float32), div if delta != "sampled" else {}, tokens=123)

    score(exp, Flat(), delta)
    ctx = seen["ctx"]
    kinds = [[None, *sorted(exp.contexts(s))] for s in range(exp.num_samples)]
    assert any(len(k) == 3 for k in kinds) and any(len(k) == 1 for k in kinds)
    results = per_sample(ctx, kinds, Flat().score(ctx))
    assert exp.old_logprobs.tolist() == torch.cat([r.orig for r in results]).tolist()
    for kind in ("episode", "step"):
        assert exp.routed[kind].tolist() == [kind in r.skill for r in results]
        want = torch.cat([r.skill.get(kind, r.orig) for r in results])
        assert exp.skill_logprobs[kind].tolist() == want.tolist()
        if delta == "full_kl":
            kl = torch.cat([torch.full((int(n),), 0.5 * float(c0 + 1 + sorted(exp.contexts(s)).index(kind)))
                            if kind in exp.contexts(s) else torch.zeros(int(n))
                            for s, (n, c0) in enumerate(zip(exp.resp_lens, ctx.sample_offsets[:-1]))])
            assert exp.divergence[kind].tolist() == pytest.approx(kl.tolist())
    assert exp.scored_tokens == 123
    with pytest.raises(ValueError, match="the scorer returned 1 log-probs"):
        from opid_mega.experience import fill_scores as fill

        fill(exp, Scores(np.zeros(1, np.float32)))
