"""YAML 1.2 numbers in config files, `base:` files, config.yaml and key=value overrides (opid_mega.config.YAMLLoader):
`1e-6` is a float, as in YAML 1.2 (PyYAML's safe_load, YAML 1.1, reads it as the string '1e-6')."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from opid_mega import config as C
from opid_mega.config import yaml_load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")

FLOATS = {"1e-6": 1e-6, "1E6": 1e6, ".5": 0.5, "-2e-3": -2e-3, "-.5": -0.5, "1.": 1.0, "+1e3": 1e3, "2.5e+2": 250.0,
          "1.0e-06": 1e-6, "1e30": 1e30, "6.02E23": 6.02e23}
NOT_FLOATS = {"10": 10, "-3": -3, "0": 0, "1e": "1e", "e5": "e5", "1.5.5": "1.5.5", ".": ".", "'1e-6'": "1e-6",
              "x1e5": "x1e5", ".inf": float("inf"), "true": True}


def test_the_acceptance_command_prints_the_float():
    r = subprocess.run([sys.executable, "-m", "opid_mega.config", TINY, "train.lr=1e-6"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "  lr: 1e-06\n" in r.stdout  # the acceptance: Python's spelling, a YAML 1.2 float
    train = yaml_load(r.stdout)["train"]
    assert train["lr"] == 1e-06 and isinstance(train["lr"], float)
    # what the trainer writes (config.yaml) keeps the spelling plain YAML 1.1 readers also read as a float
    from opid_mega.config import dump_config, load_config

    dumped = dump_config(load_config(TINY, ["train.lr=1e-6"]))
    assert "  lr: 1.0e-06\n" in dumped and yaml.safe_load(dumped)["train"]["lr"] == 1e-06


@pytest.mark.parametrize("text,value", list(FLOATS.items()) + list(NOT_FLOATS.items()))
def test_scalars(text, value):
    got = C.yaml_load(f"v: {text}")["v"]
    assert got == value and type(got) is type(value), (text, got)
    _, over = C.parse_override(f"train.lr={text}")
    assert over == value and type(over) is type(value)


def test_files_base_files_and_overrides(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  lr: 1e-6\n  weight_decay: .5\nalgo:\n  delta_clip: 2E-1\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\nalgo:\n  lambda_step: -2e-3\n  lambda_episode: 5e-4\n")
    with pytest.raises(C.ConfigError, match=r"^algo\.lambda_step: got -0\.002, allowed: a number >= 0$"):
        C.load_config(str(child))
    cfg = C.load_config(str(child), ["algo.lambda_step=1E-3", "sft.lr=3e-4"])
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.algo.delta_clip) == (1e-6, 0.5, 0.2)
    assert (cfg.algo.lambda_step, cfg.algo.lambda_episode, cfg.sft.lr) == (1e-3, 5e-4, 3e-4)
    assert C.config_from_dict(yaml.safe_load(C.dump_config(cfg))) == cfg  # config.yaml stays YAML 1.1-readable


def test_a_quoted_number_is_still_a_string():
    with pytest.raises(C.ConfigError, match=r"^train\.lr: got '1e-6' \(str\), expected a number$"):
        C.load_config(None, ["train.lr='1e-6'"])


def test_safe_load_itself_is_unchanged():
    assert yaml.safe_load("v: 1e-6")["v"] == "1e-6"  # the resolver lives on YAMLLoader only


def test_a_hand_edited_config_yaml(tmp_path):
    from opid_mega import rundir

    text = C.dump_config(C.load_config(TINY))
    assert "  lr: 1.0e-05\n" in text
    (tmp_path / "config.yaml").write_text(text.replace("  lr: 1.0e-05\n", "  lr: 3e-5\n", 1))
    assert rundir.read_saved_config(tmp_path).train.lr == 3e-5
