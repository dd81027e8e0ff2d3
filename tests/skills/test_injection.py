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


# --- episode-skill location (OPID.md: "Episode-skill location") ------------------------------------------------

def test_reference_template_beginning_with_a_newline():
    """Reference templates begin and end with a newline: the first line is empty, the task line is the second."""
    prompt = ("\nYou are an expert agent operating in the ALFRED Embodied Environment. Your task is to: put a clean "
              "mug in coffeemachine.\nPrior to this step, you have already taken 1 step(s). Below are the most recent "
              "1 observations and the corresponding actions you took: [Observation 1: 'You are in the middle of a "
              "room.', Action 1: 'go to countertop 1']\nYou are now at step 2 and your current observation is: On "
              "the countertop 1, you see a mug 1.\nYour admissible actions of the current situation are: ['take mug "
              "1 from countertop 1', 'look'].\n\n" + CLOSING)
    want = prompt.replace("in coffeemachine.\n", "in coffeemachine.\n" + EP_SECTION, 1)
    assert inject_skill(prompt, EP, "episode") == want
    assert want.startswith("\nYou are an expert agent")  # the leading newline is kept
    assert insertion_point(prompt, "step") == prompt.index("Now it's your turn")


def test_alfworld_step0_task_line_inside_the_initial_observation():
    """ALFWorld step 0: the task line is the last line of ALFWorld's initial observation, so the episode skill
    lands mid-prompt, right before the admissible-actions line."""
    prompt = ("\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
              "Your current observation is: -= Welcome to TextWorld, ALFRED! =-\n\n"
              "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a coffeemachine 1, "
              "and a sinkbasin 1.\n\n"
              "Your task is to: put a clean mug in coffeemachine.\n"
              "Your admissible actions of the current situation are: ['go to cabinet 1', 'go to coffeemachine 1', "
              "'inventory', 'look'].\n\n" + CLOSING)
    want = ("\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
            "Your current observation is: -= Welcome to TextWorld, ALFRED! =-\n\n"
            "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a coffeemachine 1, "
            "and a sinkbasin 1.\n\n"
            "Your task is to: put a clean mug in coffeemachine.\n"
            + EP_SECTION +
            "Your admissible actions of the current situation are: ['go to cabinet 1', 'go to coffeemachine 1', "
            "'inventory', 'look'].\n\n" + CLOSING)
    assert inject_skill(prompt, EP, "episode") == want
    assert inject_skills(prompt, {"episode": EP, "step": ST}) == want.replace(
        "Now it's your turn", ST_SECTION + "Now it's your turn")


def test_search_prompt_after_the_question_line():
    prompt = ("\nYou are an expert agent answering a question step by step with a search engine. Your question: "
              "What is the capital of the country that borders Chad to the west?\n\n" +
              "Now it's your turn to respond for the current step.\nYou should first reason step-by-step.\n")
    want = prompt.replace("to the west?\n\n", "to the west?\n\n" + EP_SECTION)
    assert inject_skill(prompt, EP, "episode") == want


@pytest.mark.parametrize("phrase", ["Your task is to:", "Your current task is:", "Your task is:", "Your question:"])
def test_each_task_line_phrase(phrase):
    prompt = f"\nIntro line.\nSome context.\nGoal. {phrase} do the thing.\nMore context.\n\n{CLOSING}"
    want = f"\nIntro line.\nSome context.\nGoal. {phrase} do the thing.\n{EP_SECTION}More context.\n\n{CLOSING}"
    assert inject_skill(prompt, EP, "episode") == want


def test_first_matching_line_wins_whatever_its_phrase():
    prompt = ("Your question: who?\nobs: Your task is to: something else\n\n" + CLOSING)
    assert insertion_point(prompt, "episode") == len("Your question: who?\n")


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


def test_anchor_only_counts_at_line_start():
    p = "Your task is to: x\nsay \"Now it's your turn\" later\nNow it's your turn to act.\n"
    assert split_prompt(p)[2] == "Now it's your turn to act.\n"


def test_bad_arguments():
    with pytest.raises(ValueError, match="placement"):
        inject_skill(PROMPT, ST, "step", placement="early")
    with pytest.raises(ValueError, match="placement"):
        insertion_point(PROMPT, "step", placement="early")
    with pytest.raises(TypeError, match="prompt"):
        inject_skill(None, ST, "step")


TASK = "put a clean mug in coffeemachine"
WELCOME = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room.\n\n"
           f"Your task is to: {TASK}.")


