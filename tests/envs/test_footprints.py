"""The footprints game (opid_mega/envs/footprints_env.py; docs/experiments.md, the mechanism experiment): pure Python,
quick (no simulator). Expected values come from the design: 5 doors, one right (chance 1/5), 25% robbed, a budget
of the expert's length + 1, a wrong door always fatal, the closet wall naming the right door."""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import types

import pytest

from opid_mega.envs import ENV_DEFAULTS, ENV_NAMES, Task, check_env_config, make_env
from opid_mega.envs.footprints_env import (CLOSET_ENTRY_RE, COLOURS, NOTHING_HAPPENS, REVEAL_RE, VERSION,
                                           FootprintsEnv, make_game)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**kw) -> FootprintsEnv:
    return make_env("footprints", **kw)


def _play(env, task, actions):
    """Step `actions` from a reset (stopping when the episode ends): [(action, obs, reward, done, info)]."""
    env.reset(task)
    out = []
    for a in actions:
        obs, reward, done, info = env.step(a)
        out.append((a, obs, reward, done, info))
        if done:
            break
    return out


def _routine_then(game, door, rest=("take coin", "look", "look")):
    """The expert's routine moves, then `open <door> door`, then `rest`."""
    return [f"go {d}" for d in game.moves] + [f"open {door} door", *rest]


# ---- registry, options ---------------------------------------------------------------------------------------------
def test_registered_like_the_other_envs():
    assert "footprints" in ENV_NAMES and ENV_DEFAULTS["footprints"]["max_steps"] == 5
    env = _env()
    assert type(env) is FootprintsEnv and env.name == "footprints" and env.family == "action"
    assert env.max_steps == 5 and env.success_reward == 10.0 and env.step_timeout_s == 60.0  # in-process
    cfg = types.SimpleNamespace(name="footprints", options={"pool_size": {"train": 8}})
    check_env_config(cfg)
    with pytest.raises(ValueError, match=r"^env.options.pool_sise: not an option of footprints; accepted: "
                                         r"pool_size, process, success_reward$"):
        check_env_config(types.SimpleNamespace(name="footprints", options={"pool_sise": 8}))


@pytest.mark.parametrize("pool_size,message", [
    ({"tran": 8}, "footprints: pool_size.tran: not a split; allowed: train, valid, test"),
    ({"test": 0}, "footprints: pool_size.test must be an int in 1..100000, got 0"),
    ({"test": 100_001}, "footprints: pool_size.test must be an int in 1..100000, got 100001"),
    ({"train": "8"}, "footprints: pool_size.train must be an int in 1..100000, got '8'"),
    (True, "footprints: pool_size must be an int or a mapping {train, valid, test} of ints, got True"),
])
def test_bad_pool_size_names_the_key(pool_size, message):
    with pytest.raises(ValueError) as e:
        _env(pool_size=pool_size)
    assert str(e.value) == message


def test_bad_tasks_and_splits():
    env = _env()
    with pytest.raises(ValueError, match="unknown split 'holdout'"):
        env.tasks("holdout", 1)
    from opid_mega.envs import EnvError

    with pytest.raises(EnvError, match="not a footprints-v1 task"):
        env.reset(Task(id="x", split="train", env="footprints", data={"seed": 3}))
    with pytest.raises(ValueError, match="a game seed is an int >= 0"):
        make_game(-1)


# ---- pools and determinism ---------------------------------------------------------------------------------------
def test_pools_are_disjoint_and_sized_as_designed():
    env = _env()
    seeds = {split: [t.data["seed"] for t in env.task_pool(split)] for split in ("train", "valid", "test")}
    assert [len(seeds[s]) for s in ("train", "valid", "test")] == [48, 64, 256]
    assert not set(seeds["train"]) & set(seeds["test"]) and not set(seeds["valid"]) & set(seeds["test"])
    assert not set(seeds["train"]) & set(seeds["valid"])
    assert seeds["train"][0] == 0 and seeds["test"][0] == 200_000
    assert all(t.data["version"] == VERSION for t in env.task_pool("test"))
    assert len(_env(pool_size=7).task_pool("test")) == 7
    sized = _env(pool_size={"train": 3})
    assert [len(sized.task_pool(s)) for s in ("train", "valid", "test")] == [3, 64, 256]
    assert env.tasks("train", 5, seed=1) == env.tasks("train", 5, seed=1) != env.tasks("train", 5, seed=2)


