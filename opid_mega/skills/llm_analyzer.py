"""Hindsight analysis with an LLM behind any OpenAI-compatible `/v1/chat/completions` endpoint (SGLang, vLLM, ...),
through the `openai` client.

    analyzer = LLMAnalyzer("http://127.0.0.1:30000", model="Qwen/Qwen2.5-7B-Instruct", cache_path=run_dir / "cache.jsonl",
                           audit=AuditLog(run_dir / "audit.jsonl"))
    analyzer.probe()                                 # one short request: a bad key/URL/model fails here, in one line
    job = analyzer.submit(trajs, iteration=it)       # background: score old/ref log-probs meanwhile
    ...
    analyses = job.result()                          # list[Analysis | None], one per trajectory, in order
    analyzer.stats                                   # {"requests", "retries", "reasks", "failures", "cache_hits", ...}

Per trajectory (docs/algorithm.md §3): one prompt (`build_analysis_prompt`), one request, parse (`parse_analysis`
with the `parser` rules); an unusable reply gets ONE re-ask (`build_reask_prompt`: the error and the last 2000 characters of
the bad reply); a trajectory whose analysis finally fails gets None (no skill signal; its outcome advantage stays) —
counted in `stats["failures"]`, logged, never raised.

Requests (the reference's sampling, "More reference facts"): one user message, the completion budget `max_tokens`
(sent as `max_tokens_field`: "max_tokens", the reference's and SGLang/vLLM's, or "max_completion_tokens", which
OpenAI's newer models require; the probe sends the same field); no temperature unless
`temperature` is set (the server's default otherwise) and no response format unless `response_format` is
"json_object" or "json_schema" (this project's options; a server that answers 400/422 to one is asked once more
without it, and the analyzer then stops sending it). The text parsed is the reasoning content, a newline, then the
content.

Retries (the reference's policy): 1 + `max_retries` (default 4: 5 attempts in all) per request; EVERY exception is
retried — HTTP errors of any status, connection errors, timeouts, a broken body — and so is an empty reply (a
transport error); the wait before retry r (1-based) is min(backoff_max_s, backoff_s x 2^(r-1)): 1, 2, 4, 8 s by
default. A 429 or 503 with a `Retry-After` header (delay-seconds or an HTTP date; OpenAI's `retry-after-ms` first)
waits what the server asks instead, capped at `backoff_max_s` (`stats["retry_after_waits"]`); a wait that would
end past the call's deadline is not slept: the analysis ends at once as a deadline failure. In the probe a 429 is
retried like that too (every other 4xx is final there). The `openai` client does the HTTP (auth header, SSE decoding, error types) with its own retries off: its
policy (0.5 s x 2 capped at 8 s with jitter, transient statuses only, no empty-reply check) is not the reference's.

The HTTP side (URL, Retry-After, the endpoint gate, a call's deadline, the streamed reply): opid_mega.skills.llm_transport.

Timeouts that cannot starve: replies are streamed and a request is given up only when it makes no progress — no
token for `stall_timeout_s` (the time to the first token included) — or when `timeout_s` (optional, a cap on the
whole reply; off by default) or the call's deadline passes; never at a fixed time shorter than a healthy reply. A
request the client gives up on is aborted on the server (SGLang: each request carries `rid` and is ended with POST
/abort_request {"rid": ...}; found by `probe()` through /model_info, or `sglang=True`), so abandoned requests never
keep decoding beside their retries. A server that ignores `stream` and answers the whole completion as JSON is read
as such (its reply must then arrive within `stall_timeout_s`).

Cache: successful analyses keyed by sha256(model, prompt text) — the prompt holds the whole trajectory, K and γ —
in memory, and appended to `cache_path` (JSONL) when given, so a resumed run or an identical trajectory costs no call.
Failures are never cached. Identical prompts within one call are sent once (cache on). Every trajectory gets its
own Analysis object.

Untrusted text: `opid_mega.skills.sanitize` cleans and caps each reply as it arrives, and every analysis written to
or read back from the cache, so one poisoned reply (a lone surrogate, control characters, a 5000-digit step key)
costs at most its own analysis, never the batch or a resumed run; a failed cache write costs only that entry.

Concurrency: at most `concurrency` trajectories analysed at once per analyzer (one worker pool), whatever the number
of concurrent `analyze`/`submit` calls. `submit` jobs run side by side (the batches of several iterations in flight
are analysed concurrently), their requests served from that pool in submission order. `max_in_flight` > 0 also caps the HTTP requests open at once to one endpoint
(keyed by base_url) over every LLMAnalyzer of the process — a hosted endpoint's rate limit shared by the training
and evaluation analyzers: a request waits for a slot before it is sent and holds it only while it is open (never
through a backoff or Retry-After wait); each analyzer applies its own limit to the endpoint's shared count
(`stats["in_flight_waits"]`: requests that had to wait for a slot). A wait for a slot ends at the call's deadline or
at close().

Deadline: `submit(..., deadline_s=D)` / `analyze_records(..., deadline_s=D)` (the trainer's analyzer.deadline_s)
returns D seconds after the call at the latest: every analysis not done by then is a failure ("deadline: ..."; no
skill signal, counted in `stats["failures"]` and `stats["deadline_failures"]`, audited), requests not started are
cancelled, the ones in flight are aborted on the server, and no request or backoff of this call runs past the
deadline. `close()` does not wait for requests in flight (it aborts them on the server, best effort).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import httpx
import openai

from opid_mega.skills.audit import AuditLog
from opid_mega.skills.base import Analyzer
from opid_mega.skills.parser import PARSER_RULES, parse_analysis
from opid_mega.skills.prompts import build_analysis_prompt, build_reask_prompt
from opid_mega.skills.sanitize import analysis_from_dict, clean_text, sanitize_analysis, sanitize_reply
from opid_mega.skills.llm_transport import (Call, EmptyReply, Reply, Stalled, Stop, TransportError,
                                           chat_completions_url, endpoint_gate, retry_after_s, short)
from opid_mega.skills.types import Analysis, AnalysisParseError, TrajectoryView

logger = logging.getLogger(__name__)

RESPONSE_FORMATS = ("none", "json_object", "json_schema")

# The reply shape (docs/algorithm.md §3) for servers that take a JSON schema (SGLang/xgrammar, vLLM, OpenAI).
ANALYSIS_JSON_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "episode_summary": {"type": "string"},
        "episode_skill": {"type": "string"},
        "step_skills": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "required": ["episode_summary", "episode_skill", "step_skills"],
}
_RESPONSE_FORMAT_BODY = {
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema",
                    "json_schema": {"name": "hindsight_analysis", "schema": ANALYSIS_JSON_SCHEMA}},
}

MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")
RETRY_AFTER_STATUSES = (429, 503)  # the statuses whose Retry-After header is honoured

PROBE_PROMPT = "Reply with the single word: ready"
PROBE_MAX_TOKENS = 16


class AnalyzerUnavailable(RuntimeError):
    """The start-up probe failed: the message (one line) names the endpoint, the reason and the key to check."""


@dataclass
class AnalysisRecord:
    """What happened for one trajectory: for the audit log and for debugging."""

    traj_id: str
    prompt: str
    analysis: Optional[Analysis] = None
    failure: Optional[str] = None  # why `analysis` is None
    replies: list = field(default_factory=list)  # model answers: the first, and the re-asked one if any
    attempts: int = 0  # requests sent for this trajectory (retries included)
    cached: bool = False
    reasked: bool = False
    elapsed_s: float = 0.0


@dataclass
class ProbeResult:
    """What the start-up probe measured (one request of PROBE_MAX_TOKENS tokens, alone on the endpoint)."""

    url: str
    model: str
    seconds: float  # the whole request
    first_token_s: Optional[float]  # to the first streamed token
    tokens: int  # streamed pieces with text (SGLang streams one per token)
    tokens_per_s: Optional[float]  # decode rate after the first token
    sglang: bool  # requests carry a rid and are aborted on the server when given up

    def describe(self, max_tokens: Optional[int] = None) -> str:
        text = f"{self.model} at {self.url} answered the probe in {self.seconds:.1f} s"
        if self.tokens_per_s:
            text += f" ({self.tokens} tokens, ~{self.tokens_per_s:.1f} tokens/s alone"
            if max_tokens:
                text += f"; a {max_tokens}-token reply ~{max_tokens / self.tokens_per_s:.0f} s"
            text += ")"
        return text + ("; SGLang: given-up requests are aborted on the server" if self.sglang else "")


class AnalysisJob(Future):
    """A `concurrent.futures.Future` of `list[Analysis | None]`; `.records` (one AnalysisRecord per trajectory) is
    filled once the job is done."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[AnalysisRecord] = []


