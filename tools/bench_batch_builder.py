#!/usr/bin/env python
"""Benchmark: the C++ batch builder vs the numpy reference (one iteration's advantages and micro-batches); runs `opid-bench builder` (opid_mega/bench/systems.py), with its options.

    python tools/bench_batch_builder.py --preset ci --json out.json     # = opid-bench builder --preset ci --json out.json
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opid_mega.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.argv = ["opid-bench", "builder"] + sys.argv[1:]  # opid-bench re-executes itself with sys.argv
    sys.exit(main())
