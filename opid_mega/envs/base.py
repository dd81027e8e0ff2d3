"""The environment protocol shared by every backend.

One `Env` instance plays one episode at a time:

    task = env.tasks("train", n=4, seed=0)[0]
    obs = env.reset(task)
    obs, reward, done, info = env.step("go east")

`info` always carries "admissible_actions" (list[str]), "won" (bool), "raw_obs" (the raw observation text for the
hindsight analyzer), "invalid" (the action was not admissible / could not be executed), "step" (steps taken so far)
and "truncated" (the episode ended because it hit `max_steps`). The step reward is the outcome reward paid on the
step that ends the episode: `success_reward` (10.0 for TextWorld/ALFWorld/WebShop, 1.0 for Search-QA) when won, else
0.0 — so the return of a trajectory is in {0, success_reward}.

Invalid actions (docs/algorithm.md "Reference rules in detail"): `project_action(response)` applies the reference's rules and
returns (action or None, valid). A response without an action (no tags) makes the agent loop step the env's
`noop_action`; a response whose action was extracted but that breaks a format rule (think tags missing, Chinese
characters, duplicate search/answer blocks) executes that action, as the reference does. Either way the trainer
penalises the step. The no-op reveals nothing new and changes no state, with what each reference env shows for an
invalid step: TextWorld/ALFWorld answer "Nothing happens." (ALFWorld's answer to the response tail the reference
sends), WebShop keeps the page, Search-QA gives Search-R1's fixed "invalid action" feedback; none calls the
simulator. The step counts toward `max_steps`.

Garbage never raises: any string is a legal argument of `step` (empty, 10 kB, control characters, any Unicode).
What reaches a simulator is sanitised by its backend (TextWorld/ALFWorld: only admissible commands reach the game,
anything else is answered "Nothing happens." without a game call; WebShop: only well-formed search/click actions
reach the server). Only a real simulator fault raises (EnvError and friends): the agent loop ends that trajectory as
an env error. `step_with_timeout(env, action, timeout_s)` puts a time limit on a step (EnvTimeout past it).

Deadlines: `make_env(..., step_timeout_s=...)` gives every call into the simulator (reset and step) a hard deadline
enforced by the env itself. TextWorld/ALFWorld run in a worker process by default (`ProcessEnv`): a call past the
deadline kills the worker and raises EnvTimeout, the next call runs in a fresh worker. An in-process env
(`Env.step_timeout_s` set) runs `_reset`/`_step` in a daemon thread and raises EnvTimeout past the deadline; Python
cannot stop that thread, so the env is then unusable (EnvError on every later call: build a new one) and a stuck
TextWorld call keeps the process-wide TextWorld lock, so later TextWorld calls in that process time out too.
"""
from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any, Optional

from opid_mega.envs import prompts


class EnvError(RuntimeError):
    """An environment could not be created, reached or played (missing data, dead server, bad task...)."""


class EnvTimeout(EnvError):
    """An env call did not return within its time limit (`step_with_timeout`)."""


@dataclasses.dataclass(frozen=True)
class Task:
    """A reproducible, picklable/JSON-able task descriptor.

    `env` is the env family name, `data` whatever the backend needs to rebuild the episode (game generation
    parameters, a game file path, a question and its answers, a WebShop session index...).
    """

    id: str
    split: str
    env: str = ""
    data: dict = dataclasses.field(default_factory=dict, hash=False, compare=True)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Task":
        return cls(**json.loads(text))


