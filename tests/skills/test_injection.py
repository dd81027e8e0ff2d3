"""Skill sections and insertion points (OPID.md §5 and "Reference rules in detail": section text, episode-skill
location, empty skills). Expected strings are written out from the reference's rules; whitespace is kept (our
documented deviation), so the text before the insertion point stays byte-identical."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opid_mega.envs.prompts import build_prompt
from opid_mega.skills import (
    CLOSING_ANCHOR,
    inject_skill,
    inject_skills,
    insertion_point,
    insertion_points,
    render_skill_section,
    split_prompt,
)

PROMPT = ("You are an expert agent. Your task is to: heat some egg and put it in the garbagecan.\n\n"
          "Prior to this step, you have already taken 2 step(s). Below are the most recent 2 observations:\n"
          "[Observation 1: 'You arrive at the fridge.', Action 1: 'open fridge']\n\n"
          "You are now at step 3 and your current observation is: The fridge is open.\n"
          "Your admissible actions of the current situation are: ['take egg 1 from fridge 1', 'close fridge 1'].\n\n"
          "Now it's your turn to take an action.\nYou should first reason step-by-step ... <action> </action> tags.\n")

# The reference's section text (OPID.md, "Section text"), written out literally.
EP_SECTION = ("**Episode-Level Skill**\n"
              "Refer to this episode-level skill when deciding what action to take in the current episode:\n"
              "[Heat the egg before you put it.]\n\n")
ST_SECTION = ("**Critical-Step Skill**\n"
              "Use this current-step skill for this decision only:\n"
              "[Close the fridge now.]\n\n")
EP, ST = "Heat the egg before you put it.", "Close the fridge now."

CLOSING = ("Now it's your turn to take an action.\n"
           "You should first reason step-by-step about the current situation. This reasoning process MUST be "
           "enclosed within <think> </think> tags.\n")


def test_section_format_is_the_reference_text():
    assert render_skill_section("  Heat the egg before you put it.  ", "episode") == EP_SECTION
    assert render_skill_section("\tClose the fridge now.\n", "step") == ST_SECTION
    with pytest.raises(ValueError, match="kind"):
        render_skill_section("x", "task")
    with pytest.raises(TypeError, match="string"):
        render_skill_section(3, "step")


@pytest.mark.parametrize("empty", ["", " ", "\n\t  \n", None])
def test_empty_skill_adds_no_section(empty):
    assert render_skill_section(empty, "episode") == "" and render_skill_section(empty, "step") == ""
    for placement in ("faithful", "late"):
        assert inject_skill(PROMPT, empty, "episode", placement) == PROMPT
        assert inject_skill(PROMPT, empty, "step", placement) == PROMPT
        assert inject_skills(PROMPT, {"episode": empty, "step": empty}, placement) == PROMPT
    # an empty skill beside a real one: only the real one's section appears
    assert inject_skills(PROMPT, {"episode": empty, "step": ST}) == PROMPT.replace(
        "Now it's your turn", ST_SECTION + "Now it's your turn")
    # bad kind / placement are still errors with an empty skill
    with pytest.raises(ValueError, match="kind"):
        inject_skill(PROMPT, empty, "task")
    with pytest.raises(ValueError, match="placement"):
        inject_skill(PROMPT, empty, "episode", "early")


def test_faithful_positions():
    want_ep = PROMPT.replace("garbagecan.\n\n", "garbagecan.\n\n" + EP_SECTION)
    assert inject_skill(PROMPT, EP, "episode") == want_ep
    want_st = PROMPT.replace("Now it's your turn", ST_SECTION + "Now it's your turn")
    assert inject_skill(PROMPT, ST, "step") == want_st
    both = want_ep.replace("Now it's your turn", ST_SECTION + "Now it's your turn")
    assert inject_skills(PROMPT, {"step": ST, "episode": EP}, "faithful") == both
    head, middle, tail = split_prompt(PROMPT)
    assert head.endswith("garbagecan.\n\n") and tail.startswith(CLOSING_ANCHOR) and head + middle + tail == PROMPT


def test_late_puts_both_before_the_closing_paragraph_episode_first():
    want = PROMPT.replace("Now it's your turn", EP_SECTION + ST_SECTION + "Now it's your turn")
    assert inject_skills(PROMPT, {"step": ST, "episode": EP}, "late") == want


# --- episode-skill location (OPID.md: "Episode-skill location", "More reference facts": task-line choice and
# environment templates). The prompts here are the ones our env templates build (opid_mega/envs/prompts.py).

ALF_TASK = "put a clean mug in coffeemachine"
# ALFWorld's first observation as our env returns it (banner stripped): the task line is its last line
ALF_OBS0 = ("You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a coffeemachine 1, "
            "and a sinkbasin 1.\n\nYour task is to: put a clean mug in coffeemachine.")
ALF_CLOSING = ("Now it's your turn to take an action.\n"
               "You should first reason step-by-step about the current situation. This reasoning process MUST be "
               "enclosed within <think> </think> tags.\n"
               "Once you've finished your reasoning, you should choose an admissible action for current step and "
               "present it within <action> </action> tags.\n")


def test_alfworld_step0_task_line_inside_the_initial_observation():
    """The reference's ALFWorld step 0 (OPID.md "More reference facts", Environment templates): no history, no task
    line of its own; the task is the last line of ALFWorld's first observation, so the episode skill lands
    mid-prompt, right before the admissible-actions line (whose actions are joined by a newline and a space). The
    expected prompt and its sections are written out by hand."""
    prompt = build_prompt("alfworld", ALF_TASK, [], ALF_OBS0, ["go to cabinet 1", "go to coffeemachine 1", "look"],
                          history_length=5, step_count=0)
    head = ("You are an expert agent operating in the ALFRED Embodied Environment.\n"
            "Your current observation is: You are in the middle of a room. Looking quickly around you, you see a "
            "cabinet 1, a coffeemachine 1, and a sinkbasin 1.\n\n"
            "Your task is to: put a clean mug in coffeemachine.\n")
    actions = ("Your admissible actions of the current situation are: ['go to cabinet 1'\n 'go to coffeemachine 1'\n"
               " 'look'].\n\n")
    assert prompt == head + actions + ALF_CLOSING
    assert insertion_point(prompt, "episode") == len(head)
    assert insertion_point(prompt, "step") == len(head) + len(actions)
    assert inject_skill(prompt, EP, "episode") == head + EP_SECTION + actions + ALF_CLOSING
    assert inject_skills(prompt, {"episode": EP, "step": ST}) == head + EP_SECTION + actions + ST_SECTION + ALF_CLOSING


def test_alfworld_later_step_task_line_is_the_intro_line():
    """From step 1 on the prompt opens with the intro and its task line: the episode skill follows that line."""
    prompt = build_prompt("alfworld", ALF_TASK, [(ALF_OBS0, "go to cabinet 1")], "The cabinet 1 is closed.",
                          ["open cabinet 1", "look"], history_length=5, step_count=1)
    first = ("You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: put a clean mug "
             "in coffeemachine\n")
    assert prompt.startswith(first)
    assert insertion_point(prompt, "episode") == len(first)
    # the task line also appears in the history (the first observation): phrase priority still picks the first line
    # holding "Your task is to:", which is the intro
    assert prompt.count("Your task is to:") == 2
    assert inject_skill(prompt, EP, "episode") == first + EP_SECTION + prompt[len(first):]
    assert insertion_point(prompt, "step") == prompt.index("\n\nNow it's your turn to take an action.") + 2


def test_search_prompt_after_the_question_line():
    """Search-QA (our template, both template sets): the episode skill goes after the "Your question: ..." line and
    the blank line that ends it, the step skill before the closing paragraph."""
    prompt = build_prompt("search", "What is the capital of the country that borders Chad to the west?", [], "",
                          [], history_length=4, step_count=0)
    head = ("You are an expert agent answering a question step by step with a search engine. Your question: "
            "What is the capital of the country that borders Chad to the west?\n\n")
    assert prompt.startswith(head + "Now it's your turn to respond for the current step.\n")
    assert inject_skill(prompt, EP, "episode") == head + EP_SECTION + prompt[len(head):]
    assert inject_skill(prompt, ST, "step") == head + ST_SECTION + prompt[len(head):]


@pytest.mark.parametrize("phrase", ["Your task is to:", "Your current task is:", "Your task is:", "Your question:"])
def test_each_task_line_phrase(phrase):
    prompt = f"\nIntro line.\nSome context.\nGoal. {phrase} do the thing.\nMore context.\n\n{CLOSING}"
    want = f"\nIntro line.\nSome context.\nGoal. {phrase} do the thing.\n{EP_SECTION}More context.\n\n{CLOSING}"
    assert inject_skill(prompt, EP, "episode") == want


def test_phrase_priority_your_task_is_to_wins_anywhere():
    """OPID.md "More reference facts", task-line choice: a line with "Your task is to:" anywhere in the prompt wins
    over an earlier line with another phrase."""
    prompt = "Your question: who?\nobs: Your task is to: something else\nmore text\n\n" + CLOSING
    assert insertion_point(prompt, "episode") == len("Your question: who?\nobs: Your task is to: something else\n")
    # without it, the other phrases in their order: "Your current task is:" before "Your task is:" before
    # "Your question:", wherever they stand
    prompt = "Your question: q\nYour task is: b\nYour current task is: c\nend\n\n" + CLOSING
    assert insertion_point(prompt, "episode") == len("Your question: q\nYour task is: b\nYour current task is: c\n")
    prompt = "Your question: q\nYour task is: b\nend\n\n" + CLOSING
    assert insertion_point(prompt, "episode") == len("Your question: q\nYour task is: b\n")
    prompt = "intro\nYour question: q\nend\n\n" + CLOSING
    assert insertion_point(prompt, "episode") == len("intro\nYour question: q\n")


def test_task_phrase_needs_a_word_boundary():
    prompt = "XYour task is to: not a task line\nYour task is: the task\nrest\n"
    assert insertion_point(prompt, "episode") == len("XYour task is to: not a task line\nYour task is: the task\n")


def test_task_text_on_the_next_line_is_part_of_the_match():
    """`^.*\\bYour task is to:\\s*.*` — `\\s*` crosses the line break when the phrase ends its line."""
    prompt = "\nYour task is to:\nput a mug in the sink.\nobservation\n\n" + CLOSING
    assert insertion_point(prompt, "episode") == len("\nYour task is to:\nput a mug in the sink.\n")


def test_no_task_line_goes_before_the_closing_paragraph():
    prompt = "\nYou are an agent.\nYou see a room.\n\n" + CLOSING
    want = "\nYou are an agent.\nYou see a room.\n\n" + EP_SECTION + ST_SECTION + CLOSING
    assert inject_skill(prompt, EP, "episode") == prompt.replace(CLOSING, EP_SECTION + CLOSING)
    assert inject_skills(prompt, {"step": ST, "episode": EP}) == want  # same point: episode first
    assert split_prompt(prompt) == ("\nYou are an agent.\nYou see a room.\n\n", "", CLOSING)


def test_neither_anchor_appends_at_the_end():
    prompt = "Task: find the coin.\nYou see a room.\n"
    assert inject_skill(prompt, EP, "episode") == prompt + EP_SECTION
    assert inject_skill(prompt, ST, "step") == prompt + ST_SECTION
    assert inject_skills(prompt, {"episode": EP, "step": ST}) == prompt + EP_SECTION + ST_SECTION
    assert split_prompt(prompt) == (prompt, "", "")
    assert inject_skill("", EP, "episode") == EP_SECTION


def test_closing_anchor_is_the_first_occurrence():
    """The step point is the FIRST occurrence of "Now it's your turn to" (OPID.md "More reference facts"), also
    inside a line; a bare "Now it's your turn" without "to" is no anchor."""
    p = ("Your task is to: x\nsay \"Now it's your turn\" and \"Now it's your turn to\" later\n"
         "Now it's your turn to act.\n")
    assert insertion_point(p, "step") == p.index("Now it's your turn to")
    assert split_prompt(p)[2] == "Now it's your turn to\" later\nNow it's your turn to act.\n"


def test_task_line_after_the_anchor():
    """Both points are found independently: a task line after the first anchor (no template of ours builds one)
    puts the episode point after the step point, and both sections go where each rule says."""
    p = "Obs: Now it's your turn to move.\nYour task is to: find x\nrest\n"
    ep, st = len("Obs: Now it's your turn to move.\nYour task is to: find x\n"), len("Obs: ")
    assert insertion_points(p) == (ep, st)
    assert split_prompt(p) == (p[:st], p[st:ep], p[ep:])
    assert inject_skills(p, {"episode": EP, "step": ST}) == p[:st] + ST_SECTION + p[st:ep] + EP_SECTION + p[ep:]


def test_bad_arguments():
    with pytest.raises(ValueError, match="placement"):
        inject_skill(PROMPT, ST, "step", placement="early")
    with pytest.raises(ValueError, match="placement"):
        insertion_point(PROMPT, "step", placement="early")
    with pytest.raises(TypeError, match="prompt"):
        inject_skill(None, ST, "step")


TASK = "put a clean mug in coffeemachine"
OBS0 = f"You are in the middle of a room.\n\nYour task is to: {TASK}."  # an ALFWorld-shaped first observation


@pytest.mark.parametrize("family", ["alfworld", "textworld", "webshop", "search"])
@pytest.mark.parametrize("steps", [0, 3])
@pytest.mark.parametrize("template", ["reference", "ours"])
def test_real_env_templates(family, steps, template):
    """Every env template and step: the episode skill goes after the line the rules name — under "reference" at
    ALFWorld/TextWorld step 0 the first observation's last line "Your task is to: ...", else the intro line (the
    first line) — the step skill before the closing paragraph, the first "Now it's your turn to"."""
    hist = [(OBS0 if i == 0 else f"obs {i}", f"go to cabinet {i}") for i in range(steps)]
    obs = OBS0 if steps == 0 else "On the cabinet 1, you see a mug 1."
    prompt = build_prompt(family, TASK, hist, obs, ["look", "inventory"], history_length=5, step_count=steps,
                          template=template)
    lines = prompt.split("\n")
    if template == "reference" and family in ("alfworld", "textworld") and steps == 0:
        k = lines.index(f"Your task is to: {TASK}.")
        assert k == 3 and lines[4].startswith("Your admissible actions")  # mid-prompt, before the actions line
    else:
        k = 0
        assert lines[0].endswith(("Your question: " if family == "search" else "Your task is to: ") + TASK)
    ep = sum(len(ln) + 1 for ln in lines[:k + 1])
    while prompt[ep] == "\n":  # blank lines after the task line stay above the section
        ep += 1
    assert inject_skill(prompt, EP, "episode") == prompt[:ep] + EP_SECTION + prompt[ep:]
    at = prompt.index("\n\nNow it's your turn to") + 2
    assert prompt.find(CLOSING_ANCHOR) == at
    assert inject_skill(prompt, ST, "step") == prompt[:at] + ST_SECTION + prompt[at:]
    assert inject_skill(prompt, EP, "episode", "late") == prompt[:at] + EP_SECTION + prompt[at:]


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.sampled_from(list("ab \n") + ["Now it's your turn", " to", "Your task is to:",
                                                        "Your question:", "Your task is:", "Task"]),
                       max_size=30).map("".join),
       kinds=st.sets(st.sampled_from(["episode", "step"]), min_size=1), placement=st.sampled_from(["faithful", "late"]))
def test_injection_preserves_text_before_and_after(prompt, kinds, placement):
    skills = {k: f"skill for {k}" for k in kinds}
    out = inject_skills(prompt, skills, placement)
    head, middle, tail = split_prompt(prompt)
    assert head + middle + tail == prompt
    first = min(insertion_point(prompt, k, placement) for k in kinds)
    last = max(insertion_point(prompt, k, placement) for k in kinds)
    assert out.startswith(prompt[:first]) and out.endswith(prompt[last:])
    assert len(out) == len(prompt) + sum(len(render_skill_section(s, k)) for k, s in skills.items())
    removed = out
    for k, s in skills.items():
        removed = removed.replace(render_skill_section(s, k), "", 1)
    assert removed == prompt


# --- token level: the fork scorer splices section ids at the PromptTokenizer's insertion indices ---------------

TOKEN_PROMPTS = {
    "alfworld_step0": build_prompt("alfworld", TASK, [], OBS0, ["go to cabinet 1", "look"], 5, 0),
    "alfworld_step3": build_prompt("alfworld", TASK, [(OBS0, "look"), ("o1", "look"), ("o2", "look")], "o3",
                                   ["go to cabinet 1", "look"], 5, 3),
    "webshop_step0": build_prompt("webshop", "a red shirt under 20 dollars", [], "WebShop [SEP] Search",
                                  ["search[<your query>]"], 2, 0),
    "search": build_prompt("search", "Which river flows through Paris?", [], "", [], 4, 0),
    "no_task_line": "You are an agent.\nYou see a room.\n\n" + CLOSING,
    "neither": "You are an agent.\nYou see a room.\n",
    # (an anchor at a line start: a mid-line point splits a token differently in text and in ids)
    "task_line_after_the_anchor": "Obs:\nNow it's your turn to move.\nYour task is to: find x\nrest\n",
    "generic": PROMPT,
}


@pytest.fixture(scope="module")
def prompt_tokenizer():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from opid_mega.models import qwen_tokenizer_dir
    from opid_mega.rollout.agent_loop import PromptTokenizer

    return PromptTokenizer(AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir())))


@pytest.mark.parametrize("name", sorted(TOKEN_PROMPTS))
def test_text_insertion_matches_the_token_split(prompt_tokenizer, name):
    """encode(inject(prompt)) == ids[:insert_at] + ids(section) + ids[insert_at:] for every insertion point, and
    the token split points decode to the text split points."""
    pt, prompt = prompt_tokenizer, TOKEN_PROMPTS[name]
    ids, ep, st = pt.encode(prompt)
    ep_text, st_text = insertion_points(prompt)
    tok = pt.tokenizer
    assert tok.decode(ids[:ep]) == pt.template_head + prompt[:ep_text]
    assert tok.decode(ids[:st]) == pt.template_head + prompt[:st_text]
    assert (ep > st) == (name == "task_line_after_the_anchor")
    if name in ("no_task_line", "neither"):
        assert ep == st
    for kind, placement, at in (("episode", "faithful", ep), ("step", "faithful", st), ("episode", "late", st)):
        skill = EP if kind == "episode" else ST
        injected, _, _ = pt.encode(inject_skill(prompt, skill, kind, placement))
        assert injected == ids[:at] + pt.encode_text(render_skill_section(skill, kind)) + ids[at:], (kind, placement)
