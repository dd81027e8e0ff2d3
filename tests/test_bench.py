"""opid-bench: the schema, the float64 errors, the fork-attention peer, the table and the generated docs tables.
Tiny preset, no torch.compile peers (their compile time), in-process: seconds."""
import json
import os
import subprocess
import sys

import pytest
import torch

from opid_mega.bench import attention, cli, roofline
from opid_mega.bench.attention import attended_pairs, fork_attention_cases, fork_layout, per_sequence_pairs
from opid_mega.bench.core import PRESETS, PeakMeter, get_preset, table, time_call
from opid_mega.kernels import build_fork_metadata, fork_attention_mask
from opid_mega.kernels.logprob import triton_chunk_columns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


def _ran(result, name, runs_as):
    rows = [m for c in result["cases"] for m in c["methods"] if m["name"] == name and m["runs_as"] == runs_as]
    assert rows, (name, runs_as)
    return rows


def test_logprob_tiny_schema_errors_and_peers():
    result = cli.run_op("logprob", "tiny", repeats=1, device="cpu", compile_peers=False, log=lambda s: None)
    assert result["op"] == "logprob" and result["model"]["vocab"] == 512
    assert set(result) >= {"machine", "versions", "load", "wall_s", "cases"}
    assert [c["name"] for c in result["cases"]] == ["fwd float32", "fwd+bwd float32", "fwd bfloat16",
                                                    "fwd+bwd bfloat16", "fwd+bwd float32 +entropy"]
    for case in result["cases"]:
        entropy = {"entropy": True} if case["name"].endswith("+entropy") else {}
        assert case["bound_s"] > 0 and case["shape"] == {"N": 32, "H": 64, "V": 512, **entropy}
        names = {m["name"] for m in case["methods"]}
        assert names == {"fused_logprobs", "naive full logits", "torch.compile(naive)", "Liger fused linear CE"}
        for m in case["methods"]:
            if "skipped" in m:
                assert m["skipped"] and "\n" not in m["skipped"]
                continue
            assert m["seconds_min"] <= m["seconds"] <= m["seconds_max"] and m["seconds_min"] > 0
            assert m["peak_bytes"] > 0 and m["ratio_to_bound"] > 0  # every call allocates its outputs at least
    # our torch path computes in float32 from the (bf16) inputs: float32-level error vs the float64 reference in
    # both dtypes; the naive bf16 path rounds its logits to bf16 first
    for m in _ran(result, "fused_logprobs", "torch path (chunked)"):
        assert m["error"]["logprob"] < 1e-5
        assert m["error"].get("grad_hidden_rel", 0) < 1e-2 and m["error"].get("grad_weight_rel", 0) < 1e-2
    naive = _ran(result, "naive full logits", "eager")
    assert naive[0]["error"]["logprob"] < 1e-5 and naive[2]["error"]["logprob"] > 1e-4
    # the entropy case: entropies (up to log 512 = 6.2) at float32 error, ours and the naive path; Liger has none
    ent = {(m["name"], m["runs_as"]): m for m in result["cases"][-1]["methods"]}
    for key in (("fused_logprobs", "torch path (chunked)"), ("naive full logits", "eager")):
        assert ent[key]["error"]["entropy"] < 1e-5 and ent[key]["error"]["grad_hidden_rel"] < 1e-2, key
    assert "no entropy" in ent[("Liger fused linear CE", "Triton interpreter")]["skipped"]


def test_divergence_tiny_errors():
    result = cli.run_op("divergence", "tiny", repeats=1, device="cpu", compile_peers=False, log=lambda s: None)
    for m in _ran(result, "dual_context_divergence", "torch path (chunked)"):
        assert max(m["error"][k] for k in ("kl_skill_orig", "kl_orig_skill", "logp_orig")) < 1e-5
        assert m["error"]["grad_hidden_rel"] < 1e-2
    # the top-k case (algo.delta=topk_kl): the same top-32 ids as the float64 reference, log-probs at float32 error
    [topk] = [c for c in result["cases"] if c["shape"].get("topk")]
    assert topk["name"].endswith("top-32") and topk["shape"]["topk"] == 32
    rows = {(m["name"], m["runs_as"]): m for m in topk["methods"]}
    for key in (("dual_context_divergence", "torch path (chunked)"), ("naive two full log-softmaxes", "eager")):
        err = rows[key]["error"]
        assert err["topk_ids_differ"] == 0 and max(err["topk_logp_skill"], err["topk_logp_orig"]) < 1e-5, key
    assert "no top-k" in rows[("Liger fused linear JSD (beta 0)", "Triton interpreter")]["skipped"]


