"""Reference fidelity of the run set-up. Expected values are written out from
../shared/OPID.md ("Setups in the paper", "Reference rules in detail"), never read from our own code:

- every shipped paper config (configs/qwen*.yaml) follows its reference script;
- the learning-rate schedule (constant; Search: linear warm-up over the first 10% of steps, then constant) is the
  rate the optimizer really uses at each iteration;
- a prompt longer than rollout.max_prompt_tokens is left-truncated, not ended;
- log-probs are computed at the sampling temperature all through a trainer iteration;
- Skill-GRPO: a rollout of task t carries t's own latest skill (none before its first analysis); the "with skills"
  evaluation gives each eval task the skill analysed from its own no-skill eval episode, never another task's.
"""
import glob
import os

import pytest

from opid_mega.config import ConfigError, load_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")

# OPID.md "Setups in the paper" + "Per-script settings that differ" + §3, §7, §8, §9.
ENV = {
    #            B   G  iters steps hist prompt resp mini  K  penalty  kl     entropy
    "alfworld": (16, 8, 160, 30, 5, 2048, 512, 256, 5, 0.1, 0.01, 0.001),
    "webshop": (16, 8, 160, 15, 2, 4096, 512, 64, 5, 0.1, 0.01, 0.001),
    "search_qa": (128, 8, 150, 4, 4, 4096, 512, 512, 2, 0.01, 0.001, 0.0),
}
# outcome mode per script: ALFWorld mean_std_norm for Qwen2.5-3B, mean_norm for the other models; WebShop mean_norm;
# Search mean_std_norm
OUTCOME = {
    "qwen2.5-3b_alfworld": "mean_std_norm", "qwen2.5-7b_alfworld": "mean_norm", "qwen3-1.7b_alfworld": "mean_norm",
    "qwen2.5-3b_webshop": "mean_norm", "qwen2.5-7b_webshop": "mean_norm", "qwen3-1.7b_webshop": "mean_norm",
    "qwen2.5-3b_search_qa": "mean_std_norm", "qwen2.5-7b_search_qa": "mean_std_norm",
    "qwen3-1.7b_search_qa": "mean_std_norm",
}
MODEL = {"qwen2.5-3b": "Qwen2.5-3B-Instruct", "qwen2.5-7b": "Qwen2.5-7B-Instruct", "qwen3-1.7b": "Qwen3-1.7B"}


def _evaluated_iterations(cfg):
    from opid_mega.trainer import should_evaluate

    return [it for it in range(cfg.train.iterations + 1) if should_evaluate(cfg, it)]


def test_every_paper_config_follows_its_reference_script():
    files = sorted(glob.glob(os.path.join(ROOT, "configs", "qwen*.yaml")))
    assert {os.path.basename(f)[:-5] for f in files} == set(OUTCOME)
    for path in files:
        name = os.path.basename(path)[:-5]
        cfg = load_config(path)
        env = cfg.env.name
        B, G, iters, steps, hist, prompt, resp, mini, K, pen, kl, ent = ENV[env]
        got = (cfg.rollout.tasks_per_iter, cfg.rollout.group_size, cfg.train.iterations, cfg.env.max_steps,
               cfg.env.history_length, cfg.rollout.max_prompt_tokens, cfg.rollout.max_response_tokens,
               cfg.train.mini_batch_size, cfg.analyzer.max_step_skills, cfg.algo.invalid_penalty, cfg.algo.kl_coef,
               cfg.algo.entropy_coef)
        assert got == (B, G, iters, steps, hist, prompt, resp, mini, K, pen, kl, ent), name
        assert cfg.algo.outcome_mode == OUTCOME[name], name
        assert MODEL[name.split("_")[0]] in cfg.model.path and cfg.model.enable_thinking is False, name
        a, t = cfg.algo, cfg.train
        assert (a.mode, a.placement, a.lambda_episode, a.lambda_step) == ("opid", "faithful", 0.001, 0.001), name
        # the reference's loss aggregation: token mean per micro-batch of 32 / 8 / 16 step-samples (OPID.md's
        # hyper-parameter table), averaged; mini-batches in rollout order; no validation before training
        assert (a.clip_low, a.clip_high, a.dual_clip, a.loss_agg, a.kl_kind) == (0.2, 0.2, 3.0, "token-mean-micro",
                                                                               "low_var_kl"), name
        assert t.micro_batch_size == {"alfworld": 32, "webshop": 8, "search_qa": 16}[env], name
        # validation before training only in the Qwen3 Search-QA script (run_search_opid_guide_qwen3.sh
        # val_before_train=True; every other script False)
        before = env == "search_qa" and name.startswith("qwen3")
        assert (t.shuffle_minibatches, cfg.eval.before_training) == (False, before), name
        assert (a.delta_normalize, a.delta_clip) == (False, None), name
        assert (t.lr, t.grad_clip, t.ppo_epochs, t.use_reference) == (1e-6, 1.0, 1, True), name
        assert (cfg.rollout.temperature, cfg.eval.temperature, cfg.eval.with_skills) == (1.0, 0.4, False), name
        # OPID.md "More reference facts": Retries (5 attempts in all = 1 + 4 retries) and Analyzer sampling (no
        # temperature sent, no response format); the reference's parser edge cases
        assert (cfg.analyzer.gamma, cfg.analyzer.max_tokens, 1 + cfg.analyzer.max_retries, cfg.analyzer.backoff_s,
                cfg.analyzer.backoff_max_s) == (0.95, 4096, 5, 1.0, 30.0), name
        assert (cfg.analyzer.temperature, cfg.analyzer.response_format, cfg.analyzer.json_mode,
                cfg.analyzer.parser) == (None, "none", None, "reference"), name
        if env == "search_qa":  # warm-up over the first 10% of steps; validation at the end (test_freq=150)
            assert (t.lr_scheduler, t.lr_warmup_ratio) == ("warmup", 0.1), name
            assert _evaluated_iterations(cfg) == ([0, 150] if before else [150]), name
        else:  # constant rate
            assert (t.lr_scheduler, t.lr_warmup_ratio) == ("constant", 0.0), name
        if env == "webshop":  # every 5 steps (run_webshop_opid_guide*.sh test_freq=5), not before training
            assert _evaluated_iterations(cfg) == list(range(5, 161, 5)), name
        if env == "alfworld":  # valid_seen, 128 episodes every 5 steps (not before training)
            assert (cfg.env.train_split, cfg.env.eval_split, cfg.eval.num_tasks) == ("train", "valid_seen", 128)
            assert _evaluated_iterations(cfg) == list(range(5, 161, 5)), name


