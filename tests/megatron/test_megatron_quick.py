"""In-process (single rank, gloo) tests of the Megatron backend against HF transformers in float64."""
import pytest
import torch

from megatron_testutil import ARCHS, hf_logprobs, make_hf_model, random_sequences
from tolerance import assert_close_scaled

pytest.importorskip("megatron.core")


def _megatron(hf_dir, tp=1, pp=1):
    from transformers import AutoConfig

    from opid_mega.megatron import weights
    from opid_mega.megatron.model import build_model, transformer_config

    cfg = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model(cfg, transformer_config(cfg, tp=tp, pp=pp))
    weights.load_hf_weights(chunks, cfg, hf_dir)
    return cfg, chunks


# ---------------------------------------------------------------- pure helpers (no process group needed)
def test_plain_batches_rows_values_sample_order_and_padding():
    """plain_batches (the batch builder's plain layout): rows, targets and positions of each packed sequence, the
    Samples' values scattered to their rows (a key only when every sample has it; loss_mask ones by default), and
    unpack / gathered between the gathered order (largest first over micro-batches) and the samples' order."""
    import numpy as np

    from opid_mega.megatron.logprobs import Sample, empty_batch, pad_batch, plain_batches

    pb = plain_batches([Sample([9, 10], 1, advantages=[3.0], old_logprobs=[0.3], loss_mask=[0.0]),
                        Sample([5, 6, 7, 8], 2, advantages=[1.0, 2.0], old_logprobs=[0.1, 0.2])], 64)
    (b,) = pb.batches
    assert b.input_ids.tolist() == [[9, 10, 5, 6, 7, 8]]
    assert b.position_ids.tolist() == [[0, 1, 0, 1, 2, 3]]
    assert b.cu_seqlens.tolist() == [0, 2, 6] and b.branch_ids is None
    assert b.score_rows.tolist() == [0, 3, 4] and b.score_targets.tolist() == [10, 7, 8]
    assert b.scored_per_seq == [1, 2]
    assert b.extras["advantages"].tolist() == [3.0, 1.0, 2.0]
    assert torch.allclose(b.extras["old_logprobs"], torch.tensor([0.3, 0.1, 0.2]))
    assert b.extras["loss_mask"].tolist() == [0.0, 1.0, 1.0]
    # two micro-batches: the longest sequence goes first, so unpack puts the gathered values back in sample order
    pb = plain_batches([Sample([9, 10], 1, advantages=[3.0]), Sample([5, 6, 7, 8], 2, advantages=[1.0, 2.0]),
                        Sample([1, 2, 3, 4, 5], 4, advantages=[4.0])], 6)
    assert [x.input_ids.tolist() for x in pb.batches] == [[[1, 2, 3, 4, 5]], [[9, 10, 5, 6, 7, 8]]]
    assert [x.extras["advantages"].tolist() for x in pb.batches] == [[4.0], [3.0, 1.0, 2.0]]
    assert pb.samples.tolist() == [0, 1, 2] and pb.resp_lens.tolist() == [1, 2, 1]
    assert pb.gather_index.tolist() == [1, 2, 3, 0]
    assert [t.tolist() for t in pb.unpack([x.score_targets for x in pb.batches])] == [[10], [7, 8], [5]]
    assert pb.gathered(torch.tensor([10, 7, 8, 5])).tolist() == [5, 10, 7, 8]
    assert "advantages" not in plain_batches([Sample([5, 6, 7], 1, advantages=[1.0, 2.0]), Sample([9, 10], 1)],
                                             64).batches[0].extras  # the second sample has none
    p = pad_batch(b, 9)
    assert p.input_ids.shape == (1, 9) and p.cu_seqlens.tolist() == [0, 2, 6, 9]
    assert p.position_ids[0, 6:].tolist() == [0, 1, 2] and p.score_rows.tolist() == [0, 3, 4]
    assert empty_batch().scored_per_seq == []
    none = plain_batches([], 8)
    assert len(none.batches) == 1 and none.batches[0].score_rows.numel() == 0 and none.unpack([]) == []
    with pytest.raises(ValueError, match="score_from"):
        Sample([1, 2], 0)
    with pytest.raises(ValueError, match="advantages has 1 values"):
        plain_batches([Sample([1, 2, 3], 1, advantages=[1.0])], 8)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        plain_batches([Sample([1, 2, 3], 1)], 0)
    with pytest.raises(ValueError, match="rank 2"):
        plain_batches([Sample([1, 2, 3], 1)], 8, 2, 2)
    with pytest.raises(ValueError, match="unknown value 'x'"):
        plain_batches([Sample([1, 2, 3], 1)], 8, values={"x": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\), expected \(2,\)"):
        plain_batches([Sample([1, 2, 3], 1)], 8, values={"advantages": np.zeros(3, np.float32)})


@pytest.mark.parametrize("num_ranks", [1, 3])
def test_plain_batches_budget_values_and_sample_order(num_ranks):
    """Random sequences: every micro-batch within the budget (raised to the longest sequence, which then fills one
    alone), each rank's samples disjoint and all of them scored once, every value on its token's row, and unpack
    giving each sample's targets back in sample order; the array input gives the same batches as the Samples."""
    import numpy as np

    from opid_mega.megatron.logprobs import Sample, plain_batches

    g = torch.Generator().manual_seed(9)
    lens = torch.randint(2, 30, (40,), generator=g).tolist() + [70]  # one sequence longer than the budget
    samples = []
    for i, n in enumerate(lens):
        k = int(torch.randint(1, n + 1, (1,), generator=g))  # n - k = 0 scored tokens happens too
        t = torch.randint(0, 1000, (n,), generator=g).tolist()
        samples.append(Sample(t, k, old_logprobs=[float(x) for x in t[k:]], advantages=[float(i)] * (n - k),
                              loss_mask=[float(j % 2) for j in range(n - k)]))
    budget, seen = 50, []
    for rank in range(num_ranks):
        pb = plain_batches(samples, budget, num_ranks, rank)
        assert len(pb.batches) == len(plain_batches(samples, budget, num_ranks, 0).batches)  # equal on every rank
        for b in pb.batches:
            assert b.input_ids.shape[1] <= 70 and b.cu_seqlens[-1] == b.input_ids.shape[1]
            assert b.input_ids[0, b.score_rows + 1].tolist() == b.score_targets.tolist()  # row r predicts r + 1
            assert b.extras["old_logprobs"].tolist() == b.score_targets.float().tolist()
            assert sum(b.scored_per_seq) == b.score_rows.numel()
            for seq, adv in enumerate(b.extras["advantages"].split(b.scored_per_seq)):
                assert adv.numel() == 0 or (adv == adv[0]).all(), seq  # one sample's values stay together
            if 70 in torch.diff(b.cu_seqlens).tolist():
                assert b.cu_seqlens.tolist() == [0, 70]  # the long sequence alone
        assert np.all(np.diff(pb.samples) > 0)
        targets = pb.unpack([b.score_targets for b in pb.batches])
        masks = pb.unpack([b.extras["loss_mask"] for b in pb.batches])
        for i, t, m in zip(pb.samples, targets, masks):
            s = samples[i]
            assert t.tolist() == list(s.tokens[s.score_from:]) and m.tolist() == s.loss_mask
        flat = torch.cat([b.score_targets for b in pb.batches])
        assert torch.equal(pb.gathered(torch.cat(targets) if targets else flat[:0]), flat)
        seen.extend(pb.samples.tolist())
    assert sorted(seen) == list(range(len(samples)))
    if num_ranks == 1:
        assert sum(b.input_ids.shape[1] for b in pb.batches) == sum(lens)
        assert any(b.cu_seqlens.tolist() == [0, 70] for b in pb.batches)
        assert max(b.input_ids.shape[1] for b in pb.batches) <= 70 and len(pb.batches) > sum(lens) // 70
    lens_a = np.array(lens)
    resp = np.array([s.n_scored for s in samples])
    arrays = plain_batches((np.concatenate([s.tokens for s in samples]), np.concatenate([[0], np.cumsum(lens_a)]),
                            resp), budget, num_ranks, 0,
                           values={"advantages": np.concatenate([s.advantages for s in samples])})
    ref = plain_batches(samples, budget, num_ranks, 0)
    assert np.array_equal(arrays.gather_index, ref.gather_index)
    for a, b in zip(arrays.batches, ref.batches):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.score_rows, b.score_rows)
        assert torch.equal(a.extras["advantages"], b.extras["advantages"]) and "old_logprobs" not in a.extras
        assert a.extras["loss_mask"].eq(1).all()


