"""Rollout fleet: N SGLang servers behind the one rollout-engine interface (opid_mega.rollout.engine).

    fleet = launch_fleet(model_path, n=4, server_args=["--tp", "2"], log_dir=run_dir,
                         envs=[{"CUDA_VISIBLE_DEVICES": "0,1"}, ...], balancer="client")   # or "router"
    results = fleet.generate(prompt_ids, SamplingParams(...))      # prompt order, whatever server served each
    fleet.update_weights(model.named_parameters())                  # streamed once, fanned out to every live server
    fleet.update_weights_from_disk(path); fleet.health(); fleet.stats(); fleet.shutdown()
    FleetEngine([SGLangEngine(url=u) for u in urls])                # a fleet of attached servers

Client balancing (FleetEngine, `balancer="client"`): one generate call's prompts are cut into contiguous chunks
(`chunk_prompts`, default ceil(n / (4 * live servers)), at most 64) that threads send concurrently; each chunk goes
to the live server with the least outstanding load (tokens in flight: prompt + max_new_tokens, over every generate
call of this fleet), and a server takes at most `max_inflight_prompts` prompts at once, so that the rest of a call
goes to whichever server frees up first (a slow server gets less). A chunk that fails — connection refused/reset,
timeout, HTTP 5xx after SGLangEngine's own retries, the server process gone (all surface as EngineError or a
requests error) — takes that server out of rotation for the life of the fleet and goes back to the head of the queue
for another live server; only when no server is left does generate raise EngineError naming every server and its
error. A request the server rejects (HTTP 4xx, a bad prompt) is not a server failure: it is raised at once. Nothing
is lost or duplicated: results are placed by global prompt index, and the chunk that failed is re-sent whole.
A wedged server (alive, but no reply within its engine's request timeout, rollout.request_timeout_s) and a server
whose reply is malformed (not JSON, a result of the wrong shape: SGLangEngine raises EngineError for both) are server
failures like a dead one. `generate(..., deadline=t)` (time.monotonic(): the rollout's deadline) raises
RolloutDeadline at t, abandoning the chunks in flight; that is no server failure.

Seeds: prompt i of the call gets seed `sampling.seed + i` (its index in the WHOLE call, passed per prompt to
SGLangEngine.generate(seeds=...)), so sampled results do not depend on how the call was split.

Weight updates are fanned out to every live server concurrently (the tensors are read once from the caller's
iterator and streamed to one thread per server through a small queue); a server that fails an update is taken out of
rotation (it would serve stale weights), and the update raises only when no server took it.

Router mode (RouterFleet, `balancer="router"`): `python -m sglang_router.launch_router --worker-urls ... --host H
--port P <router_args verbatim>` (sglang-router 0.3.2, a Rust HTTP router; it runs on a CPU-only machine, it does
not touch devices) in its own process group with a log file; generate chunks are sent through the router, which
picks the worker (its --policy, default cache_aware); weight updates and health probes go to each worker directly.
Who does what on a worker death (measured with 0.3.2 on CPU, tests/rollout/test_fleet.py): the router
retries a request that failed on a worker (connection refused/reset; --retry-max-retries, default 5, with backoff)
on another worker — with one of three workers SIGKILLed mid-call, 8 requests failed on it inside the router and
all were answered from the others, none lost. But the router keeps the dead worker listed as healthy until its
periodic health checks (every 60 s, 3 failures) or its circuit breaker (10 failures) catch up, so every later
request routed there pays a failed attempt and a backoff. The fleet therefore (1) before each generate call takes
workers whose process has exited out of its rotation AND out of the router (`DELETE /workers/{id}`), and (2) keeps
its own retry on top of the router's: a request the router answers with an error (its retries exhausted, or no
worker left) makes the fleet probe every worker's /health, drop the dead ones (from the router too) and re-send the
prompt (counted in rollout/retried_requests). The probes of every worker run at once, in one burst that the failures
share (a failure waits for the burst running, or reads one that started after it failed), and neither a probe nor a
call to the router runs past the rollout deadline: a probe the deadline cut short leaves its worker in rotation, and a
call with a failing worker ends within its deadline; if the router process itself has died, the fleet falls back to client
balancing over the live workers. In router mode each prompt is its own request (the router's typed /generate takes
one sampling_params object, not SGLang's per-prompt list, so per-prompt seeds need one request each), at most
`max_threads` in flight; per-server prompt counts are known only in client mode (the router does not say which
worker served a request).
"""
from __future__ import annotations

import atexit
import math
import queue
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import requests
import torch

from opid_mega.infra import shutdown as _shutdown
from opid_mega.infra.redact import redact_args
from opid_mega.rollout.engine import EngineError, GenerationResult, RolloutDeadline, SamplingParams, check_prompts
from opid_mega.rollout.sglang_engine import SGLangEngine, _has_flag, _signal_group, reserve_port, with_dtype

