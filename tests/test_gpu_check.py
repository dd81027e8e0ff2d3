"""tools/gpu_check.sh --dry-run: the device check's plumbing on the CPU (TRITON_INTERPRET=1, tiny shapes, the same
stages, files and summary). Exit 0, at most 8 files come back, summary.json with budget_s <= 540 and a status for
every stage; the stages that ran report their figures."""
import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["env", "install", "kernel_tests", "bench_logprob", "bench_divergence", "rescoring", "ppo_step",
          "local_engine"]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), TMPDIR=str(tmp_path))
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), "--dry-run"], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-6000:], r.stderr[-3000:])
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and "summary.json" in files, files
    summary = json.loads((out / "summary.json").read_text())
    assert r.stdout.rstrip().endswith("}") and json.loads(r.stdout[r.stdout.rindex("\n{") + 1:]) == summary
    assert summary["dry_run"] is True and 0 < summary["budget_s"] <= 540
    assert summary["budget_s"] == sum(s["limit_s"] for s in summary["stages"])
    assert [s["name"] for s in summary["stages"]] == STAGES
    by = {s["name"]: s for s in summary["stages"]}
    for s in summary["stages"]:
        assert s["status"] in ("ok", "skipped"), s
        assert s["status"] == "ok" or s.get("reason"), s  # a skipped stage says why
    assert summary["bf16_matmul_tflops"] > 0 and summary["exit_status"] == 0
    for name in ("env", "kernel_tests", "bench_logprob", "bench_divergence"):
        assert by[name]["status"] == "ok", by[name]
    assert by["kernel_tests"]["figures"]["passed"] > 0 and by["kernel_tests"]["figures"]["failures"] == 0
    assert all(c["share_of_matmul"] is not None for c in by["bench_logprob"]["figures"].values())
    for name in ("rescoring", "ppo_step", "local_engine"):  # megatron-core is installed here: they run
        assert by[name]["status"] == "ok", by[name]
    assert by["ppo_step"]["figures"]["tokens"] > 0 and by["ppo_step"]["figures"]["attention_backend"]
    assert by["local_engine"]["figures"]["engine_vs_trainer_max_abs"] < 1e-3  # fp32 on the CPU
    assert all(c["max_abs_diff"] < 1e-3 for c in by["rescoring"]["figures"]["cases"])
    print(json.dumps({s["name"]: [s["status"], s["seconds"]] for s in summary["stages"]}))


def test_gpu_check_budget_and_files_are_declared_within_the_device_limits():
    text = open(os.path.join(ROOT, "tools", "gpu_check.sh")).read()
    limits = text.split("LIMITS=(", 1)[1].split(")", 1)[0].split()
    assert [x.split(":")[0] for x in limits] == STAGES
    assert sum(int(x.split(":")[1]) for x in limits) <= 540
    assert "python " not in text.replace("python3", "") and "pip install -q" not in text  # python3, offline
    assert "--no-index" in text