def test_qkv_merge_split_roundtrip_gqa():
    from opid_mega.megatron.weights import _qkv_merge, _qkv_split

    a = dict(kv_heads=2, head_dim=3, heads=6)
    q, k, v = torch.randn(18, 5), torch.randn(6, 5), torch.randn(6, 5)
    full = _qkv_merge(q, k, v, a)
    # group 0 holds q heads 0..2, then k head 0, then v head 0
    assert torch.equal(full[:9], q[:9]) and torch.equal(full[9:12], k[:3]) and torch.equal(full[12:15], v[:3])
    for x, y in zip(_qkv_split(full, a), (q, k, v)):
        assert torch.equal(x, y)


def test_config_errors(tmp_path):
    from transformers import LlamaConfig, Qwen2Config

    from opid_mega.megatron.model import arch_of, transformer_config

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000)
    with pytest.raises(ValueError, match="tp=4 must divide heads"):
        transformer_config(cfg, tp=4)
    with pytest.raises(ValueError, match="pp\\*vpp"):
        transformer_config(cfg, pp=2, vpp=2)
    with pytest.raises(ValueError, match="vocabulary size"):
        transformer_config(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=1001), tp=2)
    with pytest.raises(ValueError, match="attention_bias"):
        arch_of(LlamaConfig(attention_bias=True))
    bad = Qwen2Config()
    bad.model_type = "gpt2"
    with pytest.raises(ValueError, match="not supported"):
        arch_of(bad)
    a = arch_of(cfg)
    assert a["qkv_bias"] and not a["qk_norm"] and a["head_dim"] == 16 and a["kv_heads"] == 2


