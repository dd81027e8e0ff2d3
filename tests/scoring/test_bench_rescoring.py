"""The FLOP bound of tools/bench_rescoring.py, and the tool end to end (slow)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tolerance import tolerance_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("bench_rescoring", os.path.join(ROOT, "tools", "bench_rescoring.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_linear_only_bound_is_the_token_ratio():
    dims = dict(hidden=64, layers=2, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=0)
    P, S, T, R = 300, 40, 25, 90
    naive, fork = bench.flops(dims, [P + T + R, P + S + T + R], [(P, [S + T + R, T + R])], resp_rows=2 * R)
    # Remove the attention part by computing it separately: attention-free model (head_dim scaling) check.
    attn = dims["layers"] * 4 * dims["heads"] * dims["head_dim"]
    c = lambda n, o=0: n * o + n * (n + 1) // 2  # noqa: E731
    lin_n = naive - attn * (c(P + T + R) + c(P + S + T + R))
    lin_f = fork - attn * (c(P) + c(S + T + R, P) + c(T + R, P))
    assert lin_n / lin_f == pytest.approx((2 * (P + T + R) + S) / (P + S + 2 * T + 2 * R))
    # Attention of the fork never exceeds the naive passes' attention, and the bound is > 1.
    assert naive > fork


@pytest.mark.slow
def test_bench_rescoring_ci_preset(tmp_path):
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_rescoring.py"), "--preset", "ci",
                        "--json", str(out)], capture_output=True, text=True, timeout=300, env=env)
    errors = "\n".join(line for line in r.stderr.splitlines() if "warn" not in line.lower())
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{errors[-3000:]}"
    res = json.loads(out.read_text())
    assert {c["placement"] for c in res["cases"]} == {"late", "faithful"}
    for c in res["cases"]:
        # fork and naive scoring agree within fp32 rounding of the log-probs' magnitude (fp32 on the CPU)
        assert c["max_abs_diff"] <= tolerance_for(0.0, scale=c["logprob_scale"]), (c["max_abs_diff"],
                                                                                    c["logprob_scale"])
        # the FLOP bound, recomputed here from the model's dimensions and the case's shape
        P, S, T, R, n = c["P"], c["S"], c["T"], c["R"], c["samples"]
        naive, fork = bench.flops(res["model"], [P + T + R, P + S + T + R] * n, [(P, [S + T + R, T + R])] * n,
                                  resp_rows=2 * R * n)
        assert c["bound_speedup"] == pytest.approx(naive / fork, abs=1e-4) and naive > fork
        assert c["fork_tokens"] == c["P"] + c["S"] + 2 * c["T"] + 2 * c["R"]
        assert c["naive_tokens"] == 2 * (c["P"] + c["T"] + c["R"]) + c["S"]
