"""tools/gpu_check.sh --dry-run: the device check's plumbing on the CPU (TRITON_INTERPRET=1, tiny shapes, the same
stages, files and summary). Exit 0, at most 8 files come back, summary.json with budget_s <= 540 and a status for
every stage; the stages that ran report their figures."""
import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["env", "install", "kernel_tests", "bench_logprob", "bench_divergence", "bench_fork_attention", "rescoring",
          "delta_noise", "ppo_step", "local_engine"]


def _limits():
    text = open(os.path.join(ROOT, "tools", "gpu_check.sh")).read()
    return [(x.split(":")[0], int(x.split(":")[1])) for x in text.split("LIMITS=(", 1)[1].split(")", 1)[0].split()]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), TMPDIR=str(tmp_path))
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), "--dry-run"], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-6000:], r.stderr[-3000:])
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench.tar.gz", "local_engine.json", "ppo_step.json", "stages.log", "summary.json"], files
    summary = json.loads((out / "summary.json").read_text())
    assert r.stdout.rstrip().endswith("}") and json.loads(r.stdout[r.stdout.rindex("\n{") + 1:]) == summary
    assert summary["dry_run"] is True and 0 < summary["budget_s"] <= 540
    assert summary["budget_s"] == sum(s["limit_s"] for s in summary["stages"])
    assert [s["name"] for s in summary["stages"]] == STAGES
    by = {s["name"]: s for s in summary["stages"]}
    for s in summary["stages"]:
        assert s["status"] in ("ok", "skipped"), s
        assert s["status"] == "ok" or s.get("reason"), s  # a skipped stage says why
        if s["status"] == "ok":  # its own limit at least (less only by the script's own seconds between stages)
            assert s["given_s"] >= s["limit_s"] - 5 and s["seconds"] <= s["given_s"] + 10, s
    assert summary["bf16_matmul_tflops"] > 0 and summary["exit_status"] == 0
    for name in ("env", "kernel_tests", "bench_logprob", "bench_divergence", "bench_fork_attention"):
        assert by[name]["status"] == "ok", by[name]
    assert by["kernel_tests"]["figures"]["passed"] > 0 and by["kernel_tests"]["figures"]["failures"] == 0
    for name in ("bench_logprob", "bench_divergence", "bench_fork_attention"):  # opid-bench's rows, read back
        assert list(by[name]["figures"]) == ["tiny"], name  # per preset
        cases = by[name]["figures"]["tiny"].values()
        assert cases and all(c["share_of_matmul"] is not None and c["max_error"] is not None for c in cases), name
        peers = [v for c in cases for v in c.values() if isinstance(v, dict)]
        assert any(v.get("speed_ratio") for v in peers) and all(v.get("speed_ratio") or v.get("skipped") for v in peers)
    # every opid-bench JSON of the run in one archive, one folder, 5 timed repeats per row; the targets read from them
    with tarfile.open(out / "bench.tar.gz") as tar:
        names = sorted(tar.getnames())
        docs = [json.load(tar.extractfile(n)) for n in names if n.endswith(".json")]
    assert summary["run"] == "dry_run" and names[0] == "dry_run"
    assert sorted(f"{d['op']}_{d['preset']}" for d in docs) == [
        "delta_noise_tiny", "divergence_tiny", "fork_attention_tiny", "logprob_tiny", "rescoring_tiny"]
    assert all(d["repeats"] == 5 for d in docs)
    checks = {(t["op"], t["case"], t["check"]) for t in summary["targets"]}
    assert ("logprob", "fwd bfloat16", "share_of_matmul_at_least_0.6") in checks and len(checks) == 8
    assert all(t["met"] in (True, False, None) for t in summary["targets"])
    if by["install"]["status"] == "ok":  # gpu_wheels/ is there: the package still comes from the checkout
        assert by["install"]["figures"]["opid_mega.kernels"].endswith(os.path.join("opid_mega", "kernels",
                                                                                   "__init__.py"))
    for name in ("rescoring", "delta_noise", "ppo_step", "local_engine"):  # megatron-core is installed here: they run
        assert by[name]["status"] == "ok", by[name]
    assert by["ppo_step"]["figures"]["tokens"] > 0 and by["ppo_step"]["figures"]["attention_backend"]
    eng = by["local_engine"]["figures"]
    assert eng["dtype"] == "float32" and eng["reference_dtype"] == "float64"
    for k in ("engine_vs_reference_max_abs", "trainer_vs_reference_max_abs", "engine_vs_trainer_max_abs"):
        assert eng[k] < 1e-4, (k, eng)  # fp32 against fp64 on the CPU
    resc = by["rescoring"]["figures"]["tiny"].values()  # opid-bench rows: the fp32 model on the CPU against float64
    assert resc and all(c["max_error"] < 1e-3 and c["share_of_matmul"] is not None and c["bound_speedup"] > 1
                        for c in resc), resc
    assert all(v.get("speed_ratio") for c in resc for v in c.values() if isinstance(v, dict))  # the naive scorer
    log = (out / "stages.log").read_text()
    assert "Apex is not installed" not in log and "destroy_process_group" not in log
    print(json.dumps({s["name"]: [s["status"], s["seconds"]] for s in summary["stages"]}))


def test_gpu_check_budget_and_install_are_declared_within_the_device_limits():
    limits = _limits()
    assert [n for n, _ in limits] == STAGES
    assert sum(s for _, s in limits) <= 540
    text = open(os.path.join(ROOT, "tools", "gpu_check.sh")).read()
    assert "python " not in text.replace("python3", "") and "pip install -q" not in text  # python3, offline
    # the wheels go with --no-deps onto a directory already on PYTHONPATH; the package itself is never installed
    assert "--no-index --no-deps" in text and '--target "$WORK/site"' in text
    assert 'export PYTHONPATH="$SRC:$WORK/site' in text
    assert " -e " not in text and "--editable" not in text
    # the model stages name their packages among their needs: without them, they are skipped with the reason
    assert "stage rescoring megatron.core bench_rescoring\n" in text


