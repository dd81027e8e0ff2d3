"""tools/bench_batch_builder.py end to end on its CI preset: both backends agree (the tool exits otherwise) and the
JSON carries the figures the README quotes. Timings are reported, never asserted."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("opid_mega._C", reason="C++ batch builder not built")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("dtype,shapes", [("int32", ["alfworld", "search_qa"]), ("int64", ["alfworld"])])
def test_bench_batch_builder_ci_preset(tmp_path, dtype, shapes):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_batch_builder.py"), "--preset", "ci",
                        "--token-dtype", dtype, "--shapes", *shapes, "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert sorted(res) == sorted(shapes)
    for name in shapes:
        row = res[name]
        assert row["python_s"] > 0 and row["cpp_s"] > 0
        assert row["speedup"] == pytest.approx(row["python_s"] / row["cpp_s"], rel=0.02)
        assert 0.3 < row["shared_fraction"] < 0.5  # late placement shares most of each prompt
        assert row["scoring_tokens"] < row["context_tokens"]
        assert f"{name:10s} samples=" in r.stdout
