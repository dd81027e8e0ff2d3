import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: sglang_fake, tolerance


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


@pytest.fixture
def fake_sglang():
    """Factory of :class:`FakeSGLang` servers (tests/sglang_fake.py), all closed after the test:
    make(on_generate, routes=None, tp_size=1); routes=StrictSGLang(...) adds SGLang's strict memory state machine."""
    from sglang_fake import FakeSGLang

    made = []

    def make(on_generate=None, routes=None, tp_size: int = 1):
        made.append(FakeSGLang(on_generate, routes=routes, tp_size=tp_size))
        return made[-1]

    yield make
    for s in made:
        s.close()