# ---------------------------------------------------------------- single rank against HF
@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_entropy_roundtrip_match_hf(arch, mp1, tmp_path):
    from opid_mega.megatron import weights
    from opid_mega.megatron.logprobs import Sample, compute_logprobs

    hf = make_hf_model(arch, str(tmp_path), layers=2)
    cfg, chunks = _megatron(str(tmp_path))
    seqs = random_sequences(1, [(9, 3), (17, 1), (6, 5), (12, 4)])
    lp, ent = compute_logprobs(chunks, [Sample(t, k) for t, k in seqs], max_tokens=30, return_entropy=True)
    for (t, k), a, e in zip(seqs, lp, ent):
        ref_lp, ref_ent = hf_logprobs(hf, t, k, entropy=True)
        assert a.dtype == torch.float32 and a.shape == ref_lp.shape
        assert_close_scaled(a, ref_lp, msg="log-probs vs HF float64")  # 1e-5 of the largest |log-prob|
        assert_close_scaled(e, ref_ent, msg="entropy vs HF float64")
    sd = weights.hf_state_dict(chunks, cfg)
    ref = hf.state_dict()
    if cfg.tie_word_embeddings:
        ref = {k: v for k, v in ref.items() if k != "lm_head.weight"}
    assert set(sd) == set(ref)
    for name, t in ref.items():
        assert torch.equal(sd[name], t), name


