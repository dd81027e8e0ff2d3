"""LLMAnalyzer against a real local OpenAI-compatible HTTP server (ThreadingHTTPServer in a thread)."""
from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from opid_mega.skills import Analysis, TrajectoryView, build_analysis_prompt
from opid_mega.skills.audit import AuditLog, read_audit
from opid_mega.skills.llm_analyzer import AnalysisJob, LLMAnalyzer, chat_completions_url

GOOD = json.dumps({"episode_summary": "Found the apple and put it in the fridge.",
                   "episode_skill": "Locate the object, take it, then open the target receptacle and put it in.",
                   "step_skills": {"1": "Take the apple as soon as you see it.", "9": "out of range",
                                   "2": "Open the fridge before putting things in it."}})
GARBAGE = "I think the agent did fine overall. No JSON here, sorry!"


def _traj(i: int = 0, won: bool = True, n: int = 3) -> TrajectoryView:
    steps = [(f"You are in room {i}. You see an apple {k}.", f"<think>step {k}</think><action>go {k}</action>",
              10.0 if (won and k == n - 1) else 0.0) for k in range(n)]
    return TrajectoryView(task=f"put an apple in the fridge #{i}", won=won, steps=steps, traj_id=f"t{i}")


def _completion(text: str) -> dict:
    return {"id": "cmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


class FakeServer:
    """`script(body: dict, n: int) -> (status, payload: dict | str, delay_s, headers)`; n counts requests from 0."""

    def __init__(self, script):
        self.script = script
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                with outer.lock:
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                try:
                    if self.path != "/v1/chat/completions":
                        status, payload, delay, headers = 404, {"error": "not found"}, 0.0, {}
                    else:
                        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                        with outer.lock:
                            n = len(outer.bodies)
                            outer.bodies.append(body)
                        status, payload, delay, headers = outer.script(body, n)
                    time.sleep(delay)
                    data = (json.dumps(payload) if isinstance(payload, dict) else payload).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass
                finally:
                    with outer.lock:
                        outer.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def prompts(self) -> list[str]:
        return [b["messages"][-1]["content"] for b in self.bodies]


@contextmanager
def serve(script):
    srv = FakeServer(script)
    srv.thread.start()
    try:
        yield srv
    finally:
        srv.httpd.shutdown()
        srv.httpd.server_close()


def _ok(text=GOOD, delay=0.0):
    return lambda body, n: (200, _completion(text), delay, {})


def _analyzer(url, **kw) -> LLMAnalyzer:
    defaults = dict(model="test-model", backoff_s=0.01, backoff_max_s=0.05, timeout_s=5.0, seed=0)
    defaults.update(kw)
    return LLMAnalyzer(url, **defaults)


def test_good_json(tmp_path):
    audit = AuditLog(tmp_path / "audit.jsonl")
    with serve(_ok()) as srv, _analyzer(srv.url, audit=audit, max_tokens=321) as an:
        trajs = [_traj(0), _traj(1, won=False)]
        out = an.analyze(trajs, iteration=7)
        assert all(isinstance(a, Analysis) for a in out)
        assert out[0].episode_skill.startswith("Locate the object")
        assert out[0].step_skills == {1: "Take the apple as soon as you see it.",
                                      2: "Open the fridge before putting things in it."}  # 9 is no candidate
        st = an.stats
        assert (st["requests"], st["retries"], st["reasks"], st["failures"], st["cache_hits"]) == (2, 0, 0, 0, 0)
        body = srv.bodies[0]
        assert body["model"] == "test-model" and body["max_tokens"] == 321 and body["temperature"] == 0.0
        assert body["response_format"] == {"type": "json_object"}
        assert sorted(srv.prompts()) == sorted(build_analysis_prompt(t, 5, 0.95) for t in trajs)
    recs = list(read_audit(tmp_path / "audit.jsonl", "analysis"))
    assert {r["traj_id"] for r in recs} == {"t0", "t1"}
    r0 = next(r for r in recs if r["traj_id"] == "t0")
    assert r0["iteration"] == 7 and r0["won"] is True and r0["raw_reply"] == GOOD and r0["attempts"] == 1
    assert r0["analysis"]["step_skills"] == {"1": "Take the apple as soon as you see it.",
                                             "2": "Open the fridge before putting things in it."}
    assert r0["failure"] is None and r0["prompt"] == build_analysis_prompt(_traj(0), 5, 0.95)


def test_garbage_then_good_on_reask():
    def script(body, n):
        text = body["messages"][-1]["content"]
        return 200, _completion(GOOD if "could not be used" in text else GARBAGE), 0.0, {}

    with serve(script) as srv, _analyzer(srv.url) as an:
        out = an.analyze([_traj(0)])
        assert isinstance(out[0], Analysis)
        st = an.stats
        assert (st["requests"], st["reasks"], st["failures"]) == (2, 1, 0)
        reask = srv.prompts()[1]
        assert reask.startswith(build_analysis_prompt(_traj(0), 5, 0.95))
        assert "episode_skill" in reask and GARBAGE[-30:] in reask  # the error and the tail of the bad answer


def test_garbage_twice_gives_none_and_is_counted(tmp_path):
    audit = AuditLog(tmp_path / "a.jsonl")
    with serve(_ok(GARBAGE)) as srv, _analyzer(srv.url, audit=audit) as an:
        out = an.analyze([_traj(0), _traj(1)], iteration=1)
        assert out == [None, None]
        st = an.stats
        assert (st["requests"], st["reasks"], st["failures"], st["retries"]) == (4, 2, 2, 0)
        # failures are not cached: asking again costs requests again
        an.analyze([_traj(0)])
        assert an.stats["requests"] == 6 and an.stats["cache_hits"] == 0
    recs = list(read_audit(tmp_path / "a.jsonl"))
    assert len(recs) == 3 and all(r["analysis"] is None and r["failure"].startswith("parse") for r in recs)
    assert all(r["replies"] == [GARBAGE, GARBAGE] and r["attempts"] == 2 for r in recs)


def test_empty_episode_skill_is_a_parse_failure():
    bad = json.dumps({"episode_summary": "x", "episode_skill": "  ", "step_skills": {}})
    with serve(_ok(bad)) as srv, _analyzer(srv.url) as an:
        assert an.analyze([_traj(0)]) == [None]
        assert an.stats["reasks"] == 1 and an.stats["failures"] == 1


def test_503_then_success_with_retry_after():
    def script(body, n):
        if n < 2:
            return 503, {"error": "overloaded"}, 0.0, {"Retry-After": "0"}
        return 200, _completion(GOOD), 0.0, {}

    with serve(script) as srv, _analyzer(srv.url) as an:
        out = an.analyze([_traj(0)])
        assert isinstance(out[0], Analysis)
        st = an.stats
        assert (st["requests"], st["retries"], st["failures"]) == (3, 2, 0)


def test_429_and_bad_body_are_retried():
    def script(body, n):
        if n == 0:
            return 429, {"error": "rate limited"}, 0.0, {}
        if n == 1:
            return 200, "<html>proxy error</html>", 0.0, {}
        return 200, _completion(GOOD), 0.0, {}

    with serve(script) as srv, _analyzer(srv.url) as an:
        assert isinstance(an.analyze([_traj(0)])[0], Analysis)
        assert an.stats["retries"] == 2


def test_timeout_then_success():
    def script(body, n):  # the first reply would take 30 s (the handler thread is a daemon: nobody waits for it)
        return 200, _completion(GOOD), (30.0 if n == 0 else 0.0), {}

    with serve(script) as srv, _analyzer(srv.url, timeout_s=0.25) as an:
        t0 = time.perf_counter()
        out = an.analyze([_traj(0)])
        assert isinstance(out[0], Analysis)
        assert an.stats["retries"] == 1 and an.stats["requests"] == 2
        assert time.perf_counter() - t0 < 10  # did not wait for the slow reply (~0.3 s; slack: a loaded machine)


def test_retries_exhausted_gives_none():
    with serve(lambda body, n: (500, {"error": "boom"}, 0.0, {})) as srv, _analyzer(srv.url, max_retries=3) as an:
        assert an.analyze([_traj(0)]) == [None]
        st = an.stats
        assert (st["requests"], st["retries"], st["failures"]) == (4, 3, 1)


def test_non_retryable_http_error_fails_at_once():
    with serve(lambda body, n: (401, {"error": "bad key"}, 0.0, {})) as srv, _analyzer(srv.url) as an:
        assert an.analyze([_traj(0)]) == [None]
        assert (an.stats["requests"], an.stats["retries"]) == (1, 0)
    with serve(_ok()) as srv, _analyzer(srv.url + "/wrong/path") as an:  # 404 from the server
        assert an.analyze([_traj(0)]) == [None] and an.stats["retries"] == 0


def test_connection_refused_gives_none_for_all_and_never_raises():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with _analyzer(f"http://127.0.0.1:{port}", max_retries=3, concurrency=2) as an:
        t0 = time.perf_counter()
        trajs = [_traj(i) for i in range(12)]
        job = an.submit(trajs, iteration=0)
        assert isinstance(job, AnalysisJob)
        assert job.result(timeout=30) == [None] * 12
        assert time.perf_counter() - t0 < 10
        st = an.stats
        assert st["failures"] == 12
        # the first trajectories wait out the retries; the rest fail at once (server unreachable)
        assert st["requests"] < 12 * 4
        assert all(r.failure.startswith("transport") for r in job.records)


def test_json_mode_rejected_falls_back_and_remembers():
    def script(body, n):
        if "response_format" in body:
            return 400, {"error": "response_format is not supported"}, 0.0, {}
        return 200, _completion(GOOD), 0.0, {}

    with serve(script) as srv, _analyzer(srv.url, concurrency=1) as an:
        assert isinstance(an.analyze([_traj(0)])[0], Analysis)
        assert an.stats["json_mode_fallbacks"] == 1 and an.stats["retries"] == 0
        assert isinstance(an.analyze([_traj(1)])[0], Analysis)
        assert ["response_format" in b for b in srv.bodies] == [True, False, False]
        assert an.stats["failures"] == 0


def test_400_without_json_mode_is_not_remembered():
    with serve(lambda body, n: (400, {"error": "prompt too long"}, 0.0, {})) as srv, _analyzer(srv.url) as an:
        assert an.analyze([_traj(0)]) == [None]
        assert ["response_format" in b for b in srv.bodies] == [True, False]
        an.analyze([_traj(1)])
        assert "response_format" in srv.bodies[2]  # the 400 was not about JSON mode


def test_json_schema_mode_and_url_forms():
    with serve(_ok()) as srv, _analyzer(srv.url + "/v1/", json_mode="json_schema") as an:
        assert isinstance(an.analyze([_traj(0)])[0], Analysis)
        rf = srv.bodies[0]["response_format"]
        assert rf["type"] == "json_schema" and "episode_skill" in rf["json_schema"]["schema"]["required"]
    with serve(_ok()) as srv, _analyzer(srv.url, json_mode=False) as an:
        an.analyze([_traj(0)])
        assert "response_format" not in srv.bodies[0]
    assert chat_completions_url("http://h:1/v1/chat/completions") == "http://h:1/v1/chat/completions"
    with pytest.raises(ValueError, match="base_url"):
        LLMAnalyzer("localhost:30000", model="m")
    with pytest.raises(ValueError, match="model"):
        LLMAnalyzer("http://h:1", model="")


def test_cache_hits_memory_batch_and_disk(tmp_path):
    cache = tmp_path / "cache.jsonl"
    with serve(_ok()) as srv:
        with _analyzer(srv.url, cache_path=cache) as an:
            a = an.analyze([_traj(0)])[0]
            b = an.analyze([_traj(0)])[0]  # identical trajectory: no request
            assert a == b and an.stats["requests"] == 1 and an.stats["cache_hits"] == 1
            out = an.analyze([_traj(1), _traj(1), _traj(2)])  # duplicate inside one call: one request
            assert out[0] == out[1] and an.stats["requests"] == 3 and an.stats["cache_hits"] == 2
            assert out[0] is not out[1] and out[0].step_skills is not out[1].step_skills  # own objects
        with _analyzer(srv.url, cache_path=cache) as an2:  # a resumed run: the disk cache answers
            out = an2.analyze([_traj(0), _traj(1), _traj(2)])
            assert out[0] == a and all(isinstance(x, Analysis) for x in out)
            assert an2.stats["requests"] == 0 and an2.stats["cache_hits"] == 3
        with _analyzer(srv.url, model="other-model", cache_path=cache) as an3:  # keyed by the model too
            an3.analyze([_traj(0)])
            assert an3.stats["requests"] == 1
        with _analyzer(srv.url, cache=False) as an4:
            an4.analyze([_traj(0)])
            an4.analyze([_traj(0), _traj(0)])
            assert an4.stats["requests"] == 3 and an4.stats["cache_hits"] == 0
    assert len(srv.bodies) == 7


def test_concurrency_bound_respected():
    with serve(_ok(delay=0.15)) as srv, _analyzer(srv.url, concurrency=3) as an:
        j1 = an.submit([_traj(i) for i in range(9)])
        j2 = an.submit([_traj(i) for i in range(100, 106)])
        r1, r2 = j1.result(timeout=30), j2.result(timeout=30)
        assert all(isinstance(a, Analysis) for a in r1 + r2)
        assert srv.max_in_flight == 3  # used the parallelism, never more
        assert an.stats["requests"] == 15


def test_background_job_overlaps_caller_work():
    with serve(_ok(delay=3.0)) as srv, _analyzer(srv.url) as an:
        t0 = time.perf_counter()
        job = an.submit([_traj(0), _traj(1)], iteration=3)
        assert time.perf_counter() - t0 < 2.0  # returned before the server answered (3 s; slack: a loaded machine)
        assert not job.done()
        out = job.result(timeout=60)
        assert len(out) == 2 and job.done() and [r.traj_id for r in job.records] == ["t0", "t1"]


def test_deadline_ends_the_wait_and_counts_failures(tmp_path):
    """A server that never answers (timeout 60 s x 6 attempts would be 6 min per analysis): with deadline_s=1.5 the
    job returns after ~1.5 s, every analysis a deadline failure (counted, audited), the queued ones never sent."""
    audit = AuditLog(tmp_path / "audit.jsonl")
    with serve(lambda body, n: (200, _completion(GOOD), 60.0, {})) as srv, \
            _analyzer(srv.url, timeout_s=60.0, max_retries=5, concurrency=2, audit=audit) as an:
        t0 = time.monotonic()
        job = an.submit([_traj(i) for i in range(5)], iteration=7, deadline_s=1.5)
        out = job.result(timeout=60)
        elapsed = time.monotonic() - t0
        assert out == [None] * 5 and 1.5 <= elapsed < 1.5 + 8.0  # slack for a loaded 2-core machine
        assert an.stats["deadline_failures"] == 5 and an.stats["failures"] == 5
        assert all("deadline: analyzer.deadline_s=1.5 s passed" in r.failure for r in job.records)
        assert len(srv.bodies) == 2  # concurrency 2: the three queued analyses were cancelled, never sent
        with pytest.raises(ValueError, match="deadline_s"):
            an.analyze_records([_traj(0)], deadline_s=float("nan"))
    audit.close()
    records = [r for r in read_audit(tmp_path / "audit.jsonl") if r["type"] == "analysis"]
    assert len(records) == 5 and all("deadline" in r["failure"] and r["iteration"] == 7 for r in records)


def test_empty_trajectory_gets_none_without_request():
    with serve(_ok()) as srv, _analyzer(srv.url) as an:
        out = an.analyze([TrajectoryView(task="t", won=False, steps=[]), _traj(0)])
        assert out[0] is None and isinstance(out[1], Analysis)
        assert len(srv.bodies) == 1 and an.stats["failures"] == 0


def test_from_config():
    from opid_mega.config import load_config

    cfg = load_config(None, ["analyzer.backend=llm", "analyzer.model=served", "analyzer.max_step_skills=2",
                             "analyzer.concurrency=3", "analyzer.json_mode=false"])
    with pytest.raises(ValueError, match="base_url"):
        LLMAnalyzer.from_config(cfg.analyzer)
    with serve(_ok()) as srv, LLMAnalyzer.from_config(cfg.analyzer, base_url=srv.url) as an:
        out = an.analyze([_traj(0)])
        assert out[0].step_skills == {1: "Take the apple as soon as you see it.",
                                      2: "Open the fridge before putting things in it."}
        assert an.concurrency == 3 and srv.bodies[0]["model"] == "served"
        assert "response_format" not in srv.bodies[0]
        assert "at most 2 critical steps" in srv.prompts()[0]


def test_backoff_is_capped_exponential_with_jitter():
    an = LLMAnalyzer("http://127.0.0.1:9", model="m", backoff_s=0.5, backoff_max_s=4.0, seed=123)
    try:
        for retry in range(8):
            nominal = min(4.0, 0.5 * 2 ** retry)
            delays = [an._backoff(retry, None) for _ in range(50)]
            assert all(nominal / 2 <= d <= nominal for d in delays)
            assert len(set(delays)) > 1  # jittered
        assert an._backoff(0, 3.0) == 3.0  # Retry-After is honoured ...
        assert an._backoff(0, 100.0) == 4.0  # ... within the cap
    finally:
        an.close()
