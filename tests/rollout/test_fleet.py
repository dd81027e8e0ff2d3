"""Rollout fleet (opid_mega.rollout.fleet).

Fast: the split / ordering / seed / failover / fan-out logic over in-process engines (unit level only), per-prompt
seeds through a real SGLangEngine against a small recording HTTP server, the launch env and launch_fleet's
cleanup with real processes. Slow: THREE real SGLang CPU servers (tiny Qwen3, fp32) of the session pool
(tests/rollout/conftest.py): (a) the client-balanced fleet equals one server (greedy tokens, log-probs within 1e-5 of
the largest |log-prob|, ~1e-4 nats) with prompts on both servers; a frozen server leaves rotation (it is thawed);
(c) the same through sglang-router, then one worker SIGKILLed mid-call; (b) a server SIGKILLed during a client-fleet
call: every prompt answered, retried_requests > 0, dead_servers == 1, results equal to the run without the kill.
The tests that kill a server take it out of the pool (marked take=True: they run after the sharing tests).
"""
import importlib.util
import json
import os
import signal
import stat
import sys
import threading
import time
import pytest
import torch

from opid_mega.rollout.engine import EngineError, GenerationResult, SamplingParams
from opid_mega.rollout.fleet import FleetEngine, RouterFleet, launch_fleet
from opid_mega.rollout.sglang_engine import SGLangEngine
from tolerance import assert_close_scaled

REL = 1e-5  # log-probs of two fp32 servers: relative to the largest |log-prob| (~-11: ~1e-4 nats)
HAVE_ROUTER = importlib.util.find_spec("sglang_router") is not None


# ---- unit level: in-process engines ----------------------------------------------------------------------------
class _Engine:
    """Answers response_ids = [seed, len(prompt), prompt[0]] after `delay` s; `fail_after` calls succeed, then it
    raises EngineError (a dead server) on every call."""

    def __init__(self, name, delay=0.0, fail_after=None, error="connection refused"):
        self.url = f"http://{name}"
        self.delay, self.fail_after, self.error = delay, fail_after, error
        self.calls, self.prompts, self.weights, self.shut = 0, 0, [], False
        self.lock = threading.Lock()

    def generate(self, prompts, sampling, seeds=None):
        with self.lock:
            self.calls += 1
            failing = self.fail_after is not None and self.calls > self.fail_after
        time.sleep(self.delay)
        if failing:
            raise EngineError(f"SGLang POST /generate at {self.url} failed after 6 attempts: {self.error}")
        with self.lock:
            self.prompts += len(prompts)
        return [GenerationResult([s, len(p), p[0]], [0.0, 0.0, 0.0]) for p, s in zip(prompts, seeds)]

    def update_weights(self, named_tensors, **kw):
        for i, (name, t) in enumerate(named_tensors):
            if self.fail_after is not None and i >= self.fail_after:
                raise EngineError(f"{self.url}: update refused")
            self.weights.append(name)

    def update_weights_from_disk(self, path):
        if self.fail_after == 0:
            raise EngineError(f"{self.url}: gone")
        self.weights.append(path)

    def health(self):
        return self.fail_after is None

    def shutdown(self):
        self.shut = True


def _prompts(n):
    return [[100 + i] * (1 + i % 5) for i in range(n)]


def test_results_in_prompt_order_with_global_seeds_and_balanced_load():
    engines = [_Engine("a", 0.01), _Engine("b", 0.01), _Engine("c", 0.01)]
    fleet = FleetEngine(engines, chunk_prompts=2, max_inflight_prompts=2)
    out = fleet.generate(_prompts(23), SamplingParams(seed=1000))
    assert [r.response_ids for r in out] == [[1000 + i, 1 + i % 5, 100 + i] for i in range(23)]
    assert all(e.prompts > 0 for e in engines) and sum(e.prompts for e in engines) == 23
    st = fleet.stats()
    assert [st[f"rollout/server{k}_prompts"] for k in range(3)] == [e.prompts for e in engines]
    assert st["rollout/retried_requests"] == 0 and st["rollout/dead_servers"] == 0 and st["rollout/servers_alive"] == 3
    # the same seeds whatever the split; no seed at all when the sampling has none
    again = FleetEngine(engines[:1], chunk_prompts=5).generate(_prompts(23), SamplingParams(seed=1000))
    assert [r.response_ids for r in again] == [r.response_ids for r in out]
    assert fleet.generate(_prompts(3), SamplingParams())[0].response_ids[0] is None
    assert fleet.generate([], SamplingParams()) == []


