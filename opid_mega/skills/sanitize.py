"""Untrusted text at the skill layer's boundary: analyzer replies, parsed analyses, analyses read back from a cache.

Any analyzer client (HTTP, `openai`, a local model, a cache replay) calls these where text enters, so nothing
downstream — the JSONL cache and audit writers (UTF-8), the tokenizer, the prompt builder, the fork scorer — can be
crashed by what a model wrote:

    reply = sanitize_reply(raw)                      # str, control characters / lone surrogates replaced, capped
    analysis = sanitize_analysis(analysis)           # every field cleaned, step keys small non-negative ints
    analysis = analysis_from_dict(record)            # a cache line's dict -> Analysis, or None when unusable
    text, cut = cut_to_tokens(text, 256, count)      # at most 256 tokens (count = the policy tokenizer's length)

Replaced (by U+FFFD, except line breaks): lone UTF-16 surrogates (a `\\ud800` JSON escape decodes to one; it cannot be
encoded as UTF-8, so writing it raises), C0 and C1 control characters other than tab and newline, and the line
separators that Python's `str.splitlines()` treats as line ends (VT, FF, FS/GS/RS, NEL, U+2028, U+2029: written raw
by `json.dumps(ensure_ascii=False)`, they would split one JSONL record into two on reading). CR LF and lone CR become
LF, U+2028/U+2029 become LF.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional

from opid_mega.skills.types import Analysis

# An analyzer reply (or a cached field) is cut to this many characters: far above any analysis a model writes
# (analyzer.max_tokens=4096 tokens is ~20k characters), small enough that parsing, auditing and caching stay cheap.
MAX_REPLY_CHARS = 262_144
# A step key longer than this many digits is no step index (Python's int() refuses 4300+ digits with ValueError).
MAX_STEP_KEY_DIGITS = 9
REPLACEMENT = "\ufffd"

_NEWLINES = re.compile("\r\n?|[\u2028\u2029]")
# C0 controls except \t and \n, DEL, C1 controls (NEL U+0085 included), lone surrogates
_BAD = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_STEP_KEY = re.compile(r"\s*([+-]?)([0-9]{1,%d})\s*" % MAX_STEP_KEY_DIGITS)


def clean_text(text: Any, max_chars: Optional[int] = None) -> str:
    """`text` as a str that is UTF-8 encodable and JSONL-safe (see the module docstring), cut to `max_chars`.
    Not a str: "" (None) or its str() ("" when even that fails)."""
    if text is None:
        return ""
    if not isinstance(text, str):
        try:
            text = str(text)
        except Exception:  # noqa: BLE001 - e.g. a container too deep to print
            return ""
    if max_chars is not None and len(text) > max_chars:
        text = text[:max_chars]
    if text.isascii() and text.isprintable():  # the common case: nothing to replace
        return text
    return _BAD.sub(REPLACEMENT, _NEWLINES.sub("\n", text))


def sanitize_reply(text: Any, max_chars: int = MAX_REPLY_CHARS) -> str:
    """An analyzer reply as it may be parsed, audited and cached."""
    return clean_text(text, max_chars)


def step_index(key: Any) -> Optional[int]:
    """A step key (an int, or a string of at most MAX_STEP_KEY_DIGITS digits, optional sign and surrounding space)
    as a non-negative int; None for anything else (bools, negative or huge numbers, other text). Never raises."""
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key if 0 <= key < 10 ** MAX_STEP_KEY_DIGITS else None
    if isinstance(key, str) and len(key) <= MAX_STEP_KEY_DIGITS + 64:
        m = _STEP_KEY.fullmatch(key)
        if m is None:
            return None
        value = int(m.group(2))
        return value if m.group(1) != "-" or value == 0 else None  # "-0" is 0, as int() reads it
    return None


def sanitize_analysis(analysis: Any, max_chars: int = MAX_REPLY_CHARS) -> Optional[Analysis]:
    """A clean copy of `analysis` (every text field through `clean_text`, step keys through `step_index`, entries
    whose key or value is unusable dropped); None when it is no Analysis or its episode skill is empty."""
    if not isinstance(analysis, Analysis):
        return None
    try:
        skill = clean_text(analysis.episode_skill, max_chars).strip()
        if not skill:
            return None
        steps: dict[int, str] = {}
        raw = analysis.step_skills if isinstance(analysis.step_skills, dict) else {}
        for key, value in raw.items():
            idx = step_index(key)
            text = clean_text(value, max_chars).strip() if value is not None else ""
            if idx is not None and text and idx not in steps:
                steps[idx] = text
        return Analysis(episode_summary=clean_text(analysis.episode_summary, max_chars).strip(),
                        episode_skill=skill, step_skills=steps)
    except Exception:  # noqa: BLE001 - whatever is wrong with it, it costs this analysis only
        return None


def analysis_from_dict(record: Any, max_chars: int = MAX_REPLY_CHARS) -> Optional[Analysis]:
    """`Analysis.to_dict()` output (e.g. a cache line's "analysis") back as a sanitised Analysis; None if unusable."""
    if not isinstance(record, dict) or "episode_skill" not in record:
        return None
    steps = record.get("step_skills")
    return sanitize_analysis(Analysis(episode_summary=record.get("episode_summary", ""),
                                      episode_skill=record.get("episode_skill"),
                                      step_skills=steps if isinstance(steps, dict) else {}), max_chars)


def cut_to_tokens(text: str, max_tokens: int, count: Callable[[str], int]) -> tuple[str, bool]:
    """(`text` cut to at most `max_tokens` tokens as measured by `count`, whether it was cut).

    The cut falls at a word boundary (the longest prefix ending before a whitespace run that fits, trailing space
    removed); a text whose first word alone does not fit is cut inside it (the longest fitting character prefix).
    Binary searches, so O(log n) calls of `count`; the result is checked with `count`, not assumed."""
    if max_tokens < 0:
        raise ValueError(f"cut_to_tokens: max_tokens={max_tokens} must be >= 0")
    if count(text) <= max_tokens:
        return text, False
    # word boundaries: the starts of whitespace runs (a prefix up to one of them ends with a whole word)
    bounds = [m.start() for m in re.finditer(r"\s+", text) if m.start() > 0]
    best = _largest_fitting(bounds, lambda b: count(text[:b].rstrip()) <= max_tokens)
    if best is not None:
        return text[:best].rstrip(), True
    n = _largest_fitting(range(1, len(text)), lambda b: count(text[:b]) <= max_tokens)
    return (text[:n] if n is not None else ""), True


def _largest_fitting(cands, fits) -> Optional[Any]:
    """The largest candidate c (candidates ascending) with fits(c), by binary search; only candidates for which
    fits() was checked true are returned (token counts of prefixes are monotone up to tokenizer merges)."""
    lo, hi, best = 0, len(cands) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(cands[mid]):
            best, lo = cands[mid], mid + 1
        else:
            hi = mid - 1
    return best


def cut_analysis(analysis: Analysis, max_tokens: int, count: Callable[[str], int]) -> tuple[Analysis, int]:
    """(a copy of `analysis` with its episode skill and every step skill cut to `max_tokens` tokens, how many
    skills were cut). A step skill cut to nothing is dropped."""
    skill, cut = cut_to_tokens(analysis.episode_skill, max_tokens, count)
    n = int(cut)
    steps = {}
    for k, v in analysis.step_skills.items():
        v2, c = cut_to_tokens(v, max_tokens, count)
        n += int(c)
        if v2.strip():
            steps[k] = v2
    return Analysis(episode_summary=analysis.episode_summary, episode_skill=skill, step_skills=steps), n
