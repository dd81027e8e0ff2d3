"""The agent loop: B tasks x G trajectories, environments stepped in parallel threads, ONE batched engine call per
step over all live trajectories.

    loop = AgentLoop(engine, tokenizer, env_name="textworld", env_options={...}, history_length=5)
    batch = loop.run(tasks, group_size=8, sampling=SamplingParams(temperature=1.0, max_new_tokens=512,
                                                                  stop_token_ids=loop.stop_token_ids))
    loop.close()

Each step-sample's prompt is a single-turn chat: the user message is the env prompt (env.build_prompt: task line,
history window, current observation, admissible actions, "Now it's your turn" paragraph); the tokenizer's chat
template is applied with add_generation_prompt=True (and enable_thinking=False when the template knows it, i.e.
Qwen3 with thinking off). The ids are made in three pieces split at the skill insertion points (PromptTokenizer), so
the fork scorer can insert a separately tokenized skill section without changing any other token.

Failure handling: a response is projected by the reference's rules (`env.project_action`: the extracted action, or
None, and a validity flag); an invalid response is flagged `valid=False` (the trainer penalises it) and the env gets
the extracted action, or its no-op when there is none (which reveals nothing: opid_mega.envs.base). Any string the
policy writes is such a step, never an error. An env that raises (creation, reset, prompt, step) ends only its
trajectory, with `Trajectory.error` and `Trajectory.env_error` set (logged; the trainer counts them in
rollout/env_errors); so does a step that runs past `step_timeout_s` (EnvTimeout: the env is discarded without
waiting for it — a process env's worker is killed — and a fresh one is built for the next run). Resets run under
the env's own deadline (make_env's `step_timeout_s`: TextWorld/ALFWorld in worker processes by default).
A prompt longer than `max_prompt_tokens` is LEFT-truncated as in the reference (its last max_prompt_tokens token
ids are kept, the skill insertion points shift with them; `prompt_text` stays the whole text); it never ends the
trajectory.
Engine errors (dead server...) are not env problems and propagate.

Deadline: `run(..., deadline_s=D)` ends the rollout D seconds after it started: the trajectories still running then
end as deadline failures (`Trajectory.deadline_failure`, `error` says so; the trainer leaves them out and counts
them), the finished ones are kept. An engine whose generate takes `deadline=` (SGLangEngine, FleetEngine) has the
generate call in flight cut short at that instant (RolloutDeadline); any other engine is checked between steps.

Sampling seeds: when `sampling.seed` is set, step k of a run samples with `step_seed(sampling.seed, k)`, a distinct
seed per step that depends only on (seed, k): a run (and a resumed run) is reproducible step by step.

History: the (observation, action) pairs shown to the policy hold the extracted action, or for a response without
one what the reference records (`Env.history_action`: its last 30 lower-cased characters for the action families,
20 for WebShop, nothing for search); the env itself executed the no-op.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

from opid_mega.envs.base import EnvTimeout, step_with_timeout
from opid_mega.rollout.engine import RolloutDeadline, RolloutEngine, SamplingParams
from opid_mega.rollout.types import RolloutBatch, StepSample, Trajectory

_SENTINEL = "\ue000OPID_USER_MESSAGE\ue000"
log = logging.getLogger(__name__)


def split_prompt(prompt: str) -> tuple[str, str, str]:
    """The prompt cut at its two insertion points, the earlier first (opid_mega.skills' rule): for our templates
    (head incl. the task line, middle, tail from "Now it's your turn to")."""
    from opid_mega.skills.injection import split_prompt as _split

    return _split(prompt)


class PromptTokenizer:
    """Chat-templated, three-piece prompt tokenization.

    `encode(prompt)` returns `(ids, episode_insert_at, step_insert_at)` with
    ids = tok(template_head + head) + tok(middle) + tok(tail + template_tail), where (head, middle, tail) =
    split_prompt(prompt) and template_head/template_tail are the chat template's text around the user message.
    `encode_text(section)` tokenizes a skill section the same way (no special tokens added).
    """

    def __init__(self, tokenizer, enable_thinking: bool = False):
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("PromptTokenizer: the tokenizer has no chat template")
        kwargs = {}
        if isinstance(template, str) and "enable_thinking" in template:
            kwargs["enable_thinking"] = bool(enable_thinking)
        text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                             add_generation_prompt=True, **kwargs)
        if text.count(_SENTINEL) != 1:
            raise ValueError("PromptTokenizer: the chat template does not reproduce the user message verbatim")
        self.template_head, self.template_tail = text.split(_SENTINEL)

    def encode_text(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, prompt: str) -> tuple[list[int], int, int]:
        from opid_mega.skills.injection import insertion_points

        head, middle, tail = split_prompt(prompt)
        p1 = self.encode_text(self.template_head + head)
        p2 = self.encode_text(middle)
        p3 = self.encode_text(tail + self.template_tail)
        ep, st = insertion_points(prompt)
        first, second = len(p1), len(p1) + len(p2)
        # split_prompt cuts at the earlier point first; the episode point is the later one only in a prompt whose
        # task line follows its first "Now it's your turn to" (none of our templates)
        ep_at, st_at = (first, second) if ep <= st else (second, first)
        return p1 + p2 + p3, ep_at, st_at

    def chat_text(self, prompt: str) -> str:
        return self.template_head + prompt + self.template_tail


def default_stop_token_ids(tokenizer, model_path: Optional[str] = None) -> list[int]:
    """End-of-turn ids: the tokenizer's eos, the usual chat end tokens it knows, and the model's generation_config
    eos ids (SGLang stops at those anyway, so both engines stop at the same set)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>"):
        if tok in vocab:
            ids.add(int(vocab[tok]))
    if model_path:
        for name in ("generation_config.json", "config.json"):
            path = os.path.join(model_path, name)
            if os.path.isfile(path):
                eos = json.load(open(path)).get("eos_token_id")
                for e in (eos if isinstance(eos, list) else [eos]):
                    if e is not None:
                        ids.add(int(e))
    return sorted(ids)


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of step `step` of a run seeded with `seed` (distinct per step, < 2**62)."""
    return (int(seed) * 1_000_003 + int(step) * 10_007) % (1 << 62)


def _raw_obs(env, obs: str) -> str:
    raw = getattr(env, "raw_obs", None)
    return raw if isinstance(raw, str) and raw else obs


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _project(env, response_text: str) -> tuple[Optional[str], bool]:
    """(action to execute or None, valid): `env.project_action` (the reference's rules), or for an env object
    without it, `env.parse_action` (None = invalid)."""
    project = getattr(env, "project_action", None)
    if callable(project):
        action, valid = project(response_text)
        return action, bool(valid)
    action = env.parse_action(response_text)
    return action, action is not None


class _Live:
    """Per-trajectory loop state."""

    def __init__(self, traj: Trajectory, task):
        self.traj = traj
        self.task = task
        self.env = None
        self.obs = ""
        self.raw = ""
        self.history: list[tuple[str, str]] = []
        self.done = False


class AgentLoop:
    """Runs rollouts; keeps its env instances between runs (one per trajectory slot)."""

    def __init__(self, engine: RolloutEngine, tokenizer, env_name: Optional[str] = None,
                 env_options: Optional[dict] = None, env_factory: Optional[Callable[[], object]] = None, *,
                 history_length: int = 5, max_steps: Optional[int] = None, num_workers: int = 8,
                 max_prompt_tokens: Optional[int] = None, enable_thinking: bool = False,
                 stop_token_ids: Optional[Sequence[int]] = None, model_path: Optional[str] = None,
                 step_timeout_s: Optional[float] = None):
        if (env_name is None) == (env_factory is None):
            raise ValueError("AgentLoop needs exactly one of env_name (make_env) or env_factory")
        if env_factory is None:
            from opid_mega.envs import make_env

            options = dict(env_options or {})
            env_factory = lambda: make_env(env_name, **options)  # noqa: E731
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompt_tokenizer = PromptTokenizer(tokenizer, enable_thinking=enable_thinking)
        self.env_factory = env_factory
        self.history_length = int(history_length)
        self.max_steps = max_steps
        self.num_workers = max(1, int(num_workers))
        self.max_prompt_tokens = max_prompt_tokens
        if step_timeout_s is not None and not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0 (or None: no limit), got {step_timeout_s!r}")
        self.step_timeout_s = step_timeout_s
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids is not None else default_stop_token_ids(
            tokenizer, model_path)
        self._envs: list = []
        self._pool = ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix="opid-env")
        self._stop = threading.Event()

    # ---- env pool -----------------------------------------------------------------------------------------------
    def _drop_env(self, k: int, wait: bool = True) -> None:
        """Forget the env of slot k after it raised (the next run builds a fresh one). wait=False closes it in a
        daemon thread: after a timeout its step may still be running (and holding its locks)."""
        env, self._envs[k] = self._envs[k], None
        if env is None:
            return

        def close():
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing a broken env is best effort
                pass

        if wait:
            close()
        else:
            threading.Thread(target=close, daemon=True, name="opid-env-close").start()

    def stop(self) -> None:
        """Ask a rollout running in another thread to end at its next step (the trainer is shutting down): the
        trajectories still running end as if the deadline had passed. Later rollouts end at once."""
        self._stop.set()

    def close(self) -> None:
        for env in self._envs:
            if env is not None:
                try:
                    env.close()
                except Exception:  # noqa: BLE001 - closing is best effort
                    pass
        self._envs = []
        self._pool.shutdown(wait=True)

    # ---- rollout ------------------------------------------------------------------------------------------------
    def _generate(self, prompt_ids, sampling: SamplingParams, deadline: Optional[float]):
        """engine.generate, with the deadline when the engine takes one."""
        if deadline is not None:
            takes = getattr(self, "_takes_deadline", None)
            if takes is None:
                try:
                    takes = "deadline" in inspect.signature(self.engine.generate).parameters
                except (TypeError, ValueError):
                    takes = False
                self._takes_deadline = takes
            if takes:
                return self.engine.generate(prompt_ids, sampling, deadline=deadline)
        return self.engine.generate(prompt_ids, sampling)

    def run(self, tasks: Sequence, group_size: int, sampling: SamplingParams,
            rollout_skills: Optional[Sequence[Optional[str]]] = None, skill_kind: str = "episode",
            placement: str = "faithful", deadline_s: Optional[float] = None) -> RolloutBatch:
        """Roll out G = group_size trajectories for each task. `rollout_skills` (skill_grpo): one optional skill
        text per trajectory (group-major: index = task_index * G + g), injected into every prompt of that
        trajectory with opid_mega.skills.inject_skill(prompt, skill, skill_kind, placement). `deadline_s`: see
        the module docstring."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if deadline_s is not None and not 0 < deadline_s < float("inf"):
            raise ValueError(f"deadline_s must be a finite number > 0 (or None: no deadline), got {deadline_s!r}")
        n = len(tasks) * group_size
        if rollout_skills is not None and len(rollout_skills) != n:
            raise ValueError(f"rollout_skills has {len(rollout_skills)} entries, expected tasks x group = {n}")
        t_start = time.perf_counter()
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        batch = RolloutBatch()
        lives: list[_Live] = []
        for b, task in enumerate(tasks):
            for g in range(group_size):
                k = b * group_size + g
                skill = rollout_skills[k] if rollout_skills is not None else None
                traj = Trajectory(task_id=str(getattr(task, "id", task)), group_id=b, traj_id=k,
                                  rollout_skill=skill or None)
                lives.append(_Live(traj, task))
        batch.trajectories = [lv.traj for lv in lives]

        while len(self._envs) < n:  # grow the slot list here so the threads never resize it
            self._envs.append(None)

        def reset(k: int) -> None:
            lv = lives[k]
            try:
                if self._envs[k] is None:
                    self._envs[k] = self.env_factory()
                lv.env = self._envs[k]
                lv.obs = lv.env.reset(lv.task)
                lv.raw = _raw_obs(lv.env, lv.obs)
                lv.traj.task_description = lv.env.task_description
            except Exception as e:  # noqa: BLE001 - an env failure ends only its trajectory
                lv.traj.error = f"reset: {_error_text(e)}"
                lv.traj.env_error = True
                lv.done = True
                log.warning("env error, trajectory %d (task %s) ended: %s", k, lv.traj.task_id, lv.traj.error)
                self._drop_env(k, wait=not isinstance(e, EnvTimeout))

        list(self._pool.map(reset, range(n)))

        def past_deadline(running, step: int) -> None:
            why = "the rollout was stopped" if self._stop.is_set() else \
                f"rollout.deadline_s={deadline_s:g} s passed"
            for lv in running:
                lv.traj.error = f"rollout deadline: {why} at step {step}, before the episode ended"
                lv.traj.deadline_failure = True
                lv.done = True
            if running:
                log.warning("rollout ended at step %d (%s): %d trajectories ended unfinished", step, why, len(running))

        step = 0
        while True:
            live = [lv for lv in lives if not lv.done]
            if self.max_steps is not None and step >= self.max_steps:
                break
            if not live:
                break
            if (deadline is not None and time.monotonic() >= deadline) or self._stop.is_set():
                past_deadline(live, step)
                break
            prompts: list[tuple[_Live, str, list[int], int, int]] = []
            for lv in live:
                try:
                    text = lv.env.build_prompt(lv.history, lv.obs, self.history_length)
                    if lv.traj.rollout_skill:
                        from opid_mega.skills.injection import inject_skill

                        text = inject_skill(text, lv.traj.rollout_skill, skill_kind, placement)
                    ids, ep, st = self.prompt_tokenizer.encode(text)
                except Exception as e:  # noqa: BLE001
                    lv.traj.error = f"prompt at step {step}: {_error_text(e)}"
                    lv.traj.env_error = True
                    lv.done = True
                    self._drop_env(lv.traj.traj_id)
                    continue
                if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                    # left-truncated as in the reference: keep the last max_prompt_tokens tokens; the skill
                    # insertion points move with the kept tokens (one that was cut off goes to the start)
                    cut = len(ids) - self.max_prompt_tokens
                    ids, ep, st = ids[cut:], max(0, ep - cut), max(0, st - cut)
                prompts.append((lv, text, ids, ep, st))
            if not prompts:
                break
            step_sampling = sampling if sampling.seed is None else dataclasses.replace(
                sampling, seed=step_seed(sampling.seed, step))
            t0 = time.perf_counter()
            try:
                results = self._generate([p[2] for p in prompts], step_sampling, deadline)
            except RolloutDeadline:
                batch.generate_time_s += time.perf_counter() - t0
                past_deadline([p[0] for p in prompts], step)
                break
            batch.generate_time_s += time.perf_counter() - t0
            batch.num_generate_calls += 1

            decoded = [self.tokenizer.decode(res.response_ids, skip_special_tokens=True) for res in results]

            def do_step(i: int):
                env = prompts[i][0].env
                try:
                    action, valid = _project(env, decoded[i])
                    executed = env.noop_action if action is None else action
                    return action, valid, step_with_timeout(env, executed, self.step_timeout_s), None
                except Exception as e:  # noqa: BLE001
                    return None, False, None, e

            outcomes = list(self._pool.map(do_step, range(len(prompts))))
            for (lv, text, ids, ep, st), res, response_text, (action, valid, out, err) in zip(
                    prompts, results, decoded, outcomes):
                if err is not None:
                    lv.traj.error = f"step {step}: {_error_text(err)}"
                    lv.traj.env_error = True
                    lv.done = True
                    log.warning("env error, trajectory %d (task %s) ended: %s", lv.traj.traj_id, lv.traj.task_id,
                                lv.traj.error)
                    self._drop_env(lv.traj.traj_id, wait=not isinstance(err, EnvTimeout))
                    continue
                obs, reward, done, info = out
                sample = StepSample(
                    task_id=lv.traj.task_id, group_id=lv.traj.group_id, traj_id=lv.traj.traj_id, step=step,
                    prompt_text=text, prompt_ids=ids, episode_insert_at=ep, step_insert_at=st,
                    response_ids=list(res.response_ids), response_logprobs=[float(x) for x in res.logprobs],
                    response_text=response_text, finish_reason=res.finish_reason, action=action,
                    valid=bool(valid), raw_obs=lv.raw, reward=float(reward), done=bool(done),
                    env_invalid=bool(info.get("invalid", False)) if action is not None else False,
                    rollout_skill=lv.traj.rollout_skill)
                lv.traj.steps.append(sample)
                lv.traj.score += float(reward)
                lv.traj.won = bool(info.get("won", lv.traj.won))
                for key in getattr(lv.env, "info_metrics", ()):
                    if key in info:
                        lv.traj.outcome_info[key] = info[key]
                # the reference's history: the action, or an unparseable response's tail (Env.history_action)
                lv.history.append((lv.obs, lv.env.history_action(response_text, action)))
                lv.obs = obs
                lv.raw = info.get("raw_obs", obs)
                if done:
                    lv.done = True
            step += 1
        batch.wall_time_s = time.perf_counter() - t_start
        return batch


def run_rollout(engine: RolloutEngine, tokenizer, env_name: str, tasks: Sequence, group_size: int,
                sampling: SamplingParams, env_options: Optional[dict] = None, **loop_options) -> RolloutBatch:
    """One-shot convenience: build an AgentLoop, run it, close it."""
    loop = AgentLoop(engine, tokenizer, env_name=env_name, env_options=env_options, **loop_options)
    try:
        return loop.run(tasks, group_size, sampling)
    finally:
        loop.close()
