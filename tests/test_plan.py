"""opid-plan (opid_mega/plan.py): parameter counts against transformers, memory against a real Megatron policy on CPU,
bad layouts, a fuzz of the layout inputs, and every shipped config."""
import glob
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

from opid_mega import plan as P
from opid_mega.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")) + glob.glob(os.path.join(ROOT, "configs", "cluster",
                                                                                              "*.yaml")))
C7 = os.path.join(ROOT, "configs", "cluster", "qwen2.5-7b_alfworld_2x8_disaggregated.yaml")
PUBLISHED = {"Qwen2.5-7B-Instruct": 7_615_616_512, "Qwen2.5-3B-Instruct": 3_085_938_688}


def run_plan(capsys, *argv):
    rc = P.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def plan_json(capsys, *argv):
    rc, out, err = run_plan(capsys, *argv, "--json")
    assert rc in (0, 1), err
    res = json.loads(out)
    assert res["ok"] == (res["errors"] == []) and rc == (0 if res["ok"] else 1)
    return res


# ------------------------------------------------------------------------------------------------ parameter counts
def _meta_count(hf_dict, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf_dict))
    cfg = AutoConfig.from_pretrained(str(d))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@pytest.mark.parametrize("name", P.shipped_configs())
def test_param_count_of_every_shipped_config_equals_transformers(name, tmp_path):
    hf, source = P.resolve_hf_config(f"models/{name}", "model.path")
    assert source.startswith("shipped")
    n = P.param_count(P.arch_facts(hf, name))
    assert n == _meta_count(hf, tmp_path)
    if name in PUBLISHED:
        assert n == PUBLISHED[name]


@pytest.mark.parametrize("builtin", ["tiny-qwen3", "tiny-qwen2", "tiny-llama", "tiny-qwen3-footprints"])
def test_param_count_of_builtin_models_equals_transformers(builtin, tmp_path):
    hf, _ = P.builtin_hf_config(builtin)
    assert P.param_count(P.arch_facts(hf, builtin)) == _meta_count(hf, tmp_path)


def test_shipped_configs_are_the_ones_promised_and_agree_with_arch_of():
    from transformers import AutoConfig

    from opid_mega.megatron.model import arch_of

    assert {"Qwen2.5-3B-Instruct", "Qwen2.5-7B-Instruct", "Qwen3-1.7B", "Qwen2.5-32B-Instruct"} <= set(P.shipped_configs())
    for name in P.shipped_configs():
        hf, _ = P.resolve_hf_config(name, "model.path")
        a, ref = P.arch_facts(hf, name), arch_of(AutoConfig.for_model(**hf))
        for k in ("hidden", "ffn", "layers", "heads", "kv_heads", "head_dim", "vocab", "tied", "qkv_bias", "qk_norm"):
            assert a[k] == ref[k], (name, k)


def test_model_path_with_its_own_config_json_wins_over_the_shipped_copy(tmp_path, capsys):
    d = tmp_path / "Qwen2.5-7B-Instruct"
    d.mkdir()
    hf, _ = P.resolve_hf_config("Qwen2.5-7B-Instruct", "model.path")
    (d / "config.json").write_text(json.dumps(dict(hf, num_hidden_layers=14)))
    res = plan_json(capsys, "--config", C7, f"model.path={d}")
    assert res["config"]["hf_config"] == str(d / "config.json")
    assert res["params_total"] < PUBLISHED["Qwen2.5-7B-Instruct"]
    rc, out, err = run_plan(capsys, "--config", C7, "model.path=models/No-Such-Model")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "model.path" in err


# ------------------------------------------------------------------------------------------------ memory vs Megatron
def _measure(cfg, hf_dir):
    parts = _measure_parts(cfg, hf_dir)
    return parts["weights"], parts["grads"], parts["moments"] + parts["master"]