def test_alfworld_validation_split_is_selectable():
    path = os.path.join(ROOT, "configs", "qwen2.5-3b_alfworld.yaml")
    assert load_config(path, ["env.eval_split=valid_unseen"]).env.eval_split == "valid_unseen"
    from opid_mega.envs import make_env

    env = make_env("alfworld", source="generated")  # offline generated games: both validation splits, disjoint
    seen, unseen = env.tasks("valid_seen", 4, seed=0), env.tasks("valid_unseen", 4, seed=0)
    assert {t.split for t in seen} == {"valid_seen"} and {t.split for t in unseen} == {"valid_unseen"}
    assert not {t.id for t in seen} & {t.id for t in unseen}


def test_learning_rate_schedule_values():
    from opid_mega.algo.schedule import learning_rate

    search = load_config(os.path.join(ROOT, "configs", "qwen2.5-3b_search_qa.yaml")).train
    # 150 iterations, warm-up 10% = 15 iterations: lr * (it - 1) / 15 (the first update at 0), then 1e-6
    want = {1: 0.0, 2: 1e-6 / 15, 8: 7e-6 / 15, 15: 14e-6 / 15, 16: 1e-6, 17: 1e-6, 150: 1e-6}
    for it, lr in want.items():
        assert learning_rate(search, it) == pytest.approx(lr, rel=1e-12, abs=0), it
    alf = load_config(os.path.join(ROOT, "configs", "qwen2.5-3b_alfworld.yaml")).train
    assert all(learning_rate(alf, it) == 1e-6 for it in range(1, 161))
    for bad in (["train.lr_scheduler=warmup"], ["train.lr_warmup_ratio=0.1"], ["train.lr_scheduler=cosine"],
                ["train.lr_scheduler=warmup", "train.lr_warmup_ratio=1.5"]):
        with pytest.raises(ConfigError, match="train.lr_"):
            load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), bad)


def test_long_prompt_is_left_truncated_not_ended():
    from opid_mega.envs import make_env
    from opid_mega.models import load_tokenizer, qwen_tokenizer_dir
    from opid_mega.rollout.agent_loop import AgentLoop
    from opid_mega.rollout.engine import SamplingParams
    from opid_mega.rollout.scripted_engine import ScriptedEngine, WalkthroughPolicy

    tok = load_tokenizer(qwen_tokenizer_dir())
    env = make_env("search_qa")
    tasks = env.tasks("train", n=1, seed=0)
    seen = []

    class Recording(ScriptedEngine):
        def generate(self, prompt_ids, sampling):
            seen.append([list(p) for p in prompt_ids])
            return super().generate(prompt_ids, sampling)

    def run(limit):
        seen.clear()
        loop = AgentLoop(Recording(tok, WalkthroughPolicy(env, tasks)), tok, env_name="search_qa",
                         history_length=4, num_workers=1, max_prompt_tokens=limit)
        try:
            batch = loop.run(tasks, 1, SamplingParams(max_new_tokens=128, stop_token_ids=loop.stop_token_ids))
        finally:
            loop.close()
        return batch.trajectories[0], [p[0] for p in seen]

    full, full_prompts = run(None)
    # the longest prompts lose their first tokens (the chat header; the scripted policy still finds the question)
    limit = max(len(p) for p in full_prompts) - 5
    cut, cut_prompts = run(limit)
    assert cut.error is None and cut.won == full.won and len(cut.steps) == len(full.steps) >= 2
    assert any(len(a) > limit for a in full_prompts)
    for a, b, s_full, s_cut in zip(full_prompts, cut_prompts, full.steps, cut.steps):
        assert b == a[-limit:]  # the LAST max_prompt_tokens tokens are kept (all of a shorter prompt)
        assert s_cut.prompt_ids == b and s_cut.prompt_text == s_full.prompt_text
        drop = max(0, len(a) - limit)
        assert s_cut.episode_insert_at == max(0, s_full.episode_insert_at - drop)
        assert s_cut.step_insert_at == s_full.step_insert_at - drop > 0


