"""Fake SGLang servers for the tests (HTTP, in a thread of the test process).

FakeSGLang: the bits of SGLang's HTTP API the engine uses; GET /server_info answers tp_size, POST /generate answers
`on_generate(request json) -> (status, body)`, other routes come from an optional `routes` object.

SGLangMemory + StrictSGLang: a strict model of SGLang 0.5.23's memory state machine, read from its source
(sglang/srt/managers/scheduler_components/weight_updater.py `SchedulerWeightUpdaterManager`, srt/constants.py,
torch_memory_saver's pause/resume), so that the colocation sequence can run against it without a GPU:

- `offload_tags` is a set. release_memory_occupation(tags): tags None or [] means GPU_MEMORY_ALL_TYPES
  (kv_cache, weights, cuda_graph); it asserts the scheduler is idle (waiting requests allowed while generation is
  paused), adds every tag to the set, then pauses the regions kv_cache, weights, cuda_graph that it names.
  resume_memory_occupation(tags): the same default, `offload_tags.remove(tag)` for each (KeyError for a tag that was
  not released), then resumes cuda_graph, weights, kv_cache. torch_memory_saver raises RuntimeError on pausing a
  paused region ("Cannot pause allocation that is already paused") and on resuming an active one.
- Any exception in the scheduler's handler kills the scheduler, which takes the whole server down: the request that
  raised gets an HTTP 500 naming the exception, and the server stops listening (connection refused afterwards).
- Decoding touches the KV cache, the weights and (with CUDA graphs) the graph memory: /generate while any of them is
  paused is an illegal memory access, which kills the server the same way. A weight update (from tensor / disk /
  distributed) writes into the weights: while `weights` is paused it kills the server too.

- Weight-update sessions (weight_updater.py begin_weight_update / end_weight_update, http_server.py): an update from
  tensor or distributed outside a begin/end session is refused (HTTP 400, success false, "<route> must run between
  begin_weight_update() and end_weight_update()") before any weight is touched; a begin while a session is open and
  an end without one are refused the same way. An update from disk needs no session.

The fake answers the rest of the weight-update protocol the engine uses (pause/continue generation, begin/end weight
update, flush cache, weight version, /model_info, /server_info) and can be backed by a real in-process engine
(opid_mega.rollout.local_engine.LocalEngine): generation then comes from that model and update_weights_from_tensor
payloads (the shared-memory handles of opid_mega.rollout.sglang_engine.serialize_named_tensors) are loaded into it.
"""
from __future__ import annotations

import base64
import json
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"  # sglang.srt.constants GPU_MEMORY_TYPE_*
ALL_TYPES = [KV_CACHE, WEIGHTS, CUDA_GRAPH]  # GPU_MEMORY_ALL_TYPES, in its order


