"""The privileged footprints hindsight analyzer (opid_mega/skills/hindsight.py): skills on expert, wrong-door and
robbed trajectories played in the footprints env (expected skills written out from the design: the door step is the
step after the routine moves, index 1 without a corridor and 2 with one), its plug-in loading, and that no step
skill ever names a wrong door as the thing to do. Pure Python, quick."""
from __future__ import annotations

import random
import re
import types

import pytest

from opid_mega.envs import format_response, make_env
from opid_mega.envs.footprints_env import COLOURS, make_game
from opid_mega.skills import Analysis, StepView, TrajectoryView
from opid_mega.skills.hindsight import FootprintsHindsightAnalyzer

CUE = "In the hall, open the door the fresh footprints lead to; the rug's colour means nothing."
BACKEND = "opid_mega.skills.hindsight:FootprintsHindsightAnalyzer"
DOOR_RE = re.compile(r"\b(" + "|".join(COLOURS) + r") door\b")  # a colour naming a door


def play(env, task, actions) -> TrajectoryView:
    """The analyzer's view of an episode, as the agent loop builds it: each step's raw observation is the one the
    action was taken on (the final observation is in no step)."""
    obs = env.reset(task)
    raw, steps, won = env.raw_obs, [], False
    for a in actions:
        new_obs, reward, done, info = env.step(a)
        steps.append(StepView(raw, format_response(a, "t"), float(reward), a, True))
        raw, won = info["raw_obs"], info["won"]
        if done:
            break
    return TrajectoryView(task=env.task_description, won=won, steps=steps, traj_id=task.id)


def _task(env, split="train", corridor=None, robbed=False):
    for t in env.task_pool(split):
        g = make_game(t.data["seed"])
        if g.robbed == robbed and (corridor is None or (len(g.moves) == 2) == corridor):
            return t, g
    raise AssertionError("no such game in the pool")


@pytest.fixture
def env():
    return make_env("footprints")


@pytest.mark.parametrize("corridor,door_step", [(False, 1), (True, 2)])
def test_expert_win(env, corridor, door_step):
    task, g = _task(env, corridor=corridor)
    traj = play(env, task, [f"go {d}" for d in g.moves] + [f"open {g.right} door", "take coin"])
    assert traj.won and len(traj.steps) == door_step + 2
    a = FootprintsHindsightAnalyzer().analyze_one(traj)
    assert a.step_skills == {door_step: f"Open the {g.right} door: the fresh footprints lead to it, and it is the "
                                        "right door."}
    assert a.episode_skill == f"{CUE} Here the {g.right} door was right; then take the coin."
    assert a.episode_summary == f"privileged footprints hindsight: right door {g.right} at step {door_step}; won"


@pytest.mark.parametrize("corridor,door_step", [(False, 1), (True, 2)])
def test_wrong_door(env, corridor, door_step):
    task, g = _task(env, corridor=corridor)
    wrong = next(c for c in g.doors if c != g.right)
    traj = play(env, task, [f"go {d}" for d in g.moves] + [f"open {wrong} door", "look"])
    assert not traj.won and len(traj.steps) == door_step + 2  # the closet step ends it
    a = FootprintsHindsightAnalyzer().analyze_one(traj)
    assert a.step_skills == {door_step: f"Open the {g.right} door instead of the {wrong} door: the fresh footprints "
                                        f"lead to the {g.right} door."}
    assert a.episode_skill == (f"{CUE} Here the footprints lead to the {g.right} door; the {wrong} door led into a "
                               "locked closet and lost the game.")
    assert a.episode_summary == (f"privileged footprints hindsight: wrong door {wrong} at step {door_step} (right: "
                                 f"{g.right}, from the closet wall); lost")


