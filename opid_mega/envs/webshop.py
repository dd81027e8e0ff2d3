"""WebShop backend: an HTTP client for a running WebShop environment server.

Protocol: the AgentGym `agentenv-webshop` server (a FastAPI wrapper around WebShop's `WebAgentTextEnv`, text
observation mode), started with e.g. `webshop --host 0.0.0.0 --port 36001`:
    GET  /                              -> "ok"
    POST /create                        -> env_idx (int)
    POST /reset  {env_idx, session_id}  -> [observation, null]
    POST /step   {env_idx, action}      -> {state, reward, done, info}
    GET  /available_actions?env_idx=    -> {has_search_bar, clickables}
    GET  /instruction_text?env_idx=     -> "Instruction: ..."
    GET  /observation?env_idx=          -> observation text
    POST /close  {env_idx}              -> {closed}
Actions are verl-agent style: `search[query]` and `click[button]`, taken from `<action>...</action>` by the
reference's rules (lower-cased; invalid without the think tags or with Chinese characters: prompts.project_action).
Only well-formed actions reach the server (`_sendable`); the no-op and anything else keep the page as it is.
WebShop's own reward is a score in [0, 1]; the episode is won when it is 1.0 (as in verl-agent) and the step reward
is then `success_reward` (10.0); the raw score is in info["task_score"]. Sessions (goal indices): test 0-499, train
500-1499 by default (`session_ranges`).
One client instance = one server-side env; instances are independent and can be stepped from threads.
"""
from __future__ import annotations

import re
from typing import Optional

from opid_mega.envs.base import Env, EnvError, Task, sample_pool

DEFAULT_URL = "http://127.0.0.1:36001"
DEFAULT_SESSION_RANGES = {"train": (500, 1500), "valid": (1500, 2000), "test": (0, 500)}
_ACTION_RE = re.compile(r"^(search|click)\[(.*)\]$", re.DOTALL | re.IGNORECASE)
MAX_QUERY_CHARS = 500