@pytest.mark.parametrize("family", ["alfworld", "textworld", "webshop", "search"])
@pytest.mark.parametrize("lead", ["", "\n"])
@pytest.mark.parametrize("steps", [0, 3])
def test_real_env_templates(family, lead, steps):
    """Our templates (opid_mega/envs/prompts.py), also with the reference's leading newline: the episode skill
    goes right after the intro line holding the task phrase (also when the step-0 observation repeats the task
    line), the step skill right before "Now it's your turn"."""
    hist = [(WELCOME if i == 0 else f"obs {i}", f"<action>go to cabinet {i}</action>") for i in range(steps)]
    obs = WELCOME if steps == 0 else "On the cabinet 1, you see a mug 1."
    prompt = lead + build_prompt(family, TASK, hist, obs, ["look", "inventory"], history_length=5,
                                 step_count=steps)
    phrases = ("Your task is to: ", "Your current task is: ", "Your task is: ", "Your question: ")
    first = min(prompt.index(p) for p in phrases if p in prompt)  # the first line holding a task phrase
    assert prompt[first:].startswith(("Your question: " if family == "search" else "Your task is to: ") + TASK)
    task_line_end = prompt.index("\n", first) + 1
    while prompt[task_line_end] == "\n":  # blank lines after the task line stay above the section
        task_line_end += 1
    assert inject_skill(prompt, EP, "episode") == prompt[:task_line_end] + EP_SECTION + prompt[task_line_end:]
    at = prompt.index("\nNow it's your turn") + 1
    assert inject_skill(prompt, ST, "step") == prompt[:at] + ST_SECTION + prompt[at:]
    assert inject_skill(prompt, EP, "episode", "late") == prompt[:at] + EP_SECTION + prompt[at:]


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.sampled_from(list("ab \n") + ["Now it's your turn", "Your task is to:", "Your question:",
                                                        "Task"]), max_size=30).map("".join),
       kinds=st.sets(st.sampled_from(["episode", "step"]), min_size=1), placement=st.sampled_from(["faithful", "late"]))
def test_injection_preserves_text_before_and_after(prompt, kinds, placement):
    skills = {k: f"skill for {k}" for k in kinds}
    out = inject_skills(prompt, skills, placement)
    head, middle, tail = split_prompt(prompt)
    assert head + middle + tail == prompt
    first = min(insertion_point(prompt, k, placement) for k in kinds)
    last = max(insertion_point(prompt, k, placement) for k in kinds)
    assert insertion_point(prompt, "episode", placement) <= insertion_point(prompt, "step", placement)
    assert out.startswith(prompt[:first]) and out.endswith(prompt[last:])
    assert len(out) == len(prompt) + sum(len(render_skill_section(s, k)) for k, s in skills.items())
    removed = out
    for k, s in skills.items():
        removed = removed.replace(render_skill_section(s, k), "", 1)
    assert removed == prompt


# --- token level: the fork scorer splices section ids at the PromptTokenizer's insertion indices ---------------

TOKEN_PROMPTS = {
    "reference_alfworld_step0": (
        "\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
        "Your current observation is: -= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room.\n\n"
        "Your task is to: put a clean mug in coffeemachine.\n"
        "Your admissible actions of the current situation are: ['go to cabinet 1', 'look'].\n\n" + CLOSING),
    "search": ("\nYou are an expert agent answering a question step by step with a search engine. Your question: "
               "Which river flows through Paris?\n\nNow it's your turn to respond for the current step.\nThink.\n"),
    "no_task_line": "\nYou are an agent.\nYou see a room.\n\n" + CLOSING,
    "neither": "You are an agent.\nYou see a room.\n",
    "ours": PROMPT,
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
    head, middle, _ = split_prompt(prompt)
    tok = pt.tokenizer
    assert tok.decode(ids[:ep]) == pt.template_head + head
    assert tok.decode(ids[:st]) == pt.template_head + head + middle
    if name in ("no_task_line", "neither"):
        assert ep == st
    for kind, placement, at in (("episode", "faithful", ep), ("step", "faithful", st), ("episode", "late", st)):
        skill = EP if kind == "episode" else ST
        injected, _, _ = pt.encode(inject_skill(prompt, skill, kind, placement))
        assert injected == ids[:at] + pt.encode_text(render_skill_section(skill, kind)) + ids[at:], (kind, placement)
