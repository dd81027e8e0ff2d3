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

Requests retry with capped exponential backoff on transient errors (connection refused/reset, HTTP 502/503/504).
A request that gets no reply within `request_timeout_s` (rollout.request_timeout_s) is NOT retried: the server is
wedged or overloaded, and EngineError says so at once (a fleet takes that server out of rotation and re-sends its
prompts elsewhere). A reply that is not what SGLang sends (a body that is not JSON where SGLang answers JSON, a
/generate result without output ids and matching finite log-probs, a weight update without `success: true`) is an
EngineError too, never a crash or a silent success (reply shapes checked against SGLang 0.5.23's http_server.py:
see `_post_ok`). `generate(..., deadline=t)` (a time.monotonic() instant: the rollout's deadline) cuts the request
short at t and raises RolloutDeadline, which is no server failure. When the owned server process has died, the
error says so at once and names its log file. Launched servers register their process group with
opid_mega.infra.shutdown, which stops them on SIGTERM / SIGHUP / SIGINT of the trainer.

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
import math
import os
import random
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

from opid_mega.infra import shutdown as _shutdown
from opid_mega.infra.redact import redact_args
from opid_mega.rollout.engine import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, EngineError, GenerationResult,
                                      RolloutDeadline, SamplingParams, check_prompts)

CPU_SHIMS_DIR = Path(__file__).resolve().parent / "cpu_shims"
CPU_DEFAULT_ARGS = (
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--disable-cuda-graph", None),
    ("--mem-fraction-static", "0.2"),
    # an idle CPU server otherwise polls its queues at ~100% of a core, stealing it from the trainer's PPO update
    ("--sleep-on-idle", None),
)
# SGLang treats a child's exit as a crash and, by default, first sleeps 5 s "to let GPU activity settle", then py-spy
# dumps the schedulers and triggers CUDA core dumps (waiting up to 60 s for them). Our stop (SIGTERM to the server's
# process group: `SGLangEngine.shutdown`) is no crash, and that default made every stop wait out the 5 s before its
# SIGKILL. A launched server gets these off unless this process's environment (or the launch's `env`) sets them.
CRASH_DIAGNOSTICS_ENV = ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH")
_TRANSIENT_STATUS = (502, 503, 504)
_CONNECT_TIMEOUT_S = 10.0  # a TCP connect that takes longer is retried (a frozen server still accepts connections)
_TORCH_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def _ephemeral_range() -> tuple:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A TCP port on `host` (the address the server will bind) held for a server about to start: a socket bound to it
    and never listening, its SO_REUSEADDR set only after the bind. While it is open, every other bind of the port
    fails (another start's reservation, a probe, the kernel's bind(0) and the source ports of outgoing connections),
    while the server, which binds with SO_REUSEADDR as uvicorn (SGLang) and tokio (sglang-router) do, binds and
    listens on it (Linux admits two SO_REUSEADDR sockets on one port when neither listens). Close it once the server
    listens: a port probed free and released at once could be taken by a server started beside it meanwhile. Below
    the kernel's ephemeral range when there is room (a server binds its port only after a minute of start-up)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def bind(port: int) -> Optional[socket.socket]:
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.bind((host, port))  # without SO_REUSEADDR: exclusive against every other reservation and probe
        except OSError:
            s.close()
            return None
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # now the server may bind it beside this socket
        return s

    lo, _ = _ephemeral_range()
    if lo > 11000:
        rng = random.Random()
        for _ in range(64):
            held = bind(rng.randrange(10000, lo))
            if held is not None:
                return held
    held = bind(0)
    if held is None:
        raise OSError(f"no TCP port to reserve on {host}")
    return held


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _flag_value(args: Sequence[str], flag: str) -> Optional[str]:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def with_dtype(server_args: Sequence[str], dtype: Optional[str]) -> list:
    """server_args + ["--dtype", dtype] unless they set --dtype (or dtype is None). SGLang's default `auto` serves a
    float32 checkpoint as float16 (bfloat16 for Gemma), never what the trainer computes in: every rollout server
    the trainer launches gets model.dtype."""
    args = [str(a) for a in server_args]
    return args if dtype is None or _has_flag(args, "--dtype") else args + ["--dtype", str(dtype)]


