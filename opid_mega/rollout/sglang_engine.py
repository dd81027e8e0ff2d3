"""Rollout engine backed by an SGLang server (native `/generate` API, token ids in, token ids + log-probs out).

    engine = SGLangEngine(model_path, server_args=["--tp", "2"])          # launches and owns a server
    engine = SGLangEngine(url="http://10.0.0.5:30000")                     # attaches to a running one
    results = engine.generate(prompt_ids, SamplingParams(...))
    engine.update_weights(model.named_parameters())                        # begin / from_tensor buckets / end
    engine.update_weights_from_disk("/ckpt/hf_iter_10")
    engine.shutdown()                                                      # kills the server's process group

Launching: `python -m sglang.launch_server --model-path M --host H --port P <server_args verbatim>`, in its own
process group, stdout+stderr to a log file (`engine.log_path`). On a machine without CUDA the CPU flags
`--device cpu --attention-backend torch_native --disable-cuda-graph --mem-fraction-static 0.2 --sleep-on-idle` are
added (each only when server_args does not set it; the last keeps an idle server from spinning on a core) and opid_mega/rollout/cpu_shims goes on the server's PYTHONPATH (see its README;
install SGLang for CPU with tools/install_sglang_cpu.sh). SGLANG_USE_CPU_ENGINE is removed from the server's env:
the official CPU engine needs a kernel package that is not on PyPI.

Requests retry with capped exponential backoff on transient errors (connection refused/reset, timeouts, HTTP
502/503/504). When the owned server process has died, the error says so at once and names its log file.

Log-probs follow SGLang's default (opid_mega.rollout.engine): log_softmax(logits / T) of the sampled token, before
top-p. Stopping: SGLang always stops at the model's EOS tokens too (generation_config / tokenizer eos); pass those
ids in stop_token_ids so that the local engine stops at the same tokens (the agent loop does).

Weight updates from tensors send torch shared-memory handles (torch.multiprocessing reductions, base64 over HTTP),
so they work when client and server share a machine (CPU tensors, or CUDA tensors via CUDA IPC). Across machines
use update_weights_from_disk with a shared filesystem.
"""
from __future__ import annotations

import atexit
import base64
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import requests
import torch

from opid_mega.rollout.engine import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, EngineError, GenerationResult,
                                      SamplingParams, check_prompts)

CPU_SHIMS_DIR = Path(__file__).resolve().parent / "cpu_shims"
CPU_DEFAULT_ARGS = (
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--disable-cuda-graph", None),
    ("--mem-fraction-static", "0.2"),
    # an idle CPU server otherwise polls its queues at ~100% of a core, stealing it from the trainer's PPO update
    ("--sleep-on-idle", None),
)
_TRANSIENT_STATUS = (502, 503, 504)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _flag_value(args: Sequence[str], flag: str) -> Optional[str]:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def build_server_command(model_path: str, host: str, port: int, server_args: Sequence[str] = (),
                         cpu: bool = False, python: str = sys.executable) -> list[str]:
    """The launch command: fixed model/host/port, the CPU defaults (when cpu and not overridden), then
    server_args verbatim."""
    for flag in ("--model-path", "--host", "--port"):
        if _has_flag(server_args, flag):
            raise ValueError(f"server_args must not set {flag}; SGLangEngine sets it (got {list(server_args)})")
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host, "--port",
           str(port)]
    if cpu:
        for flag, value in CPU_DEFAULT_ARGS:
            if not _has_flag(server_args, flag):
                cmd += [flag] if value is None else [flag, value]
    return cmd + [str(a) for a in server_args]


