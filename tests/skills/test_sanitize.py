"""Untrusted analyzer text at the boundary (opid_mega.skills.sanitize): fuzzed replies never raise and always come out
UTF-8 encodable, one JSONL line, bounded; a poisoned reply costs only its own analysis; the cache never replays a
crash; skills are cut to a token budget at a word boundary."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opid_mega.skills import Analysis, AnalysisParseError, parse_analysis
from opid_mega.skills.audit import AuditLog, read_audit
from opid_mega.skills.llm_analyzer import LLMAnalyzer
from opid_mega.skills.sanitize import (MAX_REPLY_CHARS, analysis_from_dict, clean_text, cut_analysis, cut_to_tokens,
                                       sanitize_analysis, sanitize_reply, step_index)

from .test_llm_analyzer import GOOD, _completion, _traj, serve

# every kind of character that has broken a writer or a reader: lone surrogates, C0/C1 controls, the separators
# str.splitlines() splits at, non-characters, astral characters, plus ordinary text
_NASTY = [chr(c) for c in [*range(0x00, 0x20), *range(0x7F, 0xA0), 0xD800, 0xDBFF, 0xDC00, 0xDFFF, 0x2028, 0x2029,
                           0xFFFE, 0xFFFF, 0xFEFF, 0x1F600, 0x10FFFF]]
NASTY_CHAR = st.one_of(st.sampled_from(_NASTY), st.integers(0xD800, 0xDFFF).map(chr), st.characters())
NASTY_TEXT = st.text(alphabet=NASTY_CHAR, max_size=200)


def _jsonl_safe(text: str) -> None:
    """What the cache and audit writers need: UTF-8 encodable, one line once JSON-encoded, readable back."""
    text.encode("utf-8")
    line = json.dumps({"t": text}, ensure_ascii=False)
    assert len(line.splitlines()) == 1
    assert json.loads(line)["t"] == text


def _analysis_safe(a: Analysis) -> None:
    for s in [a.episode_summary, a.episode_skill, *a.step_skills.values()]:
        assert isinstance(s, str)
        _jsonl_safe(s)
    assert all(type(k) is int and 0 <= k < 10**9 for k in a.step_skills)
    json.dumps(a.to_dict(), ensure_ascii=False).encode("utf-8")


@settings(max_examples=400, deadline=None)
@given(text=st.one_of(NASTY_TEXT, st.binary(max_size=100).map(lambda b: b.decode("utf-8", "surrogateescape")),
                      st.integers(), st.none(), st.floats()))
def test_clean_text_never_raises_and_is_jsonl_safe(text):
    out = clean_text(text)
    _jsonl_safe(out)
    assert not re.search("[\ud800-\udfff\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]", out)
    if isinstance(text, str) and text.isprintable() and text.isascii():
        assert out == text  # ordinary text passes untouched
    assert len(clean_text("ab\ncd\te", 3)) == 3


def test_line_breaks_and_replacements():
    assert clean_text("a\r\nb\rc\u2028d\u2029e\x85f") == "a\nb\nc\nd\ne\ufffdf"
    assert clean_text("x\ud800y\x00z\tw\nv") == "x\ufffdy\ufffdz\tw\nv"
    assert clean_text(None) == "" and clean_text(12) == "12"
    assert len(sanitize_reply("{" * (MAX_REPLY_CHARS + 10))) == MAX_REPLY_CHARS


def test_step_index_bounds():
    assert [step_index(k) for k in (3, "3", " +4 ", "007", "-0")] == [3, 3, 4, 7, 0]
    for bad in (True, -1, "-1", "1" * 5000, 10**5000, "1.5", "x", None, 1.0, 10**9):
        assert step_index(bad) is None


# a reply as a model might write it: JSON (escapes included: `\ud800` decodes to a lone surrogate), with giant keys
KEY = st.one_of(st.integers(0, 6).map(str), st.integers(4300, 6000).map(lambda n: "9" * n),
                st.sampled_from(["-1", "+2", " 1 ", "1e3", "0x1", "１"]), NASTY_TEXT)
REPLY_OBJ = st.fixed_dictionaries(
    {"episode_skill": NASTY_TEXT},
    optional={"episode_summary": NASTY_TEXT,
              "step_skills": st.dictionaries(KEY, st.one_of(NASTY_TEXT, st.none(), st.integers()), max_size=6)})


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(obj=REPLY_OBJ, ascii_escapes=st.booleans(), prefix=NASTY_TEXT, python_style=st.booleans())
def test_fuzzed_replies_parse_to_clean_analyses_or_a_parse_error(obj, ascii_escapes, prefix, python_style):
    body = repr(obj) if python_style else json.dumps(obj, ensure_ascii=ascii_escapes)
    reply = prefix + "\n```json\n" + body + "\n```"
    try:
        a = parse_analysis(reply, range(5), 3)
    except AnalysisParseError:
        return
    _analysis_safe(a)
    assert set(a.step_skills) <= set(range(5)) and len(a.step_skills) <= 3


def test_surrogate_escape_and_giant_key_reply():
    reply = ('{"episode_skill": "open \\ud800 the door", "episode_summary": "\\udfff", '
             '"step_skills": {"' + "1" * 4500 + '": "huge key", "1": "take \\ud83d\\ude00 it\\u2028now"}}')
    a = parse_analysis(reply, range(3), 5)
    assert a.episode_skill == "open \ufffd the door" and a.episode_summary == "\ufffd"
    assert a.step_skills == {1: "take \U0001F600 it\nnow"}  # a valid surrogate pair stays one character
    _analysis_safe(a)


def test_huge_reply_is_capped_and_fast():
    import time

    big = '{"episode_skill": "' + "word " * 400_000 + '"}'  # 2 MB
    t0 = time.perf_counter()
    with pytest.raises(AnalysisParseError):  # cut at MAX_REPLY_CHARS: the object is no longer closed
        parse_analysis(big, range(3), 2)
    assert time.perf_counter() - t0 < 20
    small = '{"episode_skill": "' + "word " * 1000 + '"}' + " " * 3_000_000
    assert parse_analysis(small, range(3), 2).episode_skill.startswith("word word")


@settings(max_examples=200, deadline=None)
@given(rec=st.one_of(st.dictionaries(st.text(max_size=20), st.one_of(NASTY_TEXT, st.integers(), st.none(),
                                                                      st.dictionaries(KEY, NASTY_TEXT, max_size=4))),
                     REPLY_OBJ, st.lists(st.integers()), NASTY_TEXT))
def test_analysis_from_dict_never_raises(rec):
    a = analysis_from_dict(rec)
    if a is not None:
        _analysis_safe(a)
        assert a.episode_skill.strip()


def test_sanitize_analysis_drops_what_is_unusable():
    a = Analysis("s\x00", "skill\ud800", {"1" * 5000: "x", 2: "ok\x1b", -3: "neg", 4: "   ", 5: None})
    b = sanitize_analysis(a)
    assert b == Analysis("s\ufffd", "skill\ufffd", {2: "ok\ufffd"})
    assert sanitize_analysis(Analysis("", " \x00 ", {})).episode_skill == "\ufffd"
    assert sanitize_analysis(Analysis("", "   ", {})) is None and sanitize_analysis("not one") is None


# ---------------------------------------------------------------------------------------------------------------
# the LLM analyzer: one poisoned reply in a batch
# ---------------------------------------------------------------------------------------------------------------
POISONED = {
    "surrogate": json.dumps({"episode_skill": "bad \ud800 skill", "step_skills": {"1": "lone \udc00"}}),
    "giant_key": json.dumps({"episode_skill": "giant keys", "step_skills": {"7" * 5000: "x", "0": "kept"}}),
    "controls": '{"episode_skill": "nul \x00 esc \x1b nel \x85 ls \u2028 end", "step_skills": {}}',
    "huge": '{"episode_skill": "' + "spam " * 300_000 + '"}',  # 1.5 MB: cut, no longer a closed object
}


def _script(body, n):
    prompt = body["messages"][-1]["content"]
    for name, reply in POISONED.items():
        if f"#{name}" in prompt:
            return 200, _completion(reply), 0.0, {}
    return 200, _completion(GOOD), 0.0, {}


def _named_traj(name, won=True):
    t = _traj(0, won=won)
    t.task, t.traj_id = f"put an apple in the fridge #{name}", name
    return t


def test_poisoned_replies_cost_only_their_own_analysis(tmp_path):
    cache, audit_path = tmp_path / "cache.jsonl", tmp_path / "audit.jsonl"
    names = ["good0", "surrogate", "giant_key", "controls", "huge", "good1"]
    trajs = [_named_traj(n, won=i % 2 == 0) for i, n in enumerate(names)]
    audit = AuditLog(audit_path)
    with serve(_script) as srv, LLMAnalyzer(srv.url, model="m", cache_path=cache, audit=audit, backoff_s=0.01,
                                            timeout_s=10) as an:
        out = an.analyze(trajs, iteration=1)
    audit.close()
    by = dict(zip(names, out))
    assert by["good0"] is not None and by["good1"] is not None
    assert by["surrogate"].episode_skill == "bad \ufffd skill" and by["surrogate"].step_skills == {1: "lone \ufffd"}
    assert by["giant_key"].step_skills == {0: "kept"}
    assert by["controls"].episode_skill == "nul \ufffd esc \ufffd nel \ufffd ls \n end"
    assert by["huge"] is None  # unusable after the cap (and after the re-ask): only this one is lost
    for a in out:
        if a is not None:
            _analysis_safe(a)
    # the cache holds every analysis (one valid line each), the audit reads back whole
    lines = cache.read_bytes().decode("utf-8").split("\n")
    assert lines[-1] == "" and len(lines) - 1 == 5
    assert all(json.loads(ln)["analysis"]["episode_skill"] for ln in lines[:-1])
    recs = list(read_audit(audit_path, "analysis"))
    assert sorted(r["traj_id"] for r in recs) == sorted(names)
    huge = next(r for r in recs if r["traj_id"] == "huge")
    assert huge["failure"].startswith("parse") and all(len(r) <= MAX_REPLY_CHARS for r in huge["replies"])

    # resume: the cache answers every analysis it holds, with the server gone; a poisoned line written by someone
    # else (escaped surrogates, a giant key, a torn multi-byte character) is sanitised or skipped, never raised
    with open(cache, "ab") as f:
        f.write(json.dumps({"key": "foreign", "analysis": {"episode_skill": "x\ud800", "step_skills":
                                                           {"9" * 5000: "y"}}}).encode() + b"\n")
        f.write(b'{"key": "torn", "analysis": {"episode_skill": "\xe2\x82\n')
    with LLMAnalyzer("http://127.0.0.1:9", model="m", cache_path=cache, max_retries=0) as an2:
        again = an2.analyze(trajs, iteration=2)
        assert an2.stats["cache_hits"] == 5 and an2.stats["requests"] == 1  # only "huge" is asked again
        assert an2._cache["foreign"] == Analysis("", "x\ufffd", {})
    assert [a is None for a in again] == [a is None for a in out]


def test_a_failing_cache_write_costs_the_cache_entry_not_the_analysis(tmp_path):
    with serve(lambda body, n: (200, _completion(GOOD), 0.0, {})) as srv, \
            LLMAnalyzer(srv.url, model="m", cache_path=tmp_path / "c.jsonl") as an:
        an._cache_file.close()  # every write now raises ValueError (I/O on a closed file), like a full disk
        out = an.analyze([_traj(0), _traj(1, won=False)])
        assert all(isinstance(a, Analysis) for a in out) and an.stats["failures"] == 0
        an._cache_file = None


# ---------------------------------------------------------------------------------------------------------------
# cutting skills to a token budget
# ---------------------------------------------------------------------------------------------------------------
def test_cut_to_tokens_word_boundary_generic():
    words = " ".join(f"w{i}" for i in range(100))
    cut, was = cut_to_tokens(words, 10, lambda s: len(s.split()))
    assert was and cut == " ".join(f"w{i}" for i in range(10))
    assert cut_to_tokens("short text", 10, lambda s: len(s.split())) == ("short text", False)
    assert cut_to_tokens("x" * 50, 7, len) == ("x" * 7, True)  # one giant word: cut inside it
    with pytest.raises(ValueError):
        cut_to_tokens("a", -1, len)


@pytest.fixture(scope="module")
def policy_tokenizer():
    from opid_mega.models import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("", "tiny-qwen3"))


def test_a_2000_token_skill_is_cut_to_256_at_a_word_boundary(policy_tokenizer):
    def count(s):
        return len(policy_tokenizer(s, add_special_tokens=False)["input_ids"])

    text = " ".join(f"step{i} open the drawer carefully, then look inside." for i in range(300))
    assert count(text) >= 2000
    cut, was = cut_to_tokens(text, 256, count)
    assert was and 240 <= count(cut) <= 256  # close to the budget, never over
    assert text.startswith(cut) and text[len(cut)].isspace()  # a prefix that ends at a word boundary
    a, n = cut_analysis(Analysis("sum", text, {0: text, 3: "short one"}), 256, count)
    assert n == 2 and a.step_skills[3] == "short one" and a.episode_skill == cut == a.step_skills[0]
    # no whitespace at all: cut inside the word, still within the budget
    blob = "x" * 20_000
    cut2, was2 = cut_to_tokens(blob, 256, count)
    assert was2 and 0 < count(cut2) <= 256 and blob.startswith(cut2)