def _measure_parts(cfg, hf_dir):
    """Bytes a real Policy holds after one optimizer step: weights, DDP grad buffer, Adam moments, fp32 master."""
    from opid_mega.megatron.logprobs import Sample
    from opid_mega.megatron.policy import Policy
    from opid_mega.megatron.logprobs import plain_batches
    from opid_mega.megatron.train_step import train_mini_batch

    pol = Policy(cfg, hf_dir)
    toks = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    s = Sample(toks, 20, old_logprobs=[-1.0] * 20, advantages=[0.5] * 20, ref_logprobs=[-1.0] * 20)
    m = train_mini_batch(pol.ddp, pol.optimizer, plain_batches([s], 1024).batches, pol.loss_cfg)
    assert m["update_ok"] == 1.0
    params = [p for c in pol.chunks for p in c.parameters()]
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for d in pol.ddp for b in d.buffers)
    moments = main = 0
    for o in getattr(pol.optimizer, "chained_optimizers", [pol.optimizer]):
        for st in o.optimizer.state.values():
            moments += sum(st[k].numel() * st[k].element_size() for k in ("exp_avg", "exp_avg_sq"))
        for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            main += sum(p.numel() * p.element_size() for g in getattr(o, attr, []) for p in g)
    return dict(weights=weights, grads=grads, moments=moments, master=main)


def test_memory_of_weights_grads_and_optimizer_matches_a_real_megatron_policy_on_cpu(capsys):
    """One process, world size 1: the tiny built-in Qwen3 as the trainer's Policy (megatron DDP + optimizer), one
    optimizer step; then the planner on the same config with one GPU. fp32 without the distributed optimizer: exact.
    bf16 with the distributed optimizer: the weights and optimizer state exact, the grad buffer within 0.01 %: megatron
    pads the distributed optimizer's buffer (to a multiple of 128 elements x DP) and the planner counts parameters."""
    from opid_mega.megatron import parallel
    from opid_mega.models import prepare_model

    hf_dir = str(prepare_model("tiny-qwen3"))
    tiny = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
    cases = [(["model.dtype=float32", "train.distributed_optimizer=false"], 0.0),
             (["model.dtype=bfloat16", "train.distributed_optimizer=true"], 1e-4)]
    try:
        for over, tol in cases:
            over = over + ["deploy.gpus_per_node=1"]
            measured = _measure(load_config(tiny, over), hf_dir)
            parallel.destroy_all()
            res = plan_json(capsys, "--config", tiny, *over)
            assert res["layout"]["world"] == 1 and res["layout"]["dp"] == 1
            m = res["memory"]
            planned = (m["weights_bytes"], m["grads_bytes"], m["optimizer_bytes"])
            for name, got, want in zip(("weights", "grads", "optimizer"), measured, planned):
                assert abs(got - want) <= tol * want, (over, name, got, want)
                assert got >= want  # padding only ever adds
    finally:
        parallel.destroy_all()


