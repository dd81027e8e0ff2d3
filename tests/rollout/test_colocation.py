"""Colocated memory (opid_mega.megatron.colocate) against a strict fake of SGLang 0.5.23's memory state machine
(tests/sglang_fake.py): the fake itself raises where SGLang raises; the colocation hooks, forced on without CUDA, run
the trainer's phase order (rollout, release, optimizer back, update, optimizer out, weights back, sync, KV cache and
CUDA graphs back, probe decode) for two iterations through real SGLangEngine HTTP clients, and an interrupted run
leaves an attached server serving."""
import types

import pytest
import torch

from opid_mega.config import Config
from opid_mega.megatron.colocate import Colocation
from opid_mega.rollout.engine import EngineError, SamplingParams
from opid_mega.rollout.fleet import FleetEngine
from opid_mega.rollout.sglang_engine import SGLangEngine
from sglang_fake import ALL_TYPES, SGLangMemory, ServerDied, StrictSGLang

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=2)


def test_the_fake_raises_where_sglang_raises():
    m = SGLangMemory()
    with pytest.raises(ServerDied, match="KeyError: 'kv_cache'"):  # resume of a tag never released
        m.resume(["kv_cache"])
    with pytest.raises(ServerDied, match="the server is down"):  # a dead scheduler answers nothing any more
        m.decode()

    m = SGLangMemory()
    m.release(None)  # None: every region
    assert m.offload_tags == set(ALL_TYPES) == m.paused
    m.resume(["weights"])
    assert m.offload_tags == {"kv_cache", "cuda_graph"}
    m.write_weights()  # the weights are back: an update may write them
    with pytest.raises(ServerDied, match="illegal memory access .*decode"):  # KV cache / graphs still released
        m.decode()

    m = SGLangMemory()
    m.release(["kv_cache"])
    with pytest.raises(ServerDied, match="already paused"):  # torch_memory_saver: a double pause raises
        m.release(["kv_cache"])

    m = SGLangMemory()
    m.running = 1
    with pytest.raises(ServerDied, match="only when server is idle"):
        m.release(["kv_cache"])

    m = SGLangMemory()
    m.release(["weights"])
    with pytest.raises(ServerDied, match="weight update with \\['weights'\\] released"):
        m.write_weights()

    m = SGLangMemory(memory_saver=False)  # no --enable-memory-saver: nothing is paused, but the tag set still raises
    m.release(None)
    m.decode()
    m.resume(None)
    with pytest.raises(ServerDied, match="KeyError"):
        m.resume(["cuda_graph"])


def test_a_dead_fake_server_refuses_every_request(fake_sglang):
    strict = StrictSGLang()
    server = fake_sglang(routes=strict)
    e = SGLangEngine(url=server.url, max_retries=1, backoff_s=0.01, backoff_max_s=0.01)
    with pytest.raises(EngineError, match="KeyError"):
        e.resume_memory(["kv_cache"])
    with pytest.raises(EngineError):
        e.generate([[1]], GREEDY)
    assert strict.dead == "KeyError: 'kv_cache'"


def _cfg(**deploy):
    cfg = Config()
    cfg.deploy.mode = "colocated"
    for k, v in deploy.items():
        setattr(cfg.deploy, k, v)
    return cfg


def _policy():
    """A real torch Adam with state (what Colocation moves): two steps on a small parameter."""
    p = torch.nn.Parameter(torch.randn(64, 8, generator=torch.Generator().manual_seed(0)))
    opt = torch.optim.Adam([p], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        (p ** 2).sum().backward()
        opt.step()
    return types.SimpleNamespace(optimizer=opt)


def _moments(policy):
    st = next(iter(policy.optimizer.state.values()))
    return {k: v for k, v in st.items() if v.dim() > 0}


def _servers(fake_sglang, n):
    stricts = [StrictSGLang() for _ in range(n)]
    servers = [fake_sglang(routes=s) for s in stricts]
    engines = [SGLangEngine(url=s.url, max_retries=1, backoff_s=0.01, backoff_max_s=0.01) for s in servers]
    return stricts, engines


def _tags(stricts):
    return [s.memory.offload_tags for s in stricts]


@pytest.mark.parametrize("n_servers", [1, 2])
def test_colocation_sequence_against_strict_sglang(fake_sglang, n_servers):
    stricts, engines = _servers(fake_sglang, n_servers)
    engine = engines[0] if n_servers == 1 else FleetEngine(engines)
    policy = _policy()
    before = {k: v.clone() for k, v in _moments(policy).items()}
    co = Colocation(_cfg(), policy, engine, force=True)
    for it in range(2):  # the phases of Trainer.iteration, in its order
        co.before_rollout()
        engine.generate([[1, 2]] * 3, GREEDY)  # rollout
        co.after_rollout()
        assert _tags(stricts) == [set(ALL_TYPES)] * n_servers  # the servers hold nothing during training
        # ... reference, scoring, PPO update (the optimizer state is on the training device)
        co.before_sync()
        assert _tags(stricts) == [{"kv_cache", "cuda_graph"}] * n_servers  # weights back for the sync
        for e in engines:  # the weight sync writes into the resumed weights
            e.update_weights([("w", torch.ones(4))], version=str(it + 1), flush_cache=True)
        co.after_sync()  # before the probe decodes
        assert _tags(stricts) == [set()] * n_servers
        engine.generate([[3]], GREEDY)  # the sync's probe check
    assert all(s.dead is None for s in stricts), [s.dead for s in stricts]
    assert all(s.updates == 2 for s in stricts) and sum(s.generated for s in stricts) >= 4
    for k, v in _moments(policy).items():  # the optimizer state went out and back unchanged
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    # every resume names only tags released before (never the whole default set)
    for s in stricts:
        for kind, tags in s.memory.calls:
            assert tags, (kind, tags)


def test_an_interrupted_run_leaves_an_attached_server_serving(fake_sglang):
    stricts, engines = _servers(fake_sglang, 1)
    co = Colocation(_cfg(), _policy(), engines[0], force=True)
    co.before_rollout()
    co.after_rollout()  # Ctrl-C during the PPO update: the server holds nothing
    co.close()
    assert stricts[0].memory.offload_tags == set() and stricts[0].dead is None
    engines[0].generate([[1]], GREEDY)  # the next user of the attached server can decode
    co.close()  # idempotent: nothing released, nothing resumed
    assert stricts[0].dead is None
    # interrupted between the weights' resume and the sync: the KV cache and graphs come back
    co.after_rollout()
    co.before_sync()
    co.close()
    assert stricts[0].memory.offload_tags == set() and stricts[0].dead is None


def test_colocation_is_a_no_op_without_cuda_unless_forced(fake_sglang):
    stricts, engines = _servers(fake_sglang, 1)
    co = Colocation(_cfg(), _policy(), engines[0])
    for hook in (co.before_rollout, co.after_rollout, co.before_sync, co.after_sync, co.close):
        hook()
    assert stricts[0].memory.calls == []
    co = Colocation(_cfg(release_engine_memory=False), _policy(), engines[0], force=True)
    for hook in (co.before_rollout, co.after_rollout, co.before_sync, co.after_sync, co.close):
        hook()
    assert stricts[0].memory.calls == []
