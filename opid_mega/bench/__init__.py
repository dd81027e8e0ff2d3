"""opid-bench: the kernel benchmarks behind one command, one preset vocabulary, one JSON schema and one table.

Layers: this package imports the kernels (`opid_mega.kernels`) and torch only, never the trainer.
    opid-bench list
    opid-bench logprob --preset ci --json out.json
    opid-bench all --preset ci --json-dir runs/bench
    opid-bench report runs/bench --markdown docs/performance.md
"""