@pytest.mark.parametrize("nbytes", [1 << 10, 3 << 20])
def test_the_peak_meter_sees_a_known_allocation(nbytes):
    """A torch tensor and a numpy array of known size, allocated and freed inside the block: the meter reads at
    least their size (the CPU allocator's and tracemalloc's running totals), and not much more."""
    import numpy as np

    with PeakMeter(CPU) as meter:
        t = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        del t
    assert nbytes <= meter.peak < nbytes + (1 << 16)
    with PeakMeter(CPU) as meter:
        a = np.ones(nbytes, dtype=np.uint8)
        del a
    assert nbytes <= meter.peak < nbytes + (1 << 16)
    with PeakMeter(CPU) as meter:  # thousands of profiled ops, one small tensor alive at a time: the meter's own
        x = torch.zeros(4)         # bookkeeping (the profiler's event tree) is not the call's memory
        for _ in range(2000):
            x = x + 1
    assert 0 < meter.peak < 1 << 16
    timed = time_call(lambda: torch.ones(nbytes, dtype=torch.uint8), CPU, repeats=5)
    assert nbytes <= timed["peak_bytes"] and timed["repeats"] == 5
    assert 0 < timed["seconds_min"] <= timed["seconds"] <= timed["seconds_max"]


def test_the_sdpa_peers_get_4d_inputs(monkeypatch):
    """SDPA's fused GPU kernels take [batch, heads, tokens, head_dim]: every peer call gets 4-D tensors."""
    calls = []
    real = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append((q.dim(), k.dim(), v.dim())) or real(q, k, v, **kw))
    case = fork_attention_cases(get_preset("tiny"), CPU, compile_peers=False)[0]
    for m in case.methods:
        if m.name.startswith(("per-sequence", "SDPA with")):
            calls.clear()
            case.error(m.call())
            assert calls and all(c == (4, 4, 4) for c in calls), (m.name, calls)


def test_roofline_of_the_heads_counts_each_launch():
    n, h, v, e, cols = 64, 32, 1000, 2, 256  # 4 chunks: 256, 256, 256, 232
    fwd = roofline.logprob_steps(n, h, v, e, cols, backward=False)
    assert sum(s.flops for s in fwd) == 2 * n * h * v
    # the weight is read once, the hidden rows once per chunk, the fp32 logits written and read once
    assert sum(s.bytes for s in fwd) == 4 * n * h * e + v * h * e + 8 * n * v
    for kept, recomputed in ((0, v), (1, v - 232), (4, 0)):
        both = roofline.logprob_steps(n, h, v, e, cols, backward=True, kept=kept)
        assert sum(s.flops for s in both) == 6 * n * h * v + 2 * n * h * recomputed, kept
    div = roofline.divergence_steps(n, h, v, e, cols, topk=0, backward=True, kept=1)
    assert sum(s.flops for s in div) == 4 * n * h * v + 4 * n * h * v + 4 * n * h * (v - 232)
    steps = [roofline.Step("compute-bound", 1e9, 1e3), roofline.Step("memory-bound", 1e3, 1e9, count=2)]
    pred = roofline.predict(steps, rate=1e12, bandwidth=1e11)  # 1 ms of compute, 2 x 10 ms of memory
    assert pred["bound_s"] == pytest.approx(0.021) and pred["limit"] == "memory"
    assert pred["compute_s"] == pytest.approx(1e-3) and pred["memory_s"] == pytest.approx(0.02)
    # the chunk plan: CHUNK_BYTES of fp32 logits, whole tiles, never past the shard
    assert triton_chunk_columns(4096, 152064) == 4096 and triton_chunk_columns(8192, 152064) == 2048
    assert triton_chunk_columns(1, 1000) == 1000 and triton_chunk_columns(10 ** 6, 152064) == 256


