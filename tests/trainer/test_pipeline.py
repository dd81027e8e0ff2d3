"""Bounded staleness: the rollouts in flight (opid_mega.pipeline), the behaviour weights of stale samples
(opid_mega.algo.behavior_weights, experience.off_policy) and why weighting the advantage is decoupled PPO."""
import threading

import numpy as np
import pytest
import torch

from opid_mega import algo
from opid_mega.experience import Experience, metrics, off_policy
from opid_mega.pipeline import RolloutPipeline

from .test_experience import _batch


def _run(staleness, last, resume_at=None, overlap=False):
    """The (iteration, version) of every rollout drawn and taken over iterations 1..last; `resume_at`: the pipeline
    is saved after that iteration and a new one restored from the state, as a resumed run does. `overlap`: the next
    rollouts play in the background during the "update", as the trainer drives a disaggregated deployment."""
    drawn, taken, submitted = [], [], []
    batch = _batch(1)

    def rollout(k, version):
        drawn.append((k, version))
        return Experience.from_rollout(batch, k, policy_version=version)

    def submit(exp):
        submitted.append(exp.iteration)
        return [f"view {exp.iteration}"], f"job {exp.iteration}"

    def job(k, version):  # prepared in the trainer's thread, run in the background
        def run():
            assert threading.current_thread() is not main
            return rollout(k, version)
        return run

    def land(k, version, produce):
        exp = produce()
        assert exp.iteration == k and int(exp.policy_version[0]) == version
        return (exp, *submit(exp))

    main = threading.current_thread()
    p = RolloutPipeline(staleness, last, overlap=overlap)
    for it in range(1, last + 1):
        p.fill(it, rollout, submit)
        took = p.take(it)
        if overlap:
            p.start(it, job)
            p.join(land)  # (the update runs between the two)
        assert took.views == [f"view {it}"] and took.pending == f"job {it}"
        taken.append((it, int(took.exp.policy_version[0])))
        if it == resume_at:
            state = p.state()
            p = RolloutPipeline(staleness, last, overlap=overlap)
            p.restore(state, submit)
    return drawn, taken, submitted


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_each_iteration_trains_on_a_rollout_at_most_staleness_versions_old(staleness):
    drawn, taken, _ = _run(staleness, 6)
    assert [k for k, _ in drawn] == list(range(1, 7))  # every iteration's rollout once, in order
    # iteration it draws up to it + staleness with the weights of version it - 1
    want_version = {k: max(0, k - 1 - staleness) for k in range(1, 7)}
    assert dict(drawn) == want_version
    assert taken == [(it, want_version[it]) for it in range(1, 7)]
    assert max(it - 1 - v for it, v in taken) == min(staleness, 5)


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_overlapping_draws_the_same_rollouts_with_the_same_weights(staleness):
    """Disaggregated: the next rollouts play beside the update, yet each is drawn with the weights the sequential
    pipeline draws it with (version it - 1 at iteration it), trained at the same staleness, resumable alike."""
    assert _run(staleness, 6, overlap=True)[:2] == _run(staleness, 6)[:2]
    assert _run(2, 6, overlap=True, resume_at=3) == _run(2, 6, resume_at=3)


def test_overlapping_rollout_runs_while_the_update_runs_and_is_joined_before_the_sync():
    batch = _batch(1)
    update_started, rollout_done = threading.Event(), threading.Event()

    def job(k, version):
        def run():  # waits for the "update" of the main thread: it can finish only if both run at once
            assert update_started.wait(30), "the background rollout never saw the update start"
            rollout_done.set()
            return Experience.from_rollout(batch, k, policy_version=version)
        return run

    p = RolloutPipeline(1, 3, overlap=True)
    p.fill(1, lambda k, v: Experience.from_rollout(batch, k, policy_version=v), lambda e: ([], None))
    p.take(1)
    assert p.start(1, job) == [2]
    update_started.set()  # the update runs here, while iteration 2's rollout plays
    with pytest.raises(RuntimeError, match=r"iteration 2: the rollouts \[2\] started in the background were never "
                                           "joined"):
        p.fill(2, None, None)
    assert p.join(lambda k, v, produce: (produce(), [], None)) == 1 and rollout_done.is_set()
    assert p.take(2).exp.iteration == 2
    p.close()


def test_an_error_in_the_background_rollout_is_raised_where_it_lands():
    def job(k, version):
        def run():
            raise RuntimeError(f"engine died in iteration {k}")
        return run

    p = RolloutPipeline(1, 3, overlap=True)
    p.queue.clear()
    p.start(1, job)
    with pytest.raises(RuntimeError, match="engine died in iteration 2"):
        p.join(lambda k, v, produce: (produce(), [], None))
    with pytest.raises(RuntimeError, match="start\\(\\) needs an overlapping pipeline"):
        RolloutPipeline(1, 3).start(1, job)
    p.close()


