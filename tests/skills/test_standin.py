"""The hosted-analyzer stand-in (opid_mega.skills.standin): a real OpenAI-compatible server on loopback, read by a
real LLMAnalyzer built from the analyzer config, answering with what RuleAnalyzer makes of the trajectory."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from opid_mega.config import load_config
from opid_mega.envs.prompts import project_action
from opid_mega.rollout.launch import llm_analyzer
from opid_mega.skills import Analysis, RuleAnalyzer, StepView, TrajectoryView, build_analysis_prompt
from opid_mega.skills.llm_analyzer import AnalyzerUnavailable
from opid_mega.skills.parser import parse_analysis
from opid_mega.skills.standin import StandinServer, analysis_reply


def _step(obs: str, think: str, action: str, reward: float = 0.0, tags: bool = True) -> StepView:
    response = f"<think>{think}</think>\n<action>{action}</action>" if tags else f"I will {action}."
    act, valid = project_action(response)  # what the rollout records (opid_mega.rollout.agent_loop)
    return StepView(obs, response, reward, act, valid)


def _won() -> TrajectoryView:
    return TrajectoryView(task="put a clean apple in the fridge", won=True, traj_id="won", steps=[
        _step("You are in the kitchen. You see a countertop 1 and a fridge 1.", "the apple may be on the counter",
              "go to countertop 1"),
        _step("On the countertop 1, you see an apple 1.", "take it", "take apple 1 from countertop 1"),
        _step("You pick up the apple 1.", "look around", "look"),
        _step("You pick up the apple 1.", "the sink cleans things", "go to sinkbasin 1"),
        _step("You arrive at sinkbasin 1.", "clean it", "clean apple 1 with sinkbasin 1"),
        _step("You clean the apple 1.", "now the fridge", "go to fridge 1"),
        _step("The fridge 1 is closed.", "open and put", "put apple 1 in/on fridge 1", reward=10.0),
    ])


def _lost() -> TrajectoryView:
    return TrajectoryView(task="heat some egg and put it in the garbagecan", won=False, traj_id="lost", steps=[
        _step("You are in the kitchen. You see a drawer 1.", "search", "open drawer 1"),
        _step("The drawer 1 is open. It is empty.", "again", "open drawer 1"),
        _step("The drawer 1 is open. It is empty.", "again", "open drawer 1"),
        _step("The drawer 1 is open. It is empty.", "hmm", "go to fridge 1", tags=False),
        _step("You arrive at fridge 1.", "look inside", "open fridge 1"),
    ])


def _cfg(url: str, **over):
    overrides = ["analyzer.backend=llm", "analyzer.model=standin", f"analyzer.base_url={url}",
                 "analyzer.stall_timeout_s=10", "analyzer.backoff_s=0.05"]
    return load_config(None, overrides + [f"analyzer.{k}={v}" for k, v in over.items()]).analyzer


def test_two_trajectories_get_the_rule_analyses():
    trajs = [_won(), _lost()]
    with StandinServer(latency_s=0.0, model="standin") as srv, llm_analyzer(_cfg(srv.base_url), cache_path=None) as an:
        assert an.probe().tokens >= 1
        records = an.analyze_records(trajs)
        assert srv.requests == 3 and srv.max_in_flight >= 1
    for traj, rec in zip(trajs, records):
        a = rec.analysis
        assert isinstance(a, Analysis) and rec.failure is None and not rec.reasked, rec.failure
        assert a.step_skills and all(0 <= i < len(traj.steps) for i in a.step_skills) and len(a.step_skills) <= 5
        assert a == RuleAnalyzer(max_step_skills=5).analyze_one(traj)  # what rules.py makes of that trajectory
    won, lost = records[0].analysis, records[1].analysis
    assert "go to countertop 1 -> take apple 1 from countertop 1" in won.episode_skill and 6 in won.step_skills
    assert "Do not repeat 'open drawer 1'" in lost.episode_skill and 3 in lost.step_skills  # the untagged reply


def test_reply_follows_k_reask_and_unknown_prompts():
    traj = _won()
    for k in (0, 2):
        reply = analysis_reply(build_analysis_prompt(traj, k, 0.9))
        assert parse_analysis(reply, range(7), k) == RuleAnalyzer(max_step_skills=k).analyze_one(traj)
    prompt = build_analysis_prompt(traj, 5, 0.95)
    reask = prompt + "\n\nYour previous reply could not be used.\nProblem: x\nEnd of your previous reply:\n{}\n\n..."
    assert analysis_reply(reask) == analysis_reply(prompt)
    # not an analysis prompt: a deterministic analysis from its own text, indices from its candidate list
    odd = "Task: sort the books\nCandidate step indices: [0, 1, 2]\nChoose at most 2 critical steps"
    a = parse_analysis(analysis_reply(odd), range(3), 5)
    assert "sort the books" in a.episode_skill and set(a.step_skills) == {0, 1}
    assert analysis_reply(odd) == analysis_reply(odd)
    assert parse_analysis(analysis_reply("hello"), range(1), 5).step_skills == {}
    assert analysis_reply("Reply with the single word: ready") == "ready"


def test_latency_and_probe_and_model_check():
    with StandinServer(latency_s=0.5, model="standin") as srv:
        with llm_analyzer(_cfg(srv.base_url)) as an:
            t0 = time.monotonic()
            (a,) = an.analyze([_lost()])
            assert isinstance(a, Analysis) and time.monotonic() - t0 >= 0.5
        with llm_analyzer(_cfg(srv.base_url, model="gpt-x", max_retries=0)) as an:
            with pytest.raises(AnalyzerUnavailable, match="the server lists: standin"):
                an.probe()
        with llm_analyzer(_cfg(srv.base_url, max_tokens_field="max_completion_tokens")) as an:
            assert an.probe().seconds >= 0.5


def test_bad_requests_get_400_json_and_the_server_goes_on():
    with StandinServer(model="standin") as srv:
        url = srv.base_url + "/chat/completions"
        bad = [b"{not json", b"[1, 2]", json.dumps({"model": "standin"}).encode(),
               json.dumps({"model": "standin", "messages": [{"role": "user", "content": 3}]}).encode(),
               json.dumps({"model": "standin", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": -1}).encode(), "\udcff".encode("utf-8", "surrogatepass")]
        for body in bad:
            r = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=10)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", body
        r = httpx.post(url, json={"model": "standin", "messages": [{"role": "user", "content":
                                                                       build_analysis_prompt(_won(), 5, 0.95)}]})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
        assert json.loads(r.json()["choices"][0]["message"]["content"])["episode_skill"]
        models = httpx.get(srv.base_url + "/models").json()
        assert [m["id"] for m in models["data"]] == ["standin"]
        assert httpx.get(srv.base_url.rsplit("/v1", 1)[0] + "/nope").status_code == 404


def test_cli_prints_the_url_and_stops_on_sigterm():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "opid_mega.skills.standin", "--port", "0", "--latency-s", "0.2",
                             "--model", "standin"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1"), proc.stderr.read()
        assert httpx.get(url + "/models", timeout=10).json()["data"][0]["id"] == "standin"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _footprints_trajectory(seed_index: int, wrong: bool) -> TrajectoryView:
    from opid_mega.envs import format_response, make_env
    from opid_mega.envs.footprints_env import make_game

    env = make_env("footprints")
    task = env.task_pool("valid")[seed_index]
    g = make_game(task.data["seed"])
    door = next(c for c in g.doors if c != g.right) if wrong else g.right
    env.reset(task)
    raw, steps = env.raw_obs, []
    for a in [f"go {d}" for d in g.moves] + [f"open {door} door", "take coin"]:
        _, reward, done, info = env.step(a)
        steps.append(StepView(raw, format_response(a, "t"), float(reward), a, True))
        raw = info["raw_obs"]
        if done:
            break
    return TrajectoryView(task=env.task_description, won=bool(info["won"]), steps=steps, traj_id=task.id)


def test_a_chosen_analyzer_answers_through_the_real_client():
    """analyzer=: the footprints hindsight analyzer (here with its wrong-door noise) answers in the rule analyzer's
    place, and what the real LLMAnalyzer parses is exactly what that analyzer makes of the trajectory; a bad
    analyzer or option is refused at construction."""
    from opid_mega.skills.hindsight import FootprintsHindsightAnalyzer

    trajs = [_footprints_trajectory(i, wrong=i % 2 == 1) for i in range(6)]
    spec, opts = "opid_mega.skills.hindsight:FootprintsHindsightAnalyzer", {"wrong_door_rate": 0.5, "seed": 2}
    with StandinServer(analyzer=spec, analyzer_options=opts) as srv, \
            llm_analyzer(_cfg(srv.base_url), cache_path=None) as an:
        records = an.analyze_records(trajs)
    want = FootprintsHindsightAnalyzer(max_step_skills=5, **opts)
    for traj, rec in zip(trajs, records):
        assert rec.failure is None and rec.analysis == want.analyze_one(traj)
    assert any("noisy belief" in r.analysis.episode_summary for r in records)
    with pytest.raises(ValueError, match="not_a_module"):
        StandinServer(analyzer="not_a_module:X")
    with pytest.raises(ValueError, match="wrong_door_rate"):
        StandinServer(analyzer=spec, analyzer_options={"wrong_door_rate": 2})
    with pytest.raises(ValueError, match="empty_rate"):
        StandinServer(empty_rate=1.5)


def test_empty_and_cut_replies_go_through_the_retry_and_reask_paths():
    """empty_rate / malformed_rate: the client retries an empty reply (transport error) and re-asks a cut one (parse
    failure); the faults are drawn from the seed, the prompt and its repeat count, so the same requests meet the same
    faults; with every reply empty the analysis fails after the client's attempts."""
    trajs = []
    for i in range(6):  # twelve different trajectories: each its own prompt
        for t in (_won(), _lost()):
            t.task, t.traj_id = f"{t.task} (variant {i})", f"{t.traj_id}{i}"
            trajs.append(t)

    def run(**faults):
        with StandinServer(seed=5, **faults) as srv, llm_analyzer(_cfg(srv.base_url), cache_path=None) as an:
            records = an.analyze_records(trajs)
            return records, dict(srv.faults), srv.requests

    records, faults, requests = run(empty_rate=0.3, malformed_rate=0.3)
    assert faults["empty"] > 0 and faults["malformed"] > 0 and requests > len(trajs) + 1
    assert any(r.reasked for r in records)
    for traj, rec in zip(trajs, records):
        if rec.failure is None:
            assert rec.analysis == RuleAnalyzer(max_step_skills=5).analyze_one(traj)
    assert run(empty_rate=0.3, malformed_rate=0.3)[1:] == (faults, requests)  # the same faults again
    dead, dead_faults, _ = run(empty_rate=1.0)
    assert all(r.analysis is None and r.failure for r in dead) and dead_faults["malformed"] == 0
