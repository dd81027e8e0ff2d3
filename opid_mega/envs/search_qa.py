"""Search-QA backend (Search-R1 protocol): `<search>query</search>` returns the top-k BM25 passages of a local
corpus inside `<information>...</information>`; `<answer>text</answer>` ends the episode with the normalised
exact-match reward (1.0 / 0.0). At most `max_steps` (default 4) steps; a step that is neither a search nor an
answer is invalid and gets Search-R1's "invalid action" feedback.

Data: by default the shipped country-facts set (opid_mega/data/search_qa, built by search_qa_data from
countryinfo). Any JSONL works for the real benchmarks:
  corpus_path: {"id", "title", "text"} per line (or {"id", "contents"} with the title on the first line,
               the Search-R1 wiki dump format);
  qa_path:     {"question", "answers" | "golden_answers" | "answer", optional "id", "split"} per line
               (without "split", every line belongs to every split; use qa_path per split then).
The BM25 index (bm25s) is built once per corpus file per process and shared by all env instances.
"""
from __future__ import annotations

import json
import os
import re
import string
import threading
from typing import Optional

from opid_mega.envs import prompts
from opid_mega.envs.base import Env, EnvError, Task, sample_pool
from opid_mega.envs.search_qa_data import CORPUS_FILE, DATA_DIR, QA_FILE

INVALID_FEEDBACK = ("My previous action is invalid. If I want to search, I should put the query between <search> "
                    "and </search>. If I want to give the final answer, I should put the answer between <answer> "
                    "and </answer>. Let me try again.")


def normalize_answer(text: str) -> str:
    """SQuAD/Search-R1 normalisation: lowercase, drop punctuation and articles, collapse whitespace."""
    text = str(text).lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers) -> bool:
    if isinstance(answers, str):
        answers = [answers]
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(a) for a in answers)


def load_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise EnvError(f"search_qa: file not found: {path}")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise EnvError(f"search_qa: {path}:{n} is not valid JSON: {exc}") from exc
    return rows


class BM25Retriever:
    """BM25 (bm25s) over a list of {"title", "text"} documents. `search` is thread-safe."""

    def __init__(self, docs: list[dict]):
        import bm25s

        if not docs:
            raise EnvError("search_qa: the corpus is empty")
        self.docs = docs
        texts = [f"{d['title']} {d['text']}" for d in docs]
        self._bm25s = bm25s
        self._index = bm25s.BM25()
        self._index.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
        self._lock = threading.Lock()

    def search(self, query: str, k: int = 3) -> list[dict]:
        k = max(1, min(int(k), len(self.docs)))
        with self._lock:
            tokens = self._bm25s.tokenize([query], stopwords="en", show_progress=False)
            if not tokens.vocab:  # only stopwords / punctuation
                return []
            ids, scores = self._index.retrieve(tokens, k=k, show_progress=False)
        return [self.docs[int(i)] for i, s in zip(ids[0], scores[0]) if s > 0]


_RETRIEVERS: dict[str, BM25Retriever] = {}
_RETRIEVERS_LOCK = threading.Lock()


def _load_corpus(path: str) -> list[dict]:
    docs = []
    for n, row in enumerate(load_jsonl(path)):
        if "text" in row:
            docs.append({"id": str(row.get("id", n)), "title": str(row.get("title", "")), "text": str(row["text"])})
        elif "contents" in row:  # Search-R1 wiki format: '"Title"\ntext'
            title, _, text = str(row["contents"]).partition("\n")
            docs.append({"id": str(row.get("id", n)), "title": title.strip().strip('"'), "text": text.strip()})
        else:
            raise EnvError(f"search_qa: corpus line {n + 1} of {path} has neither 'text' nor 'contents'")
    return docs


def get_retriever(corpus_path: str) -> BM25Retriever:
    key = os.path.abspath(corpus_path)
    with _RETRIEVERS_LOCK:
        if key not in _RETRIEVERS:
            _RETRIEVERS[key] = BM25Retriever(_load_corpus(key))
        return _RETRIEVERS[key]


def format_docs(docs: list[dict]) -> str:
    if not docs:
        return "<information>No results found.</information>"
    body = "\n".join(f"Doc {i + 1}(Title: {d['title']}) {d['text']}" for i, d in enumerate(docs))
    return f"<information>{body}</information>"


