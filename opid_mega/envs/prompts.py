"""Step prompt templates (verl-agent style), action projection and invalid-action detection (the reference's rules:
`project_action`).

Contract with the skill layer (opid_mega.skills):
  * the FIRST LINE of every prompt is the task line (the episode skill is inserted right after it);
  * the closing instruction paragraph starts at a line beginning with "Now it's your turn" (the step skill is
    inserted right before it).

Every builder has the signature
    build(task_description, history, current_obs, admissible_actions, history_length, step_count) -> str
where `history` is the list of ALL previous (observation, action) pairs of the episode, oldest first (the builder
keeps the last `history_length`), `current_obs` the observation to act on, and `step_count` the number of steps
already taken.
"""
from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

CLOSING_ANCHOR = "Now it's your turn"

_ACTION_CLOSING = (
    "Now it's your turn to take an action.\n"
    "You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed "
    "within <think> </think> tags.\n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and present it "
    "within <action> </action> tags."
)

_SEARCH_CLOSING = (
    "Now it's your turn to respond for the current step.\n"
    "You should first reason step-by-step. This reasoning process MUST be enclosed within <think> </think> tags.\n"
    "After your reasoning, do exactly one of the following:\n"
    "(1) if some knowledge is missing or uncertain, call the search engine with <search> your query </search>;\n"
    "(2) if you can answer with confidence, give the final answer within <answer> </answer> tags. "
    "The answer should be short, e.g. <answer> Beijing </answer>."
)

_INTROS = {
    "alfworld": "You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {task}",
    "textworld": "You are an expert agent playing a TextWorld text adventure game. Your task is to: {task}",
    "webshop": "You are an expert autonomous agent operating in the WebShop e-commerce environment. "
               "Your task is to: {task}",
    "search": "You are an expert agent answering a question step by step with a search engine. "
              "Your question: {task}",
}


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _window(history: Sequence[tuple[str, str]], history_length: int) -> tuple[int, list[tuple[str, str]]]:
    if history_length < 0:
        raise ValueError(f"history_length must be >= 0, got {history_length}")
    if history_length == 0:
        return len(history), []
    start = max(0, len(history) - history_length)
    return start, [tuple(h) for h in history[start:]]


def _action_prompt(family: str, task_description: str, history, current_obs: str, admissible_actions,
                   history_length: int, step_count: int, one_per_line: bool = False) -> str:
    start, window = _window(history, history_length)
    lines = [_INTROS[family].format(task=_one_line(task_description))]
    if window:
        lines.append(
            f"Prior to this step, you have already taken {step_count} step(s). Below are the most recent "
            f"{len(window)} observations and the corresponding actions you took:")
        for j, (obs, action) in enumerate(window):
            k = start + j + 1
            lines.append(f"[Observation {k}: '{obs.strip()}', Action {k}: '{action.strip()}']")
        lines.append(f"You are now at step {step_count + 1} and your current observation is: {current_obs.strip()}")
    else:
        lines.append(f"Your current observation is: {current_obs.strip()}")
    if one_per_line:
        acts = ",\n".join(f"'{a}'" for a in admissible_actions)
        lines.append(f"Your admissible actions of the current situation are:\n[\n{acts}\n].")
    else:
        acts = ", ".join(f"'{a}'" for a in admissible_actions)
        lines.append(f"Your admissible actions of the current situation are: [{acts}].")
    return "\n".join(lines) + "\n\n" + _ACTION_CLOSING + "\n"


def build_alfworld_prompt(task_description, history, current_obs, admissible_actions, history_length, step_count):
    return _action_prompt("alfworld", task_description, history, current_obs, admissible_actions,
                          history_length, step_count)


def build_textworld_prompt(task_description, history, current_obs, admissible_actions, history_length, step_count):
    return _action_prompt("textworld", task_description, history, current_obs, admissible_actions,
                          history_length, step_count)


def build_webshop_prompt(task_description, history, current_obs, admissible_actions, history_length, step_count):
    return _action_prompt("webshop", task_description, history, current_obs, admissible_actions,
                          history_length, step_count, one_per_line=True)


def build_search_prompt(task_description, history, current_obs, admissible_actions, history_length, step_count):
    """Search-QA: `admissible_actions` is ignored (free-form <search>/<answer>). The window shows each past action
    followed by the observation it produced (the next observation; the last one is `current_obs`). At step 0 there
    is no history and no observation line: the question is on the task line."""
    start, window = _window(history, history_length)
    lines = [_INTROS["search"].format(task=_one_line(task_description))]
    if window:
        lines.append(
            f"Prior to this step, you have already taken {step_count} step(s). Below is the recent interaction "
            "history: <search> </search> wraps your past queries and <information> </information> the results "
            "returned by the search engine.")
        for j, (_obs, action) in enumerate(window):
            i = start + j
            result = history[i + 1][0] if i + 1 < len(history) else current_obs
            lines.append(f"[Step {i + 1}] {action.strip()}")
            lines.append(str(result).strip())
    elif step_count > 0 and current_obs and current_obs.strip():
        lines.append(f"Current observation: {current_obs.strip()}")
    return "\n".join(lines) + "\n\n" + _SEARCH_CLOSING + "\n"


