"""The embedded local engine against float64 recomputations of the same model."""
import pytest
import torch

from opid_mega.models import load_model
from opid_mega.rollout.engine import (FINISH_LENGTH, FINISH_STOP, EngineError, GenerationResult, RolloutEngine,
                                      SamplingParams)
from opid_mega.rollout.factory import make_engine
from opid_mega.rollout.local_engine import LocalEngine, sample_from_logits
from tolerance import assert_close_scaled


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    return LocalEngine(tiny_qwen3)


@pytest.fixture(scope="module")
def model64(tiny_qwen3):
    return load_model(tiny_qwen3, dtype="float64")


def _prompts(seed=0, lengths=(7, 12, 3)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 151000, (n,), generator=g).tolist() for n in lengths]


def _reference_logprobs(model64, prompt, response, temperature):
    """float64 log-probs of the response tokens given the prompt, under log_softmax(logits / T)."""
    with torch.no_grad():
        logits = model64(torch.tensor([prompt + response])).logits[0].double()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)
    n = len(prompt)
    return torch.tensor([lp[n - 1 + j, tok].item() for j, tok in enumerate(response)], dtype=torch.float64)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.4, 0.9)])
def test_logprobs_match_float64_recomputation(engine, model64, temperature, top_p):
    prompts = _prompts()
    results = engine.generate(prompts, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=6, seed=3))
    for p, r in zip(prompts, results):
        assert len(r.response_ids) == len(r.logprobs) == 6 and r.finish_reason == FINISH_LENGTH
        ref = _reference_logprobs(model64, p, r.response_ids, temperature)
        assert_close_scaled(r.logprobs, ref, msg="engine vs float64")  # fp32: 1e-5 of the largest |log-prob|
        if temperature == 0.0:  # greedy picks the float64 argmax
            with torch.no_grad():
                logits = model64(torch.tensor([p + r.response_ids])).logits[0]
            assert logits[len(p) - 1:-1].argmax(-1).tolist() == r.response_ids


def test_batched_equals_unbatched(engine):
    prompts = _prompts(seed=1, lengths=(5, 17, 2))
    for sp in (SamplingParams(temperature=0.0, max_new_tokens=4), SamplingParams(temperature=1.0, max_new_tokens=4,
                                                                                 seed=11)):
        batched = engine.generate(prompts, sp)
        for i, p in enumerate(prompts):
            single_sp = SamplingParams(temperature=sp.temperature, max_new_tokens=4,
                                       seed=None if sp.seed is None else sp.seed + i)  # row i uses seed + i
            single = engine.generate([p], single_sp)[0]
            assert single.response_ids == batched[i].response_ids
            assert_close_scaled(single.logprobs, batched[i].logprobs, msg=f"row {i}")  # two fp32 paths


def test_seeded_sampling_is_reproducible_and_small_batches_chunk(tiny_qwen3):
    small = LocalEngine(tiny_qwen3, max_batch_size=2)
    prompts = _prompts(seed=2, lengths=(4, 6, 8))
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, seed=5)
    a, b = small.generate(prompts, sp), small.generate(prompts, sp)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    assert isinstance(small, RolloutEngine)


def test_stop_token_ends_a_row(engine):
    prompts = _prompts(seed=4, lengths=(6, 6))
    free = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6))
    stop = free[0].response_ids[2]
    stopped = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[stop]))
    first = free[0].response_ids.index(stop)
    assert stopped[0].response_ids == free[0].response_ids[:first + 1] and stopped[0].finish_reason == FINISH_STOP
    assert_close_scaled(stopped[0].logprobs, free[0].logprobs[:first + 1], msg="stopped row")
    if stop not in free[1].response_ids:
        assert stopped[1].response_ids == free[1].response_ids and stopped[1].finish_reason == FINISH_LENGTH


def test_update_weights_changes_outputs_and_matches_reference(tiny_qwen3, model64):
    eng = make_engine("local", tiny_qwen3)
    prompts = _prompts(seed=5)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    before = eng.generate(prompts, sp)
    g = torch.Generator().manual_seed(9)
    new = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype)
           for n, p in eng.model.named_parameters()}
    eng.update_weights(iter(new.items()))  # streamed
    after = eng.generate(prompts, sp)
    assert any(a.response_ids != b.response_ids for a, b in zip(after, before))
    # The updated engine is exactly the model with the new weights.
    ref = load_model(tiny_qwen3, dtype="float64")
    ref.load_state_dict({k: v.double() for k, v in new.items()}, strict=False)
    for p, r in zip(prompts, after):
        assert_close_scaled(r.logprobs, _reference_logprobs(ref, p, r.response_ids, 0.0), msg="updated engine")
    with pytest.raises(EngineError, match="no tensor named 'model.nope'"):
        eng.update_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(EngineError, match="model.norm.weight has shape"):
        eng.update_weights([("model.norm.weight", torch.zeros(3))])
    eng.shutdown()
    assert not eng.health()
    with pytest.raises(EngineError, match="after shutdown"):
        eng.generate(prompts, sp)


def test_sampler_top_p_and_temperature_against_float64():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    reps = 200
    batch = logits.repeat(reps, 1)  # row r is logits[r % 3]
    sp = SamplingParams(temperature=0.7, top_p=0.5, seed=0)
    gens = [torch.Generator().manual_seed(i) for i in range(batch.shape[0])]
    counts = torch.zeros(3, 50)
    for _ in range(2):
        tokens, lps = sample_from_logits(batch, sp, gens)
        counts.index_put_((torch.arange(batch.shape[0]) % 3, tokens), torch.ones(batch.shape[0]), accumulate=True)
        ref = torch.log_softmax(batch.double() / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
        assert_close_scaled(lps, ref, msg="sampler log-probs")
    probs = torch.softmax(logits.double() / 0.7, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < 0.5
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep_sorted)
    assert (counts[~keep] == 0).all()  # nothing outside the nucleus is ever sampled
    nucleus = torch.where(keep, probs, torch.zeros_like(probs))
    nucleus = nucleus / nucleus.sum(-1, keepdim=True)
    assert (counts / (2 * reps) - nucleus).abs().max() < 0.1  # and the nucleus is sampled in proportion


def test_bad_inputs_are_clear_errors(engine):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 200000]], SamplingParams())
    with pytest.raises(ValueError, match="log-probs"):
        GenerationResult([1, 2], [0.0])
    with pytest.raises(ValueError, match="unknown rollout engine"):
        make_engine("vllm", "x")
