"""Logging sinks: W&B offline (config + every metric), the config in TensorBoard, one warning for a missing logger
package, and RUN_DIR/train.log (the console tee, and opid-train writing it)."""
import glob
import io
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from opid_mega.config import load_config, redacted
from opid_mega.infra import files
from opid_mega.infra.console_log import TRAIN_LOG, TeeStream, _LogFile, tee_console
from opid_mega.metrics import MetricsLogger, read_metrics, wandb_settings

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")
SECRET = "sk-never-logged-4242"


def _wandb_records(path: str) -> list:
    """The records of a .wandb file (W&B's leveldb-style log: a 7-byte header, then 32 KiB blocks of chunks
    crc32(4) length(2) type(1); type 1 = a whole record, 2/3/4 = first/middle/last part)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_wandb_offline_gets_the_config_and_every_metric_and_tensorboard_the_config(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    (tmp_path / "wb").mkdir()
    for k in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_TAGS"):
        monkeypatch.delenv(k, raising=False)
    run = tmp_path / "run"
    run.mkdir()
    rid = files.new_run_id(run)
    cfg = load_config(CONFIG, ["logging.wandb=true", "logging.wandb_project=opid-test", "logging.wandb_name=tiny",
                               "logging.wandb_tags=[opid, cpu]", "train.lr=3.0e-6"])
    cfg.analyzer.api_key = SECRET
    settings = wandb_settings(cfg.logging, run)
    assert settings["id"] == rid and "dir" not in settings  # WANDB_DIR is set: wandb's own choice
    assert wandb_settings(load_config(CONFIG, []).logging, run) is None  # logging.wandb defaults to off
    try:
        with MetricsLogger(run, tensorboard=True, progress=False, config=redacted(cfg), wandb=settings) as log:
            assert log.wandb is not None
            log.log(1, {"train/success_rate": 0.25, "ppo/kl": 0.5, "adv/skill_abs_mean": float("nan")})
            log.log(2, {"train/success_rate": 0.75, "ppo/kl": 0.125})
    finally:
        wandb.teardown()  # the wandb-core service process of this test process
    found = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / f"run-{rid}.wandb"))
    assert len(found) == 1, os.listdir(tmp_path / "wb" / "wandb")
    raw = Path(found[0]).read_bytes()
    assert SECRET.encode() not in raw
    recs = _wandb_records(found[0])
    runs = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    assert runs and runs[0].run_id == rid and runs[0].display_name == "tiny" and runs[0].project == "opid-test"
    assert list(runs[0].tags) == ["opid", "cpu"]
    config = {u.key: json.loads(u.value_json) for r in runs[:1] for u in r.config.update}
    assert config["train"]["lr"] == 3.0e-6 and config["logging"]["wandb_name"] == "tiny"
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in recs if r.WhichOneof("record_type") == "history"]
    jsonl = read_metrics(run)
    assert len(history) == 2
    for h, m in zip(history, jsonl):  # the same keys and values as metrics.jsonl (nulls left out)
        assert {k: h[k] for k in h if not k.startswith("_")} == {k: v for k, v in m.items() if v is not None}
    assert "adv/skill_abs_mean" in jsonl[0] and "adv/skill_abs_mean" not in history[0]

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    texts, hparams = [], {}
    for ev_file in (run / "tensorboard").glob("events.out.tfevents.*"):
        assert SECRET.encode() not in ev_file.read_bytes()
        for ev in EventFileLoader(str(ev_file)).Load():
            for v in ev.summary.value:
                if v.tag.startswith("config"):
                    texts.append(b"".join(v.tensor.string_val).decode())
                if v.metadata.plugin_data.plugin_name == "hparams":
                    data = plugin_data_pb2.HParamsPluginData.FromString(v.metadata.plugin_data.content)
                    if data.HasField("session_start_info"):
                        hparams = dict(data.session_start_info.hparams)
    assert len(texts) == 1 and "    train:\n" in texts[0] and "lr: 3.0e-06" in texts[0]
    assert hparams["train.lr"].number_value == pytest.approx(3.0e-6, rel=1e-12)
    assert hparams["logging.wandb_tags"].string_value == "['opid', 'cpu']"
    assert hparams["algo.mode"].string_value == cfg.algo.mode


_BLOCKED = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("wandb", "tensorboard"):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, Block())
from opid_mega.metrics import MetricsLogger, read_metrics
with MetricsLogger(sys.argv[1], tensorboard=True, progress=False, config={"train": {"lr": 1.0}},
                   wandb={"project": "p", "mode": "offline"}) as log:
    assert log.tb is None and log.wandb is None
    log.log(1, {"train/score": 2.5})
print(read_metrics(sys.argv[1])[0]["train/score"])
"""