def served_dtype(dtype: Optional[str], model_dir: Optional[str] = None) -> Optional[str]:
    """The dtype an SGLang 0.5.23 server computes in for its --dtype value (model_config._get_and_verify_dtype):
    an explicit dtype as given; `auto` (or none): the checkpoint's config dtype, float32 (or none) served as
    float16 (bfloat16 for Gemma). None when `auto` cannot be resolved (no readable config.json)."""
    dtype = {"float": "float32", "half": "float16"}.get(dtype, dtype)
    if dtype not in (None, "auto"):
        return dtype
    try:
        import json

        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, TypeError, ValueError):
        return None
    text = config.get("dtype") or config.get("torch_dtype") or "float32"
    text = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16"}.get(text, text)
    if text == "float32":
        return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"
    return text


def build_server_command(model_path: str, host: str, port: int, server_args: Sequence[str] = (),
                         cpu: bool = False, python: str = sys.executable,
                         dtype: Optional[str] = None) -> list[str]:
    """The launch command: fixed model/host/port, the CPU defaults (when cpu and not overridden), then
    server_args verbatim (+ `--dtype dtype` when given and server_args do not set it: see with_dtype). It runs
    through opid_mega.infra.keyed, which ties the server to its launcher (opid_mega.infra.tether: it ends when the
    launcher dies) and adds `--api-key` from a pipe when there is a key (on no command line and in no log)."""
    server_args = with_dtype(server_args, dtype)
    for flag in ("--model-path", "--host", "--port", "--api-key"):
        if _has_flag(server_args, flag):
            raise ValueError(f"server_args must not set {flag}; SGLangEngine sets it (got {list(redact_args(server_args))})")
    cmd = [python, "-m", "opid_mega.infra.keyed", "sglang.launch_server", "--model-path",
           str(model_path), "--host", host, "--port", str(port)]
    if cpu:
        for flag, value in CPU_DEFAULT_ARGS:
            if not _has_flag(server_args, flag):
                cmd += [flag] if value is None else [flag, value]
    return cmd + [str(a) for a in server_args]


_SHARING_LOCK = threading.Lock()


def _on_cuda(bucket) -> bool:
    return any(t.is_cuda for _, t in bucket)


def cuda_ipc_payloads(bucket, tp_size: int) -> list:
    """update_weights_from_tensor payloads of CUDA tensors, built as SGLang's own callers build them (sglang
    Engine._serialize_tensors_per_rank, HttpServerEngineAdapter): first SGLang's torch reductions patch
    (monkey_patch_torch_reductions: a CUDA IPC handle then names its GPU by UUID instead of this process's device
    index, which means another GPU under the server's CUDA_VISIBLE_DEVICES), then ONE serialization PER server TP
    rank (rank r deserializes entry r only, TpModelWorker.deserialize_own_rank; each serialization holds its own
    IPC reference, so the producer-side refcounts drop cleanly). The patch is process-wide and afterwards breaks
    pickling CPU tensors with torch's reductions (IndexError): a process that sends CUDA buckets sends only those."""
    from sglang.srt.utils import patch_torch
    from sglang.srt.utils.common import MultiprocessingSerializer

    patch_torch.monkey_patch_torch_reductions()  # idempotent
    named = [(n, t.detach()) for n, t in bucket]
    return [MultiprocessingSerializer.serialize(named, output_str=True) for _ in range(max(1, int(tp_size)))]


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


def _bad(token):
    raise ValueError(f"output id {token!r} is not an integer")


class WeightMismatch(EngineError):
    """A weight bucket whose name, shape or dtype the served model does not have (nothing of it was sent)."""


def read_manifest(model_dir: str, dtype: Optional[str] = None) -> dict:
    """{name: (shape, dtype name)} from the safetensors headers of an HF directory (no tensor is read). `dtype`: the
    dtype the server runs in (its --dtype), else each tensor's dtype in the checkpoint."""
    import glob
    import json
    import struct

    names = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
             "I32": "int32", "U8": "uint8", "I8": "int8", "BOOL": "bool"}
    want = {"float": "float32", "half": "float16"}.get(dtype, dtype)
    out = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = (tuple(meta["shape"]), want or names.get(meta["dtype"], meta["dtype"]))
    return out


