#!/usr/bin/env python
"""Benchmark: the dual-context divergence head (both contexts' log-probs, both KLs, the top-k of algo.delta=topk_kl),
ours against its peers; runs `opid-bench divergence` (opid_mega/bench/heads.py), with its options.

    python tools/bench_divergence.py --preset ci --json out.json  # = opid-bench divergence --preset ci --json out.json
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opid_mega.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.argv = ["opid-bench", "divergence"] + sys.argv[1:]  # opid-bench re-executes itself with sys.argv
    sys.exit(main())
