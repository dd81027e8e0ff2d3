"""Lenient parsing of analyzer replies (OPID.md §3 and "Reference rules in detail: Parsing").

The reference's rules, in order:
  * candidates: each fenced block (```json ... ``` or any other tag, or none), then the whole reply;
  * each candidate as is, then with trailing commas (`,` before `}` / `]`) removed;
  * in each, a non-strict JSON `raw_decode` at every `{` (control characters such as raw newlines and tabs inside
    strings are accepted; text after the object is ignored); failing that, `ast.literal_eval` on every
    balanced-brace slice (python-style dicts: single quotes, True/None, int keys);
  * the first object (a dict) holding an `episode_skill` key wins;
  * `episode_skill` must be a non-empty string (an empty one is a parse failure), `episode_summary` a string
    (anything else counts as "");
  * `step_skills` (a dict; anything else counts as {}): keys → int (keys that are not integers are dropped),
    values → str (a None value is dropped); keys outside the candidate set are dropped; then the first K in the
    reply's order are kept. Empty/whitespace step skills that survive this are dropped afterwards (no section is
    ever rendered for them), so they still count towards K, as in the reference.
Anything unusable raises `AnalysisParseError`, never another exception.

Untrusted text (opid_mega.skills.sanitize): the reply is sanitised before parsing (cut to MAX_REPLY_CHARS, control
characters and lone surrogates replaced) and so is every string of the result (a `\\ud800` escape inside the JSON
decodes to a lone surrogate); a step key of more than MAX_STEP_KEY_DIGITS digits is no integer (dropped).
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Iterable, Iterator

from opid_mega.skills.sanitize import clean_text, sanitize_reply, step_index
from opid_mega.skills.types import Analysis, AnalysisParseError

_FENCE = re.compile(r"```(?:[A-Za-z0-9_-]*)[ \t]*\n?(.*?)```", re.S)
_TRAILING_COMMA = re.compile(r",(\s*[}\]])")
_DECODER = json.JSONDecoder(strict=False)
_KEY = "episode_skill"
_SCAN_BUDGET = 4_000_000  # characters the balanced-brace scan may visit per candidate (a guard against floods)


def _balanced_slices(text: str) -> Iterator[str]:
    """Every balanced `{...}` substring, in order of its opening brace (quotes and backslash escapes respected,
    a scan starting at that brace). One scan also settles every brace it meets outside a quote (a scan from there
    would follow the same path), so brace floods cost linear time; `_SCAN_BUDGET` bounds the rest."""
    n = len(text)
    settled = set()
    spans = []
    budget = _SCAN_BUDGET
    start = text.find("{")
    while start >= 0 and budget > 0:
        if start not in settled:
            stack, i, quote = [], start, None
            while i < n and budget > 0:
                budget -= 1
                c = text[i]
                if quote:
                    if c == "\\":
                        i += 2
                        continue
                    if c == quote:
                        quote = None
                elif c in "\"'":
                    quote = c
                elif c == "{":
                    settled.add(i)
                    stack.append(i)
                elif c == "}":
                    spans.append((stack.pop(), i + 1))
                    if not stack:
                        break
                i += 1
        start = text.find("{", start + 1)
    for a, b in sorted(spans):
        yield text[a:b]


def _json_objects(text: str) -> Iterator[Any]:
    """Non-strict `raw_decode` at every `{`: each value that decodes."""
    start = text.find("{")
    while start >= 0:
        try:
            obj = _DECODER.raw_decode(text, start)[0]
        except Exception:  # noqa: BLE001 - any failure just means "no JSON object starts here"
            obj = None
        if obj is not None:
            yield obj
        start = text.find("{", start + 1)


def _python_objects(text: str) -> Iterator[Any]:
    """`ast.literal_eval` on every balanced-brace slice: each value that evaluates."""
    for piece in _balanced_slices(text):
        if _KEY not in piece:  # neither it nor any dict inside it can hold the key (each inner dict is a slice too)
            continue
        # No warnings.catch_warnings() here: it is not thread-safe and the LLM analyzer parses in worker threads.
        # A compiler warning (e.g. an invalid escape in a string literal) that a filter turns into an error is an
        # Exception like any other and just skips the slice.
        try:
            obj = ast.literal_eval(piece)
        except Exception:  # noqa: BLE001 - SyntaxError, ValueError, MemoryError, RecursionError, ...: not a literal
            obj = None
        if obj is not None:
            yield obj


def _candidates(text: str) -> Iterator[str]:
    seen = set()
    for block in [m.group(1) for m in _FENCE.finditer(text)] + [text]:
        for variant in (block, _TRAILING_COMMA.sub(r"\1", block)):
            if variant not in seen:
                seen.add(variant)
                yield variant


def _find_object(text: str) -> dict | None:
    for cand in _candidates(text):
        if _KEY not in cand:  # the key must appear literally in an object that holds it: skip the work
            continue
        for loader in (_json_objects, _python_objects):
            for obj in loader(cand):
                if isinstance(obj, dict) and _KEY in obj:
                    return obj
    return None


def _as_int(key: Any) -> int | None:
    """A step key as an int (an int, or a string of digits with optional sign and surrounding space); None otherwise.
    Negative and huge keys (more than MAX_STEP_KEY_DIGITS digits: int() would raise) are None: never a step, so they
    are skipped like any key outside the candidate set."""
    return step_index(key)


def _as_str(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except Exception:  # noqa: BLE001 - e.g. a container too deep to print
        return None


def parse_analysis(text: str, candidate_steps: Iterable[int], max_step_skills: int) -> Analysis:
    """Parse an analyzer reply into an `Analysis` (see the module docstring); `AnalysisParseError` if unusable."""
    if not isinstance(text, str):
        raise AnalysisParseError(f"reply is {type(text).__name__}, not text")
    text = sanitize_reply(text)
    candidates = set(candidate_steps)
    try:
        obj = _find_object(text)
    except RecursionError:
        obj = None
    if obj is None:
        raise AnalysisParseError("no JSON object with an 'episode_skill' key found")
    skill = obj[_KEY]
    if not isinstance(skill, str):
        raise AnalysisParseError(f"'episode_skill' is {type(skill).__name__}, not a string")
    skill = clean_text(skill)
    if not skill.strip():
        raise AnalysisParseError("'episode_skill' is empty")
    summary = obj.get("episode_summary", "")
    summary = clean_text(summary).strip() if isinstance(summary, str) else ""
    raw_steps = obj.get("step_skills")
    kept: dict[int, str] = {}
    if isinstance(raw_steps, dict):
        for key, value in raw_steps.items():
            if len(kept) >= max_step_skills:
                break
            idx, val = _as_int(key), _as_str(value)
            if idx is None or val is None or idx not in candidates or idx in kept:
                continue
            kept[idx] = clean_text(val)
    step_skills = {idx: val.strip() for idx, val in kept.items() if val.strip()}
    return Analysis(episode_summary=summary, episode_skill=skill.strip(), step_skills=step_skills)