PROMPT_BUILDERS: dict[str, Callable[..., str]] = {
    "alfworld": build_alfworld_prompt,
    "textworld": build_textworld_prompt,
    "webshop": build_webshop_prompt,
    "search": build_search_prompt,
    "search_qa": build_search_prompt,
}


def get_prompt_builder(family: str) -> Callable[..., str]:
    try:
        return PROMPT_BUILDERS[family]
    except KeyError:
        raise ValueError(f"unknown prompt family {family!r}; known: {sorted(PROMPT_BUILDERS)}") from None


def build_prompt(family: str, task_description: str, history, current_obs: str, admissible_actions,
                 history_length: int, step_count: int) -> str:
    return get_prompt_builder(family)(task_description, history, current_obs, admissible_actions,
                                      history_length, step_count)


# ---- parsing ---------------------------------------------------------------------------------------------------
# The reference's projection rules (verl-agent `alfworld_projection` / `webshop_projection` / `search_projection`,
# OPID.md "Reference rules in detail" -> "Invalid actions").
_CHINESE_RE = re.compile(r"[\u4e00-\u9fff]")
_SEARCH_BLOCK_RE = re.compile(r"<search>(.*?)</search>", re.DOTALL | re.IGNORECASE)
_ANSWER_BLOCK_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_SEARCH_TAG_RE = re.compile(r"<search>", re.IGNORECASE)
_ANSWER_TAG_RE = re.compile(r"<answer>", re.IGNORECASE)
_SEARCH_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL | re.IGNORECASE)
ACTION_FAMILIES = ("action", "alfworld", "textworld", "webshop")
SEARCH_FAMILIES = ("search", "search_qa")


def project_action(response_text: Optional[str], family: str = "action") -> tuple[Optional[str], bool]:
    """(action to execute or None, valid) for a policy response, by the reference's rules.

    family "action" (ALFWorld, TextWorld, WebShop): the text between the FIRST `<action>` and the FIRST
    `</action>` (tags matched case-insensitively), lower-cased, stripped (and whitespace-collapsed here, which the
    games ignore anyway); None when either tag is missing. valid = both action tags found AND `<think>` and
    `</think>` both present (case-sensitive, as the reference) AND no Chinese character (U+4E00..U+9FFF) anywhere in
    the response. An extracted action is executed even when the response is invalid (the reference does the same;
    the step is penalised); an empty `<action></action>` is valid, as in the reference (the env answers it with its
    no-op).
    family "search": the response is cut after the first `</search>` (else after the first `</answer>`); the first
    `<search>q</search>` block of that, else the first `<answer>a</answer>` block, returned as
    "<search>q</search>" / "<answer>a</answer>" (content stripped, whitespace-collapsed); None when there is none.
    valid = a block was found AND the response does not hold both a `<search>` and an `<answer>` tag AND not more
    than one of either.
    Never raises on any string (None -> (None, False)).
    """
    if response_text is None:
        return None, False
    if not isinstance(response_text, str):
        raise TypeError(f"parse_action expects a str, got {type(response_text).__name__}")
    if family in ACTION_FAMILIES:
        lower = response_text.lower()
        start, end = lower.find("<action>"), lower.find("</action>")
        if start == -1 or end == -1:
            return None, False
        action = _one_line(lower[start + len("<action>"):end])  # empty when </action> comes first, as the reference
        valid = ("<think>" in response_text and "</think>" in response_text
                 and not _CHINESE_RE.search(response_text))
        return action, valid
    if family in SEARCH_FAMILIES:
        trimmed = response_text
        if "</search>" in trimmed:
            trimmed = trimmed.split("</search>", 1)[0] + "</search>"
        elif "</answer>" in trimmed:
            trimmed = trimmed.split("</answer>", 1)[0] + "</answer>"
        m = _SEARCH_BLOCK_RE.search(trimmed)
        if m:
            action = f"<search>{_one_line(m.group(1))}</search>"
        else:
            m = _ANSWER_BLOCK_RE.search(trimmed)
            if not m:
                return None, False
            action = f"<answer>{_one_line(m.group(1))}</answer>"
        n_search = len(_SEARCH_TAG_RE.findall(response_text))
        n_answer = len(_ANSWER_TAG_RE.findall(response_text))
        valid = not (n_search and n_answer) and n_search <= 1 and n_answer <= 1
        return action, valid
    raise ValueError(f"unknown parse family {family!r}; expected 'action' or 'search'")


def parse_action(response_text: Optional[str], family: str = "action") -> Optional[str]:
    """The action of a VALID response (see `project_action`), else None."""
    action, valid = project_action(response_text, family)
    return action if valid else None


def format_response(action: str, think: str = "", family: str = "action") -> str:
    """A well-formed policy response for `action` (supervised warm start, tests): <think>..</think> + the action
    tag. For family "search", `action` is already "<search>..</search>" or "<answer>..</answer>"."""
    think_part = f"<think>{think.strip()}</think>\n"
    if family in SEARCH_FAMILIES:
        if not _SEARCH_RE.fullmatch(action.strip()):
            raise ValueError(f"search action must be <search>..</search> or <answer>..</answer>, got {action!r}")
        return think_part + action.strip()
    return think_part + f"<action>{action.strip()}</action>"