def check_against_manifest(manifest: Optional[dict], bucket, where: str = "") -> None:
    if manifest is None:
        return
    for name, t in bucket:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise WeightMismatch(f"weight update for {where}: expected (name, tensor) pairs, got "
                                 f"({type(name).__name__}, {type(t).__name__})")
        if name not in manifest:
            if name == "lm_head.weight" and "model.embed_tokens.weight" in manifest:
                continue  # untied export into a tied checkpoint is not produced by us, but harmless to accept
            raise WeightMismatch(f"weight update for {where}: the served model has no tensor {name!r}; nothing of "
                                 "this bucket was sent, the server keeps its weights")
        shape, dtype = manifest[name]
        if tuple(t.shape) != tuple(shape):
            raise WeightMismatch(f"weight update for {where}: {name} has shape {tuple(t.shape)}, the served model "
                                 f"{tuple(shape)}; nothing of this bucket was sent, the server keeps its weights")
        got = str(t.dtype).replace("torch.", "")
        if got != dtype:
            raise WeightMismatch(f"weight update for {where}: {name} is {got}, the served model runs {dtype}; nothing "
                                 "of this bucket was sent, the server keeps its weights")


def _buckets(items, bucket_bytes: int):
    """Lists of (name, tensor): `items` yields pairs (grouped here by size) or lists of pairs (kept as they are)."""
    from opid_mega.infra.buckets import size_buckets

    detached = ([(str(n), t.detach()) for n, t in item] if isinstance(item, list) else (str(item[0]), item[1].detach())
                for item in items)
    return size_buckets(detached, bucket_bytes)