_REQUEST_ERROR = re.compile(r"failed with HTTP 4\d\d")  # SGLangEngine's message for a rejected (non-retried) request
_SERVER_ERRORS = (EngineError, requests.RequestException, OSError)
HEALTH_PROBE_S = 10.0  # a worker's /health answer within this (SGLang's runs a generation: >= 1 s)
ROUTER_CALL_S = 10.0  # a call to the router's own API (/workers)


def _time_left(limit: float, deadline: Optional[float]) -> float:
    """`limit` seconds, or less: what is left to `deadline` (time.monotonic()); RolloutDeadline when nothing is."""
    if deadline is None:
        return limit
    left = deadline - time.monotonic()
    if left <= 0:
        raise RolloutDeadline("the rollout deadline has passed")
    return min(limit, left)


def _at_once(calls: Sequence) -> list:
    """Each call in a thread of its own, all at once; their results in order (an exception counts as None)."""
    out: list = [None] * len(calls)

    def run(k: int) -> None:
        try:
            out[k] = calls[k]()
        except Exception:  # noqa: BLE001 - a failed probe or call is no answer
            out[k] = None

    threads = [threading.Thread(target=run, args=(k,), daemon=True, name="fleet-probe") for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _short(error: BaseException, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= limit else text[:limit] + "..."


def _is_request_error(error: BaseException) -> bool:
    """True when the request itself is bad (retrying it elsewhere would fail the same way): a ValueError/TypeError,
    an HTTP 4xx answer, or a weight update that does not fit the served model (sglang_engine.WeightMismatch)."""
    if isinstance(error, (ValueError, TypeError)) or type(error).__name__ == "WeightMismatch":
        return True
    return isinstance(error, EngineError) and bool(_REQUEST_ERROR.search(str(error)))


class _Server:
    """One worker of the fleet and its load/health bookkeeping (guarded by FleetEngine._lock)."""

    def __init__(self, index: int, engine: Any):
        self.index = index
        self.engine = engine
        self.alive = True
        self.error: Optional[str] = None
        self.inflight_prompts = 0
        self.inflight_tokens = 0
        self.prompts_served = 0
        self.chunks_served = 0

    @property
    def url(self) -> str:
        return str(getattr(self.engine, "url", f"server{self.index}"))


class _Target:
    """Where a chunk is sent: one server (client mode) or the router."""

    def __init__(self, server: Optional[_Server], send):
        self.server = server
        self.send = send


class FleetEngine:
    """See the module docstring. `engines`: SGLangEngine-like objects (generate(prompts, sampling, seeds=...),
    update_weights, update_weights_from_disk, health, shutdown, url). `owns`: shutdown() shuts them down."""

    def __init__(self, engines: Sequence[Any], *, chunk_prompts: Optional[int] = None, max_chunk_prompts: int = 64,
                 max_inflight_prompts: int = 256, max_threads: int = 64, owns: bool = True,
                 weight_queue_size: int = 8):
        if not engines:
            raise ValueError("FleetEngine needs at least one engine")
        if chunk_prompts is not None and int(chunk_prompts) < 1:
            raise ValueError(f"chunk_prompts must be >= 1, got {chunk_prompts}")
        self.servers = [_Server(i, e) for i, e in enumerate(engines)]
        self.chunk_prompts = None if chunk_prompts is None else int(chunk_prompts)
        self.max_chunk_prompts = max(1, int(max_chunk_prompts))
        self.max_inflight_prompts = max(1, int(max_inflight_prompts))
        self.max_threads = max(1, int(max_threads))
        self.owns = owns
        self.weight_queue_size = max(1, int(weight_queue_size))
        self._lock = threading.Lock()
        self._retried = 0
        self._closed = False

    # ---- introspection ------------------------------------------------------------------------------------------
    @property
    def engines(self) -> list:
        return [s.engine for s in self.servers]

    @property
    def live_engines(self) -> list:
        """The engines still in rotation (weight syncs go to these)."""
        return [s.engine for s in self._live()]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """The address a client of the whole fleet would use: the first live server (RouterFleet: the router)."""
        live = self._live()
        return (live[0] if live else self.servers[0]).url

    def _live(self) -> list[_Server]:
        with self._lock:
            return [s for s in self.servers if s.alive]

    def stats(self) -> dict:
        """Counters since the fleet started, for the trainer's iteration metrics."""
        with self._lock:
            out = {"rollout/retried_requests": self._retried,
                   "rollout/dead_servers": sum(not s.alive for s in self.servers),
                   "rollout/servers_alive": sum(s.alive for s in self.servers)}
            for s in self.servers:
                out[f"rollout/server{s.index}_prompts"] = s.prompts_served
            return out

    def mark_dead(self, engine: Any, error: str) -> None:
        """Take `engine` (one of this fleet's) out of rotation, e.g. after it failed a weight sync."""
        for s in self.servers:
            if s.engine is engine:
                self._mark_dead(s, error)
                remove = getattr(self, "_remove_from_router", None)
                if remove is not None and getattr(self, "router_alive", False):
                    remove([s])

    def dead_servers(self) -> dict[str, str]:
        """url -> the error that took it out of rotation."""
        with self._lock:
            return {s.url: s.error or "" for s in self.servers if not s.alive}

    def _mark_dead(self, server: _Server, error: str) -> None:
        with self._lock:
            if server.alive:
                server.alive = False
                server.error = error

    def _no_server_error(self, what: str) -> EngineError:
        with self._lock:
            lines = [f"  {s.url}: {s.error or 'alive'}" for s in self.servers]
        return EngineError(f"rollout fleet: no live server left to {what}; servers:\n" + "\n".join(lines))

    # ---- generate -----------------------------------------------------------------------------------------------
    def _chunk_size(self, n: int, n_live: int) -> int:
        if self.chunk_prompts is not None:
            return self.chunk_prompts
        return max(1, min(self.max_chunk_prompts, math.ceil(n / (4 * max(1, n_live)))))

    def _pick(self, cost_prompts: int, busy: dict) -> Optional[_Target]:
        """The live server with the least outstanding tokens that can take `cost_prompts` more prompts (a server
        with nothing of this call in flight can always take a chunk); None when every live server is full."""
        with self._lock:
            best = None
            for s in self.servers:
                if not s.alive:
                    continue
                if busy.get(s.index, 0) and s.inflight_prompts + cost_prompts > self.max_inflight_prompts:
                    continue
                key = (s.inflight_tokens, s.inflight_prompts, s.index)
                if best is None or key < best[0]:
                    best = (key, s)
        if best is None:
            return None
        server = best[1]
        return _Target(server, server.engine.generate)

    def _targets_exhausted(self) -> bool:
        """True when nothing is left to send to (every server dead)."""
        return not self._live()

    def _on_failure(self, target: _Target, error: BaseException, deadline: Optional[float] = None,
                    seen: Optional[float] = None) -> None:
        """A chunk failed on `target` (not a request error; seen failed at time.monotonic() `seen`): take the server
        out of rotation. Nothing here runs past `deadline`."""
        self._mark_dead(target.server, _short(error))

    def _on_success(self, target: _Target, n_prompts: int) -> None:
        if target.server is not None:
            with self._lock:
                target.server.prompts_served += n_prompts
                target.server.chunks_served += 1

    def _add_load(self, target: _Target, prompts: int, tokens: int, sign: int) -> None:
        if target.server is not None:
            with self._lock:
                target.server.inflight_prompts += sign * prompts
                target.server.inflight_tokens += sign * tokens

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                 seeds: Optional[Sequence[int]] = None, deadline: Optional[float] = None) -> list[GenerationResult]:
        if self._closed:
            raise EngineError("the rollout fleet was shut down")
        prompts = check_prompts(prompt_ids)
        n = len(prompts)
        if seeds is not None and len(seeds) != n:
            raise ValueError(f"generate: {len(seeds)} seeds for {n} prompts")
        if not n:
            return []
        if seeds is None:
            seeds = [None if sampling.seed is None else int(sampling.seed) + i for i in range(n)]
        size = self._chunk_size(n, len(self._live()))
        pending = deque(list(range(i, min(n, i + size))) for i in range(0, n, size))
        results: list[Optional[GenerationResult]] = [None] * n
        max_attempts = len(self.servers) + 3
        tries: dict[int, int] = {}
        inflight: dict[Future, tuple] = {}
        busy: dict[int, int] = {}
        pool = ThreadPoolExecutor(max_workers=max(1, min(self.max_threads, len(pending))),
                                  thread_name_prefix="fleet-generate")
        try:
            while pending or inflight:
                while pending:
                    chunk = pending[0]
                    target = self._pick(len(chunk), busy)
                    if target is None:
                        break
                    pending.popleft()
                    tokens = sum(len(prompts[i]) for i in chunk) + len(chunk) * sampling.max_new_tokens
                    self._add_load(target, len(chunk), tokens, +1)
                    key = target.server.index if target.server is not None else -1
                    busy[key] = busy.get(key, 0) + 1
                    fut = pool.submit(target.send, [prompts[i] for i in chunk], sampling, [seeds[i] for i in chunk],
                                      **({} if deadline is None else {"deadline": deadline}))
                    inflight[fut] = (target, chunk, tokens, key)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RolloutDeadline(f"rollout fleet: the rollout deadline passed with "
                                          f"{sum(r is None for r in results)} of {n} prompts unanswered")
                if not inflight:
                    if self._targets_exhausted():
                        raise self._no_server_error(f"generate {sum(len(c) for c in pending)} prompts")
                    time.sleep(0.01)  # every live server is full with other calls' work
                    continue
                done, _ = wait(list(inflight), return_when=FIRST_COMPLETED, timeout=left)
                seen = time.monotonic()
                for fut in done:
                    target, chunk, tokens, key = inflight.pop(fut)
                    self._add_load(target, len(chunk), tokens, -1)
                    busy[key] -= 1
                    error = fut.exception()
                    if error is None:
                        out = fut.result()
                        if isinstance(out, list) and len(out) == len(chunk):
                            for i, r in zip(chunk, out):
                                results[i] = r
                            self._on_success(target, len(chunk))
                            continue
                        error = EngineError(f"returned {len(out) if isinstance(out, list) else type(out).__name__}"
                                            f" results for {len(chunk)} prompts")
                    if isinstance(error, RolloutDeadline) or _is_request_error(error) or \
                            not isinstance(error, _SERVER_ERRORS):
                        raise error
                    self._on_failure(target, error, deadline, seen)
                    cid = chunk[0]
                    tries[cid] = tries.get(cid, 0) + 1
                    if tries[cid] >= max_attempts:
                        raise EngineError(f"rollout fleet: prompts {chunk[0]}..{chunk[-1]} failed {tries[cid]} times; "
                                          f"last error: {_short(error, 2000)}") from error
                    with self._lock:
                        self._retried += len(chunk)
                    pending.appendleft(chunk)
        finally:
            # On an error, chunks still in flight finish in the background (their servers' load is released when
            # they do); nothing waits for them here.
            for fut, (target, chunk, tokens, key) in list(inflight.items()):
                fut.add_done_callback(lambda _f, t=target, c=len(chunk), k=tokens: self._add_load(t, c, k, -1))
            pool.shutdown(wait=False, cancel_futures=True)
        return results  # type: ignore[return-value]

    # ---- fan-out to every live server -----------------------------------------------------------------------------
    def fan_out(self, method: str, *args, **kwargs) -> dict[str, Any]:
        """Call `method` on every live server concurrently; a server that fails is taken out of rotation. Returns
        url -> result of the servers that succeeded; raises EngineError when none did."""
        live = self._live()
        if not live:
            raise self._no_server_error(method)
        results: dict[str, Any] = {}
        with ThreadPoolExecutor(max_workers=len(live), thread_name_prefix="fleet-fanout") as pool:
            futs = {pool.submit(getattr(s.engine, method), *args, **kwargs): s for s in live}
            for fut, s in futs.items():
                error = fut.exception()
                if error is None:
                    results[s.url] = fut.result()
                else:
                    if _is_request_error(error) or not isinstance(error, _SERVER_ERRORS):
                        raise error
                    self._mark_dead(s, f"{method}: {_short(error)}")
        if not results:
            raise self._no_server_error(f"{method} (every server failed)")
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], **kwargs) -> None:
        """Stream HF-named tensors to every live server at once: the caller's iterator is read once, each item is
        handed to one thread per server (SGLangEngine.update_weights, its own buckets) through a queue of
        `weight_queue_size` items. A server that fails is taken out of rotation; raises when none succeeded."""
        live = self._live()
        if not live:
            raise self._no_server_error("update weights")
        if len(live) == 1:
            return self.fan_out("update_weights", named_tensors, **kwargs) and None
        done = object()
        queues = [queue.Queue(maxsize=self.weight_queue_size) for _ in live]
        errors: list[Optional[BaseException]] = [None] * len(live)
        finished = [threading.Event() for _ in live]

        def consume(q):
            while True:
                item = q.get()
                if item is done:
                    return
                yield item

        def worker(k):
            try:
                live[k].engine.update_weights(consume(queues[k]), **kwargs)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors[k] = e
            finally:
                finished[k].set()

        threads = [threading.Thread(target=worker, args=(k,), name=f"fleet-weights-{k}", daemon=True)
                   for k in range(len(live))]
        for t in threads:
            t.start()

        def put(k, item):
            while not finished[k].is_set():
                try:
                    queues[k].put(item, timeout=0.1)
                    return
                except queue.Full:
                    continue

        try:
            for item in named_tensors:
                for k in range(len(live)):
                    put(k, item)
        finally:
            for k in range(len(live)):
                put(k, done)
            for t in threads:
                t.join()
        ok = 0
        for k, s in enumerate(live):
            if errors[k] is None:
                ok += 1
            elif _is_request_error(errors[k]):
                raise errors[k]
            elif isinstance(errors[k], _SERVER_ERRORS):
                self._mark_dead(s, f"update_weights: {_short(errors[k])}")
            else:
                raise errors[k]
        if not ok:
            raise self._no_server_error("update weights (every server failed)")

    def update_weights_from_disk(self, model_path: str) -> None:
        self.fan_out("update_weights_from_disk", model_path)

    def health(self) -> bool:
        """True when at least one live server answers its health check."""
        return not self._closed and any(s.engine.health() for s in self._live())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.owns:
            for s in self.servers:
                try:
                    s.engine.shutdown()
                except Exception:  # noqa: BLE001 - shut the others down anyway
                    pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