class WebShopEnv(Env):
    name = "webshop"
    family = "action"
    default_max_steps = 15
    default_success_reward = 10.0
    noop_action = ""  # an empty action is not sent to the server: the page stays as it is
    unparsed_history_chars = 20  # the reference's WebShop projection keeps 20 characters (ALFWorld 30)

    def __init__(self, url: str = DEFAULT_URL, timeout: float = 60.0, session_ranges: Optional[dict] = None,
                 max_steps: Optional[int] = None, success_reward: Optional[float] = None):
        super().__init__(max_steps=max_steps, success_reward=success_reward)
        import requests

        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.session_ranges = dict(DEFAULT_SESSION_RANGES)
        if session_ranges:
            self.session_ranges.update({k: tuple(v) for k, v in session_ranges.items()})
        self._http = requests.Session()
        self._requests = requests
        self._env_idx: Optional[int] = None
        self._instruction = ""
        self._has_search_bar = False
        self._clickables: list[str] = []

    # ---- HTTP ---------------------------------------------------------------------------------------------------
    def _call(self, method: str, path: str, **kwargs):
        try:
            resp = self._http.request(method, self.url + path, timeout=self.timeout, **kwargs)
        except self._requests.exceptions.RequestException as exc:
            raise EnvError(
                f"webshop: cannot reach the WebShop server at {self.url} ({method} {path}: "
                f"{type(exc).__name__}). Start one (AgentGym agentenv-webshop: `webshop --host 0.0.0.0 --port "
                f"36001`) and pass make_env('webshop', url=...).") from exc
        if resp.status_code != 200:
            raise EnvError(f"webshop: {method} {self.url}{path} returned HTTP {resp.status_code}: "
                           f"{resp.text[:300]}")
        try:
            return resp.json()
        except ValueError as exc:
            raise EnvError(f"webshop: {method} {self.url}{path} returned non-JSON: {resp.text[:300]}") from exc

    def ping(self) -> bool:
        """True when the server answers GET /; raises EnvError naming the URL otherwise."""
        self._call("GET", "/")
        return True

    def data_problem(self, splits) -> Optional[str]:
        """The start-up check (opid_mega.checks, before any model is built): one line when the server does not
        answer GET / (within min(timeout, 10 s)) or a split is unknown; None when it answers."""
        for split in splits:
            if split not in self.session_ranges:
                return (f"webshop: unknown split {split!r} (env.train_split / env.eval_split); expected one of "
                        f"{sorted(self.session_ranges)} (env.options.session_ranges)")
        try:
            resp = self._http.get(self.url + "/", timeout=min(self.timeout, 10.0))
        except self._requests.exceptions.RequestException as exc:
            return (f"webshop: no WebShop server answers at {self.url} ({type(exc).__name__}); start one (AgentGym "
                    "agentenv-webshop: `webshop --host 0.0.0.0 --port 36001`) and set env.options.url to it")
        if resp.status_code != 200:
            return (f"webshop: GET {self.url}/ returned HTTP {resp.status_code}: not a WebShop server? "
                    "(env.options.url)")
        return None

    # ---- tasks --------------------------------------------------------------------------------------------------
    def task_pool(self, split: str) -> list[Task]:
        if split not in self.session_ranges:
            raise ValueError(f"webshop: unknown split {split!r}; expected one of {sorted(self.session_ranges)}")
        lo, hi = self.session_ranges[split]
        return [Task(id=f"webshop/{i}", split=split, env=self.name, data={"session": i}) for i in range(lo, hi)]

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        return sample_pool(self.task_pool(split), n, seed)

    # ---- episode ------------------------------------------------------------------------------------------------
    def _refresh_actions(self) -> list[str]:
        res = self._call("GET", "/available_actions", params={"env_idx": self._env_idx})
        self._has_search_bar = bool(res.get("has_search_bar"))
        self._clickables = [str(c) for c in res.get("clickables", [])]
        actions = ["search[<your query>]"] if self._has_search_bar else []
        actions += [f"click[{c}]" for c in self._clickables if c != "search"]
        return actions

    def _format_obs(self, obs: str) -> str:
        # like verl-agent: the instruction is in the task line already; drop it from the page text
        if self._instruction:
            obs = obs.replace(f"Instruction: [SEP] {self._instruction} [SEP] ", "")
        return obs.strip()

    def _reset(self, task: Task):
        if "session" not in task.data:
            raise EnvError(f"webshop: task {task.id} has no 'session'")
        if self._env_idx is None:
            self._env_idx = int(self._call("POST", "/create"))
        res = self._call("POST", "/reset", json={"env_idx": self._env_idx, "session_id": int(task.data["session"])})
        raw = res[0] if isinstance(res, (list, tuple)) else str(res)
        instr = str(self._call("GET", "/instruction_text", params={"env_idx": self._env_idx}))
        self._instruction = re.sub(r"^\s*Instruction:\s*(\[SEP\])?\s*", "", instr).strip()
        actions = self._refresh_actions()
        return self._format_obs(raw), raw, actions, self._instruction

    def _is_admissible(self, action: str) -> bool:
        m = _ACTION_RE.match(action)
        if not m:
            return False
        kind, arg = m.group(1).lower(), m.group(2).strip()
        if kind == "search":
            return self._has_search_bar and bool(arg) and arg != "<your query>"
        return arg.lower() in {c.lower() for c in self._clickables}

    def _sendable(self, action: str) -> bool:
        """What may reach the server: `search[q]` with a non-empty printable query of at most MAX_QUERY_CHARS
        characters, or `click[c]` with c on the page. WebShop's own step ignores every other action (reward 0,
        page unchanged), so not sending them changes nothing but keeps garbage away from the server."""
        m = _ACTION_RE.match(action)
        if not m:
            return False
        kind, arg = m.group(1).lower(), m.group(2).strip()
        if kind == "search":
            return bool(arg) and len(arg) <= MAX_QUERY_CHARS and arg.isprintable()
        return arg.lower() in {c.lower() for c in self._clickables}

    def _step(self, action: str):
        action = action.strip()
        if not action or not self._sendable(action):  # the no-op / an action WebShop would ignore: nothing is sent
            return self._unchanged()
        invalid = not self._is_admissible(action)
        m = _ACTION_RE.match(action)
        if m.group(1).lower() == "click":  # WebShop's clickables are lower-case
            action = f"click[{m.group(2).strip().lower()}]"
        else:
            action = f"search[{m.group(2).strip()}]"
        res = self._call("POST", "/step", json={"env_idx": self._env_idx, "action": action})
        raw = str(res.get("state", ""))
        score = float(res.get("reward") or 0.0)
        actions = self._refresh_actions()
        return self._format_obs(raw), raw, actions, score >= 1.0, invalid, {
            "done": bool(res.get("done")), "task_score": score}

    def close(self) -> None:
        if self._env_idx is not None:
            try:
                self._call("POST", "/close", json={"env_idx": self._env_idx})
            except EnvError:
                pass
            self._env_idx = None
        self._http.close()
        super().close()
