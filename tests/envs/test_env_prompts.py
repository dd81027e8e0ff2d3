"""Prompt templates, action parsing, Task descriptors, make_env errors (quick, no game generation)."""
import pickle

import pytest

from opid_mega.envs import (CLOSING_ANCHOR, PROMPT_BUILDERS, Task, build_prompt, format_response, make_env,
                            parse_action)
from opid_mega.envs.prompts import project_action
from opid_mega.envs.base import EnvError, sample_pool

FAMILIES = ["alfworld", "textworld", "webshop", "search"]


def _history(n):
    return [(f"observation number {i}", f"action number {i}") for i in range(n)]


# ---- the reference's invalid-action rules (OPID.md "Reference rules in detail" -> "Invalid actions") --------------
# ALFWorld / TextWorld / WebShop (verl-agent alfworld_projection, webshop_projection): the text between the first
# "<action>" and the first "</action>" of the lower-cased response, stripped; valid only when both action tags, both
# think tags ("<think>", "</think>", as written) are present and no character in U+4E00..U+9FFF appears.
@pytest.mark.parametrize("text,action,valid", [
    ("<think>go to the fridge</think><action>go to fridge 1</action>", "go to fridge 1", True),
    ("<think>t</think><action>Go To Fridge 1</action>", "go to fridge 1", True),  # lower-cased
    ("<think>t</think><action>  go   to\n fridge 1 </action>", "go to fridge 1", True),  # stripped (collapsed)
    ("<think>t</think><action>look</action> blah <action>open fridge 1</action>", "look", True),  # first tag
    ("<think>maybe <action>look</action>?</think><action>go east</action>", "look", True),  # think not skipped
    ("<think>t</think><ACTION>inventory</ACTION>", "inventory", True),  # action tags in any case
    ("<action>inventory</action><think>after</think>", "inventory", True),  # think anywhere
    ("<action>go to fridge 1</action>", "go to fridge 1", False),  # no think tags: executed, penalised
    ("<think>t<action>look</action>", "look", False),  # "</think>" missing
    ("<THINK>t</THINK><action>look</action>", "look", False),  # think tags are matched as written
    ("<think>t</think><action>look</action>我", "look", False),  # a Chinese character anywhere
    ("<think>\u4e00</think><action>look</action>", "look", False),  # U+4E00, the first of the range
    ("<think>\u9fff</think><action>look</action>", "look", False),  # U+9FFF, the last of the range
    ("<think>テスト</think><action>look</action>", "look", True),  # katakana is not in the range
    ("<think>t</think><action></action>", "", True),  # empty action: valid, as in the reference
    ("<think>t</think></action> x <action>", "", True),  # "</action>" before "<action>": empty slice
    ("<think>only thinking</think>", None, False),  # no action tags: nothing to execute
    ("<think>t</think><action>go to fridge 1", None, False),  # unclosed
    ("go to fridge 1", None, False),
    ("", None, False),
    (None, None, False),
])
@pytest.mark.parametrize("family", ["action", "alfworld", "textworld", "webshop"])
def test_project_action_reference_rules(family, text, action, valid):
    assert project_action(text, family=family) == (action, valid)
    assert parse_action(text, family=family) == (action if valid else None)


# Search (verl-agent search_projection): cut after the first "</search>" (else the first "</answer>"); the first
# <search> block of that, else the first <answer> block; invalid when no block, when both a "<search>" and an
# "<answer>" tag appear, or when either appears more than once. No think or Chinese rule.
@pytest.mark.parametrize("text,action,valid", [
    ("<think>need facts</think><search> capital of France </search>", "<search>capital of France</search>", True),
    ("<think>known</think>\n<answer>Paris</answer>", "<answer>Paris</answer>", True),
    ("<answer>Paris</answer>", "<answer>Paris</answer>", True),  # no think tags needed
    ("<answer>北京</answer>", "<answer>北京</answer>", True),  # no Chinese rule
    ("<SEARCH>q</SEARCH>", "<search>q</search>", True),  # blocks in any case
    ("<search>a</search> then <answer> Paris  France </answer>", "<search>a</search>", False),  # both kinds
    ("<answer>Paris</answer><search>q</search>", "<search>q</search>", False),  # search block first, both kinds
    ("<search>a</search><search>b</search>", "<search>a</search>", False),  # duplicate
    ("<answer>a</answer><answer>b</answer>", "<answer>a</answer>", False),  # duplicate
    ("<search>a</search><search>", "<search>a</search>", False),  # a second open tag counts
    ("<answer></answer>", "<answer></answer>", True),  # empty block: valid, as in the reference
    ("<search>unclosed", None, False),
    ("<action>look</action>", None, False),
    ("Paris", None, False),
    ("", None, False),
])
def test_project_search_reference_rules(text, action, valid):
    assert project_action(text, family="search") == (action, valid)
    assert parse_action(text, family="search") == (action if valid else None)