class RouterFleet(FleetEngine):
    """FleetEngine whose generate requests go through SGLang's router (see the module docstring)."""

    def __init__(self, engines: Sequence[Any], *, router_args: Sequence[str] = (), host: str = "127.0.0.1",
                 port: Optional[int] = None, log_dir: Optional[str] = None, startup_timeout_s: float = 120.0,
                 request_timeout_s: float = 1800.0, python: str = sys.executable, api_key: Optional[str] = None,
                 health_interval_s: float = 30.0, **fleet_options):
        """`host`: the address the router binds and is reached at (the node's cluster address: opid_mega.infra.hosts).
        `health_interval_s`: how often, at most, generate() probes the /health of the workers this process did not
        launch (SGLang's /health runs a generation: >= 1 s each); a failed request probes them all at once.
        `api_key`: the router's `--api-key` (given through opid_mega.infra.keyed: on no command line, in no log), which it
        sends to the workers and asks of its clients; this fleet sends it with every request to the router."""
        fleet_options.setdefault("chunk_prompts", 1)  # one request per prompt: the router balances each
        super().__init__(engines, **fleet_options)
        for flag in ("--worker-urls", "--host", "--port", "--api-key"):
            if _has_flag(router_args, flag):
                raise ValueError(f"router_args must not set {flag}; RouterFleet sets it (got "
                                 f"{redact_args(router_args)})")
        from opid_mega.infra.hosts import http_url

        self._api_key = api_key or None
        self._auth = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self.host = host
        reserved = [] if port else [reserve_port(host)]  # held until the router listens on them (_wait_router)
        self.router_port = port or reserved[0].getsockname()[1]
        self.router_url = http_url(host, self.router_port)
        self.command = [python, "-m", "opid_mega.infra.keyed", "sglang_router.launch_router",
                        "--worker-urls", *self.urls, "--host", host, "--port", str(self.router_port)]
        if not _has_flag(router_args, "--worker-startup-check-interval"):
            self.command += ["--worker-startup-check-interval", "1"]  # default 30 s: the workers are up already
        # the router's Prometheus metrics (its own retries of failed worker requests) on a port of our own (the
        # default 29000 would clash between two runs on one host)
        self.metrics_port = None
        if not _has_flag(router_args, "--prometheus-port"):
            reserved.append(reserve_port(host))
            self.metrics_port = reserved[-1].getsockname()[1]
            self.command += ["--prometheus-port", str(self.metrics_port), "--prometheus-host", host]
        self.command += [str(a) for a in router_args]
        self.router_alive = True
        self.router_error: Optional[str] = None
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="opid_router_"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.router_log_path = str(log_dir / f"sglang_router_{self.router_port}.log")
        self._router_log = open(self.router_log_path, "ab")
        self._router_log.write(("$ " + " ".join(redact_args(self.command)) + "\n").encode())  # no key values
        self._router_log.flush()
        if _shutdown.stopping():
            raise EngineError("not launching the SGLang router: the trainer is shutting down")
        from opid_mega.infra import tether

        tether.sweep(log_dir)  # what a dead earlier start of this run left here: reported and stopped
        self._record_dir = log_dir
        key_env, key_fds = {}, ()
        if self._api_key:  # the key through a pipe (opid_mega.infra.keyed)
            from opid_mega.infra.keyed import key_channel

            key_env, key_fds = key_channel(self._api_key)
        try:  # through opid_mega.infra.keyed: tied to this process (it ends when this process dies), the key if any
            self._router_proc = subprocess.Popen(self.command, stdout=self._router_log, stderr=subprocess.STDOUT,
                                                 start_new_session=True,
                                                 env={**os.environ, **key_env, **tether.owner_env()},
                                                 pass_fds=key_fds)
        finally:
            for fd in key_fds:
                os.close(fd)
        _shutdown.register_group(self._router_proc.pid, f"SGLang router {self.router_url}")
        tether.record(log_dir, self._router_proc.pid, f"SGLang router {self.router_url}")
        atexit.register(self._stop_router)
        self.request_timeout_s = float(request_timeout_s)
        self.health_interval_s = float(health_interval_s)
        self._probed_at = time.monotonic()  # the workers were checked just now (they were started or attached)
        self._burst: Optional[tuple] = None  # (start time, Future) of the failures' probe burst (_on_failure)
        self._burst_lock = threading.Lock()
        self._router_session = requests.Session()
        self._router_session.headers.update(self._auth)
        try:
            self._wait_router(startup_timeout_s)
        except BaseException:
            self._stop_router()
            raise
        finally:
            for held in reserved:
                held.close()

    @property
    def url(self) -> str:
        return self.router_url if self.router_alive else super().url

    @property
    def router_pid(self) -> int:
        return self._router_proc.pid

    def _router_log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.router_log_path, "rb") as f:
                return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _wait_router(self, timeout_s: float) -> None:
        """Until the router lists every worker as healthy (it registers them in the background after it starts)."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self._router_proc.poll() is not None:
                raise EngineError(f"the SGLang router exited with code {self._router_proc.returncode}; its log is "
                                  f"{self.router_log_path}:\n{self._router_log_tail()}")
            try:
                r = requests.get(self.router_url + "/workers", timeout=5, headers=self._auth)
                if r.status_code == 200 and self._router_workers_ready(r.json()):
                    return
                last = f"HTTP {r.status_code}: {r.text[:300]}"
            except (requests.RequestException, ValueError) as e:
                last = type(e).__name__
            time.sleep(0.3)
        raise EngineError(f"the SGLang router at {self.router_url} was not ready after {timeout_s:.0f} s (last: "
                          f"{last}); its log is {self.router_log_path}:\n{self._router_log_tail()}")

    def _router_workers_ready(self, listing: Any) -> bool:
        """The router lists every worker as healthy."""
        workers = listing.get("workers", []) if isinstance(listing, dict) else []
        healthy = {str(w.get("url", "")).rstrip("/") for w in workers
                   if isinstance(w, dict) and w.get("is_healthy", True)}
        return all(u in healthy for u in (s.url for s in self._live()))

    def _remove_from_router(self, servers: Sequence[_Server], deadline: Optional[float] = None) -> None:
        """DELETE /workers/{id} of each (sglang-router 0.3.2 names workers by a UUID that /workers lists with their
        url): one listing, then the deletions at once; no call runs past `deadline`."""
        try:
            timeout = _time_left(ROUTER_CALL_S, deadline)
            listing = requests.get(self.router_url + "/workers", timeout=timeout, headers=self._auth).json()
            urls = {s.url for s in servers}
            ids = [w["id"] for w in listing.get("workers", []) if str(w.get("url", "")).rstrip("/") in urls]
            if ids:
                _at_once([lambda i=i: requests.delete(f"{self.router_url}/workers/{i}", headers=self._auth,
                                                      timeout=_time_left(ROUTER_CALL_S, deadline)) for i in ids])
        except (requests.RequestException, ValueError, KeyError, AttributeError, RolloutDeadline):
            pass

    def _probe(self, servers: Sequence[_Server], why: str, deadline: Optional[float]) -> None:
        """/health of every one of `servers` at once, each within HEALTH_PROBE_S and the time left to `deadline`; a
        worker that fails its probe leaves rotation and the router. A probe the deadline cut short proves nothing:
        that worker stays (a later failure probes it again)."""
        def probe(s: _Server):
            try:
                timeout = _time_left(HEALTH_PROBE_S, deadline)
            except RolloutDeadline:
                return None
            t0 = time.monotonic()
            ok = s.engine.health(timeout=timeout)
            cut = timeout < HEALTH_PROBE_S and time.monotonic() - t0 >= 0.9 * timeout
            return None if not ok and cut else ok

        answers = _at_once([lambda s=s: probe(s) for s in servers])
        dead = [s for s, ok in zip(servers, answers) if ok is False]
        for s in dead:
            self._mark_dead(s, why)
        if dead and self.router_alive:
            self._remove_from_router(dead, deadline)

    def _router_send(self, prompts: list, sampling: SamplingParams, seeds: list,
                     deadline: Optional[float] = None) -> list[GenerationResult]:
        """One request per prompt (the router's typed /generate takes ONE sampling_params object, not SGLang's
        per-prompt list, and per-prompt seeds need their own params); the router picks the worker of each. No reply
        within request_timeout_s, or a malformed one, is EngineError (a failure: the workers are probed)."""
        out = []
        for ids, seed in zip(prompts, seeds):
            p = {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
                 "max_new_tokens": int(sampling.max_new_tokens), "skip_special_tokens": False}
            if sampling.stop_token_ids:
                p["stop_token_ids"] = list(sampling.stop_token_ids)
            if seed is not None:
                p["sampling_seed"] = int(seed)
            read_s, cut = self.request_timeout_s, False
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RolloutDeadline(f"SGLang router {self.router_url}: the rollout deadline has passed")
                if left < read_s:
                    read_s, cut = left, True
            try:
                r = self._router_session.post(self.router_url + "/generate", timeout=(min(10.0, read_s), read_s),
                                              json={"input_ids": ids, "sampling_params": p, "return_logprob": True})
            except requests.ReadTimeout as e:
                if cut:
                    raise RolloutDeadline(f"SGLang router {self.router_url}: no reply before the rollout "
                                          "deadline") from e
                raise EngineError(f"SGLang router POST /generate at {self.router_url}: no reply within "
                                  f"{self.request_timeout_s:g} s (rollout.request_timeout_s)") from e
            if r.status_code != 200:
                raise EngineError(f"SGLang router POST /generate at {self.router_url} failed with HTTP "
                                  f"{r.status_code}: {r.text[:500]}")
            try:
                o = r.json()
            except ValueError:
                raise EngineError(f"SGLang router POST /generate at {self.router_url}: malformed reply (HTTP 200, "
                                  f"not JSON): {r.text[:300]!r}") from None
            out.append(SGLangEngine._parse_result(o[0] if isinstance(o, list) and len(o) == 1 else o,
                                                  f"SGLang router {self.router_url}"))
        return out

    # ---- generate through the router ------------------------------------------------------------------------------
    def _pick(self, cost_prompts: int, busy: dict) -> Optional[_Target]:
        if not self.router_alive:
            return super()._pick(cost_prompts, busy)
        if not self._live():
            return None
        cap = self.max_inflight_prompts * len(self._live())
        if busy.get(-1, 0) and busy.get(-1, 0) * cost_prompts >= cap:
            return None
        return _Target(None, self._router_send)

    def _on_failure(self, target: _Target, error: BaseException, deadline: Optional[float] = None,
                    seen: Optional[float] = None) -> None:
        if target.server is not None:  # client fallback after the router died
            return super()._on_failure(target, error, deadline, seen)
        if self._router_proc.poll() is not None:
            self.router_alive = False
            self.router_error = f"router exited with code {self._router_proc.returncode}"
        # Which worker failed is not known: every live worker is probed, in one burst that the failures share (one
        # running, or one that started after this failure was seen, answers for it too), and nothing waits for it
        # past the deadline.
        with self._burst_lock:
            burst = self._burst
            if burst is None or (burst[1].done() and (seen is None or burst[0] < seen)):
                why = f"failed its health check after a request through the router failed ({_short(error)})"
                pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-probe")
                burst = self._burst = (time.monotonic(), pool.submit(self._probe, self._live(), why, deadline))
                pool.shutdown(wait=False)
                self._probed_at = burst[0]
        wait([burst[1]], timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _prune(self, deadline: Optional[float] = None) -> None:
        """Take workers whose launched process has exited out of rotation and out of the router, and attached
        workers (another node's) that fail a /health probe, probed at once at most every health_interval_s (a failed
        request probes every worker: _on_failure); nothing runs past `deadline`. The router itself keeps a dead
        worker listed healthy until its health checks catch up, retrying every request that lands there on another
        worker."""
        gone = []
        for s in self._live():
            proc = getattr(s.engine, "_proc", None)
            if proc is not None and proc.poll() is not None:
                self._mark_dead(s, f"server process exited with code {proc.returncode}")
                gone.append(s)
        if gone and self.router_alive:
            self._remove_from_router(gone, deadline)
        attached = [s for s in self._live() if getattr(s.engine, "_proc", None) is None]
        if attached and time.monotonic() - self._probed_at >= self.health_interval_s:
            self._probed_at = time.monotonic()
            self._probe(attached, f"failed its health check (every {self.health_interval_s:g} s)", deadline)
        if self.router_alive and self._router_proc.poll() is not None:
            self.router_alive = False
            self.router_error = f"router exited with code {self._router_proc.returncode}"

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                 seeds: Optional[Sequence[int]] = None, deadline: Optional[float] = None) -> list[GenerationResult]:
        """As FleetEngine.generate: no request, probe or router call runs past `deadline` (RolloutDeadline), no
        request past request_timeout_s."""
        self._prune(deadline)
        return super().generate(prompt_ids, sampling, seeds, deadline=deadline)

    def health(self) -> bool:
        self._prune()
        return super().health()

    def router_workers(self) -> list[str]:
        """The worker urls the router lists now."""
        listing = requests.get(self.router_url + "/workers", timeout=10, headers=self._auth).json()
        return [str(w.get("url", "")).rstrip("/") for w in listing.get("workers", [])]

    def router_retries(self) -> Optional[int]:
        """Requests the router re-sent to another worker after a worker failed (its smg_worker_retries_total)."""
        if self.metrics_port is None or not self.router_alive:
            return None
        try:
            from opid_mega.infra.hosts import http_url

            text = requests.get(http_url(self.host, self.metrics_port) + "/metrics", timeout=5).text
        except requests.RequestException:
            return None
        # sglang-router 0.3.2 counts a retry in smg_worker_retries_total and times its backoff in the histogram
        # smg_worker_retry_backoff_seconds; the counter is sometimes not exported yet when the histogram is
        # (measured), so a retry is whichever of the two counts more
        sums = {"smg_worker_retries_total": 0.0, "smg_worker_retry_backoff_seconds_count": 0.0}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in sums:
                try:
                    sums[name] += float(line.rsplit(None, 1)[1])
                except (IndexError, ValueError):
                    pass
        return int(max(sums.values()))

    def stats(self) -> dict:
        out = super().stats()
        out["rollout/router_alive"] = int(self.router_alive)
        retries = self.router_retries()
        if retries is not None:
            out["rollout/router_retries"] = retries
        return out

    def _stop_router(self) -> None:
        proc = self._router_proc
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM, 5.0)
        _signal_group(proc, signal.SIGKILL, 5.0)
        _shutdown.unregister_group(proc.pid)
        from opid_mega.infra import tether

        tether.forget(self._record_dir, proc.pid)
        if self._router_log is not None and not self._router_log.closed:
            self._router_log.close()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._stop_router()
        self._router_session.close()
        super().shutdown()


def launch_fleet(model_path: str, n: int, server_args: Sequence[str] = (), log_dir: Optional[str] = None,
                 envs: Optional[Sequence[Optional[dict]]] = None, mem_fraction: Optional[float] = None,
                 balancer: str = "client", router_args: Sequence[str] = (), concurrent: bool = True,
                 engine_options: Optional[dict] = None, host: str = "127.0.0.1", api_key: Optional[str] = None,
                 dtype: Optional[str] = None, **fleet_options) -> FleetEngine:
    """Launch `n` SGLang servers (concurrently; server k gets `envs[k]` merged into its environment, e.g.
    {"CUDA_VISIBLE_DEVICES": "2,3"}, and `--mem-fraction-static mem_fraction` unless server_args sets it) and
    return them as a FleetEngine (balancer "client") or a RouterFleet (balancer "router"). If one server fails to
    start, the others are shut down and the first error is raised. `host`: the address the servers (and the router)
    bind and are reached at; `api_key`: their `--api-key` (SGLangEngine, RouterFleet). `dtype`: their `--dtype`
    unless server_args set it (the trainer passes model.dtype: SGLang's `auto` serves float32 as float16)."""
    if n < 1:
        raise ValueError(f"launch_fleet: n must be >= 1, got {n}")
    if balancer not in ("client", "router"):
        raise ValueError(f"launch_fleet: balancer must be 'client' or 'router', got {balancer!r}")
    if envs is not None and len(envs) != n:
        raise ValueError(f"launch_fleet: {len(envs)} envs for {n} servers")
    args = with_dtype(server_args, dtype)
    if mem_fraction is not None and not _has_flag(args, "--mem-fraction-static"):
        args += ["--mem-fraction-static", str(mem_fraction)]
    options = dict(engine_options or {})
    engines: list[Optional[SGLangEngine]] = [None] * n
    errors: list[Optional[BaseException]] = [None] * n

    def start(k: int) -> None:
        try:
            engines[k] = SGLangEngine(model_path, server_args=args, log_dir=log_dir, host=host, api_key=api_key,
                                      env=(envs[k] if envs is not None else None), **options)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[k] = e

    if concurrent:
        threads = [threading.Thread(target=start, args=(k,), name=f"fleet-launch-{k}") for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for k in range(n):
            start(k)
            if errors[k] is not None:
                break
    failed = [(k, e) for k, e in enumerate(errors) if e is not None]
    if failed:
        for e in engines:
            if e is not None:
                e.shutdown()
        k, first = failed[0]
        raise EngineError(f"launch_fleet: server {k} of {n} failed to start ({len(failed)} failed); the others "
                          f"were shut down: {first}") from first
    if balancer == "router":
        try:
            return RouterFleet(engines, router_args=router_args, log_dir=log_dir, host=host, api_key=api_key,
                               **fleet_options)
        except BaseException:
            for e in engines:
                e.shutdown()
            raise
    return FleetEngine(engines, **fleet_options)
