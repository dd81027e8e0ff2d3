"""The rule-based analyzer and the analyzer prompts."""
import json

import pytest

from opid_mega.skills import (
    RuleAnalyzer,
    StepView,
    TrajectoryView,
    build_analysis_prompt,
    build_reask_prompt,
    discounted_returns,
    parse_analysis,
)

WIN = TrajectoryView(task="put a clean mug in the coffeemachine", won=True, steps=[
    StepView("You are in the kitchen.", "<think>..</think><action>go to sinkbasin 1</action>", 0.0,
             "go to sinkbasin 1"),
    StepView("You arrive at sinkbasin 1.", "<action>look</action>", 0.0, "look"),  # changes nothing
    StepView("You arrive at sinkbasin 1.", "<action>take mug 1</action>", 0.0, "take mug 1"),
    StepView("You pick up the mug 1.", "garbled", 0.0, None, False),
    StepView("You pick up the mug 1.", "<action>clean mug 1 with sinkbasin 1</action>", 0.0,
             "clean mug 1 with sinkbasin 1"),
    StepView("You clean the mug 1.", "<action>put mug 1 in coffeemachine 1</action>", 10.0,
             "put mug 1 in coffeemachine 1"),
])
LOSS = TrajectoryView(task="find the coin", won=False, steps=[
    StepView("Room A. Exits: north.", "<action>go north</action>", 0.0, "go north"),
    StepView("Room B. Exits: south.", "no tags", 0.0, None, False),
    StepView("Room B. Exits: south.", "<action>look</action>", 0.0, "look"),
    StepView("Room B. Exits: south.", "<action>look</action>", 0.0, "look"),
    StepView("Room B. Exits: south.", "<action>look</action>", 0.0, "look"),
])


def test_success_gives_the_winning_workflow():
    a = RuleAnalyzer(max_step_skills=2).analyze_one(WIN)
    assert "go to sinkbasin 1 -> take mug 1 -> clean mug 1 with sinkbasin 1 -> put mug 1 in coffeemachine 1" \
        in a.episode_skill
    assert "look" not in a.episode_skill.split("workflow:")[1].split(".")[0]
    assert list(a.step_skills) == [0, 5]  # the rewarded (last) step first, then the earliest progress step
    assert "put mug 1 in coffeemachine 1" in a.step_skills[5]


def test_failure_gives_avoidance_rules_at_first_mistakes():
    a = RuleAnalyzer(max_step_skills=5).analyze_one(LOSS)
    assert "<action></action>" in a.episode_skill and "Do not repeat 'look'" in a.episode_skill
    assert set(a.step_skills) == {1, 2, 3}
    assert "tags" in a.step_skills[1] and "repeat" in a.step_skills[3]


def test_rules_are_deterministic_bounded_and_parsable():
    an = RuleAnalyzer(max_step_skills=1)
    out1 = an.analyze([WIN, LOSS])
    out2 = an.analyze([WIN, LOSS])
    assert [x.to_dict() for x in out1] == [x.to_dict() for x in out2]
    for traj, a in zip([WIN, LOSS], out1):
        assert len(a.step_skills) <= 1 and set(a.step_skills) <= set(range(len(traj.steps)))
        again = parse_analysis(json.dumps(a.to_dict()), range(len(traj.steps)), 1)
        assert again == a
    assert an.analyze([TrajectoryView("t", False, [])]) == [None]
    assert an.submit([WIN]).result()[0] == out1[0]
    an.close()
    with pytest.raises(ValueError):
        RuleAnalyzer(max_step_skills=-1)


def test_failure_without_detectable_mistake_still_has_a_rule():
    traj = TrajectoryView("t", False, [StepView("A", "<action>x</action>", 0.0, "x"),
                                       StepView("B", "<action>y</action>", 0.0, "y")])
    a = RuleAnalyzer().analyze_one(traj)
    assert a.episode_skill and a.step_skills == {}


def test_discounted_returns():
    assert discounted_returns([0, 0, 10], 0.95) == pytest.approx([9.025, 9.5, 10.0])
    assert discounted_returns([], 0.95) == []