def test_parse_errors():
    with pytest.raises(TypeError):
        parse_action(123)
    with pytest.raises(TypeError):
        project_action(b"<action>look</action>")
    with pytest.raises(ValueError, match="unknown parse family"):
        parse_action("<action>x</action>", family="nope")


@pytest.mark.parametrize("family,action", [("action", "go to fridge 1"), ("search", "<search>who</search>"),
                                           ("search", "<answer>Paris</answer>")])
def test_format_response_roundtrip(family, action):
    resp = format_response(action, think="step by step", family=family)
    assert resp.startswith("<think>step by step</think>")
    assert parse_action(resp, family=family) == action


# ---- prompts ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n_hist", [0, 1, 7])
def test_prompt_task_line_and_closing_paragraph(family, n_hist):
    task = "put a clean mug in\ncoffeemachine"  # a newline in the task must not break the task line
    prompt = build_prompt(family, task, _history(n_hist), "you see a mug 1", ["go to mug 1", "look"],
                          history_length=3, step_count=n_hist)
    lines = prompt.split("\n")
    assert "put a clean mug in coffeemachine" in lines[0]
    anchors = [i for i, ln in enumerate(lines) if ln.startswith(CLOSING_ANCHOR)]
    assert len(anchors) == 1
    assert lines[anchors[0] - 1] == ""  # the closing paragraph is its own paragraph
    assert "<think>" in "\n".join(lines[anchors[0]:])
    assert ("<action>" if family != "search" else "<answer>") in "\n".join(lines[anchors[0]:])
    if family != "search":
        assert "'go to mug 1'" in prompt and "you see a mug 1" in prompt


@pytest.mark.parametrize("family", FAMILIES)
def test_history_window_slides(family):
    hist = _history(7)
    prompt = build_prompt(family, "task", hist, "current obs", ["look"], history_length=3, step_count=7)
    for i in range(7):
        shown_action = f"action number {i}" in prompt
        assert shown_action == (i >= 4), (i, prompt)
    if family == "search":  # each shown action is followed by the observation it produced
        assert "[Step 5] action number 4\nobservation number 5" in prompt
        assert "[Step 7] action number 6\ncurrent obs" in prompt
    else:
        assert "[Observation 5: 'observation number 4', Action 5: 'action number 4']" in prompt
        assert "observation number 3" not in prompt
        assert "already taken 7 step(s)" in prompt and "step 8" in prompt
    # history_length=0: no history at all
    bare = build_prompt(family, "task", hist, "current obs", ["look"], history_length=0, step_count=7)
    assert "action number" not in bare
    with pytest.raises(ValueError):
        build_prompt(family, "task", hist, "obs", [], history_length=-1, step_count=7)


def test_prompt_contract_with_skill_injection():
    from opid_mega.skills.injection import inject_skills, split_prompt

    prompt = build_prompt("alfworld", "heat some egg and put it in garbagecan", _history(2), "obs", ["look"],
                          history_length=5, step_count=2)
    head, middle, tail = split_prompt(prompt)
    assert head.startswith("You are an expert agent") and "heat some egg" in head
    assert tail.startswith(CLOSING_ANCHOR) and middle
    out = inject_skills(prompt, {"episode": "Find the egg first.", "step": "Heat it now."})
    assert out.split("\n")[0] == prompt.split("\n")[0]
    assert out.index("[Find the egg first.]") < out.index("Prior to this step") < out.index("[Heat it now.]") \
        < out.index(CLOSING_ANCHOR)


def test_webshop_actions_one_per_line():
    prompt = build_prompt("webshop", "buy a red shirt", [], "WebShop [SEP] Search",
                          ["search[<your query>]", "click[next >]"], history_length=2, step_count=0)
    assert "[\n'search[<your query>]',\n'click[next >]'\n]." in prompt


def test_prompt_builders_registry():
    assert set(FAMILIES) <= set(PROMPT_BUILDERS)
    with pytest.raises(ValueError, match="unknown prompt family"):
        build_prompt("nope", "t", [], "o", [], 1, 0)


# ---- tasks -----------------------------------------------------------------------------------------------------
def test_task_json_and_pickle():
    t = Task(id="textworld/simple-easy-3", split="train", env="textworld", data={"game_seed": 3, "x": [1, 2]})
    assert Task.from_json(t.to_json()) == t
    assert pickle.loads(pickle.dumps(t)) == t


def test_sample_pool_reproducible():
    pool = list(range(10))
    a, b, c = sample_pool(pool, 7, seed=1), sample_pool(pool, 7, seed=1), sample_pool(pool, 7, seed=2)
    assert a == b and a != c and len(set(a)) == 7
    assert sorted(sample_pool(pool, 20, seed=0)) == sorted(pool * 2)  # cycles through the pool
    with pytest.raises(EnvError):
        sample_pool([], 1, 0)


def test_make_env_unknown():
    with pytest.raises(ValueError, match="unknown env"):
        make_env("minecraft")