def test_close_asks_a_background_rollout_to_stop_and_never_waits_for_its_deadline():
    """An error or a signal ends the run while the next rollout plays beside the update: close() asks it to stop
    (the agent loop's stop) and gives it seconds; one that does not stop is left behind (a daemon thread, its result
    dropped). Before, close() waited for it: up to rollout.deadline_s (7,200 s by default)."""
    import time

    stop = threading.Event()

    def job(k, version):
        def run():  # a rollout that ends when asked to
            assert stop.wait(60)
            return None
        return run

    p = RolloutPipeline(1, 3, overlap=True)
    p.start(1, job)
    t0 = time.monotonic()
    p.close(cancel=stop.set)
    assert time.monotonic() - t0 < 2.0 and p.drawing is None
    stubborn = RolloutPipeline(1, 3, overlap=True)
    stubborn.start(1, lambda k, version: (lambda: time.sleep(60)))
    t0 = time.monotonic()
    stubborn.close(cancel=lambda: None, grace_s=0.5)
    assert time.monotonic() - t0 < 2.0
    assert [t.daemon for t in threading.enumerate() if t.name == "rollout"] == [True]  # nothing waits for it at exit


def test_a_restored_pipeline_trains_on_the_saved_rollouts_and_resubmits_their_analyses():
    straight = _run(2, 6)
    resumed = _run(2, 6, resume_at=3)
    assert resumed[1] == straight[1]  # same records taken, same versions
    assert resumed[0] == straight[0]  # nothing redrawn
    assert resumed[2] == [1, 2, 3, 4, 5, 4, 5, 6]  # the two in flight at iteration 3 submitted again
    assert RolloutPipeline(1, 3).state() is None


def test_pipeline_errors_are_named():
    with pytest.raises(ValueError, match="max_staleness=-1 must be an integer >= 0"):
        RolloutPipeline(-1, 3)
    p = RolloutPipeline(0, 3)
    with pytest.raises(RuntimeError, match=r"iteration 1: its rollout is not in flight \(in flight: \[\]\)"):
        p.take(1)


def test_behavior_weights_against_float64_by_hand():
    rng = np.random.default_rng(3)
    prox, behav = -rng.random(50) * 4 - 0.01, -rng.random(50) * 4 - 0.01
    got = algo.behavior_weights(prox.astype(np.float32), behav.astype(np.float32), cap=2.0)
    want = [min(np.exp(float(p) - float(b)), 2.0) for p, b in zip(prox.astype(np.float32), behav.astype(np.float32))]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert (got == 2.0).any() and (got < 1.0).any()
    with pytest.raises(ValueError, match="cap=0 must be > 0"):
        algo.behavior_weights(prox, behav, cap=0)
    with pytest.raises(ValueError, match=r"\(50,\) proximal and \(3,\) behaviour"):
        algo.behavior_weights(prox, behav[:3], cap=2.0)


