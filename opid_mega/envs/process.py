"""Run an environment in its own worker process (`make_env(name, process=True, ...)`, the default for TextWorld and
ALFWorld).

Why: (1) a hard deadline. A simulator call that hangs (jericho on some control characters never returns) cannot be
stopped inside a process — a thread cannot be killed, and a stuck TextWorld call keeps the process-wide TextWorld
lock (`_cache.TEXTWORLD_LOCK`) — but a worker process can be killed. (2) Parallelism: TextWorld/ALFWorld serialise
every call inside one process, so N ProcessEnvs stepped from N threads use N cores.

Contract: every call has a deadline. Episode calls (reset, step, step_response, build_prompt, walkthrough, property
reads, close) get `step_timeout_s` (`env.step_timeout_s` of the config; None: `timeout`); start-up and task calls
(tasks, task_pool, prepare, unprepared: they may generate games) get `timeout` (`prepare` is sent one task at a
time, so each game generation has that deadline). A call past its deadline
kills the worker process (SIGKILL to its process group: nothing is left running, the pipe cannot fall out of step)
and raises EnvTimeout; a worker that dies raises EnvError. Either way the NEXT call starts a fresh worker (the same
env options; `restarts` counts them) and runs there — the episode in progress is lost, so that call is normally a
reset. Workers otherwise live until `close()`, across episodes. Start method: "forkserver" by default (safe with
threads and torch: workers are forked from a clean server process that imported TextWorld/ALFWorld once, so a start
costs tens of ms), "spawn" where there is none (a fresh interpreter: ~0.2 s, plus ~1.5 s to import TextWorld at the
first reset). Workers get the parent's environment variables as of their start. `close()` (or garbage collection,
or the interpreter's exit: the workers are daemonic) ends the worker; a worker whose parent died (SIGKILL) exits
within ~1 s by itself.

Each call is blocking; one ProcessEnv must not be used from two threads at once (like any Env). Errors raised in the
child (EnvError, ValueError, ...) are re-raised in the parent with their type and message. Tasks, observations and
infos cross the pipe pickled (`Task` is a frozen dataclass of plain data).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from typing import Any, Optional

from opid_mega.envs import prompts
from opid_mega.envs.base import EnvError, EnvTimeout, Task, _preview

_STATIC = ("name", "family", "prompt_family", "noop_action", "unparsed_history_chars", "max_steps", "success_reward",
           "prompt_template")
_PROPERTIES = ("admissible_actions", "won", "done", "task", "task_description", "steps", "raw_obs") + _STATIC
_OPTIONAL = ("task_pool", "prepare", "unprepared")  # forwarded only when the env in the worker has them
_TASK_CALLS = frozenset(("tasks",) + _OPTIONAL)  # calls under `timeout` (they may generate games), not step_timeout_s


# The forkserver (the default start method where it exists) forks each worker from a server process that imported
# these once: a worker starts in tens of ms with TextWorld/ALFWorld already imported (~1.5 s each otherwise).
_PRELOAD = ["opid_mega.envs.process", "opid_mega.envs.textworld_env", "opid_mega.envs.alfworld_env", "textworld",
            "textworld.gym", "alfworld.agents.environment.alfred_tw_env"]  # missing ones are skipped by the server
_preload_lock = threading.Lock()
_preload_set = False


def _context(start_method: str):
    global _preload_set
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        with _preload_lock:
            if not _preload_set:  # has an effect only before this process's forkserver starts
                ctx.set_forkserver_preload(list(_PRELOAD))
                _preload_set = True
    return ctx


def _watch_parent() -> None:
    """Exit this worker when its parent is gone (killed without closing it): no orphan keeps a core spinning. Under
    the forkserver the parent is the server, which exits when the process that owns it dies. Runs in a daemon
    thread; a stuck simulator call in ctypes (jericho) releases the GIL, so this still runs."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="opid-env-parent-watch").start()


