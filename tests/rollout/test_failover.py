"""Servers fail over, never hang (issue 22, item 6), against fake SGLang HTTP servers (tests/sglang_fake.py):

- a server that stops answering (wedged, not dead) passes the per-request timeout once, is never retried, and leaves
  a fleet's rotation like a dead one (its prompts answered by the other server, counted in rollout/dead_servers);
  alone it is one clear EngineError;
- malformed replies (not JSON, the wrong shape, log-probs that do not match or are not finite) are server failures:
  a fleet fails over, a lone server raises EngineError, never a crash;
- a weight update succeeds only on a well-formed success reply;
- the rollout deadline cuts a generate call short (RolloutDeadline, no server failure) and the agent loop ends the
  trajectories still running as deadline failures, keeping the finished ones.
The real-SGLang case (a SIGSTOPped scheduler) is in test_fleet.py, the trainer's SIGTERM in tests/trainer.
"""
import threading
import time

import pytest
import torch

from opid_mega.rollout.engine import EngineError, RolloutDeadline, SamplingParams
from opid_mega.rollout.fleet import FleetEngine
from opid_mega.rollout.sglang_engine import SGLangEngine
from sglang_fake import StrictSGLang

# Time is the behaviour here (a request timeout or a rollout deadline fires): each check is "not before the limit"
# where the limit is the test's own, and "well before a hang". A wedged server holds a request 120 s and the deadline
# tests' request timeout is 60 s; HANG_S is far below both and >= 10x every limit here, so a 5x slower machine passes.
HANG_S = 30.0


def _results(req):
    """SGLang-shaped /generate outputs: prompt p answers [p[0], len(p)] with log-probs -0.5, -1.5."""
    return [{"output_ids": [ids[0], len(ids)], "meta_info": {"finish_reason": {"type": "length"},
                                                             "output_token_logprobs": [[-0.5, 0, None],
                                                                                       [-1.5, 0, None]]}}
            for ids in req["input_ids"]]


class _Server:
    """A fake server whose /generate answers with `reply(req)` (default: well-formed results), counting calls;
    `wedge()` makes it stop answering (requests hang until the test ends)."""

    def __init__(self, fake_sglang, reply=None):
        self.calls = 0
        self.reply = reply or (lambda req: (200, _results(req)))
        self.release = threading.Event()
        self.wedged = False
        self.lock = threading.Lock()
        self.http = fake_sglang(self._generate)
        self.url = self.http.url

    def _generate(self, req):
        with self.lock:
            self.calls += 1
        if self.wedged:
            self.release.wait(120)
            return 503, {"error": "released at the end of the test"}
        return self.reply(req)

    def wedge(self):
        self.wedged = True


@pytest.fixture
def servers(fake_sglang):
    made = []

    def make(reply=None):
        made.append(_Server(fake_sglang, reply))
        return made[-1]

    yield make
    for s in made:
        s.release.set()


PROMPTS = [[100 + i, 1, 2][: 1 + i % 3] for i in range(12)]
WANT = [[p[0], len(p)] for p in PROMPTS]


def test_a_wedged_server_leaves_rotation_within_the_request_timeout(servers):
    wedged, healthy = servers(), servers()
    timeout = 2.0
    engines = [SGLangEngine(url=s.url, request_timeout_s=timeout, backoff_s=0.01) for s in (wedged, healthy)]
    wedged.wedge()
    fleet = FleetEngine(engines, chunk_prompts=2)
    t0 = time.monotonic()
    out = fleet.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    elapsed = time.monotonic() - t0
    assert [r.response_ids for r in out] == WANT  # every prompt answered, in order, by the healthy server
    st = fleet.stats()
    print(f"fleet with a wedged server: {elapsed:.1f} s (request timeout {timeout} s); {st}")
    assert timeout <= elapsed < HANG_S
    assert st["rollout/dead_servers"] == 1 and st["rollout/servers_alive"] == 1
    assert st["rollout/server1_prompts"] == len(PROMPTS) and "no reply within 2 s" in fleet.dead_servers()[wedged.url]
    # each chunk the wedged server got (they were in flight at once) timed out once and went to the other server:
    # none was retried on the wedged one
    assert wedged.calls >= 1 and st["rollout/retried_requests"] == 2 * wedged.calls
    calls, retried = wedged.calls, st["rollout/retried_requests"]
    assert [r.response_ids for r in fleet.generate(PROMPTS, SamplingParams(max_new_tokens=2))] == WANT
    # out of rotation: never asked again, so nothing timed out or was re-sent this time
    assert wedged.calls == calls and fleet.stats()["rollout/retried_requests"] == retried


