#!/usr/bin/env python
"""Benchmark: token log-probs from hidden states (with and without the entropy), ours against its peers; runs
`opid-bench logprob` (opid_mega/bench/heads.py), with its options.

    python tools/bench_logprob.py --preset ci --json out.json     # = opid-bench logprob --preset ci --json out.json
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opid_mega.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.argv = ["opid-bench", "logprob"] + sys.argv[1:]  # opid-bench re-executes itself with sys.argv
    sys.exit(main())