class Env:
    """Base class: the bookkeeping every backend shares (step counter, max steps, won/done, last info).

    Subclasses implement `tasks`, `_reset(task) -> (obs, raw_obs, admissible, task_description)` and
    `_step(action) -> (obs, raw_obs, admissible, won, invalid, extra_info)`; they may override `walkthrough`.
    """

    name: str = "base"
    family: str = "action"  # prompt/parse family: "action" (<action>), "search" (<search>/<answer>)
    default_max_steps: int = 30
    default_success_reward: float = 10.0
    noop_action: str = ""  # what the agent loop steps for a response without an action: see the module docstring
    # What the prompt history records for a response without an action: its last N lower-cased characters (None: the
    # family's, prompts.UNPARSED_HISTORY_CHARS: 30 for <action> envs as the reference's ALFWorld, 0 for Search)
    unparsed_history_chars: Optional[int] = None
    # Prompt template set (prompts.TEMPLATES: "reference" | "ours"; config env.template); make_env sets it
    prompt_template: str = prompts.DEFAULT_TEMPLATE
    # Deadline (seconds) of each reset/step, run in a daemon thread (None: the call runs in the caller's thread, no
    # limit). make_env sets it; see the module docstring.
    step_timeout_s: Optional[float] = None
    _stuck: str = ""  # set when a call ran past its deadline (its thread may still be running)

    def __init__(self, max_steps: Optional[int] = None, success_reward: Optional[float] = None):
        self.max_steps = int(max_steps if max_steps is not None else self.default_max_steps)
        if self.max_steps < 1:
            raise ValueError(f"{self.name}: max_steps must be >= 1, got {self.max_steps}")
        self.success_reward = float(success_reward if success_reward is not None else self.default_success_reward)
        self._task: Optional[Task] = None
        self._task_description = ""
        self._admissible: list[str] = []
        self._won = False
        self._done = True
        self._steps = 0
        self._last_obs = ""
        self._last_raw = ""

    # ---- to implement -------------------------------------------------------------------------------------------
    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        raise NotImplementedError

    def _reset(self, task: Task) -> tuple[str, str, list[str], str]:
        raise NotImplementedError

    def _step(self, action: str) -> tuple[str, str, list[str], bool, bool, dict]:
        raise NotImplementedError

    def walkthrough(self) -> Optional[list[str]]:
        """The expert/planner action sequence for the current task (None when the backend has none)."""
        return None

    def close(self) -> None:
        self._done = True

    @property
    def raw_obs(self) -> str:
        """The raw observation line of the current state (what the analyzer sees for the next step)."""
        return self._last_raw or ""

    # ---- protocol -----------------------------------------------------------------------------------------------
    def _deadline(self, what: str, timeout_s: Optional[float], fn, *args):
        """`fn(*args)` under a deadline of `timeout_s` seconds (None: in this thread, no limit)."""
        if self._stuck:
            raise EnvError(f"{self.name}: unusable: {self._stuck} ran past its deadline and may still be running "
                           "(an in-process env cannot be stopped); build a new env, or run it in a worker process "
                           "(make_env(..., process=True))")
        if timeout_s is None:
            return fn(*args)
        try:
            return run_with_deadline(fn, args, timeout_s, f"{self.name}-{what.split('(')[0]}")
        except EnvTimeout:
            self._stuck = what
            raise EnvTimeout(f"{self.name}: {what} did not return within {timeout_s} s (env.step_timeout_s); the "
                             "call is left running in a daemon thread and this env is unusable") from None

    def reset(self, task: Task) -> str:
        if not isinstance(task, Task):
            raise TypeError(f"{self.name}.reset expects a Task, got {type(task).__name__}")
        obs, raw, admissible, description = self._deadline(f"reset({task.id!r})", self.step_timeout_s, self._reset,
                                                           task)
        self._task = task
        self._task_description = description
        self._admissible = list(admissible)
        self._won = False
        self._done = False
        self._steps = 0
        self._last_obs = obs
        self._last_raw = raw
        return obs

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        return self.step_with_timeout(action_text, self.step_timeout_s)

    def step_with_timeout(self, action_text: str, timeout_s: Optional[float]) -> tuple[str, float, bool, dict]:
        """`step` under a deadline of `timeout_s` seconds instead of `step_timeout_s` (None: no limit)."""
        if self._task is None:
            raise EnvError(f"{self.name}: step() called before reset(task)")
        if self._done:
            raise EnvError(f"{self.name}: step() called after the episode ended; call reset(task) first")
        if not isinstance(action_text, str):
            raise TypeError(f"{self.name}.step expects a str action, got {type(action_text).__name__}")
        obs, raw, admissible, won, invalid, extra = self._deadline(f"step({_preview(action_text)})", timeout_s,
                                                                   self._step, action_text)
        self._steps += 1
        self._admissible = list(admissible)
        self._last_obs = obs
        self._last_raw = raw
        reward = 0.0
        if won and not self._won:
            reward = self.success_reward
        self._won = self._won or bool(won)
        truncated = not self._won and self._steps >= self.max_steps
        done = self._won or truncated or bool(extra.pop("done", False))
        self._done = done
        info = {
            "admissible_actions": list(self._admissible),
            "won": self._won,
            "raw_obs": raw,
            "invalid": bool(invalid),
            "step": self._steps,
            "truncated": truncated,
        }
        info.update(extra)
        return obs, reward, done, info

    def parse_action(self, response_text: str) -> Optional[str]:
        """The action of a valid policy response (None when the response is invalid: OPID's penalised step)."""
        return prompts.parse_action(response_text, family=self.family)

    def project_action(self, response_text: str) -> tuple[Optional[str], bool]:
        """(action to execute or None, valid) by the reference's rules (`prompts.project_action`)."""
        return prompts.project_action(response_text, family=self.family)

    def history_action(self, response_text: str, action: Optional[str]) -> str:
        """The action the prompt history records for this step (`prompts.history_action`): the projected action,
        or for a response without one its last `unparsed_history_chars` lower-cased characters."""
        n = self.unparsed_history_chars
        return prompts.history_action(response_text, action,
                                      prompts.UNPARSED_HISTORY_CHARS.get(self.family, 0) if n is None else n)

    def step_response(self, response_text: str) -> tuple[Optional[str], str, float, bool, dict[str, Any]]:
        """Project a full policy response and step: the extracted action, or the no-op when there is none;
        info["format_invalid"] = True when the response breaks the reference's rules (the step the trainer
        penalises). Returns (action or None, obs, reward, done, info)."""
        action, valid = self.project_action(response_text)
        obs, reward, done, info = self.step(self.noop_action if action is None else action)
        info["format_invalid"] = not valid
        return action, obs, reward, done, info

    def _unchanged(self, extra: Optional[dict] = None) -> tuple[str, str, list[str], bool, bool, dict]:
        """A `_step` result that changes nothing: the same observation and admissible actions, flagged invalid."""
        return self._last_obs, self._last_raw, list(self._admissible), False, True, dict(extra or {})

    def build_prompt(self, history: list[tuple[str, str]], current_obs: str, history_length: int) -> str:
        """The step prompt for the current state (see `prompts.build_prompt`)."""
        return prompts.build_prompt(
            self.prompt_family, self.task_description, history, current_obs, self.admissible_actions,
            history_length=history_length, step_count=self._steps, template=self.prompt_template)

    # ---- properties ---------------------------------------------------------------------------------------------
    @property
    def prompt_family(self) -> str:
        return self.name

    @property
    def admissible_actions(self) -> list[str]:
        return list(self._admissible)

    @property
    def won(self) -> bool:
        return self._won

    @property
    def done(self) -> bool:
        return self._done

    @property
    def task(self) -> Optional[Task]:
        return self._task

    @property
    def task_description(self) -> str:
        return self._task_description

    @property
    def steps(self) -> int:
        return self._steps

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_with_deadline(fn, args: tuple, timeout_s: float, name: str = "env"):
    """`fn(*args)` in a daemon thread, waited for `timeout_s` seconds: its result, or its exception re-raised, or
    EnvTimeout past the deadline (the thread is abandoned: Python cannot stop it)."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name=f"opid-env-{name}")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise EnvTimeout(f"{name}: did not return within {timeout_s} s")
    if "error" in box:
        raise box["error"]
    return box["result"]


def step_with_timeout(env, action: str, timeout_s: Optional[float]):
    """`env.step(action)` under a time limit of `timeout_s` seconds (None: the env's own deadline, if any); raises
    EnvTimeout past it.

    An env that enforces the limit itself does so (`ProcessEnv.step_with_timeout` kills its worker process, so
    nothing is left running; `Env.step_with_timeout` steps in a daemon thread and marks the env unusable); any other
    object steps in a daemon thread that is abandoned past the limit (the env must then be discarded, not closed —
    its call may still be running).
    """
    if timeout_s is None:
        return env.step(action)
    if callable(getattr(type(env), "step_with_timeout", None)):  # its class's own (not a wrapper's delegation)
        return env.step_with_timeout(action, timeout_s)
    try:
        return run_with_deadline(env.step, (action,), timeout_s, f"step-{getattr(env, 'name', 'env')}")
    except EnvTimeout:
        raise EnvTimeout(f"{getattr(env, 'name', 'env')}: step({_preview(action)}) did not return within "
                         f"{timeout_s} s (env.step_timeout_s)") from None


def _preview(action, n: int = 60) -> str:
    text = repr(action)
    return text if len(text) <= n else text[:n] + f"... ({len(action)} chars)"


def sample_pool(pool: list, n: int, seed: int) -> list:
    """n items from `pool`, reproducible from `seed`: a seeded permutation, cycled when n > len(pool)."""
    import random

    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not pool:
        raise EnvError("the task pool is empty")
    rng = random.Random(seed)
    out: list = []
    while len(out) < n:
        order = list(pool)
        rng.shuffle(order)
        out.extend(order[: n - len(out)])
    return out


class TextWorldGameEnv(Env):
    """An Env that plays one TextWorld-engine game at a time (TextWorld, ALFWorld): the game handle, its expert
    walkthrough, and closing it under the process-wide TextWorld lock."""

    _tw_env = None
    _tw_path = None
    _walkthrough: Optional[list] = None

    def walkthrough(self) -> Optional[list[str]]:
        return None if self._walkthrough is None else list(self._walkthrough)

    def _close_game(self) -> None:
        if self._stuck:  # a call past its deadline may still run in the game and hold the lock: just let go of it
            self._tw_env = None
            self._tw_path = None
            return
        if self._tw_env is not None:
            from opid_mega.envs._cache import TEXTWORLD_LOCK

            try:
                with TEXTWORLD_LOCK:
                    self._tw_env.close()
            finally:
                self._tw_env = None
                self._tw_path = None

    def close(self) -> None:
        self._close_game()
        super().close()