@pytest.mark.parametrize("block_m,block_n", [(1, 1), (4, 3), (16, 16)])
def test_fork_attention_tiles_cover_every_visible_pair(block_m, block_n):
    """The kernel's visited tiles (roofline.fork_attention_tiles) hold every (query, key) pair the fork rule lets
    attend; with 1 x 1 tiles they are exactly those pairs."""
    groups = [(5, [3, 4]), (0, [2]), (7, [])]
    bid = sum(([0] * p + [b + 1 for b, n in enumerate(br) for _ in range(n)] for p, br in groups), [])
    cu = torch.tensor([0] + list(torch.tensor([p + sum(br) for p, br in groups]).cumsum(0)), dtype=torch.int32)
    bid = torch.tensor(bid, dtype=torch.int32)
    meta = build_fork_metadata(cu, bid)
    args = (meta.cu_seqlens.tolist(), meta.prefix_end.tolist(), meta.seg_start.tolist())
    mask = fork_attention_mask(cu, bid)
    tiles = roofline.fork_attention_tiles(*args, block_m, block_n)
    if block_m == block_n == 1:
        assert tiles == int(mask.sum())
    visited = torch.zeros_like(mask)
    for g0, g1, p in zip(args[0][:-1], args[0][1:], args[1]):
        for m0 in range(g0, g1, block_m):
            q_hi = min(m0 + block_m, g1)
            for lo, hi in ((g0, min(p, q_hi)), (max(args[2][m0], p), q_hi)):
                for n0 in range(lo, hi, block_n):
                    visited[m0:q_hi, n0:min(n0 + block_n, hi)] = True
    assert not (mask & ~visited).any()
    steps = roofline.fork_attention_steps(*args, heads=4, kv_heads=2, head_dim=8, elt=2, block_m=block_m,
                                          block_n=block_n)
    assert steps[0].flops == 4 * block_m * block_n * 8 * 4 * tiles


def test_fork_attention_case_has_its_roofline_and_the_per_sequence_flops():
    result = cli.run_op("fork_attention", "tiny", repeats=1, device="cpu", compile_peers=False, log=lambda s: None)
    groups, prefix, branches, branch_tokens = get_preset("tiny").fork
    for case in result["cases"]:
        pairs = attended_pairs(groups, prefix, branches, branch_tokens)
        assert case["flop_ratio_per_sequence"] == pytest.approx(
            per_sequence_pairs(groups, prefix, branches, branch_tokens) / pairs, abs=1e-4) and pairs > 0
        rl = case["roofline"]
        assert rl["bound_s"] > 0 and rl["flops"] >= case["flops"] and rl["limit"] in ("compute", "memory")
        ours = [m for m in case["methods"] if m["role"] == "ours" and "seconds" in m]
        assert ours and all(m["ratio_to_roofline"] == pytest.approx(m["seconds"] / rl["bound_s"]) for m in ours)


def test_attended_pairs_counts_the_fork_mask():
    # 2 groups, prefix 5, 3 branches of 4: each group 5*6/2 + 3*(4*5 + 4*5/2) = 15 + 90 = 105 pairs
    cu, bid = fork_layout(2, 5, 3, 4, CPU)
    assert attended_pairs(2, 5, 3, 4) == 210 == int(fork_attention_mask(cu, bid).sum())


def test_fork_attention_matches_flexattention_with_the_same_mask():
    case = fork_attention_cases(get_preset("tiny"), CPU, compile_peers=False)[0]
    rows = {(m.name, m.runs_as): m for m in case.methods}
    ours = rows[("fork_attention", "torch path (SDPA per segment)")].call()
    flex = rows[("FlexAttention, fork block mask", "eager (unfused reference path)")].call()
    naive = rows[("per-sequence causal SDPA (naive scorer: prefix per branch)", "eager")].call()
    eps = torch.finfo(ours.dtype).eps
    assert (ours - flex).abs().max().item() < 64 * eps * flex.abs().max().item()
    assert case.error(ours)["out"] < 64 * eps and case.error(naive)["out"] < 64 * eps


