"""Hindsight analysis with an LLM behind any OpenAI-compatible `/v1/chat/completions` endpoint (SGLang, vLLM, ...).

    analyzer = LLMAnalyzer("http://127.0.0.1:30000", model="Qwen/Qwen2.5-7B-Instruct", cache_path=run_dir / "cache.jsonl",
                           audit=AuditLog(run_dir / "audit.jsonl"))
    job = analyzer.submit(trajs, iteration=it)       # background: score old/ref log-probs meanwhile
    ...
    analyses = job.result()                          # list[Analysis | None], one per trajectory, in order
    analyzer.stats                                   # {"requests", "retries", "reasks", "failures", "cache_hits", ...}

Per trajectory (OPID.md §3): one prompt (`build_analysis_prompt`), one HTTP call, parse; an unusable reply gets ONE
re-ask (`build_reask_prompt` with the error and the tail of the bad answer); a trajectory whose analysis finally
fails gets None (no skill signal; its outcome advantage stays) — counted in `stats["failures"]`, logged, never
raised.

Transport: connection errors, timeouts, 408/409/425/429 and 5xx are retried up to `max_retries` times with capped
exponential backoff and jitter (`Retry-After` is honoured, within the cap); other 4xx fail at once. When a server
stays unreachable (connection refused after all retries), the trajectories of that call that have not started yet
fail at once instead of each waiting out its own backoff schedule.

JSON-constrained decoding: `json_mode=True` (or "json_object") sends `response_format={"type": "json_object"}`;
`json_mode="json_schema"` sends the Analysis JSON schema (`{"type": "json_schema", ...}`, SGLang/vLLM/OpenAI).
If the server answers 400 to a request with `response_format`, the request is repeated once without it; when that
succeeds the analyzer remembers and stops sending it.

Cache: successful analyses keyed by sha256(model, prompt text) — the prompt holds the whole trajectory, K and γ —
in memory, and appended to `cache_path` (JSONL) when given, so a resumed run or an identical trajectory costs no call.
Failures are never cached. Identical prompts within one call are sent once (cache on). Every trajectory gets its
own Analysis object.

Untrusted text: `opid_mega.skills.sanitize` cleans and caps each reply as it arrives, and every analysis written to
or read back from the cache, so one poisoned reply (a lone surrogate, control characters, a 5000-digit step key)
costs at most its own analysis, never the batch or a resumed run; a failed cache write costs only that entry.

Concurrency: at most `concurrency` requests in flight per analyzer (one worker pool), whatever the number of
concurrent `analyze`/`submit` calls.

Deadline: `submit(..., deadline_s=D)` / `analyze_records(..., deadline_s=D)` (the trainer's analyzer.deadline_s)
returns D seconds after the call at the latest: every analysis not done by then is a failure ("deadline: ..."; no
skill signal, counted in `stats["failures"]` and `stats["deadline_failures"]`, audited), requests not started are
cancelled, and no request or backoff of this call runs past the deadline (a request's read timeout is cut to it).
`close()` does not wait for requests in flight.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import requests

from opid_mega.skills.audit import AuditLog
from opid_mega.skills.base import Analyzer
from opid_mega.skills.parser import parse_analysis
from opid_mega.skills.prompts import build_analysis_prompt, build_reask_prompt
from opid_mega.skills.sanitize import analysis_from_dict, clean_text, sanitize_analysis, sanitize_reply
from opid_mega.skills.types import Analysis, AnalysisParseError, TrajectoryView

logger = logging.getLogger(__name__)

_RETRY_STATUS = {408, 409, 425, 429}

# The reply shape (OPID.md §3) for servers that take a JSON schema (SGLang/xgrammar, vLLM, OpenAI).
ANALYSIS_JSON_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "episode_summary": {"type": "string"},
        "episode_skill": {"type": "string"},
        "step_skills": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "required": ["episode_summary", "episode_skill", "step_skills"],
}


class TransportError(RuntimeError):
    """The endpoint gave no usable reply after all retries (or a non-retryable HTTP error)."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


@dataclass
class AnalysisRecord:
    """What happened for one trajectory: for the audit log and for debugging."""

    traj_id: str
    prompt: str
    analysis: Optional[Analysis] = None
    failure: Optional[str] = None  # why `analysis` is None
    replies: list = field(default_factory=list)  # model answers: the first, and the re-asked one if any
    attempts: int = 0  # HTTP requests sent for this trajectory (retries included)
    cached: bool = False
    reasked: bool = False
    elapsed_s: float = 0.0


