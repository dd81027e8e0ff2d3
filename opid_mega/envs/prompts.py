"""Step prompt templates (verl-agent style), action projection and invalid-action detection (the reference's rules:
`project_action`).

Two template sets (`env.template`, the builders' `template=` argument):
  * "reference" (default): the shapes docs/algorithm.md "More reference facts" (Environment templates) describes.
    ALFWorld step 0 has no history and no task line of its own: ALFWorld's first observation ends with the task
    line ("Your task is to: ..."), so the episode skill lands mid-prompt, right before the admissible-actions line.
    TextWorld, our offline stand-in for ALFWorld, follows the same rule: its env ends the first observation with a
    "Your task is to: <objective>" line, as ALFWorld's game does; Footprints (the mechanism experiment's game) too.
    Later steps open with the intro and the task line. ALFWorld/TextWorld (and Footprints) admissible actions are
    quoted and joined by a newline and a space. WebShop has a closing paragraph of its own (one action that best
    advances the shopping goal), Search-QA too.
  * "ours" (what this project used before; the first CPU experiment ran with it): every prompt opens with the
    intro and the task line (step 0 too), ALFWorld/TextWorld actions are joined by ", ", and WebShop shares the
    ALFWorld closing paragraph.
The wording of the intro lines and closing paragraphs is this project's (the reference's text is not copied).

Contract with the skill layer (opid_mega.skills):
  * the task line holds "Your task is to:" (Search-QA: "Your question:"); the episode skill is inserted right
    after it (at ALFWorld/TextWorld step 0 under "reference", that is the last line of the first observation);
  * the closing instruction paragraph begins with CLOSING_ANCHOR ("Now it's your turn to"), at the start of its
    line, and is the first occurrence of that phrase in the template's own text (the step skill goes before it).

Every builder has the signature
    build(task_description, history, current_obs, admissible_actions, history_length, step_count,
          template="reference") -> str
where `history` is the list of ALL previous (observation, action) pairs of the episode, oldest first (the builder
keeps the last `history_length`), `current_obs` the observation to act on, and `step_count` the number of steps
already taken.
"""
from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

CLOSING_ANCHOR = "Now it's your turn to"
TEMPLATES = ("reference", "ours")
DEFAULT_TEMPLATE = "reference"

_ACTION_CLOSING = (
    "Now it's your turn to take an action.\n"
    "You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed "
    "within <think> </think> tags.\n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and present it "
    "within <action> </action> tags."
)

