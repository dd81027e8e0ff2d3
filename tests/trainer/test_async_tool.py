"""tools/bench_async.py on a tiny budget: GRPO, then OPID against the hosted-analyzer stand-in, each row its own
opid-train run; the rows say what ran (staleness measured from the metrics, the deployment) and what it cost."""
import json
import os
import subprocess
import sys

import pytest

from .conftest import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_bench_async_rows_on_a_tiny_budget(tmp_path):
    out = tmp_path / "bench.json"
    tiny = [a for a in TINY if not a.startswith(("train.iterations=", "train.save_interval="))]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_async.py"), "--iterations", "4",
                        "--latencies", "0.5", "--staleness", "0", "1", "--modes", "colocated", "disaggregated",
                        "--json", str(out), *tiny], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["grpo"]["staleness"] == 0 and res["grpo"]["iteration_s"] > 0
    rows = [(x["max_staleness"], x["mode"], x["staleness"], x["latency_s"]) for x in res["opid"]]
    assert rows == [(0, "colocated", 0, 0.5), (1, "colocated", 1, 0.5), (1, "disaggregated", 1, 0.5)]
    for x in res["opid"]:
        assert x["ratio_to_grpo"] == pytest.approx(x["iteration_s"] / res["grpo"]["iteration_s"])
    # on-policy, every iteration waits for its replies (at least one reply's latency); the table says so
    assert res["opid"][0]["analysis_wait_s"] > 0.2
    assert "| 0.5 s (0.5 s) | 1 | disaggregated |" in r.stdout


def test_baseline_of_another_config_is_refused(tmp_path):
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps({"config": os.path.join(ROOT, "configs", "smollm2_textworld_quick.yaml"),
                                "grpo": {"iteration_s": 1.0, "iterations_s": [1.0], "rollout_s": 0.5}}))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_async.py"), "--baseline", str(prev),
                        "--latencies", "1", "--staleness", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and f"--baseline {prev} holds no GRPO run of" in r.stderr and "tiny_cpu.yaml" in r.stderr
