"""The agent loop on real environments: scripted (walkthrough) and tiny-model policies, failure isolation, and the
three-piece prompt tokenization the fork scorer relies on."""
import threading
import time

import pytest
import torch

from opid_mega.envs import make_env
from opid_mega.envs.search_qa import SearchQAEnv
from opid_mega.models import load_model
from opid_mega.rollout.agent_loop import AgentLoop, PromptTokenizer, default_stop_token_ids
from opid_mega.rollout.engine import SamplingParams
from opid_mega.rollout.local_engine import LocalEngine
from opid_mega.rollout.scripted_engine import ScriptedEngine, WalkthroughPolicy
from opid_mega.skills.injection import inject_skill, render_skill_section
from tolerance import assert_close_scaled

SKILL = "Search for the country first, then answer with the exact region name."


@pytest.fixture(scope="module")
def sqa():
    env = make_env("search_qa")
    return env, env.tasks("train", n=3, seed=0)


def _sampling(loop, **kw):
    return SamplingParams(stop_token_ids=loop.stop_token_ids, **kw)


def test_prompt_pieces_allow_skill_insertion(qwen_tokenizer, sqa):
    env, tasks = sqa
    pt = PromptTokenizer(qwen_tokenizer)
    assert pt.template_tail.endswith("<think>\n\n</think>\n\n")  # Qwen3 with thinking off
    obs = env.reset(tasks[0])
    prompt = env.build_prompt([("first obs", "<search>x</search>")], obs, history_length=4)
    ids, ep, st = pt.encode(prompt)
    assert 0 < ep < st < len(ids)
    assert qwen_tokenizer.decode(ids) == pt.chat_text(prompt)
    assert qwen_tokenizer.decode(ids[:ep]).endswith(prompt.split("\n")[0] + "\n")
    assert qwen_tokenizer.decode(ids[st:]).startswith("Now it's your turn")
    for kind, at in (("episode", ep), ("step", st)):
        with_skill, _, _ = pt.encode(inject_skill(prompt, SKILL, kind, "faithful"))
        section = pt.encode_text(render_skill_section(SKILL, kind))
        assert with_skill == ids[:at] + section + ids[at:]  # every other token identical
    late, _, _ = pt.encode(inject_skill(prompt, SKILL, "episode", "late"))
    assert late == ids[:st] + pt.encode_text(render_skill_section(SKILL, "episode")) + ids[st:]
    # Without the closing anchor the step insertion point is the end of the user message; without a task line the
    # episode point falls back to the step point (the reference's rule).
    ids2, ep2, st2 = pt.encode("Task line\nobservation only\n")
    assert ids2[st2:] == pt.encode_text(pt.template_tail) and ep2 == st2
    ids3, ep3, st3 = pt.encode("Your task is to: find the coin\nobservation only\n")
    assert ids3[st3:] == pt.encode_text(pt.template_tail) and ep3 < st3


def test_stop_ids_cover_the_chat_end_tokens(qwen_tokenizer, tiny_qwen3):
    ids = default_stop_token_ids(qwen_tokenizer, tiny_qwen3)
    assert qwen_tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    assert qwen_tokenizer.convert_tokens_to_ids("<|endoftext|>") in ids


def test_walkthrough_rollout_on_search_qa(qwen_tokenizer, sqa):
    env, tasks = sqa
    policy = WalkthroughPolicy(env, tasks, bad_steps=[0])  # step 0 answers without a tag: invalid
    engine = ScriptedEngine(qwen_tokenizer, policy)
    loop = AgentLoop(engine, qwen_tokenizer, env_name="search_qa", history_length=4, num_workers=3)
    batch = loop.run(tasks, group_size=2, sampling=_sampling(loop, max_new_tokens=128))
    loop.close()
    trajs = batch.trajectories
    assert [t.group_id for t in trajs] == [0, 0, 1, 1, 2, 2] and [t.traj_id for t in trajs] == list(range(6))
    assert all(t.won and t.error is None and t.score == 1.0 and t.length == 3 for t in trajs)
    assert engine.batch_sizes == [6, 6, 6]  # ONE batched engine call per step over all live trajectories
    for t in trajs:
        s0, s1, s2 = t.steps
        assert (s0.valid, s0.action) == (False, None) and s1.valid and s2.valid
        assert s1.action.startswith("<search>") and s2.action.startswith("<answer>") and s2.done
        assert [s.reward for s in t.steps] == [0.0, 0.0, 1.0]
        assert s2.raw_obs.startswith("<information>")  # the observation step 2 acted on: step 1's results
        assert len(s1.response_ids) == len(s1.response_logprobs) and s1.finish_reason == "stop"
        assert s1.task_id == tasks[t.group_id].id
        assert t.to_view().steps[1].action == s1.action
    m = batch.metrics()
    assert m["success_rate"] == 1.0 and m["invalid_rate"] == pytest.approx(1 / 3) and m["mean_length"] == 3


