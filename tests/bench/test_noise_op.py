"""opid-bench delta_noise at the tiny preset on CPU, in this process: the same step-samples scored in other packings,
layouts and with an empty skill, per dtype, beside a run's |λΔ| (a small dumped-advantages file written here). fp32
rows must be at fp32 rounding of the log-probs Δ is a difference of; bf16 rows must be visibly coarser (the check can
tell the two apart)."""
import json
import os

import numpy as np
import pytest

from tolerance import tolerance_for

pytest.importorskip("megatron.core")

from opid_mega.bench import cli, noise  # noqa: E402

QUIET = dict(repeats=1, device="cpu", compile_peers=False, log=lambda s: None)


def _run_dir(tmp_path, records, lambdas=(0.5, 0.25)):
    (tmp_path / "config.yaml").write_text(f"algo:\n  lambda_episode: {lambdas[0]}\n  lambda_step: {lambdas[1]}\n")
    path = tmp_path / "advantages.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


RECORDS = [{"iteration": 1, "delta": {"episode": [0.1, -0.2]}}, {"iteration": 2, "delta": {"step": [0.4]}},
           {"iteration": 2, "kinds": []}]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from opid_mega.megatron import parallel

    path = _run_dir(tmp_path_factory.mktemp("run"), RECORDS)
    saved = dict(os.environ)  # the process-group set-up sets MASTER_ADDR / MASTER_PORT
    try:
        yield cli.run_op("delta_noise", "tiny", advantages=path, **QUIET)
    finally:
        parallel.destroy_all()
        os.environ.clear()
        os.environ.update(saved)


def test_delta_noise_tiny_has_fp32_and_bf16_rows_and_fp32_noise_at_rounding(result):
    cases = {c["dtype"]: c for c in result["cases"]}
    assert list(cases) == ["float32", "bfloat16", "float16"]
    names = ["fork, one micro-batch", "fork, one step-sample per micro-batch", "fork, reversed order",
             "two-pass naive scorer", "fork, empty skill", "two-pass, empty skill"]
    for case in cases.values():
        assert [m["name"] for m in case["methods"]] == names
        assert case["shape"]["tokens"] == case["shape"]["samples"] * case["shape"]["R"] == 128
        assert case["logprob_scale"] > 1.0  # log-probs of a 512-token vocabulary: their rounding sets Δ's
        for m in case["methods"]:
            assert "skipped" not in m, m
            assert m["seconds"] > 0 and m["peak_bytes"] > 0
    fp32, bf16 = cases["float32"], cases["bfloat16"]
    tol = tolerance_for(0.0, scale=fp32["logprob_scale"])
    for m in fp32["methods"]:
        err = m["error"]
        assert max(err.get("noise_max", 0.0), err.get("float64_max", 0.0)) <= tol, (m["name"], err, tol)
        assert err.get("noise_p50", 0.0) <= err.get("noise_p99", 0.0) <= err.get("noise_max", 0.0)
    # bf16 rounds at 2^-8: its Δ is far from float64 and its two layouts disagree far beyond fp32 rounding
    bf16_rows = {m["name"]: m["error"] for m in bf16["methods"]}
    assert bf16_rows["fork, one micro-batch"]["float64_max"] > 10 * tol
    assert bf16_rows["two-pass naive scorer"]["noise_max"] > 10 * tol
    # the signal beside it: the run's |λΔ|, λ per kind from its config.yaml
    sig = fp32["signal"]
    assert sig["lambda"] == {"episode": 0.5, "step": 0.25} and sig["tokens"] == 3 and sig["iterations"] == 2
    assert sig["lambda_delta_max"] == pytest.approx(0.1) and sig["lambda_delta_p50"] == pytest.approx(0.1)
    assert "the run's |λΔ|" in fp32["notes"][1]


def test_the_run_signal_and_what_noise_buries(tmp_path):
    path = _run_dir(tmp_path, RECORDS)
    sig = noise.signal(path)  # |λΔ| = 0.05, 0.1 (episode, λ 0.5), 0.1 (step, λ 0.25)
    assert np.allclose(sig["_sorted"], [0.05, 0.1, 0.1])
    assert noise.buried(sig, 0.5, 0.15) == pytest.approx({"buried_tokens": 1 / 3, "buried_mass": 0.05 / 0.25})
    assert noise.buried(sig, 0.5, 0.0) == {"buried_tokens": 0.0, "buried_mass": 0.0}
    assert noise.signal(path, lam=2.0)["lambda"] == {"episode": 2.0, "step": 2.0}
    os.remove(tmp_path / "config.yaml")
    with pytest.raises(ValueError, match="--lam"):
        noise.signal(path)


def test_the_cli_keeps_advantages_to_delta_noise(tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(["logprob", "--preset", "tiny", "--advantages", str(tmp_path / "a.jsonl")])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["delta_noise", "--preset", "tiny", "--advantages", str(tmp_path / "missing.jsonl")])
