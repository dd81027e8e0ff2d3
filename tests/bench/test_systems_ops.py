"""opid-bench's systems ops at the tiny preset, in this process (no torch.compile, one timed call): the C++ batch
builder vs numpy (advantages vs float64, packed arrays byte-identical), the weight transfer per sync method (the
engine process ends up with exactly the trainer's weights, never faster than one copy of the bytes), the env worker
(the same observations as in-process, a stuck step killed at its deadline); and the old tools/bench_* scripts run
opid-bench. Timings are checked for presence and sense (> 0, ratios consistent), never for speed."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from opid_mega.bench import cli, systems
from opid_mega.bench.core import get_preset, run_case, table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = torch.device("cpu")
TINY = get_preset("tiny")


def _rows(case: dict) -> dict:
    return {m["name"]: m for m in case["methods"]}


def _timed_row(case: dict, m: dict) -> None:
    assert "skipped" not in m, m
    assert m["seconds"] > 0 and m["peak_bytes"] > 0
    if case["bound_s"] is None:
        assert m["ratio_to_bound"] is None
    else:
        assert m["ratio_to_bound"] == pytest.approx(m["seconds"] / case["bound_s"])


def test_builder_tiny_cpp_matches_numpy_and_float64():
    pytest.importorskip("opid_mega._C", reason="C++ batch builder not built")
    result = cli.run_op("builder", "tiny", repeats=1, device="cpu", compile_peers=False, log=lambda s: None)
    assert result["op"] == "builder" and [c["name"] for c in result["cases"]] == [
        "iteration alfworld", "fork scoring batches alfworld"]
    shape = systems.BUILDER_PRESETS["tiny"][0]["alfworld"]
    ctx = systems.make_batch(shape)["contexts"]
    for case in result["cases"]:
        # the batch the preset implies; the fork layout computes each shared prefix once
        assert case["shape"]["step_samples"] == shape[0] * shape[1] * shape[2] == ctx.num_samples
        assert case["shape"]["context_tokens"] == ctx.tokens.size
        assert case["shared_fraction"] == pytest.approx(
            1 - case["shape"]["scoring_tokens"] / case["shape"]["context_tokens"], abs=1e-4)
        assert case["shared_fraction"] > 0.2
        assert case["scoring_micro_batches"] % case["shape"]["dp_ranks"] == 0
        # no FLOPs: the bound is writing the outputs once at the memcpy rate
        assert case["flops"] == 0 and case["bound_kind"] == "copy" and case["bound_s"] > 0
        rows = _rows(case)
        assert set(rows) == {"batch builder" if case["name"].startswith("iteration") else "build_fork_batches",
                             "numpy reference"}
        for m in case["methods"]:
            _timed_row(case, m)
            assert m["error"]["arrays_differ"] == 0  # byte-identical to the numpy path
    for m in result["cases"][0]["methods"]:
        # float64 arithmetic rounded to float32 once (|A| < 4 here): within float32's half ulp of the reference
        assert m["error"]["token_adv"] < 4 * 2 ** -24
        assert m["error"]["outcome_adv"] < 1e-12
    text = table(result)
    assert "C++ (opid_mega._C)" in text and "numpy + Python" in text and "arrays_differ 0.0e+00" in text


def test_builder_error_sees_a_wrong_advantage_and_a_wrong_token():
    case = systems.builder_cases(TINY, CPU)[0]
    numpy_row = next(m for m in case.methods if m.name == "numpy reference")
    res = numpy_row.call()
    assert case.error(res)["arrays_differ"] == 0
    res[1][3] += 1e-3  # one token advantage
    res[0].flat["tokens"][0] ^= 1  # one packed token id
    err = case.error(res)
    assert err["token_adv"] > 9e-4 and err["arrays_differ"] == 2


def test_weight_sync_tiny_every_method_delivers_the_weights():
    (case,) = systems.weight_sync_cases(TINY, CPU)
    shapes = systems.hf_shapes(TINY)
    nbytes = 2 * sum(int(np.prod(s)) for _, s in shapes)  # bf16
    assert case.shape["bytes"] == nbytes and case.shape["tensors"] == len(shapes) == 2 + 2 * 12
    # the presets' models: Qwen2.5-0.5B's 494,032,768 and Qwen2.5-7B's 7,615,616,512 parameters; ci syncs 4 layers
    params = lambda p, whole=True: sum(int(np.prod(s)) for _, s in systems.hf_shapes(get_preset(p), whole))  # noqa
    assert params("ci") == 494_032_768 and params("7b") == 7_615_616_512
    assert params("ci", whole=False) == 4 * 14_912_384
    # before any sync the engine holds zeros: the check sees the difference (and no bytes arrived)
    before = case.error(("tensor", 0))
    assert before["weights"] > 0.1 and before["bytes_missing"] == nbytes
    result = run_case(case, CPU, repeats=1, log=lambda s: None)
    assert result["bound_kind"] == "copy" and result["bound_s"] > 0
    rows = _rows(result)
    assert list(rows) == ["tensor", "tensor, inline bytes", "distributed", "disk"]
    assert [m["role"] for m in rows.values()] == ["ours"] * 4
    for m in rows.values():
        _timed_row(result, m)
        # after each method's syncs the engine (zeroed before) holds exactly the trainer's weights
        assert m["error"]["weights"] == 0 and m["error"]["bytes_missing"] == 0, m
        assert m["error"]["sums"] < 1e-9
        assert m["ratio_to_bound"] > 1  # no transfer beats one copy of its bytes


@pytest.mark.slow  # ~15 s: 3 spawned workers import TextWorld
def test_env_worker_tiny_same_observations_and_recovery():
    result = cli.run_op("env_worker", "tiny", repeats=1, device="cpu", compile_peers=False, log=lambda s: None)
    episodes, starts, stuck = result["cases"]
    assert episodes["shape"]["games"] == 2 and episodes["shape"]["steps"] >= 2
    assert episodes["worker_rss_bytes"] > 10 << 20
    assert list(_rows(episodes)) == ["worker process (default)", "in-process, thread deadline",
                                     "in-process, no deadline"]
    for case in (episodes, starts):
        assert case["bound_s"] is None  # simulator time: no bound
        for m in case["methods"]:
            _timed_row(case, m)
            assert m["error"] == {"obs_differ": 0}, m  # the worker plays the same games as in-process
    rows = _rows(stuck)
    ours = rows["worker process: killed at the deadline, reset in a fresh one"]
    _timed_row(stuck, ours)
    # the stuck step comes back at its deadline (not 60 s later), the reset after it plays the same game
    assert 0 <= ours["error"]["past_deadline_s"] < 5 and ours["error"]["obs_differ"] == 0
    assert ours["seconds"] >= systems.STUCK_DEADLINE_S
    assert "cannot recover" in rows["in-process, thread deadline"]["skipped"]
    assert "stuck step, then reset" in table(result)


def test_old_scripts_run_opid_bench(tmp_path):
    pytest.importorskip("opid_mega._C", reason="C++ batch builder not built")
    out = tmp_path / "builder.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_batch_builder.py"), "--preset", "tiny",
                        "--no-compile", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["op"] == "builder" and doc["preset"] == "tiny" and "numpy reference" in r.stdout
    for script in ("bench_weight_sync.py", "bench_env_process.py"):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", script), "--help"], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0 and "opid-bench" in r.stdout, r.stderr[-2000:]
