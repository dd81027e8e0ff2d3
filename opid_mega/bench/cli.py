"""opid-bench: benchmarks of the kernels against their peers, one preset vocabulary, one JSON schema, one table.

    opid-bench list
    opid-bench OP [--preset tiny|ci|7b|32b] [--repeats N] [--json PATH]
    opid-bench all --preset P [--json-dir DIR]
    opid-bench report DIR [--markdown FILE] [--check]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REEXEC_ENV = "OPID_BENCH_REEXEC"
DEFAULT_REPEATS = 5


def markers(run_dir: str) -> tuple:
    """The comment lines around a run's tables in a markdown file, named by the run's folder (docs/bench/ci -> ci),
    so one file holds the tables of several runs (CPU, GPU)."""
    name = os.path.basename(os.path.normpath(run_dir))
    return f"<!-- opid-bench tables: begin {name} -->", f"<!-- opid-bench tables: end {name} -->"


# The modules of opid-bench's ops; each defines OPS = {name: (what it measures, cases(preset, device, compile_peers))}.
OP_MODULES = ("heads", "attention", "scoring", "noise", "systems")
# Benchmarks that still live in their own scripts (their own presets and JSON), listed so that `list` shows them
# until an op of the same name exists.
SCRIPTS = {
    "builder": "tools/bench_batch_builder.py (C++ batch builder vs numpy)",
    "weight_sync": "tools/bench_weight_sync.py (trainer -> engine weight update)",
    "env_worker": "tools/bench_env_process.py (environment worker processes)",
}


def _ops() -> dict:
    import importlib
    ops = {}
    for mod in OP_MODULES:
        ops.update(importlib.import_module(f"{__package__}.{mod}").OPS)
    return ops


def op_names() -> tuple:
    return tuple(_ops())


def scripts() -> dict:
    """The benchmarks not yet in opid-bench."""
    ops = _ops()
    return {k: v for k, v in SCRIPTS.items() if k not in ops}


def _gpu_present(device_arg) -> bool:
    if device_arg:
        return device_arg.startswith("cuda")
    return os.path.exists("/proc/driver/nvidia/version")


def _reexec(device_arg):
    """Without a GPU, run again with the Triton interpreter on (it must be set before triton is imported) so that
    Triton rows (ours, Liger) can run on CPU where their shapes allow."""
    if os.environ.get(REEXEC_ENV) or _gpu_present(device_arg) or "TRITON_INTERPRET" in os.environ:
        return
    env = dict(os.environ, TRITON_INTERPRET="1", **{REEXEC_ENV: "1"})
    os.execve(sys.executable, [sys.executable, "-m", "opid_mega.bench.cli"] + sys.argv[1:], env)


def run_op(op: str, preset_name: str, repeats: int = DEFAULT_REPEATS, device: str = None,
           compile_peers: bool = True, log=print, **options) -> dict:
    """One op's result; `options` go to its cases function (delta_noise: advantages, lam)."""
    import torch
    from .core import get_preset, load_average, op_result, run_case
    ops = _ops()
    if op not in ops:
        raise ValueError(f"unknown op {op!r}; `opid-bench list` shows them")
    preset = get_preset(preset_name)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    load_before = load_average()
    t0 = time.time()
    cases = [run_case(c, dev, repeats, log) for c in ops[op][1](preset, dev, compile_peers, **options)]
    return op_result(op, preset, dev, cases, time.time() - t0, load_before, repeats)


def _write(path: str, result: dict):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


def render(results: list) -> str:
    """Markdown of a named run: one table per op, in the order of `opid-bench list`."""
    from .core import table
    order = {n: i for i, n in enumerate(op_names())}
    results = sorted(results, key=lambda r: order.get(r["op"], len(order)))
    return "\n\n".join(table(r, markdown=True) for r in results) + "\n"


