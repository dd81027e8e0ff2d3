"""Typed config: YAML, dotted overrides, validation errors that name the key."""
import glob
import os
import subprocess
import sys

import pytest

from opid_mega.config import ConfigError, Config, dump_config, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "opid_mega.config", *args], capture_output=True, text=True,
                          timeout=60)


def test_defaults_are_the_papers():
    c = Config()
    assert (c.algo.lambda_episode, c.algo.lambda_step) == (0.001, 0.001)
    assert (c.algo.clip_low, c.algo.clip_high, c.algo.dual_clip) == (0.2, 0.2, 3.0)
    assert c.algo.loss_agg == "token-mean" and c.algo.kl_kind == "low_var_kl" and c.algo.kl_coef == 0.01
    assert c.rollout.group_size == 8 and c.analyzer.gamma == 0.95 and c.train.lr == 1e-6


def test_file_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("algo:\n  mode: grpo\nparallel:\n  tp: 2\n")
    c = load_config(str(f), ["algo.lambda_episode=0.5", "parallel.pp=2", "algo.delta_clip=null",
                             "env.options={pool_size: {train: 3}}", "rollout.sglang_args=[--foo, bar]"])
    assert c.algo.mode == "grpo" and c.parallel.tp == 2 and c.parallel.pp == 2
    assert c.algo.lambda_episode == 0.5 and isinstance(c.algo.lambda_episode, float)
    assert c.env.options == {"pool_size": {"train": 3}} and c.rollout.sglang_args == ["--foo", "bar"]
    assert not c.algo.needs_analysis and c.algo.routing == "step_priority"
    assert load_config(None, ["algo.mode=no_routing"]).algo.routing == "additive"
    # The dump is itself a valid config that resolves to the same thing.
    f2 = tmp_path / "dump.yaml"
    f2.write_text(dump_config(c))
    assert load_config(str(f2)) == c


@pytest.mark.parametrize("override,key", [
    ("algo.bogus=1", "algo.bogus"),
    ("nosection.x=1", "nosection"),
    ("algo.lambda_episode=-0.1", "algo.lambda_episode"),
    ("algo.lambda_episode=abc", "algo.lambda_episode"),
    ("algo.mode=fancy", "algo.mode"),
    ("parallel.tp=two", "parallel.tp"),
    ("parallel.tp=0", "parallel.tp"),
    ("parallel.tp=1.5", "parallel.tp"),
    ("logging.tensorboard=maybe", "logging.tensorboard"),
    ("algo.dual_clip=0.5", "algo.dual_clip"),
    ("parallel.vpp=2", "parallel.vpp"),
    ("algo=3", "algo"),
    ("novalue", "novalue"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(key)


def test_cli_good_and_bad(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("train:\n  iterations: 3\n")
    r = run_cli(str(good), "algo.lambda_step=0.002")
    assert r.returncode == 0, r.stderr
    assert "lambda_step: 0.002" in r.stdout and "iterations: 3" in r.stdout
    bad = tmp_path / "bad.yaml"
    for text, key in [("algo:\n  lamda_episode: 1\n", "algo.lamda_episode"),
                      ("train:\n  lr: fast\n", "train.lr"),
                      ("algo:\n  lambda_step: -1\n", "algo.lambda_step"),
                      ("algo:\n  mode: magic\n", "algo.mode"),
                      ("[1, 2]\n", str(bad))]:
        bad.write_text(text)
        r = run_cli(str(bad))
        assert r.returncode == 2 and r.stdout == ""  # a ConfigError: exit 2, one "config error: " line
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("config error: ") and key in lines[0], r.stderr
    missing = tmp_path / "missing.yaml"
    r = run_cli(str(missing))
    assert r.returncode == 2 and r.stderr == f"config error: {missing}: config file not found\n", r.stderr


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_shipped_configs_validate(path):
    load_config(path)


def test_sft_section_and_bad_sft_values_are_rejected():
    c = load_config(None, ["sft.epochs=3", "sft.lr=0.01", "sft.think='Plan - {action}'"])
    assert (c.sft.epochs, c.sft.lr, c.sft.mini_batch_size, c.sft.think) == (3, 0.01, 64, "Plan - {action}")
    assert Config().model.enable_thinking is False and Config().model.init_from == ""
    assert load_config(None, ["algo.loss_agg=seq-mean-token-sum", "scoring.kernel_backend=triton"]).algo.loss_agg \
        == "seq-mean-token-sum"
    for item, key in [("sft.epochs=0", "sft.epochs"), ("sft.think=no placeholder", "sft.think"),
                      ("algo.loss_agg=seq-mean", "algo.loss_agg"), ("scoring.kernel_backend=cuda", "scoring.kernel_backend")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [item])
    assert load_config(None, ["scoring.kernel_backend=torch", "analyzer.sglang_args=[--tp, '2']"]).analyzer \
        .sglang_args == ["--tp", "2"]


def test_core_budget_keys_and_missing_cores(capsys):
    from opid_mega.infra.runtime import apply_core_budget

    cfg = load_config(None, ["deploy.trainer_cpus=[0]", "deploy.server_cpus=[0]"])
    assert cfg.deploy.trainer_cpus == [0] and cfg.deploy.server_cpus == [0]
    with pytest.raises(ConfigError, match="deploy.server_cpus"):
        load_config(None, ["deploy.server_cpus=[-1]"])
    bad = load_config(None, ["deploy.server_cpus=[4096]"])
    assert apply_core_budget("opid-train", bad) is False
    assert "cores [4096] do not exist" in capsys.readouterr().err


def test_tp2pp2_config_is_the_tiny_config_in_another_layout():
    """configs/tiny_cpu_tp2pp2.yaml says "same model, env and algorithm as tiny_cpu.yaml", and the multi-rank tests
    compare the two runs value by value: only the parallel layout and the run dir may differ."""
    import dataclasses

    root = os.path.join(os.path.dirname(__file__), "..", "configs")
    one = dataclasses.asdict(load_config(os.path.join(root, "tiny_cpu.yaml")))
    four = dataclasses.asdict(load_config(os.path.join(root, "tiny_cpu_tp2pp2.yaml")))
    diff = sorted(f"{sec}.{k}" for sec in one for k in one[sec] if one[sec][k] != four[sec][k])
    # the layout: TP x PP and the ranks per node the launchers start for it (deploy.gpus_per_node on CPU)
    assert diff == ["deploy.gpus_per_node", "logging.run_dir", "parallel.pp", "parallel.tp"]
