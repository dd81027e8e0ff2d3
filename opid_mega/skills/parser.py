"""Lenient parsing of analyzer replies (docs/algorithm.md §3, "Reference rules in detail: Parsing" and "More reference
facts: Parser edge cases").

`parse_analysis(text, candidates, K, rules="reference")` follows the reference's rules (analyzer.parser=reference):
  * candidates: each fenced block (```json ... ``` or any other tag, or none), then the whole reply;
  * each candidate as is, then with trailing commas (`,` before `}` / `]`) removed;
  * in each, a non-strict JSON `raw_decode` at every `{` (control characters such as raw newlines and tabs inside
    strings are accepted; text after the object is ignored); the first object (a dict) holding an `episode_skill`
    key wins;
  * in a candidate where no JSON object was found: `ast.literal_eval` on every balanced-brace slice (python-style
    dicts: single quotes, True/None, int keys); objects are taken in candidate order and the first dict holding
    `episode_skill` wins (a python-style dict in a fenced block wins over a JSON object elsewhere in the reply);
  * `episode_skill`: a non-string value goes through str() and is accepted (`null` -> "None"); an empty one is a
    parse failure; `episode_summary` a string (anything else counts as "");
  * `step_skills` (a dict; anything else counts as {}): every key through int() (a key int() refuses is dropped;
    float and bool keys are truncated / 0-1), every value through str() (`null` -> "None"); duplicate keys after
    that: the last value wins (at the first one's place); keys outside the candidate set are dropped; then the first
    K in the reply's order are kept. Empty/whitespace step skills that survive this are dropped afterwards (no
    section is ever rendered for them), so they still count towards K, as in the reference.

rules="ours" (analyzer.parser=ours) is this project's earlier, stricter choice on the edge cases: a `null` step
value is dropped (no "None" skill), of duplicate keys the first wins, only int keys and digit strings are step
indices (float and bool keys are dropped), a non-string `episode_skill` is a parse failure; and the Python-literal
fallback is tried in each candidate right after its JSON objects (so a python-style dict is found even when the
same candidate also holds an unrelated JSON object).

Anything unusable raises `AnalysisParseError`, never another exception.

Untrusted text (opid_mega.skills.sanitize): the reply is sanitised before parsing (cut to MAX_REPLY_CHARS, control
characters and lone surrogates replaced) and so is every string of the result (a `\\ud800` escape inside the JSON
decodes to a lone surrogate); with rules="ours" a step key of more than MAX_STEP_KEY_DIGITS digits is no integer.
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


PARSER_RULES = ("reference", "ours")


def _find_object_ours(text: str) -> dict | None:
    for cand in _candidates(text):
        if _KEY not in cand:  # the key must appear literally in an object that holds it: skip the work
            continue
        for loader in (_json_objects, _python_objects):
            for obj in loader(cand):
                if isinstance(obj, dict) and _KEY in obj:
                    return obj
    return None


def _find_object_reference(text: str) -> tuple[dict | None, bool]:
    """(the first object holding the key, in candidate order; whether any JSON object was found). Per candidate text
    (each fenced block, then the whole reply; each as is, then without trailing commas): its JSON objects, or — only
    when that candidate holds no JSON object — its python-literal dicts."""
    found_json = False
    for cand in _candidates(text):
        has_key, cand_json = _KEY in cand, False
        for obj in _json_objects(cand):  # raw_decode at a `{` yields dicts only
            found_json = cand_json = True
            if not has_key:
                break  # no object here can hold the key; one object is enough to know JSON was found
            if isinstance(obj, dict) and _KEY in obj:
                return obj, True
        if cand_json or not has_key:
            continue
        for obj in _python_objects(cand):
            if isinstance(obj, dict) and _KEY in obj:
                return obj, found_json
    return None, found_json


def _as_int(key: Any) -> int | None:
    """rules=ours: a step key as an int (an int, or a string of digits with optional sign and surrounding space);
    None otherwise. Negative and huge keys (more than MAX_STEP_KEY_DIGITS digits: int() would raise) are None: never
    a step, so they are skipped like any key outside the candidate set."""
    return step_index(key)


def _int_like_reference(key: Any) -> int | None:
    """rules=reference: int(key), None where int() refuses it (floats are truncated, True/False are 1/0)."""
    try:
        return int(key)
    except Exception:  # noqa: BLE001 - ValueError, TypeError, OverflowError (inf): not a step index
        return None


def _as_str(value: Any) -> str | None:
    """str(value); None when even that fails (e.g. a container too deep to print)."""
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except Exception:  # noqa: BLE001
        return None


def _step_skills_reference(raw: dict, candidates: set, k: int) -> dict[int, str]:
    converted: dict[int, str] = {}
    for key, value in raw.items():
        idx, val = _int_like_reference(key), _as_str(value)
        if idx is None or val is None:
            continue
        converted[idx] = val  # duplicates: the last value wins, at the first one's place
    return dict([(i, v) for i, v in converted.items() if i in candidates][:max(k, 0)])


def _step_skills_ours(raw: dict, candidates: set, k: int) -> dict[int, str]:
    kept: dict[int, str] = {}
    for key, value in raw.items():
        if len(kept) >= k:
            break
        idx, val = _as_int(key), (None if value is None else _as_str(value))
        if idx is None or val is None or idx not in candidates or idx in kept:
            continue  # duplicates: the first wins
        kept[idx] = val
    return kept


def parse_analysis(text: str, candidate_steps: Iterable[int], max_step_skills: int,
                   rules: str = "reference") -> Analysis:
    """Parse an analyzer reply into an `Analysis` (see the module docstring); `AnalysisParseError` if unusable.
    `rules`: "reference" (analyzer.parser default) or "ours"."""
    if rules not in PARSER_RULES:
        raise ValueError(f"parse_analysis: rules={rules!r}, allowed: {', '.join(PARSER_RULES)}")
    if not isinstance(text, str):
        raise AnalysisParseError(f"reply is {type(text).__name__}, not text")
    text = sanitize_reply(text)
    candidates = set(candidate_steps)
    found_json = False
    try:
        if rules == "reference":
            obj, found_json = _find_object_reference(text)
        else:
            obj = _find_object_ours(text)
    except RecursionError:
        obj = None
    if obj is None:
        if found_json:
            raise AnalysisParseError("no JSON object with an 'episode_skill' key found (JSON objects without it were "
                                     "found; python-style dicts were tried only where no JSON object was)")
        raise AnalysisParseError("no JSON object with an 'episode_skill' key found")
    skill = obj[_KEY]
    if not isinstance(skill, str):
        if rules == "ours":
            raise AnalysisParseError(f"'episode_skill' is {type(skill).__name__}, not a string")
        skill = _as_str(skill)
        if skill is None:
            raise AnalysisParseError("'episode_skill' cannot be turned into text")
    skill = clean_text(skill)
    if not skill.strip():
        raise AnalysisParseError("'episode_skill' is empty")
    summary = obj.get("episode_summary", "")
    summary = clean_text(summary).strip() if isinstance(summary, str) else ""
    raw_steps = obj.get("step_skills")
    kept: dict[int, str] = {}
    if isinstance(raw_steps, dict):
        pick = _step_skills_reference if rules == "reference" else _step_skills_ours
        kept = pick(raw_steps, candidates, max_step_skills)
    step_skills = {idx: clean_text(val).strip() for idx, val in kept.items()}
    step_skills = {idx: val for idx, val in step_skills.items() if val}
    return Analysis(episode_summary=summary, episode_skill=skill.strip(), step_skills=step_skills)
