import pytest


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """Built-in models are built once per test session, in a temp dir (tiny-qwen3: ~5 s)."""
    return str(tmp_path_factory.mktemp("opid_models"))


@pytest.fixture(scope="session")
def tiny_qwen3(model_cache):
    from opid_mega.models import prepare_model

    return prepare_model("tiny-qwen3", model_cache)


@pytest.fixture(scope="session")
def qwen_tokenizer(tiny_qwen3):
    from opid_mega.models import load_tokenizer

    return load_tokenizer(tiny_qwen3)


# ---- SGLang servers for the tests: a fake one (HTTP, in a thread) and the real CPU server's flags -------------------
def cpu_server_args(max_total_tokens: int = 16384, max_running_requests: int = 8) -> list:
    """launch_server flags of the real SGLang CPU test servers (fp32, small KV pool, no radix cache)."""
    return ["--dtype", "float32", "--max-total-tokens", str(max_total_tokens),
            "--max-running-requests", str(max_running_requests), "--disable-radix-cache"]


@pytest.fixture(scope="session")
def real_sglang_cpu():
    """Skips the test unless a real SGLang server can serve on this machine's CPU; returns cpu_server_args."""
    import importlib.util

    import torch

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang not installed (tools/install_sglang_cpu.sh)")
    if torch.cuda.is_available():
        pytest.skip("this test serves on CPU")
    return cpu_server_args


class FakeSGLang:
    """A minimal HTTP server speaking the bits of SGLang's API the engine uses: GET /server_info answers tp_size 1
    (any other GET: {}), POST /generate answers `on_generate(request json) -> (status, body)`."""

    def __init__(self, on_generate):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"tp_size": 1} if self.path == "/server_info" else {})

            def do_POST(self):
                self._send(*on_generate(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_sglang():
    """Factory of :class:`FakeSGLang` servers, all closed after the test."""
    made = []

    def make(on_generate):
        made.append(FakeSGLang(on_generate))
        return made[-1]

    yield make
    for s in made:
        s.close()