class _ExplodingSearchQA(SearchQAEnv):
    def _step(self, action):
        raise RuntimeError("boom in step")


class _BrokenResetSearchQA(SearchQAEnv):
    def _reset(self, task):
        raise RuntimeError("boom in reset")


def test_an_env_that_raises_fails_only_its_trajectory(qwen_tokenizer, sqa):
    env, tasks = sqa
    lock, made = threading.Lock(), []

    def factory():
        with lock:
            made.append(1)
            k = len(made)
        return {1: _ExplodingSearchQA, 2: _BrokenResetSearchQA}.get(k, SearchQAEnv)()

    engine = ScriptedEngine(qwen_tokenizer, WalkthroughPolicy(env, tasks))
    loop = AgentLoop(engine, qwen_tokenizer, env_factory=factory, history_length=4, num_workers=3)
    batch = loop.run(tasks[:2], group_size=2, sampling=_sampling(loop, max_new_tokens=128))
    failed = [t for t in batch.trajectories if t.failed]
    assert sorted(t.error.split(":")[0] for t in failed) == ["reset", "step 0"]
    assert any("boom in step" in t.error for t in failed) and any("boom in reset" in t.error for t in failed)
    assert all(t.won and t.length == 2 for t in batch.trajectories if not t.failed)
    assert batch.metrics()["num_failed"] == 2 and all(t.env_error for t in failed)
    # The broken envs were dropped: the next run builds fresh ones and every trajectory succeeds.
    again = loop.run(tasks[:2], group_size=2, sampling=_sampling(loop, max_new_tokens=128))
    loop.close()
    assert all(t.won and not t.failed for t in again.trajectories)


def test_stop_ends_a_running_rollout_at_its_next_step(qwen_tokenizer, sqa):
    """AgentLoop.stop() from another thread (the trainer shutting down while the next rollout plays beside the
    update): the trajectories still running end at the next step, named as stopped; no step is generated after."""
    env, tasks = sqa
    calls = []

    class StopsAfterStep0(ScriptedEngine):
        def generate(self, prompt_ids, sampling):
            calls.append(len(prompt_ids))
            threading.Thread(target=loop.stop).start()  # as the trainer's close() does, from its own thread
            time.sleep(0.2)
            return super().generate(prompt_ids, sampling)

    loop = AgentLoop(StopsAfterStep0(qwen_tokenizer, WalkthroughPolicy(env, tasks)), qwen_tokenizer,
                     env_name="search_qa", history_length=4)
    batch = loop.run(tasks[:2], group_size=1, sampling=_sampling(loop, max_new_tokens=128), deadline_s=600)
    loop.close()
    assert len(calls) == 1  # step 0 only: the walkthrough needs two steps
    assert all(t.deadline_failure and len(t.steps) == 1 for t in batch.trajectories)
    assert all("the rollout was stopped at step 1" in t.error for t in batch.trajectories)


def test_each_step_samples_with_its_own_seed(qwen_tokenizer, sqa):
    from opid_mega.rollout import step_seed

    env, tasks = sqa
    seen = []

    class Recording(ScriptedEngine):
        def generate(self, prompt_ids, sampling):
            seen.append(sampling.seed)
            return super().generate(prompt_ids, sampling)

    loop = AgentLoop(Recording(qwen_tokenizer, WalkthroughPolicy(env, tasks)), qwen_tokenizer, env_name="search_qa",
                     history_length=4, num_workers=1)
    loop.run(tasks[:1], group_size=1, sampling=_sampling(loop, max_new_tokens=128, seed=5))
    loop.run(tasks[:1], group_size=1, sampling=_sampling(loop, max_new_tokens=128))
    loop.close()
    assert seen == [step_seed(5, 0), step_seed(5, 1), None, None]  # derived from (seed, step) only; None stays None
    assert len({step_seed(s, k) for s in range(50) for k in range(30)}) == 50 * 30


