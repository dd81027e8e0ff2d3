"""A stand-in for a hosted analyzer: a real OpenAI-compatible HTTP server on loopback that answers the analyzer's
prompts with real analyses after a chosen latency, for runs and tests that need an analyzer endpoint without a model.

    with StandinServer(latency_s=2.5, model="standin") as srv:   # serving in a background thread
        analyzer = LLMAnalyzer(srv.base_url, model="standin")     # srv.base_url: http://127.0.0.1:<port>/v1

    python -m opid_mega.skills.standin --port 0 --latency-s 2.5 --model standin
    # prints http://127.0.0.1:<port>/v1 on stdout, serves until SIGTERM / SIGINT

Routes: GET /v1/models (and /v1/models/<model>), POST /v1/chat/completions, streamed (`"stream": true`: SSE
`chat.completion.chunk`s, the last one with finish_reason "stop", then `data: [DONE]`) or whole (a
`chat.completion` body). The completion budget may be named `max_tokens` or `max_completion_tokens` (a positive
integer; accepted, not enforced). `latency_s` (fractional seconds) passes before the first token of each reply
(the response headers are sent at once, as hosted endpoints do). Errors are OpenAI-shaped JSON: 400 for a body that
is not a JSON object, has no usable `messages`, or a bad field; 404 for another model (the probe names what
/v1/models lists) or path. The server keeps counts: `requests`, `max_in_flight`.

The reply to an analysis prompt (opid_mega.skills.prompts.build_analysis_prompt, and its re-ask) is what
opid_mega.skills.rules.RuleAnalyzer produces for that trajectory as a rollout hands it over: the prompt is parsed
back into the task, the outcome, K, gamma and each step's observation, response and discounted return; each step's
reward is recovered from the returns (r_t = G_t - gamma G_{t+1}, to the prompt's 6 decimals: rewards below 1e-5
count as 0), its action and validity from the response by the env's reference rules
(opid_mega.envs.prompts.project_action: the "search" family when responses carry <search>/<answer> tags and no
<action>, else "action"). It is sent as the reference's JSON reply (episode_summary, episode_skill, step_skills keyed
by 0-based step). A prompt that does not parse back into a trajectory gets a deterministic analysis built from its
own text instead: the episode skill quotes its task line (else its first line), and the first K candidate step
indices it lists (if any) each get a step skill — always valid JSON with valid indices, never an error. A
"Reply with the single word: X" prompt (the analyzer's start-up probe) is answered with X.

`analyzer` (an import path "package.module:Class" of an opid_mega.skills analyzer with `analyze_one`, built with
`analyzer_options` and the prompt's K as max_step_skills; default: the rule analyzer) answers in the rule analyzer's
place, e.g. opid_mega.skills.hindsight:FootprintsHindsightAnalyzer with {"wrong_door_rate": 0.2}: an analyzer that
errs. `empty_rate` / `malformed_rate`: the share of replies that are empty (the client's transport error, retried) or
cut in the middle of their JSON (a parse failure, re-asked), each reply's fate drawn from a hash of `seed`, the prompt
and how many times this server has seen that prompt, so a run's sequence of faults repeats.

Standard library only on the serving side (http.server.ThreadingHTTPServer, one thread per request).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from opid_mega.envs.prompts import project_action
from opid_mega.skills.prompts import _FAILURE, _SUCCESS
from opid_mega.skills.rules import RuleAnalyzer
from opid_mega.skills.types import Analysis, StepView, TrajectoryView

_REASK_MARK = "\n\nYour previous reply could not be used.\n"
_WORD_PROMPT = re.compile(r"^\s*Reply with the single word:\s*(\S+)\s*$")
_HEAD = re.compile(r"\nTask: (?P<task>.*?)\nOutcome: (?P<outcome>success|failure)\n"
                   r"Candidate step indices: \[(?P<cands>[0-9, ]*)\]\n", re.S)
_TRAJ = re.compile(r"\nTrajectory \((?P<n>\d+) steps; [^\n]*?gamma = (?P<gamma>[^)\s]+)\):\n")
_K = re.compile(r"Choose at most (\d+) critical steps")
_CANDS = re.compile(r"Candidate step indices: \[([0-9, ]*)\]")
_CHUNK_CHARS = 24  # characters per streamed chunk


class _Unparsed(ValueError):
    """The prompt is no analysis prompt this module can read back."""


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) else 0.0


def parse_prompt(prompt: str) -> tuple[TrajectoryView, int]:
    """(the trajectory, K) an analysis prompt was rendered from, as far as the prompt holds it (StepView actions
    and validity by the env's reference rules); raises _Unparsed."""
    at = prompt.find(_REASK_MARK)
    if at >= 0:  # a re-ask: the original prompt comes first
        prompt = prompt[:at]
    head = _HEAD.search(prompt)
    traj = _TRAJ.search(prompt, head.end() - 1) if head else None
    if head is None or traj is None:
        raise _Unparsed("no task / trajectory header")
    n, gamma = int(traj.group("n")), _number(traj.group("gamma"))
    won = head.group("outcome") == "success"
    tail = "\n\n" + (_SUCCESS if won else _FAILURE) + "\n\n"
    end = prompt.rfind(tail)
    if end < traj.end():
        raise _Unparsed("no outcome instruction after the trajectory")
    block = prompt[traj.end():end]
    cands = [int(c) for c in head.group("cands").replace(" ", "").split(",") if c]
    if n < 1 or cands != list(range(n)):
        raise _Unparsed("the candidate indices are not 0..n-1")
    raw: list[tuple[str, str, float]] = []
    pos = 0
    for i in range(n):
        start = f"\nStep {i}\nObservation: "
        if not block.startswith(start, pos):
            raise _Unparsed(f"step {i} not where expected")
        body_at = pos + len(start)
        if i + 1 < n:
            m = re.compile(rf"\nDiscounted return: ([^\n]*)\n\n(?=Step {i + 1}\nObservation: )").search(block, body_at)
        else:
            m = re.compile(r"\nDiscounted return: ([^\n]*)$").search(block, body_at)
        if m is None:
            raise _Unparsed(f"no discounted return for step {i}")
        body = block[body_at:m.start()]
        cut = body.find("\nResponse: ")
        if cut < 0:
            raise _Unparsed(f"no response for step {i}")
        raw.append((body[:cut], body[cut + len("\nResponse: "):], _number(m.group(1))))
        pos = m.end() - 1  # at the blank line's "\n" before the next "Step"
    returns = [g for _, _, g in raw] + [0.0]
    responses = [r for _, r, _ in raw]
    lower = [r.lower() for r in responses]
    family = "search" if not any("<action>" in r for r in lower) and \
        any("<search>" in r or "<answer>" in r for r in lower) else "action"
    steps = []
    for t, (obs, response, _) in enumerate(raw):
        reward = returns[t] - gamma * returns[t + 1]
        action, valid = project_action(response, family)
        steps.append(StepView(obs, response, reward if abs(reward) >= 1e-5 else 0.0, action, valid))
    ks = _K.findall(prompt)
    k = int(ks[-1]) if ks else 5
    return TrajectoryView(task=head.group("task"), won=won, steps=steps), k


def fallback_analysis(prompt: str) -> Analysis:
    """A deterministic analysis from a prompt's own text (one that does not parse back into a trajectory)."""
    task = re.search(r"^Task: (.*)$", prompt, re.M)
    line = (task.group(1) if task else next((x for x in prompt.splitlines() if x.strip()), "")).strip()[:200]
    ks = _K.findall(prompt)
    k = int(ks[-1]) if ks else 5
    cands = _CANDS.search(prompt)
    idx = [int(c) for c in cands.group(1).replace(" ", "").split(",") if c][:k] if cands else []
    what = f"'{line}'" if line else "this one"
    return Analysis(episode_summary=f"An episode of a task like {what}.",
                    episode_skill=f"For a task like {what}, state the goal, act toward it step by step and check "
                                  "each observation before the next action.",
                    step_skills={i: f"At step {i}, choose the action that moves most directly toward the goal."
                                 for i in idx})


def analysis_reply(prompt: str, analyzer: Optional[Callable[[int], Any]] = None) -> str:
    """The text the stand-in answers `prompt` with (see the module docstring); `analyzer(k)`: the analyzer (with
    `analyze_one`) for K = k (default: the rule analyzer)."""
    word = _WORD_PROMPT.match(prompt)
    if word:
        return word.group(1)
    try:
        view, k = parse_prompt(prompt)
        analysis = (analyzer or (lambda n: RuleAnalyzer(max_step_skills=n)))(k).analyze_one(view)
    except _Unparsed:
        analysis = None
    if analysis is None:
        analysis = fallback_analysis(prompt)
    return json.dumps(analysis.to_dict(), ensure_ascii=False)


class _BadRequest(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _prompt_of(body: Any, model: str) -> tuple[str, bool]:
    """(the last user message's text, stream) of a chat completion request; raises _BadRequest."""
    if not isinstance(body, dict):
        raise _BadRequest(400, "the request body must be a JSON object")
    if body.get("model") not in (None, model):
        raise _BadRequest(404, f"The model `{body.get('model')}` does not exist (this server serves `{model}`).",
                          "model", "model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise _BadRequest(400, "'messages' must be a non-empty list of message objects", "messages")
    content = messages[-1].get("content")
    if isinstance(content, list):  # content parts: the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if not isinstance(content, str):
        raise _BadRequest(400, "the last message's 'content' must be a string or a list of text parts", "messages")
    for field in ("max_tokens", "max_completion_tokens"):
        v = body.get(field)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise _BadRequest(400, f"'{field}' must be a positive integer", field)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _BadRequest(400, "'stream' must be a boolean", "stream")
    return content, stream


def analyzer_factory(spec: str, options: Optional[dict] = None) -> Callable[[int], Any]:
    """k -> the analyzer `spec` names ("package.module:Class", a subclass of opid_mega.skills.Analyzer with
    analyze_one) built with `options` and max_step_skills=k (one instance per k). Raises ValueError naming a bad
    spec or option."""
    from opid_mega.plugins import PluginError
    from opid_mega.skills.plugins import analyzer_class, analyzer_kwargs

    try:
        cls = analyzer_class(spec)
    except PluginError as e:
        raise ValueError(f"StandinServer: {e}") from None
    if not callable(getattr(cls, "analyze_one", None)):
        raise ValueError(f"StandinServer: analyzer {spec!r} has no analyze_one (a per-trajectory analyzer is needed)")
    made: dict = {}

    def build(k: int):
        if k not in made:
            made[k] = cls(**analyzer_kwargs(cls, dict(options or {}), k))
        return made[k]

    build(5)  # a bad option is an error now, not a 500 on the first request
    return build


def _rate(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value <= 1.0:
        raise ValueError(f"StandinServer: {name}={value!r} must be a number in [0, 1]")
    return float(value)


class StandinServer:
    """The stand-in on 127.0.0.1:`port` (0: any free port), serving in a background thread between start() and
    close() (or as a context manager). `base_url`: http://127.0.0.1:<port>/v1. `analyzer`, `analyzer_options`,
    `empty_rate`, `malformed_rate`, `seed`: see the module docstring."""

    def __init__(self, latency_s: float = 0.0, model: str = "standin", port: int = 0, host: str = "127.0.0.1",
                 analyzer: str = "", analyzer_options: Optional[dict] = None, empty_rate: float = 0.0,
                 malformed_rate: float = 0.0, seed: int = 0):
        if not (isinstance(latency_s, (int, float)) and math.isfinite(latency_s) and latency_s >= 0):
            raise ValueError(f"StandinServer: latency_s={latency_s!r} must be a finite number of seconds >= 0")
        if not model:
            raise ValueError("StandinServer: model is empty")
        self.empty_rate, self.malformed_rate = _rate("empty_rate", empty_rate), _rate("malformed_rate", malformed_rate)
        if self.empty_rate + self.malformed_rate > 1.0:
            raise ValueError(f"StandinServer: empty_rate + malformed_rate = {self.empty_rate + self.malformed_rate:g} "
                             "must be at most 1")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"StandinServer: seed={seed!r} must be an int")
        self.seed = seed
        self.analyzer = analyzer_factory(analyzer, analyzer_options) if analyzer else None
        self.seen: dict = {}  # prompt digest -> times answered (the fault draws' counter)
        self.faults = {"empty": 0, "malformed": 0}
        self.latency_s = float(latency_s)
        self.model = model
        self.requests = 0  # chat completion requests answered (errors included)
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._httpd = ThreadingHTTPServer((host, port), self._handler())
        self._httpd.daemon_threads = True
        self.host, self.port = self._httpd.server_address[:2]
        self.base_url = f"http://{self.host}:{self.port}/v1"
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "StandinServer":
        if self._thread is None:
            self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                            name="standin-server", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._closing.set()  # replies waiting out their latency end now
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()

    def reply(self, prompt: str) -> str:
        """The reply to `prompt`: the analysis, or (by the fault draw) an empty or cut reply."""
        text = analysis_reply(prompt, self.analyzer)
        if not (self.empty_rate or self.malformed_rate) or _WORD_PROMPT.match(prompt):
            return text
        digest = hashlib.sha256(prompt.encode("utf-8")).hexdigest()
        with self._lock:
            n = self.seen[digest] = self.seen.get(digest, 0) + 1
        u = int.from_bytes(hashlib.sha256(f"{self.seed}/{digest}/{n}".encode()).digest()[:8], "big") / 2.0 ** 64
        fault = "empty" if u < self.empty_rate else "malformed" if u < self.empty_rate + self.malformed_rate else ""
        if not fault:
            return text
        with self._lock:
            self.faults[fault] += 1
        return "" if fault == "empty" else text[:len(text) // 2]

    def __enter__(self) -> "StandinServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "opid-standin/1"

            def log_message(self, *args):  # quiet: a stand-in serving many requests
                pass

            def _json(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, e: _BadRequest) -> None:
                kind = "invalid_request_error" if e.status < 500 else "server_error"
                self._json(e.status, {"error": {"message": e.message, "type": kind, "param": e.param,
                                                "code": e.code}})

            def _model(self) -> dict:
                return {"id": server.model, "object": "model", "created": 0, "owned_by": "opid-standin"}

            def do_GET(self):  # noqa: N802
                path = self.path.split("?", 1)[0].rstrip("/")
                if path == "/v1/models":
                    return self._json(200, {"object": "list", "data": [self._model()]})
                if path == f"/v1/models/{server.model}":
                    return self._json(200, self._model())
                self._error(_BadRequest(404, f"no route GET {self.path}"))

            def do_POST(self):  # noqa: N802
                try:
                    size = int(self.headers.get("Content-Length") or 0)
                    raw = self.rfile.read(size) if size > 0 else b""
                except (ValueError, OSError):
                    return self._error(_BadRequest(400, "a request body with a valid Content-Length is required"))
                if self.path.split("?", 1)[0].rstrip("/") != "/v1/chat/completions":
                    return self._error(_BadRequest(404, f"no route POST {self.path}"))
                with server._lock:
                    server.requests += 1
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    try:
                        body = json.loads(raw.decode("utf-8"))
                    except (UnicodeDecodeError, ValueError):
                        raise _BadRequest(400, "the request body is not valid JSON") from None
                    prompt, stream = _prompt_of(body, server.model)
                    text = server.reply(prompt)
                    if stream:
                        self._stream(text)
                    else:
                        if server._closing.wait(server.latency_s):
                            return
                        self._json(200, self._completion(text))
                except _BadRequest as e:
                    self._error(e)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up and left
                    pass
                except Exception as e:  # noqa: BLE001 - a bug answers 500, the server goes on
                    try:
                        self._error(_BadRequest(500, f"stand-in error: {type(e).__name__}: {e}"))
                    except OSError:
                        pass
                finally:
                    with server._lock:
                        server.in_flight -= 1

            def _completion(self, text: str) -> dict:
                return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
                        "created": int(time.time()), "model": server.model,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 0, "completion_tokens": len(text.split()),
                                  "total_tokens": len(text.split())}}

            def _stream(self, text: str) -> None:
                cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

                def chunk(delta: dict, finish: Optional[str] = None) -> bytes:
                    obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": server.model,
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode("utf-8")

                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
                self.wfile.flush()
                if server._closing.wait(server.latency_s):
                    return
                out = [chunk({"role": "assistant", "content": ""})]
                out += [chunk({"content": text[i:i + _CHUNK_CHARS]}) for i in range(0, len(text), _CHUNK_CHARS)]
                out.append(chunk({}, "stop"))
                for piece in out:
                    self.wfile.write(piece)
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        return Handler


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opid_mega.skills.standin",
                                 description="An OpenAI-compatible stand-in for a hosted analyzer, on loopback.")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--latency-s", type=float, default=0.0, help="seconds before the first token of each reply")
    ap.add_argument("--model", default="standin", help="the served model name (requests must name it)")
    ap.add_argument("--analyzer", default="", help="package.module:Class of the analyzer that answers (default: the "
                                                   "rule analyzer)")
    ap.add_argument("--analyzer-options", default="{}", help="its constructor options as a JSON object")
    ap.add_argument("--empty-rate", type=float, default=0.0, help="share of empty replies")
    ap.add_argument("--malformed-rate", type=float, default=0.0, help="share of replies cut mid-JSON")
    ap.add_argument("--seed", type=int, default=0, help="seed of the fault draws")
    args = ap.parse_args(argv)
    try:
        options = json.loads(args.analyzer_options)
        if not isinstance(options, dict):
            raise ValueError(f"--analyzer-options must be a JSON object, got {args.analyzer_options!r}")
        srv = StandinServer(latency_s=args.latency_s, model=args.model, port=args.port, host=args.host,
                            analyzer=args.analyzer, analyzer_options=options, empty_rate=args.empty_rate,
                            malformed_rate=args.malformed_rate, seed=args.seed)
    except (ValueError, OSError) as e:
        print(f"standin: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with srv:
        print(srv.base_url, flush=True)
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
