"""tools/bench_batch_builder.py end to end on its CI preset: both backends agree (the tool exits otherwise), the
counts match the batch the preset implies and the JSON carries the figures the README quotes. Timings are reported,
never asserted."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("opid_mega._C", reason="C++ batch builder not built")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMINGS = ("python_s", "cpp_s", "speedup", "python_cpu_s", "cpp_cpu_s", "speedup_cpu", "fork_python_s", "fork_cpp_s",
           "fork_speedup", "fork_speedup_cpu")


def _tool():
    spec = importlib.util.spec_from_file_location("bench_batch_builder", os.path.join(ROOT, "tools",
                                                                                      "bench_batch_builder.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype,shapes", [("int32", ["alfworld", "search_qa"]), ("int64", ["alfworld"])])
def test_bench_batch_builder_ci_preset(tmp_path, dtype, shapes):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_batch_builder.py"), "--preset", "ci",
                        "--token-dtype", dtype, "--shapes", *shapes, "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert sorted(res) == sorted(shapes)
    bench = _tool()
    for name in shapes:
        row = res[name]
        # the JSON contract: every figure present; the timings finite floats (their values are not checked)
        assert set(row) == {"step_samples", "context_tokens", "scoring_tokens", "shared_fraction",
                            "scoring_micro_batches", *TIMINGS}, sorted(row)
        assert all(isinstance(row[k], float) and math.isfinite(row[k]) for k in TIMINGS), row
        # the counts the preset's batch implies (make_batch is seeded: the batch the tool built)
        tasks, trajs, steps = bench.CI_SHAPES[name][:3]
        ctx = bench.make_batch(bench.CI_SHAPES[name], "late", token_dtype=np.dtype(dtype))["contexts"]
        assert row["step_samples"] == tasks * trajs * steps == ctx.num_samples
        assert row["context_tokens"] == ctx.tokens.size
        # the fork layout computes each shared prefix once: the fraction saved is what its token count says
        assert row["shared_fraction"] == pytest.approx(1 - row["scoring_tokens"] / row["context_tokens"], abs=1e-4)
        assert 0.3 < row["shared_fraction"] < 0.5  # late placement shares most of each prompt
        assert row["scoring_micro_batches"] % 4 == 0  # --ranks 4 (the default): the same count on every rank
        assert f"{name:10s} samples=" in r.stdout
