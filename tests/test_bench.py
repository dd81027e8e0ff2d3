"""opid-bench: the schema, the float64 errors, the fork-attention peer, the table and the generated docs tables.
Tiny preset, no torch.compile peers (their compile time), in-process: seconds."""
import json
import os
import subprocess
import sys

import pytest
import torch

from opid_mega.bench import cli
from opid_mega.bench.attention import attended_pairs, fork_attention_cases, fork_layout
from opid_mega.bench.core import PRESETS, get_preset, table
from opid_mega.kernels import fork_attention_mask

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
            assert m["seconds"] > 0 and m["peak_bytes"] >= 0 and m["ratio_to_bound"] > 0
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
    assert md.count("\n| fwd ") == sum(len(c["methods"]) for c in result["cases"])


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


@pytest.mark.parametrize("run", ["ci", "gpu_h200"])
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
                           "--device", "cpu", "--json", str(out)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["op"] == op and res["preset"] == "tiny"
    ours = [m for c in res["cases"] for m in c["methods"] if m["role"] == "ours" and "skipped" not in m]
    assert ours and all(m["seconds"] > 0 and max(m["error"].values()) < 1e-2 for m in ours)