# WebShop's own closing ("reference"): one action, the one that best advances the shopping goal
_WEBSHOP_CLOSING = (
    "Now it's your turn to take the one next action that brings you closest to the shopping goal.\n"
    "You should first reason step-by-step about the current page and which admissible action best advances the "
    "purchase. This reasoning process MUST be enclosed within <think> </think> tags.\n"
    "Once you've finished your reasoning, choose exactly one admissible action for the current step and present it "
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

_AGENTS = {
    "alfworld": "You are an expert agent operating in the ALFRED Embodied Environment.",
    "textworld": "You are an expert agent playing a TextWorld text adventure game.",
    "webshop": "You are an expert autonomous agent operating in the WebShop e-commerce environment.",
    "search": "You are an expert agent answering a question step by step with a search engine.",
    "footprints": "You are an expert agent playing a text adventure game.",
}
_TASK_PHRASE = {"alfworld": "Your task is to:", "textworld": "Your task is to:", "webshop": "Your task is to:",
                "search": "Your question:", "footprints": "Your task is to:"}
# "reference": ALFWorld's step-0 template has no task line (the task ends the first observation); TextWorld follows
STEP0_WITHOUT_TASK_LINE = ("alfworld", "textworld", "footprints")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def task_line(family: str, task_description: str) -> str:
    """The intro line holding the task phrase (the episode skill goes right after it)."""
    return f"{_AGENTS[family]} {_TASK_PHRASE[family]} {_one_line(task_description)}"


def first_observation_task_line(task_description: str) -> str:
    """The line ALFWorld's first observation ends with, which TextWorld's env appends to its own."""
    return f"Your task is to: {_one_line(task_description)}"


def _check_template(template: str) -> None:
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; allowed: {', '.join(TEMPLATES)}")


def _window(history: Sequence[tuple[str, str]], history_length: int) -> tuple[int, list[tuple[str, str]]]:
    if history_length < 0:
        raise ValueError(f"history_length must be >= 0, got {history_length}")
    if history_length == 0:
        return len(history), []
    start = max(0, len(history) - history_length)
    return start, [tuple(h) for h in history[start:]]


def _actions(admissible_actions, family: str, template: str) -> str:
    if family == "webshop":  # one per line, inside brackets of their own
        acts = ",\n".join(f"'{a}'" for a in admissible_actions)
        return f"Your admissible actions of the current situation are:\n[\n{acts}\n]."
    sep = "\n " if template == "reference" else ", "
    acts = sep.join(f"'{a}'" for a in admissible_actions)
    return f"Your admissible actions of the current situation are: [{acts}]."


def _action_prompt(family: str, task_description: str, history, current_obs: str, admissible_actions,
                   history_length: int, step_count: int, template: str = DEFAULT_TEMPLATE) -> str:
    _check_template(template)
    start, window = _window(history, history_length)
    if template == "reference" and family in STEP0_WITHOUT_TASK_LINE and step_count == 0:
        lines = [_AGENTS[family]]  # the task line is the last line of the first observation
    else:
        lines = [task_line(family, task_description)]
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
    lines.append(_actions(admissible_actions, family, template))
    closing = _WEBSHOP_CLOSING if family == "webshop" and template == "reference" else _ACTION_CLOSING
    return "\n".join(lines) + "\n\n" + closing + "\n"


def build_alfworld_prompt(task_description, history, current_obs, admissible_actions, history_length, step_count,
                          template: str = DEFAULT_TEMPLATE):
    return _action_prompt("alfworld", task_description, history, current_obs, admissible_actions,
                          history_length, step_count, template)


def build_textworld_prompt(task_description, history, current_obs, admissible_actions, history_length, step_count,
                           template: str = DEFAULT_TEMPLATE):
    return _action_prompt("textworld", task_description, history, current_obs, admissible_actions,
                          history_length, step_count, template)


def build_webshop_prompt(task_description, history, current_obs, admissible_actions, history_length, step_count,
                         template: str = DEFAULT_TEMPLATE):
    return _action_prompt("webshop", task_description, history, current_obs, admissible_actions,
                          history_length, step_count, template)


def build_footprints_prompt(task_description, history, current_obs, admissible_actions, history_length, step_count,
                            template: str = DEFAULT_TEMPLATE):
    """Footprints (opid_mega.envs.footprints_env): TextWorld's template with an intro line of its own."""
    return _action_prompt("footprints", task_description, history, current_obs, admissible_actions,
                          history_length, step_count, template)


def build_search_prompt(task_description, history, current_obs, admissible_actions, history_length, step_count,
                        template: str = DEFAULT_TEMPLATE):
    """Search-QA: `admissible_actions` is ignored (free-form <search>/<answer>). The window shows each past action
    followed by the observation it produced (the next observation; the last one is `current_obs`). At step 0 there
    is no history and no observation line: the question is on the task line. Both template sets build the same
    Search-QA prompt."""
    _check_template(template)
    start, window = _window(history, history_length)
    lines = [task_line("search", task_description)]
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
    "footprints": build_footprints_prompt,
}


def get_prompt_builder(family: str) -> Callable[..., str]:
    try:
        return PROMPT_BUILDERS[family]
    except KeyError:
        raise ValueError(f"unknown prompt family {family!r}; known: {sorted(PROMPT_BUILDERS)}") from None


def build_prompt(family: str, task_description: str, history, current_obs: str, admissible_actions,
                 history_length: int, step_count: int, template: str = DEFAULT_TEMPLATE) -> str:
    return get_prompt_builder(family)(task_description, history, current_obs, admissible_actions,
                                      history_length, step_count, template=template)


def template_fingerprint(template: str = DEFAULT_TEMPLATE, family: Optional[str] = None) -> str:
    """A short hash of what the builders (of `family`, or all) render for fixed inputs under `template` (steps 0 and
    2): it changes whenever a template's text changes, so caches built from tokenized prompts (the warm start's key,
    opid_mega.sft.sft_key) follow the text."""
    import hashlib

    h = hashlib.sha256()
    for fam in ([family] if family else sorted(PROMPT_BUILDERS)):
        for steps in (0, 2):
            hist = [(f"o{i}", f"a{i}") for i in range(steps)]
            h.update(build_prompt(fam, "t", hist, "o", ["x", "y"], 5, steps, template).encode())
    return h.hexdigest()[:16]


# ---- parsing ---------------------------------------------------------------------------------------------------
# The reference's projection rules (verl-agent `alfworld_projection` / `webshop_projection` / `search_projection`,
# docs/algorithm.md "Reference rules in detail" -> "Invalid actions").
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


# The prompt history records, for a response without an action, the last characters of the lower-cased response
# (the reference's action projections: ALFWorld 30, WebShop 20; Search records "").
UNPARSED_HISTORY_CHARS = {"action": 30, "search": 0}


def history_action(response_text: Optional[str], action: Optional[str], tail_chars: int) -> str:
    """The action the prompt history records for a step: the projected `action` when there is one, else the last
    `tail_chars` characters of the lower-cased response ("" for tail_chars 0 or no response)."""
    if action is not None:
        return action
    if tail_chars < 0:
        raise ValueError(f"history_action: tail_chars must be >= 0, got {tail_chars}")
    if not response_text or tail_chars == 0:
        return ""
    return response_text.lower()[-tail_chars:]


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
