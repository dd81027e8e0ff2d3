"""analyzer.backend=llm: with analyzer.base_url the trainer attaches; without it, it launches a server for
analyzer.model through opid_mega.rollout.sglang_engine's launcher and talks to <url>/v1. SGLang itself is not started
here (too slow on CPU): the launched "server" is a small OpenAI-compatible HTTP process standing in for
`python -m sglang.launch_server`, so the command line, the process lifetime and the URL wiring are all real."""
import json
import os
import stat
import sys

import pytest

from opid_mega.skills.llm_analyzer import LLMAnalyzer
from opid_mega.skills.types import StepView, TrajectoryView
from opid_mega.rollout.launch import build_analyzer, launch_analyzer_server

FAKE_SERVER = r'''#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
open({argv_file!r}, "w").write(json.dumps(argv))
port = int(argv[argv.index("--port") + 1])
REPLY = json.dumps({{"episode_summary": "s", "episode_skill": "Open the box first.",
                    "step_skills": {{"0": "Go east."}}}})
class H(BaseHTTPRequestHandler):
    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._send({{}})
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        assert self.path == "/v1/chat/completions", self.path
        self._send({{"choices": [{{"message": {{"content": REPLY}}}}]}})
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _view():
    return TrajectoryView(task="find the coin", won=True, traj_id="1/t/0",
                          steps=[StepView("You are in a room.", "<think>go</think><action>go east</action>", 10.0,
                                          "go east", True)])


def _running_fake(tmp_path):
    """The fake server above as a running process on a free loopback port (an endpoint someone else runs)."""
    import socket
    import subprocess
    import time

    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER.format(python=sys.executable, argv_file=str(tmp_path / "attached_argv.json")))
    proc = subprocess.Popen([sys.executable, str(script), "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            requests.get(url + "/health", timeout=1)
            return proc, url
        except requests.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("the fake analyzer server did not start")


def test_attaches_to_base_url_without_launching(tiny_cfg, tmp_path):
    proc, url = _running_fake(tmp_path)
    cfg = tiny_cfg("analyzer.backend=llm", f"analyzer.base_url={url}/v1", "analyzer.model=m")

    def launch(*a):
        raise AssertionError("must not launch a server when analyzer.base_url is set")

    try:
        analyzer, server = build_analyzer(cfg, None, tmp_path, launch=launch)  # the start-up probe answered
        try:
            assert server is None and isinstance(analyzer, LLMAnalyzer)
            assert analyzer.url == f"{url}/v1/chat/completions" and analyzer.model == "m"
        finally:
            analyzer.close()
    finally:
        proc.kill()
        proc.wait()


def test_a_bad_endpoint_is_one_line_at_start(tiny_cfg, tmp_path):
    """The start-up probe: nothing listens at analyzer.base_url -> AnalyzerUnavailable naming the key to check."""
    import socket

    from opid_mega.skills.llm_analyzer import AnalyzerUnavailable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connection refused
    cfg = tiny_cfg("analyzer.backend=llm", f"analyzer.base_url=http://127.0.0.1:{port}/v1", "analyzer.model=m",
                   "analyzer.max_retries=0")
    with pytest.raises(AnalyzerUnavailable, match="analyzer.base_url") as e:
        build_analyzer(cfg, None, tmp_path, launch=None)
    assert "\n" not in str(e.value)


def test_empty_model_is_a_clear_error(tiny_cfg, tmp_path):
    cfg = tiny_cfg("analyzer.backend=llm", "analyzer.base_url=")
    with pytest.raises(ValueError, match="analyzer.model"):
        build_analyzer(cfg, None, tmp_path)


def test_launches_a_server_for_the_model_and_shuts_it_down(tiny_cfg, tmp_path):
    argv_file = tmp_path / "argv.json"
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_SERVER.format(python=sys.executable, argv_file=str(argv_file)))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    cfg = tiny_cfg("analyzer.backend=llm", "analyzer.base_url=", "analyzer.model=/models/analyzer-7b",
                   "analyzer.max_retries=0", "analyzer.sglang_args=[--tp, '2']")
    analyzer, server = build_analyzer(cfg, None, tmp_path,
                                      launch=lambda c, d: launch_analyzer_server(c, d, python=str(fake)))
    try:
        argv = json.loads(argv_file.read_text())
        # through opid_mega.infra.keyed: the run's API key reaches the server by a pipe, never on its command line
        assert argv[:4] == ["-m", "opid_mega.infra.keyed", "sglang.launch_server", "--model-path"]
        assert argv[4] == "/models/analyzer-7b" and "--api-key" not in argv
        assert argv[-2:] == ["--tp", "2"]  # analyzer.sglang_args verbatim, after the launcher's own flags
        assert analyzer.url == server.url + "/v1/chat/completions" and analyzer.model == "/models/analyzer-7b"
        assert server.log_path.startswith(str(tmp_path / "sglang_analyzer"))
        (result,) = analyzer.analyze([_view()])  # a real request through the launched server
        assert result.episode_skill == "Open the box first." and result.step_skills == {0: "Go east."}
    finally:
        analyzer.close()
        server.shutdown()
    assert server._proc.poll() is not None  # the launched server is gone
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)


def test_a_builtin_model_name_launches_the_prepared_offline_model(tiny_cfg, tmp_path, monkeypatch):
    """analyzer.model=smollm2-135m (a built-in): the launched server and the client get the prepared directory."""
    import opid_mega.models as models

    built = []
    monkeypatch.setattr(models, "prepare_model", lambda name, *a, **k: built.append(name) or f"/cache/{name}")
    seen = {}

    def launch(c, d):
        seen["model"] = c.analyzer.model
        raise RuntimeError("stop here")

    cfg = tiny_cfg("analyzer.backend=llm", "analyzer.base_url=", "analyzer.model=smollm2-135m")
    with pytest.raises(RuntimeError, match="stop here"):
        build_analyzer(cfg, None, tmp_path, launch=launch)
    assert built == ["smollm2-135m"] and seen == {"model": "/cache/smollm2-135m"}
    assert cfg.analyzer.model == "smollm2-135m"  # the caller's config is not changed