def test_a_slow_server_gets_less_work():
    fast, slow = _Engine("fast", 0.005), _Engine("slow", 0.2)
    FleetEngine([slow, fast], chunk_prompts=1, max_inflight_prompts=1).generate(_prompts(30), SamplingParams(seed=0))
    assert fast.prompts > 3 * slow.prompts > 0


def test_a_dead_server_leaves_rotation_and_its_chunks_are_retried():
    # the bad server fails its first call; the good one is slow enough (7 chunks x 0.1 s) that the bad one's worker
    # surely asks for a chunk before the good one has taken them all, on a loaded machine too
    good, bad = _Engine("good", 0.1), _Engine("bad", 0.01, fail_after=0)
    fleet = FleetEngine([bad, good], chunk_prompts=3)
    out = fleet.generate(_prompts(20), SamplingParams(seed=7))
    assert [r.response_ids for r in out] == [[7 + i, 1 + i % 5, 100 + i] for i in range(20)]  # nothing lost
    st = fleet.stats()
    assert st["rollout/dead_servers"] == 1 and st["rollout/servers_alive"] == 1
    assert st["rollout/retried_requests"] >= 3 and st["rollout/retried_requests"] % 3 == 0
    assert st["rollout/server0_prompts"] + st["rollout/server1_prompts"] == 20 == bad.prompts + good.prompts
    assert "connection refused" in fleet.dead_servers()["http://bad"]
    calls = bad.calls
    fleet.generate(_prompts(5), SamplingParams())
    assert bad.calls == calls and fleet.url == "http://good"  # out of rotation for good


def test_no_server_left_names_every_server():
    fleet = FleetEngine([_Engine("a", fail_after=0, error="reset by peer"), _Engine("b", fail_after=0)])
    with pytest.raises(EngineError, match=r"(?s)no live server left.*http://a: .*reset by peer.*http://b: "):
        fleet.generate(_prompts(4), SamplingParams())
    assert fleet.stats()["rollout/dead_servers"] == 2 and not fleet.health()


def test_a_rejected_request_is_raised_not_failed_over():
    bad_request = _Engine("a", fail_after=0, error="x")
    bad_request.error = None
    fleet = FleetEngine([bad_request, _Engine("b", fail_after=0)])

    def reject(prompts, sampling, seeds=None):
        raise EngineError("SGLang POST /generate failed with HTTP 400: prompt too long")

    bad_request.generate = reject
    fleet.servers[1].engine.generate = reject
    with pytest.raises(EngineError, match="HTTP 400"):
        fleet.generate(_prompts(4), SamplingParams())
    assert fleet.stats()["rollout/dead_servers"] == 0
    with pytest.raises(ValueError, match="seeds for"):
        fleet.generate(_prompts(4), SamplingParams(), seeds=[1])


