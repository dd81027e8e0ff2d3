"""LLMAnalyzer (the `openai` client) against a real local OpenAI-compatible HTTP server (ThreadingHTTPServer in a
thread) that streams like SGLang (SSE chunks, `rid`, /abort_request, /model_info) or answers whole JSON bodies.

Expected values are written from the reference's facts (OPID.md "More reference facts": Retries, Analyzer sampling),
not from our code: 5 attempts in all, every error retried, an empty reply retried, backoff 1 s x 2 capped at 30 s,
the text parsed = reasoning + newline + content, the re-ask quotes the last 2000 characters."""
from __future__ import annotations

import email.utils
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

import pytest

from opid_mega.skills import Analysis, TrajectoryView, build_analysis_prompt
from opid_mega.skills.audit import AuditLog, read_audit
from opid_mega.skills.llm_analyzer import AnalysisJob, AnalyzerUnavailable, LLMAnalyzer
from opid_mega.skills.llm_transport import chat_completions_url, retry_after_s

GOOD = json.dumps({"episode_summary": "Found the apple and put it in the fridge.",
                   "episode_skill": "Locate the object, take it, then open the target receptacle and put it in.",
                   "step_skills": {"1": "Take the apple as soon as you see it.", "9": "out of range",
                                   "2": "Open the fridge before putting things in it."}})
GOOD_STEPS = {1: "Take the apple as soon as you see it.", 2: "Open the fridge before putting things in it."}
GARBAGE = "I think the agent did fine overall. No JSON here, sorry!"


def _traj(i: int = 0, won: bool = True, n: int = 3) -> TrajectoryView:
    steps = [(f"You are in room {i}. You see an apple {k}.", f"<think>step {k}</think><action>go {k}</action>",
              10.0 if (won and k == n - 1) else 0.0) for k in range(n)]
    return TrajectoryView(task=f"put an apple in the fridge #{i}", won=won, steps=steps, traj_id=f"t{i}")


def _completion(text: str) -> dict:
    """A whole (non-streamed) chat completion: what a server that ignores `stream` answers."""
    return {"id": "cmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


@dataclass
class SSE:
    """A streamed reply: `reasoning` (one chunk) then `text` in `pieces` chunks, `gap_s` apart. `stall_after`: after
    that many chunks the server sends nothing more until the request is aborted (/abort_request with its rid) or
    `hold_s` passes."""

    text: str = ""
    reasoning: str = ""
    pieces: int = 4
    gap_s: float = 0.0
    stall_after: Optional[int] = None
    hold_s: float = 60.0
    finish: str = "stop"


def _chunk(content=None, reasoning=None, finish=None) -> bytes:
    delta = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    obj = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(obj)}\n\n".encode()