def test_missing_names_modules_and_the_tokenizer(tmp_path):
    tool = os.path.join(ROOT, "tools", "gpu_check.py")

    def missing(names, **env):
        run_env = {k: v for k, v in os.environ.items() if k != "OPID_QWEN_TOKENIZER_DIR"}
        run_env.update(env)
        r = subprocess.run([sys.executable, tool, "missing", names], env=run_env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert missing("json,no_such_module_xyz") == "no_such_module_xyz"
    assert missing("qwen_tokenizer", OPID_QWEN_TOKENIZER_DIR=str(tmp_path)) == "qwen_tokenizer"  # no tokenizer.json
    (tmp_path / "tokenizer.json").write_text("{}")
    assert missing("qwen_tokenizer,json", OPID_QWEN_TOKENIZER_DIR=str(tmp_path)) == ""


def test_an_unknown_argument_is_refused_with_one_line():
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), "--dryrun"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "usage: bash tools/gpu_check.sh [--dry-run]"


def test_without_a_cuda_device_every_later_stage_is_skipped_with_the_reason(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), TMPDIR=str(tmp_path), CUDA_VISIBLE_DEVICES="",
               GPU_WHEELS=str(tmp_path / "no_wheels"))
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh")], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == ["env"] and summary["exit_status"] == 1
    assert [(s["name"], s["status"]) for s in summary["stages"]] == [("env", "failed")] + [
        (n, "skipped") for n in STAGES[1:]]
    assert all(s["reason"] == "no CUDA device (see the env stage)" for s in summary["stages"][1:])
    assert summary["stages"][0]["figures"]["cuda_available"] is False


def test_the_pytest_stage_refuses_a_package_that_is_not_the_checks(tmp_path):
    """The kernel tests must import opid_mega.kernels from the check's PYTHONPATH (the checkout linked, kernels/ as
    opid_mega.kernels), never from somewhere else."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "pytest", "--version"],
                       env=dict(os.environ, GPU_CHECK_SRC=str(tmp_path)), cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("gpu_check: opid_mega.kernels comes from "), r.stderr
    assert r.stderr.rstrip().endswith(f"not from the check's {tmp_path}")


def test_only_the_selected_stages_run(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), TMPDIR=str(tmp_path), GPU_CHECK_ONLY="env,bench_divergence")
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), "--dry-run"], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    status = {s["name"]: (s["status"], s.get("reason")) for s in summary["stages"]}
    assert status["env"][0] == "ok" and status["bench_divergence"][0] == "ok"
    others = [n for n in STAGES if n not in ("env", "bench_divergence", "install")]
    assert all(status[n] == ("skipped", "not in GPU_CHECK_ONLY=env,bench_divergence") for n in others), status
    assert status["install"][0] == "skipped"  # not selected (or no wheels): either way it says why
    assert sorted(p.name for p in out.iterdir()) == ["bench.tar.gz", "stages.log", "summary.json"]


def _model_stages():
    import importlib.util

    path = os.path.join(ROOT, "tools", "gpu_model_stages.py")
    spec = importlib.util.spec_from_file_location("gpu_model_stages", path)
    stages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stages)
    return stages


def test_the_ppo_step_counts_the_head_on_the_scored_rows_only():
    """Model FLOPs of a PPO step: 3 x the forward, every token through the layers (linear layers, causal attention),
    the LM head on the response rows only -- not 6 x all parameters x all tokens."""
    stages = _model_stages()
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    S, P, R, V = 3, 20, 5, stages.VOCAB
    h, f, L, hq, hkv, d = 64, 128, 2, 4, 2, 16
    linear = L * (2 * h * (hq + 2 * hkv) * d + 2 * hq * d * h + 6 * h * f)
    n = P + R
    forward = S * (linear * n + L * 4 * hq * d * n * (n + 1) // 2) + 2 * h * V * S * R
    assert stages.ppo_flops(shape, S, P, R) == 3 * forward
    # the head on every token would add 2 x 3 x h x V x S x P: the prompt rows are never scored
    assert stages.ppo_flops(shape, S, P + 10, R) - stages.ppo_flops(shape, S, P, R) < 2 * 3 * h * V * S * 10
    big = stages.SIZES["gpu"][0]
    params = 697_077_760  # the GPU check's random Qwen3 (tied embeddings)
    assert stages.ppo_flops(big, 16, 512, 256) < 0.75 * 6 * params * 16 * (512 + 256)


def test_the_check_s_random_bf16_model_keeps_exact_rope_frequencies():
    """Qwen3ForCausalLM(config).to(bf16) rounds the rotary inv_freq buffer to bf16 (HF's from_pretrained(dtype=...)
    keeps it fp32): the engine and the reference built from such a model would both carry a position-growing phase
    error the trainer's exact RoPE has not, and the engine stage would report that as the trainer's error."""
    import torch

    stages = _model_stages()
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    model = stages.random_qwen3(shape, "bfloat16")
    inv = model.model.rotary_emb.inv_freq
    exact = [1.0 / 10000.0 ** (2 * i / 16) for i in range(8)]  # base 10000 (Qwen3Config's default), head_dim 16
    assert inv.dtype == torch.float32
    assert torch.allclose(inv.double(), torch.tensor(exact, dtype=torch.float64), rtol=1e-6, atol=0)
    assert next(model.parameters()).dtype == torch.bfloat16
