"""opid-bench's model ops at the tiny preset, in-process on CPU: rescoring (fork scorer vs the two-pass naive scorer
on a megatron-core model) and training attention (varlen vs the per-sequence loop and the dense mask). Every row
has its time, peak memory, ratio to the bound and its error against a float64 reference, within fp32 rounding of
the magnitudes compared; the report renders their tables."""
import json
import os

import pytest
import torch

from tolerance import tolerance_for

pytest.importorskip("megatron.core")

from opid_mega.bench import cli  # noqa: E402
from opid_mega.bench.core import get_preset, table  # noqa: E402
from opid_mega.bench.scoring import (PLACEMENTS, PROMPT, layout_of, layout_pairs, rescoring_shape,  # noqa: E402
                                     scoring_flops)
from opid_mega.kernels import fork_attention_mask  # noqa: E402

QUIET = dict(repeats=1, device="cpu", compile_peers=False, log=lambda s: None)


@pytest.fixture(scope="module")
def rescoring():
    """One tiny rescoring run (megatron-core's parallel state for one in-process rank, torn down after)."""
    from opid_mega.megatron import parallel

    saved = dict(os.environ)  # the process-group set-up sets MASTER_ADDR / MASTER_PORT
    try:
        yield cli.run_op("rescoring", "tiny", **QUIET)
    finally:
        parallel.destroy_all()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def train_attention():
    return cli.run_op("train_attention", "tiny", **QUIET)


def _check_rows(result):
    for case in result["cases"]:
        assert case["flops"] > 0 and case["bound_s"] > 0
        for m in case["methods"]:
            assert "skipped" not in m, m  # every row runs on CPU at the tiny preset
            assert m["seconds"] > 0 and m["peak_bytes"] > 0 and m["ratio_to_bound"] > 0
            assert m["error"] and all(v >= 0 for v in m["error"].values())


def test_the_linear_part_of_the_bound_is_the_token_ratio():
    dims = dict(hidden=64, layers=2, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=0)
    P, S, T, R = 300, 40, 25, 90
    naive, fork = scoring_flops(dims, [P + T + R, P + S + T + R], [(P, [S + T + R, T + R])], resp_rows=2 * R)
    attn = dims["layers"] * 4 * dims["heads"] * dims["head_dim"]  # per attended (query, key) pair
    c = lambda n, o=0: n * o + n * (n + 1) // 2  # noqa: E731
    lin_n = naive - attn * (c(P + T + R) + c(P + S + T + R))
    lin_f = fork - attn * (c(P) + c(S + T + R, P) + c(T + R, P))
    assert lin_n / lin_f == pytest.approx((2 * (P + T + R) + S) / (P + S + 2 * T + 2 * R))
    assert naive > fork


def test_rescoring_shapes_come_from_the_prompt_pieces():
    ci = get_preset("ci")
    late, faithful = rescoring_shape(ci, "late"), rescoring_shape(ci, "faithful")
    # the same prompt either way: P + T is the whole prompt, S the skill section
    assert late["P"] + late["T"] == faithful["P"] + faithful["T"]
    assert late["P"] == (PROMPT["head"] + PROMPT["middle"]) // 4 and faithful["P"] == PROMPT["head"] // 4
    assert rescoring_shape(get_preset("7b"), "late") == {"P": 402, "S": 87, "T": 73, "R": 160}
    with pytest.raises(ValueError, match="placement"):
        rescoring_shape(ci, "early")