class SGLangEngine:
    """See the module docstring."""

    def __init__(self, model_path: Optional[str] = None, *, url: Optional[str] = None,
                 server_args: Sequence[str] = (), host: str = "127.0.0.1", port: Optional[int] = None,
                 cpu: Optional[bool] = None, log_dir: Optional[str] = None, startup_timeout_s: float = 600.0,
                 request_timeout_s: float = 1800.0, max_retries: int = 5, backoff_s: float = 0.5,
                 backoff_max_s: float = 8.0, weight_bucket_bytes: int = 512 << 20,
                 weight_transport: Optional[str] = None, python: str = sys.executable,
                 env: Optional[dict] = None, cpus: Optional[Sequence[int]] = None, api_key: Optional[str] = None):
        """`host`: the address a launched server binds and is reached at (the node's cluster address in a multi-node
        run: opid_mega.infra.hosts.bind_host). `api_key`: a launched server gets it (`--api-key`, through
        opid_mega.infra.keyed: on no command line, in no log); every request carries `Authorization: Bearer <key>`."""
        if (model_path is None) == (url is None):
            raise ValueError("SGLangEngine needs exactly one of model_path (launch a server) or url (attach)")
        self.request_timeout_s = float(request_timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.weight_bucket_bytes = int(weight_bucket_bytes)
        if weight_transport is None:  # shared memory when the server runs here, inline bytes otherwise
            from opid_mega.infra.hosts import is_local_url

            weight_transport = "shm" if url is None or is_local_url(url) else "inline"
        if weight_transport not in ("shm", "inline"):
            raise ValueError(f"weight_transport must be 'shm' or 'inline', got {weight_transport!r}")
        self.weight_transport = weight_transport
        self._proc: Optional[subprocess.Popen] = None
        self._record_dir: Optional[Path] = None
        self._log_file = None
        self.log_path: Optional[str] = None
        self.start_time_s: Optional[float] = None
        self._session = requests.Session()
        self._api_key = api_key or None
        if self._api_key:
            self._session.headers["Authorization"] = f"Bearer {self._api_key}"
        self._lock = threading.Lock()
        self._closed = False
        if url is not None:
            self.url = url.rstrip("/")
            self._wait_ready(startup_timeout_s)
        else:
            if cpu is None:
                cpu = not torch.cuda.is_available()
            from opid_mega.infra.hosts import http_url

            self._reserved = reserve_port(host) if not port else None  # held until the server listens on it
            port = port or self._reserved.getsockname()[1]
            self.url = http_url(host, port)
            cpu_serving = cpu or _flag_value(server_args, "--device") == "cpu"
            if cpus and cpu_serving:  # SGLang's own CPU binding: its OpenMP threads on exactly these cores
                env = {**(env or {}), "SGLANG_CPU_OMP_THREADS_BIND": ",".join(str(int(c)) for c in cpus),
                       "OMP_NUM_THREADS": str(len(cpus))}
                if not _has_flag(server_args, "--max-total-tokens"):  # SGLang cannot size its pool once bound
                    server_args = list(server_args) + ["--max-total-tokens", "16384"]
            self.command = build_server_command(model_path, host, port, server_args, cpu=cpu, python=python)
            t0 = time.monotonic()
            try:
                self._launch(cpu_serving, log_dir, env)
                self._wait_ready(startup_timeout_s)
            except BaseException:
                self.shutdown()
                raise
            finally:
                if self._reserved is not None:
                    self._reserved.close()
            self.start_time_s = time.monotonic() - t0
        info = self._request("GET", "/server_info", retries=self.max_retries)
        from opid_mega.infra.redact import redact_tree

        # it lists the server's arguments (a launch command among them): never keep a key in what may be dumped
        self.server_info = info = redact_tree(info, [self._api_key] if self._api_key else [])
        self.tp_size = int(info.get("tp_size", 1) or 1) if isinstance(info, dict) else 1

    @property
    def api_key(self) -> Optional[str]:
        """The key this engine sends (and a launched server was given); None without one."""
        return self._api_key

    # ---- process management -------------------------------------------------------------------------------------
    def _launch(self, cpu_serving: bool, log_dir: Optional[str], extra_env: Optional[dict] = None) -> None:
        """Start the server. `extra_env` (e.g. {"CUDA_VISIBLE_DEVICES": "2,3"}) is merged over this process's
        environment; a value of None removes that variable."""
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="opid_sglang_"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = str(log_dir / f"sglang_server_{self.url.rsplit(':', 1)[1]}.log")
        env = dict(os.environ)
        env.pop("SGLANG_USE_CPU_ENGINE", None)
        # A server started by a torchrun rank must not inherit that rank's torch.distributed identity: with
        # TORCHELASTIC_USE_AGENT_STORE / MASTER_PORT set, its own process group joins the trainer's rendezvous store
        # and "Init parallel" hangs.
        for key in list(env):
            if key in _TORCH_DIST_ENV or key.startswith("TORCHELASTIC_"):
                del env[key]
        for key in CRASH_DIAGNOSTICS_ENV:
            env.setdefault(key, "0")
        for key, value in (extra_env or {}).items():
            if value is None:
                env.pop(str(key), None)
            else:
                env[str(key)] = str(value)
        if cpu_serving:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SHIMS_DIR), env.get("PYTHONPATH", "")) if p)
        if _shutdown.stopping():
            raise EngineError("not launching an SGLang server: the trainer is shutting down")
        from opid_mega.infra import tether

        tether.sweep(log_dir)  # what a dead earlier start of this run left in this directory: reported and stopped
        self._record_dir = log_dir
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(("$ " + " ".join(redact_args(self.command)) + "\n").encode())  # no --api-key value
        self._log_file.flush()
        key_env, key_fds = {}, ()
        if self._api_key:  # the key through a pipe (opid_mega.infra.keyed): on no command line, in no environment
            from opid_mega.infra.keyed import key_channel

            key_env, key_fds = key_channel(self._api_key)
        try:  # tied to this process: it ends when this process dies, SIGKILL included (opid_mega.infra.tether)
            self._proc = subprocess.Popen(self.command, stdout=self._log_file, stderr=subprocess.STDOUT,
                                          env={**env, **key_env, **tether.owner_env()}, start_new_session=True,
                                          pass_fds=key_fds)
        finally:
            for fd in key_fds:
                os.close(fd)
        _shutdown.register_group(self._proc.pid, f"SGLang server {self.url}")
        tether.record(log_dir, self._proc.pid, f"SGLang server {self.url}")
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
            if self._closed or _shutdown.stopping():
                raise EngineError(f"SGLangEngine ({self.url}) was shut down while waiting for the server to start")
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
                 timeout: Optional[float] = None, deadline: Optional[float] = None, reply: str = "json") -> Any:
        """One HTTP call with retries of transient errors (see the module docstring). `reply`: "json" (the body
        must be JSON; anything else is a malformed reply, EngineError) or "text" (the body as text). `deadline`
        (time.monotonic()): no attempt runs past it (RolloutDeadline)."""
        retries = self.max_retries if retries is None else retries
        delay = self.backoff_s
        budget = float(timeout or self.request_timeout_s)
        for attempt in range(retries + 1):
            if self._closed:
                raise EngineError(f"SGLangEngine ({self.url}) was shut down")
            self._check_process()
            read_s, cut = budget, False
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RolloutDeadline(f"SGLang {method} {path} at {self.url}: the rollout deadline has passed")
                if left < read_s:
                    read_s, cut = left, True
            try:
                r = self._session.request(method, self.url + path, json=payload,
                                          timeout=(min(_CONNECT_TIMEOUT_S, read_s), read_s))
            except requests.ConnectTimeout as e:  # before requests.ConnectionError (it is one): transient
                error = f"{type(e).__name__}: {e}"
            except requests.Timeout as e:  # connected, no reply in time: wedged or overloaded, never retried
                if cut:
                    raise RolloutDeadline(f"SGLang {method} {path} at {self.url}: no reply before the rollout "
                                          f"deadline") from e
                self._check_process()
                raise EngineError(f"SGLang {method} {path} at {self.url}: no reply within {budget:g} s "
                                  f"(rollout.request_timeout_s): the server is wedged or overloaded"
                                  + (f"; its log is {self.log_path}" if self.log_path else "")) from e
            except requests.ConnectionError as e:
                error = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    if reply == "text":
                        return r.text
                    try:
                        return r.json()
                    except ValueError:
                        raise EngineError(f"SGLang {method} {path} at {self.url}: malformed reply (HTTP 200, not "
                                          f"JSON): {r.text[:300]!r}") from None
                if r.status_code not in _TRANSIENT_STATUS:
                    raise EngineError(f"SGLang {method} {path} failed with HTTP {r.status_code}: {r.text[:2000]}")
                error = f"HTTP {r.status_code}: {r.text[:500]}"
            if attempt < retries:
                time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
                delay = min(delay * 2, self.backoff_max_s)
        self._check_process()
        raise EngineError(f"SGLang {method} {path} at {self.url} failed after {retries + 1} attempts: {error}")

    # ---- protocol -----------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                 seeds: Optional[Sequence[int]] = None, deadline: Optional[float] = None) -> list[GenerationResult]:
        """Generate one response per prompt, in prompt order. Prompt i is sampled with seed `seeds[i]` when given,
        else `sampling.seed + i` (no seed when sampling.seed is None): a caller that splits one batch over several
        servers (FleetEngine) passes each prompt the seed of its index in the whole batch. `deadline`
        (time.monotonic()): RolloutDeadline when no reply came before it. A reply of the wrong shape is EngineError
        (a server failure)."""
        prompts = check_prompts(prompt_ids)
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
        if not prompts:
            return []
        params = []
        for i in range(len(prompts)):
            p = {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
                 "max_new_tokens": int(sampling.max_new_tokens), "skip_special_tokens": False}
            if sampling.stop_token_ids:
                p["stop_token_ids"] = list(sampling.stop_token_ids)
            if seeds is not None and seeds[i] is not None:
                p["sampling_seed"] = int(seeds[i])
            elif sampling.seed is not None:
                p["sampling_seed"] = int(sampling.seed) + i  # honoured with --enable-deterministic-inference
            params.append(p)
        out = self._request("POST", "/generate", {"input_ids": prompts, "sampling_params": params,
                                                  "return_logprob": True}, deadline=deadline)
        if isinstance(out, dict) and len(prompts) == 1:
            out = [out]
        if not isinstance(out, list) or len(out) != len(prompts):
            got = f"{len(out)} results" if isinstance(out, list) else type(out).__name__
            raise EngineError(f"SGLang POST /generate at {self.url}: malformed reply ({got} for {len(prompts)} "
                              "prompts)")
        return [self._parse_result(o, self.url) for o in out]

    @staticmethod
    def _parse_result(o: Any, where: str = "SGLang") -> GenerationResult:
        """One /generate result: {"output_ids": [int], "meta_info": {"output_token_logprobs": [[lp, id, text]...],
        "finish_reason": {"type": ...}}}. Anything else (missing fields, ids that are not integers, log-probs that
        are not finite numbers or do not match the ids) is a malformed reply: EngineError."""
        try:
            meta = o.get("meta_info") or {}
            raw_ids, raw_lps = o["output_ids"], meta["output_token_logprobs"]
            if not isinstance(raw_ids, list) or not isinstance(raw_lps, list):
                raise TypeError("output_ids / output_token_logprobs are not lists")
            ids = [t if type(t) is int else int(t) if isinstance(t, float) and t.is_integer() else _bad(t)
                   for t in raw_ids]
            lps = [float(entry[0]) for entry in raw_lps]
            fr = meta.get("finish_reason") or {}
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise EngineError(f"{where} /generate: malformed result ({type(e).__name__}: {e}): "
                              f"{str(o)[:300]}") from None
        if len(lps) != len(ids):
            raise EngineError(f"{where} /generate: malformed result ({len(ids)} output ids but {len(lps)} "
                              "log-probs)")
        if not all(math.isfinite(x) for x in lps):
            raise EngineError(f"{where} /generate: malformed result (a log-prob that is not finite)")
        kind = fr.get("type") if isinstance(fr, dict) else str(fr)
        reason = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}.get(kind, FINISH_LENGTH)
        return GenerationResult(ids, lps, reason)

    # ---- weights ------------------------------------------------------------------------------------------------
    # Every update: pause generation, send, set the weight version, continue (a finally). Tensors are checked against
    # the served model's manifest (names, shapes, dtype) before they are sent: a bad bucket raises WeightMismatch
    # and the server keeps the weights it had.

    @property
    def manifest(self) -> Optional[dict]:
        """{HF name: (shape, dtype name)} of the served model, from the safetensors headers of its model directory
        (read once; the dtype is the one the server computes in: its --dtype (launched: our command; attached: its
        /server_info), `auto` resolved as SGLang does, see served_dtype). None when the directory is not readable
        here (a server on another host): buckets are then sent unchecked."""
        if not hasattr(self, "_manifest"):
            self._manifest = None
            info = self._request("GET", "/model_info", retries=self.max_retries)
            path = info.get("model_path") if isinstance(info, dict) else None
            if path and os.path.isdir(path):
                dtype = _flag_value(getattr(self, "command", []) or [], "--dtype")
                info = getattr(self, "server_info", None)
                if dtype is None and isinstance(info, dict) and "dtype" in info:  # SGLang lists its arguments
                    dtype = info["dtype"] or "auto"
                self._manifest = read_manifest(path, None if dtype is None else served_dtype(dtype, path))
        return self._manifest

    def check_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Raise WeightMismatch naming the first tensor whose name, shape or dtype the served model does not have."""
        check_against_manifest(self.manifest, bucket, self.url)

    def pause_generation(self) -> None:
        """Stop scheduling generation (in-flight requests are retracted and resume after continue_generation)."""
        self._post_ok("/pause_generation", {"mode": "retract"})

    def continue_generation(self) -> None:
        self._post_ok("/continue_generation", {})

    def release_memory(self, tags: Optional[list] = None) -> None:
        """Colocated GPU serving: free the server's weights and/or KV cache (tags "weights", "kv_cache"; None: both).
        Needs --enable-memory-saver."""
        self._post_ok("/release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: Optional[list] = None) -> None:
        self._post_ok("/resume_memory_occupation", {"tags": tags})

    def weight_version(self) -> Optional[str]:
        """The weight version the server answers under (/model_info; /server_info keeps the launch value)."""
        info = self._request("GET", "/model_info", retries=self.max_retries)
        return info.get("weight_version") if isinstance(info, dict) else None

    def _set_version(self, version: Optional[str]) -> None:
        if version is None:
            return
        self._post_ok("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        got = self.weight_version()
        if got != str(version):
            raise EngineError(f"SGLang {self.url}: weight version is {got!r} after setting {version!r}")

    def begin_update(self) -> None:
        """Start a weight update: generation paused, begin_weight_update. Then send_bucket per bucket, end_update."""
        self._lock.acquire()
        try:
            self.pause_generation()
            try:
                self._post_ok("/begin_weight_update", {})
            except BaseException:
                self.continue_generation()  # a refused or malformed begin must not leave generation paused
                raise
        except BaseException:
            self._lock.release()
            raise

    def send_bucket(self, bucket: list) -> int:
        """Check one bucket against the served model, then send it (update_weights_from_tensor). Returns bytes."""
        self.check_bucket(bucket)
        self._send_bucket(bucket, flush_cache=False)
        return sum(t.numel() * t.element_size() for _, t in bucket)

    def end_update(self, version: Optional[str] = None, flush_cache: bool = True) -> None:
        """end_weight_update, flush the cache, set the version, continue generation (also after a failed bucket)."""
        try:
            try:
                self._post_ok("/end_weight_update", {})
            finally:
                try:
                    if flush_cache:
                        self._request("POST", "/flush_cache", {}, retries=self.max_retries, reply="text")
                finally:
                    self.continue_generation()
            self._set_version(version)
        finally:
            self._lock.release()

    def update_weights(self, named_tensors: Iterable, flush_cache: bool = True, version: Optional[str] = None) -> int:
        """Stream HF-named tensors into the server with update_weights_from_tensor: begin_weight_update, one request
        per bucket of about `weight_bucket_bytes` (or per list, when `named_tensors` yields lists of pairs: buckets
        made by the caller), end_weight_update (sglang 0.5.23 needs all three); generation is paused meanwhile. A
        list or tuple of pairs is checked whole before anything is sent; a stream is checked bucket by bucket before
        each is sent. Returns the bytes sent."""
        items = named_tensors
        if isinstance(items, (list, tuple)):  # a whole update given at once: all or nothing
            self.check_bucket([p for x in items for p in (x if isinstance(x, list) else [x])])
        sent = 0
        self.begin_update()
        ok = False
        try:
            for bucket in _buckets(items, self.weight_bucket_bytes):
                sent += self.send_bucket(bucket)
            ok = True
        finally:
            self.end_update(version if ok else None, flush_cache=flush_cache)
        return sent

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
        if not bucket:
            return
        if _on_cuda(bucket):  # colocated GPU engine: CUDA IPC handles, one payload per server TP rank
            payloads = cuda_ipc_payloads(bucket, self.tp_size)
        else:  # CPU: the same wire format with named shared-memory segments (see serialize_named_tensors)
            payloads = [serialize_named_tensors(bucket, self.weight_transport)] * self.tp_size
        # Not retried: a shared-memory handle can be opened once, so a retry must re-serialize (done by the caller
        # calling update_weights again). The CPU payload is handles only ("shm"), so sending it tp_size times is free.
        self._post_ok("/update_weights_from_tensor", {"serialized_named_tensors": payloads,
                                                      "flush_cache": flush_cache}, retries=0)

    def update_weights_from_disk(self, model_path: str, version: Optional[str] = None) -> None:
        """Reload all weights from an HF directory (same architecture) visible to the server."""
        with self._lock:
            self.pause_generation()
            try:
                self._post_ok("/update_weights_from_disk", {"model_path": str(model_path)})
                self._set_version(version)
            finally:
                self.continue_generation()

    # update_weights_from_distributed: the trainer's rank 0 is rank 0 of a process group with the server's TP ranks
    # (NCCL on GPU; gloo works on CPU) and broadcasts each bucket; the server receives it with the names, dtypes and
    # shapes sent over HTTP first.
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "opid_weights", backend: str = "nccl") -> None:
        self._post_ok("/init_weights_update_group", {"master_address": master_address, "master_port": int(master_port),
                                                     "rank_offset": int(rank_offset), "world_size": int(world_size),
                                                     "group_name": group_name, "backend": backend}, retries=0)

    def update_weights_from_distributed(self, bucket: Sequence[tuple[str, torch.Tensor]], broadcast,
                                        group_name: str = "opid_weights") -> int:
        """Send one bucket, between begin_update() and end_update(): the HTTP request (names, dtypes, shapes) runs in
        a thread while `broadcast(tensors)` starts the asynchronous broadcasts over the update group (it returns their
        work handles). A refusal by the server raises at once instead of leaving the broadcast waiting forever (the
        update group is then mid-broadcast: the caller drops it). Returns the bytes sent."""
        self.check_bucket(bucket)
        payload = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                   "shapes": [list(t.shape) for _, t in bucket], "group_name": group_name, "flush_cache": False}
        box: dict = {}

        def call():
            try:
                box["out"] = self._post_ok("/update_weights_from_distributed", payload, retries=0)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                box["error"] = exc

        th = threading.Thread(target=call, daemon=True)
        th.start()
        works = broadcast([t for _, t in bucket]) or []
        deadline = time.monotonic() + self.request_timeout_s
        while th.is_alive() or not all(w.is_completed() for w in works):
            if "error" in box:
                break
            if time.monotonic() > deadline:
                raise EngineError(f"SGLang {self.url}: update_weights_from_distributed did not complete in "
                                  f"{self.request_timeout_s:.0f} s")
            time.sleep(0.002)
        if "error" in box:
            raise box["error"]
        for w in works:
            w.wait()
        return sum(t.numel() * t.element_size() for _, t in bucket)

    # What SGLang 0.5.23 answers (srt/entrypoints/http_server.py): {"success": bool, "message": str, ...} from
    # /update_weights_from_tensor, /update_weights_from_disk, /update_weights_from_distributed,
    # /init_weights_update_group, /begin_weight_update, /end_weight_update, /update_weight_version (HTTP 400 when
    # success is false); {"message": ..., "status": "ok"} from /pause_generation and /continue_generation; JSON null
    # from /release_memory_occupation and /resume_memory_occupation; plain text ("Cache flushed. ...") from
    # /flush_cache (HTTP 400 with the reason when it did not flush).
    _SUCCESS_REPLY = ("/update_weights_from_tensor", "/update_weights_from_disk", "/update_weights_from_distributed",
                      "/init_weights_update_group", "/begin_weight_update", "/end_weight_update",
                      "/update_weight_version")

    def _post_ok(self, path: str, payload: dict, retries: Optional[int] = None) -> Any:
        """POST and check the reply: a success only on a well-formed success reply (see above). `success: false`
        is a refusal; a reply of another shape (not JSON, no `success: true` where SGLang sends one, a status other
        than "ok") is a malformed reply. Both raise EngineError."""
        out = self._request("POST", path, payload, retries=retries)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(f"SGLang {path} refused: {out.get('message')}")
        if path in self._SUCCESS_REPLY:
            ok = isinstance(out, dict) and out.get("success") is True
        else:  # pause / continue ({"status": "ok"}), release / resume memory (null)
            ok = out is None or (isinstance(out, dict) and out.get("status", "ok") == "ok")
        if not ok:
            raise EngineError(f"SGLang POST {path} at {self.url}: malformed reply (expected "
                              f"{'a JSON object with success true' if path in self._SUCCESS_REPLY else 'status ok'}"
                              f"): {str(out)[:300]!r}")
        return out

    def health(self, timeout: float = 10.0) -> bool:
        """GET /health answered 200 within `timeout` s (SGLang's /health runs a generation: >= 1 s)."""
        if self._closed or (self._proc is not None and self._proc.poll() is not None):
            return False
        try:
            return self._session.get(self.url + "/health", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the owned server: SIGTERM to its process group, SIGKILL after timeout_s. Attached servers are left
        running. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._session.close()  # first: the server's HTTP front end waits for open keep-alive connections to close
        proc = self._proc
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGTERM, timeout_s)
        if proc is not None:
            # The server leaves scheduler/detokenizer children in the group: always sweep it.
            _signal_group(proc, signal.SIGKILL, timeout_s)
            _shutdown.unregister_group(proc.pid)
            if self._record_dir is not None:
                from opid_mega.infra import tether

                tether.forget(self._record_dir, proc.pid)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