_SHARING_LOCK = threading.Lock()


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]], transport: str = "shm") -> str:
    """One base64 payload that SGLang's MultiprocessingSerializer/SafeUnpickler reads.

    transport "shm": a ForkingPickler dump under torch's `file_system` sharing strategy — CPU tensors travel as
    named shared-memory segments (CUDA tensors as CUDA IPC handles), so the server must run on this machine. (The
    default `file_descriptor` strategy passes fds through multiprocessing's resource sharer, whose authentication
    fails between unrelated processes such as a client and an HTTP server.)
    transport "inline": a plain pickle with the tensor bytes inline (torch.save format): works across machines,
    costs the bytes (+33 % base64) over HTTP.
    Tensors are copied first, so the caller's parameters are never moved into shared memory.
    """
    if transport == "inline":
        import pickle

        tensors = [(name, t.detach().to("cpu", copy=True)) for name, t in named_tensors]
        return base64.b64encode(pickle.dumps(tensors, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
    if transport != "shm":
        raise ValueError(f"unknown weight transport {transport!r}; expected 'shm' or 'inline'")
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp  # registers the tensor reductions with ForkingPickler

    tensors = [(name, t.detach().clone()) for name, t in named_tensors]
    buf = io.BytesIO()
    with _SHARING_LOCK:
        previous = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        try:
            ForkingPickler(buf).dump(tensors)
        finally:
            tmp.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _signal_group(proc: subprocess.Popen, sig: int, timeout_s: float) -> None:
    """Send `sig` to the server's process group and wait up to `timeout_s` for the server to exit."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass


class SGLangEngine:
    """See the module docstring."""

    def __init__(self, model_path: Optional[str] = None, *, url: Optional[str] = None,
                 server_args: Sequence[str] = (), host: str = "127.0.0.1", port: Optional[int] = None,
                 cpu: Optional[bool] = None, log_dir: Optional[str] = None, startup_timeout_s: float = 600.0,
                 request_timeout_s: float = 1800.0, max_retries: int = 5, backoff_s: float = 0.5,
                 backoff_max_s: float = 8.0, weight_bucket_bytes: int = 512 << 20,
                 weight_transport: Optional[str] = None, python: str = sys.executable):
        if (model_path is None) == (url is None):
            raise ValueError("SGLangEngine needs exactly one of model_path (launch a server) or url (attach)")
        self.request_timeout_s = float(request_timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.weight_bucket_bytes = int(weight_bucket_bytes)
        if weight_transport is None:  # shared memory when the server runs here, inline bytes otherwise
            local = url is None or any(h in url for h in ("//127.0.0.1", "//localhost", "//0.0.0.0"))
            weight_transport = "shm" if local else "inline"
        if weight_transport not in ("shm", "inline"):
            raise ValueError(f"weight_transport must be 'shm' or 'inline', got {weight_transport!r}")
        self.weight_transport = weight_transport
        self._proc: Optional[subprocess.Popen] = None
        self._log_file = None
        self.log_path: Optional[str] = None
        self.start_time_s: Optional[float] = None
        self._session = requests.Session()
        self._lock = threading.Lock()
        self._closed = False
        if url is not None:
            self.url = url.rstrip("/")
            self._wait_ready(startup_timeout_s)
        else:
            if cpu is None:
                cpu = not torch.cuda.is_available()
            port = port or free_port()
            self.url = f"http://{host}:{port}"
            self.command = build_server_command(model_path, host, port, server_args, cpu=cpu, python=python)
            t0 = time.monotonic()
            self._launch(cpu or _flag_value(self.command, "--device") == "cpu", log_dir)
            try:
                self._wait_ready(startup_timeout_s)
            except BaseException:
                self.shutdown()
                raise
            self.start_time_s = time.monotonic() - t0
        info = self._request("GET", "/server_info", retries=self.max_retries)
        self.server_info = info
        self.tp_size = int(info.get("tp_size", 1) or 1) if isinstance(info, dict) else 1

    # ---- process management -------------------------------------------------------------------------------------
    def _launch(self, cpu_serving: bool, log_dir: Optional[str]) -> None:
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="opid_sglang_"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = str(log_dir / f"sglang_server_{self.url.rsplit(':', 1)[1]}.log")
        env = dict(os.environ)
        env.pop("SGLANG_USE_CPU_ENGINE", None)
        if cpu_serving:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SHIMS_DIR), env.get("PYTHONPATH", "")) if p)
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(("$ " + " ".join(self.command) + "\n").encode())
        self._log_file.flush()
        self._proc = subprocess.Popen(self.command, stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        atexit.register(self.shutdown)

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def _log_tail(self, lines: int = 30) -> str:
        """The end of the server log, from its last traceback when there is one (exit noise such as nanobind
        leak reports is dropped)."""
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 200_000))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        kept = [ln for ln in text.splitlines() if not ln.startswith((" - leaked", "nanobind:"))]
        starts = [i for i, ln in enumerate(kept) if "Traceback (most recent call last)" in ln]
        if starts:
            kept = kept[starts[-1]:]
        return "\n".join(kept[-lines:])

    def _check_process(self) -> None:
        """Raise EngineError when the owned server process is gone."""
        if self._proc is not None and self._proc.poll() is not None:
            raise EngineError(
                f"the SGLang server (pid {self._proc.pid}, {self.url}) exited with code {self._proc.returncode}; "
                f"its log is {self.log_path}. Last lines:\n{self._log_tail()}")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            self._check_process()
            try:
                r = self._session.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except requests.RequestException as e:
                last = type(e).__name__
            time.sleep(0.5)
        where = f"; its log is {self.log_path}:\n{self._log_tail()}" if self.log_path else ""
        self.shutdown()
        raise EngineError(f"the SGLang server at {self.url} was not ready after {timeout_s:.0f} s (last: {last})"
                          f"{where}")

    # ---- HTTP ---------------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, payload: Any = None, retries: Optional[int] = None,
                 timeout: Optional[float] = None) -> Any:
        retries = self.max_retries if retries is None else retries
        delay = self.backoff_s
        for attempt in range(retries + 1):
            if self._closed:
                raise EngineError(f"SGLangEngine ({self.url}) was shut down")
            self._check_process()
            try:
                r = self._session.request(method, self.url + path, json=payload,
                                          timeout=timeout or self.request_timeout_s)
            except (requests.ConnectionError, requests.Timeout) as e:
                error = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    try:
                        return r.json()
                    except ValueError:
                        return r.text
                if r.status_code not in _TRANSIENT_STATUS:
                    raise EngineError(f"SGLang {method} {path} failed with HTTP {r.status_code}: {r.text[:2000]}")
                error = f"HTTP {r.status_code}: {r.text[:500]}"
            if attempt < retries:
                time.sleep(delay)
                delay = min(delay * 2, self.backoff_max_s)
        self._check_process()
        raise EngineError(f"SGLang {method} {path} at {self.url} failed after {retries + 1} attempts: {error}")

    # ---- protocol -----------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerationResult]:
        prompts = check_prompts(prompt_ids)
        if not prompts:
            return []
        params = []
        for i in range(len(prompts)):
            p = {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
                 "max_new_tokens": int(sampling.max_new_tokens), "skip_special_tokens": False}
            if sampling.stop_token_ids:
                p["stop_token_ids"] = list(sampling.stop_token_ids)
            if sampling.seed is not None:
                p["sampling_seed"] = int(sampling.seed) + i  # honoured with --enable-deterministic-inference
            params.append(p)
        out = self._request("POST", "/generate", {"input_ids": prompts, "sampling_params": params,
                                                  "return_logprob": True})
        if isinstance(out, dict):
            out = [out]
        if not isinstance(out, list) or len(out) != len(prompts):
            raise EngineError(f"SGLang /generate returned {type(out).__name__} for {len(prompts)} prompts")
        return [self._parse_result(o) for o in out]

    @staticmethod
    def _parse_result(o: dict) -> GenerationResult:
        meta = o.get("meta_info", {})
        ids = [int(t) for t in o.get("output_ids", [])]
        lps = [float(entry[0]) for entry in meta.get("output_token_logprobs", [])]
        if len(lps) != len(ids):
            raise EngineError(f"SGLang returned {len(ids)} output ids but {len(lps)} log-probs")
        fr = meta.get("finish_reason") or {}
        kind = fr.get("type") if isinstance(fr, dict) else str(fr)
        reason = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}.get(kind, FINISH_LENGTH)
        return GenerationResult(ids, lps, reason)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], flush_cache: bool = True) -> None:
        """Stream HF-named tensors into the server: begin_weight_update, update_weights_from_tensor per bucket of
        about `weight_bucket_bytes`, end_weight_update (all three are required by sglang 0.5.23)."""
        with self._lock:
            self._post_ok("/begin_weight_update", {})
            try:
                bucket: list[tuple[str, torch.Tensor]] = []
                size = 0
                for name, tensor in named_tensors:
                    t = tensor.detach()
                    bucket.append((str(name), t))
                    size += t.numel() * t.element_size()
                    if size >= self.weight_bucket_bytes:
                        self._send_bucket(bucket, flush_cache=False)
                        bucket, size = [], 0
                self._send_bucket(bucket, flush_cache=flush_cache)
            finally:
                self._post_ok("/end_weight_update", {})

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
        if not bucket:
            if flush_cache:
                self._request("POST", "/flush_cache", {}, retries=self.max_retries)
            return
        payload = {"serialized_named_tensors": [serialize_named_tensors(bucket, self.weight_transport)
                                                for _ in range(self.tp_size)],
                   "flush_cache": flush_cache}
        # Not retried: a shared-memory handle can be opened once, so a retry must re-serialize (done by the caller
        # calling update_weights again).
        self._post_ok("/update_weights_from_tensor", payload, retries=0)

    def update_weights_from_disk(self, model_path: str) -> None:
        """Reload all weights from an HF directory (same architecture) visible to the server."""
        with self._lock:
            self._post_ok("/update_weights_from_disk", {"model_path": str(model_path)})

    def _post_ok(self, path: str, payload: dict, retries: Optional[int] = None) -> dict:
        out = self._request("POST", path, payload, retries=retries)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(f"SGLang {path} refused: {out.get('message')}")
        return out

    def health(self) -> bool:
        if self._closed or (self._proc is not None and self._proc.poll() is not None):
            return False
        try:
            return self._session.get(self.url + "/health", timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the owned server: SIGTERM to its process group, SIGKILL after timeout_s. Attached servers are left
        running. Idempotent."""
        if self._closed:
            return
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGTERM, timeout_s)
        if proc is not None:
            # The server leaves scheduler/detokenizer children in the group: always sweep it.
            _signal_group(proc, signal.SIGKILL, timeout_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self._session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
