"""Search-QA: BM25 over the shipped country-facts corpus, Search-R1 protocol, exact-match reward (quick)."""
import json
import os
import sys
import threading

import pytest

from opid_mega.envs import format_response, make_env
from opid_mega.envs.base import EnvError
from opid_mega.envs.search_qa import INVALID_FEEDBACK, exact_match, normalize_answer
from opid_mega.envs.search_qa_data import CORPUS_FILE, DATA_DIR, QA_FILE


@pytest.fixture(scope="module")
def env():
    e = make_env("search_qa")
    yield e
    e.close()


@pytest.mark.parametrize("pred,golds,ok", [
    ("Paris", ["Paris"], True),
    ("  the PARIS. ", ["Paris"], True),
    ("An apple", ["apple"], True),
    ("+33", ["33"], True),
    (".fr", [".fr"], True),
    ("Paris, France", ["Paris"], False),
    ("Lyon", ["Paris", "Lutetia"], False),
    ("lutetia", ["Paris", "Lutetia"], True),
])
def test_exact_match(pred, golds, ok):
    assert exact_match(pred, golds) is ok


def test_normalize_answer():
    assert normalize_answer("The  Quick, brown FOX!") == "quick brown fox"


def test_walkthrough_episode_wins(env):
    task = env.tasks("train", 1, seed=0)[0]
    obs = env.reset(task)
    assert obs == task.data["question"] == env.task_description
    search, answer = env.walkthrough()
    obs, reward, done, info = env.step(search)
    assert obs.startswith("<information>Doc 1(Title: ") and not done and reward == 0.0 and not info["invalid"]
    obs, reward, done, info = env.step(answer)
    assert done and info["won"] and reward == 1.0 and info["em"] == 1.0


def test_bm25_finds_the_fact(env):
    docs = env.retriever.search("What is the capital of France?", k=3)
    assert any(d["title"] == "France" and "Paris" in d["text"] for d in docs)
    assert env.retriever.search("the of and", k=3) == []  # stopwords only: no results, no crash


def test_wrong_answer_and_full_response(env):
    task = [t for t in env.task_pool("test") if t.id.endswith("france-capital")] or env.tasks("test", 1, 0)
    env.reset(task[0])
    action, obs, reward, done, info = env.step_response(
        format_response("<answer>Atlantis</answer>", think="guess", family="search"))
    assert action == "<answer>Atlantis</answer>" and done and reward == 0.0 and not info["won"]
    with pytest.raises(EnvError, match="after the episode ended"):
        env.step("<answer>x</answer>")


def test_invalid_and_max_steps(env):
    env.reset(env.tasks("train", 1, seed=3)[0])
    action, obs, reward, done, info = env.step_response("I think it is Paris")  # unparsable
    assert action is None and info["format_invalid"] and info["invalid"] and obs == INVALID_FEEDBACK
    for _ in range(2):
        obs, reward, done, info = env.step("<search>capital</search>")
        assert not done
    obs, reward, done, info = env.step("<search>capital</search>")  # 4th step = max_steps
    assert done and info["truncated"] and reward == 0.0 and not info["won"]


def test_tasks_reproducible_and_splits_disjoint(env):
    assert env.tasks("train", 16, seed=5) == env.tasks("train", 16, seed=5)
    assert env.tasks("train", 16, seed=5) != env.tasks("train", 16, seed=6)
    train = {t.data["question"] for t in env.task_pool("train")}
    test = {t.data["question"] for t in env.task_pool("test")}
    assert len(train) > 1000 and len(test) > 200 and not train & test


