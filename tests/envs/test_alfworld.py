"""ALFWorld through the real ALFWorld code path (TextWorld PDDL engine + AlfredDemangler/AlfredInfos wrappers) on
locally generated ALFWorld problems; the real-data loader on the same files laid out like the ALFWorld download."""
import json
import os
import shutil
import sys
import threading

import pytest

from opid_mega.envs import make_env
from opid_mega.envs.alfworld_gen import TASK_TYPES, make_problem
from opid_mega.envs.base import EnvError


@pytest.fixture(scope="module")
def env(alfworld_cache):
    e = make_env("alfworld", process=False, source="generated", cache_dir=alfworld_cache, pool_size=8)
    yield e
    e.close()


@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_planner_walkthrough_wins(env, task_type):
    task = next(t for t in env.task_pool("train") if t.data["task_type"] == task_type)
    obs = env.reset(task)
    assert "-= Welcome" not in obs and "You are in the middle of a room" in obs
    assert env.task_description and env.task_description in obs
    assert "look" in env.admissible_actions and "help" not in env.admissible_actions
    assert any(a.startswith("go to ") for a in env.admissible_actions)
    plan = env.walkthrough()
    assert plan and plan[-1].startswith("move ")
    for i, action in enumerate(plan):
        assert action in env.admissible_actions
        obs, reward, done, info = env.step(action)
        assert not info["invalid"] and info["raw_obs"]
        assert done == (i == len(plan) - 1)
    assert reward == 10.0 and info["won"] and env.won and not info["truncated"]
    assert os.path.basename(env.game_path(task)) == "game.tw-pddl"


def test_invalid_action_noop_and_max_steps(alfworld_cache):
    e = make_env("alfworld", process=False, source="generated", cache_dir=alfworld_cache, pool_size=8, max_steps=4)
    e.reset(e.tasks("train", 1, seed=0)[0])
    admissible = e.admissible_actions
    # No action tag: the no-op. It reveals nothing new: "Nothing happens.", as the reference's agent sees for it
    # (`look` used to run here, which describes the room again).
    action, obs, reward, done, info = e.step_response("I will look around")
    assert action is None and info["format_invalid"] and info["invalid"] and not done and reward == 0.0
    assert obs == "Nothing happens." and e.admissible_actions == admissible and info["step"] == 1
    obs, reward, done, info = e.step("fly to the moon")  # not admissible: ALFWorld's own answer, no game call
    assert info["invalid"] and obs == "Nothing happens." and not done and reward == 0.0
    assert e.admissible_actions == admissible
    # An action without think tags is executed (as the reference does) and flagged invalid (penalised).
    action, obs, reward, done, info = e.step_response("<action>Inventory</action>")
    assert action == "inventory" and info["format_invalid"] and not info["invalid"] and "carrying" in obs
    obs, reward, done, info = e.step(e.noop_action)  # the no-op counts toward max_steps
    assert done and info["truncated"] and not info["won"] and reward == 0.0
    e.close()


def test_garbage_between_walkthrough_steps_changes_nothing(env):
    """Garbage never reaches the game and never changes its state: the walkthrough still wins around it."""
    from _env_fuzz import NASTY

    task = env.task_pool("train")[1]
    env.max_steps = 10_000
    try:
        env.reset(task)
        sent = []
        real_step = env._tw_env.step
        env._tw_env.step = lambda cmd: (sent.append(cmd), real_step(cmd))[1]
        plan = env.walkthrough()
        for action in plan:
            admissible = env.admissible_actions
            for junk in NASTY[:14]:
                new_obs, reward, done, info = env.step(junk)
                assert info["invalid"] and not done and reward == 0.0
                assert new_obs == "Nothing happens." and env.admissible_actions == admissible
            _, reward, done, info = env.step(action)
        assert done and info["won"] and reward == 10.0
        assert sent == plan  # only the admissible commands reached the game
    finally:
        env.max_steps = 30


