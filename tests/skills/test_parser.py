"""The lenient analyzer-reply parser (OPID.md §3, "Reference rules in detail: Parsing" and "More reference facts:
Parser edge cases"). Tests of a reference rule say so and run with the default rules="reference"; this project's
stricter edge-case choices (analyzer.parser=ours) are tested as ours, beside the reference's expected value. Expected
values are written out from the rules, by hand."""
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opid_mega.skills import AnalysisParseError, parse_analysis
from opid_mega.skills.sanitize import clean_text

GOOD = {"episode_summary": "went well", "episode_skill": "go to the sink, then put the mug",
        "step_skills": {"0": "open the fridge", "3": "take the mug", "4": "put it"}}


def test_plain_json():
    a = parse_analysis(json.dumps(GOOD), range(5), 5)
    assert a.episode_skill == "go to the sink, then put the mug" and a.episode_summary == "went well"
    assert a.step_skills == {0: "open the fridge", 3: "take the mug", 4: "put it"}


def test_fenced_block_with_prose_and_trailing_commas():
    text = ("Sure! Here is my analysis.\n```json\n{\n  \"episode_summary\": \"s\",\n  \"episode_skill\": \"w\",\n"
            "  \"step_skills\": {\"1\": \"a\", \"2\": \"b\",},\n}\n```\nHope it helps {not json}.")
    a = parse_analysis(text, range(3), 5)
    assert a.episode_skill == "w" and a.step_skills == {1: "a", 2: "b"}


@pytest.mark.parametrize("fence", ["```json\n", "```\n", "```JSON\n", "```json ", "```python\n"])
def test_fenced_block_tags(fence):
    text = f"Analysis:\n{fence}{{\"episode_skill\": \"fenced\", \"step_skills\": {{\"0\": \"s\"}}}}\n```\nDone."
    a = parse_analysis(text, [0], 2)
    assert a.episode_skill == "fenced" and a.step_skills == {0: "s"}


def test_fenced_block_comes_before_the_whole_reply():
    """Candidates: each fenced block, then the whole reply."""
    text = '{"episode_skill": "outside"}\n```json\n{"episode_skill": "inside"}\n```\n'
    assert parse_analysis(text, [], 5).episode_skill == "inside"


def test_raw_newlines_tabs_and_control_characters_inside_strings():
    """Non-strict JSON decoding: control characters inside strings are accepted; newlines and tabs are kept, any
    other control character is replaced by U+FFFD (untrusted text, opid_mega.skills.sanitize)."""
    text = ('{"episode_summary": "line one\nline two", "episode_skill": "first\tgo to the sink\n'
            'then put the mug\x01 down", "step_skills": {"2": "open\nthe fridge"}}')
    a = parse_analysis(text, range(3), 5)
    assert a.episode_skill == "first\tgo to the sink\nthen put the mug\ufffd down"
    assert a.episode_summary == "line one\nline two" and a.step_skills == {2: "open\nthe fridge"}


def test_text_around_the_object_and_after_it():
    """raw_decode at a `{`: whatever follows the object is ignored, even braces."""
    text = 'Here you go: {"episode_skill": "e", "step_skills": {"1": "a"}} and some {trailing} text }'
    a = parse_analysis(text, range(3), 5)
    assert a.episode_skill == "e" and a.step_skills == {1: "a"}


def test_trailing_commas_in_the_whole_reply_with_raw_newlines():
    text = 'prose {"episode_skill": "multi\nline", "step_skills": {"0": "x", "1": "y",},} prose'
    a = parse_analysis(text, range(2), 5)
    assert a.episode_skill == "multi\nline" and a.step_skills == {0: "x", 1: "y"}


def test_python_style_dict():
    """ast.literal_eval on a balanced-brace slice: single quotes, True/None, int keys."""
    a = parse_analysis("Result: {'episode_skill': 'x', 'step_skills': {2: 'y', 'foo': 'z'}, 'ok': True, "
                       "'n': None} end", range(3), 5)
    assert a.episode_skill == "x" and a.step_skills == {2: "y"}