class FakeSGLang:
    """A minimal HTTP server speaking the bits of SGLang's API the engine uses: GET /server_info answers
    {"tp_size": tp_size} (any other GET: {}), POST /generate answers `on_generate(request json) -> (status, body)`
    (a `bytes` body is sent as it is: a reply that is not JSON).
    `routes` (optional) is asked first: routes.get(path) / routes.post(path, body) -> (status, body), or None to
    fall through to the defaults above."""

    def __init__(self, on_generate=None, routes=None, tp_size: int = 1):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body):
                raw = isinstance(body, bytes)  # bytes go out as they are (a non-JSON reply)
                data = body if raw else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if raw else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                got = routes.get(self.path) if routes is not None else None
                if got is None:
                    got = 200, ({"tp_size": tp_size} if self.path == "/server_info" else {})
                self._send(*got)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
                got = routes.post(self.path, body) if routes is not None else None
                if got is None:
                    got = on_generate(body) if on_generate is not None else (404, {"error": self.path})
                self._send(*got)
                if getattr(routes, "dead", None):  # the scheduler died: the whole server goes down
                    fake._stop_listening()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self._stopped = False
        self._stop_lock = threading.Lock()

    def _stop_listening(self):
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        threading.Thread(target=self._close_now, daemon=True).start()

    def _close_now(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def close(self):
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        self._close_now()


class ServerDied(Exception):
    """The fake server's scheduler died (the message is SGLang's exception)."""


class SGLangMemory:
    """SGLang 0.5.23's memory state (see the module docstring). `memory_saver`: launched with --enable-memory-saver
    (the real torch_memory_saver adapter, which raises on double pause/resume); False: the no-op adapter (the tag set
    still raises KeyError). `cuda_graph`: decoding replays CUDA graphs (their memory must be resident)."""

    def __init__(self, memory_saver: bool = True, cuda_graph: bool = True):
        self.memory_saver = memory_saver
        self.cuda_graph = cuda_graph
        self.offload_tags: set = set()  # SchedulerWeightUpdaterManager.offload_tags
        self.paused: set = set()  # torch_memory_saver regions currently paused
        self.dead: Optional[str] = None
        self.running = 0  # requests being decoded
        self.engine_paused = False  # /pause_generation
        self.calls: list = []  # ("release"|"resume", tags as sent)

    # ---- the scheduler dies on any exception in its handlers ----------------------------------------------------
    def _die(self, exc: BaseException):
        self.dead = f"{type(exc).__name__}: {exc}"
        raise ServerDied(self.dead) from exc

    def _run(self, fn, *args):
        if self.dead:
            raise ServerDied(f"the server is down ({self.dead})")
        try:
            return fn(*args)
        except ServerDied:
            raise
        except Exception as exc:  # noqa: BLE001 - SGLang's scheduler: any exception ends the process
            self._die(exc)

    # ---- torch_memory_saver -------------------------------------------------------------------------------------
    def _pause(self, tag):
        if self.memory_saver:
            if tag in self.paused:
                raise RuntimeError(f"Cannot pause allocation that is already paused. Tag: {tag}")
            self.paused.add(tag)

    def _resume(self, tag):
        if self.memory_saver:
            if tag not in self.paused:
                raise RuntimeError(f"Cannot resume allocation that is already active. Tag: {tag}")
            self.paused.discard(tag)

    # ---- SchedulerWeightUpdaterManager.release/resume_memory_occupation -----------------------------------------
    def release(self, tags):
        self.calls.append(("release", tags))
        self._run(self._release, tags)

    def _release(self, tags):
        if self.running and not self.engine_paused:
            raise AssertionError("release_memory_occupation should be called only when server is idle.")
        if tags is None or len(tags) == 0:
            tags = ALL_TYPES
        for tag in tags:
            self.offload_tags.add(tag)
        for tag in (KV_CACHE, WEIGHTS, CUDA_GRAPH):
            if tag in tags:
                self._pause(tag)

    def resume(self, tags):
        self.calls.append(("resume", tags))
        self._run(self._resume_tags, tags)

    def _resume_tags(self, tags):
        if tags is None or len(tags) == 0:
            tags = ALL_TYPES
        for tag in tags:
            self.offload_tags.remove(tag)  # KeyError: the tag was not released
        for tag in (CUDA_GRAPH, WEIGHTS, KV_CACHE):
            if tag in tags:
                self._resume(tag)

    # ---- what touches GPU memory --------------------------------------------------------------------------------
    def _touch(self, what, regions):
        # with the no-op adapter nothing is paused for real: the memory is still there
        gone = [t for t in regions if t in self.offload_tags] if self.memory_saver else []
        if gone:
            raise RuntimeError(f"CUDA error: an illegal memory access was encountered ({what} with {gone} released)")

    def decode(self):
        self._run(self._touch, "decode", [KV_CACHE, WEIGHTS] + ([CUDA_GRAPH] if self.cuda_graph else []))

    def write_weights(self):
        self._run(self._touch, "weight update", [WEIGHTS])

    def check_alive(self):
        self._run(lambda: None)


class StrictSGLang:
    """The routes of a fake SGLang server with a strict SGLangMemory (FakeSGLang(routes=StrictSGLang(...))).

    generate(prompts, sampling_params) -> list of SGLang /generate outputs; default: an in-process `backend`
    (LocalEngine) when given, else two fixed tokens per prompt. `model_path` is what /model_info reports (the
    engine reads its safetensors manifest from there); `dtype` the --dtype /server_info lists."""

    def __init__(self, memory: Optional[SGLangMemory] = None, backend=None, model_path: Optional[str] = None,
                 tp_size: int = 1, dtype: str = "float32"):
        self.memory = memory or SGLangMemory()
        self.dtype = dtype  # the --dtype /server_info lists (SGLang's default: auto)
        self.backend = backend
        self.model_path = model_path
        self.tp_size = tp_size
        self.version = "default"
        self.in_update = False
        self.generated = 0  # /generate requests served
        self.updates = 0  # update_weights_from_tensor requests applied
        self.tensor_updates: list = []  # the body of every update_weights_from_tensor request
        self.lock = threading.Lock()

    @property
    def dead(self):
        return self.memory.dead

    def get(self, path):
        if self.memory.dead:
            return 500, {"error": f"the server is down ({self.memory.dead})"}
        if path == "/health":
            return 200, {}
        if path == "/server_info":
            return 200, {"tp_size": self.tp_size, "weight_version": "default", "dtype": self.dtype}
        if path == "/model_info":
            return 200, {"model_path": self.model_path, "weight_version": self.version}
        return None

    def post(self, path, body):
        try:
            return self._post(path, body)
        except ServerDied as exc:
            return 500, {"error": str(exc)}

    def _post(self, path, body):
        m = self.memory
        if path == "/release_memory_occupation":
            m.release(body.get("tags"))
            return 200, None
        if path == "/resume_memory_occupation":
            m.resume(body.get("tags"))
            return 200, None
        m.check_alive()
        if path == "/pause_generation":
            m.engine_paused = True
            return 200, {}
        if path == "/continue_generation":
            m.engine_paused = False
            return 200, {}
        if path == "/begin_weight_update":
            if self.in_update:
                return 400, {"success": False, "message": "a weight-update session is already open; "
                                                          "call end_weight_update() first"}
            self.in_update = True
            return 200, {"success": True, "message": "Success"}
        if path == "/end_weight_update":
            if not self.in_update:
                return 400, {"success": False, "message": "no weight-update session is open; call "
                                                          "begin_weight_update() first"}
            self.in_update = False
            return 200, {"success": True, "message": "Success"}
        if path == "/flush_cache":
            return 200, {}
        if path == "/update_weight_version":
            self.version = str(body["new_version"])
            return 200, {"success": True, "message": "Success"}
        if path in ("/update_weights_from_tensor", "/update_weights_from_distributed") and not self.in_update:
            name = path.lstrip("/")  # refused before any weight is touched
            return 400, {"success": False, "message": f"{name} must run between begin_weight_update() and "
                                                      "end_weight_update()"}
        if path in ("/update_weights_from_tensor", "/update_weights_from_disk", "/update_weights_from_distributed"):
            m.write_weights()
            if path == "/update_weights_from_tensor":
                payloads = body["serialized_named_tensors"]
                self.tensor_updates.append(body)
                if self.backend is not None:
                    named = pickle.loads(base64.b64decode(payloads[0]))
                    self.backend.update_weights(named)
                self.updates += 1
            return 200, {"success": True, "message": "Success"}
        if path == "/generate":
            with self.lock:
                m.running += 1
            try:
                m.decode()
                out = self._generate(body["input_ids"], body["sampling_params"])
            finally:
                with self.lock:
                    m.running -= 1
            self.generated += 1
            return 200, out
        return None

    def _generate(self, prompts, params):
        if self.backend is None:
            return [{"output_ids": [7, 8], "meta_info": {"finish_reason": {"type": "length"},
                                                         "output_token_logprobs": [[-0.5, 7, None], [-1.5, 8, None]]}}
                    for _ in prompts]
        from opid_mega.rollout.engine import SamplingParams

        out = []
        for ids, p in zip(prompts, params):
            sp = SamplingParams(temperature=p["temperature"], top_p=p["top_p"], max_new_tokens=p["max_new_tokens"],
                                stop_token_ids=tuple(p.get("stop_token_ids", ())), seed=p.get("sampling_seed"))
            r = self.backend.generate([ids], sp)[0]
            out.append({"output_ids": list(r.response_ids), "meta_info": {
                "finish_reason": {"type": r.finish_reason},
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(r.logprobs, r.response_ids)]}})
        return out