def test_rollout_skill_is_injected_per_trajectory(qwen_tokenizer, sqa):
    env, tasks = sqa
    engine = ScriptedEngine(qwen_tokenizer, WalkthroughPolicy(env, tasks))
    loop = AgentLoop(engine, qwen_tokenizer, env_name="search_qa", history_length=4, num_workers=2)
    batch = loop.run(tasks[:1], group_size=2, sampling=_sampling(loop, max_new_tokens=128),
                     rollout_skills=[SKILL, None], skill_kind="episode", placement="faithful")
    loop.close()
    with_skill, without = batch.trajectories
    assert with_skill.rollout_skill == SKILL and without.rollout_skill is None
    section = render_skill_section(SKILL, "episode")
    for s_with, s_without in zip(with_skill.steps, without.steps):
        assert section in s_with.prompt_text and section not in s_without.prompt_text
        assert s_with.prompt_text == inject_skill(s_without.prompt_text, SKILL, "episode", "faithful")
    with pytest.raises(ValueError, match="rollout_skills has 1 entries"):
        AgentLoop(engine, qwen_tokenizer, env_name="search_qa").run(tasks[:1], 2, SamplingParams(),
                                                                    rollout_skills=[SKILL])


def test_tiny_model_rollout_records_engine_logprobs(qwen_tokenizer, tiny_qwen3, sqa):
    _, tasks = sqa
    engine = LocalEngine(tiny_qwen3)
    loop = AgentLoop(engine, qwen_tokenizer, env_name="search_qa", history_length=4, max_steps=2, num_workers=2,
                     model_path=tiny_qwen3)
    batch = loop.run(tasks[:2], group_size=2, sampling=_sampling(loop, temperature=1.0, max_new_tokens=6, seed=0))
    again = loop.run(tasks[:2], group_size=2, sampling=_sampling(loop, temperature=1.0, max_new_tokens=6, seed=0))
    loop.close()
    assert [s.response_ids for s in again.step_samples()] == [s.response_ids for s in batch.step_samples()]
    steps = [[s.response_ids for s in t.steps] for t in batch.trajectories]
    assert any(a != b for a, b in steps)  # step 1 samples with another seed than step 0
    samples = batch.step_samples()
    assert len(samples) == 8 and all(t.length == 2 and not t.won for t in batch.trajectories)
    assert all(not s.valid and s.action is None for s in samples)  # a random model never emits a valid tag
    model = load_model(tiny_qwen3, dtype="float64")
    s = samples[-1]
    with torch.no_grad():
        logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
    lp = torch.log_softmax(logits, -1)
    n = len(s.prompt_ids)
    ref = [lp[n - 1 + j, t].item() for j, t in enumerate(s.response_ids)]
    assert_close_scaled(s.response_logprobs, ref, msg="engine = recomputation")  # step-0 invariant (fp32 vs f64)
    assert batch.num_generate_calls == 2 and batch.metrics()["response_tokens"] == sum(
        len(x.response_ids) for x in samples)


@pytest.mark.slow
def test_walkthrough_rollout_on_textworld(qwen_tokenizer, tmp_path):
    options = dict(challenges=("coin_collector", "treasure_hunter"), cache_dir=str(tmp_path))
    env = make_env("textworld", **options)
    tasks = env.tasks("train", n=2, seed=0)
    engine = ScriptedEngine(qwen_tokenizer, WalkthroughPolicy(env, tasks, bad_steps=[1]))
    loop = AgentLoop(engine, qwen_tokenizer, env_name="textworld", env_options=options, history_length=5,
                     num_workers=4)
    batch = loop.run(tasks, group_size=2, sampling=_sampling(loop, max_new_tokens=128))
    loop.close()
    assert all(t.won and t.score == 10.0 and t.error is None for t in batch.trajectories)
    assert all(not t.steps[1].valid and t.num_invalid == 1 for t in batch.trajectories)
    assert all(t.steps[1].prompt_text.startswith("You are an expert agent playing a TextWorld")
               for t in batch.trajectories)


# ---- invalid actions and env faults (OPID.md "Reference rules in detail" -> "Invalid actions") ------------------
GARBAGE = ["", "\x00\x01\x02", "x" * 10_000, "a" + "é" * 150, "中文动作" * 60, "🙂" * 60, "\n\n\n", "\t\x1b[2J",
           "<action>\x00\x01\x02</action>", "<think>t</think><action>" + "é" * 300 + "</action>",
           "<think>t</think><action>restore</action>", "<search></search><search>", "search[\x00]"]


