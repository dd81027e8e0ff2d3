"""SGLang engine. Fast: command building, weight payloads, attach errors. Slow: ONE real CPU server (tiny Qwen3,
fp32, taken from the session pool of tests/rollout/conftest.py) checked against the local engine on the same weights,
weight updates, and the dead-server error.

Tolerance: greedy tokens must be identical and |log-prob(SGLang) - log-prob(local)| <= 1e-5 of the largest |log-prob|
(~1e-4 nats: REL x ~11, assert_close_scaled). Measured here:
<= 2e-6 (fp32 rounding: the log-probs are ~-11, where one fp32 ulp is 9.5e-7; different kernels, torch_native
attention vs SDPA). 1e-4 leaves room for other CPUs/thread counts while staying far below the effect of any real
difference: the perturbed weights used below move the log-probs by > 1e-2.
"""
import base64
import importlib.util
import os
import pickle
import signal
import time

import pytest
import torch

from opid_mega.rollout import sglang_engine
from opid_mega.rollout.engine import EngineError, SamplingParams
from opid_mega.rollout.sglang_engine import (CPU_SHIMS_DIR, SGLangEngine, build_server_command, reserve_port,
                                             serialize_named_tensors)
from tolerance import assert_close_scaled

TOL = 1e-4  # nats: what "far below the effect of a real weight change" is measured against
REL = 1e-5  # log-prob comparisons: relative to the largest |log-prob|
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


def test_server_command_cpu_defaults_and_verbatim_args():
    cmd = build_server_command("/m", "127.0.0.1", 1234, ["--dtype", "float32", "--mem-fraction-static", "0.5"],
                               cpu=True, python="py")
    # through opid_mega.infra.keyed: the server is tied to its launcher (opid_mega.infra.tether), the key by a pipe
    assert cmd[:10] == ["py", "-m", "opid_mega.infra.keyed", "sglang.launch_server", "--model-path", "/m", "--host",
                        "127.0.0.1", "--port", "1234"]
    assert cmd[10:15] == ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
    assert "--sleep-on-idle" in cmd  # an idle CPU server must not spin
    assert cmd.count("--mem-fraction-static") == 1 and cmd[-4:] == ["--dtype", "float32", "--mem-fraction-static",
                                                                    "0.5"]
    assert "--device" not in build_server_command("/m", "h", 1, [], cpu=False)
    with pytest.raises(ValueError, match="must not set --port"):
        build_server_command("/m", "h", 1, ["--port", "5"])
    assert (CPU_SHIMS_DIR / "vllm" / "_custom_ops.py").is_file() and (CPU_SHIMS_DIR / "torchvision").is_dir()


def test_inline_weight_payload_roundtrip():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(8, 6, generator=g)
    tensors = [("a.weight", big[2:5]), ("b.bias", torch.randn(3, generator=g, dtype=torch.float64))]
    out = pickle.loads(base64.b64decode(serialize_named_tensors(tensors, "inline")))
    assert [n for n, _ in out] == ["a.weight", "b.bias"]
    assert torch.equal(out[0][1], big[2:5]) and out[0][1].untyped_storage().nbytes() == 3 * 6 * 4  # no full storage
    assert torch.equal(out[1][1], tensors[1][1])
    with pytest.raises(ValueError, match="unknown weight transport"):
        serialize_named_tensors(tensors, "carrier-pigeon")


@pytest.mark.skipif(not HAVE_SGLANG, reason="sglang not installed (tools/install_sglang_cpu.sh)")
def test_shm_weight_payload_passes_sglang_safe_unpickler():
    from sglang.srt.utils.common import MultiprocessingSerializer

    t = torch.randn(4, 3)
    out = MultiprocessingSerializer.deserialize(serialize_named_tensors([("w", t)], "shm"))
    assert out[0][0] == "w" and torch.equal(out[0][1], t)


def test_attaching_to_nothing_is_a_clear_error():
    held = reserve_port()
    port = held.getsockname()[1]
    held.close()
    with pytest.raises(EngineError, match=f"127.0.0.1:{port} was not ready after 1 s"):
        SGLangEngine(url=f"http://127.0.0.1:{port}", startup_timeout_s=1)


def test_a_server_that_cannot_start_names_its_log(tmp_path):
    with pytest.raises(EngineError, match="exited with code .*its log is .*sglang_server_"):
        SGLangEngine(str(tmp_path / "no_such_model"), python="false", log_dir=str(tmp_path), startup_timeout_s=30)


