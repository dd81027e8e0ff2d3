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


# ---- one session pool of real SGLang CPU servers ---------------------------------------------------------------
# A server start costs ~40 s on 2 idle cores (3 started together: ~75 s), so the real-server tests of test_fleet.py,
# test_sglang_engine.py and test_weight_sync.py share the servers of one pool: 3 starts for all of them, at once,
# instead of 5 (one module fixture each). Every test using the pool declares what it uses with the marker
# `sglang_servers(shared=k, take=False)` (checked at collection). The pool's contract, which makes no test depend on
# another's side effects:
#   - sglang_pool.shared(n): the first n shared servers, each alive and serving the checkpoint's weights, checked when
#     handed out: a dead one is replaced by a fresh start; one whose greedy probe differs from the probe it answered
#     when it started (a test changed its weights) reloads the checkpoint from disk and must then answer it again.
#     A test may change a shared server's weights, or freeze it and thaw it; it must leave it alive.
#   - sglang_pool.take(request): one server for the calling test alone (marked take=True), never handed out again:
#     the test may kill it.
# The order (pytest_collection_modifyitems below): the taking tests run right after the last sharing test, those
# that also use more shared servers first. Each take removes a server for good: a take before a test that needs more
# servers than are left would cost a fresh start. The order saves server starts; no result depends on it. In a
# whole run: the fleet tests share 3 servers (one frozen and thawed), test_weight_sync changes a shared server's
# weights; then the router test takes one (+2 shared), the client-fleet kill test one (+1), test_sglang_engine the
# last one. The pool starts the servers the selected tests need in all (see _planned_size) together, at first use.
POOL_SERVER_ARGS = cpu_server_args(max_total_tokens=16384, max_running_requests=16)  # 16: the fleet tests' 24 prompts
POOL_PROBE = list(range(1000, 1012))  # 12 prompt tokens; the greedy continuation tells the weights apart
POOL_MARK = "sglang_servers"
POOL_SIZE = pytest.StashKey[int]()


def pytest_configure(config):
    config.addinivalue_line("markers", f"{POOL_MARK}(shared=0, take=False): the test uses `shared` shared servers of the "
                                       "session's SGLang pool and, with take=True, takes one more for itself (it may "
                                       "kill it); taking tests run after the sharing ones (tests/rollout/conftest.py)")


def _pool_use(item):
    """(shared, take) that `item` declares, or None when it does not use the pool."""
    mark = item.get_closest_marker(POOL_MARK)
    if mark is None:
        if "sglang_pool" in getattr(item, "fixturenames", ()):
            raise pytest.UsageError(f"{item.nodeid} uses sglang_pool: declare what it uses with "
                                    f"@pytest.mark.{POOL_MARK}(shared=k, take=...)")
        return None
    return int(mark.kwargs.get("shared", 0)), bool(mark.kwargs.get("take", False))


@pytest.hookimpl(trylast=True)  # after -k / -m / --deselect: the plan counts the tests that run
def pytest_collection_modifyitems(config, items):
    """Taking tests right after the last sharing test, more shared servers first (else in collection order)."""
    uses = {it: _pool_use(it) for it in items}
    takers = sorted((it for it in items if uses[it] and uses[it][1]), key=lambda it: -uses[it][0])  # stable
    sharers = [i for i, it in enumerate(items) if uses[it] and not uses[it][1]]
    if takers and sharers:
        rest = [it for it in items if it not in set(takers)]
        at = rest.index(items[sharers[-1]]) + 1
        items[:] = rest[:at] + takers + rest[at:]
    config.stash[POOL_SIZE] = _planned_size([uses[it] for it in items if uses[it]])


def _planned_size(uses) -> int:
    """Servers the pool starts for these (shared, take) uses in this order: taker i (counting from 0) has i servers
    taken before it and needs shared + 1."""
    takers = [shared for shared, take in uses if take]
    return max([shared for shared, take in uses if not take] + [shared + i + 1 for i, shared in enumerate(takers)],
               default=0)


class SGLangPool:
    """Real SGLang CPU servers of tiny Qwen3, all launched with POOL_SERVER_ARGS; the first need starts the `planned`
    number at once (starts overlap: 3 take about twice as long as one), later needs (replacements) what is missing."""

    def __init__(self, model_dir: str, log_dir: str, planned: int):
        self.model_dir, self.log_dir, self.planned = model_dir, log_dir, planned
        self.shared_servers: list = []  # handed out by shared(n), in start order
        self.taken: list = []
        self.probes: dict = {}  # url -> (response_ids, logprobs) of POOL_PROBE right after the start
        self.starts = 0

    def _probe(self, engine):
        from opid_mega.rollout.engine import SamplingParams

        r = engine.generate([POOL_PROBE], SamplingParams(temperature=0.0, max_new_tokens=4))[0]
        return r.response_ids, r.logprobs

    def _serves_checkpoint(self, engine) -> bool:
        (ids, lps), (ids0, lps0) = self._probe(engine), self.probes[engine.url]
        scale = max(abs(x) for x in lps0)
        return ids == ids0 and max(abs(a - b) for a, b in zip(lps, lps0)) <= 1e-5 * scale  # the tests' REL

    def _start(self, n: int) -> None:
        import time

        from opid_mega.rollout.fleet import launch_fleet

        n = max(n, self.planned - self.starts)
        t0 = time.monotonic()
        engines = launch_fleet(self.model_dir, n, POOL_SERVER_ARGS, log_dir=self.log_dir,
                               engine_options={"startup_timeout_s": 300}).engines
        for e in engines:
            self.probes[e.url] = self._probe(e)
        self.starts += n
        self.shared_servers += engines
        print(f"\nSGLang pool: {n} CPU server(s) started in {time.monotonic() - t0:.1f} s ({self.starts} in all, "
              f"{self.planned} planned)")

    def _check(self) -> None:
        """Drop dead shared servers; reload the checkpoint into those that serve other weights."""
        for e in list(self.shared_servers):
            if not e.health():
                print(f"\nSGLang pool: {e.url} is dead, dropped")
                e.shutdown()
                self.shared_servers.remove(e)
            elif not self._serves_checkpoint(e):
                print(f"\nSGLang pool: {e.url} serves other weights, reloading the checkpoint")
                e.update_weights_from_disk(self.model_dir)
                assert self._serves_checkpoint(e), f"{e.url} still serves other weights after reloading the checkpoint"

    def shared(self, n: int) -> list:
        self._check()
        if len(self.shared_servers) < n:
            self._start(n - len(self.shared_servers))
        return self.shared_servers[:n]

    def take(self, request):
        use = _pool_use(request.node)
        if not (use and use[1]):
            raise pytest.UsageError(f"{request.node.nodeid} takes a server out of the SGLang pool: mark it "
                                    f"@pytest.mark.{POOL_MARK}(shared=k, take=True)")
        self._check()
        if not self.shared_servers:
            self._start(1)
        self.taken.append(self.shared_servers.pop())  # the last started: shared(n) hands out the first ones
        return self.taken[-1]

    def shutdown(self) -> None:
        for e in self.shared_servers + self.taken:
            e.shutdown()


@pytest.fixture(scope="session")
def sglang_pool(request, tiny_qwen3, tmp_path_factory, real_sglang_cpu):
    """The session's pool of real SGLang CPU servers (see the contract above); skips where real_sglang_cpu does."""
    pool = SGLangPool(tiny_qwen3, str(tmp_path_factory.mktemp("sglang_pool_logs")),
                      request.config.stash.get(POOL_SIZE, 1))
    yield pool
    pool.shutdown()


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