def test_fork_layout_equals_two_naive_passes_and_grad_path(mp1, tmp_path):
    """Shared prefix + two branches with their own positions == two separate sequences (both attention paths)."""
    from opid_mega.megatron.logprobs import PackedBatch, Sample, compute_logprobs

    make_hf_model("qwen3", str(tmp_path), layers=2)
    _, chunks = _megatron(str(tmp_path))
    g = torch.Generator().manual_seed(3)
    prefix, skill, tail, resp = (torch.randint(0, 1024, (n,), generator=g).tolist() for n in (7, 4, 3, 5))
    P, S, T, R = 7, 4, 3, 5
    ids = prefix + skill + tail + resp + tail + resp
    pos = list(range(P)) + list(range(P, P + S + T + R)) + list(range(P, P + T + R))
    br = [0] * P + [1] * (S + T + R) + [2] * (T + R)
    b_resp = P + S + T  # first response token of branch 1
    a_resp = P + S + T + R + T  # first response token of branch 2
    rows = [j - 1 for j in range(b_resp, b_resp + R)] + [j - 1 for j in range(a_resp, a_resp + R)]
    batch = PackedBatch(torch.tensor([ids]), torch.tensor([pos]), torch.tensor([0, len(ids)], dtype=torch.int32),
                        torch.tensor(rows), torch.tensor(resp + resp), [R, R],
                        branch_ids=torch.tensor(br, dtype=torch.int32))
    fork = compute_logprobs(chunks, [], batches=[batch])
    naive = compute_logprobs(chunks, [Sample(prefix + skill + tail + resp, P + S + T),
                                      Sample(prefix + tail + resp, P + T)])
    assert_close_scaled(fork[0], naive[0], msg="branch 1")
    assert_close_scaled(fork[1], naive[1], msg="branch 2")
    # the training path (grad enabled, branches: SDPA with each group's own mask) gives the same numbers
    model = chunks[0]
    out = model(batch.input_ids, batch.position_ids, None, packed_seq_params=batch.packed_seq_params(),
                score_rows=batch.score_rows, score_targets=batch.score_targets)
    assert out.requires_grad
    assert_close_scaled(out[0], torch.cat(naive), msg="training path")


def test_reference_swap_restores_weights(mp1, tmp_path):
    from opid_mega.megatron.logprobs import Sample, compute_logprobs
    from opid_mega.megatron.train_step import ReferenceWeights

    make_hf_model("llama", str(tmp_path), layers=2)
    _, chunks = _megatron(str(tmp_path))
    ref = ReferenceWeights(chunks)
    s = [Sample(random_sequences(4, [(10, 2)])[0][0], 2)]
    before = compute_logprobs(chunks, s)[0]
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(0.05 * torch.randn_like(p))
    moved = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    with ref.swapped_in(chunks):
        assert torch.equal(compute_logprobs(chunks, s)[0], before)
    for n, p in chunks[0].named_parameters():
        assert torch.equal(p, moved[n])
    assert (compute_logprobs(chunks, s)[0] - before).abs().max() > 1e-3
    with pytest.raises(ValueError, match="token ids must lie in \\[0, 1024\\)"):
        compute_logprobs(chunks, [Sample([1, 2, 1024], 1)])