def test_weighting_the_advantage_is_weighting_the_clipped_ppo_loss():
    """L(w·A) = w·L(A) per token for w >= 0 (clip and dual clip are positively homogeneous in A)."""
    g = torch.Generator().manual_seed(0)
    n = 64
    logp, old = -torch.rand(n, generator=g, dtype=torch.float64) * 3, -torch.rand(n, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(n, generator=g, dtype=torch.float64) * 2
    w = torch.rand(n, generator=g, dtype=torch.float64) * 2
    per_token = []
    for i in range(n):  # each token's loss alone (a one-hot mask), with weight w_i on the loss
        mask = torch.zeros(n, dtype=torch.float64)
        mask[i] = 1.0
        per_token.append(algo.ppo_policy_loss(logp, old, adv, mask, dual_clip=3.0, normalizer=1.0)[0])
    weighted = algo.ppo_policy_loss(logp, old, adv * w, torch.ones(n, dtype=torch.float64), dual_clip=3.0,
                                    normalizer=1.0)[0]
    assert torch.allclose(weighted, (torch.stack(per_token) * w).sum(), rtol=1e-12, atol=1e-12)


def test_off_policy_weights_only_the_stale_samples():
    exp = Experience.from_rollout(_batch(2), iteration=5, policy_version=3)  # drawn 1 version before the trainer's 4
    R = int(exp.resp_lens.sum())
    exp.old_logprobs = (exp.engine_logprobs + np.linspace(-0.5, 0.9, R)).astype(np.float32)
    off_policy(exp, "decoupled", cap=2.0)
    want = np.minimum(np.exp(exp.old_logprobs.astype(np.float64) - exp.engine_logprobs), 2.0)
    np.testing.assert_allclose(exp.behavior_weights, want, rtol=1e-12)
    off_policy(exp, "none", cap=2.0)
    assert (exp.behavior_weights == 1.0).all()
    fresh = Experience.from_rollout(_batch(2), iteration=5, policy_version=4)
    fresh.old_logprobs = exp.old_logprobs
    off_policy(fresh, "decoupled", cap=2.0)
    assert (fresh.behavior_weights == 1.0).all()
    exp.engine_logprobs = exp.engine_logprobs[:3]
    with pytest.raises(ValueError, match="needs the rollout engine's log-probs"):
        off_policy(exp, "decoupled", cap=2.0)


def test_stale_samples_train_with_their_behaviour_weights(tiny_cfg):
    """Where the correction is applied (Trainer.train_data -> Policy.train), analytically, on the tiny model: two
    copies of one step-sample drawn 2 versions ago, advantages +1 and -1, rescored under the current weights (PPO
    ratio 1, so the gradient is linear in the weighted advantages). Uncorrected their gradients cancel; with behaviour
    weights w0 = 2 (capped: the engine found the tokens e^5 times less likely) and w1 = 1/e the gradient is
    (w0 - w1) = 1.63 times that of the first copy alone (advantages +1 and 0, on-policy). An update without the
    weights gives ~0, weights inverted give 1.99 (π_b / π_prox, capped) or 2.22 (advantages divided by w)."""
    from types import SimpleNamespace

    from opid_mega import experience
    from opid_mega.megatron import parallel
    from opid_mega.megatron.policy import Policy
    from opid_mega.rollout.types import RolloutBatch, StepSample, Trajectory
    from opid_mega.trainer import Trainer, resolve_init

    cfg = tiny_cfg("train.max_staleness=2", "train.off_policy_correction=decoupled", "train.behavior_weight_cap=2.0",
                   "algo.kl_coef=0", "algo.entropy_coef=0", "train.grad_clip=0", "train.save_interval=0",
                   "train.mini_batch_size=2", "train.ppo_epochs=1")
    policy = Policy(cfg, resolve_init(cfg))
    try:
        policy.set_lr(0.0)  # the weights stay: every update below sees the same model
        prompt, resp = [11, 22, 33, 44, 55, 66], [101, 202, 303, 404]
        prox = np.asarray(policy.logprobs([(prompt + resp, len(prompt))])[0], np.float64)

        def record(version, engine_shift, advantages):
            steps = [StepSample(task_id="t", group_id=0, traj_id=j, step=0, prompt_text="p", prompt_ids=prompt,
                                episode_insert_at=1, step_insert_at=5, response_ids=resp,
                                response_logprobs=(prox + shift).tolist(), response_text="r", finish_reason="stop",
                                action="go", valid=True, raw_obs="o", reward=0.0, done=True)
                     for j, shift in enumerate(engine_shift)]
            batch = RolloutBatch(trajectories=[Trajectory(task_id="t", group_id=0, traj_id=j, steps=[s])
                                               for j, s in enumerate(steps)])
            exp = Experience.from_rollout(batch, iteration=3, policy_version=version)
            exp.old_logprobs = np.concatenate([prox, prox]).astype(np.float32)
            exp.token_advantages = np.repeat(np.asarray(advantages, np.float32), len(resp))
            experience.off_policy(exp, cfg.train.off_policy_correction, cfg.train.behavior_weight_cap)
            return exp

        def grad_norm(exp):
            data = Trainer.train_data(SimpleNamespace(cfg=cfg), exp)
            return policy.train(data, seed=0)["grad_norm"]

        stale = record(1, [-5.0, 1.0], [1.0, -1.0])  # engine log-probs 5 below / 1 above π_prox
        w0, w1 = 2.0, np.exp(-1.0)
        np.testing.assert_allclose(stale.behavior_weights, [w0] * 4 + [w1] * 4, rtol=1e-6)
        one = grad_norm(record(2, [0.0, 0.0], [1.0, 0.0]))  # on-policy: no weights
        corrected = grad_norm(stale)
        print(f"grad norm: one copy {one:.6g}; stale pair, corrected {corrected:.6g} ({corrected / one:.4f} x, want "
              f"{w0 - w1:.4f} x)")
        assert one > 0 and corrected == pytest.approx((w0 - w1) * one, rel=1e-3)
    finally:
        parallel.destroy_all()