def test_robbed(env):
    task, g = _task(env, robbed=True)
    door_step = len(g.moves)
    traj = play(env, task, [f"go {d}" for d in g.moves] + [f"open {g.right} door", "take coin", "look"])
    assert not traj.won and len(traj.steps) == door_step + 3  # the empty chest shows, one more step ends it
    a = FootprintsHindsightAnalyzer().analyze_one(traj)
    assert a.step_skills == {door_step: f"Open the {g.right} door: the fresh footprints lead to it, and it is the "
                                        "right door."}
    assert a.episode_skill == (f"{CUE} Here the {g.right} door was right: the coin was already gone this time, bad "
                               "luck rather than a wrong choice.")
    # robbed with a wasted step first: `take coin` is the budget's last step, the empty chest is in no step; a lost
    # `take coin` in the vault still means the coin was gone
    traj = play(env, task, ["look"] + [f"go {d}" for d in g.moves] + [f"open {g.right} door", "take coin"])
    assert len(traj.steps) == door_step + 3 and "empty" not in " ".join(s.raw_obs for s in traj.steps)
    b = FootprintsHindsightAnalyzer().analyze_one(traj)
    assert b.episode_skill == a.episode_skill and b.step_skills == {door_step + 1: a.step_skills[door_step]}


def test_lost_in_the_vault_without_taking_the_coin(env):
    task, g = _task(env)
    door_step = len(g.moves)
    traj = play(env, task, [f"go {d}" for d in g.moves] + [f"open {g.right} door", "look", "look"])
    assert not traj.won and len(traj.steps) == g.budget
    a = FootprintsHindsightAnalyzer().analyze_one(traj)
    assert a.step_skills == {door_step: f"Open the {g.right} door: the fresh footprints lead to it, and it is the "
                                        "right door.",
                             door_step + 1: "Take the coin now: it is in the chest."}
    assert a.episode_skill == f"{CUE} Here the {g.right} door was right; in the vault, take the coin at once."
    # K = 1 keeps the door step
    assert list(FootprintsHindsightAnalyzer(max_step_skills=1).analyze_one(traj).step_skills) == [door_step]
    assert FootprintsHindsightAnalyzer(max_step_skills=0).analyze_one(traj).step_skills == {}


def test_no_door_outcome(env):
    """No door opened, or the door step was the last one (env.max_steps cut the game): no step skill, the cue."""
    task, g = _task(env)
    for traj in (play(env, task, ["look"] * 9),
                 play(make_env("footprints", max_steps=len(g.moves) + 1), task,
                      [f"go {d}" for d in g.moves] + [f"open {g.doors[0]} door", "look"])):
        a = FootprintsHindsightAnalyzer().analyze_one(traj)
        assert a.step_skills == {} and a.episode_skill == CUE and "no door outcome" in a.episode_summary
    assert FootprintsHindsightAnalyzer().analyze([TrajectoryView(task="t", won=False, steps=[])]) == [None]


def test_no_step_skill_names_a_wrong_door_as_the_thing_to_do(env):
    """Random play on all 256 held-out games (random admissible actions, random doors, garbage), three episodes each:
    every step skill that names a door names the right one as the door to open; a wrong colour appears only as
    "instead of the <wrong> door"; a door step skill sits on the step that opened a door."""
    rng = random.Random(7)
    an = FootprintsHindsightAnalyzer()
    seen = {"wrong": 0, "right": 0, "none": 0}
    for task in env.task_pool("test"):
        g = make_game(task.data["seed"])
        for _ in range(3):
            env.reset(task)
            done, steps, raw = False, [], env.raw_obs
            while not done:
                r = rng.random()
                plan = env.walkthrough()
                a = (rng.choice(env.admissible_actions) if r < 0.5 else plan[min(env.steps, len(plan) - 1)]
                     if r < 0.9 else rng.choice(["", "open door", "🙂", f"open {rng.choice(COLOURS)} door"]))
                _obs, reward, done, info = env.step(a)
                steps.append(StepView(raw, a, reward, a, True))
                raw = info["raw_obs"]
            traj = TrajectoryView(task=env.task_description, won=info["won"], steps=steps)
            a = an.analyze_one(traj)
            for t, skill in a.step_skills.items():
                doors = DOOR_RE.findall(skill)
                for m in DOOR_RE.finditer(skill):
                    if m.group(1) != g.right:
                        assert skill[:m.start()].endswith("instead of the "), skill
                if doors:
                    assert skill.startswith(f"Open the {g.right} door")
                    assert steps[t].action in [f"open {c} door" for c in g.doors]  # the step that opened a door
            kind = "none" if info["first_door_correct"] is None else (
                "right" if info["first_door_correct"] else "wrong")
            seen[kind] += 1
            if kind == "wrong" and a.step_skills:
                assert "instead of" in next(iter(a.step_skills.values()))
    assert min(seen.values()) > 20, seen  # every case was exercised