class LLMAnalyzer(Analyzer):
    def __init__(self, base_url: str, model: str, api_key: str = "EMPTY", concurrency: int = 16,
                 timeout_s: Optional[float] = None, stall_timeout_s: float = 120.0, max_retries: int = 4,
                 backoff_s: float = 1.0, backoff_max_s: float = 30.0, temperature: Optional[float] = None,
                 max_tokens: int = 4096, response_format: Optional[str] = "none", parser: str = "reference",
                 max_step_skills: int = 5, gamma: float = 0.95, cache: bool = True,
                 cache_path: Optional[str | Path] = None, audit: Optional[AuditLog] = None,
                 connect_timeout_s: float = 10.0, sglang: Optional[bool] = None,
                 max_tokens_field: str = "max_tokens", max_in_flight: int = 0):
        if not model:
            raise ValueError("LLMAnalyzer: model is empty (the served model name, e.g. the HF path given to SGLang)")
        if concurrency < 1:
            raise ValueError(f"LLMAnalyzer: concurrency={concurrency} must be >= 1")
        if max_retries < 0:
            raise ValueError(f"LLMAnalyzer: max_retries={max_retries} must be >= 0")
        if (timeout_s is not None and timeout_s <= 0) or stall_timeout_s <= 0 or backoff_s < 0 or backoff_max_s < 0:
            raise ValueError("LLMAnalyzer: timeout_s (or None) and stall_timeout_s must be > 0, backoff_s and "
                             "backoff_max_s >= 0")
        if max_step_skills < 0:
            raise ValueError(f"LLMAnalyzer: max_step_skills={max_step_skills} must be >= 0")
        response_format = response_format or "none"
        if response_format not in RESPONSE_FORMATS:
            raise ValueError(f"LLMAnalyzer: response_format={response_format!r}, allowed: "
                             f"{', '.join(RESPONSE_FORMATS)}")
        if parser not in PARSER_RULES:
            raise ValueError(f"LLMAnalyzer: parser={parser!r}, allowed: {', '.join(PARSER_RULES)}")
        if max_tokens_field not in MAX_TOKENS_FIELDS:
            raise ValueError(f"LLMAnalyzer: max_tokens_field={max_tokens_field!r}, allowed: "
                             f"{', '.join(MAX_TOKENS_FIELDS)}")
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 0:
            raise ValueError(f"LLMAnalyzer: max_in_flight={max_in_flight!r} must be an integer >= 0 (0: no limit)")
        self.url = chat_completions_url(base_url)
        self.base_url = self.url[: -len("/chat/completions")]  # .../v1, what the openai client takes
        self.server_root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url  # /abort_request
        self.model = model
        self.api_key = api_key or "EMPTY"
        self.concurrency = concurrency
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.stall_timeout_s = float(stall_timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.max_tokens_field = max_tokens_field
        self.max_in_flight = max_in_flight
        self._gate = endpoint_gate(self.base_url)  # shared with every analyzer of this endpoint in the process
        self.response_format: Optional[str] = None if response_format == "none" else response_format
        self.parser = parser
        self.max_step_skills = max_step_skills
        self.gamma = gamma
        self.audit = audit
        self.sglang = sglang  # None: not known yet (probe() finds out); requests carry a rid only when True
        self._format_rejected = False  # the server answered 400 to response_format and 200 without it
        self._lock = threading.Lock()
        self._stats = {"requests": 0, "retries": 0, "reasks": 0, "failures": 0, "cache_hits": 0, "analyzed": 0,
                       "response_format_fallbacks": 0, "deadline_failures": 0, "empty_replies": 0, "stalls": 0,
                       "aborts": 0, "retry_after_waits": 0, "in_flight_waits": 0}
        self._stop = threading.Event()
        self._workers = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="llm-analyzer")
        # openai's own retries are off: the loop in _chat is the reference's policy (see the module docstring)
        self._client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0)
        self._http = httpx.Client(headers={"Authorization": f"Bearer {self.api_key}"}, timeout=5.0)  # abort, info
        self._inflight: dict[str, Call] = {}  # rid -> its call

        self._cache_enabled = bool(cache)
        self._cache: dict[str, Analysis] = {}
        self._cache_path = Path(cache_path) if (cache and cache_path) else None
        self._cache_file = None
        if self._cache_path is not None:
            self._load_disk_cache()
            self._cache_path.parent.mkdir(parents=True, exist_ok=True)
            self._cache_file = open(self._cache_path, "a", encoding="utf-8")

    # ------------------------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def analyze(self, trajs: Sequence[TrajectoryView], iteration: Optional[int] = None) -> list[Optional[Analysis]]:
        return [r.analysis for r in self.analyze_records(trajs, iteration)]

    audits_itself = True  # every analysis, prompt and raw reply is audited here (_audit)
    deadline_slack_s = 30.0  # the job ends itself at the deadline; a little slack for it to return

    def late(self, job) -> int:
        """Analyses of a finished job that the deadline ended (their records' failure says so)."""
        return sum(str(getattr(r, "failure", "") or "").startswith(("deadline:", "transport: deadline:"))
                   for r in getattr(job, "records", []))

    def submit(self, trajs: Sequence[TrajectoryView], iteration: Optional[int] = None,
               deadline_s: Optional[float] = None) -> AnalysisJob:
        """Start `analyze(trajs)` in the background; `.result()` gives the analyses, `.records` the details.
        `deadline_s`: see the module docstring (counted from this call)."""
        if self._pool is None:
            # Jobs run side by side (the batches of the iterations in flight under train.max_staleness >= 1 are
            # analysed concurrently, not queued behind each other); their requests share the `concurrency`
            # workers, first come first served, so an older batch's requests go first. More jobs than workers
            # would only wait for a worker.
            self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="llm-analyzer-job")
        job = AnalysisJob()
        trajs = list(trajs)
        call = Call(deadline_s)  # the deadline runs from now, not from when the job thread starts

        def run() -> None:
            if not job.set_running_or_notify_cancel():
                return
            try:
                records = self.analyze_records(trajs, iteration, call=call)
            except BaseException as e:  # a bug, not a server problem: surface it through the future
                job.set_exception(e)
            else:
                job.records = records
                job.set_result([r.analysis for r in records])

        self._pool.submit(run)
        return job

    def analyze_records(self, trajs: Sequence[TrajectoryView], iteration: Optional[int] = None,
                        deadline_s: Optional[float] = None, call: Optional[Call] = None) -> list[AnalysisRecord]:
        """One AnalysisRecord per trajectory, in order (the analysis is `record.analysis`). `deadline_s`: see the
        module docstring."""
        if self._stop.is_set():
            raise RuntimeError("LLMAnalyzer is closed")
        if deadline_s is not None and not 0 < deadline_s < float("inf"):
            raise ValueError(f"LLMAnalyzer: deadline_s={deadline_s!r} must be a finite number > 0 (or None)")
        call = call or Call(deadline_s)
        records: list[Optional[AnalysisRecord]] = [None] * len(trajs)
        groups: dict[str, list[int]] = {}  # cache key -> indices of trajectories with that prompt
        prompts: dict[str, str] = {}
        for i, traj in enumerate(trajs):
            tid = getattr(traj, "traj_id", "") or str(i)
            if not traj.steps:
                records[i] = AnalysisRecord(traj_id=tid, prompt="", failure="empty trajectory (no steps)")
                self._audit(iteration, traj, records[i])
                continue
            prompt = build_analysis_prompt(traj, self.max_step_skills, self.gamma)
            # With the cache on, identical prompts in one call are sent once; off, every trajectory is its own call.
            key = self.cache_key(prompt) if self._cache_enabled else f"{i}"
            prompts[key] = prompt
            groups.setdefault(key, []).append(i)

        futures = {}
        for key, idxs in groups.items():
            first = trajs[idxs[0]]
            hit = self._cache_get(key)
            if hit is not None:
                for i in idxs:
                    tid = getattr(trajs[i], "traj_id", "") or str(i)
                    records[i] = AnalysisRecord(traj_id=tid, prompt=prompts[key], analysis=_copy(hit), cached=True)
                    self._audit(iteration, trajs[i], records[i])
                self._count("cache_hits", len(idxs))
                continue
            tid = getattr(first, "traj_id", "") or str(idxs[0])
            futures[key] = self._workers.submit(self._analyze_one, tid, prompts[key], len(first.steps), key, call)

        for key, fut in futures.items():
            try:
                left = call.left()
                if left is not None and left <= 0 and not fut.done():
                    raise TimeoutError
                rec: AnalysisRecord = fut.result(timeout=left)  # _analyze_one never raises for server problems
            except TimeoutError:  # the deadline passed: this analysis (and every one still pending) is a failure
                if not call.abandoned.is_set():
                    call.abandoned.set()
                    self._abort_in_flight(call)  # the requests still decoding end on the server now
                fut.cancel()
                rec = AnalysisRecord(traj_id=getattr(trajs[groups[key][0]], "traj_id", "") or str(groups[key][0]),
                                     prompt=prompts[key], failure=call.deadline_failure())
                self._count("failures")
                self._count("deadline_failures", len(groups[key]))
                logger.warning("LLM analysis of trajectory %s: %s; no skill signal", rec.traj_id, rec.failure)
            except Exception as e:  # noqa: BLE001 - a bug in one analysis costs that analysis, not the batch
                logger.exception("LLM analysis of trajectory %s failed unexpectedly", groups[key][0])
                rec = AnalysisRecord(traj_id=getattr(trajs[groups[key][0]], "traj_id", "") or str(groups[key][0]),
                                     prompt=prompts[key], failure=self._scrub(f"unexpected {type(e).__name__}: {e}"))
                self._count("failures")
            idxs = groups[key]
            for n, i in enumerate(idxs):
                if n == 0:
                    records[i] = rec
                else:  # an identical trajectory in the same call: served by the first one's answer
                    tid = getattr(trajs[i], "traj_id", "") or str(i)
                    records[i] = AnalysisRecord(traj_id=tid, prompt=rec.prompt, analysis=_copy(rec.analysis),
                                                failure=rec.failure, cached=rec.analysis is not None)
                    if rec.analysis is not None:
                        self._count("cache_hits")
                    else:
                        self._count("failures")
                self._audit(iteration, trajs[i], records[i])
        return records  # type: ignore[return-value]

    def cache_key(self, prompt: str) -> str:
        return hashlib.sha256(f"{self.model}\x00{prompt}".encode("utf-8")).hexdigest()

    def close(self) -> None:
        """Stop: no new request or retry starts, queued work is cancelled; requests in flight are not waited for
        (a shutdown on SIGTERM must not sit out a reply) but aborted on the server, best effort, in the background."""
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._workers.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            cache_file, self._cache_file = self._cache_file, None
        self._abort_in_flight(None, then_close=True)
        try:
            self._client.close()
        except Exception:  # noqa: BLE001
            pass
        if cache_file is not None:
            cache_file.close()

    def __enter__(self) -> "LLMAnalyzer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------------------
    # One trajectory
    # ------------------------------------------------------------------------------------------------------------
    def _analyze_one(self, traj_id: str, prompt: str, n_steps: int, key: str, call: Call) -> AnalysisRecord:
        rec = AnalysisRecord(traj_id=traj_id, prompt=prompt)
        t0 = time.perf_counter()
        try:
            rec.analysis = self._request_and_parse(prompt, n_steps, call, rec)
        except TransportError as e:
            rec.failure = f"transport: {e}"
        except AnalysisParseError as e:
            rec.failure = f"parse: {e}"
        except Exception as e:  # never let one trajectory take the batch down
            rec.failure = f"unexpected {type(e).__name__}: {e}"
            logger.exception("LLM analysis of trajectory %s failed unexpectedly", traj_id)
        rec.elapsed_s = time.perf_counter() - t0
        if rec.analysis is not None:
            rec.analysis = sanitize_analysis(rec.analysis)  # the parser's output already is; any client's may not be
            if rec.analysis is None:
                rec.failure = "parse: the analysis holds no usable episode skill after sanitising"
        if rec.failure is not None:
            rec.failure = self._scrub(clean_text(rec.failure, 4096))
        if rec.analysis is None and call.abandoned.is_set():
            pass  # past the deadline: the caller already counted this analysis as a deadline failure
        elif rec.analysis is None:
            self._count("failures")
            if rec.failure and rec.failure.startswith("transport: deadline:"):
                self._count("deadline_failures")
            logger.warning("LLM analysis of trajectory %s failed (%s): no skill signal", traj_id, rec.failure)
        else:
            self._count("analyzed")
            try:
                self._cache_put(key, rec.analysis)
            except Exception:  # noqa: BLE001 - a cache write that fails costs the cache entry, never the analysis
                logger.exception("LLM analyzer: writing the cache entry of trajectory %s failed", traj_id)
        return rec

    def _scrub(self, text: str) -> str:
        """`text` with the API key (when it is a real one) replaced by ***: error bodies may echo it."""
        key = self.api_key
        return text.replace(key, "***") if key and key != "EMPTY" and len(key) >= 6 else text

    def _request_and_parse(self, prompt: str, n_steps: int, call: Call, rec: AnalysisRecord) -> Analysis:
        candidates = range(n_steps)
        # untrusted text: cleaned and capped at the boundary
        answer = sanitize_reply(self._chat(prompt, call, rec).text())
        rec.replies.append(answer)
        try:
            return parse_analysis(answer, candidates, self.max_step_skills, rules=self.parser)
        except AnalysisParseError as first_error:
            self._count("reasks")
            rec.reasked = True
            reask = build_reask_prompt(prompt, answer, str(first_error))
            answer2 = sanitize_reply(self._chat(reask, call, rec).text())
            rec.replies.append(answer2)
            try:
                return parse_analysis(answer2, candidates, self.max_step_skills, rules=self.parser)
            except AnalysisParseError as second_error:
                raise AnalysisParseError(f"after one re-ask: {second_error} (first reply: {first_error})") from None

    # ------------------------------------------------------------------------------------------------------------
    # Requests
    # ------------------------------------------------------------------------------------------------------------
    def probe(self, max_tokens: int = PROBE_MAX_TOKENS) -> ProbeResult:
        """One short request before any analysis: whether the endpoint answers, with this key and this model.
        Whether the server is SGLang (GET /model_info answers with a model_path) is found out first when not given.
        Connection errors, timeouts, 5xx, 429 (its Retry-After honoured) and empty replies are retried like any
        request; any other 4xx is final. Raises
        AnalyzerUnavailable with one line naming the endpoint, the reason and the config key to check."""
        if self.sglang is None:
            self.sglang = self._looks_like_sglang()
        call, rec = Call(None), AnalysisRecord(traj_id="probe", prompt=PROBE_PROMPT)
        t0 = time.monotonic()
        try:
            reply = self._chat(PROBE_PROMPT, call, rec, max_tokens=max_tokens, final_4xx=True)
        except openai.APIStatusError as e:
            raise AnalyzerUnavailable(self._probe_status_message(e)) from None
        except TransportError as e:
            raise AnalyzerUnavailable(f"analyzer: no usable reply from {self.base_url} for model {self.model!r} "
                                      f"({self._scrub(short(e, 300))}): check analyzer.base_url and that the server "
                                      "is up") from None
        seconds = time.monotonic() - t0
        rate = None
        if reply.tokens > 1 and reply.last_token_s is not None and reply.first_token_s is not None \
                and reply.last_token_s > reply.first_token_s:
            rate = (reply.tokens - 1) / (reply.last_token_s - reply.first_token_s)
        return ProbeResult(url=self.base_url, model=self.model, seconds=seconds, first_token_s=reply.first_token_s,
                           tokens=reply.tokens, tokens_per_s=rate, sglang=bool(self.sglang))

    def _looks_like_sglang(self) -> bool:
        try:
            r = self._http.get(self.server_root + "/model_info", timeout=min(self.connect_timeout_s, 10.0))
            return r.status_code == 200 and isinstance(r.json(), dict) and "model_path" in r.json()
        except Exception:  # noqa: BLE001 - any other server: no rid, no abort
            return False

    def _probe_status_message(self, e: "openai.APIStatusError") -> str:
        status = e.status_code
        detail = self._scrub(short(getattr(e, "message", e), 200))
        if status in (401, 403):
            return (f"analyzer: {self.base_url} refused the API key (HTTP {status}: {detail}): check analyzer.api_key "
                    "or the environment variable analyzer.api_key_env names")
        if status == 404:
            served = self._served_models()
            return (f"analyzer: HTTP 404 from {self.url} for model {self.model!r} ({detail}): check analyzer.model "
                    f"and analyzer.base_url" + (f" (the server lists: {', '.join(served)})" if served else ""))
        return f"analyzer: the probe request to {self.url} failed (HTTP {status}: {detail})"

    def _served_models(self) -> list:
        try:
            return [m.id for m in self._client.models.list(timeout=5.0).data][:8]
        except Exception:  # noqa: BLE001
            return []

    def _backoff(self, retry: int) -> float:
        """The wait before retry `retry` (1-based): backoff_s x 2^(retry-1), capped at backoff_max_s."""
        return min(self.backoff_max_s, self.backoff_s * (2.0 ** min(retry - 1, 64)))  # no float overflow

    def _chat(self, prompt: str, call: Call, rec: AnalysisRecord, max_tokens: Optional[int] = None,
              final_4xx: bool = False) -> "Reply":
        """One completion's text (as Reply) after at most 1 + max_retries attempts; TransportError after the last
        one fails, or when the call's deadline passes / the analyzer closes. `final_4xx` (the probe): an HTTP 4xx
        is raised at once (openai.APIStatusError)."""
        response_format = None if self._format_rejected else self.response_format
        tried_without_format = False
        tries = 0
        while True:
            wait_hint: Optional[float] = None  # what a 429/503 asked for in Retry-After
            if self._stop.is_set():
                raise TransportError("analyzer closed")
            left = call.left()
            if left is not None and left <= 0:
                raise TransportError(call.deadline_failure())
            tries += 1
            self._count("requests")
            rec.attempts += 1
            try:
                reply = self._request(prompt, call, response_format, max_tokens or self.max_tokens)
            except Stop as e:
                raise TransportError(str(e)) from None
            except openai.APIStatusError as e:
                if e.status_code in (400, 422) and response_format is not None and not tried_without_format:
                    # probably response_format is unsupported: once more without it (not counted as a retry)
                    tried_without_format, response_format = True, None
                    tries -= 1
                    self._count("response_format_fallbacks")
                    continue
                if final_4xx and 400 <= e.status_code < 500 and e.status_code != 429:
                    raise
                error = f"HTTP {e.status_code}: {short(getattr(e, 'message', e))}"
                if e.status_code in RETRY_AFTER_STATUSES:
                    wait_hint = retry_after_s(getattr(getattr(e, "response", None), "headers", None))
            except Exception as e:  # noqa: BLE001 - the reference retries every exception
                if isinstance(e, EmptyReply):
                    self._count("empty_replies")
                elif isinstance(e, Stalled):
                    self._count("stalls")
                error = f"{type(e).__name__}: {short(e)}"
            else:
                if tried_without_format and not self._format_rejected:
                    with self._lock:
                        self._format_rejected = True
                    logger.warning("LLM analyzer: %s rejected response_format=%s (HTTP 400/422); sending requests "
                                   "without it from now on", self.url, self.response_format)
                return reply
            if tries >= 1 + self.max_retries:
                raise TransportError(f"{error} (after {tries} attempts)")
            left = call.left()
            if wait_hint is None:
                delay = self._backoff(tries)
            else:
                delay = min(wait_hint, self.backoff_max_s)
                if left is not None and delay >= left:  # not slept: it would end past the deadline
                    raise TransportError(
                        f"deadline: {error}; the server asked to retry after {wait_hint:g} s (Retry-After), past "
                        f"analyzer.deadline_s={call.deadline_s:g} s ({max(0.0, left):.1f} s left)")
                self._count("retry_after_waits")
            self._count("retries")
            logger.debug("LLM analyzer: %s; retry %d/%d in %.2f s", error, tries, self.max_retries, delay)
            if self._stop.wait(delay if left is None else max(0.0, min(delay, left))):
                raise TransportError("analyzer closed")

    def _request(self, prompt: str, call: Call, response_format: Optional[str], max_tokens: int) -> "Reply":
        """One streamed chat completion. Raises Stop (deadline / closed), Stalled (no progress), EmptyReply, or
        whatever the transport raised; a request given up after it was sent is aborted on the server."""
        rid = f"opid-analyzer-{uuid.uuid4().hex}" if self.sglang else None
        kwargs: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                                  self.max_tokens_field: max_tokens, "stream": True}
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if response_format is not None:
            kwargs["response_format"] = _RESPONSE_FORMAT_BODY[response_format]
        if rid:
            kwargs["extra_body"] = {"rid": rid}
        if self._gate.enter(self.max_in_flight, self._stop, call):  # a slot of analyzer.max_in_flight
            self._count("in_flight_waits")
        try:
            return self._send(kwargs, rid, call)
        finally:
            self._gate.leave()

    def _send(self, kwargs: dict, rid: Optional[str], call: Call) -> "Reply":
        """The request of _request, sent and read (its slot of the endpoint held)."""
        t0 = time.monotonic()
        read_s = self.stall_timeout_s if self.timeout_s is None else min(self.stall_timeout_s, self.timeout_s)
        left = call.left()
        if left is not None:
            read_s = max(0.01, min(read_s, left))
        timeout = httpx.Timeout(read_s, connect=min(self.connect_timeout_s, read_s))
        reply = Reply()
        completed = False
        self._track(rid, call)
        try:
            with self._client.chat.completions.with_streaming_response.create(**kwargs, timeout=timeout) as resp:
                if "text/event-stream" not in resp.headers.get("content-type", ""):
                    reply.take_message(resp.json(), time.monotonic() - t0)  # a server that ignored stream=true
                else:
                    last = t0
                    for chunk in resp.parse():
                        now = time.monotonic()
                        if reply.take_chunk(chunk, now - t0):
                            last = now
                        why = self._give_up(call, t0, last, now)
                        if why:
                            self._stopped(why, call)
            if reply.finish_reason == "abort":
                raise RuntimeError("the server aborted the request")
            completed = True
        except (httpx.TimeoutException, openai.APITimeoutError):
            now = time.monotonic()
            self._stopped(self._give_up(call, t0, now, now, timed_out=True), call)
        except openai.APIStatusError:
            completed = True  # the server answered with an error: nothing of this request runs there
            raise
        finally:
            # aborted here unless the call's deadline or close() already claimed (and aborts) it
            if self._untrack(rid, call) and not completed:
                self._abort(rid)
        text = reply.text()
        if not text.strip():
            raise EmptyReply(f"empty reply (finish_reason={reply.finish_reason})")
        return reply

    def _give_up(self, call: Call, t0: float, last: float, now: float, timed_out: bool = False) -> Optional[str]:
        """Why to stop reading a reply now (None: go on). `timed_out`: a socket read timed out."""
        if self._stop.is_set():
            return "closed"
        left = call.left()
        if left is not None and left <= (0.05 if timed_out else 0.0):
            return "deadline"
        if self.timeout_s is not None and now - t0 >= self.timeout_s - (0.05 if timed_out else 0.0):
            return "timeout"
        if timed_out or now - last > self.stall_timeout_s:
            return "stall"
        return None

    def _stopped(self, why: Optional[str], call: Call):
        if why == "closed":
            raise Stop("analyzer closed")
        if why == "deadline":
            raise Stop(call.deadline_failure())
        if why == "timeout":
            raise Stalled(f"the reply was not complete after analyzer.timeout_s={self.timeout_s:g} s")
        raise Stalled(f"no token for analyzer.stall_timeout_s={self.stall_timeout_s:g} s")

    def _track(self, rid: Optional[str], call: Call) -> None:
        if rid:
            with self._lock:
                self._inflight[rid] = call

    def _untrack(self, rid: Optional[str], call: Call) -> bool:
        """Whether `rid` was still in flight (not claimed by _abort_in_flight)."""
        if not rid:
            return False
        with self._lock:
            return self._inflight.pop(rid, None) is not None

    def _abort(self, rid: str) -> None:
        """POST /abort_request {"rid": rid} (SGLang): the server stops decoding a request the client gave up on."""
        self._count("aborts")
        try:
            self._http.post(self.server_root + "/abort_request", json={"rid": rid}, timeout=5.0)
        except Exception as e:  # noqa: BLE001 - best effort: a dead server runs nothing anyway
            logger.debug("LLM analyzer: abort of %s failed: %s", rid, short(e))

    def _abort_in_flight(self, call: Optional[Call], then_close: bool = False) -> None:
        """Abort (in a background thread) the requests in flight of `call` (None: all of them)."""
        with self._lock:  # claimed: their workers do not abort them again
            rids = [r for r, c in self._inflight.items() if call is None or c is call]
            for r in rids:
                del self._inflight[r]

        def run():
            for rid in rids:
                self._abort(rid)
            if then_close:
                self._http.close()

        if rids:
            threading.Thread(target=run, name="llm-analyzer-abort", daemon=True).start()
        elif then_close:
            self._http.close()

    # ------------------------------------------------------------------------------------------------------------
    # Cache, stats, audit
    # ------------------------------------------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def _cache_get(self, key: str) -> Optional[Analysis]:
        if not self._cache_enabled:
            return None
        with self._lock:
            return self._cache.get(key)

    def _cache_put(self, key: str, analysis: Analysis) -> None:
        if not self._cache_enabled:
            return
        with self._lock:
            self._cache[key] = analysis
            if self._cache_file is not None:
                self._cache_file.write(json.dumps({"key": key, "model": self.model,
                                                   "analysis": analysis.to_dict()}, ensure_ascii=False) + "\n")
                self._cache_file.flush()

    def _load_disk_cache(self) -> None:
        path = self._cache_path
        if path is None or not path.exists():
            return
        from opid_mega.infra.jsonl import cut_to_last_line

        cut_to_last_line(path)  # a torn last line of a killed run: the next record must start on its own line
        # a torn UTF-8 byte costs that line only; records end with "\n" only (not U+2028 / NEL: splitlines() would)
        lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
        bad = 0
        for line in lines:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                # sanitised like a fresh reply: a cache line can never replay a crash (surrogates, huge keys, ...)
                a = analysis_from_dict(rec["analysis"])
                if a is None or not isinstance(rec["key"], str):
                    raise ValueError("no usable analysis")
                self._cache[rec["key"]] = a
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                bad += 1  # a torn line from a killed run, or a foreign line: skip it
        if bad:
            logger.warning("LLM analyzer cache %s: skipped %d unreadable line(s)", path, bad)

    def _audit(self, iteration: Optional[int], traj: TrajectoryView, rec: AnalysisRecord) -> None:
        if self.audit is None:
            return
        try:
            self.audit.log_analysis(
                iteration=iteration, traj_id=rec.traj_id, task=traj.task, won=traj.won, prompt=rec.prompt,
                raw_reply=rec.replies[-1] if rec.replies else None, analysis=rec.analysis, failure=rec.failure,
                attempts=rec.attempts, replies=rec.replies, cached=rec.cached, reasked=rec.reasked,
                elapsed_s=round(rec.elapsed_s, 4), analyzer=f"llm:{self.model}")
        except Exception:  # the audit must never cost an analysis
            logger.exception("writing the analysis audit record failed")


def _copy(a: Optional[Analysis]) -> Optional[Analysis]:
    """Each trajectory gets its own Analysis object (callers may edit theirs)."""
    return None if a is None else dataclasses.replace(a, step_skills=dict(a.step_skills))
