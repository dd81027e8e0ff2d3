"""The analyzer's HTTP side: the chat-completions URL, the Retry-After header, the requests open to one endpoint
across the process (max_in_flight), one analyze() call's deadline and the reply as it streams in. The retry policy,
prompts, parsing and cache are the analyzer's (opid_mega.skills.llm_analyzer)."""
from __future__ import annotations

import datetime
import email.utils
import math
import threading
import time
from typing import Any, Optional


class TransportError(RuntimeError):
    """The endpoint gave no usable reply after all attempts (or the call's deadline passed, or the analyzer closed)."""


class Stop(Exception):
    """Not retried: the call's deadline passed or the analyzer was closed (the message says which)."""


class EmptyReply(RuntimeError):
    """A complete reply without any text (content and reasoning both empty): a transport error, retried."""


class Stalled(RuntimeError):
    """No token for stall_timeout_s (or the whole reply past timeout_s): given up, aborted on the server, retried."""


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


def retry_after_s(headers: Any, now: Optional[float] = None) -> Optional[float]:
    """The seconds a reply asks the client to wait before retrying: `retry-after-ms` (OpenAI's), else `Retry-After`
    as delay-seconds or an HTTP date (a date in the past: 0); None when neither is there or readable."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            value = float(ms) / 1000.0
            if math.isfinite(value) and value >= 0:
                return value
        except ValueError:
            pass
    text = (headers.get("retry-after") or "").strip()
    if not text:
        return None
    try:
        value = float(text)
        return value if math.isfinite(value) and value >= 0 else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:  # an HTTP date is GMT
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class EndpointGate:
    """The HTTP requests open to one endpoint over every LLMAnalyzer of the process (max_in_flight): a counting
    semaphore whose limit each analyzer gives when it enters (0: counted, never waits)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.open = 0

    def enter(self, limit: int, stop: threading.Event, call: "Call") -> bool:
        """Take a slot (waits while `limit` requests are open); True when it had to wait. Raises Stop when the
        call's deadline passes or the analyzer closes while waiting."""
        waited = False
        with self._cond:
            while limit and self.open >= limit:
                if stop.is_set():
                    raise Stop("analyzer closed")
                left = call.left()
                if left is not None and left <= 0:
                    raise Stop(call.deadline_failure())
                waited = True
                self._cond.wait(0.1 if left is None else min(0.1, left))
            self.open += 1
        return waited

    def leave(self) -> None:
        with self._cond:
            self.open -= 1
            self._cond.notify_all()


_GATES: dict[str, EndpointGate] = {}
_GATES_LOCK = threading.Lock()


def endpoint_gate(base_url: str) -> EndpointGate:
    """The process's one gate of the endpoint `base_url` (the `.../v1` form)."""
    with _GATES_LOCK:
        return _GATES.setdefault(base_url, EndpointGate())


class Call:
    """State shared by the trajectories of one analyze() call."""

    def __init__(self, deadline_s: Optional[float] = None) -> None:
        self.deadline_s = deadline_s
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self.abandoned = threading.Event()  # the deadline passed: late results are no longer used

    def left(self) -> Optional[float]:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def deadline_failure(self) -> str:
        return f"deadline: analyzer.deadline_s={self.deadline_s:g} s passed before this analysis was done"


class Reply:
    """A streamed (or whole) completion as it arrives: content and reasoning pieces, their timing."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.finish_reason: Optional[str] = None
        self.tokens = 0  # pieces with text
        self.first_token_s: Optional[float] = None
        self.last_token_s: Optional[float] = None

    def _add(self, content: Any, reasoning: Any, at: float) -> bool:
        got = False
        if isinstance(content, str) and content:
            self.content.append(content)
            got = True
        if isinstance(reasoning, str) and reasoning:
            self.reasoning.append(reasoning)
            got = True
        if got:
            self.tokens += 1
            self.first_token_s = at if self.first_token_s is None else self.first_token_s
            self.last_token_s = at
        return got

    def take_chunk(self, chunk: Any, at: float) -> bool:
        """One SSE chunk; True when it carried text (progress)."""
        got = False
        for choice in getattr(chunk, "choices", None) or ():
            delta = getattr(choice, "delta", None)
            got |= self._add(getattr(delta, "content", None), getattr(delta, "reasoning_content", None), at)
            if getattr(choice, "finish_reason", None):
                self.finish_reason = choice.finish_reason
        return got

    def take_message(self, body: Any, at: float) -> None:
        """A whole (non-streamed) chat completion body."""
        try:
            choice = body["choices"][0]
            msg = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"no choices[0].message in {short(body)!r}") from None
        if not isinstance(msg, dict):
            raise ValueError(f"choices[0].message is {type(msg).__name__}, not an object")
        self._add(msg.get("content"), msg.get("reasoning_content"), at)
        self.finish_reason = choice.get("finish_reason") if isinstance(choice, dict) else None

    def text(self) -> str:
        """The text parsed (the reference's): the reasoning content, a newline, then the content."""
        return "".join(self.reasoning) + "\n" + "".join(self.content)


def short(obj: Any, n: int = 200) -> str:
    text = " ".join(str(obj).split())
    return text if len(text) <= n else text[:n] + "..."