# ---------------------------------------------------------------------------------------------------- tiny trainer
@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """skill_grpo at sampling temperature 0.7 with a 4-iteration warm-up of ratio 0.5 (W = 2 iterations)."""
    from .conftest import CONFIG, TINY
    from opid_mega.trainer import Trainer

    cfg = load_config(CONFIG, TINY + ["algo.mode=skill_grpo", "rollout.temperature=0.7", "train.iterations=4",
                                      "train.lr_scheduler=warmup", "train.lr_warmup_ratio=0.5", "train.lr=0.001",
                                      "eval.num_tasks=2", "train.save_interval=0"])
    tr = Trainer(cfg, str(tmp_path_factory.mktemp("fidelity")))
    yield tr
    tr.close()


@pytest.mark.slow
def test_lr_used_per_iteration_and_logprobs_at_the_sampling_temperature(trainer, monkeypatch):
    import torch

    import opid_mega.megatron.train_step as ts

    used = []
    real = ts.train_mini_batch

    def recording(ddp, optimizer, *a, **k):
        used.append({g["lr"] for g in optimizer.param_groups})
        return real(ddp, optimizer, *a, **k)

    monkeypatch.setattr(ts, "train_mini_batch", recording)
    params = lambda: [p.detach().clone() for p in trainer.policy.chunks[0].parameters()]  # noqa: E731
    want = {1: 0.0, 2: 0.5e-3, 3: 1e-3}  # lr * min(1, (it - 1) / 2)
    for it, lr in want.items():
        before, used[:] = params(), []
        m = trainer.iteration(it)
        assert used and all(s == {lr} for s in used), (it, used)
        assert m["train/lr"] == lr
        moved = any(not torch.equal(a, b) for a, b in zip(before, params()))
        assert moved == (lr > 0), it  # lr 0: Adam leaves every weight where it was
        # old log-probs at T = 0.7 equal the engine's sampling log-probs (log_softmax(logits / 0.7)), and the
        # PPO forward uses the same T: the first mini-batch's approx-KL is 0
        assert m["rollout/logprob_mismatch"] < 1e-4 and abs(m["ppo/approx_kl_first"]) < 1e-6, (it, m)


@pytest.mark.slow
def test_skill_grpo_rollouts_and_eval_use_each_tasks_own_skill(trainer, monkeypatch):
    from opid_mega.skills.audit import read_audit
    from opid_mega.pipeline import skill_key

    tr = trainer
    audit = tr.run_dir / "audit.jsonl"
    task_a, task_b = tr.env0.tasks(tr.cfg.env.train_split, 2, seed=123)
    monkeypatch.setattr(tr.env0, "tasks", lambda *a, **k: [task_a])  # every iteration now rolls out task A

    def rollout_skills(it):
        return [r["skill"] for r in read_audit(audit, "augmented_prompt")
                if r["iteration"] == it and r.get("stage") == "rollout"]

    # A has no analysis yet: no skill in its rollouts, whatever other tasks hold
    tr.rollouts.skill_bank.clear()
    tr.rollouts.skill_bank[skill_key(task_b)] = "SKILL OF TASK B"
    tr.iteration(11)
    assert rollout_skills(11) == []
    own = tr.rollouts.skill_bank[skill_key(task_a)]  # filled from A's own analyses of iteration 11
    assert own.strip() and tr.rollouts.skill_bank[skill_key(task_b)] == "SKILL OF TASK B"
    # A's next rollouts carry A's latest skill, and only that
    tr.iteration(12)
    steps = sum(1 for r in read_audit(audit, "augmented_prompt")
                if r["iteration"] == 12 and r.get("stage") == "rollout")
    assert steps >= 2 and rollout_skills(12) == [own] * steps

    # "with skills" evaluation: each eval task gets the episode skill of the analysis of its own no-skill episode
    ev = tr.rollouts.evaluate(13)
    assert set(ev) == {"eval/success_rate", "eval/episode_length", "eval/success_rate_with_skills"}
    analyses = {r["traj_id"]: r["analysis"]["episode_skill"] for r in read_audit(audit, "analysis")
                if r["iteration"] == 13 and r.get("analysis")}
    assert len(analyses) == len(tr.rollouts.eval_tasks) == 2
    for i, t in enumerate(tr.rollouts.eval_tasks):
        mine = analyses[f"eval13/{skill_key(t)}/{i}"]
        got = [r["skill"] for r in read_audit(audit, "augmented_prompt")
               if r["iteration"] == 13 and r["sample_id"].startswith(f"13/rollout/{i}/")]
        assert got and set(got) == {mine}, (i, got, mine)
    assert all("SKILL OF TASK B" not in r["prompt"] for r in read_audit(audit, "augmented_prompt")
               if r["iteration"] == 13)