def test_games_are_a_function_of_the_seed():
    games = [make_game(s) for s in range(200_000, 200_256)]
    assert games == [make_game(s) for s in range(200_000, 200_256)]
    for g in games:
        assert len(set(g.doors)) == 5 and set(g.doors) <= set(COLOURS) and g.right in g.doors and g.rug in g.doors
        assert len(g.moves) in (1, 2)
    assert len({(g.doors, g.right, g.moves) for g in games}) > 200  # the seed matters
    # the same games in another process with another hash seed (str seeds go through SHA-512, not hash())
    code = ("import json, dataclasses; from opid_mega.envs.footprints_env import make_game; "
            "print(json.dumps([dataclasses.astuple(make_game(s)) for s in (0, 1, 200000, 200255)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True).stdout
    import dataclasses

    assert json.loads(out) == json.loads(json.dumps([dataclasses.astuple(make_game(s))
                                                     for s in (0, 1, 200000, 200255)]))
    # two envs play the same task identically
    task = _env().tasks("test", 1, seed=3)[0]
    a, b = _env(), _env()
    acts = _routine_then(make_game(task.data["seed"]), make_game(task.data["seed"]).doors[0])
    assert a.reset(task) == b.reset(task) and _play(a, task, acts) == _play(b, task, acts)


# ---- the expert, the robbed share, the chance rate ---------------------------------------------------------------
def test_expert_wins_exactly_the_non_robbed_games_and_a_quarter_is_robbed():
    """The expert wins every non-robbed game of every pool (3 or 4 steps) and loses every robbed one (the chest is
    empty; the game ends at its budget). Robbed share: exactly one game of each block of 4 seeds, so exactly 12 of
    the 48 training games, 16 of 64, 64 of the 256 held-out games (a per-game coin would give 0.25 +- 0.027, one
    binomial sd over 256: the block rule removes that spread); within a block the robbed seed varies."""
    env = _env()
    for split in ("train", "valid", "test"):
        for task in env.task_pool(split):
            env.reset(task)
            game, plan = env.game, env.walkthrough()
            assert plan == [f"go {d}" for d in game.moves] + [f"open {game.right} door", "take coin"]
            steps = _play(env, task, plan)
            assert [s[0] for s in steps] == plan and not any(s[4]["invalid"] for s in steps)
            assert steps[-1][4]["won"] == (not game.robbed) and steps[-1][2] == (0.0 if game.robbed else 10.0)
            assert steps[-1][3] == (not game.robbed)  # a robbed game has one step of its budget left
            if game.robbed:
                assert "the chest: it is empty" in steps[-1][1]
                obs, reward, done, info = env.step("look")  # the budget's last step ends it
                assert done and not info["won"] and reward == 0.0 and info["step"] == game.budget
                assert info["truncated"]
    robbed = {split: [make_game(t.data["seed"]).robbed for t in env.task_pool(split)]
              for split in ("train", "valid", "test")}
    assert [sum(robbed[s]) for s in ("train", "valid", "test")] == [12, 16, 64]
    for split in robbed:
        assert all(sum(robbed[split][i:i + 4]) == 1 for i in range(0, len(robbed[split]), 4))
    positions = [robbed["test"][i:i + 4].index(True) for i in range(0, 256, 4)]
    assert all(positions.count(k) >= 8 for k in range(4)), positions  # 16 expected each; not a fixed slot


def test_a_random_door_with_expert_routine_steps_succeeds_at_chance():
    """Uniformly random door, expert routine steps: success = P(right door) x P(not robbed) = 0.2 x 0.75 = 0.15. Four
    draws per held-out game (1024 episodes): binomial sd sqrt(0.15 * 0.85 / 1024) = 0.011 (the fixed robbed games only
    lower it); tolerance three sd, 0.034. Each episode wins exactly when the drawn door is right and the game is not
    robbed."""
    env, rng, wins, n = _env(), random.Random(2026), 0, 0
    for task in env.task_pool("test"):
        game = make_game(task.data["seed"])
        for _ in range(4):
            door = rng.choice(game.doors)
            steps = _play(env, task, _routine_then(game, door))
            won = steps[-1][4]["won"]
            assert won == (door == game.right and not game.robbed)
            wins, n = wins + won, n + 1
    assert n == 1024
    assert abs(wins / n - 0.15) <= 3 * math.sqrt(0.15 * 0.85 / n), wins / n


# ---- budget, fatal doors, the closet reveal, first_door_correct ----------------------------------------------------
def test_the_budget_is_the_expert_length_plus_one():
    env = _env()
    kinds = set()
    for task in env.task_pool("train"):
        env.reset(task)
        game = env.game
        assert game.budget == len(env.walkthrough()) + 1 == len(game.moves) + 3
        kinds.add(game.budget)
        steps = _play(env, task, ["look"] * 10)  # never progresses: the budget ends it
        assert len(steps) == game.budget and steps[-1][3] and steps[-1][4]["truncated"] and not steps[-1][4]["won"]
        assert not any(s[3] for s in steps[:-1])
        if not game.robbed:  # one spare step: a wasted step first still wins, on the budget's last step
            steps = _play(env, task, ["look"] + env.walkthrough())
            assert steps[-1][4]["won"] and len(steps) == game.budget
            steps = _play(env, task, ["look", "nonsense"] + env.walkthrough())  # two wasted: no win
            assert len(steps) == game.budget and not steps[-1][4]["won"] and steps[-1][0] == f"open {game.right} door"
    assert kinds == {4, 5}  # with and without a corridor
    # env.max_steps is an outer cap on top of the budget
    capped = _env(max_steps=2)
    task = capped.task_pool("train")[0]
    steps = _play(capped, task, ["look"] * 5)
    assert len(steps) == 2 and steps[-1][4]["truncated"]


def test_a_wrong_door_is_fatal_and_the_closet_names_the_right_door():
    env = _env()
    for task in env.task_pool("train")[:12]:
        game = make_game(task.data["seed"])
        for wrong in [c for c in game.doors if c != game.right]:
            for after in ("look", f"open {game.right} door", "take coin", "garbage!"):
                steps = _play(env, task, _routine_then(game, wrong, rest=(after, "look", "look")))
                door = steps[game.door_step]
                assert door[0] == f"open {wrong} door" and not door[3] and door[4]["first_door_correct"] is False
                assert CLOSET_ENTRY_RE.search(door[1]).group(1) == wrong
                assert REVEAL_RE.search(door[1]).group(1) == game.right
                assert door[4]["admissible_actions"] == ["look"]  # no door out of the closet
                last = steps[-1]  # the next step ends the game, whatever it does
                assert len(steps) == game.door_step + 2 and last[3] and not last[4]["won"] and last[2] == 0.0
                assert not last[4]["truncated"]  # one step before the budget (door step + 3)
                assert last[4]["invalid"] == (after != "look") and last[4]["first_door_correct"] is False


def test_first_door_correct_is_none_until_a_door_is_opened():
    env = _env()
    for task in env.task_pool("train")[:10]:
        game = make_game(task.data["seed"])
        for door in (game.right, next(c for c in game.doors if c != game.right)):
            steps = _play(env, task, ["open red door", "examine rug"] + _routine_then(game, door))
            k = 2 + game.door_step  # "open red door" in the porch is invalid (red may be a door here too)
            assert steps[0][4]["invalid"] and steps[k][0] == f"open {door} door" and not steps[k][4]["invalid"]
            assert all(s[4]["first_door_correct"] is None for s in steps[:k])
            assert all(s[4]["first_door_correct"] is (door == game.right) for s in steps[k:])


def test_routine_steps_and_rooms():
    """Going back costs steps; `examine rug` and `look` change nothing; in the porch a door is not admissible."""
    env = _env()
    task = next(t for t in env.task_pool("train") if len(make_game(t.data["seed"]).moves) == 2)
    game = make_game(task.data["seed"])
    back = {"north": "south", "east": "west", "west": "east"}
    obs = env.reset(task)
    assert obs.startswith("-= Porch =-\n") and obs.endswith("\n\nYour task is to: find the gold coin and take it.")
    assert env.admissible_actions == sorted([f"go {game.moves[0]}", "look"])
    o1, *_ = env.step(f"go {game.moves[0]}")
    assert o1.startswith("-= Corridor =-") and env.admissible_actions == sorted(
        [f"go {game.moves[1]}", f"go {back[game.moves[0]]}", "look"])
    o2, *_ = env.step(f"go {back[game.moves[0]]}")
    assert o2.startswith("-= Porch =-")
    env.reset(task)
    env.step(f"go {game.moves[0]}")
    hall, *_ = env.step(f"go {game.moves[1]}")
    assert hall.startswith("-= Hall =-") and f"Fresh footprints lead to the {game.right} door." in hall
    assert f"A {game.rug} rug lies on the floor." in hall
    assert env.admissible_actions == sorted([f"go {back[game.moves[1]]}", "examine rug", "look"]
                                            + [f"open {c} door" for c in game.doors])
    rug, _, done, info = env.step("examine rug")
    assert game.rug in rug and not info["invalid"] and not done
    # "ours": the first observation has no task line (the prompt's intro line carries it)
    assert "Your task is to" not in _env(template="ours").reset(task)


def test_prompts_are_the_action_template_with_the_task_line_in_the_first_observation():
    from opid_mega.envs import CLOSING_ANCHOR

    env = _env()
    task = env.task_pool("train")[0]
    obs = env.reset(task)
    prompt = env.build_prompt([], obs, 5)
    assert prompt.startswith("You are an expert agent playing a text adventure game.\nYour current observation "
                             "is: -= Porch =-\n")
    assert prompt.count("Your task is to: find the gold coin and take it.") == 1 and CLOSING_ANCHOR in prompt
    o1, *_ = env.step(env.walkthrough()[0])
    later = env.build_prompt([(obs, env.walkthrough()[0])], o1, 5)
    assert later.split("\n")[0] == ("You are an expert agent playing a text adventure game. Your task is to: find "
                                    "the gold coin and take it.")
    from opid_mega.envs.prompts import template_fingerprint

    assert template_fingerprint("reference", "footprints") != template_fingerprint("reference", "textworld")


# ---- garbage ---------------------------------------------------------------------------------------------------
def test_fuzz_any_string_is_an_invalid_action_never_an_exception():
    """Hypothesis-generated and known-nasty strings (empty, 10 kB, control characters, surrogates, any Unicode): an
    action that is not admissible is answered "Nothing happens.", flagged invalid, and changes nothing (the
    admissible actions stay); it counts toward the budget."""
    from _env_fuzz import FUZZ, NASTY_ALL, RESPONSES, play_garbage
    from hypothesis import given

    env = _env()
    task = env.task_pool("train")[0]
    last: dict = {}

    def check_steps(text):
        for before, admissible, action, obs, reward, done, info in play_garbage(env, task, text, last):
            cmd = " ".join(action.strip().lower().split())
            if cmd not in admissible:
                assert obs == NOTHING_HAPPENS and info["invalid"] and reward == 0.0
                if not done:
                    assert info["admissible_actions"] == admissible

    FUZZ(given(RESPONSES)(check_steps))()
    for text in NASTY_ALL + ["x" * 100_000, "ö" * 50_000, "🙂 open red door", "OPEN  RED\tDOOR"]:
        check_steps(text)
    # a well-formed response with a routine action moves on
    env.reset(task)
    action, obs, reward, done, info = env.step_response(f"<think>go</think><action>{env.walkthrough()[0]}</action>")
    assert action == env.walkthrough()[0] and not info["invalid"] and not info["format_invalid"]