def test_a_missing_logger_package_is_one_warning_line_and_the_run_goes_on(tmp_path):
    r = subprocess.run([sys.executable, "-c", _BLOCKED, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "2.5"
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2, r.stderr
    assert "logging.tensorboard" in warnings[0] and "pip install tensorboard" in warnings[0]
    assert "logging.wandb" in warnings[1] and "wandb package is not installed" in warnings[1]


def test_tee_console_copies_both_streams_appends_and_keeps_the_traceback(tmp_path, capsys):
    import logging

    path = tmp_path / TRAIN_LOG
    console_out = sys.stdout
    handler = logging.StreamHandler(sys.stderr)  # made before the tee, as a library does on import
    logger = logging.getLogger("opid-test-tee")
    logger.addHandler(handler)
    logger.propagate = False
    with tee_console(path, argv=["opid-train", "analyzer.api_key=" + SECRET, "train.lr=1e-6"]):
        assert sys.stdout.isatty() == console_out.isatty() and sys.stdout.encoding == console_out.encoding
        print("line one")
        print("to stderr", file=sys.stderr)
        logger.warning("from logging")
        sys.stdout.write("no newline yet")
        assert path.read_text().endswith("from logging\n")  # flushed at every line
    print("after the block")
    assert sys.stdout is console_out and handler.stream is sys.stderr
    logger.removeHandler(handler)
    out, err = capsys.readouterr()
    assert out == "line one\nno newline yetafter the block\n" and err == "to stderr\nfrom logging\n"  # unchanged
    with pytest.raises(ValueError, match="boom"):
        with tee_console(path, argv=["opid-train", "--resume", "x"]):
            print("resumed")
            raise ValueError("boom")
    capsys.readouterr()
    lines = path.read_text().splitlines()
    headers = [x for x in lines if x.startswith("==== ")]
    assert len(headers) == 2 and SECRET not in path.read_text() and "analyzer.api_key=***" in headers[0]
    assert lines[1:6] == ["line one", "to stderr", "from logging", "no newline yet", headers[1]]
    assert "resumed" in lines and lines[-1] == "ValueError: boom" and "Traceback (most recent call last):" in lines


def test_a_log_file_that_fails_warns_once_and_the_console_goes_on(tmp_path, capsys):
    broken = open(tmp_path / "x.log", "w")
    broken.close()
    console, warn_to = io.StringIO(), io.StringIO()
    tee = TeeStream(console, _LogFile(broken, warn_to))
    assert tee.write("a\n") == 2 and tee.write("b\n") == 2
    tee.flush()
    assert console.getvalue() == "a\nb\n"
    assert len(warn_to.getvalue().splitlines()) == 1 and "no longer copied" in warn_to.getvalue()
    with tee_console(tmp_path / "no-such-dir" / TRAIN_LOG) as where:  # cannot be opened: one line, block runs
        print("still printed")
    out, err = capsys.readouterr()
    assert where is None and out == "still printed\n" and len(err.splitlines()) == 1 and "not copied" in err


def test_opid_train_writes_train_log_and_a_fresh_start_moves_the_old_one_aside(tmp_path, monkeypatch, capsys):
    """opid-train in this process, stopped by a core budget naming a core this machine lacks, right after the run
    directory is handled: what it printed is in train.log; a second fresh start moves that file aside (train.log.<time>.bak)."""
    from opid_mega import cli

    monkeypatch.setattr(cli, "quiet", lambda: None)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    run = tmp_path / "run"
    for attempt in (1, 2):
        assert cli.train_main(["--config", CONFIG, "--run-dir", str(run), "deploy.trainer_cpus=[99999]"]) == 2
        _, err = capsys.readouterr()
        assert err.startswith("opid-train: ") and "99999" in err and len(err.splitlines()) == 1
        text = (run / TRAIN_LOG).read_text()
        assert text.startswith("==== ") and "deploy.trainer_cpus=[99999]" in text.splitlines()[0]
        assert text.splitlines()[1:] == err.splitlines()
    assert len(list(run.glob(TRAIN_LOG + ".*.bak"))) == 1