def test_plugin_loading_and_options():
    from opid_mega.skills.plugins import analyzer_class, build_analyzer, check_analyzer

    assert analyzer_class(BACKEND) is FootprintsHindsightAnalyzer
    check_analyzer(BACKEND, {"max_step_skills": 2})
    with pytest.raises(ValueError, match=r"^analyzer.options.k: not an option of "):
        check_analyzer(BACKEND, {"k": 2})
    built = build_analyzer(types.SimpleNamespace(backend=BACKEND, options={}, max_step_skills=3))
    assert isinstance(built, FootprintsHindsightAnalyzer) and built.max_step_skills == 3
    with pytest.raises(ValueError, match="max_step_skills must be an int >= 0"):
        FootprintsHindsightAnalyzer(max_step_skills=-1)
    # submit (inherited) runs analyze in the background
    env = make_env("footprints")
    task, g = _task(env)
    traj = play(env, task, [f"go {d}" for d in g.moves] + [f"open {g.right} door", "take coin"])
    an = FootprintsHindsightAnalyzer()
    [res] = an.submit([traj]).result(timeout=10)
    an.close()
    assert isinstance(res, Analysis) and res.step_skills == {len(g.moves): f"Open the {g.right} door: the fresh "
                                                                           "footprints lead to it, and it is the "
                                                                           "right door."}


def test_noisy_belief_names_a_wrong_door_at_its_rate(env):
    """wrong_door_rate p: a share ~p of the trajectories with a door outcome get skills written from a wrong door B
    (never the right one, never the one opened: a wrong door named as the thing to do); the same trajectory always
    gets the same belief; p = 0 is the privileged analyzer exactly; bad rates are refused."""
    rng = random.Random(7)
    trajs = []
    for task in env.task_pool("valid")[:48]:
        g = make_game(task.data["seed"])
        door = g.right if rng.random() < 0.5 else rng.choice([c for c in g.doors if c != g.right])
        trajs.append((g, door, play(env, task, [f"go {d}" for d in g.moves] + [f"open {door} door", "take coin"])))
    exact, noisy = FootprintsHindsightAnalyzer(), FootprintsHindsightAnalyzer(wrong_door_rate=0.4, seed=3)
    assert FootprintsHindsightAnalyzer(wrong_door_rate=0.0, seed=3).analyze(
        [t for *_, t in trajs]) == exact.analyze([t for *_, t in trajs])
    wrong = 0
    for g, door, traj in trajs:
        a, b = exact.analyze_one(traj), noisy.analyze_one(traj)
        assert b == noisy.analyze_one(traj)  # the same trajectory, the same belief
        if a == b:
            continue
        wrong += 1
        [(step, skill)] = b.step_skills.items()
        named = re.match(r"Open the (\w+) door instead of the (\w+) door", skill)
        assert named and named.group(2) == door and named.group(1) not in (g.right, door)
        assert named.group(1) in g.doors and f"the footprints lead to the {named.group(1)} door" in b.episode_skill
        assert "noisy belief" in b.episode_summary and step == len(g.moves)
    assert 0.2 * len(trajs) <= wrong <= 0.6 * len(trajs), wrong  # 0.4 of 48: 19 expected
    assert FootprintsHindsightAnalyzer(wrong_door_rate=0.4, seed=4).analyze([t for *_, t in trajs]) != \
        noisy.analyze([t for *_, t in trajs])  # another seed, other draws
    for bad in (-0.1, 1.5, float("nan"), True, "0.2"):
        with pytest.raises(ValueError, match="wrong_door_rate must be a number in"):
            FootprintsHindsightAnalyzer(wrong_door_rate=bad)
