"""The fork scorer equals the naive (two/three-pass) scorer on random tiny Megatron models: TP1, TP2, PP2, both
placements, routed (two contexts) and additive (three contexts), shared prompts, empty tails, 1-token responses,
and at a sampling temperature of 0.7 (every context scored at logits / 0.7 by both scorers)."""
import json
import os
import subprocess
import sys

import pytest

from tolerance import tolerance_for

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(tmp_path, world):
    out = tmp_path / f"fork_w{world}.json"
    r = subprocess.run([sys.executable, os.path.join(HERE, "_fork_worker.py"), str(out), str(world)],
                       capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


def _check(res, layouts):
    assert {k.split("-")[0] for k in res} == set(layouts)
    for key, v in res.items():
        assert v["n_values"] > 10, key
        # two fp32 paths: within 1e-5 of the largest |log-prob| compared
        assert v["max_abs_diff"] <= tolerance_for(0.0, scale=v["max_abs_logprob"]), (key, v)
        assert 0.0 < v["shared_fraction"] < 1.0, (key, v)
        if key.endswith("-T0.7"):
            assert v["temperature_effect"] > 1e-3, (key, v)
    assert {k.split("-")[0] for k in res if k.endswith("-T0.7")} == set(layouts)


@pytest.mark.slow
def test_fork_equals_naive_single_rank(tmp_path):
    _check(_run(tmp_path, 1), ["tp1pp1"])


@pytest.mark.slow
def test_fork_equals_naive_tp2_pp2(tmp_path):
    _check(_run(tmp_path, 2), ["tp1pp1", "tp2pp1", "tp1pp2"])
