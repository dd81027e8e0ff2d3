"""Run an environment in its own worker process (`make_env(name, process=True, ...)`).

TextWorld/ALFWorld serialise every call inside one process (see `_cache.TEXTWORLD_LOCK`), so threads give
concurrency but not parallelism for them. A `ProcessEnv` holds one env in a child process and forwards the Env
protocol over a pipe: N ProcessEnvs stepped from N threads use N cores. Each call is blocking; one ProcessEnv must
not be used from two threads at once (like any Env). Errors raised in the child (EnvError, ValueError, ...) are
re-raised in the parent with their type and message; a dead child raises EnvError.
A call that does not answer within its time limit (`timeout` for every call, `step_with_timeout` for one step)
kills the worker process (nothing is left running, the pipe cannot fall out of step) and raises EnvTimeout; the
ProcessEnv is closed then: build a new one.
Start-up costs a Python process (~1-3 s with the spawn start method, the default: safe with threads and torch).
"""
from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any, Optional

from opid_mega.envs import prompts
from opid_mega.envs.base import EnvError, EnvTimeout, Task, _preview

_STATIC = ("name", "family", "prompt_family", "noop_action", "max_steps", "success_reward")
_PROPERTIES = ("admissible_actions", "won", "done", "task", "task_description", "steps", "raw_obs") + _STATIC


def _worker(conn, name: str, options: dict) -> None:
    from opid_mega.envs import make_env

    try:
        env = make_env(name, **options)
    except Exception as exc:  # noqa: BLE001
        conn.send(("err", _pack(exc)))
        conn.close()
        return
    conn.send(("ok", None))
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
    """The Env protocol, executed by a child process that owns the real env."""

    def __init__(self, name: str, start_method: str = "spawn", timeout: Optional[float] = 600.0, **options):
        ctx = mp.get_context(start_method)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child, name, options), daemon=True,
                                 name=f"opid-env-{name}")
        self._proc.start()
        child.close()
        self._timeout = timeout
        self._closed = False
        self._static: dict = {}
        self._recv("'start'")
        self._static = {k: self._call("__getattr__", k) for k in _STATIC}

    def _recv(self, what: str, timeout: Optional[float] = None):
        timeout = self._timeout if timeout is None else timeout
        if timeout is not None and not self._conn.poll(timeout):
            self._kill()
            raise EnvTimeout(f"env worker process did not answer {what} within {timeout} s; the worker was "
                             "killed")
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise EnvError(f"env worker process died during {what} (exit code {self._proc.exitcode})") from exc
        if status == "err":
            exc, tb = payload
            raise exc from EnvError(f"raised in the env worker process:\n{tb}")
        return payload

    def _call(self, method: str, *args, timeout: Optional[float] = None, **kwargs):
        if self._closed:
            raise EnvError(f"env worker process is closed ({method!r})")
        try:
            self._conn.send((method, args, kwargs))
        except (BrokenPipeError, OSError) as exc:
            raise EnvError(f"env worker process is gone (exit code {self._proc.exitcode})") from exc
        what = f"{method}({_preview(args[0])})" if method in ("step", "step_response") and args else repr(method)
        return self._recv(what, timeout)

    def _kill(self) -> None:
        """Stop the worker now (SIGKILL: a stuck simulator may ignore anything gentler; the worker holds no state
        worth saving) and mark this ProcessEnv closed."""
        self._closed = True
        try:
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(10)
        finally:
            self._conn.close()

    # ---- protocol -----------------------------------------------------------------------------------------------
    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        return self._call("tasks", split, n, seed)

    def task_pool(self, split: str) -> list[Task]:
        return self._call("task_pool", split)

    def reset(self, task: Task) -> str:
        return self._call("reset", task)

    def step(self, action_text: str):
        return self._call("step", action_text)

    def step_with_timeout(self, action_text: str, timeout_s: float):
        """`step` under a time limit: past it the worker is killed and EnvTimeout raised."""
        return self._call("step", action_text, timeout=timeout_s)

    def walkthrough(self):
        return self._call("walkthrough")

    def prepare(self, tasks):
        return self._call("prepare", tasks)

    def parse_action(self, response_text: str):
        return prompts.parse_action(response_text, family=self.family)

    def project_action(self, response_text: str):
        return prompts.project_action(response_text, family=self.family)

    def step_response(self, response_text: str):
        return self._call("step_response", response_text)

    def build_prompt(self, history, current_obs: str, history_length: int) -> str:
        return self._call("build_prompt", history, current_obs, history_length)

    def __getattr__(self, item: str) -> Any:
        if item in _PROPERTIES:
            static = self.__dict__.get("_static") or {}
            return static[item] if item in static else self._call("__getattr__", item)
        raise AttributeError(item)

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._proc.is_alive():
                self._call("close", timeout=min(self._timeout or 30.0, 30.0))
        except EnvError:
            pass
        finally:
            self._closed = True
            try:
                self._conn.close()
            except OSError:
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
