"""The advantage maths (docs/algorithm.md §2, §6, §7), whose one implementation is the batch builder
(opid_mega._C, with opid_mega.batching.reference beside it): both backends against float64 references written from
the rules, on random inputs, and the hand-worked examples of OPID.md."""
import math
import random

import numpy as np
import pytest

from advantage_oracle import ref_outcome, ref_tokens

from opid_mega import batching

BACKENDS = ["cpp", "python"] if batching.backend_name() == "cpp" else ["python"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["mean_std_norm", "mean_norm"])
@pytest.mark.parametrize("seed", range(5))
def test_outcome_advantage_matches_float64_reference(mode, seed, backend):
    rng = random.Random(seed)
    n = rng.randint(1, 60)
    groups = [rng.randint(0, 6) for _ in range(n)]
    scores = [rng.choice([0.0, 10.0]) - rng.choice([0.0, 0.1]) + rng.gauss(0, 0.3) for _ in range(n)]
    got = batching.outcome_advantage(np.array(scores), np.array(groups, np.int64), mode, backend=backend)
    np.testing.assert_allclose(got, ref_outcome(scores, groups, mode), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_outcome_advantage_hand_worked(backend):
    # One task group: trajectory A won (R=10) with 2 steps, the second invalid; trajectory B failed (R=0), 2 steps:
    # S = R - 0.1 * 1[invalid] = 10, 9.9, 0, 0 (experience.advantages)
    s = np.array([10.0, 9.9, 0.0, 0.0])
    g = np.array([7, 7, 7, 7], np.int64)
    a = batching.outcome_advantage(s, g, "mean_norm", backend=backend)
    assert a.tolist() == pytest.approx([10 - 4.975, 9.9 - 4.975, -4.975, -4.975])
    sd = math.sqrt(sum((x - 4.975) ** 2 for x in [10, 9.9, 0, 0]) / 3)
    a = batching.outcome_advantage(s, g, "mean_std_norm", backend=backend)
    assert a[0] == pytest.approx((10 - 4.975) / (sd + 1e-6))
    # A single step-sample group: mu = 0, sigma = 1.
    one = batching.outcome_advantage(np.array([3.0]), np.array([1], np.int64), "mean_std_norm", backend=backend)
    assert one[0] == pytest.approx(3.0 / (1 + 1e-6))


@pytest.mark.parametrize("backend", BACKENDS)
def test_outcome_advantage_errors(backend):
    with pytest.raises(ValueError, match="mode"):
        batching.outcome_advantage(np.ones(2), np.zeros(2, np.int64), "bogus", backend=backend)
    with pytest.raises(ValueError, match="group_ids"):
        batching.outcome_advantage(np.ones(2), np.zeros(3, np.int64), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("normalize,clip", [(False, None), (True, None), (False, 0.05), (True, 1.5)])
def test_token_advantages_match_float64_reference(seed, normalize, clip, backend):
    rng = np.random.default_rng(seed)
    n = 7
    lens = rng.integers(1, 9, n).astype(np.int64)
    a_out = rng.standard_normal(n)
    deltas = [rng.standard_normal(int(lens.sum())) - 0.5, rng.standard_normal(int(lens.sum()))]
    masks = [rng.random(n) < 0.6, rng.random(n) < 0.4]
    lams = [0.37, 1.3]
    got = batching.token_advantages(a_out, lens, deltas, masks, lams, normalize, clip, backend=backend)
    want = ref_tokens(a_out.tolist(), lens.tolist(), deltas, masks, lams, normalize, clip)
    scale = max(abs(x) for x in want)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)  # float32 output of float64 arithmetic
    # λ = 0 (GRPO) leaves exactly the outcome advantage
    grpo = batching.token_advantages(a_out, lens, deltas, masks, [0.0, 0.0], normalize, clip, backend=backend)
    assert np.array_equal(grpo, np.repeat(a_out, lens).astype(np.float32))
    with pytest.raises(ValueError, match="same length"):
        batching.token_advantages(a_out, lens, deltas, masks, [0.1], backend=backend)
    with pytest.raises(ValueError, match=">= 0"):
        batching.token_advantages(a_out, lens, deltas, masks, [0.1, -1.0], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_delta_normalisation_has_the_epsilon(backend):
    """(Δ − μ)/(σ + ε) (OPID.md "More reference facts"), worked by hand: valid Δ = 0 and 2e-6 (a third sample is not
    routed) give μ = 1e-6 and population σ = 1e-6, so with ε = 1e-6 the normalised values are ∓1e-6 / 2e-6 = ∓0.5 (a
    plain z-score would give ∓1); Δ = 1, 2, 3, 6 give μ = 3, σ = √3.5, the last one 3 / (√3.5 + 1e-6)."""
    one = np.ones(3, np.int64)
    d = batching.token_advantages(np.zeros(3), one, [np.array([0.0, 2e-6, 5.0])], [np.array([True, True, False])],
                                  [1.0], normalize=True, backend=backend)
    assert d[0] == pytest.approx(-0.5, rel=1e-6) and d[1] == pytest.approx(0.5, rel=1e-6) and d[2] == 0.0
    d = batching.token_advantages(np.zeros(1), np.array([4], np.int64), [np.array([1.0, 2.0, 3.0, 6.0])],
                                  [np.array([True])], [1.0], normalize=True, backend=backend)
    assert d[3] == pytest.approx(3 / (math.sqrt(3.5) + 1e-6), rel=1e-6)
    assert d[0] == pytest.approx(-2 / (math.sqrt(3.5) + 1e-6), rel=1e-6)
    # a constant Δ normalises to exactly 0: (Δ − μ) = 0, divided by 0 + ε
    c = batching.token_advantages(np.zeros(2), np.array([2, 2], np.int64), [np.full(4, 0.5)], [np.ones(2, bool)],
                                  [1.0], normalize=True, backend=backend)
    assert not np.any(c)