class AnalysisJob(Future):
    """A `concurrent.futures.Future` of `list[Analysis | None]`; `.records` (one AnalysisRecord per trajectory) is
    filled once the job is done."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[AnalysisRecord] = []


def chat_completions_url(base_url: str) -> str:
    """`http://h:p` / `http://h:p/v1` / a full `.../chat/completions` URL -> the chat completions URL."""
    url = base_url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"LLMAnalyzer: base_url {base_url!r} must start with http:// or https://")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


class _Call:
    """State shared by the trajectories of one analyze() call."""

    def __init__(self, deadline_s: Optional[float] = None) -> None:
        self.unreachable = threading.Event()
        self.reason = ""
        self.deadline_s = deadline_s
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self.abandoned = threading.Event()  # the deadline passed: late results are no longer used

    def left(self) -> Optional[float]:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def deadline_failure(self) -> str:
        return f"deadline: analyzer.deadline_s={self.deadline_s:g} s passed before this analysis was done"


class LLMAnalyzer(Analyzer):
    def __init__(self, base_url: str, model: str, api_key: str = "EMPTY", concurrency: int = 16,
                 timeout_s: float = 120.0, max_retries: int = 5, backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                 temperature: float = 0.0, max_tokens: int = 4096, json_mode: bool | str = True,
                 max_step_skills: int = 5, gamma: float = 0.95, cache: bool = True,
                 cache_path: Optional[str | Path] = None, audit: Optional[AuditLog] = None,
                 connect_timeout_s: float = 10.0, seed: Optional[int] = None):
        if not model:
            raise ValueError("LLMAnalyzer: model is empty (the served model name, e.g. the HF path given to SGLang)")
        if concurrency < 1:
            raise ValueError(f"LLMAnalyzer: concurrency={concurrency} must be >= 1")
        if max_retries < 0:
            raise ValueError(f"LLMAnalyzer: max_retries={max_retries} must be >= 0")
        if timeout_s <= 0 or backoff_s < 0 or backoff_max_s < 0:
            raise ValueError("LLMAnalyzer: timeout_s must be > 0, backoff_s and backoff_max_s >= 0")
        if max_step_skills < 0:
            raise ValueError(f"LLMAnalyzer: max_step_skills={max_step_skills} must be >= 0")
        if json_mode not in (True, False, "json_object", "json_schema"):
            raise ValueError(f"LLMAnalyzer: json_mode={json_mode!r}, allowed: true, false, 'json_object', "
                             "'json_schema'")
        self.url = chat_completions_url(base_url)
        self.model = model
        self.api_key = api_key
        self.concurrency = concurrency
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = min(float(connect_timeout_s), self.timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.json_mode: Optional[str] = ("json_object" if json_mode is True else json_mode) or None
        self.max_step_skills = max_step_skills
        self.gamma = gamma
        self.audit = audit
        self._json_rejected = False  # the server answered 400 to response_format and 200 without it
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stats = {"requests": 0, "retries": 0, "reasks": 0, "failures": 0, "cache_hits": 0, "analyzed": 0,
                       "json_mode_fallbacks": 0, "deadline_failures": 0}
        self._stop = threading.Event()
        self._workers = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="llm-analyzer")
        self._local = threading.local()
        self._sessions: list[requests.Session] = []

        self._cache_enabled = bool(cache)
        self._cache: dict[str, Analysis] = {}
        self._cache_path = Path(cache_path) if (cache and cache_path) else None
        self._cache_file = None
        if self._cache_path is not None:
            self._load_disk_cache()
            self._cache_path.parent.mkdir(parents=True, exist_ok=True)
            self._cache_file = open(self._cache_path, "a", encoding="utf-8")

    @classmethod
    def from_config(cls, acfg: Any, base_url: Optional[str] = None, cache_path: Optional[str | Path] = None,
                    audit: Optional[AuditLog] = None) -> "LLMAnalyzer":
        """From `opid_mega.config.AnalyzerConfig`; `base_url` overrides `acfg.base_url` (e.g. a launched server)."""
        url = base_url or acfg.base_url
        if not url:
            raise ValueError("analyzer.base_url is empty: launch an OpenAI-compatible server first and pass its URL")
        from opid_mega.config import resolve_api_key  # analyzer.api_key, else $analyzer.api_key_env, else EMPTY

        return cls(url, acfg.model, api_key=resolve_api_key(acfg), concurrency=acfg.concurrency, timeout_s=acfg.timeout_s,
                   max_retries=acfg.max_retries, backoff_s=acfg.backoff_s, backoff_max_s=acfg.backoff_max_s,
                   temperature=acfg.temperature, max_tokens=acfg.max_tokens, json_mode=acfg.json_mode,
                   max_step_skills=acfg.max_step_skills, gamma=acfg.gamma, cache=True, cache_path=cache_path,
                   audit=audit)

    # ------------------------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def analyze(self, trajs: Sequence[TrajectoryView], iteration: Optional[int] = None) -> list[Optional[Analysis]]:
        return [r.analysis for r in self.analyze_records(trajs, iteration)]

    def submit(self, trajs: Sequence[TrajectoryView], iteration: Optional[int] = None,
               deadline_s: Optional[float] = None) -> AnalysisJob:
        """Start `analyze(trajs)` in the background; `.result()` gives the analyses, `.records` the details.
        `deadline_s`: see the module docstring (counted from this call)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-analyzer-job")
        job = AnalysisJob()
        trajs = list(trajs)
        call = _Call(deadline_s)  # the deadline runs from now, not from when the job thread starts

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
                        deadline_s: Optional[float] = None, call: Optional[_Call] = None) -> list[AnalysisRecord]:
        """One AnalysisRecord per trajectory, in order (the analysis is `record.analysis`). `deadline_s`: see the
        module docstring."""
        if self._stop.is_set():
            raise RuntimeError("LLMAnalyzer is closed")
        if deadline_s is not None and not 0 < deadline_s < float("inf"):
            raise ValueError(f"LLMAnalyzer: deadline_s={deadline_s!r} must be a finite number > 0 (or None)")
        call = call or _Call(deadline_s)
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
                call.abandoned.set()
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
        (a shutdown on SIGTERM must not sit out an analyzer's timeout_s)."""
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._workers.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            sessions, self._sessions = list(self._sessions), []
            cache_file, self._cache_file = self._cache_file, None
        for s in sessions:
            s.close()
        if cache_file is not None:
            cache_file.close()

    def __enter__(self) -> "LLMAnalyzer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------------------
    # One trajectory
    # ------------------------------------------------------------------------------------------------------------
    def _analyze_one(self, traj_id: str, prompt: str, n_steps: int, key: str, call: _Call) -> AnalysisRecord:
        rec = AnalysisRecord(traj_id=traj_id, prompt=prompt)
        t0 = time.perf_counter()
        try:
            rec.analysis = self._request_and_parse(prompt, n_steps, call, rec)
        except TransportError as e:
            rec.failure = f"transport: {e}"
            if e.unreachable:
                call.unreachable.set()
                call.reason = str(e)
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

    def _request_and_parse(self, prompt: str, n_steps: int, call: _Call, rec: AnalysisRecord) -> Analysis:
        candidates = range(n_steps)
        answer = sanitize_reply(self._chat(prompt, call, rec))  # untrusted text: cleaned and capped at the boundary
        rec.replies.append(answer)
        try:
            return parse_analysis(answer, candidates, self.max_step_skills)
        except AnalysisParseError as first_error:
            self._count("reasks")
            rec.reasked = True
            reask = build_reask_prompt(prompt, answer, str(first_error))
            answer2 = sanitize_reply(self._chat(reask, call, rec))
            rec.replies.append(answer2)
            try:
                return parse_analysis(answer2, candidates, self.max_step_skills)
            except AnalysisParseError as second_error:
                raise AnalysisParseError(f"after one re-ask: {second_error} (first reply: {first_error})") from None

    # ------------------------------------------------------------------------------------------------------------
    # HTTP
    # ------------------------------------------------------------------------------------------------------------
    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = requests.Session()
            adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=2, max_retries=0)
            s.mount("http://", adapter)
            s.mount("https://", adapter)
            s.headers.update({"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json"})
            self._local.session = s
            with self._lock:
                self._sessions.append(s)
        return s

    def _payload(self, prompt: str, json_mode: Optional[str]) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        if json_mode == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif json_mode == "json_schema":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "hindsight_analysis", "schema": ANALYSIS_JSON_SCHEMA}}
        return body

    def _backoff(self, retry: int, retry_after: Optional[float]) -> float:
        delay = min(self.backoff_max_s, self.backoff_s * (2.0 ** min(retry, 64)))  # no float overflow
        with self._lock:
            delay = delay / 2 + self._rng.uniform(0, delay / 2)  # "equal jitter": spread, never below half
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.backoff_max_s))
        return delay

    def _chat(self, prompt: str, call: _Call, rec: AnalysisRecord) -> str:
        """The text of one chat completion; TransportError after `max_retries` retries of transient errors."""
        json_mode = None if self._json_rejected else self.json_mode
        tried_without_json = False
        retry = 0
        while True:
            if call.unreachable.is_set():
                raise TransportError(f"server unreachable ({call.reason})", unreachable=True)
            if self._stop.is_set():
                raise TransportError("analyzer closed")
            left = call.left()
            if left is not None and left <= 0:
                raise TransportError(call.deadline_failure())
            read_s = self.timeout_s if left is None else min(self.timeout_s, left)
            self._count("requests")
            rec.attempts += 1
            retry_after = None
            unreachable = False
            try:
                resp = self._session().post(self.url, json=self._payload(prompt, json_mode),
                                            timeout=(min(self.connect_timeout_s, read_s), read_s))
            except requests.exceptions.ConnectionError as e:  # refused, reset, DNS; ConnectTimeout is one too
                unreachable = True
                error = f"{type(e).__name__} to {self.url}: {_short(e)}"
            except requests.exceptions.Timeout as e:
                if read_s < self.timeout_s:  # cut short by the deadline
                    raise TransportError(call.deadline_failure()) from None
                error = f"timeout after {self.timeout_s:g} s ({type(e).__name__})"
            except requests.exceptions.RequestException as e:
                error = f"{type(e).__name__}: {_short(e)}"
            else:
                status = resp.status_code
                if status == 200:
                    try:
                        content = _message_text(resp.json())
                    except ValueError as e:  # a broken body from a healthy-looking server: transient
                        error = f"bad response body: {e}"
                    else:
                        if tried_without_json and not self._json_rejected:
                            with self._lock:
                                self._json_rejected = True
                            logger.warning("LLM analyzer: %s rejected response_format=%s (HTTP 400); "
                                           "sending requests without it from now on", self.url, self.json_mode)
                        return content
                elif status in (400, 422) and json_mode is not None and not tried_without_json:
                    # Probably response_format is unsupported: once more without it (not a transport retry).
                    tried_without_json = True
                    json_mode = None
                    self._count("json_mode_fallbacks")
                    continue
                elif status in _RETRY_STATUS or status >= 500:
                    error = f"HTTP {status}: {_short(resp.text)}"
                    retry_after = _retry_after(resp.headers.get("Retry-After"))
                else:
                    raise TransportError(f"HTTP {status} from {self.url}: {_short(resp.text)}")
            if retry >= self.max_retries:
                raise TransportError(f"{error} (after {retry} retries)", unreachable=unreachable)
            delay = self._backoff(retry, retry_after)
            retry += 1
            self._count("retries")
            logger.debug("LLM analyzer: %s; retry %d/%d in %.2f s", error, retry, self.max_retries, delay)
            left = call.left()
            if self._stop.wait(delay if left is None else max(0.0, min(delay, left))):
                raise TransportError("analyzer closed")

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
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()  # a torn UTF-8 byte: that line only
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


def _message_text(body: Any) -> str:
    """choices[0].message.content of a chat completion (reasoning_content when content is empty)."""
    try:
        msg = body["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"no choices[0].message in {str(body)[:200]!r}") from None
    content = msg.get("content") if isinstance(msg, dict) else None
    if not content and isinstance(msg, dict):
        content = msg.get("reasoning_content")
    return content if isinstance(content, str) else ""


def _retry_after(value: Optional[str]) -> Optional[float]:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _short(obj: Any, n: int = 200) -> str:
    text = " ".join(str(obj).split())
    return text if len(text) <= n else text[:n] + "..."