# Two-step trajectories for the analyzer prompt; returns by hand with gamma = 0.95 (G_t = r_t + 0.95 G_{t+1}):
#   success, rewards [0, 10]: G_1 = 10, G_0 = 0 + 0.95 x 10 = 9.5
#   failure, rewards [1, -2]: G_1 = -2, G_0 = 1 + 0.95 x (-2) = -0.9
WIN2 = TrajectoryView(task="take the coin", won=True, steps=[
    StepView("You are in a hall. A door leads east.", "<think>east</think><action>go east</action>", 0.0, "go east"),
    StepView("You see a coin.", "<think>take it</think><action>take coin</action>", 10.0, "take coin"),
])
LOSS2 = TrajectoryView(task="open the chest", won=False, steps=[
    StepView("A locked chest. A key lies here.", "<action>open chest</action>", 1.0, "open chest"),
    StepView("The chest is locked.", "<action>kick chest</action>", -2.0, "kick chest"),
])
WIN2_STEPS = """Step 0
Observation: You are in a hall. A door leads east.
Response: <think>east</think><action>go east</action>
Discounted return: 9.500000

Step 1
Observation: You see a coin.
Response: <think>take it</think><action>take coin</action>
Discounted return: 10.000000"""
LOSS2_STEPS = """Step 0
Observation: A locked chest. A key lies here.
Response: <action>open chest</action>
Discounted return: -0.900000

Step 1
Observation: The chest is locked.
Response: <action>kick chest</action>
Discounted return: -2.000000"""


def _fields(prompt: str) -> list:
    """The JSON field names the prompt lists (its lines '- "name": ...')."""
    return [ln.split('"')[1] for ln in prompt.splitlines() if ln.startswith('- "')]


def test_analysis_prompt_success_two_steps():
    """OPID.md "More reference facts: Analyzer prompt content": task, outcome, candidates; each step on several lines
    (index, observation, response, discounted return with 6 decimals); success asks for a reusable workflow; exactly
    three JSON fields; 0-based indices; guidance, not a story; at most K = min(K, T) critical steps."""
    p = build_analysis_prompt(WIN2, max_step_skills=5, gamma=0.95)
    lines = p.splitlines()
    assert "Task: take the coin" in lines and "Outcome: success" in lines
    assert "Candidate step indices: [0, 1]" in lines
    assert WIN2_STEPS in p
    assert _fields(p) == ["episode_summary", "episode_skill", "step_skills"]
    assert "exactly these three fields" in p
    assert "reusable workflow" in p and "core mistake" not in p
    assert "0-based" in p and "not as a story" in p
    assert "at most 2 critical steps" in p  # K = min(5, T = 2)
    assert p.index("Task:") < p.index("Outcome:") < p.index("Step 0") < p.index("Step 1") < p.index("reusable")


def test_analysis_prompt_failure_two_steps():
    """Failure: the core mistake and the warning signs to avoid, not "what to do instead"."""
    p = build_analysis_prompt(LOSS2, max_step_skills=1, gamma=0.95)
    assert "Outcome: failure" in p.splitlines() and "Candidate step indices: [0, 1]" in p
    assert LOSS2_STEPS in p
    assert "core mistake" in p and "warning signs" in p and "avoid" in p
    assert "instead" not in p.lower() and "workflow" not in p
    assert _fields(p) == ["episode_summary", "episode_skill", "step_skills"]
    assert "at most 1 critical steps" in p  # K = min(1, 2)
    # plain tuples are accepted as steps; a 3-step return by hand: [0, 0, 1] -> G_0 = 0.95^2 = 0.9025
    t = build_analysis_prompt(TrajectoryView("t", True, [("o", "r", 0), ("o", "r", 0), ("o", "r", 1)]))
    assert "Step 0\nObservation: o\nResponse: r\nDiscounted return: 0.902500" in t


def test_reask_prompt_quotes_the_last_2000_characters_by_default():
    p = build_analysis_prompt(WIN2)
    bad = "x" * 1000 + "y" * 2000
    r = build_reask_prompt(p, bad, "no JSON object")
    assert r.startswith(p) and "Problem: no JSON object" in r
    assert "reply:\n" + "y" * 2000 + "\n" in r and "x" not in r[len(p):]
    assert build_reask_prompt(p, "x" * 1000 + "TAIL", "e", tail_chars=4).count("x") == p.count("x")
