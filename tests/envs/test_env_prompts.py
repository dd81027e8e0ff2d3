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


# ---- prompts: the reference's template facts (OPID.md "More reference facts", Environment templates) --------------
ALF_OBS0 = ("You are in the middle of a room. Looking quickly around you, you see a cabinet 1.\n\n"
            "Your task is to: put a mug in sink.")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("template", ["reference", "ours"])
@pytest.mark.parametrize("n_hist", [0, 1, 7])
def test_closing_paragraph_starts_with_the_anchor(family, template, n_hist):
    """Every template ends with a closing paragraph of its own that begins "Now it's your turn to" at the start of
    a line after a blank line; it is the first occurrence of the anchor, and it asks for the env's tags."""
    task = "put a clean mug in\ncoffeemachine"  # a newline in the task must not break the task line
    prompt = build_prompt(family, task, _history(n_hist), "you see a mug 1", ["go to mug 1", "look"],
                          history_length=3, step_count=n_hist, template=template)
    assert CLOSING_ANCHOR == "Now it's your turn to"
    at = prompt.find(CLOSING_ANCHOR)
    assert at > 2 and prompt[at - 2:at] == "\n\n" and prompt.count(CLOSING_ANCHOR) == 1
    closing = prompt[at:]
    assert "<think>" in closing and ("<action>" if family != "search" else "<answer>") in closing
    assert prompt.endswith("\n")
    if family != "search":
        assert "'go to mug 1'" in prompt and "you see a mug 1" in prompt


def test_alfworld_step0_has_no_task_line_of_its_own():
    """ALFWorld step 0 ("reference"): no history and no task line of its own — the only "Your task is to:" is the
    first observation's last line — and the admissible actions are joined by a newline and a space."""
    prompt = build_prompt("alfworld", "put a mug in sink", [], ALF_OBS0, ["go to sink 1", "look", "inventory"],
                          history_length=5, step_count=0)
    lines = prompt.split("\n")
    assert lines[:7] == [
        "You are an expert agent operating in the ALFRED Embodied Environment.",
        "Your current observation is: You are in the middle of a room. Looking quickly around you, you see a "
        "cabinet 1.",
        "",
        "Your task is to: put a mug in sink.",
        "Your admissible actions of the current situation are: ['go to sink 1'",
        " 'look'",
        " 'inventory'].",
    ]
    assert lines[7] == "" and lines[8].startswith(CLOSING_ANCHOR) and prompt.count("Your task is to:") == 1
    assert "Prior to this step" not in prompt


@pytest.mark.parametrize("family", ["alfworld", "textworld"])
def test_later_steps_open_with_the_task_line_and_join_with_newline_space(family):
    prompt = build_prompt(family, "put a mug in sink", [(ALF_OBS0, "go to sink 1")], "You arrive at sink 1.",
                          ["take mug 1 from sink 1", "look"], history_length=5, step_count=1)
    lines = prompt.split("\n")
    assert lines[0].endswith(". Your task is to: put a mug in sink")
    assert lines[1] == ("Prior to this step, you have already taken 1 step(s). Below are the most recent 1 "
                        "observations and the corresponding actions you took:")
    assert "Your admissible actions of the current situation are: ['take mug 1 from sink 1'\n 'look']." in prompt


def test_textworld_step0_follows_alfworld():
    """TextWorld, our offline stand-in for ALFWorld, takes ALFWorld's step-0 rule: no task line of its own (its
    env ends the first observation with the task line, tests/envs/test_textworld.py)."""
    obs = "-= Cellar =-\nYou arrive in a cellar.\n\nYour task is to: Find the coin."
    prompt = build_prompt("textworld", "Find the coin.", [], obs, ["go west", "look"], history_length=5, step_count=0)
    assert prompt.startswith("You are an expert agent playing a TextWorld text adventure game.\n"
                             "Your current observation is: -= Cellar =-\nYou arrive in a cellar.\n\n"
                             "Your task is to: Find the coin.\n"
                             "Your admissible actions of the current situation are: ['go west'\n 'look'].\n\n"
                             "Now it's your turn to take an action.\n")


def test_webshop_and_search_closings_of_their_own():
    """WebShop's closing paragraph is its own (one action that best advances the shopping goal), Search-QA's too;
    both begin with the anchor. WebShop keeps its task line at step 0."""
    alf = build_prompt("alfworld", "t", [("o", "a")], "o", ["look"], 5, 1)
    web = build_prompt("webshop", "buy a red shirt", [], "WebShop [SEP] Search", ["search[<your query>]"], 2, 0)
    sea = build_prompt("search", "who?", [], "", [], 4, 0)
    closings = [p[p.index(CLOSING_ANCHOR):] for p in (alf, web, sea)]
    assert len(set(closings)) == 3
    assert "shopping goal" in closings[1] and "one" in closings[1].split("\n")[0]
    assert web.split("\n")[0].endswith("Your task is to: buy a red shirt")
    assert "<search>" in closings[2] and "<answer>" in closings[2]


def test_ours_template_relabelled():
    """Ours (env.template=ours, this project's earlier templates): the task line opens every prompt, step 0 too;
    actions joined by ", "; WebShop shares ALFWorld's closing."""
    prompt = build_prompt("alfworld", "put a mug in sink", [], ALF_OBS0, ["go to sink 1", "look"], 5, 0,
                          template="ours")
    assert prompt.split("\n")[0].endswith("Your task is to: put a mug in sink")
    assert "['go to sink 1', 'look']" in prompt
    web = build_prompt("webshop", "shirt", [], "page", ["click[a]"], 2, 0, template="ours")
    alf = build_prompt("alfworld", "shirt", [], "page", ["click[a]"], 5, 0, template="ours")
    assert web[web.index(CLOSING_ANCHOR):] == alf[alf.index(CLOSING_ANCHOR):]
    with pytest.raises(ValueError, match="unknown prompt template"):
        build_prompt("alfworld", "t", [], "o", [], 5, 0, template="mine")


def test_ours_template_is_the_text_before_the_switch():
    """The warm-start cache keeps the keys of warm starts built before env.template existed only for prompts that
    render exactly as then (opid_mega.sft.PROMPTS_BEFORE_TEMPLATES); Search-QA's template is the same in both."""
    from opid_mega.envs.prompts import template_fingerprint
    from opid_mega.sft import PROMPTS_BEFORE_TEMPLATES

    for family, fp in PROMPTS_BEFORE_TEMPLATES.items():
        assert template_fingerprint("ours", family) == fp
        assert (template_fingerprint("reference", family) == fp) == (family == "search_qa")


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