def test_a_launched_server_runs_without_sglang_crash_diagnostics_unless_asked(tmp_path, monkeypatch):
    """Stopping a server is no crash: a launched server gets SGLang's crash diagnostics (5 s sleep, py-spy, CUDA core
    dumps) off, unless this process's environment or the launch's env sets them."""
    from opid_mega.rollout.sglang_engine import CRASH_DIAGNOSTICS_ENV

    dump = tmp_path / "env.txt"
    python = tmp_path / "python"  # stands in for the interpreter: records the environment it got, then fails
    python.write_text(f"#!/bin/sh\nenv > {dump}\nexit 3\n")
    python.chmod(0o755)

    def launched_env(**kw) -> dict:
        with pytest.raises(EngineError, match="exited with code 3"):
            SGLangEngine(str(tmp_path / "model"), python=str(python), log_dir=str(tmp_path), startup_timeout_s=30, **kw)
        return dict(ln.split("=", 1) for ln in dump.read_text().splitlines() if "=" in ln)

    for key in CRASH_DIAGNOSTICS_ENV:
        monkeypatch.delenv(key, raising=False)
    env = launched_env()
    assert {k: env.get(k) for k in CRASH_DIAGNOSTICS_ENV} == dict.fromkeys(CRASH_DIAGNOSTICS_ENV, "0")
    monkeypatch.setenv(CRASH_DIAGNOSTICS_ENV[0], "1")  # asked for, in this process's environment
    env = launched_env(env={CRASH_DIAGNOSTICS_ENV[1]: "true"})  # ... or in the launch's
    assert [env.get(k) for k in CRASH_DIAGNOSTICS_ENV] == ["1", "true"]


# ---- one real server -------------------------------------------------------------------------------------------
@pytest.fixture
def server(sglang_pool, request):
    """A server of the session pool (tests/rollout/conftest.py), this test's alone: it ends by killing it."""
    engine = sglang_pool.take(request)
    print(f"\nSGLang CPU server of the pool: {engine.url} (log {engine.log_path})")
    return engine