def test_custom_jsonl_files(tmp_path):
    corpus = tmp_path / "c.jsonl"
    qa = tmp_path / "q.jsonl"
    corpus.write_text(json.dumps({"id": "1", "contents": '"Zorbia"\nZorbia is a land whose capital is Quuxville.'})
                      + "\n" + json.dumps({"id": "2", "title": "Blarg", "text": "Blarg has a capital named Fnord."})
                      + "\n")
    qa.write_text(json.dumps({"question": "What is the capital of Zorbia?", "golden_answers": ["Quuxville"]}) + "\n")
    e = make_env("search_qa", corpus_path=str(corpus), qa_path=str(qa), topk=1)
    task = e.tasks("test", 1, seed=0)[0]
    e.reset(task)
    obs, *_ = e.step("<search>Zorbia capital</search>")
    assert "Quuxville" in obs and "Fnord" not in obs
    _, reward, done, _ = e.step("<answer>quuxville</answer>")
    assert reward == 1.0 and done
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(EnvError, match="needs 'question' and 'answers'"):
        make_env("search_qa", corpus_path=str(corpus), qa_path=str(bad)).tasks("train", 1)
    with pytest.raises(EnvError, match="file not found"):
        make_env("search_qa", qa_path=str(tmp_path / "missing.jsonl")).tasks("train", 1)


def test_threads(env):
    tasks = env.tasks("test", 16, seed=1)
    results = []

    def play(chunk):
        e = make_env("search_qa")
        for t in chunk:
            e.reset(t)
            for a in e.walkthrough():
                _, r, done, _ = e.step(a)
            results.append(r)

    threads = [threading.Thread(target=play, args=(tasks[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [1.0] * 16


def test_shipped_data_is_reproducible(tmp_path):
    pytest.importorskip("countryinfo")
    from opid_mega.envs.search_qa_data import build

    corpus, qa = build(str(tmp_path))
    for name, path in ((CORPUS_FILE, corpus), (QA_FILE, qa)):
        with open(os.path.join(DATA_DIR, name), "rb") as a, open(path, "rb") as b:
            assert a.read() == b.read(), f"{name} differs from the builder's output: rerun {sys.executable} -m " \
                                         "opid_mega.envs.search_qa_data"


def test_invalid_block_is_executed_and_flagged(env):
    """As the reference: a response with duplicate or mixed blocks is invalid (penalised), and its first block is
    still what the env executes; a response without a block gets the fixed invalid-action feedback."""
    task = env.tasks("train", 1, seed=3)[0]
    env.reset(task)
    action, obs, reward, done, info = env.step_response(
        "<search>capital of France</search><search>capital of Spain</search>")
    assert action == "<search>capital of France</search>" and info["format_invalid"] and not info["invalid"]
    assert obs.startswith("<information>") and not done
    action, obs, reward, done, info = env.step_response("<think>no tags</think> Paris")
    assert action is None and info["format_invalid"] and info["invalid"] and obs == INVALID_FEEDBACK
    action, obs, reward, done, info = env.step_response("<answer>x</answer><search>y</search>")
    assert action == "<search>y</search>" and info["format_invalid"] and obs.startswith("<information>")
    action, obs, reward, done, info = env.step_response(f"<answer>{task.data['answers'][0]}</answer>")
    assert not info["format_invalid"] and done and info["won"] and reward == 1.0


def test_fuzz_any_string_is_an_action():
    """Hypothesis-generated and known-nasty strings: never raise or hang; an answer ends the episode, anything
    without a block gets the invalid feedback."""
    from _env_fuzz import FUZZ, NASTY_ALL, RESPONSES, play_garbage
    from hypothesis import given

    e = make_env("search_qa", max_steps=100_000)
    task = e.tasks("train", 1, seed=0)[0]
    last: dict = {}

    @FUZZ
    @given(RESPONSES)
    def check(text):
        for before, admissible, action, obs, reward, done, info in play_garbage(e, task, text, last):
            parsed, _ = e.project_action(action)
            if parsed is None:
                assert obs == INVALID_FEEDBACK and info["invalid"] and not done and reward == 0.0
            elif parsed.startswith("<answer>"):
                assert done and obs.startswith("Your answer: ")
            else:
                assert obs.startswith("<information>") and not done

    check()
    for text in NASTY_ALL:
        play_garbage(e, task, text, last)
    e.close()