def test_json_is_tried_before_python_literals_within_a_candidate():
    text = "{'episode_skill': 'python'} then {\"episode_skill\": \"json\"}"
    assert parse_analysis(text, [], 5).episode_skill == "json"


def test_nested_object_holding_episode_skill():
    text = json.dumps({"analysis": {"episode_skill": "nested", "step_skills": {"1": "s"}}})
    a = parse_analysis(text, range(2), 5)
    assert a.episode_skill == "nested" and a.step_skills == {1: "s"}


def test_first_object_with_episode_skill_wins():
    text = '{"note": "ignore me"} then {"episode_skill": "first"} and {"episode_skill": "second"}'
    assert parse_analysis(text, [], 5).episode_skill == "first"


def test_first_object_with_an_empty_episode_skill_is_a_failure():
    """The first object holding `episode_skill` wins, and an empty one is a parse failure."""
    with pytest.raises(AnalysisParseError, match="empty"):
        parse_analysis('{"episode_skill": "  "} {"episode_skill": "later"}', [], 5)


def test_step_keys_become_int_others_dropped():
    text = json.dumps({"episode_skill": "e", "step_skills": {"abc": "word", "1.5": "float", "2": "two",
                                                             " 3 ": "three", "": "blank", "-0": "zero"}})
    a = parse_analysis(text, range(5), 10)
    assert a.step_skills == {2: "two", 3: "three", 0: "zero"}
    assert list(a.step_skills) == [2, 3, 0]  # the reply's order


def test_step_values_become_str():
    """Reference: every value through str(), null included ("None"). Ours: a null value is dropped."""
    text = json.dumps({"episode_skill": "e", "step_skills": {"0": 5, "1": 2.5, "2": True, "3": None, "4": "ok"}})
    assert parse_analysis(text, range(5), 5).step_skills == {0: "5", 1: "2.5", 2: "True", 3: "None", 4: "ok"}
    assert parse_analysis(text, range(5), 5, rules="ours").step_skills == {0: "5", 1: "2.5", 2: "True", 4: "ok"}


def test_reference_null_step_value_is_the_text_none():
    a = parse_analysis('{"episode_skill": "E", "step_skills": {"1": null, "0": "go"}}', range(2), 5)
    assert a.step_skills == {1: "None", 0: "go"} and list(a.step_skills) == [1, 0]


def test_reference_duplicate_keys_the_last_wins():
    """Keys equal after int() ("2" and "02"): the last value, at the first one's place; K counts distinct steps."""
    text = '{"episode_skill": "E", "step_skills": {"2": "a", "1": "b", "02": "c"}}'
    assert parse_analysis(text, range(3), 5).step_skills == {2: "c", 1: "b"}
    assert list(parse_analysis(text, range(3), 5).step_skills) == [2, 1]
    assert parse_analysis(text, range(3), 1).step_skills == {2: "c"}
    # the same key twice in the JSON text, and a duplicated episode_skill: the decoder keeps the last, both rules
    same = '{"episode_skill": "first", "episode_skill": "second", "step_skills": {"1": "x", "1": "y"}}'
    for rules in ("reference", "ours"):
        a = parse_analysis(same, range(3), 5, rules=rules)
        assert a.episode_skill == "second" and a.step_skills == {1: "y"}
    # ours: of keys equal after conversion, the first wins
    assert parse_analysis(text, range(3), 5, rules="ours").step_skills == {2: "a", 1: "b"}


def test_reference_float_and_bool_keys_go_through_int():
    """A python-style dict can have float and bool keys: int(1.9) = 1, int(False) = 0; int("1.9") fails (dropped)."""
    text = "{'episode_skill': 'E', 'step_skills': {1.9: 'float', False: 'bool', 2: 'int', '1.9': 'text'}}"
    assert parse_analysis(text, range(3), 5).step_skills == {1: "float", 0: "bool", 2: "int"}
    assert parse_analysis(text, range(3), 5, rules="ours").step_skills == {2: "int"}


