"""ProcessEnv: the Env protocol forwarded to a worker process (parallelism for TextWorld/ALFWorld)."""
import os
import signal
import threading
import time

import pytest

from opid_mega.envs import make_env
from opid_mega.envs.base import EnvError, EnvTimeout, step_with_timeout
from opid_mega.envs.search_qa import SearchQAEnv


def test_search_qa_in_a_process():
    env = make_env("search_qa", process=True)
    try:
        assert env.name == "search_qa" and env.family == "search" and env.max_steps == 4
        task = env.tasks("train", 1, seed=0)[0]
        assert env.reset(task) == task.data["question"] == env.task_description
        assert env.parse_action("<think>x</think><search>q</search>") == "<search>q</search>"
        assert env.build_prompt([], task.data["question"], 4).split("\n")[0].endswith(task.data["question"])
        for action in env.walkthrough():
            obs, reward, done, info = env.step(action)
        assert done and reward == 1.0 and env.won
        with pytest.raises(EnvError, match="after the episode ended"):  # child errors keep their type
            env.step("<answer>x</answer>")
        with pytest.raises(TypeError, match="expects a Task"):
            env.reset("not a task")
    finally:
        env.close()
    with pytest.raises(EnvError, match="closed"):
        env.step("<answer>x</answer>")


def test_step_past_the_time_limit_kills_the_worker():
    env = make_env("search_qa", process=True)
    try:
        env.reset(env.tasks("train", 1, seed=0)[0])
        assert env.project_action("<search>a</search><search>b</search>") == ("<search>a</search>", False)
        obs, *_ = step_with_timeout(env, "<search>capital</search>", 60)
        assert obs.startswith("<information>")
        os.kill(env._proc.pid, signal.SIGSTOP)  # a simulator that never answers again
        t0 = time.monotonic()
        with pytest.raises(EnvTimeout, match=r"did not answer step\('<search>capital</search>'\) within 1.0 s"):
            step_with_timeout(env, "<search>capital</search>", 1.0)
        assert time.monotonic() - t0 < 15 and not env._proc.is_alive()  # killed, nothing left running
        with pytest.raises(EnvError, match="closed"):
            env.step("<search>capital</search>")
    finally:
        env.close()  # after a kill: returns at once


class _SlowSearchQA(SearchQAEnv):
    def _step(self, action):
        if "slow" in action:
            time.sleep(30)  # abandoned past the limit (a daemon thread: nobody waits for it)
        return super()._step(action)


def test_in_process_step_time_limit():
    """An in-process env steps in a daemon thread that is abandoned past the limit (Python cannot stop it)."""
    env = _SlowSearchQA()
    env.reset(env.tasks("train", 1, seed=0)[0])
    assert step_with_timeout(env, "<search>fast</search>", None)[0].startswith("<information>")  # no limit
    assert step_with_timeout(env, "<search>fast</search>", 5.0)[0].startswith("<information>")
    t0 = time.monotonic()
    with pytest.raises(EnvTimeout, match=r"search_qa: step\('<search>slow</search>'\) did not return within 0.2 s"):
        step_with_timeout(env, "<search>slow</search>", 0.2)
    assert time.monotonic() - t0 < 10  # the 0.2 s limit, not the 30 s step (slack: a loaded 2-core machine)
    env2 = _SlowSearchQA()
    env2.reset(env2.tasks("train", 1, seed=0)[0])
    assert step_with_timeout(env2, "<answer>x</answer>", 5.0)[2]  # done
    with pytest.raises(EnvError, match="after the episode ended"):  # errors of the step keep their type
        step_with_timeout(env2, "<answer>x</answer>", 5.0)


def test_bad_options_fail_at_start():
    with pytest.raises(ValueError, match="source must be"):
        make_env("alfworld", process=True, source="nope")


@pytest.mark.slow
def test_alfworld_processes_in_parallel(alfworld_cache):
    envs = [make_env("alfworld", process=True, source="generated", cache_dir=alfworld_cache, pool_size=8)
            for _ in range(2)]
    tasks = envs[0].tasks("train", 2, seed=0)
    results = []

    def play(env, task):
        env.reset(task)
        for action in env.walkthrough():
            _, reward, done, info = env.step(action)
        results.append(info["won"] and reward == 10.0)

    threads = [threading.Thread(target=play, args=et) for et in zip(envs, tasks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for e in envs:
        e.close()
    assert results == [True, True]
