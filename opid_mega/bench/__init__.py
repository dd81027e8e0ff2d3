"""opid-bench: the kernel benchmarks behind one command, one preset vocabulary, one JSON schema and one table.

Layers: the top layer beside cli (its ops drive the kernels, the model, the batch builder and the envs); nothing else
in opid_mega imports it.
    opid-bench list
    opid-bench logprob --preset ci --json out.json
    opid-bench all --preset ci --json-dir runs/bench
    opid-bench report runs/bench --markdown docs/performance.md
"""