@pytest.mark.parametrize("value, text", [("3", "3"), ("null", "None"), ('["a", "b"]', "['a', 'b']"),
                                         ('{"x": 1}', "{'x': 1}"), ("false", "False"), ("2.50", "2.5")])
def test_reference_non_string_episode_skill_goes_through_str(value, text):
    reply = '{"episode_skill": %s, "step_skills": {"0": "s"}}' % value
    a = parse_analysis(reply, range(1), 5)
    assert a.episode_skill == text and a.step_skills == {0: "s"}
    with pytest.raises(AnalysisParseError, match="not a string"):
        parse_analysis(reply, range(1), 5, rules="ours")


def test_reference_python_literal_fallback_per_candidate_text():
    """Reference opid/analysis.py:561-588 (`_decode_json_objects`, called per candidate text and variant from
    :520-528): a candidate's python-literal slices are tried only when that candidate holds no JSON object; objects
    are gathered in candidate order (fenced blocks first, the whole reply last) and the first holding episode_skill
    wins (:530-532). Ours tries the python-style dicts in each candidate after its JSON objects."""
    # one candidate (no fence) with a JSON object without the key: its python-style dict is not tried
    text = 'Confidence: {"score": 0.9}. Analysis: {\'episode_skill\': \'python\', \'step_skills\': {0: \'s\'}}'
    with pytest.raises(AnalysisParseError, match="tried only where no JSON object was"):
        parse_analysis(text, range(2), 5)
    assert parse_analysis(text, range(2), 5, rules="ours").episode_skill == "python"
    # the python-style dict in a fenced block (a candidate without JSON) wins over a JSON object elsewhere
    fenced = 'Scores: {"score": 1}\n```python\n{\'episode_skill\': \'py\', \'step_skills\': {1: \'s\'}}\n```'
    for rules in ("reference", "ours"):
        got = parse_analysis(fenced, range(2), 5, rules=rules)
        assert (got.episode_skill, got.step_skills) == ("py", {1: "s"}), rules
    # no JSON object at all: the fallback runs under both rules
    only = "Analysis: {'episode_skill': 'python', 'step_skills': {0: 's'}}"
    for rules in ("reference", "ours"):
        assert parse_analysis(only, range(2), 5, rules=rules).step_skills == {0: "s"}


def test_unknown_rules_are_refused():
    with pytest.raises(ValueError, match="rules"):
        parse_analysis("{}", range(1), 1, rules="strict")


def test_candidate_filter_then_first_k_in_reply_order():
    text = json.dumps({"episode_skill": "e", "step_skills": {"9": "out", "-1": "neg", "1.5": "float", "4": "a",
                                                             "2": "b", "0": "c", "3": "d"}})
    assert parse_analysis(text, range(5), 2).step_skills == {4: "a", 2: "b"}
    assert parse_analysis(text, range(5), 0).step_skills == {}
    assert parse_analysis(text, [3, 9], 5).step_skills == {9: "out", 3: "d"}


def test_empty_step_skill_counts_towards_k_but_is_not_kept():
    """Keep the first K candidate keys (as the reference does); an empty one then gives no section."""
    text = json.dumps({"episode_skill": "e", "step_skills": {"0": "", "1": "a", "2": "b"}})
    assert parse_analysis(text, range(3), 2).step_skills == {1: "a"}
    assert parse_analysis(text, range(3), 3).step_skills == {1: "a", 2: "b"}


def test_bad_step_container_gives_no_step_skills():
    for steps in (["a", "b"], "a", None, 3):
        a = parse_analysis(json.dumps({"episode_skill": "e", "step_skills": steps}), range(3), 5)
        assert a.step_skills == {} and a.episode_skill == "e"