def test_a_lone_wedged_server_is_one_clear_error_not_six_timeouts(servers):
    wedged = servers()
    engine = SGLangEngine(url=wedged.url, request_timeout_s=1.5, max_retries=5, backoff_s=0.01)
    wedged.wedge()
    t0 = time.monotonic()
    with pytest.raises(EngineError) as err:
        engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=2))
    elapsed = time.monotonic() - t0
    assert 1.5 <= elapsed < HANG_S and wedged.calls == 1  # one timeout: not retried
    msg = str(err.value)
    assert "\n" not in msg and "no reply within 1.5 s (rollout.request_timeout_s)" in msg and wedged.url in msg


MALFORMED = {
    "not JSON": lambda req: (200, b"<html><body>502 Bad Gateway</body></html>"),
    "a JSON string": lambda req: (200, "ok"),
    "no output_ids": lambda req: (200, [{"text": "hi", "meta_info": {}} for _ in req["input_ids"]]),
    "too few results": lambda req: (200, _results(req)[:-1] if len(req["input_ids"]) > 1 else []),
    "ids without log-probs": lambda req: (200, [{**o, "meta_info": {"output_token_logprobs": []}}
                                                for o in _results(req)]),
    "a NaN log-prob": lambda req: (200, [{**o, "meta_info": {"output_token_logprobs": [[float("nan"), 0, None]] * 2}}
                                         for o in _results(req)]),
    "an id that is no integer": lambda req: (200, [{**o, "output_ids": ["a", 1]} for o in _results(req)]),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_reply_is_a_server_failure(servers, kind):
    bad, good = servers(MALFORMED[kind]), servers()
    lone = SGLangEngine(url=bad.url, backoff_s=0.01)
    with pytest.raises(EngineError, match="malformed") as err:
        lone.generate(PROMPTS[:3], SamplingParams(max_new_tokens=2))
    assert "\n" not in str(err.value) and bad.calls == 1  # one line; not retried
    fleet = FleetEngine([SGLangEngine(url=bad.url, backoff_s=0.01), SGLangEngine(url=good.url)], chunk_prompts=3)
    out = fleet.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    assert [r.response_ids for r in out] == WANT
    st = fleet.stats()
    assert st["rollout/dead_servers"] == 1 and "malformed" in fleet.dead_servers()[bad.url]


class _UpdateReplies(StrictSGLang):
    """The strict fake, with the reply to one weight-update route replaced."""

    def __init__(self, path, reply):
        super().__init__()
        self.path, self.reply = path, reply

    def post(self, path, body):
        if path == self.path:
            return self.reply
        return super().post(path, body)


WEIGHTS = [("model.layers.0.mlp.up_proj.weight", torch.randn(4, 3))]


@pytest.mark.parametrize("path", ["/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update"])
@pytest.mark.parametrize("reply", [(200, b"OK"), (200, {}), (200, {"message": "Success"}),
                                   (200, {"success": "yes"}), (200, "Success")],
                         ids=["not-json", "empty-object", "no-success", "success-not-true", "json-string"])
def test_a_weight_update_needs_a_well_formed_success_reply(fake_sglang, path, reply):
    routes = _UpdateReplies(path, reply)
    engine = SGLangEngine(url=fake_sglang(routes=routes).url)
    with pytest.raises(EngineError, match=f"(?s)POST {path} at .*malformed reply"):
        engine.update_weights(WEIGHTS, version="3")
    assert routes.memory.engine_paused is False  # generation was continued after the failed update
    assert engine.weight_version() == "default"  # the failed update did not set the version


def test_weight_updates_fail_over_on_a_non_json_reply_and_disk_updates_too(fake_sglang):
    ok = StrictSGLang()
    bad = _UpdateReplies("/update_weights_from_tensor", (200, b"OK"))
    good_engine, bad_engine = SGLangEngine(url=fake_sglang(routes=ok).url), SGLangEngine(url=fake_sglang(routes=bad).url)
    good_engine.update_weights(WEIGHTS, version="1")  # a well-formed success reply: a success
    assert good_engine.weight_version() == "1" and ok.updates == 1
    fleet = FleetEngine([bad_engine, good_engine])
    fleet.update_weights(iter(WEIGHTS), version="2")
    assert fleet.stats()["rollout/dead_servers"] == 1 and "malformed" in fleet.dead_servers()[bad_engine.url]
    assert good_engine.weight_version() == "2" and ok.updates == 2
    disk = SGLangEngine(url=fake_sglang(routes=_UpdateReplies("/update_weights_from_disk", (200, b"done"))).url)
    with pytest.raises(EngineError, match="update_weights_from_disk .*malformed reply"):
        disk.update_weights_from_disk("/ckpt/hf_10")


def test_the_rollout_deadline_cuts_a_call_short_and_is_no_server_failure(servers):
    a, b = servers(), servers()
    engines = [SGLangEngine(url=s.url, request_timeout_s=60.0) for s in (a, b)]
    a.wedge()
    b.wedge()
    fleet = FleetEngine(engines, chunk_prompts=2)
    t0 = time.monotonic()
    with pytest.raises(RolloutDeadline):
        fleet.generate(PROMPTS, SamplingParams(max_new_tokens=2), deadline=time.monotonic() + 1.5)
    assert 1.5 <= time.monotonic() - t0 < HANG_S  # at the deadline, not the 60 s request timeout
    assert fleet.stats()["rollout/dead_servers"] == 0  # a deadline is no server failure
    t0 = time.monotonic()
    with pytest.raises(RolloutDeadline):
        engines[0].generate(PROMPTS[:2], SamplingParams(max_new_tokens=2), deadline=time.monotonic() + 1.0)
    assert 1.0 <= time.monotonic() - t0 < HANG_S
    with pytest.raises(RolloutDeadline):  # already past: nothing is sent
        engines[1].generate(PROMPTS[:2], SamplingParams(max_new_tokens=2), deadline=time.monotonic() - 1)


def test_agent_loop_ends_unfinished_trajectories_at_the_deadline(servers, qwen_tokenizer):
    """Search-QA, 4 trajectories: at step 0 the server answers trajectory 0 with an answer (its episode ends) and
    the others with a search; at step 1 it stops answering. The rollout deadline ends the three still running as
    deadline failures; trajectory 0 is kept."""
    from opid_mega.envs import make_env
    from opid_mega.rollout.agent_loop import AgentLoop

    answer = qwen_tokenizer("<answer>Paris</answer>", add_special_tokens=False)["input_ids"]
    search = qwen_tokenizer("<search>capital of France</search>", add_special_tokens=False)["input_ids"]

    def reply(req):
        if server.calls > 1:
            server.wedge()
            server.release.wait(120)
            return 503, {}
        outs = []
        for k, _ in enumerate(req["input_ids"]):
            ids = answer if k == 0 else search
            outs.append({"output_ids": ids, "meta_info": {"finish_reason": {"type": "stop"},
                                                          "output_token_logprobs": [[-0.1, t, None] for t in ids]}})
        return 200, outs

    server = servers(reply)
    env = make_env("search_qa")
    tasks = env.tasks("train", n=1, seed=0)
    loop = AgentLoop(SGLangEngine(url=server.url, request_timeout_s=60.0), qwen_tokenizer, env_name="search_qa",
                     num_workers=2, stop_token_ids=[0])
    try:
        t0 = time.monotonic()
        batch = loop.run(tasks, 4, SamplingParams(max_new_tokens=16, stop_token_ids=(0,)), deadline_s=3.0)
        elapsed = time.monotonic() - t0
    finally:
        loop.close()
    print(f"agent loop with the deadline at 3 s: {elapsed:.1f} s")
    assert 3.0 <= elapsed < HANG_S  # ended at the deadline, not by the 60 s request timeout
    first, *rest = batch.trajectories
    assert not first.deadline_failure and first.error is None and len(first.steps) == 1
    assert all(t.deadline_failure and not t.env_error and len(t.steps) == 1 for t in rest)
    assert all("rollout.deadline_s=3 s passed at step 1" in t.error for t in rest)
    with pytest.raises(ValueError, match="deadline_s must be a finite number > 0"):
        loop.run(tasks, 1, SamplingParams(), deadline_s=float("inf"))