class SearchQAEnv(Env):
    name = "search_qa"
    family = "search"
    default_max_steps = 4
    default_success_reward = 1.0
    noop_action = ""  # not a search/answer: Search-R1's invalid-action feedback, no retrieval

    def __init__(self, corpus_path: Optional[str] = None, qa_path: Optional[str] = None, topk: int = 3,
                 max_steps: Optional[int] = None, success_reward: Optional[float] = None):
        super().__init__(max_steps=max_steps, success_reward=success_reward)
        # empty: the small bundled country-facts set (tests, the CPU configs); the paper configs name their own files
        self.corpus_path = os.path.expanduser(corpus_path) if corpus_path else os.path.join(DATA_DIR, CORPUS_FILE)
        self.qa_path = os.path.expanduser(qa_path) if qa_path else os.path.join(DATA_DIR, QA_FILE)
        self.topk = int(topk)
        self._qa: Optional[list[dict]] = None
        self._retriever: Optional[BM25Retriever] = None
        self._answers: list[str] = []
        self._question = ""

    def data_problem(self, splits) -> Optional[str]:
        """The start-up check (opid_mega.checks, before any model is built): one line when the corpus or the
        questions file (env.options.corpus_path / qa_path) is missing or empty here; None otherwise. The files are
        not parsed here (the trainer's first env does that, with its own errors)."""
        for key, path in (("corpus_path", self.corpus_path), ("qa_path", self.qa_path)):
            if not os.path.isfile(path):
                return (f"search_qa: env.options.{key}={path}: no such file on this node; put the "
                        f"{'retrieval corpus' if key == 'corpus_path' else 'questions'} there as JSONL "
                        "(configs/README.md \"Data\") or set env.options." + key)
            if os.path.getsize(path) == 0:
                return f"search_qa: env.options.{key}={path} is empty"
        return None

    @property
    def retriever(self) -> BM25Retriever:
        if self._retriever is None:
            self._retriever = get_retriever(self.corpus_path)
        return self._retriever

    def _questions(self) -> list[dict]:
        if self._qa is None:
            qa = []
            for n, row in enumerate(load_jsonl(self.qa_path)):
                answers = row.get("answers", row.get("golden_answers", row.get("answer")))
                if isinstance(answers, str):
                    answers = [answers]
                if "question" not in row or not answers:
                    raise EnvError(f"search_qa: QA line {n + 1} of {self.qa_path} needs 'question' and "
                                   "'answers' (or 'golden_answers' / 'answer')")
                qa.append({"id": str(row.get("id", n)), "question": str(row["question"]),
                           "answers": [str(a) for a in answers], "split": row.get("split")})
            self._qa = qa
        return self._qa

    def task_pool(self, split: str) -> list[Task]:
        rows = [r for r in self._questions() if r["split"] in (None, split)]
        if not rows:
            splits = sorted({str(r["split"]) for r in self._questions()})
            raise EnvError(f"search_qa: no question of split {split!r} in {self.qa_path} (splits: {splits})")
        return [Task(id=f"search_qa/{r['id']}", split=split, env=self.name,
                     data={"question": r["question"], "answers": r["answers"]}) for r in rows]

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        return sample_pool(self.task_pool(split), n, seed)

    def _reset(self, task: Task):
        if "question" not in task.data or "answers" not in task.data:
            raise EnvError(f"search_qa: task {task.id} has no question/answers")
        self.retriever  # build/load the index now, not in the first step
        self._question = str(task.data["question"])
        self._answers = [str(a) for a in task.data["answers"]]
        return self._question, self._question, [], self._question

    def _step(self, action: str):
        """`action` is "<search>q</search>" / "<answer>a</answer>" (a whole response works too: its first block is
        taken, as `prompts.project_action`); anything else, the no-op included, gets Search-R1's fixed
        invalid-action feedback (nothing retrieved)."""
        parsed, _ = prompts.project_action(action, family="search")
        if parsed is None:
            return INVALID_FEEDBACK, INVALID_FEEDBACK, [], False, True, {}
        m = re.fullmatch(r"<(search|answer)>(.*)</\1>", parsed, re.DOTALL)
        kind, content = m.group(1), m.group(2)
        if kind == "search":
            obs = format_docs(self.retriever.search(content, self.topk))
            return obs, obs, [], False, False, {"query": content}
        won = exact_match(content, self._answers)
        obs = f"Your answer: {content}"
        return obs, obs, [], won, False, {"done": True, "answer": content, "em": float(won)}

    def walkthrough(self) -> Optional[list[str]]:
        if not self._question:
            return None
        return [f"<search>{self._question}</search>", f"<answer>{self._answers[0]}</answer>"]
