"""algo.advantage_fn / algo.loss_fn (docs/custom_algo.md): import paths checked when the config is loaded (one line
naming the key), the docs' examples (examples/custom_advantage.py, examples/custom_loss.py) called by a real trainer
iteration and by the Megatron loss, their results checked against hand computations."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from opid_mega import config as C
from tolerance import assert_close_scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TINY_CFG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
ADV = "algo.advantage_fn=custom_advantage:rloo_advantages"
LOSS = "algo.loss_fn=custom_loss:reinforce_loss"


@pytest.fixture
def examples_on_path(monkeypatch):
    """examples/ on sys.path (as PYTHONPATH=$PWD/examples does), the example modules imported afresh."""
    monkeypatch.syspath_prepend(EXAMPLES)
    for m in ("custom_advantage", "custom_loss"):
        sys.modules.pop(m, None)
    yield
    for m in ("custom_advantage", "custom_loss"):
        sys.modules.pop(m, None)


def _error(*overrides) -> str:
    with pytest.raises(C.ConfigError) as e:
        C.load_config(TINY_CFG, list(overrides))
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_the_docs_hold_the_example_files():
    doc = open(os.path.join(ROOT, "docs", "custom_algo.md"), encoding="utf-8").read()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.DOTALL)
    for name in ("custom_advantage", "custom_loss"):
        code = open(os.path.join(EXAMPLES, f"{name}.py"), encoding="utf-8").read()
        assert [b for b in blocks if b.startswith(f"# {name}.py")] == [code], name


def test_defaults_are_the_builtins_and_survive_config_yaml(examples_on_path, tmp_path):
    from opid_mega import rundir
    from opid_mega.algo.loss import ppo_policy_loss
    from opid_mega.experience import advantages
    from opid_mega.plugins import advantage_function, loss_function

    cfg = C.load_config(TINY_CFG)
    assert cfg.algo.advantage_fn == "opid_mega.experience:advantages"
    assert cfg.algo.loss_fn == "opid_mega.algo.loss:ppo_policy_loss"
    assert advantage_function(cfg.algo.advantage_fn) is advantages
    assert loss_function(cfg.algo.loss_fn) is ppo_policy_loss
    # config.yaml is written and read back on resume: the paths come back as written, defaults and plug-ins alike
    for overrides in ([], [ADV, LOSS]):
        cfg = C.load_config(TINY_CFG, overrides)
        run = tmp_path / str(len(overrides))
        run.mkdir()
        rundir.write_config(run, cfg)
        back = rundir.read_saved_config(run)
        assert (back.algo.advantage_fn, back.algo.loss_fn) == (cfg.algo.advantage_fn, cfg.algo.loss_fn)
        assert back.to_dict() == cfg.to_dict()


def test_bad_paths_are_one_line_naming_the_key(examples_on_path):
    cfg = C.load_config(TINY_CFG, [ADV, LOSS])  # the examples load
    assert (cfg.algo.advantage_fn, cfg.algo.loss_fn) == ("custom_advantage:rloo_advantages",
                                                         "custom_loss:reinforce_loss")
    # a missing module / attribute
    assert _error("algo.loss_fn=mypkg.losses:clipped") == \
        "algo.loss_fn: cannot import 'mypkg.losses:clipped': No module named 'mypkg'"
    assert _error("algo.loss_fn=custom_loss:nope") == \
        "algo.loss_fn: cannot import 'custom_loss:nope': module 'custom_loss' has no attribute 'nope'"
    assert _error("algo.advantage_fn=nopkg:f") == "algo.advantage_fn: cannot import 'nopkg:f': No module named 'nopkg'"
    # not a function
    assert _error("algo.loss_fn=opid_mega.algo.loss:LOSS_AGGS") == \
        "algo.loss_fn: 'opid_mega.algo.loss:LOSS_AGGS' is a tuple, not a function"
    assert _error("algo.advantage_fn=custom_advantage:Experience") == \
        "algo.advantage_fn: 'custom_advantage:Experience' is a class, not a function"
    assert _error("algo.advantage_fn=custom_advantage:np") == \
        "algo.advantage_fn: 'custom_advantage:np' is a module, not a function"
    # a signature that does not take the documented call (each example under the other key)
    assert _error("algo.advantage_fn=custom_loss:reinforce_loss") == \
        ("algo.advantage_fn: 'custom_loss:reinforce_loss' cannot be called as fn(exp, algo_cfg): missing a required "
         "argument: 'advantages'")
    assert _error("algo.loss_fn=custom_advantage:rloo_advantages") == \
        ("algo.loss_fn: 'custom_advantage:rloo_advantages' cannot be called as fn(logp, old_logp, advantages, mask, "
         "clip_low=, clip_high=, dual_clip=, log_ratio_clamp=, normalizer=): too many positional arguments")
    assert _error("algo.loss_fn=opid_mega.algo.loss:kl_penalty").startswith(
        "algo.loss_fn: 'opid_mega.algo.loss:kl_penalty' cannot be called as fn(logp, ")
    # not an import path; a typo in the key
    assert _error("algo.loss_fn=") == "algo.loss_fn: '' is not an import path; expected 'package.module:function'"
    assert _error("algo.advantage_fn=rloo") == \
        "algo.advantage_fn: 'rloo' is not an import path; expected 'package.module:function'"
    typo = _error("algo.loss_fnn=custom_loss:reinforce_loss")
    assert typo.startswith("algo.loss_fnn: unknown key; allowed keys in algo: advantage_fn, clip_high, ")
    assert ", loss_fn, " in typo
    assert _error("algo.advantage_fn=3") == "algo.advantage_fn: got 3 (int), expected a string"


def test_python_m_opid_mega_config_exits_2_with_the_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([EXAMPLES, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "opid_mega.config", TINY_CFG,
                           "algo.advantage_fn=custom_advantage:no_such_fn"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("config error: algo.advantage_fn: cannot import 'custom_advantage:no_such_fn': "
                                   "module 'custom_advantage' has no attribute 'no_such_fn'")
    ok = subprocess.run([sys.executable, "-m", "opid_mega.config", TINY_CFG, ADV, LOSS], capture_output=True,
                        text=True, env=env, cwd=tmp_path, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "advantage_fn: custom_advantage:rloo_advantages\n" in ok.stdout
    assert "loss_fn: custom_loss:reinforce_loss\n" in ok.stdout


def _hand_advantages(r, groups, resp_lens, old, skill, routed, lam):
    """RLOO outcome per step-sample and the token advantages, by loops over plain Python floats."""
    S = len(r)
    a_out = []
    for i in range(S):
        others = [r[j] for j in range(S) if groups[j] == groups[i] and j != i]
        a_out.append(r[i] - sum(others) / len(others) if others else 0.0)
    tokens, t = [], 0
    for i in range(S):
        for _ in range(resp_lens[i]):
            a = a_out[i]
            for kind in ("episode", "step"):
                if routed[kind][i]:
                    a += lam[kind] * (float(skill[kind][t]) - float(old[t]))
            tokens.append(a)
            t += 1
    return a_out, tokens


@pytest.mark.slow
def test_a_real_iteration_calls_both_examples(examples_on_path, tiny_cfg, tmp_path):
    """One Trainer.iteration with both examples: the advantage function runs on random non-zero scores, invalid
    flags, routing and skill log-probs put into the record; the logged adv/* metrics and the advantages the policy
    trains on equal the hand computation; the Megatron loss calls the REINFORCE loss (no clip fraction logged)."""
    import custom_advantage
    import custom_loss

    from opid_mega.trainer import Trainer

    cfg = tiny_cfg(ADV, LOSS, "rollout.tasks_per_iter=2", "algo.lambda_episode=0.5", "algo.lambda_step=0.25")
    tr = Trainer(cfg, str(tmp_path))
    try:
        assert tr.advantage_fn is custom_advantage.rloo_advantages
        assert tr.policy.loss_cfg.loss_fn is custom_loss.reinforce_loss
        rng = np.random.default_rng(7)
        seen, trained, loss_calls = {}, [], []

        def advantage_fn(exp, algo_cfg):  # random non-zero inputs, then the configured function
            S, R = exp.num_samples, int(exp.resp_lens.sum())
            exp.scores = rng.uniform(-1.0, 2.0, S)
            exp.invalid = rng.random(S) < 0.4
            for kind in ("episode", "step"):
                exp.routed[kind] = rng.random(S) < 0.6
                exp.skill_logprobs[kind] = (exp.old_logprobs + rng.normal(0.0, 1.0, R)).astype(np.float32)
            seen.update(r=[float(s) - 0.1 * bool(b) for s, b in zip(exp.scores, exp.invalid)],
                        groups=exp.groups.tolist(), resp_lens=exp.resp_lens.tolist(), old=exp.old_logprobs.copy(),
                        skill={k: v.copy() for k, v in exp.skill_logprobs.items()},
                        routed={k: v.tolist() for k, v in exp.routed.items()})
            custom_advantage.rloo_advantages(exp, algo_cfg)

        def train(data, seed):
            trained.append(data.values["advantages"].copy())
            return policy_train(data, seed)

        def loss_fn(*args, **kwargs):
            loss_calls.append(sorted(kwargs))
            return custom_loss.reinforce_loss(*args, **kwargs)

        tr.advantage_fn = advantage_fn
        policy_train, tr.policy.train = tr.policy.train, train
        tr.policy.loss_cfg.loss_fn = loss_fn
        m = tr.iteration(1)
    finally:
        tr.close()
    assert cfg.algo.invalid_penalty == 0.1 and len(set(seen["groups"])) == 2
    a_out, tokens = _hand_advantages(seen["r"], seen["groups"], seen["resp_lens"], seen["old"], seen["skill"],
                                     seen["routed"], {"episode": 0.5, "step": 0.25})
    assert any(abs(a) > 0.1 for a in a_out) and any(any(v) for v in seen["routed"].values())
    (adv,) = trained
    assert adv.dtype == np.float32
    assert_close_scaled(adv, tokens)
    lens = seen["resp_lens"]
    outcome_abs = sum(abs(a) * n for a, n in zip(a_out, lens)) / sum(lens)
    skill_abs = sum(abs(t - a) for t, a in zip(tokens, np.repeat(a_out, lens))) / sum(lens)
    assert_close_scaled(m["adv/outcome_abs_mean"], outcome_abs)
    assert_close_scaled(m["adv/skill_abs_mean"], skill_abs)
    # the loss: called by the Megatron loss with the documented keywords; it reports approx_kl, no clip fraction
    assert loss_calls and all(k == ["clip_high", "clip_low", "dual_clip", "log_ratio_clamp", "normalizer"]
                              for k in loss_calls)
    assert m["ppo/clipfrac"] is None and m["ppo/approx_kl"] is not None and np.isfinite(m["ppo/loss"])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_the_loss_through_ppo_loss_func_by_hand(examples_on_path, agg):
    """ppo_loss_func with LossConfig(loss_fn=reinforce_loss): the summed loss and the count equal Σ w·(-A·logp) and
    the count of the aggregation, by hand; the gradient with respect to logp is -A·w."""
    import custom_loss

    from opid_mega.megatron.logprobs import Sample, plain_batches
    from opid_mega.megatron.train_step import LossConfig, ppo_loss_func

    g = torch.Generator().manual_seed(3)
    lens = [3, 5, 2]
    samples, logps = [], []
    for n in lens:
        old = (-torch.rand(n, generator=g) * 3 - 0.2).tolist()
        adv = (torch.randn(n, generator=g) * 2).tolist()
        mask = [1.0] * (n - 1) + [0.0]  # the last token of each sequence masked out
        samples.append(Sample(list(range(n + 2)), 2, old_logprobs=old, advantages=adv, loss_mask=mask))
        logps.append([o + 0.1 * float(x) for o, x in zip(old, torch.randn(n, generator=g))])
    logp = torch.tensor([x for lp in logps for x in lp], requires_grad=True)
    cfg = LossConfig(kl_coef=0.0, entropy_coef=0.0, loss_agg=agg, loss_fn=custom_loss.reinforce_loss)
    pb = plain_batches(samples, 64)  # one micro-batch; the output in its gathered order
    loss, count, metrics = ppo_loss_func(pb.batches[0], pb.gathered(torch.stack([logp, torch.zeros_like(logp)])), cfg)
    want, want_count, want_grad = 0.0, 0.0, []
    for s, lp in zip(samples, logps):
        w = 1.0 / sum(s.loss_mask) if agg == "seq-mean-token-mean" else 1.0
        for a, x, mk in zip(s.advantages, lp, s.loss_mask):
            want += w * mk * (-a * x)
            want_grad.append(-a * w * mk)
        want_count += 1.0 if agg == "seq-mean-token-mean" else sum(s.loss_mask)
    assert_close_scaled(loss.item(), want, floor=1.0)
    assert int(count) == want_count
    loss.backward()
    assert_close_scaled(logp.grad, want_grad)
    assert "clipfrac" not in metrics and "approx_kl" in metrics


def test_a_loss_that_returns_the_wrong_thing_is_named():
    from opid_mega.megatron.logprobs import Sample, plain_batches
    from opid_mega.megatron.train_step import LossConfig, ppo_loss_func

    def bare(logp, old_logp, advantages, mask, **kwargs):
        return (-advantages * logp * mask).sum()  # no metrics

    (batch,) = plain_batches([Sample([1, 2, 3, 4], 2, old_logprobs=[-1.0, -2.0], advantages=[0.5, -0.3],
                                     loss_mask=[1.0, 1.0])], 64).batches
    with pytest.raises(ValueError) as e:
        ppo_loss_func(batch, torch.tensor([[-1.1, -1.9], [0.0, 0.0]]), LossConfig(kl_coef=0.0, entropy_coef=0.0,
                                                                                   loss_fn=bare))
    assert str(e.value) == (f"ppo_loss_func: the policy loss {__name__}:test_a_loss_that_returns_the_wrong_thing_is_"
                            "named.<locals>.bare returned Tensor, expected (a scalar tensor, a dict of metrics)")


def test_check_advantages_names_the_function():
    """What the trainer checks after algo.advantage_fn: dtype, length and finiteness of both columns."""
    from opid_mega.config import AlgoConfig
    from opid_mega.experience import check_advantages, compute_advantages
    from opid_mega.scoring.scorer import ScoreResult

    g = torch.Generator().manual_seed(11)
    results = [ScoreResult(orig=-torch.rand(n, generator=g) - 0.1, skill={}) for n in (2, 4, 3)]
    exp = compute_advantages(AlgoConfig(mode="grpo"), results, [1.0, 0.0, 1.0], [False, True, False], [0, 0, 1])
    check_advantages(exp, "opid_mega.experience:advantages")  # the built-in passes
    name = "mymod:adv"
    good_tok, good_out = exp.token_advantages, exp.a_out
    exp.token_advantages = good_tok.astype(np.float64)
    with pytest.raises(ValueError) as e:
        check_advantages(exp, name)
    assert str(e.value) == ("algo.advantage_fn=mymod:adv: exp.token_advantages is float64 of shape (9,), expected a "
                            "numpy float32 array of 9 values (one per response token)")
    exp.token_advantages = good_tok[:8]
    with pytest.raises(ValueError, match=r"exp.token_advantages is float32 of shape \(8,\), expected"):
        check_advantages(exp, name)
    exp.token_advantages = good_tok.tolist()
    with pytest.raises(ValueError, match=r"^algo.advantage_fn=mymod:adv: exp.token_advantages is list, expected"):
        check_advantages(exp, name)
    exp.token_advantages = good_tok
    exp.a_out = np.array([0.5, np.nan, np.inf])
    with pytest.raises(ValueError) as e:
        check_advantages(exp, name)
    assert str(e.value) == ("algo.advantage_fn=mymod:adv: exp.a_out[1] is nan (2 non-finite values), expected finite "
                            "values")
    exp.a_out = None
    with pytest.raises(ValueError, match=r"exp.a_out is NoneType, expected a numpy float64 array of 3 values"):
        check_advantages(exp, name)
    exp.a_out = good_out
    check_advantages(exp, name)