def test_weights_are_streamed_once_to_every_server_and_a_failing_one_leaves():
    a, b, c = _Engine("a"), _Engine("b"), _Engine("c", fail_after=2)
    fleet = FleetEngine([a, b, c], weight_queue_size=1)
    read = []

    def tensors():
        for i in range(6):
            read.append(i)
            yield f"w{i}", torch.zeros(2)

    fleet.update_weights(tensors())
    assert read == list(range(6))  # the caller's iterator is read once
    assert a.weights == b.weights == [f"w{i}" for i in range(6)]
    assert fleet.stats()["rollout/dead_servers"] == 1 and "update refused" in fleet.dead_servers()["http://c"]
    fleet.update_weights_from_disk("/ckpt")
    assert a.weights[-1] == b.weights[-1] == "/ckpt" and c.weights == ["w0", "w1"]

    def refuse(named_tensors, **kw):  # a tensor the served model does not have: the caller's bug, not a dead server
        list(named_tensors)
        raise type("WeightMismatch", (EngineError,), {})("the served model has no tensor 'x'")

    a.update_weights = b.update_weights = refuse
    with pytest.raises(EngineError, match="no tensor 'x'"):
        fleet.update_weights(tensors())
    assert fleet.stats()["rollout/servers_alive"] == 2
    a.fail_after = b.fail_after = 0
    with pytest.raises(EngineError, match="no live server left"):
        fleet.update_weights_from_disk("/ckpt2")
    fleet.shutdown()
    assert a.shut and b.shut and c.shut