def test_fuzz_any_string_is_an_action(env):
    """Hypothesis-generated and known-nasty strings: never raise, never hang, never reach the game unless
    admissible."""
    from _env_fuzz import FUZZ, RESPONSES, play_garbage
    from hypothesis import given

    task = env.task_pool("train")[2]
    env.max_steps = 100_000
    last: dict = {}
    sent = []

    def spy(real):
        def step(cmd):
            sent.append((cmd, list(env.admissible_actions)))
            return real(cmd)
        return step

    @FUZZ
    @given(RESPONSES)
    def check(text):
        if "obs" not in last:
            last["obs"] = env.reset(task)
        if not getattr(env._tw_env.step, "_spy", False):  # (re)install after a reset that reloaded the game
            env._tw_env.step = spy(env._tw_env.step)
            env._tw_env.step._spy = True
        for before, admissible, action, obs, reward, done, info in play_garbage(env, task, text, last):
            if " ".join(action.lower().split()) not in admissible:
                assert info["invalid"] and reward == 0.0 and not done and obs == "Nothing happens."
                assert info["admissible_actions"] == admissible

    try:
        check()
    finally:
        env.max_steps = 30
    assert all(cmd in admissible for cmd, admissible in sent)


def test_generation_reproducible_and_splits_disjoint(env):
    assert make_problem(7) == make_problem(7)
    assert make_problem(7)["pddl_problem"] != make_problem(8)["pddl_problem"]
    assert env.tasks("train", 5, seed=3) == env.tasks("train", 5, seed=3)
    train = {t.data["seed"] for t in env.task_pool("train")}
    test = {t.data["seed"] for t in env.task_pool("test")}
    assert len(train) == 8 and not train & test
    with pytest.raises(ValueError, match="unknown split"):
        env.task_pool("dev")


@pytest.mark.slow
def test_many_generated_games_are_solvable(alfworld_cache):
    e = make_env("alfworld", process=False, source="generated", cache_dir=alfworld_cache, pool_size=8)
    for task in e.task_pool("test"):
        e.reset(task)
        plan = e.walkthrough()
        assert plan, task.id
        for action in plan:
            _, reward, done, info = e.step(action)
        assert done and info["won"] and reward == 10.0, task.id
    e.close()


def test_real_data_layout(tmp_path, env):
    """The `source='data'` loader on files laid out as `alfworld-download` does (json_2.1.1/<split>/<task>/...)."""
    for split, seeds in (("train", [0, 1]), ("valid_unseen", [200_000])):
        for seed in seeds:
            task = next(t for t in env.task_pool("test" if seed >= 200_000 else "train") if t.data["seed"] == seed)
            src = os.path.dirname(env.game_path(task))
            dst = tmp_path / "json_2.1.1" / split / f"{task.data['task_type']}-trial_{seed}" / "trial_T0"
            shutil.copytree(src, dst)
    real = make_env("alfworld", process=False, data_path=str(tmp_path))
    tasks = real.tasks("train", 2, seed=0)
    assert len({t.id for t in tasks}) == 2 and all(t.id.startswith("alfworld/train/") for t in tasks)
    real.reset(real.tasks("test", 1, seed=0)[0])  # test -> valid_unseen
    for action in real.walkthrough():
        _, reward, done, info = real.step(action)
    assert done and info["won"] and reward == 10.0
    real.close()


def test_missing_data_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "nothing"))
    e = make_env("alfworld", process=False)
    with pytest.raises(EnvError, match="alfworld-download") as err:
        e.tasks("train", 1)
    assert "source='generated'" in str(err.value) and str(tmp_path / "nothing") in str(err.value)


def test_threads(alfworld_cache):
    """4 envs load (serialised under a lock) and step (concurrently) from threads; stdout is left intact."""
    stdout = sys.stdout
    pool = make_env("alfworld", process=False, source="generated", cache_dir=alfworld_cache,
                    pool_size=8).task_pool("train")[:4]
    wins, errors = [], []

    def play(task):
        try:
            e = make_env("alfworld", process=False, source="generated", cache_dir=alfworld_cache)
            e.reset(task)
            for action in e.walkthrough():
                _, r, done, info = e.step(action)
            wins.append(info["won"] and r == 10.0)
            e.close()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=play, args=(t,)) for t in pool]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and wins == [True] * 4
    assert sys.stdout is stdout


def test_task_json_roundtrip_plays(env):
    from opid_mega.envs import Task

    task = Task.from_json(env.tasks("valid", 1, seed=0)[0].to_json())
    env.reset(task)
    assert json.loads(task.to_json())["data"]["generated"] is True
    assert env.walkthrough()
