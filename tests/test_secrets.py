"""The analyzer key: resolved at run time (analyzer.api_key, else $analyzer.api_key_env, else EMPTY), sent to the
endpoint, and written nowhere: not in config dumps, logged command lines, experiment records or child command lines."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from opid_mega.config import Config, dump_config, load_config, resolve_api_key
from opid_mega.infra.redact import redact_args, redact_text

ROOT = Path(__file__).resolve().parent.parent
SECRET = "sk-SECRET-test-4b1d0c"


def test_precedence_explicit_key_then_env_then_empty():
    a = Config().analyzer
    assert a.api_key == "" and a.api_key_env == "OPENAI_API_KEY"
    assert resolve_api_key(a, {}) == "EMPTY"
    assert resolve_api_key(a, {"OPENAI_API_KEY": SECRET}) == SECRET
    assert resolve_api_key(a, {"OPENAI_API_KEY": "  "}) == "EMPTY"
    b = load_config(None, ["analyzer.api_key=explicit", "analyzer.api_key_env=MY_KEY"]).analyzer
    assert resolve_api_key(b, {"MY_KEY": SECRET, "OPENAI_API_KEY": "x"}) == "explicit"  # explicit beats the env
    c = load_config(None, ["analyzer.api_key_env=MY_KEY"]).analyzer
    assert resolve_api_key(c, {"MY_KEY": SECRET, "OPENAI_API_KEY": "x"}) == SECRET
    assert resolve_api_key(load_config(None, ["analyzer.api_key=EMPTY"]).analyzer, {"OPENAI_API_KEY": "x"}) == "EMPTY"
    assert resolve_api_key(load_config(None, ["analyzer.api_key_env="]).analyzer, {"": "x"}) == "EMPTY"


def test_dump_never_holds_the_key():
    cfg = load_config(None, [f"analyzer.api_key={SECRET}"])
    assert cfg.analyzer.api_key == SECRET  # in memory, for the client
    text = dump_config(cfg)
    assert SECRET not in text and yaml.safe_load(text)["analyzer"]["api_key"] == ""
    assert SECRET in dump_config(cfg, redact=False)
    r = subprocess.run([sys.executable, "-m", "opid_mega.config", str(ROOT / "configs" / "tiny_cpu.yaml"),
                        f"analyzer.api_key={SECRET}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and SECRET not in r.stdout + r.stderr and "api_key_env: OPENAI_API_KEY" in r.stdout


def test_redact_args_and_text():
    args = ["python", "-m", "opid_mega.cli", f"analyzer.api_key={SECRET}", "--api-key", SECRET, f"--api-key={SECRET}",
            "analyzer.max_tokens=5", "sync.check_tokens=16", "analyzer.api_key="]
    out = redact_args(args)
    assert SECRET not in " ".join(out)
    assert out == ["python", "-m", "opid_mega.cli", "analyzer.api_key=***", "--api-key", "***", "--api-key=***",
                   "analyzer.max_tokens=5", "sync.check_tokens=16", "analyzer.api_key="]
    assert redact_text(f"HTTP 401: bad key {SECRET}", [SECRET, "EMPTY"]) == "HTTP 401: bad key ***"
    assert redact_text("EMPTY stays", ["EMPTY"]) == "EMPTY stays"


class _Capture(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):  # noqa: N802 - an OpenAI-compatible endpoint that records the Authorization header
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _Capture.seen.append(self.headers.get("Authorization"))
        body = json.dumps({"choices": [{"message": {"content": json.dumps({"episode_skill": "s"})}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_the_env_key_is_what_the_endpoint_receives(monkeypatch):
    from opid_mega.rollout.launch import llm_analyzer
    from opid_mega.skills import TrajectoryView

    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OPID_TEST_KEY", SECRET)
        cfg = load_config(None, ["analyzer.backend=llm", "analyzer.model=m", "analyzer.api_key_env=OPID_TEST_KEY"])
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        traj = TrajectoryView(task="t", won=True, steps=[("obs", "<action>go</action>", 1.0)], traj_id="a")
        with llm_analyzer(cfg.analyzer, base_url=url) as an:
            assert an.analyze([traj])[0].episode_skill == "s"
        monkeypatch.delenv("OPID_TEST_KEY")
        with llm_analyzer(cfg.analyzer, base_url=url) as an:  # no variable: the local-server default
            an.analyze([TrajectoryView(task="u", won=True, steps=traj.steps, traj_id="b")])
    finally:
        srv.shutdown()
        srv.server_close()
    assert _Capture.seen == [f"Bearer {SECRET}", "Bearer EMPTY"]


def _experiment_tool():
    spec = importlib.util.spec_from_file_location("experiment_tool_secrets", ROOT / "tools" / "experiment.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_experiment_records_and_child_command_lines_hold_no_key(tmp_path):
    ex = _experiment_tool()
    overrides, env = ex.move_secrets(["train.iterations=2", f"analyzer.api_key={SECRET}", "algo.mode=opid"])
    assert overrides == ["train.iterations=2", "algo.mode=opid", "analyzer.api_key=",
                         f"analyzer.api_key_env={ex.SECRET_ENV}"]
    assert env == {ex.SECRET_ENV: SECRET}
    # a child resolves the key from its environment exactly as given
    child = load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), overrides)
    assert resolve_api_key(child.analyzer, env) == SECRET
    # records: experiment.json (the spec), a step's log line; even an override that kept the key is redacted
    spec = ex.spec_of("configs/tiny_cpu.yaml", [f"analyzer.api_key={SECRET}", *overrides])
    ex.check_spec(tmp_path / "out", spec)
    log = tmp_path / "out" / "logs" / "step.log"
    ex.run_logged("step", [sys.executable, "-c", "pass", f"analyzer.api_key={SECRET}"], log, {})
    for f in (tmp_path / "out").rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f
    assert "analyzer.api_key=***" in log.read_text()
