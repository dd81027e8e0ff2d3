"""opid-logprobs: per-token log-probs of given tokens with the Megatron backend (TP/PP/DP).

    opid-logprobs --model HF_DIR --input TOKENS.jsonl --tp N --pp M [--sequence-parallel] --out OUT.jsonl

Each input line is {"tokens": [...], "score_from": k}; each output line is the input object plus
"logprobs": [log p(tokens[j] | tokens[:j]) for j in k..len-1] (and "entropy" with --entropy).
Started plainly it spawns tp*pp*dp ranks itself (gloo on CPU, NCCL on GPU); under torchrun it uses the given world.
A layout that does not fit the model or the world (e.g. --tp 3 with 4 attention heads) is refused before any rank
starts: one line on stderr, exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _parse(argv):
    p = argparse.ArgumentParser(prog="opid-logprobs", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--input", required=True, help='JSONL: {"tokens": [...], "score_from": k} per line')
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1, help="data-parallel size when spawning ranks (ignored under torchrun)")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (needs --tp > 1)")
    p.add_argument("--max-tokens", type=int, default=4096, help="token budget of one packed micro-batch")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--entropy", action="store_true", help="also write per-token entropy")
    return p.parse_args(argv)


def _read_input(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                toks, k = obj["tokens"], int(obj["score_from"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise SystemExit(f"opid-logprobs: {path}:{n}: need {{\"tokens\": [...], \"score_from\": k}} ({e})")
            if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
                raise SystemExit(f"opid-logprobs: {path}:{n}: tokens must be a list of integers")
            if not 1 <= k <= len(toks):
                raise SystemExit(f"opid-logprobs: {path}:{n}: score_from={k} must be in [1, {len(toks)}]")
            rows.append(obj)
    return rows


def run(args) -> None:
    """One rank's work (torch.distributed env vars set)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from opid_mega.megatron import parallel, weights
    from opid_mega.megatron.logprobs import Sample, compute_logprobs
    from opid_mega.megatron.model import build_model, transformer_config
    from opid_mega.megatron.train_step import dp_shard

    rows = _read_input(args.input)
    parallel.initialize(args.tp, args.pp)
    try:
        hf = AutoConfig.from_pretrained(args.model)
        dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
        chunks = build_model(hf, transformer_config(hf, tp=args.tp, pp=args.pp, dtype=dtype,
                                                    sequence_parallel=args.sequence_parallel))
        weights.load_hf_weights(chunks, hf, args.model)
        mine = dp_shard(list(range(len(rows))))
        lp, ent = compute_logprobs(chunks, [Sample(rows[i]["tokens"], int(rows[i]["score_from"])) for i in mine],
                                   max_tokens=args.max_tokens, return_entropy=True)
        part = {}
        if ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage():
            part = {i: (a.tolist(), e.tolist()) for i, a, e in zip(mine, lp, ent)}
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(part, parts, dst=0)
        if dist.get_rank() == 0:
            merged = {k: v for p in parts for k, v in p.items()}
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                for i, row in enumerate(rows):
                    out = dict(row, logprobs=merged[i][0])
                    if args.entropy:
                        out["entropy"] = merged[i][1]
                    f.write(json.dumps(out) + "\n")
            os.replace(tmp, args.out)
    finally:
        parallel.destroy()


def layout_error(args) -> str | None:
    """The layout problem of these arguments on this world (None: fine), from the model's config.json alone."""
    from opid_mega.megatron.layout import LayoutError, layout_error as check, model_facts

    torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.tp * args.pp * args.dp
    if not torchrun and args.dp < 1:
        return f"dp={args.dp} must be an integer >= 1"
    try:
        facts = model_facts(args.model)
    except LayoutError as e:
        return str(e)
    return check(facts, tp=args.tp, pp=args.pp, sp=args.sequence_parallel, world=world)


def main(argv=None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    _read_input(args.input)  # fail fast, before any rank starts
    msg = layout_error(args)
    if msg:  # one line, no traceback, before any rank (or process group) starts
        if os.environ.get("RANK", "0") == "0":
            print(f"opid-logprobs: {msg}", file=sys.stderr)
        raise SystemExit(2)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        run(args)
        return
    from opid_mega.megatron.parallel import spawn

    spawn(args.tp * args.pp * args.dp, run, args)


if __name__ == "__main__":
    main()
