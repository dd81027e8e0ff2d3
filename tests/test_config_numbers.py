"""Every numeric config key, discovered from the dataclasses: a range check exists for it, and hostile values
(0, -1, 1e30, inf, nan, "x", a 5000-digit integer) give one ConfigError line naming the key — or are accepted when
valid — never a traceback: through config_from_dict, `python -m opid_mega.config` and opid-train."""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import typing

import pytest
import yaml

from opid_mega import config as C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")


def _numeric(tp) -> bool:
    if tp in (int, float):
        return True
    if typing.get_origin(tp) is typing.Union:
        return any(a in (int, float) for a in typing.get_args(tp))
    return False


def numeric_keys() -> list[tuple[str, type]]:
    out = []
    for section, cls in typing.get_type_hints(C.Config).items():
        for name, tp in typing.get_type_hints(cls).items():
            if _numeric(tp):
                out.append((f"{section}.{name}", tp))
    return out


KEYS = numeric_keys()
VALUES = [0, -1, 1e30, math.inf, -math.inf, math.nan, "x", 10**5000, 2**31, True]
TEXTS = ["0", "-1", "1.0e30", "1e30", ".inf", "-.inf", ".nan", "x", "1" * 5000, "[1]"]
TRAIN_TEXTS = ("-1", ".inf", ".nan", "x")


def test_discovery_finds_the_numeric_keys():
    names = {k for k, _ in KEYS}
    assert len(names) >= 60
    for key in ("env.step_timeout_s", "analyzer.backoff_s", "analyzer.temperature", "analyzer.max_tokens",
                "analyzer.max_skill_tokens", "train.weight_decay", "train.adam_beta1", "train.adam_beta2",
                "sync.bucket_mb", "sync.check_tol", "algo.dual_clip", "algo.delta_clip", "train.seed"):
        assert key in names


def test_every_numeric_key_has_a_range_check():
    missing = [k for k, _ in KEYS if k not in C._CHECKS]
    assert not missing, f"numeric config keys without a range check in opid_mega.config._CHECKS: {missing}"


def _one_line_naming(msg: str, key: str) -> None:
    assert "\n" not in msg and key in msg and len(msg) < 400, msg


@pytest.mark.parametrize("key,tp", KEYS, ids=[k for k, _ in KEYS])
def test_hostile_values_give_one_line_or_a_valid_config(key, tp):
    section, name = key.split(".")
    for value in VALUES:
        try:
            cfg = C.config_from_dict({section: {name: value}})
        except C.ConfigError as e:
            _one_line_naming(str(e), key)
            continue
        got = getattr(getattr(cfg, section), name)
        assert isinstance(got, (int, float)) and not isinstance(got, bool) and math.isfinite(got), (key, value)
        assert C._CHECKS[key][0](got)
        assert C.config_from_dict(yaml.safe_load(C.dump_config(cfg))) == cfg  # and survives config.yaml
    # inf and nan are never a valid number
    for bad in (math.inf, math.nan):
        with pytest.raises(C.ConfigError):
            C.config_from_dict({section: {name: bad}})


def test_step_timeout_inf_is_refused():
    with pytest.raises(C.ConfigError, match=r"^env\.step_timeout_s: got inf, allowed: a finite number$"):
        C.load_config(TINY, ["env.step_timeout_s=.inf"])
    with pytest.raises(C.ConfigError, match=r"^algo\.dual_clip: got nan, allowed: a finite number or null$"):
        C.load_config(None, ["algo.dual_clip=.nan"])
    with pytest.raises(C.ConfigError, match=r"^train\.adam_beta2: got 1\.0, allowed: a number in \[0, 1\)$"):
        C.load_config(None, ["train.adam_beta2=1.0"])


def test_through_python_m_opid_mega_config_and_opid_train(capsys, monkeypatch):
    """Every key x every hostile text through the CLI entry points in this process (a traceback fails the test):
    exit 2 with one line on stderr, or exit 0 with the YAML. opid-train gets the refused values of TRAIN_TEXTS."""
    from opid_mega import cli

    monkeypatch.setattr(cli, "quiet", lambda: None)  # no thread / warning settings changed in the test process
    refused = 0
    for key, _ in KEYS:
        for text in TEXTS:
            rc = C.main([TINY, f"{key}={text}"])
            out, err = capsys.readouterr()
            if rc == 0:
                assert err == "" and "model:" in out
                continue
            assert rc == 2 and out == "", (key, text)
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("config error: "), (key, text, err)
            _one_line_naming(lines[0], key)
            refused += 1
            if text not in TRAIN_TEXTS:  # opid-train reads the config the same way: a few texts per key suffice
                continue
            try:
                code = cli.train_main(["--config", TINY, "--run-dir", "/nonexistent/never-created", f"{key}={text}"])
            except SystemExit as ex:
                code = ex.code
            out, err = capsys.readouterr()
            assert code == 2, (key, text, err)
            lines = err.strip().splitlines()
            assert len(lines) == 1 and key in lines[0], (key, text, err)
    assert refused >= 5 * len(KEYS)


def test_subprocesses_exit_2_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    huge = tmp_path / "huge.yaml"
    huge.write_text("train:\n  iterations: " + "1" * 5000 + "\n")
    for cmd in ([sys.executable, "-m", "opid_mega.config", TINY, "env.step_timeout_s=.inf"],
                [sys.executable, "-m", "opid_mega.config", str(huge)],
                [sys.executable, "-m", "opid_mega.cli", "--config", TINY, "--run-dir", str(tmp_path / "r"),
                 "analyzer.backoff_s=.nan"],
                [sys.executable, "-m", "opid_mega.cli", "--config", TINY, "--run-dir", str(tmp_path / "r"),
                 "train.adam_beta1=x"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (cmd[3:], r.stderr)
    assert not (tmp_path / "r").exists()  # refused before anything was written
