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
