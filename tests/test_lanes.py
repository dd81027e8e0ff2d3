"""The suite's two lanes (tests/lanes.py): the scheduler driven by a simulation of xdist's workers (a worker runs an
item once it knows the next one or is told to shut down), with a worker that crashes; the PAIRED list against the
suite's files; and a real `pytest -n 2` run of a small suite."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import lanes

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


class FakeNode:
    """A worker as the scheduler sees it (send_runtest_some, shutdown, shutting_down), plus what it was sent."""

    def __init__(self, name):
        self.gateway = SimpleNamespace(id=name)
        self.queue: list[int] = []
        self.shutting_down = False
        self.running = None  # (index, end time)
        self.ended = False

    def send_runtest_some(self, indices):
        assert not self.shutting_down, "items sent to a worker told to shut down"
        self.queue.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def simulate(collection, durations, paired, nodes=2, crash_at=None):
    """Runs `collection` through LaneScheduling on `nodes` simulated workers; durations[i] is item i's time.
    crash_at=(worker, item): that worker dies when it starts that item, and a new one replaces it (as xdist does).
    Returns ({item: (worker, start, end)},
    crashed items)."""
    config = SimpleNamespace(getvalue=lambda name: [f"{nodes}*popen"], getoption=lambda *a: "load")
    old = lanes.PAIRED
    lanes.PAIRED = frozenset(paired)
    try:
        sched = lanes.LaneScheduling(config, log=SimpleNamespace(lanes=lambda *a: None))
        workers = [FakeNode(f"gw{k}") for k in range(nodes)]
        for w in workers:
            sched.add_node(w)
        for w in workers:
            sched.add_node_collection(w, collection)
        assert sched.collection_is_completed
        sched.schedule()
        ran, crashed, now = {}, [], 0.0
        for _ in range(100_000):
            changed = True
            while changed:  # start what can start; a worker's end may hand another one work
                changed = False
                for w in workers:
                    if w.ended or w.running:
                        continue
                    if len(w.queue) >= 2 or (w.queue and w.shutting_down):
                        index = w.queue[0]
                        changed = True
                        if crash_at == (w.gateway.id, index):
                            w.ended = True
                            crashed.append(sched.remove_node(w))
                            new = FakeNode(f"gw{len(workers)}")  # xdist starts a replacement worker
                            workers.append(new)
                            sched.add_node(new)
                            sched.add_node_collection(new, collection)
                            sched.schedule()
                            continue
                        w.running = (index, now + durations[index])
                        ran.setdefault(index, []).append((w.gateway.id, now, now + durations[index]))
                    elif not w.queue and w.shutting_down:
                        w.ended = changed = True
                        assert sched.remove_node(w) is None
            busy = [w for w in workers if w.running]
            if not busy:
                if all(w.ended for w in workers):
                    return ran, crashed
                raise AssertionError(f"deadlock: queues {[(w.gateway.id, w.queue, w.shutting_down) for w in workers]}")
            w = min(busy, key=lambda w: w.running[1])
            index, now = w.running
            w.running = None
            w.queue.remove(index)
            sched.mark_test_complete(w, index, durations[index])
            if sched.tests_finished:  # what xdist's DSession does then
                for other in workers:
                    if not other.ended and not other.shutting_down:
                        other.shutdown()
        raise AssertionError("the simulation did not end")
    finally:
        lanes.PAIRED = old


def _suite(n_files=9, per_file=5, seed=0):
    import random

    rng = random.Random(seed)
    collection = [f"tests/t{f}.py::test_{k}" for f in range(n_files) for k in range(rng.randint(1, per_file))]
    durations = [rng.uniform(0.1, 3.0) for _ in collection]
    paired = {f"tests/t{f}.py" for f in range(n_files) if rng.random() < 0.6}
    return collection, durations, paired


def _check(collection, ran, paired, crashed=()):
    assert sorted(ran) == [i for i in range(len(collection)) if collection[i] not in crashed]
    assert all(len(runs) == 1 for runs in ran.values()), "an item ran twice"
    intervals = [(collection[i], *runs[0]) for i, runs in ran.items()]
    for nodeid, worker, start, end in intervals:
        if nodeid.split("::")[0] in paired:
            continue
        beside = [other for other, w, s, e in intervals if other != nodeid and s < end and e > start]
        assert not beside, f"{nodeid} (alone lane) ran beside {beside}"
    # a file's tests on one worker, in collection order
    by_file = {}
    for nodeid, worker, start, end in sorted(intervals, key=lambda t: t[2]):
        by_file.setdefault(nodeid.split("::")[0], []).append((worker, nodeid))
    for path, runs in by_file.items():
        assert len({w for w, _ in runs}) == 1, (path, runs)
        assert [n for _, n in runs] == [n for n in collection if n.startswith(path + "::") and n not in crashed]


@pytest.mark.parametrize("seed", range(6))
def test_every_item_runs_once_paired_side_by_side_alone_with_nothing_beside(seed):
    collection, durations, paired = _suite(seed=seed)
    ran, _ = simulate(collection, durations, paired)
    _check(collection, ran, paired)
    if paired and len(paired) < 9:  # both workers ran paired files, at once
        paired_runs = [(w, s, e) for i, runs in ran.items() for w, s, e in runs if collection[i].split("::")[0] in paired]
        if len({w for w, _, _ in paired_runs}) == 2:
            assert any(a[0] != b[0] and a[1] < b[2] and b[1] < a[2] for a in paired_runs for b in paired_runs)


def test_edge_collections():
    for collection, paired in ([], set()), (["tests/a.py::t"], set()), (["tests/a.py::t"], {"tests/a.py"}), \
            (["tests/a.py::t", "tests/b.py::t"], {"tests/a.py"}), (["tests/a.py::t", "tests/b.py::t"], set()):
        ran, _ = simulate(collection, [1.0] * len(collection), paired)
        _check(collection, ran, paired)
    ran, _ = simulate(["tests/a.py::t", "tests/b.py::t"], [1.0, 1.0], {"tests/a.py"}, nodes=1)  # -n 1
    _check(["tests/a.py::t", "tests/b.py::t"], ran, {"tests/a.py"})


@pytest.mark.parametrize("lane", ["paired", "alone"])
def test_a_crashed_worker_reports_its_item_and_the_rest_still_run(lane):
    collection, durations, paired = _suite(seed=3)
    victim = next(i for i, n in enumerate(collection) if (n.split("::")[0] in paired) == (lane == "paired"))
    # the worker that gets the victim dies when it starts it (try each worker: the one that is sent it)
    for worker in ("gw0", "gw1"):
        ran, crashed = simulate(collection, durations, paired, crash_at=(worker, victim))
        if crashed:
            assert crashed == [collection[victim]]
            _check(collection, ran, paired, crashed=crashed)
            return
    raise AssertionError("no worker was sent the item")


def test_paired_list_names_existing_single_process_files():
    files = {str(p.relative_to(ROOT)) for p in HERE.rglob("test_*.py")}
    assert lanes.PAIRED <= files, sorted(lanes.PAIRED - files)
    assert len(lanes.PAIRED) >= 20
    # files that start SGLang servers, launches or simulated nodes, share the session's server pool, or give a child
    # two threads are never paired
    for path in lanes.PAIRED:
        text = (ROOT / path).read_text()
        for marker in ("sglang_pool", "real_sglang_cpu", "torchrun", "cluster_sim", "launch_server", "nproc",
                       '"OMP_NUM_THREADS": "2"'):
            assert marker not in text, f"{path} is paired but uses {marker}"


MINI_CONFTEST = '''
import sys
sys.path.insert(0, {tests!r})
import lanes
lanes.PAIRED = frozenset({{"test_p1.py", "test_p2.py"}})
from lanes import pytest_configure_node, pytest_runtest_setup, pytest_xdist_make_scheduler  # noqa: F401
'''
MINI_TEST = '''
import json, os, time
import torch
import pytest


@pytest.mark.parametrize("k", range(4))
def test_t(k):
    start = time.time()
    time.sleep(0.4)
    with open(os.environ["LANES_LOG"], "a") as f:
        f.write(json.dumps({{"file": "{name}", "k": k, "pid": os.getpid(), "start": start, "end": time.time(),
                            "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}}) + "\\n")
'''


def test_real_run_with_two_workers(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "conftest.py").write_text(MINI_CONFTEST.format(tests=str(HERE)))
    for name in ("test_p1", "test_p2", "test_a1", "test_a2"):
        (tmp_path / f"{name}.py").write_text(MINI_TEST.format(name=name))
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "LANES_LOG": str(log)}
    env.pop("OMP_NUM_THREADS", None)
    env.pop("PYTEST_ADDOPTS", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted((x["file"], x["k"]) for x in rows) == sorted((f, k) for f in ("test_p1", "test_p2", "test_a1",
                                                                                  "test_a2") for k in range(4))
    paired = [x for x in rows if x["file"] in ("test_p1", "test_p2")]
    alone = [x for x in rows if x["file"] in ("test_a1", "test_a2")]
    # the paired files on two workers at once, one torch thread and OMP_NUM_THREADS=1 each
    assert len({x["pid"] for x in paired}) == 2
    assert any(a["pid"] != b["pid"] and a["start"] < b["end"] and b["start"] < a["end"] for a in paired for b in paired)
    assert all(x["threads"] == 1 and x["omp"] == "1" for x in paired), paired
    # the alone files on one worker, after every paired test, with the usual threads
    assert len({x["pid"] for x in alone}) == 1
    assert min(x["start"] for x in alone) >= max(x["end"] for x in paired)
    usual = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                           capture_output=True, text=True, timeout=120).stdout.strip()
    assert all(x["threads"] == int(usual) and x["omp"] is None for x in alone), alone
    # an explicit other distribution keeps xdist's own scheduler (both workers run the alone files too)
    log.unlink()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p",
                        "no:cacheprovider", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 16 and all(x["threads"] == int(usual) for x in rows)
