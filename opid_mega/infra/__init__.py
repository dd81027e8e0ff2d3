"""Run infrastructure, below every other layer (it imports nothing else of opid_mega): durable files and JSONL
repair, secret redaction, host addresses and API keys, signals and shutdown, console logging and progress lines,
size-bucketing of tensors. The run directory's contract (plan, resume, config hashes) is opid_mega.rundir."""
