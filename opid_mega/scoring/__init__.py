"""Dual-context scoring (scorer.py): the `Scorer` interface, the naive two-pass scorer and the fork scorer that scores
every context of a step-sample in one forward over the shared-prefix layout (the layout itself is
opid_mega.batching.layout)."""