def test_colocated_rollout_memory_and_sglang_kv_from_free_memory_match_a_real_policy(capsys):
    """Colocated, one GPU shared by the trainer and its rollout server: during rollout only Adam's moments leave the
    GPU (Colocation moves the torch optimizer's state); the weights, the DDP grad buffer and the fp32 master weights
    (the optimizer's parameters, sharded over DP with the distributed optimizer) stay. SGLang 0.5.23 sizes its pool
    as --mem-fraction-static x the memory free at its start (the trainer's resident bytes already taken), so the KV
    cache is that pool minus the served weights. Measured on a real Policy, bf16 + distributed optimizer (master
    weights exist) and fp32 (none: the weights are the master)."""
    from opid_mega.megatron import parallel
    from opid_mega.models import prepare_model

    hf_dir = str(prepare_model("tiny-qwen3"))
    tiny = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
    gib, frac = 2.0, 0.5
    a = P.arch_facts(P.builtin_hf_config("tiny-qwen3")[0])
    try:
        for dtype, distopt, offload, e in (("bfloat16", "true", "true", 2), ("float32", "false", "true", 4),
                                            ("bfloat16", "true", "false", 2)):
            over = [f"model.dtype={dtype}", f"train.distributed_optimizer={distopt}", "deploy.gpus_per_node=1",
                    "deploy.mode=colocated", "rollout.engine=sglang", "deploy.rollout_servers_per_node=1",
                    f"deploy.rollout_mem_fraction={frac}", f"deploy.offload_optimizer={offload}"]
            got = _measure_parts(load_config(tiny, over), hf_dir)
            parallel.destroy_all()
            m = plan_json(capsys, "--config", tiny, *over, "--gpu-mem-gib", str(gib))["memory"]
            assert (dtype == "float32") == (got["master"] == 0)
            assert m["master_bytes"] == got["master"] and m["moments_bytes"] == got["moments"], (over, m, got)
            resident = got["weights"] + got["grads"] + got["master"] + (0 if offload == "true" else got["moments"])
            # the grad buffer is padded by the distributed optimizer (< 0.01 %); the planner counts parameters
            assert resident * (1 - 1e-4) <= m["resident_in_rollout_bytes"] <= resident, (over, m, resident)
            free = gib * 2 ** 30 - m["resident_in_rollout_bytes"]
            assert m["sglang_free_at_start_bytes"] == int(free)
            assert m["sglang_pool_bytes"] == int(frac * free)
            assert m["sglang_kv_bytes"] == int(frac * free - P.param_count(a) * e)
            assert m["sglang_kv_tokens"] == int((frac * free - P.param_count(a) * e) // P.kv_bytes_per_token(a, 1, e))
            (g0,) = m["per_gpu"]
            assert abs(g0["rollout_phase_gib"] - (m["resident_in_rollout_bytes"] + frac * free) / 2 ** 30) < 0.01
    finally:
        parallel.destroy_all()


def test_colocated_servers_get_less_than_a_fraction_of_the_whole_gpu(capsys):
    """The 7B TP2 DP6 colocated config: ~2.5 GB of fp32 master weights per rank stay during rollout, and the servers'
    KV cache is a fraction of the memory left free by the trainer, not of the whole GPU."""
    co = os.path.join(ROOT, "configs", "cluster", "qwen2.5-7b_alfworld_2x8_colocated.yaml")
    res = plan_json(capsys, "--config", co)
    m, lay = res["memory"], res["layout"]
    assert (lay["tp"], lay["dp"]) == (2, 6) and res["ok"]
    assert 2.3e9 < m["master_bytes"] < 2.6e9  # P / DP x 4 B
    assert m["resident_in_rollout_bytes"] == m["weights_bytes"] + m["grads_bytes"] + m["master_bytes"]
    free = 80 * 2 ** 30 - m["resident_in_rollout_bytes"]
    frac = load_config(co).deploy.rollout_mem_fraction
    assert m["sglang_pool_bytes"] == int(frac * free) < frac * 80 * 2 ** 30
    dis = plan_json(capsys, "--config", co, "deploy.offload_optimizer=false")["memory"]
    assert dis["resident_in_rollout_bytes"] == m["resident_in_rollout_bytes"] + m["moments_bytes"]
    assert dis["sglang_kv_bytes"] < m["sglang_kv_bytes"]


def _rank_worker(tiny, over, hf_dir, out_dir):
    """One rank of a multi-rank run: the trainer's Policy, one optimizer step, this rank's measured bytes."""
    from megatron.core import parallel_state as ps

    from opid_mega.megatron import parallel

    try:
        weights, grads, opt = _measure(load_config(tiny, over), hf_dir)
        rank = dict(tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                    dp=ps.get_data_parallel_rank(), weights=weights, grads=grads, optimizer=opt)
        with open(os.path.join(out_dir, f"{torch.distributed.get_rank()}.json"), "w") as f:
            json.dump(rank, f)
    finally:
        parallel.destroy()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.pp=2"],
                                    ["parallel.tp=1", "parallel.pp=2", "train.distributed_optimizer=true"]],
                         ids=["tp2pp2", "pp2dp2-distopt"])