# ---- per-prompt seeds through a real SGLangEngine (HTTP) -------------------------------------------------------
def _recording_server(fake_sglang):
    """A fake server that records every /generate payload and answers each prompt with [its sampling_seed, its
    first token]."""
    payloads = []

    def generate(req):
        payloads.append(req)
        return 200, [{"output_ids": [p.get("sampling_seed", -1), ids[0]], "meta_info": {
            "finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, 0, None]] * 2}}
            for ids, p in zip(req["input_ids"], req["sampling_params"])]

    server = fake_sglang(generate)
    server.payloads = payloads
    return server


def test_per_prompt_seeds_reach_the_servers(fake_sglang):
    servers = [_recording_server(fake_sglang), _recording_server(fake_sglang)]
    one = SGLangEngine(url=servers[0].url)
    assert [r.response_ids for r in one.generate([[5], [6]], SamplingParams(seed=10))] == [[10, 5], [11, 6]]
    assert [r.response_ids for r in one.generate([[5], [6]], SamplingParams(seed=10), seeds=[3, 9])] == \
        [[3, 5], [9, 6]]
    assert [p["sampling_seed"] for p in servers[0].payloads[-1]["sampling_params"]] == [3, 9]
    assert one.generate([[5]], SamplingParams())[0].response_ids == [-1, 5]  # no seed sent
    assert "sampling_seed" not in servers[0].payloads[-1]["sampling_params"][0]
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        one.generate([[5]], SamplingParams(seed=1), seeds=[1, 2])
    fleet = FleetEngine([one, SGLangEngine(url=servers[1].url)], chunk_prompts=3)
    out = fleet.generate([[i] for i in range(14)], SamplingParams(seed=500))
    assert [r.response_ids for r in out] == [[500 + i, i] for i in range(14)]
    assert len(servers[1].payloads) > 0 and fleet.stats()["rollout/server1_prompts"] > 0


# ---- the router over fake workers: deadline, health probes per interval, a frozen worker ---------------------------
class _RouterWorker:
    """A fake worker for SGLang's router (one prompt per request); `frozen_s` > 0 makes /generate and /health hang
    that long (a SIGSTOPped server)."""

    def __init__(self, fake_sglang, tag):
        self.frozen_s, self.tag, self.generates = 0.0, tag, 0
        worker = self

        class Routes:
            def get(self, path):
                if path.startswith("/health") and worker.frozen_s:
                    time.sleep(worker.frozen_s)
                return None

            def post(self, path, body):
                return None

        def generate(req):
            if worker.frozen_s:
                time.sleep(worker.frozen_s)
            worker.generates += 1
            return 200, {"output_ids": [worker.tag, req["input_ids"][0]], "meta_info": {
                "finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, 0, None]] * 2}}

        self.server = fake_sglang(generate, routes=Routes())
        self.engine = SGLangEngine(url=self.server.url, startup_timeout_s=10, max_retries=0)
        self.probes = 0
        probe = self.engine.health

        def counted(**kw):
            self.probes += 1
            return probe(**kw)

        self.engine.health = counted


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_ROUTER, reason="sglang-router not installed")
def test_router_fleet_deadline_health_interval_and_a_frozen_worker(fake_sglang, tmp_path):
    from opid_mega.rollout.engine import RolloutDeadline

    a, b = _RouterWorker(fake_sglang, 1), _RouterWorker(fake_sglang, 2)
    fleet = RouterFleet([a.engine, b.engine], router_args=["--policy", "round_robin"], log_dir=str(tmp_path),
                        owns=False, health_interval_s=3600.0, request_timeout_s=3.0)
    try:
        sp = SamplingParams(max_new_tokens=2)
        for _ in range(4):  # no /health probe per call (SGLang's /health runs a generation: >= 1 s each)
            assert [r.response_ids for r in fleet.generate([[5], [6]], sp)] in ([[1, 5], [2, 6]], [[2, 5], [1, 6]])
        assert (a.probes, b.probes) == (0, 0) and a.generates + b.generates == 8
        fleet.health_interval_s = 0.0  # the interval is up: one probe of each worker before the call
        fleet.generate([[5]], sp)
        assert (a.probes, b.probes) == (1, 1)
        fleet.health_interval_s = 3600.0

        a.frozen_s = b.frozen_s = 5.0  # the deadline cuts a request that would take 5 s
        t0 = time.monotonic()
        with pytest.raises(RolloutDeadline):
            fleet.generate([[7]], sp, deadline=time.monotonic() + 1.0)
        assert time.monotonic() - t0 < 2.5
        b.frozen_s = 0.0
        time.sleep(5.5)  # the frozen requests drain

        a.frozen_s = 60.0  # worker a freezes: its request times out (3 s), the probe finds it, it leaves rotation
        t0 = time.monotonic()
        out = fleet.generate([[i] for i in range(6)], sp)
        took = time.monotonic() - t0
        print(f"router with a frozen worker: {took:.1f} s; {fleet.stats()}")
        assert [r.response_ids for r in out] == [[2, i] for i in range(6)]  # all answered by b
        assert a.engine.url in fleet.dead_servers() and b.engine.url not in fleet.dead_servers()
        deadline = time.monotonic() + 10
        while a.engine.url in fleet.router_workers() and time.monotonic() < deadline:
            time.sleep(0.2)  # the router removes workers in the background
        assert fleet.router_workers() == [b.engine.url]
        b0 = b.generates
        fleet.generate([[9], [10]], sp)  # no request reaches the frozen worker any more
        assert b.generates == b0 + 2 and took < 20
    finally:
        a.frozen_s = 0.0
        fleet.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_ROUTER, reason="sglang-router not installed")
def test_a_router_request_whose_workers_fail_ends_within_its_deadline(fake_sglang, tmp_path):
    """A node cut off: two of three workers frozen (their /generate and /health hang 30 s). Requests routed there get
    no reply within the request timeout (2 s); the probes of every worker that follow run at once, cut at the
    rollout deadline, and the call ends (answered or RolloutDeadline) within the deadline + 2 s. Before, each failed
    request probed the workers one after another (10 s each) and made two 10 s router calls per removal: ~25 s
    here, past a 5 s deadline."""
    from opid_mega.rollout.engine import RolloutDeadline

    workers = [_RouterWorker(fake_sglang, k) for k in (1, 2, 3)]
    fleet = RouterFleet([w.engine for w in workers], router_args=["--policy", "round_robin"], log_dir=str(tmp_path),
                        owns=False, health_interval_s=3600.0, request_timeout_s=2.0)
    try:
        workers[0].frozen_s = workers[1].frozen_s = 30.0
        t0 = time.monotonic()
        try:
            out = fleet.generate([[i] for i in range(6)], SamplingParams(max_new_tokens=2), deadline=t0 + 5.0)
            ended = "answered"
            assert [r.response_ids[1] for r in out] == list(range(6))
        except RolloutDeadline:
            ended = "RolloutDeadline"
        took = time.monotonic() - t0
        print(f"router, 2 of 3 workers frozen, deadline 5 s: {ended} after {took:.1f} s; probes "
              f"{[w.probes for w in workers]}; {fleet.stats()}")
        assert took <= 5.0 + 2.0
        assert workers[2].probes >= 1  # a failure was followed by a probe burst
    finally:
        for w in workers:
            w.frozen_s = 0.0
        fleet.shutdown()


# ---- launching: env, and a failed start shuts the others down ---------------------------------------------------
_FAKE_SERVER = r'''#!{python}
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
with open(os.path.join({out!r}, "env_%d" % os.getpid()), "w") as f:
    json.dump(dict(os.environ), f)
if os.environ.get("FAKE_FAIL") == "1":
    sys.exit(3)
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        data = json.dumps({{"tp_size": 1}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _fake_python(tmp_path):
    exe = tmp_path / "fake_python"
    exe.write_text(_FAKE_SERVER.format(python=sys.executable, out=str(tmp_path)))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_launch_fleet_env_and_cleanup(tmp_path, monkeypatch):
    monkeypatch.setenv("OPID_FLEET_TEST_DROP", "x")
    fake = _fake_python(tmp_path)
    fleet = launch_fleet("/m", 2, ["--dtype", "float32"], log_dir=str(tmp_path), mem_fraction=0.3,
                         envs=[{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1,2",
                                                                "OPID_FLEET_TEST_DROP": None}],
                         engine_options={"python": fake, "startup_timeout_s": 30, "cpu": False})
    pids = [e.pid for e in fleet.engines]
    envs = [json.loads((tmp_path / f"env_{pid}").read_text()) for pid in pids]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1,2"]
    assert envs[0]["OPID_FLEET_TEST_DROP"] == "x" and "OPID_FLEET_TEST_DROP" not in envs[1]
    assert all(e.command[-2:] == ["--mem-fraction-static", "0.3"] for e in fleet.engines)
    assert fleet.health() and len(set(fleet.urls)) == 2
    fleet.shutdown()
    assert not any(_alive(p) for p in pids)

    started = []
    orig = SGLangEngine._launch

    def record(self, *a, **kw):
        orig(self, *a, **kw)
        started.append(self)

    monkeypatch.setattr(SGLangEngine, "_launch", record)
    with pytest.raises(EngineError, match=r"(?s)server 2 of 3 failed to start.*the others were shut down.*code 3"):
        launch_fleet("/m", 3, log_dir=str(tmp_path), envs=[{}, {}, {"FAKE_FAIL": "1"}],
                     engine_options={"python": fake, "startup_timeout_s": 30, "cpu": False})
    assert len(started) == 3
    time.sleep(0.2)
    assert not any(_alive(e.pid) for e in started)  # the two that started are shut down


# ---- real SGLang CPU servers of the session pool (tests/rollout/conftest.py) -------------------------------------
def _real_prompts(n=24):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 151000, (int(k),), generator=g).tolist()
            for k in torch.randint(2, 20, (n,), generator=g)]


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="session")
def reference(sglang_pool):
    """All prompts through one server alone (pool server 0, serving the checkpoint), in one call."""
    return sglang_pool.shared(1)[0].generate(_real_prompts(), GREEDY)


def _assert_same(out, ref):
    assert len(out) == len(ref) and all(r is not None for r in out)
    assert [r.response_ids for r in out] == [r.response_ids for r in ref]
    assert all(r.finish_reason == "length" and len(r.logprobs) == GREEDY.max_new_tokens for r in out)
    assert_close_scaled([x for r in out for x in r.logprobs], [x for r in ref for x in r.logprobs], rel=REL,
                        msg="fleet vs one server")


def _kill_when_busy(fleet, victim, run, busy):
    """Run `run()` in a thread, SIGKILL `victim`'s process group once `busy()` says it has work in flight, and
    return run()'s result."""
    box = {}

    def target():
        try:
            box["out"] = run()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while not busy() and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.02)
    assert busy(), "the victim never had requests in flight"
    time.sleep(0.3)  # mid-generation
    os.killpg(victim.pid, signal.SIGKILL)
    t.join(300)
    assert not t.is_alive()
    if "error" in box:
        raise box["error"]
    return box["out"]


@pytest.mark.slow
@pytest.mark.sglang_servers(shared=2)
def test_client_fleet_equals_one_server(sglang_pool, reference):
    servers = sglang_pool.shared(2)
    fleet = FleetEngine(servers[:2], chunk_prompts=3, owns=False)
    t0 = time.monotonic()
    out = fleet.generate(_real_prompts(), GREEDY)
    print(f"client fleet of 2: {len(out)} prompts in {time.monotonic() - t0:.1f} s; {fleet.stats()}")
    _assert_same(out, reference)
    st = fleet.stats()
    assert st["rollout/server0_prompts"] > 0 and st["rollout/server1_prompts"] > 0
    assert st["rollout/server0_prompts"] + st["rollout/server1_prompts"] == len(out)
    assert st["rollout/retried_requests"] == 0 and st["rollout/servers_alive"] == 2


@pytest.mark.slow
@pytest.mark.sglang_servers(shared=3)  # freezes the third, thaws it
def test_client_fleet_routes_around_a_frozen_server(sglang_pool, reference):
    """Issue 22: one server's scheduler frozen (SIGSTOP: the server is alive and accepts requests, answers none):
    the requests sent to it pass the per-request timeout, it leaves rotation like a dead one and the other server
    answers every prompt (the same results); then it is thawed for the tests after this one."""
    from launch.test_fleet_multinode import _scheduler_pid

    servers = sglang_pool.shared(3)  # shared: thawed and idle again at the end
    victim, timeout = servers[2], 8.0
    # attached engines with a short request timeout (before the freeze: attaching asks the server for its info)
    engines = [SGLangEngine(url=e.url, request_timeout_s=timeout) for e in (servers[0], victim)]
    fleet = FleetEngine(engines, chunk_prompts=3, owns=False)
    t0 = time.monotonic()
    servers[0].generate(_real_prompts(), GREEDY)
    alone = time.monotonic() - t0  # what the other server needs for every prompt on its own
    frozen = _scheduler_pid(victim.pid)
    os.kill(frozen, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        out = fleet.generate(_real_prompts(), GREEDY)
        elapsed = time.monotonic() - t0
    finally:
        os.kill(frozen, signal.SIGCONT)
    st = fleet.stats()
    print(f"client fleet with a frozen server: {elapsed:.1f} s (request timeout {timeout:.0f} s, the other server "
          f"alone {alone:.1f} s); {st}")
    _assert_same(out, reference)
    assert st["rollout/dead_servers"] == 1 and "no reply within 8 s" in fleet.dead_servers()[victim.url]
    assert st["rollout/retried_requests"] > 0 and st["rollout/server0_prompts"] == len(out)
    # about the timeout once, then the other server's work: the bound (5x that) only catches a hang on the frozen one
    assert elapsed < 5 * (timeout + alone)
    deadline = time.monotonic() + 120
    while not victim.health() and time.monotonic() < deadline:  # thawed: it serves again for the next tests
        time.sleep(0.5)
    assert victim.health()
    served = -1
    while served != _served(victim) and time.monotonic() < deadline:  # nothing abandoned still finishing there
        served = _served(victim)
        time.sleep(3.0)


def _served(engine):
    """Requests a real server has finished, from its log (SGLang logs one 'POST /generate ... 200' per request)."""
    with open(engine.log_path, errors="replace") as f:
        return sum('"POST /generate HTTP/1.1" 200' in line for line in f)


def _router_generate_errors(fleet):
    """Requests the router saw fail on a worker (its log has one ERROR line from routers::http::router each)."""
    with open(fleet.router_log_path, errors="replace") as f:
        return sum("ERROR" in line and "routers::http::router" in line for line in f)


@pytest.mark.slow
@pytest.mark.sglang_servers(shared=2, take=True)  # kills its third worker
@pytest.mark.skipif(not HAVE_ROUTER, reason="sglang-router not installed (pip install sglang-router)")
def test_router_fleet_equals_one_server_and_survives_a_dead_worker(sglang_pool, request, reference, tmp_path):
    victim = sglang_pool.take(request)
    servers = sglang_pool.shared(2) + [victim]
    before = [_served(e) for e in servers]
    # 4 requests in flight at a time, one prompt each, round robin over the 3 workers: the victim always has work
    fleet = RouterFleet(servers, router_args=["--policy", "round_robin"], log_dir=str(tmp_path), owns=False,
                        max_threads=4)
    try:
        out = fleet.generate(_real_prompts(), GREEDY)
        _assert_same(out, reference)
        spread = [_served(e) - b for e, b in zip(servers, before)]
        print(f"router: requests per worker {spread}")
        assert all(n > 0 for n in spread) and sum(spread) == len(out)

        t0 = time.monotonic()
        out = _kill_when_busy(fleet, victim, lambda: fleet.generate(_real_prompts(), GREEDY),
                              lambda: _served(victim) > before[2] + spread[2])
        st, router_errors = fleet.stats(), _router_generate_errors(fleet)
        print(f"router with a worker SIGKILLed mid-call: {time.monotonic() - t0:.1f} s; {st}; requests that failed "
              f"on a worker inside the router: {router_errors}")
        _assert_same(out, reference)
        assert router_errors + st["rollout/retried_requests"] > 0  # something was in flight on the victim
        assert st["rollout/router_alive"] == 1

        out = fleet.generate(_real_prompts()[:6], GREEDY)  # finds the dead worker, takes it out of the router
        _assert_same(out, reference[:6])
        assert fleet.stats()["rollout/dead_servers"] == 1 and victim.url in fleet.dead_servers()
        deadline = time.monotonic() + 10
        while victim.url in fleet.router_workers() and time.monotonic() < deadline:
            time.sleep(0.2)  # the router removes workers in the background
        assert sorted(fleet.router_workers()) == sorted([servers[0].url, servers[1].url])

        os.killpg(fleet.router_pid, signal.SIGKILL)  # the router dies: client balancing over the live workers
        time.sleep(0.3)
        out = fleet.generate(_real_prompts(), GREEDY)
        _assert_same(out, reference)
        st = fleet.stats()
        assert st["rollout/router_alive"] == 0
        assert st["rollout/server0_prompts"] > 0 and st["rollout/server1_prompts"] > 0
    finally:
        fleet.shutdown()
    time.sleep(0.2)
    assert not _alive(fleet.router_pid)
    assert servers[0].health() and servers[1].health()  # owns=False: the workers are left running


@pytest.mark.slow
@pytest.mark.sglang_servers(shared=1, take=True)  # kills its second server
def test_client_fleet_loses_nothing_when_a_server_dies(sglang_pool, request, reference):
    victim = sglang_pool.take(request)
    servers = sglang_pool.shared(1) + [victim]
    assert victim.health(), "the client-fleet kill test needs server 1 alive"
    fleet = FleetEngine(servers[:2], chunk_prompts=2, max_inflight_prompts=4, owns=False)
    t0 = time.monotonic()
    out = _kill_when_busy(fleet, victim, lambda: fleet.generate(_real_prompts(), GREEDY),
                          lambda: fleet.servers[1].prompts_served > 0 and fleet.servers[1].inflight_prompts > 0)
    st = fleet.stats()
    print(f"client fleet with a server SIGKILLed mid-call: {time.monotonic() - t0:.1f} s; {st}")
    _assert_same(out, reference)
    assert st["rollout/retried_requests"] > 0 and st["rollout/dead_servers"] == 1
    assert st["rollout/servers_alive"] == 1 and victim.url in fleet.dead_servers()
    assert st["rollout/server0_prompts"] + st["rollout/server1_prompts"] == len(out)
