"""Dual-context scoring: the `Scorer` interface (scorer.py: the naive two-pass scorer) and the fork scorer that
scores every context of a step-sample in one forward over the shared-prefix layout (fork_scorer.py; the layout
itself is opid_mega.batching.layout)."""
