"""TextWorld: locally generated games (cached per session), played to a win with their walkthroughs."""
import os
import threading

import pytest

from opid_mega.envs import CLOSING_ANCHOR, make_env
from opid_mega.envs.textworld_env import DIFFICULTIES, clean_observation


def _env(cache, **kw):
    kw.setdefault("challenges", ["coin_collector", "treasure_hunter"])
    kw.setdefault("pool_size", {"train": 2, "valid": 1, "test": 1})
    return make_env("textworld", process=False, cache_dir=cache, **kw)


@pytest.fixture(scope="module")
def env(textworld_cache):
    e = _env(textworld_cache)
    e.prepare(e.task_pool("train"))  # 2 games, generated once per session
    yield e
    e.close()


def test_tasks_reproducible_and_disjoint(tmp_path):
    e = _env(str(tmp_path), challenges=list(DIFFICULTIES), pool_size=8)  # no generation: descriptors only
    assert e.tasks("train", 6, seed=0) == e.tasks("train", 6, seed=0)
    assert e.tasks("train", 6, seed=0) != e.tasks("train", 6, seed=1)
    train = {t.data["game_seed"] for t in e.task_pool("train")}
    test = {t.data["game_seed"] for t in e.task_pool("test")}
    assert len(train) == 8 and not train & test
    assert {t.data["challenge"] for t in e.task_pool("train")} == set(DIFFICULTIES)
    with pytest.raises(ValueError, match="unknown challenge/difficulty"):
        make_env("textworld", process=False, cache_dir=str(tmp_path), difficulties=["impossible"])
    with pytest.raises(ValueError, match="unknown split"):
        e.task_pool("dev")


def test_clean_observation():
    raw = "\n\n  ________  __\n |  \\/  $$ |\n \\$$$$$$$$\n\nHello there.\n\n\n\n> -= Room =-0/1\nYou see a key."
    assert clean_observation(raw) == "Hello there.\n\nYou see a key."
    end = "You win.\n\n    *** The End ***\n\nYou scored 1 out of 1.\nWould you like to RESTART, QUIT?"
    assert clean_observation(end) == "You win."


def test_walkthrough_wins(env):
    for task in env.task_pool("train"):
        obs = env.reset(task)
        assert "$$$$" not in obs and env.task_description
        prompt = env.build_prompt([], obs, history_length=5)
        # as ALFWorld's (env.template=reference): the first observation ends with the task line, the prompt has no
        # task line of its own, so the episode skill goes right before the admissible actions
        assert obs.endswith(f"\n\nYour task is to: {env.task_description}")
        assert env.task_description not in prompt.split("\n")[0]
        lines = prompt.split("\n")
        k = lines.index(f"Your task is to: {env.task_description}")
        assert lines[k + 1].startswith("Your admissible actions")
        assert any(line.startswith(CLOSING_ANCHOR) for line in lines)
        plan = env.walkthrough()
        assert plan
        history = []
        for i, action in enumerate(plan):
            assert action in env.admissible_actions
            new_obs, reward, done, info = env.step(action)
            history.append((obs, action))
            obs = new_obs
            assert not info["invalid"] and done == (i == len(plan) - 1)
        assert reward == 10.0 and info["won"] and info["score"] == info["max_score"]
        assert "RESTART" not in obs
        prompt = env.build_prompt(history, obs, history_length=1)
        assert f"Action {len(plan)}: '{plan[-1]}'" in prompt and f"Action {len(plan) - 1}:" not in prompt


def test_cache_files_and_reuse(env, textworld_cache):
    task = env.task_pool("train")[0]
    path = env.game_path(task)
    d = task.data
    assert path == os.path.join(textworld_cache, f"{d['challenge']}-{d['difficulty']}-{d['game_seed']}.z8")
    assert os.path.isfile(path[:-3] + ".json")
    mtime = os.path.getmtime(path)
    assert _env(textworld_cache).game_path(task) == path and os.path.getmtime(path) == mtime  # not regenerated


@pytest.fixture(scope="module")
def coin_env(textworld_cache):
    """One coin_collector game (the quickest to generate), for the quick garbage tests."""
    e = _env(textworld_cache, challenges=["coin_collector"], pool_size={"train": 1}, max_steps=100_000)
    yield e
    e.close()


@pytest.mark.parametrize("process", [False, True])
def test_first_observation_task_line_by_template(textworld_cache, process):
    """env.template=reference: TextWorld's first observation ends with "Your task is to: <objective>" (ALFWorld's
    shape; the step-0 prompt has no task line of its own); ours: the game's text alone, the task on the first
    prompt line. The template reaches a worker process too."""
    obs = {}
    for template in ("reference", "ours"):
        e = make_env("textworld", process=process, template=template, cache_dir=textworld_cache,
                     challenges=["coin_collector"], pool_size={"train": 1})
        try:
            assert e.prompt_template == template
            obs[template] = e.reset(e.task_pool("train")[0])
            task = e.task_description
            prompt = e.build_prompt([], obs[template], history_length=5)
        finally:
            e.close()
        assert (task in prompt.split("\n")[0]) == (template == "ours")
    assert obs["reference"] == obs["ours"] + f"\n\nYour task is to: {task}"
    with pytest.raises(ValueError, match="template"):
        make_env("textworld", process=False, template="mine")


