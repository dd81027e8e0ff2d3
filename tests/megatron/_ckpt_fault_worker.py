"""A tiny megatron-core model in one gloo process, for the checkpoint fault tests (test_checkpoint_integrity.py).

    python _ckpt_fault_worker.py CKPT_DIR REF_FILE     # saves step_1, writes step 1's weights to REF_FILE, then
                                                      # perturbs and saves step_2 (OPID_CKPT_FAULT kills it inside)
"""
import argparse
import os
import shlex
import sys

import torch

FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --kv-channels 16 --vocab-size 1000 --max-position-embeddings 128 "
         "--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-6 "
         "--swiglu --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.05")


def tiny_model(seed: int = 0):
    """A megatron-core GPT (OPID's provider, Megatron-LM arguments); parallel state must be initialised."""
    from opid_mega.megatron.megatron_lm import add_megatron_lm_args
    from opid_mega.megatron.provider import make_model_provider

    args = add_megatron_lm_args(argparse.ArgumentParser()).parse_args(shlex.split(FLAGS))
    torch.manual_seed(seed)
    model = make_model_provider(args)(pre_process=True, post_process=True, config=None, pg_collection=None)
    perturb(model, seed + 100)
    return model


def perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def main() -> int:
    from opid_mega.megatron import checkpoint, parallel

    ckpt, ref = sys.argv[1], sys.argv[2]
    fault = os.environ.pop(checkpoint.FAULT_ENV, "")  # only for the second save
    parallel.initialize(1, 1, backend="gloo")
    model = tiny_model(0)
    checkpoint.save(ckpt, 1, [model], extra={"trainer_state": "{}"})
    torch.save(weights(model), ref)
    perturb(model, 7)
    os.environ[checkpoint.FAULT_ENV] = fault
    checkpoint.save(ckpt, 2, [model], extra={"trainer_state": "{}"})
    print("saved step_2", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
