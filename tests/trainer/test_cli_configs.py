"""Shipped configs validate; the CLI rejects bad invocations with a clear message and exit code 2."""
import os
import subprocess
import sys

import pytest

from opid_mega.cli import train_main
from opid_mega.config import load_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.parametrize("name", ["tiny_cpu", "tiny_cpu_tp2pp2", "smollm2_textworld"])
def test_config_validates(name):
    path = os.path.join(ROOT, "configs", f"{name}.yaml")
    r = subprocess.run([sys.executable, "-m", "opid_mega.config", path], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cfg = load_config(path)
    assert cfg.rollout.tasks_per_iter * cfg.rollout.group_size <= 16  # sized for CPU


def test_tiny_config_is_a_warm_started_cpu_run():
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"))
    assert cfg.model.init_from == "sft" and cfg.rollout.engine == "local" and cfg.analyzer.backend == "rules"
    assert (cfg.parallel.tp, cfg.parallel.pp) == (1, 1)


def test_cli_errors(tmp_path, capsys):
    assert train_main([]) == 2  # one line naming what is missing (opid_mega.rundir.plan_run), exit 2
    assert "--config is required" in capsys.readouterr().err
    assert train_main(["--resume", str(tmp_path)]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    assert train_main(["--config", os.path.join(ROOT, "configs", "tiny_cpu.yaml"), "algo.mode=nonsense"]) == 2
    err = capsys.readouterr().err
    assert "algo.mode" in err and len(err.strip().splitlines()) == 1
