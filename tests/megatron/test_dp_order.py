"""A run resumed on another data-parallel size (`--resume D deploy.nodes=N`) trains on the same global sample order,
split over its new ranks: the mini-batches of Policy.train (opid_mega.megatron.policy.minibatch_plan) do not depend on
the DP size, and each mini-batch's micro-batches over DP = 1, 2, 3 or 4 ranks hold exactly its step-samples' response
tokens, each once."""
import numpy as np
import pytest

from opid_mega.megatron.policy import minibatch_plan
from opid_mega.megatron.policy import TrainData


def _data(n=21, seed=3):
    rng = np.random.default_rng(seed)
    seqs, resp = [], []
    for _ in range(n):
        p, r = int(rng.integers(2, 30)), int(rng.integers(1, 10))
        seqs.append(rng.integers(0, 50_000, p + r).tolist())
        resp.append(r)
    sid = np.repeat(np.arange(n), resp)  # a response token's value names it: sample * 1000 + position
    pos = np.concatenate([np.arange(r) for r in resp])
    code = (sid * 1000 + pos).astype(np.float32)
    return resp, TrainData.from_sequences(seqs, resp, old_logprobs=code, advantages=code)


def _tokens_on_ranks(part: TrainData, dp: int, budget: int) -> list:
    """(global sample, position) of every response token the dp ranks train on (read from the tokens' values)."""
    out = []
    for r in range(dp):
        for b in part.micro_batches(budget, dp, r):
            for v in b.extras["old_logprobs"].tolist() if b.scored_per_seq else []:
                s, j = divmod(int(v), 1000)
                out.append((s, j))
    return out


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_global_sample_order_does_not_depend_on_the_dp_size(shuffle):
    resp, data = _data()
    plan = minibatch_plan(data.num_samples, 8, 2, shuffle, seed=1234)
    # the plan: every step-sample once per epoch, mini-batches of 8 (the last one short), the same for every call
    assert [len(x) for x in plan] == [8, 8, 5, 8, 8, 5]
    assert sorted(plan[0] + plan[1] + plan[2]) == list(range(21)) == sorted(plan[3] + plan[4] + plan[5])
    assert plan == minibatch_plan(data.num_samples, 8, 2, shuffle, seed=1234)
    assert (plan[:3] != [list(range(0, 8)), list(range(8, 16)), list(range(16, 21))]) == shuffle
    for idx in plan:
        part = data.subset(idx)
        want = sorted((s, j) for s in idx for j in range(resp[s]))
        for dp in (1, 2, 3, 4):
            got = _tokens_on_ranks(part, dp, budget=64)
            assert sorted(got) == want, (dp, idx)  # the same samples, each token on exactly one rank