def test_invalid_noop_and_truncation(coin_env):
    e = coin_env
    e.max_steps = 3
    try:
        e.reset(e.task_pool("train")[0])
        admissible = e.admissible_actions
        # No action tag: the no-op reveals nothing (it used to run `look`, which describes the room again).
        action, obs, reward, done, info = e.step_response("<think>hmm</think> no action tag")
        assert action is None and info["format_invalid"] and info["invalid"] and not done
        assert obs == "Nothing happens." and e.admissible_actions == admissible and info["step"] == 1
        obs, reward, done, info = e.step("dance wildly")  # not admissible: never sent to the game
        assert info["invalid"] and not done and reward == 0.0 and obs == "Nothing happens."
        obs, reward, done, info = e.step("inventory")
        assert done and info["truncated"] and not info["won"]
    finally:
        e.max_steps = 100_000


def test_garbage_never_reaches_jericho(coin_env):
    """jericho hangs on "\x00\x01\x02" and raises on a multi-byte character cut at 198 bytes (MACHINE_NOTES.md):
    only admissible commands reach the game, garbage leaves its state alone, and the walkthrough still wins."""
    from _env_fuzz import NASTY

    e = coin_env
    e.reset(e.task_pool("train")[0])
    sent = []
    real_step = e._tw_env.step
    e._tw_env.step = lambda cmd: (sent.append(cmd), real_step(cmd))[1]
    plan = e.walkthrough()
    for action in plan:
        admissible = e.admissible_actions
        for junk in NASTY:
            new_obs, reward, done, info = e.step(junk)
            assert info["invalid"] and not done and reward == 0.0
            assert new_obs == "Nothing happens." and e.admissible_actions == admissible
        _, reward, done, info = e.step(action)
    assert done and info["won"] and reward == 10.0
    assert sent == plan


def test_free_commands_reach_the_game_but_not_what_jericho_cannot_take(textworld_cache):
    """admissible_only=False: any command goes to the game's parser (flagged invalid unless admissible), except one
    the interpreter cannot take whole: the long multi-byte action that makes jericho raise is an invalid step."""
    e = _env(textworld_cache, challenges=["coin_collector"], pool_size={"train": 1}, admissible_only=False)
    try:
        task = e.task_pool("train")[0]
        e.reset(task)
        long = "a" + "é" * 150  # 301 UTF-8 bytes; jericho cuts at 198, inside a character
        with pytest.raises(UnicodeDecodeError):
            e._tw_env.step(long)  # the fault itself, straight into the game
        for junk in (long, "\ud800", "x" * 199):
            obs, reward, done, info = e.step(junk)
            assert obs == "Nothing happens." and info["invalid"] and not done and reward == 0.0
        obs, reward, done, info = e.step("dance")  # not admissible: the parser answers, the step is invalid
        assert obs != "Nothing happens." and info["invalid"] and not done
        for action in e.walkthrough():
            _, reward, done, info = e.step(action)
            assert not info["invalid"]
        assert done and info["won"] and reward == 10.0
    finally:
        e.close()


def test_fuzz_any_string_is_an_action(coin_env):
    from _env_fuzz import FUZZ, RESPONSES, play_garbage
    from hypothesis import given

    task = coin_env.task_pool("train")[0]
    last: dict = {}

    @FUZZ
    @given(RESPONSES)
    def check(text):
        for before, admissible, action, obs, reward, done, info in play_garbage(coin_env, task, text, last):
            if " ".join(action.lower().split()) not in admissible:
                assert info["invalid"] and reward == 0.0 and not done and obs == "Nothing happens."
                assert info["admissible_actions"] == admissible

    check()


def test_threads(env, textworld_cache):
    tasks = env.task_pool("train")
    results, errors = [], []

    def play(task):
        try:
            e = _env(textworld_cache)
            e.reset(task)
            for action in e.walkthrough():
                _, reward, done, info = e.step(action)
            results.append(info["won"] and reward == 10.0)
            e.close()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=play, args=(t,)) for t in tasks * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and results == [True] * 4


@pytest.mark.parametrize("challenge", ["simple", "cooking"])
def test_other_challenges_generate_and_win(textworld_cache, challenge):
    e = _env(textworld_cache, challenges=[challenge], pool_size={"test": 1})
    task = e.tasks("test", 1, seed=0)[0]
    e.reset(task)
    assert task.data["game_seed"] >= 200_000 and e.task_description
    for action in e.walkthrough():
        _, reward, done, info = e.step(action)
    assert done and info["won"] and reward == 10.0
    e.close()