def _worker(conn, name: str, options: dict, environ: dict) -> None:
    try:
        os.setpgrp()  # its own process group: a kill takes the simulator's children (Inform7 compilers) too
    except OSError:
        pass
    _watch_parent()
    if os.environ != environ:  # the parent's environment as of now (a forkserver keeps the one it started with)
        os.environ.clear()
        os.environ.update(environ)
    from opid_mega.envs import make_env

    try:
        env = make_env(name, process=False, step_timeout_s=None, **options)  # the parent enforces the deadlines
    except Exception as exc:  # noqa: BLE001
        conn.send(("err", _pack(exc)))
        conn.close()
        return
    conn.send(("ok", {"static": {k: getattr(env, k) for k in _STATIC},
                      "methods": [m for m in _OPTIONAL if callable(getattr(env, m, None))]}))
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            break
        try:
            if method == "__getattr__":
                result = getattr(env, args[0])
            else:
                result = getattr(env, method)(*args, **kwargs)
            conn.send(("ok", result))
        except Exception as exc:  # noqa: BLE001
            conn.send(("err", _pack(exc)))
        if method == "close":
            break
    conn.close()


def _pack(exc: BaseException):
    try:
        import pickle

        pickle.dumps(exc)
        return exc, traceback.format_exc()
    except Exception:  # noqa: BLE001
        return EnvError(f"{type(exc).__name__}: {exc}"), traceback.format_exc()


