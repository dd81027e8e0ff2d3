"""Multi-rank check that the fork scorer equals the naive scorer on a random tiny Megatron model.

`python _fork_worker.py OUT.json WORLD` spawns WORLD gloo ranks; every rank runs the layouts listed in LAYOUTS for
that world size, and rank 0 writes the max abs differences (per layout and placement) to OUT.json.
"""
import json
import random
import sys

import torch

LAYOUTS = {1: [(1, 1)], 2: [(1, 1), (2, 1), (1, 2)]}


def make_requests(rng: random.Random, vocab: int, placement: str, additive: bool):
    from opid_mega.scoring.scorer import ScoreRequest

    reqs = []
    shared_prompt = [rng.randrange(vocab) for _ in range(rng.randint(6, 14))]
    for i in range(7):
        prompt = list(shared_prompt) if i < 3 else [rng.randrange(vocab) for _ in range(rng.randint(2, 16))]
        n = len(prompt)
        ep_at = rng.randint(1, n)
        st_at = rng.choice([n, rng.randint(ep_at, n)])  # often an empty tail
        if placement == "late":
            ep_at = st_at
        resp = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 5, 9]))]
        sec = lambda: [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]  # noqa: E731
        if additive or i % 3 == 0:
            skills = {"episode": (ep_at, sec()), "step": (st_at, sec())}
        elif i % 3 == 1:
            skills = {"episode": (ep_at, sec())}
        else:
            skills = {"step": (st_at, sec())}
        reqs.append(ScoreRequest(prompt, resp, skills))
    return reqs


def run_rank(out_path: str):
    import torch.distributed as dist
    from transformers import Qwen3Config

    from opid_mega.megatron import parallel
    from opid_mega.megatron.logprobs import PackedBatch, Sample, compute_logprobs
    from opid_mega.megatron.model import build_model, transformer_config
    from opid_mega.scoring.scorer import ForkScorer
    from opid_mega.scoring.scorer import NaiveScorer, score_requests

    hf = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                     tie_word_embeddings=False)
    results = {}
    for tp, pp in LAYOUTS[int(__import__("os").environ["WORLD_SIZE"])]:
        parallel.initialize(tp=tp, pp=pp, seed=7)
        chunks = build_model(hf, transformer_config(hf, tp=tp, pp=pp))

        def naive_fn(seqs, temperature):
            return compute_logprobs(chunks, [Sample(t, s) for t, s in seqs], max_tokens=64, temperature=temperature)

        def packed_fn(mbs, temperature):
            batches = [PackedBatch.from_micro_batch(mb) for mb in mbs]
            return [compute_logprobs(chunks, None, batches=[b], temperature=temperature)[0] for b in batches]

        # (placement, additive, sampling temperature): T=0.7 scores every context at logits / 0.7 in both scorers
        cases = [(p, a, 1.0) for p in ("faithful", "late") for a in (False, True)] + [("faithful", False, 0.7)]
        for placement, additive, temp in cases:
            rng = random.Random(11 + tp * 10 + pp + additive)
            reqs = make_requests(rng, hf.vocab_size, placement, additive)
            naive = score_requests(NaiveScorer(naive_fn, temperature=temp), reqs)
            fork_scorer = ForkScorer(packed_fn, max_tokens=96, temperature=temp)
            fork = score_requests(fork_scorer, reqs)
            diff = size = 0.0  # max |naive - fork| and the largest |log-prob| compared (the test scales by it)
            for a, b in zip(naive, fork):
                assert a.orig.shape == b.orig.shape and set(a.skill) == set(b.skill)
                diff = max(diff, (a.orig - b.orig).abs().max().item())
                size = max(size, a.orig.abs().max().item())
                for k in a.skill:
                    diff = max(diff, (a.skill[k] - b.skill[k]).abs().max().item())
                    size = max(size, a.skill[k].abs().max().item())
            key = f"tp{tp}pp{pp}-{placement}-{'additive' if additive else 'routed'}" + \
                ("" if temp == 1.0 else f"-T{temp}")
            results[key] = {"max_abs_diff": diff, "max_abs_logprob": size,
                            "shared_fraction": fork_scorer.last_shared_fraction,
                            "n_values": sum(r.orig.numel() for r in naive)}
            if temp != 1.0:  # the temperature really reaches the model: T=1 gives other numbers
                plain = score_requests(NaiveScorer(naive_fn, temperature=1.0), reqs)
                results[key]["temperature_effect"] = max((a.orig - b.orig).abs().max().item()
                                                         for a, b in zip(naive, plain))
        parallel.parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    parallel.destroy()


if __name__ == "__main__":
    from opid_mega.megatron.parallel import spawn

    spawn(int(sys.argv[2]), run_rank, sys.argv[1], timeout_s=400)