def test_per_rank_memory_matches_megatron_on_4_cpu_ranks(capsys, tmp_path, layout):
    """4 gloo ranks: every rank's measured weights / grads / optimizer bytes against the planner's numbers for its
    pipeline stage (the tiny Qwen3 ties its embeddings: with PP the last stage holds its own output-layer copy).
    Tolerance 0.01 % on grads and optimizer for the distributed optimizer's padding (see the test above)."""
    from opid_mega.megatron import parallel
    from opid_mega.models import prepare_model

    hf_dir = str(prepare_model("tiny-qwen3"))
    tiny = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
    over = ["model.dtype=bfloat16", "deploy.gpus_per_node=4", *layout]
    parallel.spawn(4, _rank_worker, tiny, over, hf_dir, str(tmp_path), timeout_s=300)
    ranks = [json.load(open(tmp_path / f"{r}.json")) for r in range(4)]
    res = plan_json(capsys, "--config", tiny, *over)
    a = P.arch_facts(P.builtin_hf_config("tiny-qwen3")[0])
    lay = res["layout"]
    stages = P.rank_params(a, lay["tp"], lay["pp"])["stages"]
    assert res["memory"]["params_rank"] == max(stages)
    sharded = "train.distributed_optimizer=true" in layout
    for r in ranks:
        n = stages[r["pp"]]
        opt = 12 * (-(-n // lay["dp"]) if sharded else n)
        assert r["weights"] == 2 * n, r
        assert 4 * n <= r["grads"] <= 4 * n * (1 + 1e-4), r
        assert abs(r["optimizer"] - opt) <= 1e-4 * opt, (r, opt)


def test_optimizer_sharding_and_recompute_shrink_memory(capsys):
    base = plan_json(capsys, "--config", C7, "train.distributed_optimizer=false")
    m = base["memory"]
    assert m["optimizer_gib"] == m["optimizer_unsharded_gib"] > m["optimizer_sharded_gib"]
    dp = base["layout"]["dp"]
    assert abs(m["optimizer_sharded_gib"] * dp - m["optimizer_unsharded_gib"]) < 0.01
    assert m["activations_none_gib"] >= m["activations_selective_gib"] > m["activations_full_gib"]
    full = plan_json(capsys, "--config", C7, "train.recompute=full")
    assert full["memory"]["activations_gib"] == m["activations_full_gib"]
    sp = plan_json(capsys, "--config", C7, "parallel.sequence_parallel=true")
    assert sp["memory"]["activations_none_gib"] < m["activations_none_gib"]
    doubled = plan_json(capsys, "--config", C7, "train.micro_batch_tokens=16384")
    assert doubled["memory"]["activations_none_gib"] > 1.9 * m["activations_none_gib"] - 1


# ------------------------------------------------------------------------------------------------ bad layouts
@pytest.mark.parametrize("over,key,words", [
    (["parallel.tp=3"], "parallel.tp", "attention heads"),  # 28 heads
    (["parallel.pp=3", "deploy.train_gpus_per_node=6"], "parallel.pp", "layers"),  # 28 layers
    (["parallel.pp=2", "parallel.vpp=4"], "parallel.pp", "layers"),  # 28 % 8
    (["parallel.pp=4"], "deploy.nodes", "not divisible"),  # world 12, tp*pp = 8
    (["parallel.tp=4"], "parallel.tp", "span nodes"),  # 6 training GPUs per node
    (["deploy.train_gpus_per_node=8"], "deploy.train_gpus_per_node", "left for training"),  # servers on 6, 7
    (["deploy.rollout_gpus=[[0],[5]]", "deploy.train_gpus_per_node=6"], "deploy.train_gpus_per_node",
     "left for training"),  # servers on 0 and 5, the analyzer on 7: only 1-4 and 6 are left
    (["deploy.mode=colocated", "deploy.rollout_gpus=[]", "deploy.rollout_servers_per_node=6",
      "deploy.rollout_mem_fraction=0.5", "deploy.analyzer_gpus=[0]"], "deploy.analyzer_gpus", "training GPUs"),
    (["deploy.analyzer_gpus=[]"], "deploy.analyzer_gpus", "needs its GPU"),
    (["deploy.analyzer_gpus=[9]"], "deploy.analyzer_gpus", "do not exist"),
    (["deploy.rollout_gpus=[[6],[6]]"], "deploy.rollout_gpus", "two rollout servers"),
    (["train.micro_batch_tokens=65536"], "memory", "train.micro_batch_tokens"),
    (["deploy.rollout_mem_fraction=0.15"], "deploy.rollout_mem_fraction", "KV cache"),
])
def test_bad_layouts_fail_with_the_reason(capsys, over, key, words):
    res = plan_json(capsys, "--config", C7, *over)
    assert not res["ok"]
    assert any(e.startswith(key) and words in e for e in res["errors"]), res["errors"]


def test_memory_over_the_gpu_and_colocated_analyzer_placement(capsys):
    res = plan_json(capsys, "--config", C7, "--gpu-mem-gib", "40")
    assert not res["ok"] and any(e.startswith("memory: GPU") for e in res["errors"])
    ok = plan_json(capsys, "--config", C7)
    assert ok["ok"] and ok["per_gpu_gib"] <= 80
    assert ok["per_gpu_gib"] == max(g["peak_gib"] for g in ok["memory"]["per_gpu"])
    co = os.path.join(ROOT, "configs", "cluster", "qwen2.5-7b_alfworld_2x8_colocated.yaml")
    bad = plan_json(capsys, "--config", co, "deploy.train_gpus_per_node=8")  # the analyzer's GPUs become training GPUs
    assert any(e.startswith("deploy.analyzer_gpus") and "training GPUs" in e for e in bad["errors"])
    # SGLang takes its fraction of the memory FREE at its start: even 0.85 leaves the trainer's resident bytes, and
    # the rollout phase stays within the GPU
    big = plan_json(capsys, "--config", co, "deploy.rollout_mem_fraction=0.85")
    assert not any(e.startswith("memory: GPU 0") for e in big["errors"]), big["errors"]
    g0 = big["memory"]["per_gpu"][0]
    assert g0["rollout_phase_gib"] <= 80 and g0["train"]


def test_nodes_and_gpus_per_node_options_override_deploy(capsys):
    res = plan_json(capsys, "--config", C7, "--nodes", "3")
    assert res["config"]["nodes"] == 3 and res["layout"]["world"] == 18 and res["layout"]["dp"] == 9
    res = plan_json(capsys, "--config", C7, "--gpus-per-node", "4")
    assert res["config"]["gpus_per_node"] == 4 and not res["ok"]  # rollout GPUs 6, 7 and analyzer 7 do not exist


def test_usage_and_config_errors_exit_2_with_one_line(capsys):
    for argv in (["--config", "/no/such.yaml"], ["--config", C7, "parallel.tp=0"], ["--config", C7, "nokey=1"],
                 ["--config", C7, "--mfu", "0"], ["--config", C7, "--nodes", "0"]):
        rc, out, err = run_plan(capsys, *argv)
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, (argv, err)


# ------------------------------------------------------------------------------------------------ fuzz
def test_fuzz_layout_inputs_never_crash_and_exit_code_matches(capsys):
    rng = random.Random(14)
    seen = {0: 0, 1: 0, 2: 0}
    for _ in range(300):
        gpus, n_srv, rtp = rng.randint(1, 16), rng.randint(0, 3), rng.choice([1, 2, 4])
        over = [f"parallel.tp={rng.choice([1, 1, 2, 3, 4, 8])}", f"parallel.pp={rng.choice([1, 1, 1, 2, 3, 4, 7])}",
                f"parallel.vpp={rng.choice([1, 1, 1, 2, 4])}", f"deploy.mode={rng.choice(['colocated', 'disaggregated'])}",
                f"deploy.train_gpus_per_node={rng.randint(0, gpus + 1)}",
                f"deploy.rollout_servers_per_node={n_srv}", f"deploy.rollout_tp={rtp}",
                f"deploy.analyzer_gpus={rng.sample(range(gpus + 2), rng.randint(0, 1))}",
                f"deploy.rollout_mem_fraction={rng.choice([0.2, 0.45, 0.85])}",
                f"parallel.sequence_parallel={rng.choice(['true', 'false'])}",
                f"train.distributed_optimizer={rng.choice(['true', 'false'])}",
                f"train.recompute={rng.choice(['none', 'selective', 'full'])}",
                # explicit server GPUs (random ids: may clash, repeat or not exist) or the default placement
                "deploy.rollout_gpus=" + str([rng.sample(range(gpus + 1), min(rtp, gpus + 1)) for _ in range(n_srv)]
                                             if rng.random() < 0.4 else [])]
        cfg = rng.choice([C7, os.path.join(ROOT, "configs", "cluster", "qwen2.5-3b_webshop_4x8_colocated.yaml"),
                          os.path.join(ROOT, "configs", "qwen3-1.7b_alfworld.yaml"),
                          os.path.join(ROOT, "configs", "tiny_cpu.yaml")])
        argv = ["--config", cfg, "--nodes", str(rng.randint(1, 5)), "--gpus-per-node", str(gpus), "--json",
                "--gpu-mem-gib", str(rng.choice([24, 80, 141, 141])), *over]
        rc, out, err = run_plan(capsys, *argv)
        seen[rc] += 1
        if rc == 2:
            assert out == "" and len(err.strip().splitlines()) == 1, (argv, err)
            continue
        res = json.loads(out)
        assert rc == (0 if res["ok"] else 1) and res["ok"] == (res["errors"] == []), argv
        assert isinstance(res["params_total"], int) and res["params_total"] > 0
        assert isinstance(res["per_gpu_gib"], float) and res["per_gpu_gib"] >= 0
        assert all(isinstance(e, str) and ":" in e for e in res["errors"])
        assert isinstance(res["memory"], dict) and isinstance(res["time"], dict)
    assert min(seen.values()) >= 5, seen  # the fuzz reaches every outcome


def test_placement_follows_the_launchers_rules(capsys):
    """The planner places GPUs exactly as the launcher's opid_mega.placement.node_placement does; where that refuses
    a deploy section, the planner reports at least one deploy.* error."""
    placement = pytest.importorskip("opid_mega.placement")
    rng = random.Random(7)
    agree = refused = 0
    for _ in range(300):
        gpus, n_srv, rtp = rng.randint(1, 12), rng.randint(0, 3), rng.choice([1, 2])
        over = [f"deploy.mode={rng.choice(['colocated', 'disaggregated'])}", f"deploy.gpus_per_node={gpus}",
                f"deploy.train_gpus_per_node={rng.randint(0, gpus)}", f"deploy.rollout_servers_per_node={n_srv}",
                f"deploy.rollout_tp={rtp}", f"deploy.analyzer_gpus={rng.sample(range(gpus + 1), rng.randint(0, 2))}",
                "deploy.rollout_gpus=" + str([rng.sample(range(gpus + 1), min(rtp, gpus + 1)) for _ in range(n_srv)]
                                             if rng.random() < 0.3 else []), "parallel.tp=1"]
        try:
            cfg = load_config(C7, over)
        except Exception:
            continue
        res = P.plan(cfg)
        try:
            want = placement.node_placement(cfg.deploy, analyzer_launched=True)
        except placement.PlacementError:
            refused += 1
            assert any(e.startswith("deploy.") for e in res["errors"]), (over, res["errors"])
            continue
        agree += 1
        lay = res["layout"]
        assert (lay["train_gpus"], lay["rollout_groups"], lay["analyzer_gpus"]) == \
            (want.train_gpus, want.rollout_groups, want.analyzer_gpus), over
    assert agree >= 20 and refused >= 20, (agree, refused)


# ------------------------------------------------------------------------------------------------ shipped configs
def _paper_config_without_placement(path):
    """A paper-setup file (configs/*.yaml) that launches an analyzer server but places it nowhere (no deploy section):
    the planner must name exactly that (deploy.analyzer_gpus) besides what the placement then implies."""
    import yaml

    with open(path) as f:
        raw = yaml.safe_load(f)
    gpu = raw.get("parallel", {}).get("backend") != "gloo" and "base" not in raw  # the CPU presets build on a base
    return gpu and "deploy" not in raw and raw.get("analyzer", {}).get("backend") == "llm" and not raw.get(
        "analyzer", {}).get("base_url")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_shipped_config_plans(capsys, path):
    rc, out, err = run_plan(capsys, "--config", path, "--json")
    res = json.loads(out)
    assert res["ok"] == (res["errors"] == []) and rc == (0 if res["ok"] else 1)
    if _paper_config_without_placement(path):
        # one-node paper setups predate `deploy`: everything but the analyzer's placement must be fine once it is
        # given (one GPU kept out of training for it, lower SGLang fraction colocated)
        assert any(e.startswith("deploy.analyzer_gpus") for e in res["errors"])
        tp = res["layout"]["tp"]
        fixed = plan_json(capsys, "--config", path, f"deploy.train_gpus_per_node={8 - tp}",
                          f"deploy.analyzer_gpus={list(range(8 - tp, 8))}", "deploy.rollout_servers_per_node=2",
                          "deploy.rollout_mem_fraction=0.5")
        assert fixed["ok"], fixed["errors"]
        return
    assert rc == 0, res["errors"]
    assert res["per_gpu_gib"] <= 80


def test_cluster_configs_are_complete_and_validate():
    names = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "cluster", "*.yaml"))}
    for m in ("7b", "3b"):
        for env in ("alfworld", "webshop", "search_qa"):
            for n in (2, 4):
                for mode in ("colocated", "disaggregated"):
                    assert f"qwen2.5-{m}_{env}_{n}x8_{mode}.yaml" in names
    assert "qwen2.5-32b_alfworld_4x8_disaggregated.yaml" in names
    for p in glob.glob(os.path.join(ROOT, "configs", "cluster", "*.yaml")):
        r = subprocess.run([sys.executable, "-m", "opid_mega.config", p], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (p, r.stderr)
        cfg, parts = load_config(p), os.path.basename(p)[:-5].split("_")
        assert f"{cfg.deploy.nodes}x{cfg.deploy.gpus_per_node}" == parts[-2] and cfg.deploy.mode == parts[-1]
        assert cfg.parallel.backend == "nccl" and cfg.model.path.lower().endswith(parts[0].split("-")[1] + "-instruct")


def test_opid_plan_command_text_and_json():
    exe = shutil.which("opid-plan")
    cmd = [exe] if exe else [sys.executable, "-m", "opid_mega.plan"]
    r = subprocess.run(cmd + ["--config", C7], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    for word in ("weights", "grads", "optimizer", "activations", "fork scoring", "SGLang", "rollout", "training",
                 "weight sync", "assumptions:", "MFU 0.35", "989 TFLOP/s", "100 Gbit/s", "plan: ok"):
        assert word in r.stdout, word
    r = subprocess.run(cmd + ["--config", C7, "--json", "parallel.tp=3"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    res = json.loads(r.stdout)
    assert r.returncode == 1 and not res["ok"] and res["params_total"] == PUBLISHED["Qwen2.5-7B-Instruct"]


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_iteration_time_with_the_analysis_and_rollout_overlapped(capsys, mode):
    """train.max_staleness >= 1: the iteration is the longest chain of the pipeline (opid_mega.pipeline), not the sum
    of its phases; the analyzer is a stage of its own. Phase times from the JSON, the chains written out by hand."""
    C = os.path.join(ROOT, "configs", "cluster", f"qwen2.5-7b_alfworld_2x8_{mode}.yaml")
    over = [f"deploy.mode={mode}", "analyzer.backend=llm", "analyzer.base_url=", "deploy.analyzer_gpus=[0]"]
    seq = plan_json(capsys, "--config", C, *over, "train.max_staleness=0")["time"]
    t = plan_json(capsys, "--config", C, *over, "train.max_staleness=1")["time"]
    R, A, S, T, Y, O = (t[k] for k in ("rollout_s", "analysis_s", "scoring_s", "training_s", "sync_s", "offload_s"))
    assert A > 0 and R > 0 and T > 0
    assert seq["iteration_s"] == seq["sequential_s"] == pytest.approx(R + A + S + T + Y + O, abs=0.2)
    want = max(R + S + T + Y + O, A) if mode == "colocated" else max(max(R, S + T) + Y, A)
    assert t["iteration_s"] == pytest.approx(want, abs=0.2)
    assert t["sequential_s"] == seq["sequential_s"] and t["iteration_s"] < t["sequential_s"]
    # an analyzer slower than everything else is what an iteration takes
    slow = plan_json(capsys, "--config", C, *over, "train.max_staleness=2", "analyzer.max_tokens=200000")["time"]
    assert slow["iteration_s"] == pytest.approx(slow["analysis_s"], abs=0.2)
    rc, out, _ = run_plan(capsys, "--config", C, *over, "train.max_staleness=1")
    assert f"train.max_staleness=1, {mode}" in out and "one after the other" in out


def test_idle_gpus_are_reported(capsys):
    """The 7B ALFWorld setup on 2 x 8 GPUs: 6 training GPUs per node (rollout servers on GPUs 0-1), the analyzer on
    node 0's GPUs 6-7, so node 1's GPUs 6 and 7 have nothing placed on them."""
    c = os.path.join(ROOT, "configs", "qwen2.5-7b_alfworld.yaml")
    res = plan_json(capsys, "--config", c, "--nodes", "2")
    assert res["idle_gpus"] == {"count": 2, "of": 16, "per_node": [{"node": 1, "gpus": [6, 7]}]}
    rc, out, _ = run_plan(capsys, "--config", c, "--nodes", "2")
    lines = [x for x in out.splitlines() if x.startswith("idle GPUs:")]
    assert lines == ["idle GPUs: 2 of 16 (node 1: GPUs 6, 7): no training rank, rollout server or analyzer is placed "
                     "on them (deploy.train_gpus_per_node / deploy.rollout_gpus / deploy.analyzer_gpus)"]
    # one node: every GPU has a role
    assert plan_json(capsys, "--config", c)["idle_gpus"] == {"count": 0, "of": 8, "per_node": []}
    rc, out, _ = run_plan(capsys, "--config", c)
    assert "idle GPUs: none of 8" in out.splitlines()
    # a CPU config has no GPUs to leave idle
    assert plan_json(capsys, "--config", os.path.join(ROOT, "configs", "tiny_cpu.yaml"))["idle_gpus"] is None
