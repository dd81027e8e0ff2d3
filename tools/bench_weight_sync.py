#!/usr/bin/env python
"""Benchmark: trainer -> engine weight transfer per sync.method at the preset model's size; runs `opid-bench weight_sync` (opid_mega/bench/systems.py), with its options.

    python tools/bench_weight_sync.py --preset ci --json out.json     # = opid-bench weight_sync --preset ci --json out.json
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opid_mega.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.argv = ["opid-bench", "weight_sync"] + sys.argv[1:]  # opid-bench re-executes itself with sys.argv
    sys.exit(main())
