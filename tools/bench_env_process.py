#!/usr/bin/env python
"""Benchmark: TextWorld in a worker process vs in the trainer's process; runs `opid-bench env_worker` (opid_mega/bench/systems.py), with its options.

    python tools/bench_env_process.py --preset ci --json out.json     # = opid-bench env_worker --preset ci --json out.json
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opid_mega.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.argv = ["opid-bench", "env_worker"] + sys.argv[1:]  # opid-bench re-executes itself with sys.argv
    sys.exit(main())