class ProcessEnv:
    """The Env protocol, executed by a child process that owns the real env (module docstring: the deadlines)."""

    def __init__(self, name: str, start_method: Optional[str] = None, timeout: Optional[float] = 600.0,
                 step_timeout_s: Optional[float] = None, **options):
        for what, value in (("timeout", timeout), ("step_timeout_s", step_timeout_s)):
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"ProcessEnv: {what} must be a finite number of seconds > 0 or None, got {value!r}")
        self._name = name
        self._options = dict(options)
        if start_method is None:
            start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        self.start_method = start_method
        self._ctx = _context(start_method)
        self._timeout = timeout
        self.step_timeout_s = step_timeout_s
        self._closed = False
        self._proc = None
        self._conn = None
        self._static: dict = {}
        self._methods: tuple = ()
        self.starts = 0  # workers started (the first one included)
        self.restarts = 0  # workers started again after a kill or a death
        self.start_time_s = 0.0  # wall time of the last start, spawn to ready
        self._start()

    # ---- worker lifecycle ---------------------------------------------------------------------------------------
    def _start(self) -> None:
        t0 = time.perf_counter()
        conn, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(child, self._name, self._options, dict(os.environ)), daemon=True,
                                 name=f"opid-env-{self._name}")
        proc.start()
        child.close()
        self._proc, self._conn = proc, conn
        self.starts += 1
        try:
            ready = self._recv("start-up", self._timeout)
        except BaseException:
            self._kill()
            raise
        self._static, self._methods = ready["static"], tuple(ready["methods"])
        self.start_time_s = time.perf_counter() - t0

    def _kill(self) -> None:
        """Stop the worker now (SIGKILL to its process group: a stuck simulator may ignore anything gentler; the
        worker holds no state worth saving). The next call starts a fresh one."""
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is None:
            return
        try:
            if proc.is_alive():
                try:
                    group = os.getpgid(proc.pid)
                except OSError:
                    group = None
                if group == proc.pid:  # the worker leads its own group (it calls setpgrp first thing)
                    try:
                        os.killpg(group, signal.SIGKILL)
                    except OSError:
                        proc.kill()
                else:
                    proc.kill()
            proc.join(10)
        finally:
            try:
                conn.close()
            except OSError:
                pass

    @property
    def pid(self) -> Optional[int]:
        """The pid of the current worker process (None between a kill and the next call)."""
        return None if self._proc is None else self._proc.pid

    def _recv(self, what: str, timeout: Optional[float]):
        if timeout is not None and not self._conn.poll(timeout):
            self._kill()
            raise EnvTimeout(f"{self._name}: env worker process did not answer {what} within {timeout} s "
                             "(env.step_timeout_s for episode calls); the worker was killed, the next call starts a "
                             "fresh one")
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            code = self._proc.exitcode if self._proc is not None else None
            self._kill()
            raise EnvError(f"{self._name}: env worker process died during {what} (exit code {code}); the next call "
                           "starts a fresh one") from exc
        if status == "err":
            exc, tb = payload
            raise exc from EnvError(f"raised in the env worker process:\n{tb}")
        return payload

    def _call(self, method: str, *args, timeout: Optional[float] = None, **kwargs):
        if self._closed:
            raise EnvError(f"{self._name}: env worker process is closed ({method!r})")
        if self._proc is None:  # killed after a timeout, or dead: a fresh worker
            self.restarts += 1
            self._start()
        if timeout is None:
            timeout = self._timeout if method in _TASK_CALLS or self.step_timeout_s is None else self.step_timeout_s
        try:
            self._conn.send((method, args, kwargs))
        except (BrokenPipeError, OSError) as exc:
            code = self._proc.exitcode
            self._kill()
            raise EnvError(f"{self._name}: env worker process is gone (exit code {code}); the next call starts a "
                           "fresh one") from exc
        if method in ("step", "step_response") and args:
            what = f"{method}({_preview(args[0])})"
        elif method == "reset" and args and isinstance(args[0], Task):
            what = f"reset({args[0].id!r})"
        elif method == "__getattr__":
            what = repr(args[0])
        else:
            what = repr(method)
        return self._recv(what, timeout)

    # ---- protocol -----------------------------------------------------------------------------------------------
    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        return self._call("tasks", split, n, seed)

    def reset(self, task: Task) -> str:
        return self._call("reset", task)

    def step(self, action_text: str):
        return self._call("step", action_text)

    def step_with_timeout(self, action_text: str, timeout_s: Optional[float]):
        """`step` under a deadline of `timeout_s` s instead of step_timeout_s: past it the worker is killed and
        EnvTimeout raised."""
        return self._call("step", action_text, timeout=timeout_s)

    def walkthrough(self):
        return self._call("walkthrough")

    def parse_action(self, response_text: str):
        return prompts.parse_action(response_text, family=self.family)

    def project_action(self, response_text: str):
        return prompts.project_action(response_text, family=self.family)

    def history_action(self, response_text: str, action):
        n = self.unparsed_history_chars
        return prompts.history_action(response_text, action,
                                      prompts.UNPARSED_HISTORY_CHARS.get(self.family, 0) if n is None else n)

    def step_response(self, response_text: str):
        return self._call("step_response", response_text)

    def build_prompt(self, history, current_obs: str, history_length: int) -> str:
        return self._call("build_prompt", history, current_obs, history_length)

    def __getattr__(self, item: str) -> Any:
        if item.startswith("_"):
            raise AttributeError(item)
        if item in _PROPERTIES:
            static = self.__dict__.get("_static") or {}
            return static[item] if item in static else self._call("__getattr__", item)
        if item in _OPTIONAL and item in (self.__dict__.get("_methods") or ()):
            if item == "prepare":  # one call per task: each generation under `timeout`, however long the list
                return lambda tasks: [path for task in tasks for path in self._call("prepare", [task])]
            return lambda *args, **kwargs: self._call(item, *args, **kwargs)
        raise AttributeError(item)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        proc, conn = self._proc, self._conn
        if proc is None:
            return
        try:
            if proc.is_alive():
                conn.send(("close", (), {}))
                if conn.poll(min(self.step_timeout_s or 30.0, 30.0)):
                    conn.recv()
                proc.join(5)
        except (EOFError, OSError):
            pass
        finally:
            self._kill()  # whatever is left of it (a no-op after a clean exit)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
