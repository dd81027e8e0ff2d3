"""Record, from a Megatron-LM checkout, where its argument parser stores each flag OPID reads, and the namespace it
parses for a Qwen2.5-7B command line: the facts tests/compat/test_megatron_lm_args.py checks OPID against.

    git -C Megatron-LM archive core_v0.19.0 megatron | tar -x -C /tmp/mlm-0.19.0
    python tests/compat/read_megatron_lm_args.py /tmp/mlm-0.19.0 core_v0.19.0 <commit>

Megatron-LM's own ``add_megatron_arguments`` and ``parse_args`` are imported from the checkout (its megatron-core
too) and run as they are; nothing is validated (``validate_args`` needs CUDA). The result is merged into
tests/compat/megatron_lm_args.json under the tag. On Python 3.11, ``typing.override`` (3.12) is taken from
typing_extensions so that checkouts from core_v0.17 on import.
"""
import argparse
import json
import os
import shlex
import sys
import typing
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "megatron_lm_args.json")
# Qwen2.5-7B (its HF config.json: hidden 3584, 28 layers, 28 heads, 4 KV heads, intermediate 18944, rms_norm_eps 1e-6,
# rope_theta 1e6, QKV bias, untied, vocab 152064) as Megatron-LM flags, tensor parallel 2, bf16.
QWEN25_7B = ("--num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28 "
             "--group-query-attention --num-query-groups 4 --kv-channels 128 --max-position-embeddings 32768 "
             "--seq-length 4096 --position-embedding-type rope --rotary-base 1000000 --normalization RMSNorm "
             "--norm-epsilon 1e-6 --swiglu --disable-bias-linear --add-qkv-bias --untie-embeddings-and-output-weights "
             "--hidden-dropout 0.0 --attention-dropout 0.0 --vocab-size 152064 --make-vocab-size-divisible-by 128 "
             "--bf16 --tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8 --lr 1e-6 "
             "--train-iters 10 --tokenizer-type NullTokenizer")


def _jsonable(v):
    try:
        json.dumps(v)
        return v
    except TypeError:
        return {"repr": repr(v)}


def read(checkout: str) -> dict:
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    sys.path.insert(0, checkout)
    warnings.filterwarnings("ignore")
    from megatron.training.arguments import add_megatron_arguments, parse_args

    from opid_mega.megatron.megatron_lm import MEGATRON_LM_FLAGS

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    by_flag = {o: a for a in parser._actions for o in a.option_strings}
    flags = {}
    for flag in sorted(set(MEGATRON_LM_FLAGS.values())):
        a = by_flag.get(flag)
        flags[flag] = None if a is None else dict(dest=a.dest, default=_jsonable(a.default))
    sys.argv = ["pretrain_gpt.py"] + shlex.split(QWEN25_7B)
    ns = parse_args()
    return dict(flags=flags, qwen2_5_7b=dict(argv=QWEN25_7B, namespace={k: _jsonable(v) for k, v in
                                                                        sorted(vars(ns).items())}))


def main() -> int:
    checkout, tag, commit = sys.argv[1:4]
    facts = json.load(open(FIXTURE)) if os.path.exists(FIXTURE) else {}
    facts[tag] = dict(commit=commit, **read(checkout))
    with open(FIXTURE, "w") as f:
        json.dump(facts, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"read_megatron_lm_args: {tag} ({commit[:12]}): {len(facts[tag]['flags'])} flags, "
          f"{len(facts[tag]['qwen2_5_7b']['namespace'])} namespace fields -> {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
