"""ProcessEnv: the Env protocol forwarded to a worker process (parallelism for TextWorld/ALFWorld)."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from opid_mega.config import EnvConfig
from opid_mega.envs import env_factory, make_env
from opid_mega.envs.base import EnvError, EnvTimeout, step_with_timeout
from opid_mega.envs.process import ProcessEnv
from opid_mega.envs.search_qa import SearchQAEnv
from opid_mega.envs.textworld_env import TextWorldEnv

STUCK = "\x00\x01\x02"  # jericho's interpreter never returns from this command (MACHINE_NOTES.md)
LONG_MULTIBYTE = "a" + "é" * 150  # byte 198 falls inside a character: jericho raises UnicodeDecodeError


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
        pid = env.pid
        os.kill(pid, signal.SIGSTOP)  # a simulator that never answers again
        t0 = time.monotonic()
        with pytest.raises(EnvTimeout, match=r"did not answer step\('<search>capital</search>'\) within 1.0 s"):
            step_with_timeout(env, "<search>capital</search>", 1.0)
        assert time.monotonic() - t0 < 15 and env.pid is None and not _alive(pid)  # killed, nothing left running
        with pytest.raises(EnvError, match="before reset"):  # the next call runs in a fresh worker
            env.step("<search>capital</search>")
        assert env.restarts == 1 and _alive(env.pid)
        env.reset(env.tasks("train", 1, seed=0)[0])
        assert step_with_timeout(env, "<search>capital</search>", 60)[0].startswith("<information>")
    finally:
        pid = env.pid
        env.close()
    assert not _alive(pid)
    with pytest.raises(EnvError, match="closed"):
        env.step("<search>capital</search>")


def _alive(pid) -> bool:
    """Whether process `pid` exists and is not a zombie (/proc)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, TypeError):
        return False


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


def test_reset_past_the_deadline_restarts_the_worker():
    env = make_env("search_qa", process=True, step_timeout_s=1.0)
    try:
        task = env.tasks("train", 1, seed=0)[0]
        env.reset(task)
        pid = env.pid
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EnvTimeout, match=r"did not answer reset\('search_qa/.*'\) within 1.0 s"):
            env.reset(task)
        assert time.monotonic() - t0 < 15 and not _alive(pid)
        assert env.reset(task) == task.data["question"] and env.restarts == 1  # a fresh worker
    finally:
        env.close()


def _coin(cache, **kw):
    """One coin_collector game (test_textworld's coin_env plays the same one: generated once per session), any
    command sent to the game's parser."""
    return make_env("textworld", challenges=["coin_collector"], pool_size={"train": 1, "valid": 1, "test": 1},
                    cache_dir=cache, admissible_only=False, **kw)


def test_textworld_and_alfworld_run_in_a_worker_by_default(tmp_path):
    env = make_env("textworld", cache_dir=str(tmp_path), challenges=["coin_collector"], pool_size=4)
    local = make_env("textworld", process=False, cache_dir=str(tmp_path), challenges=["coin_collector"],
                     pool_size=4)
    try:
        assert isinstance(env, ProcessEnv) and env.step_timeout_s == 60.0 and _alive(env.pid)
        assert env.tasks("train", 3, seed=1) == local.tasks("train", 3, seed=1)  # Tasks pickle both ways
        assert callable(env.prepare) and env.unprepared(env.task_pool("train")) == 4
    finally:
        pid = env.pid
        env.close()
    assert not _alive(pid)
    assert isinstance(local, TextWorldEnv) and local.step_timeout_s == 60.0  # in-process: a thread deadline
    assert type(make_env("search_qa")) is SearchQAEnv  # pure Python: in-process, under a thread deadline
    with make_env("search_qa", process=True) as remote:
        assert hasattr(remote, "task_pool") and not hasattr(remote, "prepare")  # what the env in the worker has
    cfg = EnvConfig(name="textworld", options={"process": False, "cache_dir": str(tmp_path)}, step_timeout_s=7.0)
    built = env_factory(cfg)()  # env.options: {process: false} keeps it in the trainer's process
    assert isinstance(built, TextWorldEnv) and built.step_timeout_s == 7.0 and built.max_steps == 30
    for bad, match in (({"process": "yes"}, "process must be true or false"),
                       ({"step_timeout_s": float("inf")}, "finite number"),
                       ({"admissible_only": "no", "process": False}, "admissible_only must be")):
        with pytest.raises(ValueError, match=match):
            make_env("textworld", cache_dir=str(tmp_path), **bad)


@pytest.mark.slow
def test_stuck_textworld_step_returns_within_the_deadline(textworld_cache):
    """The real hang (jericho on "\\x00\\x01\\x02"): the step returns at the deadline, the worker is killed, the
    next reset runs in a fresh worker and the game is played to a win; nothing is left after close."""
    deadline = 5.0
    env = _coin(textworld_cache, step_timeout_s=deadline)
    try:
        task = env.task_pool("train")[0]
        env.prepare([task])  # a generation is a task call (under `timeout`), not an episode call
        env.reset(task)
        obs, reward, done, info = env.step(LONG_MULTIBYTE)  # what jericho cannot take: an invalid step
        assert obs == "Nothing happens." and info["invalid"] and not done
        pid = env.pid
        t0 = time.monotonic()
        with pytest.raises(EnvTimeout, match=r"did not answer step\('\\x00\\x01\\x02'\) within 5.0 s"):
            env.step(STUCK)
        elapsed = time.monotonic() - t0
        # at the deadline, not before; the upper bound (6x it) only catches a wait far past it (the game never
        # answers; env.step_timeout_s's default is 60 s)
        assert deadline - 0.1 <= elapsed < 6 * deadline
        assert env.pid is None and not _alive(pid)
        env.reset(task)
        assert env.restarts == 1 and env.task_description
        for action in env.walkthrough():
            _, reward, done, info = env.step(action)
        assert done and info["won"] and reward == 10.0
    finally:
        pid = env.pid
        env.close()
    assert not _alive(pid)


def test_worker_exits_when_its_parent_is_killed():
    """SIGKILL of the process that owns a ProcessEnv (no close, no atexit): the worker goes too."""
    script = ("import time\nfrom opid_mega.envs import make_env\n"
              "if __name__ == '__main__':\n"
              "    e = make_env('search_qa', process=True)\n"
              "    print(e.pid, flush=True)\n"
              "    time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(owner.stdout.readline())
        assert _alive(worker)
    finally:
        owner.kill()
        owner.wait(30)
    t0 = time.monotonic()
    while _alive(worker) and time.monotonic() - t0 < 20:
        time.sleep(0.2)
    assert not _alive(worker)