@pytest.mark.parametrize("text", [
    "", "no json here", '{"episode_skill": ""}', '{"episode_skill": "   "}', '{"episode_summary": "only"}',
    "{'episode_skill': }", "[1, 2, 3]", '{"episode_skill": "x"', '["episode_skill"]', '"episode_skill"',
])
@pytest.mark.parametrize("rules", ["reference", "ours"])
def test_unusable_replies_raise_parse_error(text, rules):
    with pytest.raises(AnalysisParseError):
        parse_analysis(text, range(3), 3, rules=rules)


def test_non_text_reply():
    with pytest.raises(AnalysisParseError, match="not text"):
        parse_analysis(None, range(3), 3)


@pytest.mark.parametrize("text", [
    "{" * 20000, "{" * 5000 + '"episode_skill"' + "}" * 5000, '{"a":' * 3000 + '"episode_skill"',
    "[" * 100000 + "episode_skill", "{'episode_skill': " + "(" * 5000 + "}",
    "```" * 3000 + "{\"episode_skill\"", "{\"episode_skill\": \"" + "\\" * 20000 + "\"}",
])
@pytest.mark.parametrize("rules", ["reference", "ours"])
def test_pathological_replies_fail_fast(text, rules):
    t0 = time.monotonic()
    try:
        parse_analysis(text, range(3), 3, rules=rules)
    except AnalysisParseError:
        pass
    assert time.monotonic() - t0 < 10


JSONISH = st.sampled_from(list('{}[]"\':,0123456789 \n\t`\\') + ["episode_skill", "step_skills", "json", "```",
                                                                    "```json\n", "True", "None", "\x00", "\x01"])


@pytest.mark.parametrize("rules", ["reference", "ours"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(max_size=300), st.lists(JSONISH, max_size=60).map("".join)),
       candidates=st.sets(st.integers(-3, 12), max_size=8), k=st.integers(0, 6))
def test_fuzz_parser_only_raises_parse_error_and_respects_candidates(rules, text, candidates, k):
    try:
        a = parse_analysis(text, candidates, k, rules=rules)
    except AnalysisParseError:
        return
    assert isinstance(a.episode_skill, str) and a.episode_skill.strip()
    assert set(a.step_skills) <= candidates and len(a.step_skills) <= k
    assert all(isinstance(v, str) and v.strip() for v in a.step_skills.values())


@settings(max_examples=150, deadline=None)
@given(skill=st.text(min_size=1, max_size=40).filter(lambda s: s.strip()),
       steps=st.dictionaries(st.integers(0, 30), st.text(min_size=1, max_size=20).filter(lambda s: s.strip()),
                             max_size=8),
       k=st.integers(0, 8), prose=st.text(max_size=30).filter(lambda s: "{" not in s),
       raw=st.booleans())
def test_valid_objects_round_trip(skill, steps, k, prose, raw):
    """Any valid object after prose is recovered; with `raw`, strings carry raw control characters (non-strict)."""
    body = json.dumps({"episode_summary": "s", "episode_skill": skill,
                       "step_skills": {str(i): v for i, v in steps.items()}}, ensure_ascii=raw)
    if raw:  # un-escape the control characters json.dumps escaped: raw newlines etc. inside strings
        body = body.replace("\\n", "\n").replace("\\t", "\t").replace("\\r", "\r")
        if "\\" in body.replace('\\"', "").replace("\\\\", ""):
            return  # other escapes stay escaped; nothing to un-escape safely
    a = parse_analysis(prose + "\n" + body, range(20), k)
    # control characters other than newline / tab come back as U+FFFD (opid_mega.skills.sanitize)
    assert a.episode_skill == clean_text(skill).strip()
    want = [(i, clean_text(v).strip()) for i, v in steps.items() if i < 20][:k]
    assert list(a.step_skills.items()) == want
