r"""Skill sections and where they go in a step-sample prompt (docs/algorithm.md §5, "Reference rules in detail" and
"More reference facts": task-line choice).

A prompt has two insertion points, found independently (as the reference does):
  * the episode point: right after the task line, chosen by PHRASE PRIORITY: the first line matching
    `^.*\bYour task is to:\s*.*` anywhere in the prompt; only when no line holds that phrase, the first line
    matching the same pattern with "Your current task is:", then "Your task is:", then "Your question:". The
    section starts after that line and any blank lines that follow it. With no task line at all: the step point;
  * the step point: the FIRST occurrence of "Now it's your turn to" in the prompt (CLOSING_ANCHOR; every closing
    paragraph of opid_mega.envs.prompts begins with it, at the start of its line); failing that, the end.
Inserting a section at one of those points leaves the text before it byte-identical, so the original and the skill
context share every token up to the insertion point (whitespace is kept, unlike the reference code, which strips
it). An empty or whitespace-only skill gives no section: the prompt comes back unchanged.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

from opid_mega.algo.routing import EPISODE, STEP

CLOSING_ANCHOR = "Now it's your turn to"
PLACEMENTS = ("faithful", "late")
TASK_LINE_PATTERNS = (
    r"^.*\bYour task is to:\s*.*",
    r"^.*\bYour current task is:\s*.*",
    r"^.*\bYour task is:\s*.*",
    r"^.*\bYour question:\s*.*",
)
# in priority order: a later phrase is tried only when no line holds an earlier one
_TASK_LINES = tuple(re.compile(p, re.M) for p in TASK_LINE_PATTERNS)

SECTION_TITLES = {EPISODE: "**Episode-Level Skill**", STEP: "**Critical-Step Skill**"}
SECTION_INSTRUCTIONS = {
    EPISODE: "Refer to this episode-level skill when deciding what action to take in the current episode:",
    STEP: "Use this current-step skill for this decision only:",
}


def _skill_text(skill: Optional[str], where: str) -> str:
    if skill is None:
        return ""
    if not isinstance(skill, str):
        raise TypeError(f"{where}: the skill must be a string, got {type(skill).__name__}")
    return skill.strip()


def render_skill_section(skill: Optional[str], kind: str) -> str:
    """`title / instruction / [skill]` followed by a blank line; it is inserted at the start of a line.
    An empty / whitespace-only skill (or None) renders as "" (no section)."""
    if kind not in SECTION_TITLES:
        raise ValueError(f"render_skill_section: kind={kind!r}, allowed: {', '.join(SECTION_TITLES)}")
    skill = _skill_text(skill, "render_skill_section")
    if not skill:
        return ""
    return f"{SECTION_TITLES[kind]}\n{SECTION_INSTRUCTIONS[kind]}\n[{skill}]\n\n"


def closing_point(prompt: str) -> int:
    """Offset of the first occurrence of CLOSING_ANCHOR ("Now it's your turn to") in the prompt, or len(prompt)."""
    pos = prompt.find(CLOSING_ANCHOR)
    return len(prompt) if pos < 0 else pos


def task_line_end(prompt: str) -> Optional[int]:
    """Offset right after the task line chosen by phrase priority (TASK_LINE_PATTERNS in order), or None."""
    for pattern in _TASK_LINES:
        m = pattern.search(prompt)
        if m is not None:
            return m.end()
    return None


def insertion_points(prompt: str) -> tuple[int, int]:
    """(episode point, step point) of the faithful placement (see the module docstring). The episode point is
    after the step point only in a prompt whose task line comes after its first "Now it's your turn to" (none of
    our templates; an observation quoting the phrase could do it), as in the reference."""
    st = closing_point(prompt)
    ep = task_line_end(prompt)
    if ep is None:
        return st, st
    while ep < len(prompt) and prompt[ep] == "\n":  # the line break ending the task line, then blank lines
        ep += 1
    return ep, st


def split_prompt(prompt: str) -> tuple[str, str, str]:
    """(head, middle, tail) cut at the two insertion points, the earlier one first: head + middle + tail == prompt.
    For every prompt our templates build, head ends at the episode point and tail starts at the step point; middle
    is "" when the prompt has no task line."""
    a, b = sorted(insertion_points(prompt))
    return prompt[:a], prompt[a:b], prompt[b:]


def anchor(kind: str, placement: str = "faithful") -> int:
    """Which of a prompt's two insertion points a skill section of `kind` goes to: 0, the episode point (after the
    task line), for an episode skill placed faithfully; 1, the step point (before "Now it's your turn"), otherwise.
    The one rule for prompt text (insertion_point) and prompt tokens (the rollout's episode/step insert_at)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"insertion_point: placement={placement!r}, allowed: {', '.join(PLACEMENTS)}")
    if kind not in SECTION_TITLES:
        raise ValueError(f"insertion_point: kind={kind!r}, allowed: {', '.join(SECTION_TITLES)}")
    return 0 if kind == EPISODE and placement == "faithful" else 1


def insertion_point(prompt: str, kind: str, placement: str = "faithful") -> int:
    """Character offset where a skill section of `kind` goes."""
    return insertion_points(prompt)[anchor(kind, placement)]


def inject_skills(prompt: str, skills: Mapping[str, Optional[str]], placement: str = "faithful") -> str:
    """Insert one section per (kind, skill); at a shared point the episode section comes before the step one.
    Empty / whitespace-only skills add nothing."""
    if not isinstance(prompt, str):
        raise TypeError(f"inject_skills: the prompt must be a string, got {type(prompt).__name__}")
    if placement not in PLACEMENTS:
        raise ValueError(f"inject_skills: placement={placement!r}, allowed: {', '.join(PLACEMENTS)}")
    for kind in skills:
        if kind not in SECTION_TITLES:
            raise ValueError(f"inject_skills: kind={kind!r}, allowed: {', '.join(SECTION_TITLES)}")
    skills = {k: v for k, v in skills.items() if _skill_text(v, "inject_skills")}
    out = prompt
    # Insert from the rightmost point leftwards so earlier offsets stay valid; for equal offsets insert the step
    # section first so that the episode section ends up in front of it.
    order = sorted(skills.items(), key=lambda kv: (-insertion_point(prompt, kv[0], placement), kv[0] != STEP))
    for kind, skill in order:
        at = insertion_point(prompt, kind, placement)
        out = out[:at] + render_skill_section(skill, kind) + out[at:]
    return out


def inject_skill(prompt: str, skill: str, kind: str, placement: str = "faithful") -> str:
    """The prompt with one skill section inserted (faithful: episode after the task line, step before the closing
    paragraph or at the end when it is missing; late: both before the closing paragraph). An empty skill: the
    prompt unchanged."""
    return inject_skills(prompt, {kind: skill}, placement)