def test_garbage_responses_are_invalid_steps_not_env_errors(qwen_tokenizer, tmp_path):
    """Any string the policy writes is a penalised step (or a valid one): no trajectory is dropped or ends as an
    env error, every step counts toward max_steps. ALFWorld (generated games): nothing reaches the game."""
    options = dict(source="generated", cache_dir=str(tmp_path), pool_size=4, max_steps=len(GARBAGE))
    env = make_env("alfworld", **options)
    tasks = env.tasks("train", 2, seed=0)
    calls = []

    def respond(chat_text):
        calls.append(1)
        return GARBAGE[(len(calls) - 1) // 4 % len(GARBAGE)]  # 4 trajectories: one garbage string per step

    loop = AgentLoop(ScriptedEngine(qwen_tokenizer, respond), qwen_tokenizer, env_name="alfworld", env_options=options,
                     history_length=5, num_workers=4, step_timeout_s=30.0)
    batch = loop.run(tasks, group_size=2, sampling=_sampling(loop, max_new_tokens=4096))
    loop.close()
    for t in batch.trajectories:
        assert t.error is None and not t.env_error and not t.won and t.length == len(GARBAGE)
        # valid only with both action tags and both think tags and no Chinese character: the reference's rule
        assert [s.valid for s in t.steps] == [False] * 9 + [True, True, False, False]
        # no action tag -> the no-op; an extracted action that is not admissible: both "Nothing happens."
        assert all(s.raw_obs == "Nothing happens." for s in t.steps[1:])
        assert "Your task is to:" in t.steps[0].raw_obs
        assert [s.action for s in t.steps[8:11]] == ["\x00\x01\x02", "é" * 300, "restore"]  # extracted
        assert all(s.env_invalid for s in t.steps if s.action is not None)
    assert batch.metrics()["num_failed"] == 0


def test_reference_validity_is_recorded_and_the_extracted_action_runs(qwen_tokenizer, sqa):
    """Search: duplicate blocks are invalid (penalised) but the first block is still executed, as the reference
    does; a response without a block gets the fixed feedback; a clean one is valid."""
    env, tasks = sqa
    responses = iter(["<search>capital</search><search>Paris</search>", "I do not know",
                      "<think>t</think><answer>x</answer>"])
    loop = AgentLoop(ScriptedEngine(qwen_tokenizer, lambda _: next(responses)), qwen_tokenizer,
                     env_name="search_qa", history_length=4, num_workers=1)
    batch = loop.run(tasks[:1], group_size=1, sampling=_sampling(loop, max_new_tokens=128))
    loop.close()
    s0, s1, s2 = batch.trajectories[0].steps
    assert (s0.action, s0.valid, s0.env_invalid) == ("<search>capital</search>", False, False)
    assert s1.raw_obs.startswith("<information>")  # the search ran
    assert (s1.action, s1.valid) == (None, False)
    assert s2.raw_obs.startswith("My previous action is invalid")
    assert (s2.action, s2.valid, s2.done) == ("<answer>x</answer>", True, True)
    assert batch.trajectories[0].num_invalid == 2


class _HangingSearchQA(SearchQAEnv):
    """A simulator stuck past env.step_timeout_s (an abandoned daemon thread: nobody waits) until the test releases
    it (60 s at most); `stuck` / `returned` say whether its step began / ended."""

    stuck, returned, release = threading.Event(), threading.Event(), threading.Event()

    def _step(self, action):
        self.stuck.set()
        self.release.wait(60)
        self.returned.set()
        return super()._step(action)


def test_a_step_past_the_time_limit_ends_only_its_trajectory(qwen_tokenizer, sqa):
    env, tasks = sqa
    lock, made = threading.Lock(), []

    def factory():
        with lock:
            made.append(1)
            return _HangingSearchQA() if len(made) == 1 else SearchQAEnv()

    for ev in (_HangingSearchQA.stuck, _HangingSearchQA.returned, _HangingSearchQA.release):
        ev.clear()
    loop = AgentLoop(ScriptedEngine(qwen_tokenizer, WalkthroughPolicy(env, tasks)), qwen_tokenizer,
                     env_factory=factory, history_length=4, num_workers=4, step_timeout_s=0.5)
    batch = loop.run(tasks[:2], group_size=2, sampling=_sampling(loop, max_new_tokens=128))
    # the loop moved on: the stuck step began and is still stuck (it ends only when released, here)
    assert _HangingSearchQA.stuck.is_set() and not _HangingSearchQA.returned.is_set()
    _HangingSearchQA.release.set()
    failed = [t for t in batch.trajectories if t.failed]
    assert len(failed) == 1 and failed[0].env_error and failed[0].length == 0
    assert failed[0].error.startswith("step 0: EnvTimeout: search_qa: step(") and "0.5 s" in failed[0].error
    assert all(t.won for t in batch.trajectories if not t.failed)
    again = loop.run(tasks[:2], group_size=2, sampling=_sampling(loop, max_new_tokens=128))  # a fresh env
    loop.close()
    assert all(t.won and not t.failed for t in again.trajectories)
    with pytest.raises(ValueError, match="step_timeout_s must be > 0"):
        AgentLoop(ScriptedEngine(qwen_tokenizer, str), qwen_tokenizer, env_name="search_qa", step_timeout_s=0)


def test_env_step_timeout_config_reaches_the_loop(qwen_tokenizer):
    from opid_mega.config import ConfigError, load_config
    from opid_mega.rollout.launch import build_agent_loop

    assert load_config().env.step_timeout_s == 60.0
    cfg = load_config(overrides=["env.name=search_qa", "env.step_timeout_s=2.5"])
    loop = build_agent_loop(cfg, ScriptedEngine(qwen_tokenizer, str), qwen_tokenizer, None)
    assert loop.step_timeout_s == 2.5
    loop.close()
    with pytest.raises(ConfigError, match="env.step_timeout_s"):
        load_config(overrides=["env.step_timeout_s=0"])


@pytest.mark.slow
def test_a_stuck_textworld_step_ends_its_trajectory_and_the_slot_gets_a_fresh_worker(qwen_tokenizer, tmp_path):
    """The real jericho hang ("\x00\x01\x02" sent to the game with admissible_only=False) in a TextWorld worker
    process (the default): that trajectory ends at the deadline as a counted env error, the others win, the next
    run plays the slot in a fresh worker, and no worker process is left after close."""

    def _alive(pid) -> bool:  # exists and is not a zombie
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, TypeError):
            return False

    options = dict(challenges=["coin_collector"], pool_size={"train": 1, "valid": 1, "test": 1},
                   cache_dir=str(tmp_path), admissible_only=False)
    probe = make_env("textworld", process=False, **options)
    tasks = probe.tasks("train", 1, seed=0)
    probe.prepare(tasks)
    policy = WalkthroughPolicy(probe, tasks)
    probe.close()
    calls = []

    def respond(chat_text):
        calls.append(1)  # the first response of the first run (trajectory 0, step 0) hangs the game
        return "<think>t</think><action>\x00\x01\x02</action>" if len(calls) == 1 else policy(chat_text)

    loop = AgentLoop(ScriptedEngine(qwen_tokenizer, respond), qwen_tokenizer, env_name="textworld",
                     env_options=dict(options, step_timeout_s=5.0), history_length=2, num_workers=3,
                     step_timeout_s=5.0)
    t0 = time.monotonic()
    batch = loop.run(tasks, group_size=3, sampling=_sampling(loop, max_new_tokens=128))
    # only a hang guard (the game never returns): the 5 s step limit, not the 60 s default (3 worker starts and the
    # walkthroughs take ~7 s here: 8x slack)
    assert time.monotonic() - t0 < 60.0
    failed = [t for t in batch.trajectories if t.failed]
    assert [t.traj_id for t in failed] == [0] and failed[0].env_error and failed[0].length == 0
    assert failed[0].error.startswith("step 0: EnvTimeout: textworld: env worker process did not answer step(")
    assert "within 5.0 s" in failed[0].error and batch.metrics()["num_failed"] == 1  # rollout/env_errors
    assert all(t.won for t in batch.trajectories if not t.failed)
    again = loop.run(tasks, group_size=3, sampling=_sampling(loop, max_new_tokens=128))
    assert all(t.won and not t.failed for t in again.trajectories)  # slot 0 plays in a fresh worker
    pids = [env.pid for env in loop._envs]
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    loop.close()
    assert not any(_alive(p) for p in pids)