def test_rescoring_tiny_rows_errors_and_bound(rescoring):
    result = rescoring
    assert result["op"] == "rescoring" and result["preset"] == "tiny"
    assert [c["placement"] for c in result["cases"]] == list(PLACEMENTS)
    _check_rows(result)
    tiny = get_preset("tiny")
    for case in result["cases"]:
        assert [(m["name"].split(" (")[0], m["role"]) for m in case["methods"]] == [
            ("fork scorer", "ours"), ("naive two-pass scorer", "peer")]
        s = case["shape"]
        P, S, T, R, n = s["P"], s["S"], s["T"], s["R"], s["samples"]
        assert {k: s[k] for k in "PSTR"} == rescoring_shape(tiny, case["placement"]) and n == 2
        assert s["fork_tokens"] == n * (P + S + 2 * T + 2 * R) and s["naive_tokens"] == n * (2 * (P + T + R) + S)
        # the bound, recomputed from the model's dimensions and the case's shape
        dims = dict(hidden=tiny.hidden, layers=s["layers"], ffn=s["ffn"], heads=tiny.heads, kv_heads=tiny.kv_heads,
                    head_dim=tiny.head_dim, vocab=tiny.vocab)
        naive, fork = scoring_flops(dims, [P + T + R, P + S + T + R] * n, [(P, [S + T + R, T + R])] * n, 2 * R * n)
        assert case["flops"] == fork and case["naive_flops"] == naive
        assert case["bound_speedup"] == pytest.approx(naive / fork, abs=1e-4) and naive > fork
        assert f"×{naive / fork:.2f}" in case["name"]
        # fp32 model vs the same weights in float64: within fp32 rounding of the log-probs' magnitude
        tol = tolerance_for(0.0, scale=case["logprob_scale"])
        assert case["logprob_scale"] > 1.0  # random inputs: log-probs of a 512-token vocabulary, never ~0
        for m in case["methods"]:
            assert set(m["error"]) == {"orig", "skill"}
            assert max(m["error"].values()) <= tol, (m["name"], m["error"], tol)


def test_train_attention_tiny_rows_errors_and_pairs(train_attention):
    result = train_attention
    assert [c["name"] for c in result["cases"]] == ["plain pack fwd+bwd float32", "fork layout fwd+bwd float32"]
    _check_rows(result)
    tiny = get_preset("tiny")
    for case in result["cases"]:
        assert [(m["name"].split(" (")[0], m["role"]) for m in case["methods"]] == [
            ("varlen_attention", "ours"), ("per-sequence loop", "peer"), ("SDPA with the dense [N, N] mask", "peer")]
        layout = tuple(case["layout"]) if isinstance(case["layout"][0], int) else tuple(
            (p, tuple(b)) for p, b in case["layout"])
        cu, br = layout_of(layout)
        bid = torch.zeros(cu[-1], dtype=torch.int32) if br is None else torch.tensor(br, dtype=torch.int32)
        pairs = int(fork_attention_mask(torch.tensor(cu, dtype=torch.int32), bid).sum())
        assert case["shape"]["attended_pairs"] == layout_pairs(layout) == pairs and case["shape"]["N"] == cu[-1]
        assert case["flops"] == 12 * pairs * tiny.heads * tiny.head_dim
        for m in case["methods"]:
            assert set(m["error"]) == {"out", "dq_rel", "dk_rel", "dv_rel"}
            # fp32 against float64: the output within fp32 rounding of its magnitude, the gradients of theirs
            assert m["error"]["out"] <= tolerance_for(0.0, scale=case["out_scale"]), (m["name"], m["error"])
            assert max(m["error"][k] for k in ("dq_rel", "dk_rel", "dv_rel")) <= tolerance_for(0.0, scale=1.0,
                                                                                              rel=1e-4), m


def test_the_report_renders_the_model_ops(rescoring, train_attention, tmp_path, capsys):
    for result in (rescoring, train_attention):
        (tmp_path / f"{result['op']}.json").write_text(json.dumps(result))
        md = table(result, markdown=True)
        assert md.count("\n| ") == 1 + sum(len(c["methods"]) for c in result["cases"])  # header, rows
    assert cli.report(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.index("**rescoring") < out.index("**train_attention")
    assert "naive two-pass scorer" in out and "per-sequence loop (the previous path)" in out