def test_table_has_every_row_ratio_and_skip_reason():
    result = cli.run_op("fork_attention", "tiny", repeats=1, device="cpu", compile_peers=False,
                        log=lambda s: None)
    text = table(result)
    assert "skipped: --no-compile" in text and "FlexAttention, fork block mask" in text
    assert "torch path (SDPA per segment)" in text
    md = table(result, markdown=True)
    # one line per row, then one per case in the roofline table
    assert md.count("\n| fwd ") == sum(len(c["methods"]) + 1 for c in result["cases"])
    assert "| case | our configuration | GFLOP | MiB moved | roofline ms | limit |" in md


def test_report_regenerates_and_checks_markdown(tmp_path):
    result = cli.run_op("fork_attention", "tiny", repeats=1, device="cpu", compile_peers=False,
                        log=lambda s: None)
    run = tmp_path / "run"
    run.mkdir()
    (run / "fork_attention.json").write_text(json.dumps(result))
    doc = tmp_path / "perf.md"
    begin, end = cli.markers(str(run))
    assert (begin, end) == ("<!-- opid-bench tables: begin run -->", "<!-- opid-bench tables: end run -->")
    doc.write_text(f"intro\n{begin}\nold\n{end}\nafter\n")
    assert cli.report(str(run), str(doc), check=True) == 1
    assert cli.report(str(run), str(doc)) == 0
    assert cli.report(str(run), str(doc), check=True) == 0
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("after\n") and "FlexAttention" in text


BENCH_DIR = os.path.join(ROOT, "docs", "bench")
RUNS = sorted(d for d in os.listdir(BENCH_DIR) if os.path.isdir(os.path.join(BENCH_DIR, d))
              and any(f.endswith(".json") for f in os.listdir(os.path.join(BENCH_DIR, d))))


def test_every_committed_run_comes_from_one_invocation_with_five_repeats():
    """A committed run's JSONs: one opid-bench invocation each, at least 5 timed repeats per row (min, median,
    max), every row that ran with a peak above 0."""
    assert "ci" in RUNS
    for run in RUNS:
        for f in sorted(os.listdir(os.path.join(BENCH_DIR, run))):
            doc = json.load(open(os.path.join(BENCH_DIR, run, f)))
            assert doc["repeats"] >= 5, (run, f)
            for case in doc["cases"]:
                for m in case["methods"]:
                    if "seconds" in m:
                        assert m["repeats"] == doc["repeats"] and m["peak_bytes"] > 0, (run, f, m["name"])
                        assert m["seconds_min"] <= m["seconds"] <= m["seconds_max"], (run, f, m["name"])


@pytest.mark.parametrize("run", RUNS)
def test_committed_docs_tables_match_the_committed_run(run):
    assert cli.report(os.path.join(ROOT, "docs", "bench", run), os.path.join(ROOT, "docs", "performance.md"),
                      check=True) == 0


def test_cli_list_and_bad_input():
    out = subprocess.run([sys.executable, "-m", "opid_mega.bench.cli", "list"], capture_output=True, text=True)
    assert out.returncode == 0 and "fork_attention" in out.stdout and "7b" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "opid_mega.bench.cli", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown op 'nope'" in bad.stderr
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("70b")
    assert PRESETS["7b"].hidden == 3584 and PRESETS["7b"].tp == 1


@pytest.mark.parametrize("script,op", [("bench_logprob.py", "logprob"), ("bench_divergence.py", "divergence")])
def test_the_old_script_names_run_opid_bench(tmp_path, script, op):
    out = tmp_path / f"{op}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", script), "--preset", "tiny", "--no-compile",
                           "--repeats", "1", "--device", "cpu", "--json", str(out)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["op"] == op and res["preset"] == "tiny"
    ours = [m for c in res["cases"] for m in c["methods"] if m["role"] == "ours" and "skipped" not in m]
    assert ours and all(m["seconds"] > 0 and max(m["error"].values()) < 1e-2 for m in ours)