def test_public_forward_step_and_loss_func_with_megatron_schedule(mp1, tmp_path):
    """The README integration path: our forward_step + ppo_loss_func handed to get_forward_backward_func."""
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from opid_mega.algo import kl_penalty, ppo_policy_loss
    from opid_mega.megatron.logprobs import Sample, forward_step, plain_batches
    from opid_mega.megatron.train_step import LossConfig, build_optimizer, ppo_loss_func, wrap_ddp

    hf = make_hf_model("qwen2", str(tmp_path), layers=2)
    cfg, chunks = _megatron(str(tmp_path))
    model = wrap_ddp(chunks, chunks[0].config)
    opt = build_optimizer(model, lr=1e-4)
    seqs = random_sequences(5, [(9, 3), (12, 2), (7, 4)])
    g = torch.Generator().manual_seed(0)
    samples = [Sample(t, k, old_logprobs=(-7 + torch.randn(len(t) - k, generator=g)).tolist(),
                      advantages=torch.randn(len(t) - k, generator=g).tolist(),
                      ref_logprobs=(-7 + torch.randn(len(t) - k, generator=g)).tolist()) for t, k in seqs]
    batches = plain_batches(samples, 21).batches  # 28 tokens: two micro-batches of <= 21
    assert len(batches) == 2
    loss_cfg = LossConfig(kl_coef=0.05, entropy_coef=0.0)
    step = partial(forward_step, loss_func=partial(ppo_loss_func, cfg=loss_cfg))
    model[0].zero_grad_buffer()
    opt.zero_grad()
    out = get_forward_backward_func()(forward_step_func=step, data_iterator=iter(batches), model=model[0],
                                      num_microbatches=2, seq_length=21, micro_batch_size=1, forward_only=False)
    ok, grad_norm, _ = opt.step()
    assert ok and grad_norm > 0
    loss_sum = sum(d["loss"][0] for d in out)
    ntok = sum(d["loss"][1] for d in out)
    lp = torch.cat([hf_logprobs(hf, t, k) for t, k in seqs])
    cat = lambda key: torch.tensor([x for s in samples for x in getattr(s, key)], dtype=torch.float64)  # noqa: E731
    pg, _ = ppo_policy_loss(lp, cat("old_logprobs"), cat("advantages"), torch.ones_like(lp))
    want = pg + 0.05 * kl_penalty(lp, cat("ref_logprobs")).mean()
    assert int(ntok) == lp.numel()
    assert_close_scaled(float(loss_sum / ntok), want.item(), floor=1.0)  # a mean of O(1) terms: scale >= 1


def test_logprobs_and_ppo_forward_at_the_sampling_temperature(mp1, tmp_path):
    """OPID.md: log-probs are computed at the sampling temperature (logits / T). The scoring forward (old log-probs,
    entropy) equals a float64 HF log_softmax(logits / T); the PPO training forward uses the same T: with old
    log-probs = the HF reference at T, the first mini-batch has approx-KL 0 and the loss is the PPO loss at T."""
    from opid_mega.algo import ppo_policy_loss
    from opid_mega.megatron.logprobs import Sample, compute_logprobs, plain_batches
    from opid_mega.megatron.train_step import LossConfig, build_optimizer, train_mini_batch, wrap_ddp

    T = 0.7
    hf = make_hf_model("qwen3", str(tmp_path), layers=2).double()
    _, chunks = _megatron(str(tmp_path))
    seqs = random_sequences(8, [(9, 3), (14, 2), (6, 4)])

    def ref_at(tokens, k, temp):  # float64: log_softmax(logits / temp) at the scored rows, and its entropy
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0] / temp, -1)
        rows = torch.arange(k - 1, len(tokens) - 1)
        return logp[rows, torch.tensor(tokens[k:])], -(logp[rows].exp() * logp[rows]).sum(-1)

    lp, ent = compute_logprobs(chunks, [Sample(t, k) for t, k in seqs], return_entropy=True, temperature=T)
    lp1 = compute_logprobs(chunks, [Sample(t, k) for t, k in seqs])
    for (t, k), a, e, a1 in zip(seqs, lp, ent, lp1):
        ref_lp, ref_ent = ref_at(t, k, T)
        assert_close_scaled(a, ref_lp, msg="log-probs at T")
        assert_close_scaled(e, ref_ent, msg="entropy at T")
        assert_close_scaled(a1, ref_at(t, k, 1.0)[0], msg="log-probs at T = 1")  # default: T = 1
        assert (a1.double() - ref_lp).abs().max() > 1e-3  # T really changes the numbers

    g = torch.Generator().manual_seed(2)
    old = [ref_at(t, k, T)[0] for t, k in seqs]
    samples = [Sample(t, k, old_logprobs=o.tolist(), advantages=torch.randn(len(o), generator=g).tolist())
               for (t, k), o in zip(seqs, old)]
    model = wrap_ddp(chunks, chunks[0].config)
    opt = build_optimizer(model, lr=0.0)
    adv = torch.tensor([a for s in samples for a in s.advantages], dtype=torch.float64)
    want, _ = ppo_policy_loss(torch.cat(old), torch.cat(old), adv, torch.ones_like(adv))
    m = train_mini_batch(model, opt, plain_batches(samples, 64).batches, LossConfig(kl_coef=0.0, entropy_coef=0.0, temperature=T))
    # approx-KL is a mean of (old - new) log-prob differences: 1e-6 of the log-probs' magnitude (it is one mean of
    # signed fp32 rounding errors, far below their max, and far below the 1e-4 that T = 1 gives below)
    assert_close_scaled(m["approx_kl"], 0.0, rel=1e-6, scale=float(torch.cat(old).abs().max()), msg="approx_kl")
    assert_close_scaled(m["loss"], want.item(), floor=1.0, msg="loss")  # a mean of O(1) terms: scale >= 1
    m1 = train_mini_batch(model, opt, plain_batches(samples, 64).batches, LossConfig(kl_coef=0.0, entropy_coef=0.0))  # T = 1: off
    assert abs(m1["approx_kl"]) > 1e-4


