#!/usr/bin/env python
"""Checkpoint conversion between OPID and Megatron-LM (both megatron-core distributed checkpoints, same tensor keys).

    python tools/convert_checkpoint.py to-megatron-lm RUN/checkpoints OUT_DIR [--step N]

lays OPID checkpoint step N (default: the latest) out as Megatron-LM's ``OUT_DIR/iter_<N:07d>`` +
``latest_checkpointed_iteration.txt`` (tensor files hard-linked), for ``--load OUT_DIR --finetune --no-load-optim
--no-load-rng``. The other direction needs no conversion: ``opid_mega.megatron.checkpoint.load_model(MLM_SAVE_DIR,
chunks)`` reads a Megatron-LM ``--save`` directory directly.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    to = sub.add_parser("to-megatron-lm", help="OPID checkpoint -> Megatron-LM layout")
    to.add_argument("ckpt_dir", help="OPID checkpoint directory (holds latest_step and step_<N>/) or a step_<N> dir")
    to.add_argument("out_dir", help="Megatron-LM checkpoint directory to write (its --load)")
    to.add_argument("--step", type=int, default=None, help="the step to export (default: the latest)")
    a = ap.parse_args(argv)
    from opid_mega.megatron.checkpoint import export_megatron_lm

    try:
        dst = export_megatron_lm(a.ckpt_dir, a.out_dir, step=a.step)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"convert_checkpoint: {e}", file=sys.stderr)
        return 2
    print(f"wrote {dst} (load with --load {a.out_dir} --finetune --no-load-optim --no-load-rng)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