def report(run_dir: str, markdown: str = None, check: bool = False) -> int:
    files = sorted(f for f in os.listdir(run_dir) if f.endswith(".json"))
    if not files:
        raise SystemExit(f"opid-bench report: no .json results in {run_dir}")
    results = []
    for f in files:
        with open(os.path.join(run_dir, f)) as fh:
            doc = json.load(fh)
        if "op" not in doc or "cases" not in doc:
            raise SystemExit(f"opid-bench report: {f} is not an opid-bench result (no 'op' / 'cases')")
        results.append(doc)
    body = render(results)
    if markdown is None:
        print(body, end="")
        return 0
    with open(markdown) as fh:
        text = fh.read()
    BEGIN, END = markers(run_dir)
    if BEGIN not in text or END not in text:
        raise SystemExit(f"opid-bench report: {markdown} lacks the markers {BEGIN} ... {END}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{body}{END}{tail}"
    if check:
        if new != text:
            print(f"{markdown} differs from the tables of {run_dir}; regenerate with "
                  f"`opid-bench report {run_dir} --markdown {markdown}`")
            return 1
        print(f"{markdown} matches {run_dir}")
        return 0
    with open(markdown, "w") as fh:
        fh.write(new)
    print(f"wrote the tables of {run_dir} into {markdown}")
    return 0


def main(argv=None) -> int:
    from .core import PRESETS
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="opid-bench", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="ops: " + ", ".join(op_names()) + "; presets: " + ", ".join(PRESETS))
    ap.add_argument("op", help="an op (see `opid-bench list`), `all`, `list` or `report`")
    ap.add_argument("run_dir", nargs="?", help="report: the folder of a run's JSON results")
    ap.add_argument("--preset", default="ci", choices=list(PRESETS),
                    help="shapes: tiny (tests), ci (Qwen2.5-0.5B, 2 CPU cores), 7b (Qwen2.5-7B, one TP rank), "
                         "32b (Qwen2.5-32B, one of 4 TP ranks)")
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                    help=f"timed calls per row: median, min and max (default {DEFAULT_REPEATS})")
    ap.add_argument("--json", default=None, help="OP: write the result here")
    ap.add_argument("--json-dir", default=None, help="all: write OP.json for every op here")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers (their compile time)")
    ap.add_argument("--advantages", default=None,
                    help="delta_noise: a run's dumped advantages (logging.dump_advantages=true): its |λΔ| beside the "
                         "noise")
    ap.add_argument("--lam", type=float, default=None,
                    help="delta_noise: λ of that run (default: algo.lambda_* of the config.yaml beside the file)")
    ap.add_argument("--markdown", default=None, help="report: replace the tables between the markers in this file")
    ap.add_argument("--check", action="store_true", help="report: exit 1 when --markdown's tables differ")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.op == "list":
        for name, (what, _) in _ops().items():
            print(f"{name:16s} {what}")
        for name, where in scripts().items():
            print(f"{name:16s} not in opid-bench yet: {where}")
        print("presets:")
        for p in PRESETS.values():
            print(f"  {p.name:5s} {p.model}: hidden {p.hidden}, vocab {p.vocab}, heads {p.heads}/{p.kv_heads} kv, "
                  f"head dim {p.head_dim}, TP {p.tp}, {p.tokens} tokens; {p.note}")
        return 0
    if args.op == "report":
        if not args.run_dir:
            ap.error("report needs the folder of a run's JSON results")
        return report(args.run_dir, args.markdown, args.check)
    names = op_names()
    ops = names if args.op == "all" else (args.op,)
    unknown = [o for o in ops if o not in names]
    if unknown:
        hint = f" (still {scripts()[unknown[0]]})" if unknown[0] in scripts() else ""
        ap.error(f"unknown op {unknown[0]!r}{hint}; ops: {', '.join(names)}")
    if args.op == "all" and args.json:
        ap.error("all writes one file per op: use --json-dir")
    if (args.advantages or args.lam is not None) and "delta_noise" not in ops:
        ap.error("--advantages and --lam are delta_noise's")
    if args.advantages and not os.path.exists(args.advantages):
        ap.error(f"--advantages: no such file {args.advantages}")
    _reexec(args.device)
    import torch
    from .core import table
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats
    t0 = time.time()
    for op in ops:
        print(f"== {op} (preset {args.preset})", flush=True)
        options = {"advantages": args.advantages, "lam": args.lam} if op == "delta_noise" else {}
        result = run_op(op, args.preset, repeats, args.device, not args.no_compile,
                        log=lambda s: print(s, flush=True), **options)
        print(table(result), flush=True)
        path = args.json if args.op != "all" else (os.path.join(args.json_dir, f"{op}.json") if args.json_dir
                                                      else None)
        if path:
            _write(path, result)
            print(f"wrote {path}")
    print(f"total wall {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