@pytest.mark.slow
def test_cpu_compat_keeps_hf_loading_intact_and_is_removable(tmp_path):
    """In a fresh process: after cpu_compat.apply(), an HF model loads with correct RoPE buffers, megatron-style
    device="cuda" factories land on the CPU, and remove() restores torch."""
    import subprocess
    import sys

    make_hf_model("llama", str(tmp_path), layers=1)
    code = f"""
import torch
orig = torch.zeros
from opid_mega.megatron import cpu_compat
assert cpu_compat.apply()
assert torch.zeros(2, device="cuda").device.type == "cpu" and torch.cuda.current_device() == torch.device("cpu")
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
rot = m.model.rotary_emb
assert torch.equal(rot.inv_freq, type(rot)(config=rot.config).inv_freq), "RoPE buffers corrupted"
cpu_compat.remove()
assert torch.zeros is orig
print("OK")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


@pytest.mark.parametrize("agg", ["token-mean", "token-mean-micro", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_ppo_loss_func_aggregations_match_algo_over_micro_batches(agg):
    """Summed over micro-batches and divided by the summed counts (megatron's per-token-loss convention), the
    loss equals opid_mega.algo's aggregation over the whole mini-batch, for every loss_agg."""
    from opid_mega.algo import agg_loss, kl_penalty, ppo_policy_loss
    from opid_mega.megatron.logprobs import Sample, plain_batches
    from opid_mega.megatron.train_step import LossConfig, ppo_loss_func

    g = torch.Generator().manual_seed(5)
    lens = [3, 1, 5, 4, 2, 6]
    samples, outs = [], []
    for n in lens:
        old = (torch.randn(n, generator=g) - 2).tolist()
        samples.append(Sample(list(range(n + 2)), 2, old_logprobs=old,
                              advantages=(torch.randn(n, generator=g) * 2).tolist(),
                              ref_logprobs=(torch.randn(n, generator=g) - 2).tolist(),
                              loss_mask=(torch.rand(n, generator=g) > 0.3).float().tolist()))
        outs.append(torch.stack([torch.tensor(old) + 0.3 * torch.randn(n, generator=g), torch.rand(n, generator=g)]))
    cfg = LossConfig(kl_coef=0.05, entropy_coef=0.01, loss_agg=agg)
    total, count = 0.0, 0.0
    micro = ([0, 1], [2], [3, 4, 5])  # three micro-batches
    for idx in micro:
        pb = plain_batches([samples[i] for i in idx], 64)  # one micro-batch; outputs in its gathered order
        (batch,) = pb.batches
        loss, cnt, _ = ppo_loss_func(batch, pb.gathered(torch.cat([outs[i] for i in idx], dim=1)), cfg)
        total, count = total + loss.item(), count + float(cnt)
    width = max(lens)
    pad = lambda vals: torch.stack([torch.nn.functional.pad(torch.as_tensor(v, dtype=torch.float64), (0, width - len(v)))  # noqa: E731
                                    for v in vals])
    logp, ent = pad([o[0] for o in outs]), pad([o[1] for o in outs])
    old, adv = pad([s.old_logprobs for s in samples]), pad([s.advantages for s in samples])
    ref, mask = pad([s.ref_logprobs for s in samples]), pad([s.loss_mask for s in samples])
    mids = torch.tensor([k for k, idx in enumerate(micro) for _ in idx]).unsqueeze(1).expand(-1, width)
    want, _ = ppo_policy_loss(logp, old, adv, mask, agg=agg, micro_ids=mids)
    want = want + 0.05 * agg_loss(kl_penalty(logp, ref, "low_var_kl"), mask, agg, micro_ids=mids) \
        - 0.01 * agg_loss(ent, mask, agg, micro_ids=mids)
    assert_close_scaled(total / count, want.item(), floor=1.0)  # fp32 vs float64; a mean of O(1) terms: scale >= 1


def test_builder_packed_training_step_equals_the_samples_path(mp1, tmp_path):
    """The trainer's micro-batches (TrainData -> C++ batch builder) give the same PPO step as train_mini_batch's
    Samples path (plain_batches: values from the Samples' fields) packed by another budget: equal loss metrics and
    gradients (two fp32 paths: within 1e-5 of each tensor's largest entry) on random sequences and values."""
    from opid_mega.megatron.logprobs import Sample, plain_batches
    from opid_mega.megatron.policy import TrainData
    from opid_mega.megatron.train_step import LossConfig, build_optimizer, train_mini_batch, wrap_ddp

    make_hf_model("qwen3", str(tmp_path), layers=2)
    _, chunks = _megatron(str(tmp_path))
    model = wrap_ddp(chunks, chunks[0].config)
    opt = build_optimizer(model, lr=0.0)  # lr 0: both steps start from the same weights
    seqs = random_sequences(11, [(9, 3), (14, 2), (6, 4), (20, 5), (3, 1)])
    g = torch.Generator().manual_seed(3)
    vals = {k: [torch.randn(len(t) - p, generator=g) - (2.0 if k != "advantages" else 0.0) for t, p in seqs]
            for k in ("old_logprobs", "advantages", "ref_logprobs")}
    cfg = LossConfig(kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
    samples = [Sample(t, p, **{k: v[i].tolist() for k, v in vals.items()}) for i, (t, p) in enumerate(seqs)]
    data = TrainData.from_sequences([t for t, _ in seqs], [len(t) - p for t, p in seqs],
                                    **{k: torch.cat(v).numpy() for k, v in vals.items()})
    grads = lambda: [p.main_grad.detach().clone() for p in model[0].parameters()]  # noqa: E731
    m_ref = train_mini_batch(model, opt, plain_batches(samples, 40).batches, cfg)
    g_ref = grads()
    batches = data.micro_batches(24)
    assert len(batches) > len(plain_batches(samples, 40).batches) > 1  # other packings
    assert sorted(n for b in batches for n in b.scored_per_seq) == sorted(len(t) - p for t, p in seqs)
    m_new = train_mini_batch(model, opt, batches, cfg)
    for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
        assert_close_scaled(m_new[k], m_ref[k], floor=1.0, msg=k)
    for i, (a, b) in enumerate(zip(grads(), g_ref)):
        assert_close_scaled(a, b, msg=f"grad of parameter {i}")
    assert sum(float(a.abs().sum()) for a in g_ref) > 0


def _hf_named_grads(chunks, hf_cfg):
    """The chunks' accumulated gradients (main_grad) under their HF names: exported like weights, through the same
    name/shape mapping (the parameters hold the gradients for the export, then get their values back)."""
    from opid_mega.megatron.weights import hf_state_dict

    params = [p for c in chunks for p in c.parameters()]
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(p.main_grad)
        grads = hf_state_dict(chunks, hf_cfg)
        for p, s in zip(params, saved):
            p.copy_(s)
    return grads


@pytest.mark.parametrize("agg,layout", [("token-mean-micro", "packed"), ("token-mean-micro", "micro_batch_size"),
                                        ("token-mean", "packed")])
def test_loss_agg_gradient_through_megatron_equals_the_hand_formula(mp1, tmp_path, agg, layout):
    """OPID.md "More reference facts", loss aggregation: two micro-batches with 3 and 1 valid response tokens.
    The reference's aggregation (token-mean-micro) is the mean of the micro-batches' token means,
    L = 1/2 [(l1 + l2 + l3)/3 + l4/1]; ours (token-mean) is one token mean, L = (l1 + l2 + l3 + l4)/4. The gradient
    of the real Megatron step (one process, fp32) equals the float64 gradient of that formula through the HF model,
    with l_t = -A_t exp(log p_t - log p_old,t) (ratios kept inside the clip range, so no clip binds). Layouts:
    "packed": one packed micro-batch per sequence; "micro_batch_size": both sequences in ONE packed micro-batch,
    the reference's micro-batches of train.micro_batch_size = 1 step-sample given by the loss weights."""
    from opid_mega.megatron.logprobs import Sample, plain_batches
    from opid_mega.megatron.policy import TrainData
    from opid_mega.megatron.train_step import (LossConfig, build_optimizer, loss_micro_batches, train_mini_batch,
                                               wrap_ddp)

    hf = make_hf_model("qwen2", str(tmp_path), layers=1)
    hf_cfg, chunks = _megatron(str(tmp_path))
    model = wrap_ddp(chunks, chunks[0].config)
    opt = build_optimizer(model, lr=0.0, clip_grad=0.0)  # lr 0, no clipping: main_grad is the raw gradient
    (ta, ka), (tb, kb) = random_sequences(21, [(7, 4), (5, 4)])  # 3 and 1 response tokens
    base = [hf_logprobs(hf, ta, ka).double(), hf_logprobs(hf, tb, kb).double()]
    g = torch.Generator().manual_seed(4)
    old = [b + 0.05 * torch.randn(len(b), generator=g, dtype=torch.float64) for b in base]
    adv = [torch.tensor([1.5, -2.0, 0.5], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)]
    samples = [Sample(t, k, old_logprobs=o.tolist(), advantages=a.tolist())
               for (t, k), o, a in zip(((ta, ka), (tb, kb)), old, adv)]
    if layout == "packed":
        batches = [plain_batches([s], 64).batches[0] for s in samples]
    else:
        data = TrainData.from_sequences([ta, tb], [3, 1], old_logprobs=torch.cat(old).float().numpy(),
                                        advantages=torch.cat(adv).float().numpy())
        batches = loss_micro_batches(data, 64, micro_batch_size=1)
        assert len(batches) == 1 and sorted(batches[0].scored_per_seq) == [1, 3]
    train_mini_batch(model, opt, batches, LossConfig(kl_coef=0.0, entropy_coef=0.0, loss_agg=agg))
    got = _hf_named_grads(chunks, hf_cfg)

    # float64 reference: the hand formula through the HF model
    hf = hf.double()
    hf.zero_grad()
    losses = []
    for (t, k), o, a in zip(((ta, ka), (tb, kb)), old, adv):
        logp = torch.log_softmax(hf(torch.tensor([t])).logits[0], -1)
        lp = logp[torch.arange(k - 1, len(t) - 1), torch.tensor(t[k:])]
        ratio = torch.exp(lp - o)
        assert bool(((ratio > 0.8) & (ratio < 1.2)).all())  # no clip binds: l_t = -A_t ratio_t
        losses.append(-a * ratio)
    l1, l2, l3 = losses[0]
    (l4,) = losses[1]
    L = 0.5 * ((l1 + l2 + l3) / 3 + l4 / 1) if agg == "token-mean-micro" else (l1 + l2 + l3 + l4) / 4
    L.backward()
    want = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    hf.float()
    assert set(want) <= set(got) and len(want) > 5
    for n, w in want.items():
        assert_close_scaled(got[n].double(), w, rel=1e-5, msg=n)  # fp32 vs float64, relative to the max
    assert max(float(w.abs().max()) for w in want.values()) > 0