class FakeServer:
    """`script(body: dict, n: int) -> (status, payload, delay_s, headers)`; n counts chat requests from 0. payload:
    an SSE (streamed), a dict (a JSON body) or a str (a raw body). `sglang`: GET /model_info answers like SGLang.
    `api_key`: requests without `Authorization: Bearer <api_key>` get 401. Records: bodies, aborts (rids), gets,
    max_in_flight (chat requests open at once; a request stops counting just before its last bytes are written, so
    a client that starts its next request the moment one ends is never counted twice)."""

    def __init__(self, script, sglang: bool = True, api_key: Optional[str] = None, models=("served-model",)):
        self.script = script
        self.bodies: list[dict] = []
        self.aborts: list[str] = []
        self.gets: list[str] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.aborted: dict[str, threading.Event] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _done(self):
                """This chat request no longer counts as open (once)."""
                if getattr(self, "_open", False):
                    self._open = False
                    with outer.lock:
                        outer.in_flight -= 1

            def _reply(self, status, payload, headers=None):
                data = (json.dumps(payload) if isinstance(payload, (dict, list)) else payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self._done()
                self.wfile.write(data)

            def _authorized(self):
                return api_key is None or self.headers.get("Authorization") == f"Bearer {api_key}"

            def do_GET(self):  # noqa: N802
                outer.gets.append(self.path)
                if not self._authorized():
                    return self._reply(401, {"error": {"message": "Invalid API key"}})
                if self.path == "/model_info" and sglang:
                    return self._reply(200, {"model_path": "m", "is_generation": True})
                if self.path == "/v1/models":
                    return self._reply(200, {"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                                                         "owned_by": "x"} for m in models]})
                self._reply(404, {"error": {"message": "not found"}})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path == "/abort_request":
                    with outer.lock:
                        outer.aborts.append(body.get("rid"))
                        outer.aborted.setdefault(body.get("rid"), threading.Event()).set()
                    return self._reply(200, "")
                with outer.lock:
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                self._open = True
                try:
                    if not self._authorized():
                        return self._reply(401, {"error": {"message": "Invalid API key"}})
                    if self.path != "/v1/chat/completions":
                        return self._reply(404, {"error": {"message": f"no route {self.path}"}})
                    with outer.lock:
                        n = len(outer.bodies)
                        outer.bodies.append(body)
                        event = outer.aborted.setdefault(body.get("rid"), threading.Event())
                    status, payload, delay, headers = outer.script(body, n)
                    time.sleep(delay)
                    if isinstance(payload, SSE):
                        self._stream(payload, event)
                    else:
                        self._reply(status, payload, headers)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up and left
                    pass
                finally:
                    self._done()

            def _stream(self, sse: SSE, aborted: threading.Event):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the body ends when the connection closes
                chunks = []
                if sse.reasoning:
                    chunks.append(_chunk(reasoning=sse.reasoning))
                n, size = sse.pieces, max(1, -(-len(sse.text) // max(1, sse.pieces)))
                chunks += [_chunk(content=sse.text[i:i + size]) for i in range(0, len(sse.text), size)][:n] or []
                for i, c in enumerate(chunks):
                    if sse.stall_after is not None and i >= sse.stall_after:
                        if aborted.wait(sse.hold_s):  # SGLang ends an aborted stream with finish_reason "abort"
                            self._done()
                            self.wfile.write(_chunk(finish="abort") + b"data: [DONE]\n\n")
                        return
                    self.wfile.write(c)
                    self.wfile.flush()
                    if sse.gap_s:
                        time.sleep(sse.gap_s)
                self._done()
                self.wfile.write(_chunk(finish=sse.finish) + b"data: [DONE]\n\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def prompts(self) -> list[str]:
        return [b["messages"][-1]["content"] for b in self.bodies]


@contextmanager
def serve(script, **kw):
    srv = FakeServer(script, **kw)
    srv.thread.start()
    try:
        yield srv
    finally:
        srv.httpd.shutdown()
        srv.httpd.server_close()


def _ok(text=GOOD, delay=0.0):
    """A whole JSON completion (a server that ignores `stream`)."""
    return lambda body, n: (200, _completion(text), delay, {})


def _sse(text=GOOD, **kw):
    return lambda body, n: (200, SSE(text, **kw), 0.0, {})


def _analyzer(url, **kw) -> LLMAnalyzer:
    defaults = dict(model="test-model", backoff_s=0.01, backoff_max_s=0.05, stall_timeout_s=10.0)
    defaults.update(kw)
    return LLMAnalyzer(url, **defaults)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------
# requests as the reference sends them
# ---------------------------------------------------------------------------------------------------------------
def test_streamed_reply_and_the_reference_request(tmp_path):
    """Sampling: no temperature, no response format (the server's defaults); the text parsed is reasoning + newline
    + content (no reasoning here: a newline, then the content)."""
    audit = AuditLog(tmp_path / "audit.jsonl")
    with serve(_sse()) as srv, _analyzer(srv.url, audit=audit, max_tokens=321) as an:
        trajs = [_traj(0), _traj(1, won=False)]
        out = an.analyze(trajs, iteration=7)
        assert all(isinstance(a, Analysis) for a in out)
        assert out[0].episode_skill.startswith("Locate the object") and out[0].step_skills == GOOD_STEPS
        st = an.stats
        assert (st["requests"], st["retries"], st["reasks"], st["failures"], st["cache_hits"]) == (2, 0, 0, 0, 0)
        body = srv.bodies[0]
        assert body["model"] == "test-model" and body["max_tokens"] == 321 and body["stream"] is True
        assert "temperature" not in body and "response_format" not in body
        assert body["messages"] == [{"role": "user", "content": body["messages"][0]["content"]}]
        assert "rid" not in body  # not known to be SGLang (no probe, sglang=None): no rid
        assert sorted(srv.prompts()) == sorted(build_analysis_prompt(t, 5, 0.95) for t in trajs)
    recs = list(read_audit(tmp_path / "audit.jsonl", "analysis"))
    r0 = next(r for r in recs if r["traj_id"] == "t0")
    assert r0["iteration"] == 7 and r0["won"] is True and r0["raw_reply"] == "\n" + GOOD and r0["attempts"] == 1
    assert r0["failure"] is None and r0["prompt"] == build_analysis_prompt(_traj(0), 5, 0.95)


def test_reasoning_newline_content_is_the_text_parsed():
    reasoning = 'Thinking: the skill could be {"episode_skill": "from the reasoning"}.'
    with serve(lambda b, n: (200, SSE(GOOD, reasoning=reasoning), 0.0, {})) as srv, _analyzer(srv.url) as an:
        (rec,) = an.analyze_records([_traj(0)])
    assert rec.replies == [reasoning + "\n" + GOOD]
    assert rec.analysis.episode_skill == "from the reasoning"  # the reasoning comes first in the text parsed


def test_a_whole_json_completion_is_read_too():
    with serve(_ok()) as srv, _analyzer(srv.url) as an:
        (rec,) = an.analyze_records([_traj(0)])
        assert rec.analysis.step_skills == GOOD_STEPS and rec.replies == ["\n" + GOOD]
        assert srv.bodies[0]["stream"] is True


def test_our_sampling_switches_temperature_and_response_format():
    with serve(_sse()) as srv, _analyzer(srv.url, temperature=0.0, response_format="json_object") as an:
        an.analyze([_traj(0)])
        assert srv.bodies[0]["temperature"] == 0.0 and srv.bodies[0]["response_format"] == {"type": "json_object"}
    with serve(_sse()) as srv, _analyzer(srv.url + "/v1/", response_format="json_schema") as an:
        assert isinstance(an.analyze([_traj(0)])[0], Analysis)
        rf = srv.bodies[0]["response_format"]
        assert rf["type"] == "json_schema" and "episode_skill" in rf["json_schema"]["schema"]["required"]
    with pytest.raises(ValueError, match="response_format"):
        LLMAnalyzer("http://h:1", model="m", response_format="yaml")
    with pytest.raises(ValueError, match="parser"):
        LLMAnalyzer("http://h:1", model="m", parser="lenient")


def test_response_format_rejected_falls_back_and_remembers():
    def script(body, n):
        if "response_format" in body:
            return 400, {"error": {"message": "response_format is not supported"}}, 0.0, {}
        return 200, SSE(GOOD), 0.0, {}

    with serve(script) as srv, _analyzer(srv.url, concurrency=1, response_format="json_object") as an:
        assert isinstance(an.analyze([_traj(0)])[0], Analysis)
        assert an.stats["response_format_fallbacks"] == 1 and an.stats["retries"] == 0
        assert isinstance(an.analyze([_traj(1)])[0], Analysis)
        assert ["response_format" in b for b in srv.bodies] == [True, False, False]


# ---------------------------------------------------------------------------------------------------------------
# parsing and the re-ask
# ---------------------------------------------------------------------------------------------------------------
def test_reask_quotes_exactly_the_last_2000_characters():
    digits = "".join(f"{i:04d}" for i in range(500))  # 2000 characters, no two windows alike
    bad = "x" * 700 + digits  # no JSON object: unusable

    def script(body, n):
        return 200, SSE(GOOD if n == 1 else bad), 0.0, {}

    with serve(script) as srv, _analyzer(srv.url) as an:
        (rec,) = an.analyze_records([_traj(0)])
        assert isinstance(rec.analysis, Analysis) and rec.reasked and an.stats["reasks"] == 1
        reask = srv.prompts()[1]
    assert reask.startswith(build_analysis_prompt(_traj(0), 5, 0.95))
    assert "episode_skill" in reask.split("Problem:")[1]  # the error names what was missing
    assert "reply:\n" + digits + "\n\n" in reask  # the tail begins right after the label: nothing before it
    assert "x" not in reask.split("Problem:")[1].split("reply:\n")[1]


def test_garbage_twice_gives_none_and_is_counted(tmp_path):
    audit = AuditLog(tmp_path / "a.jsonl")
    with serve(_sse(GARBAGE)) as srv, _analyzer(srv.url, audit=audit) as an:
        out = an.analyze([_traj(0), _traj(1)], iteration=1)
        assert out == [None, None]
        st = an.stats
        assert (st["requests"], st["reasks"], st["failures"], st["retries"]) == (4, 2, 2, 0)
        an.analyze([_traj(0)])  # failures are not cached: asking again costs requests again
        assert an.stats["requests"] == 6 and an.stats["cache_hits"] == 0
    recs = list(read_audit(tmp_path / "a.jsonl"))
    assert len(recs) == 3 and all(r["analysis"] is None and r["failure"].startswith("parse") for r in recs)
    assert all(r["replies"] == ["\n" + GARBAGE] * 2 and r["attempts"] == 2 for r in recs)


def test_parser_rules_switch():
    """A null step value: the reference makes it the skill "None"; ours drops it."""
    reply = json.dumps({"episode_summary": "s", "episode_skill": "E", "step_skills": {"0": None, "1": "b"}})
    with serve(_sse(reply)) as srv:
        with _analyzer(srv.url) as an:
            assert an.analyze([_traj(0)])[0].step_skills == {0: "None", 1: "b"}
        with _analyzer(srv.url, parser="ours") as an:
            assert an.analyze([_traj(0)])[0].step_skills == {1: "b"}


# ---------------------------------------------------------------------------------------------------------------
# retries: the reference's policy
# ---------------------------------------------------------------------------------------------------------------
def test_backoff_is_1_2_4_8_capped_at_30():
    an = LLMAnalyzer("http://127.0.0.1:9", model="m")
    try:
        assert [an._backoff(r) for r in range(1, 9)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
        assert (an.max_retries, an.backoff_s, an.backoff_max_s) == (4, 1.0, 30.0)  # 5 attempts in all
    finally:
        an.close()


def test_empty_replies_and_errors_are_retried_then_success():
    """Attempts 1-2: empty replies (content ""), 3: HTTP 500, 4: a body that is no completion, 5: the analysis.
    5 attempts in all: the fifth is the last one allowed, and it succeeds."""
    def script(body, n):
        if n < 2:
            return 200, SSE(""), 0.0, {}
        if n == 2:
            return 500, {"error": {"message": "boom"}}, 0.0, {}
        if n == 3:
            return 200, "<html>proxy error</html>", 0.0, {}
        return 200, SSE(GOOD), 0.0, {}

    with serve(script) as srv, _analyzer(srv.url) as an:
        (rec,) = an.analyze_records([_traj(0)])
        assert isinstance(rec.analysis, Analysis) and rec.attempts == 5
        st = an.stats
        assert (len(srv.bodies), st["requests"], st["retries"], st["empty_replies"]) == (5, 5, 4, 2)


def test_five_attempts_in_all_then_none():
    with serve(_sse("")) as srv, _analyzer(srv.url) as an:  # every reply empty
        (rec,) = an.analyze_records([_traj(0)])
        assert rec.analysis is None and len(srv.bodies) == 5 and an.stats["failures"] == 1
        assert rec.failure.startswith("transport: EmptyReply") and "after 5 attempts" in rec.failure


@pytest.mark.parametrize("status", [400, 401, 404, 429, 503])
def test_every_http_error_is_retried(status):
    with serve(lambda b, n: (status, {"error": {"message": "no"}}, 0.0, {})) as srv, _analyzer(srv.url) as an:
        assert an.analyze([_traj(0)]) == [None]
        assert len(srv.bodies) == 5 and an.stats["retries"] == 4


def test_connection_refused_gives_none_for_all_and_never_raises():
    with _analyzer(f"http://127.0.0.1:{_closed_port()}", concurrency=2) as an:
        job = an.submit([_traj(i) for i in range(4)], iteration=0)
        assert isinstance(job, AnalysisJob)
        assert job.result(timeout=60) == [None] * 4
        assert an.stats["failures"] == 4 and an.stats["requests"] == 4 * 5
        assert all(r.failure.startswith("transport: APIConnectionError") for r in job.records)


# ---------------------------------------------------------------------------------------------------------------
# timeouts that cannot starve: progress-based, aborted on the server
# ---------------------------------------------------------------------------------------------------------------
def test_slow_steady_stream_is_never_cut():
    """A reply that takes ~2.4 s in all but sends a token every 0.3 s: with stall_timeout_s=1.2 it completes (a
    fixed 1.2 s timeout would have cut it, and every retry too)."""
    with serve(_sse(GOOD, pieces=8, gap_s=0.3)) as srv, _analyzer(srv.url, stall_timeout_s=1.2) as an:
        t0 = time.monotonic()
        (rec,) = an.analyze_records([_traj(0)])
        assert isinstance(rec.analysis, Analysis) and len(srv.bodies) == 1
        assert time.monotonic() - t0 >= 2.0 and an.stats["stalls"] == 0


def test_stalled_stream_is_aborted_with_its_rid_and_retried():
    def script(body, n):  # n = 0: the probe; n = 1: the first analysis request stalls after one token
        return 200, (SSE(GOOD, pieces=4, stall_after=1) if n == 1 else SSE(GOOD)), 0.0, {}

    with serve(script) as srv, _analyzer(srv.url, stall_timeout_s=0.5) as an:
        probe = an.probe()  # finds SGLang through /model_info: requests carry a rid from now on
        assert probe.sglang and "/model_info" in srv.gets and srv.aborts == []
        (rec,) = an.analyze_records([_traj(0)])
        assert isinstance(rec.analysis, Analysis) and rec.attempts == 2
        rids = [b["rid"] for b in srv.bodies[1:]]
        assert len(rids) == 2 and rids[0] != rids[1] and all(r.startswith("opid-analyzer-") for r in rids)
        assert srv.aborts == [rids[0]]  # the stalled one, by its rid; the good one is not aborted
        assert an.stats["stalls"] == 1 and an.stats["aborts"] == 1 and an.stats["retries"] == 1


def test_timeout_s_caps_a_whole_reply_and_aborts_it():
    with serve(_sse(GOOD, pieces=20, gap_s=0.2)) as srv, \
            _analyzer(srv.url, sglang=True, timeout_s=1.0, stall_timeout_s=5.0, max_retries=1) as an:
        (rec,) = an.analyze_records([_traj(0)])
        assert rec.analysis is None and "timeout_s=1 s" in rec.failure and len(srv.bodies) == 2
        assert srv.aborts == [b["rid"] for b in srv.bodies]


def test_deadline_ends_the_wait_aborts_in_flight_and_counts_failures(tmp_path):
    """A server that stalls every reply: with deadline_s=1.5 the job returns after ~1.5 s, every analysis a deadline
    failure (counted, audited), the queued ones never sent, the two in flight aborted on the server."""
    audit = AuditLog(tmp_path / "audit.jsonl")
    with serve(_sse(GOOD, stall_after=0)) as srv, \
            _analyzer(srv.url, sglang=True, stall_timeout_s=60.0, concurrency=2, audit=audit) as an:
        t0 = time.monotonic()
        job = an.submit([_traj(i) for i in range(5)], iteration=7, deadline_s=1.5)
        out = job.result(timeout=60)
        elapsed = time.monotonic() - t0
        # not before the deadline; the upper bound only catches a wait for the stalled replies (60 s stall timeout)
        assert out == [None] * 5 and 1.5 <= elapsed < 30.0
        assert an.stats["deadline_failures"] == 5 and an.stats["failures"] == 5
        assert all("deadline: analyzer.deadline_s=1.5 s passed" in r.failure for r in job.records)
        for _ in range(100):  # the aborts are sent in the background
            if len(srv.aborts) == 2:
                break
            time.sleep(0.05)
        assert len(srv.bodies) == 2 and sorted(srv.aborts) == sorted(b["rid"] for b in srv.bodies)
        with pytest.raises(ValueError, match="deadline_s"):
            an.analyze_records([_traj(0)], deadline_s=float("nan"))
    audit.close()
    records = [r for r in read_audit(tmp_path / "audit.jsonl") if r["type"] == "analysis"]
    assert len(records) == 5 and all("deadline" in r["failure"] and r["iteration"] == 7 for r in records)


# ---------------------------------------------------------------------------------------------------------------
# the start-up probe
# ---------------------------------------------------------------------------------------------------------------
def test_probe_measures_and_finds_sglang():
    with serve(_sse("ready now, ok", pieces=4, gap_s=0.05)) as srv, _analyzer(srv.url) as an:
        p = an.probe()
        assert p.sglang and an.sglang and p.tokens == 4
        # timed from the request's start: the first token before the end; a decode rate measured (4 tokens, spaced)
        # and quoted
        assert p.first_token_s is not None and 0 <= p.first_token_s <= p.seconds and p.tokens_per_s is not None
        assert f"(4 tokens, ~{p.tokens_per_s:.1f} tokens/s alone" in p.describe(512)
        assert srv.bodies[0]["max_tokens"] == 16 and "rid" in srv.bodies[0]
        assert "answered the probe" in p.describe(512) and "512-token reply" in p.describe(512)
    with serve(_sse("ready"), sglang=False) as srv, _analyzer(srv.url) as an:
        assert an.probe().sglang is False and "rid" not in srv.bodies[0]


def _probe_error(an) -> str:
    with pytest.raises(AnalyzerUnavailable) as e:
        an.probe()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("analyzer: ")
    return msg


def test_probe_bad_key_bad_model_unreachable_are_one_line_errors():
    with serve(_sse("ready"), api_key="right-key-123") as srv:
        with _analyzer(srv.url, api_key="wrong-key-456") as an:
            msg = _probe_error(an)
            assert "refused the API key" in msg and "HTTP 401" in msg and "analyzer.api_key" in msg
            assert "wrong-key-456" not in msg
            assert len(srv.bodies) == 0  # rejected before the script: a 4xx is final for the probe (one request)
        with _analyzer(srv.url, api_key="right-key-123") as an:
            assert an.probe().tokens >= 1

    def by_model(body, n):
        if body["model"] != "served-model":
            return 404, {"error": {"message": f"The model `{body['model']}` does not exist."}}, 0.0, {}
        return 200, SSE("ready"), 0.0, {}

    with serve(by_model, sglang=False) as srv, _analyzer(srv.url, model="typo-model") as an:
        msg = _probe_error(an)
        assert "HTTP 404" in msg and "'typo-model'" in msg and "analyzer.model" in msg
        assert "the server lists: served-model" in msg and len(srv.bodies) == 1
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    with _analyzer(url, max_retries=1) as an:
        msg = _probe_error(an)
        assert url in msg and "analyzer.base_url" in msg and "APIConnectionError" in msg


# ---------------------------------------------------------------------------------------------------------------
# cache, concurrency, background, config
# ---------------------------------------------------------------------------------------------------------------
def test_cache_hits_memory_batch_and_disk(tmp_path):
    cache = tmp_path / "cache.jsonl"
    with serve(_sse()) as srv:
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
    with serve(_sse(GOOD, pieces=3, gap_s=0.05)) as srv, _analyzer(srv.url, concurrency=3) as an:
        j1 = an.submit([_traj(i) for i in range(9)])
        j2 = an.submit([_traj(i) for i in range(100, 106)])
        r1, r2 = j1.result(timeout=60), j2.result(timeout=60)
        assert all(isinstance(a, Analysis) for a in r1 + r2)
        assert srv.max_in_flight == 3  # used the parallelism, never more
        assert an.stats["requests"] == 15


def test_jobs_of_several_iterations_are_analysed_side_by_side():
    # train.max_staleness >= 1 submits the next iteration's batch while the last one is still being analysed: both
    # batches' requests are open at once (queued one batch after the other, at most 2 would be)
    with serve(_ok(delay=1.0)) as srv, _analyzer(srv.url, concurrency=4) as an:
        j1 = an.submit([_traj(0), _traj(1)], iteration=1)
        j2 = an.submit([_traj(2), _traj(3)], iteration=2)
        r1, r2 = j1.result(timeout=60), j2.result(timeout=60)
        assert all(isinstance(a, Analysis) for a in r1 + r2)
        assert srv.max_in_flight == 4 and an.stats["requests"] == 4


def test_background_job_overlaps_caller_work():
    with serve(_ok(delay=3.0)) as srv, _analyzer(srv.url) as an:
        job = an.submit([_traj(0), _traj(1)], iteration=3)
        assert not job.done()  # submit returned before the server answered (it waits 3 s)
        out = job.result(timeout=60)
        assert len(out) == 2 and job.done() and [r.traj_id for r in job.records] == ["t0", "t1"]


def test_empty_trajectory_gets_none_without_request():
    with serve(_sse()) as srv, _analyzer(srv.url) as an:
        out = an.analyze([TrajectoryView(task="t", won=False, steps=[]), _traj(0)])
        assert out[0] is None and isinstance(out[1], Analysis)
        assert len(srv.bodies) == 1 and an.stats["failures"] == 0


def test_url_forms_and_bad_arguments():
    assert chat_completions_url("http://h:1/v1/chat/completions") == "http://h:1/v1/chat/completions"
    an = LLMAnalyzer("http://h:1/v1/chat/completions", model="m")
    assert (an.base_url, an.server_root) == ("http://h:1/v1", "http://h:1")
    an.close()
    with pytest.raises(ValueError, match="base_url"):
        LLMAnalyzer("localhost:30000", model="m")
    with pytest.raises(ValueError, match="model"):
        LLMAnalyzer("http://h:1", model="")


def test_from_config():
    from opid_mega.config import load_config
    from opid_mega.rollout.launch import llm_analyzer

    cfg = load_config(None, ["analyzer.backend=llm", "analyzer.model=served", "analyzer.max_step_skills=2",
                             "analyzer.concurrency=3", "analyzer.temperature=0.5", "analyzer.parser=ours",
                             "analyzer.response_format=json_object", "analyzer.stall_timeout_s=7"])
    with pytest.raises(ValueError, match="base_url"):
        llm_analyzer(cfg.analyzer)
    with serve(_sse()) as srv, llm_analyzer(cfg.analyzer, base_url=srv.url) as an:
        out = an.analyze([_traj(0)])
        assert out[0].step_skills == GOOD_STEPS
        assert (an.concurrency, an.parser, an.stall_timeout_s, an.max_retries) == (3, "ours", 7.0, 4)
        body = srv.bodies[0]
        assert body["model"] == "served" and body["temperature"] == 0.5
        assert body["response_format"] == {"type": "json_object"}
        assert "at most 2 critical steps" in srv.prompts()[0]
    old = load_config(None, ["analyzer.model=m", "analyzer.json_mode=true"])  # the deprecated alias
    with llm_analyzer(old.analyzer, base_url="http://h:1") as an:
        assert an.response_format == "json_object"
    default = load_config(None, ["analyzer.model=m"])
    with llm_analyzer(default.analyzer, base_url="http://h:1") as an:
        assert an.response_format is None and an.temperature is None and an.parser == "reference"


# ---------------------------------------------------------------------------------------------------------------
# hosted endpoints: Retry-After, the completion budget's field name, a shared cap on requests in flight
# ---------------------------------------------------------------------------------------------------------------
def _then_ok(first_status: int, headers: dict):
    """The first chat request gets `first_status` with `headers`, every later one the analysis."""
    def script(body, n):
        if n == 0:
            return first_status, {"error": {"message": "slow down"}}, 0.0, headers
        return 200, SSE(GOOD), 0.0, {}
    return script


def test_retry_after_header_values():
    assert retry_after_s({"retry-after": "1"}) == 1.0 and retry_after_s({"retry-after": " 2.5 "}) == 2.5
    assert retry_after_s({"retry-after-ms": "250", "retry-after": "9"}) == 0.25  # OpenAI's header first
    now = 1_700_000_000.0
    date = email.utils.formatdate(now + 7, usegmt=True)
    assert retry_after_s({"retry-after": date}, now=now) == pytest.approx(7.0)
    assert retry_after_s({"retry-after": email.utils.formatdate(now - 60, usegmt=True)}, now=now) == 0.0
    for bad in ({}, {"retry-after": ""}, {"retry-after": "soon"}, {"retry-after": "-3"}, {"retry-after": "nan"}):
        assert retry_after_s(bad) is None


def test_429_retry_after_seconds_is_waited_then_retried():
    with serve(_then_ok(429, {"Retry-After": "1"})) as srv, _analyzer(srv.url, backoff_max_s=30.0) as an:
        t0 = time.monotonic()
        (rec,) = an.analyze_records([_traj(0)])
        elapsed = time.monotonic() - t0
        assert isinstance(rec.analysis, Analysis) and rec.attempts == 2 and len(srv.bodies) == 2
        assert 0.9 <= elapsed < 1.0 + 3.0  # the backoff alone would have been 0.01 s
        assert an.stats["retry_after_waits"] == 1 and an.stats["retries"] == 1
    # capped at backoff_max_s: a Retry-After of 30 s waits 0.2 s
    with serve(_then_ok(429, {"Retry-After": "30"})) as srv, _analyzer(srv.url, backoff_max_s=0.2) as an:
        t0 = time.monotonic()
        assert isinstance(an.analyze([_traj(0)])[0], Analysis)
        assert 0.15 <= time.monotonic() - t0 < 0.2 + 3.0 and an.stats["retry_after_waits"] == 1


def test_503_retry_after_http_date_is_waited():
    with serve(_then_ok(503, {"Retry-After": email.utils.formatdate(time.time() + 2, usegmt=True)})) as srv, \
            _analyzer(srv.url, backoff_max_s=30.0) as an:
        t0 = time.monotonic()
        (rec,) = an.analyze_records([_traj(0)])
        elapsed = time.monotonic() - t0
        # the date has whole seconds: it lies 1-2 s ahead when the reply is read
        assert isinstance(rec.analysis, Analysis) and rec.attempts == 2
        assert 0.9 <= elapsed < 2.0 + 3.0 and an.stats["retry_after_waits"] == 1


def test_retry_after_past_the_deadline_is_a_deadline_failure_without_the_wait():
    always = lambda body, n: (429, {"error": {"message": "rate limited"}}, 0.0, {"Retry-After": "30"})  # noqa: E731
    with serve(always) as srv, _analyzer(srv.url, backoff_max_s=60.0) as an:
        t0 = time.monotonic()
        job = an.submit([_traj(0)], deadline_s=10.0)
        assert job.result(timeout=60) == [None]
        assert time.monotonic() - t0 < 4.0  # neither the 30 s wait nor the 10 s deadline was sat out
        (rec,) = job.records
        assert rec.failure.startswith("transport: deadline: HTTP 429") and "Retry-After" in rec.failure
        assert len(srv.bodies) == 1 and an.late(job) == 1
        st = an.stats
        assert (st["deadline_failures"], st["failures"], st["retry_after_waits"], st["retries"]) == (1, 1, 0, 0)


def test_probe_retries_a_429():
    with serve(_then_ok(429, {"Retry-After": "0"})) as srv, _analyzer(srv.url, backoff_max_s=30.0) as an:
        assert an.probe().tokens >= 1 and len(srv.bodies) == 2 and an.stats["retry_after_waits"] == 1


def test_max_tokens_field():
    with serve(_sse()) as srv:
        with _analyzer(srv.url, max_tokens=321, max_tokens_field="max_completion_tokens") as an:
            an.probe()
            assert isinstance(an.analyze([_traj(0)])[0], Analysis)
        with _analyzer(srv.url, max_tokens=321) as an:  # the default: the reference's request exactly
            an.analyze([_traj(1)])
        probe, new, old = srv.bodies
    assert probe["max_completion_tokens"] == 16 and "max_tokens" not in probe
    assert new["max_completion_tokens"] == 321 and "max_tokens" not in new
    assert old["max_tokens"] == 321 and "max_completion_tokens" not in old
    with pytest.raises(ValueError, match="max_tokens_field"):
        LLMAnalyzer("http://h:1", model="m", max_tokens_field="max_new_tokens")
    with pytest.raises(ValueError, match="max_in_flight"):
        LLMAnalyzer("http://h:1", model="m", max_in_flight=-1)


def test_max_in_flight_caps_open_requests_per_endpoint():
    trajs = [_traj(i) for i in range(4)]
    with serve(_sse(GOOD, pieces=3, gap_s=0.05)) as srv:
        with _analyzer(srv.url, concurrency=4, max_in_flight=1) as an:
            assert all(isinstance(a, Analysis) for a in an.analyze(trajs))
            assert srv.max_in_flight == 1 and an.stats["in_flight_waits"] >= 1
    with serve(_sse(GOOD, pieces=3, gap_s=0.05)) as srv:
        with _analyzer(srv.url, concurrency=4) as an:  # 0: only concurrency bounds it
            an.analyze(trajs)
            assert srv.max_in_flight > 1 and an.stats["in_flight_waits"] == 0
    # two analyzers of one endpoint (training and evaluation) share its limit
    with serve(_sse(GOOD, pieces=3, gap_s=0.05)) as srv:
        with _analyzer(srv.url, concurrency=3, max_in_flight=1) as a1, \
                _analyzer(srv.url + "/v1", concurrency=3, max_in_flight=1) as a2:
            j1, j2 = a1.submit(trajs[:3]), a2.submit([_traj(i) for i in range(10, 13)])
            assert all(isinstance(a, Analysis) for a in j1.result(timeout=60) + j2.result(timeout=60))
            assert srv.max_in_flight == 1 and len(srv.bodies) == 6


def test_a_slot_is_not_held_through_a_retry_after_wait():
    """max_in_flight=1, two trajectories: the first request gets 429 with Retry-After 1; the other trajectory's
    request is sent (and answered) during that wait, then the retry."""
    with serve(_then_ok(429, {"Retry-After": "1"})) as srv, \
            _analyzer(srv.url, concurrency=2, max_in_flight=1, backoff_max_s=30.0) as an:
        t0 = time.monotonic()
        out = an.analyze([_traj(0), _traj(1)])
        assert all(isinstance(a, Analysis) for a in out) and 0.9 <= time.monotonic() - t0 < 1.0 + 3.0
        first, other, retry = srv.prompts()
        assert other != first and retry == first and srv.max_in_flight == 1


def test_hosted_endpoint_keys_from_config():
    from opid_mega.config import ConfigError, load_config
    from opid_mega.rollout.launch import llm_analyzer

    cfg = load_config(None, ["analyzer.model=m", "analyzer.max_tokens_field=max_completion_tokens",
                             "analyzer.max_in_flight=2"])
    with llm_analyzer(cfg.analyzer, base_url="http://h:1") as an:
        assert (an.max_tokens_field, an.max_in_flight) == ("max_completion_tokens", 2)
    default = load_config(None, ["analyzer.model=m"]).analyzer
    assert (default.max_tokens_field, default.max_in_flight) == ("max_tokens", 0)
    for override, key in (("analyzer.max_tokens_field=max_new_tokens", "analyzer.max_tokens_field"),
                          ("analyzer.max_in_flight=-1", "analyzer.max_in_flight"),
                          ("analyzer.max_in_flight=1.5", "analyzer.max_in_flight")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        assert str(e.value).startswith(key) and "\n" not in str(e.value)
