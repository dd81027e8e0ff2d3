r"""Skill sections and where they go in a step-sample prompt (OPID.md §5, "Reference rules in detail").

A prompt is split at two points:
  * the episode point: right after the first line that matches the reference's task-line pattern
    (`^.*\bYour task is to:\s*.*`, or the same with "Your current task is:", "Your task is:", "Your question:";
    the first such line in the prompt, whichever phrase it holds) and any blank lines that follow it; with no
    such line, the step point; failing that, the end;
  * the step point: the first line that begins "Now it's your turn" at or after the episode point (the closing
    paragraph); failing that, the end.
Inserting a section at one of those points leaves the text before it byte-identical, so the original and the skill
context share every token up to the insertion point (whitespace is kept, unlike the reference code, which strips
it). An empty or whitespace-only skill gives no section: the prompt comes back unchanged.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

from opid_mega.algo.routing import EPISODE, STEP

CLOSING_ANCHOR = "Now it's your turn"
PLACEMENTS = ("faithful", "late")
TASK_LINE_PATTERNS = (
    r"^.*\bYour task is to:\s*.*",
    r"^.*\bYour current task is:\s*.*",
    r"^.*\bYour task is:\s*.*",
    r"^.*\bYour question:\s*.*",
)
_TASK_LINE = re.compile("|".join(f"(?:{p})" for p in TASK_LINE_PATTERNS), re.M)

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


def _closing_line(prompt: str, start: int) -> int:
    """Offset of the first line at or after `start` that begins with CLOSING_ANCHOR, or len(prompt)."""
    pos = prompt.find(CLOSING_ANCHOR, start)
    while pos >= 0:
        if pos == 0 or prompt[pos - 1] == "\n":
            return pos
        pos = prompt.find(CLOSING_ANCHOR, pos + 1)
    return len(prompt)


def split_prompt(prompt: str) -> tuple[str, str, str]:
    """(head, middle, tail): head ends at the episode point, tail starts at the step point (see the module
    docstring). head + middle + tail == prompt; middle is "" when the prompt has no task line."""
    m = _TASK_LINE.search(prompt)
    if m is None:
        ep = st = _closing_line(prompt, 0)
    else:
        ep = m.end()
        while ep < len(prompt) and prompt[ep] == "\n":  # the line break ending the task line, then blank lines
            ep += 1
        st = _closing_line(prompt, ep)
    return prompt[:ep], prompt[ep:st], prompt[st:]


def insertion_point(prompt: str, kind: str, placement: str = "faithful") -> int:
    """Character offset where a skill section of `kind` goes."""
    if placement not in PLACEMENTS:
        raise ValueError(f"insertion_point: placement={placement!r}, allowed: {', '.join(PLACEMENTS)}")
    if kind not in SECTION_TITLES:
        raise ValueError(f"insertion_point: kind={kind!r}, allowed: {', '.join(SECTION_TITLES)}")
    head, middle, _ = split_prompt(prompt)
    if kind == EPISODE and placement == "faithful":
        return len(head)
    return len(head) + len(middle)


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