def _group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group `pgid`, from /proc."""
    total, tick = 0, os.sysconf("SC_CLK_TCK")
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ..., utime (12), stime (13)
            total += int(fields[11]) + int(fields[12])
    return total / tick


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 151000, (n,), generator=g).tolist() for n in (5, 23, 3)]


def _max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.logprobs, rb.logprobs))


def _assert_logprobs_close(a, b, msg):
    assert [len(r.logprobs) for r in a] == [len(r.logprobs) for r in b], msg
    assert_close_scaled([x for r in a for x in r.logprobs], [x for r in b for x in r.logprobs], rel=REL, msg=msg)


@pytest.mark.slow
@pytest.mark.sglang_servers(take=True)  # step 6 kills the server
def test_real_sglang_server_on_cpu(server, tiny_qwen3):
    from opid_mega.rollout.local_engine import LocalEngine

    local = LocalEngine(tiny_qwen3)
    prompts = _prompts()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    assert server.health()

    # 1. Greedy: same tokens, same log-probs as the local engine.
    s0, l0 = server.generate(prompts, greedy), local.generate(prompts, greedy)
    assert [r.response_ids for r in s0] == [r.response_ids for r in l0]
    assert all(r.finish_reason == "length" and len(r.logprobs) == 8 for r in s0)
    d_greedy = _max_diff(s0, l0)
    _assert_logprobs_close(s0, l0, "greedy")

    # 2. Sampling at T=1: SGLang's log-probs are the model's log-probs of its own samples.
    sampled = server.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6))
    d_sampled = 0.0
    for p, r in zip(prompts, sampled):
        with torch.no_grad():
            lp = torch.log_softmax(local.model(torch.tensor([p + r.response_ids])).logits[0].double(), -1)
        ref = [lp[len(p) - 1 + j, t].item() for j, t in enumerate(r.response_ids)]
        d_sampled = max(d_sampled, max(abs(a - b) for a, b in zip(ref, r.logprobs)))
        assert_close_scaled(r.logprobs, ref, rel=REL, msg="sampled, vs the model's own log-probs")

    # 2b. Idle, the server (all processes of its group: launcher, scheduler, detokenizer) sleeps: < 5% of a core.
    time.sleep(1.0)
    c0, t0 = _group_cpu_seconds(server.pid), time.monotonic()
    time.sleep(4.0)
    idle = (_group_cpu_seconds(server.pid) - c0) / (time.monotonic() - t0)
    assert idle < 0.05, f"the idle SGLang server used {idle:.0%} of a core"

    # 3. Stop tokens end a response (the token is kept).
    stop = s0[1].response_ids[3]
    stopped = server.generate([prompts[1]], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[stop]))
    first = s0[1].response_ids.index(stop)
    assert stopped[0].response_ids == s0[1].response_ids[:first + 1] and stopped[0].finish_reason == "stop"

    # 4. Weight updates from tensors (shared memory and inline transports) change the outputs and match the local
    #    engine loaded with the same perturbed weights.
    g = torch.Generator().manual_seed(7)
    changed = 0.0
    for transport in ("shm", "inline"):
        new = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in local.model.named_parameters()]
        server.weight_transport = transport
        server.update_weights(iter(new))
        local.update_weights(new)
        s1, l1 = server.generate(prompts, greedy), local.generate(prompts, greedy)
        assert [r.response_ids for r in s1] == [r.response_ids for r in l1]
        _assert_logprobs_close(s1, l1, f"after a {transport} weight update")
        changed = max(changed, _max_diff(s1, s0))
    assert changed > 100 * TOL  # the tolerance is far below the effect of a real weight change

    # 5. update_weights_from_disk restores the original weights.
    server.update_weights_from_disk(tiny_qwen3)
    s2 = server.generate(prompts, greedy)
    assert [r.response_ids for r in s2] == [r.response_ids for r in s0]
    _assert_logprobs_close(s2, s0, "after update_weights_from_disk")
    print(f"max |logprob SGLang - local|: greedy {d_greedy:.2e}, sampled {d_sampled:.2e}; "
          f"perturbation moved log-probs by {changed:.2e}")

    # 6. A dead server is a clear error that names the log file.
    os.killpg(server.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30  # the killed processes' sockets close when they are reaped (a loaded machine)
    while server.health() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not server.health()
    with pytest.raises(EngineError, match=r"SGLang server \(pid \d+.*exited with code -9; its log is .*\.log"):
        server.generate(prompts, greedy)


def _flaky_server(fake_sglang, fails):
    """A fake server whose /generate answers 503 `fails` times before succeeding (a transient overload)."""
    state = {"fails": fails, "generate_calls": 0}

    def generate(req):
        state["generate_calls"] += 1
        if state["fails"] > 0:
            state["fails"] -= 1
            return 503, {"error": "overloaded"}
        return 200, [{"output_ids": [7, 8], "meta_info": {
            "finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 7, None], [-1.5, 8, None]]}}
            for _ in req["input_ids"]]

    server = fake_sglang(generate)
    server.state = state
    return server


def test_transient_errors_are_retried_with_capped_backoff(fake_sglang, monkeypatch):
    flaky = _flaky_server(fake_sglang, fails=3)
    engine = SGLangEngine(url=flaky.url, backoff_s=0.05, backoff_max_s=0.1, max_retries=5)
    waits = []

    class _Clock:  # the engine module's clock, its sleeps recorded (and slept)
        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, s):
            waits.append(s)
            time.sleep(s)

    monkeypatch.setattr(sglang_engine, "time", _Clock())
    out = engine.generate([[1, 2], [3]], SamplingParams(max_new_tokens=2))
    assert flaky.state["generate_calls"] == 4 and waits == [0.05, 0.1, 0.1]  # 0.05, then doubled, capped at 0.1
    assert [r.response_ids for r in out] == [[7, 8], [7, 8]] and out[0].logprobs == [-0.5, -1.5]
    assert out[0].finish_reason == "stop"
    flaky.state["fails"] = 10
    engine.max_retries = 1
    with pytest.raises(EngineError, match="/generate at .* failed after 2 attempts: HTTP 503"):
        engine.generate([[1]], SamplingParams())
    assert waits[3:] == [0.05]  # one wait between the 2 attempts; each call starts at backoff_s again
    engine.shutdown()  # attached: the server is left running
    assert flaky.thread.is_alive()


def test_engine_keeps_only_the_masked_server_info(fake_sglang):
    """SGLang's /server_info lists the server's arguments, the API key among them: the engine keeps it masked."""
    key = "k3y-Secret-42xyz"
    info = {"tp_size": 2, "api_key": key, "argv": ["python", "-m", "sglang.launch_server", "--api-key", key],
            "launch_command": f"python -m sglang.launch_server --api-key={key} --tp 2"}

    class Routes:
        def get(self, path):
            return (200, info) if path == "/server_info" else None

        def post(self, path, body):
            return None

    engine = SGLangEngine(url=fake_sglang(routes=Routes()).url, api_key=key, startup_timeout_s=10)
    try:
        assert key not in repr(engine.server_info) and engine.tp_size == 2
        assert engine.server_info["launch_command"] == "python -m sglang.launch_server --api-key=*** --tp 2"
    finally:
        engine.shutdown()
