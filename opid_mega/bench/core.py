"""Presets, measurement, the JSON schema and the table shared by every op of opid-bench.

Schema of one op's result (what `--json` writes):
  {"op", "preset", "model": {preset shapes}, "machine": {...}, "versions": {...}, "load": {"before", "after"},
   "wall_s", "repeats", "cases": [case, ...]}
  case = {"name", "shape": {...}, "dtype", "flops", "bound_s", "roofline": {...} | absent, "methods": [method, ...]}
  method = {"name", "role": "ours"|"peer", "runs_as", "seconds", "seconds_min", "seconds_max", "repeats",
            "peak_bytes", "error": {output: max abs error vs the float64 reference}, "ratio_to_bound",
            "ratio_to_roofline" (ours, where the case has a roofline)} or {"name", "role", "skipped": "reason"}.
The bound of a case is its FLOPs at this machine's measured matmul rate for the case dtype (the time the
unavoidable matmul work alone would take); `ratio_to_bound` = seconds / bound_s (1.0 = as fast as that matmul).
A case without FLOPs may give `copy_bytes` instead (bytes it must copy at least once: bound = copy_bytes at this
machine's measured memcpy rate, the case says so in "bound_kind": "copy"); with neither, bound_s and
ratio_to_bound are null. A case of host-side work (`device="cpu"`) is timed and metered on the CPU whatever the
op's device.
Roofline (`roofline.py`): where a case gives one, the FLOPs and bytes of each launch of OUR kernel's chosen
configuration (chunk widths, tiles) and the time they predict at the measured matmul rate and memory bandwidth;
`ratio_to_roofline` = seconds / that time.
Peak memory (`PeakMeter`): extra bytes allocated by one call beyond what existed before it, minus the gradients it
returns (fwd+bwd). CUDA: max_memory_allocated after reset_peak_memory_stats. CPU: the peak of torch's CPU allocator
(its running total, read from the profiler's allocation events) plus the peak of tracemalloc (numpy arrays, Python
objects); every allocation counts, however small or brief, so a call that allocates reads more than 0.
Timing: one warm-up call (compilation, autotuning), one call under the memory meter, then `repeats` timed calls:
their median ("seconds"), min and max.
"""
from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class Preset:
    """Shapes named by the model they come from (one tensor-parallel rank: vocab, heads and kv_heads per rank)."""
    name: str
    model: str
    hidden: int
    vocab: int          # vocabulary of the whole model
    heads: int          # query heads of the whole model
    kv_heads: int
    head_dim: int
    tp: int             # tensor-parallel ranks the shapes are divided over
    tokens: int         # response tokens of one micro-batch for the vocabulary heads
    fork: tuple         # (groups, prefix tokens, branches per group, tokens per branch) of the fork layout
    dtypes: tuple       # dtypes the vocabulary heads and the attention run in
    passes: tuple = ("fwd", "fwd+bwd")   # passes of the log-prob head
    fwd_only: tuple = ()                 # dtypes whose log-prob head runs the forward only (CPU time budget)
    divergence_dtypes: tuple = ()        # dtypes of the divergence head (empty: `dtypes`; CPU time budget)
    note: str = ""

    @property
    def vocab_rank(self) -> int:
        return self.vocab // self.tp

    @property
    def heads_rank(self) -> int:
        return self.heads // self.tp

    @property
    def kv_heads_rank(self) -> int:
        return max(1, self.kv_heads // self.tp)

    def as_dict(self) -> dict:
        return {"name": self.name, "model": self.model, "hidden": self.hidden, "vocab": self.vocab,
                "heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "tp": self.tp,
                "vocab_per_rank": self.vocab_rank, "heads_per_rank": self.heads_rank,
                "kv_heads_per_rank": self.kv_heads_rank, "tokens": self.tokens,
                "fork": dict(zip(("groups", "prefix", "branches", "branch_tokens"), self.fork)),
                "dtypes": list(self.dtypes), "fwd_only": list(self.fwd_only),
                "divergence_dtypes": list(self.divergence_dtypes or self.dtypes), "note": self.note}


PRESETS = {
    "tiny": Preset("tiny", "toy (tests)", hidden=64, vocab=512, heads=4, kv_heads=2, head_dim=16, tp=1, tokens=32,
                   fork=(2, 24, 3, 8), dtypes=("float32", "bfloat16"), note="seconds; every peer runs on CPU"),
    "ci": Preset("ci", "Qwen2.5-0.5B", hidden=896, vocab=151936, heads=14, kv_heads=2, head_dim=64, tp=1,
                 tokens=32, fork=(1, 256, 8, 32), dtypes=("float32", "bfloat16"), fwd_only=("bfloat16",),
                 divergence_dtypes=("float32",), note="2 CPU cores: all ops within 5 minutes"),
    "7b": Preset("7b", "Qwen2.5-7B", hidden=3584, vocab=152064, heads=28, kv_heads=4, head_dim=128, tp=1,
                 tokens=4096, fork=(4, 2048, 8, 256), dtypes=("bfloat16",), note="one GPU"),
    "32b": Preset("32b", "Qwen2.5-32B", hidden=5120, vocab=152064, heads=40, kv_heads=8, head_dim=128, tp=4,
                  tokens=4096, fork=(4, 2048, 8, 256), dtypes=("bfloat16",), note="one of 4 TP ranks, one GPU"),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


# ------------------------------------------------------------------------------------------------------------------
# machine, versions, load
# ------------------------------------------------------------------------------------------------------------------
def _version(module: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(module)
    except Exception:  # noqa: BLE001 - not installed
        return None


def load_average() -> Optional[list]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "device": device.type,
            "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def versions() -> dict:
    return {"torch": torch.__version__, "triton": _version("triton"), "liger-kernel": _version("liger-kernel"),
            "opid-mega": _version("opid-mega")}


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and _version("triton") is not None


# ------------------------------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------------------------------
def _cpu_allocator_peak(prof) -> int:
    """Peak of torch's CPU allocator over a profiled block, relative to its total before the block: the profiler's
    allocation events (alloc_size < 0: a free) carry the allocator's running total."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append(e)
    if not events:
        return 0
    events.sort(key=lambda e: e.start_time_ns)
    base = events[0].extra_fields.total_allocated - events[0].extra_fields.alloc_size
    return max(0, max(e.extra_fields.total_allocated for e in events) - base)


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null (the profiler's start and stop write two log lines there on every use)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class PeakMeter:
    """Extra peak memory of the block (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
            return self
        import tracemalloc
        from torch.profiler import ProfilerActivity, profile

        # the profiler outside tracemalloc's window: its own Python objects (the event tree it builds at exit) are
        # not the call's
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._prof.__enter__()
        self._tracing = tracemalloc.is_tracing()
        if not self._tracing:
            tracemalloc.start()
        tracemalloc.reset_peak()
        self.before = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.before
            return False
        import tracemalloc

        python_peak = tracemalloc.get_traced_memory()[1] - self.before
        if not self._tracing:
            tracemalloc.stop()
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        self.peak = _cpu_allocator_peak(self._prof) + max(0, python_peak)
        return False


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_call(call: Callable, device: torch.device, repeats: int, grad_bytes: int = 0) -> dict:
    """Warm-up, one metered call, `repeats` timed calls: {"seconds" (median), "seconds_min", "seconds_max",
    "repeats", "peak_bytes", "result" (of the metered call)}."""
    call()
    _sync(device)
    with PeakMeter(device) as meter:
        result = call()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = call()
        _sync(device)
        times.append(time.perf_counter() - t0)
        del out
    return {"seconds": statistics.median(times), "seconds_min": min(times), "seconds_max": max(times),
            "repeats": repeats, "peak_bytes": max(0, meter.peak - grad_bytes), "result": result}


_RATES: dict = {}


def matmul_rate(dtype: torch.dtype, device: torch.device, size: int = 0) -> float:
    """FLOP/s of one [size, size] x [size, size] matmul at `dtype` on this machine (measured once per run, the median
    of 5). Default size: 8192 on a GPU (a 1024^3 matmul is a few microseconds there, launch-bound, far below the
    GPU's rate, which would make every bound look easy), 1024 on CPU (where it already runs at the cores' rate)."""
    size = size or (8192 if device.type == "cuda" else 1024)
    key = (dtype, device.type)
    if key not in _RATES:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        _RATES[key] = 2 * size ** 3 / max(time_call(lambda: a @ b, device, repeats=5)["seconds"], 1e-9)
    return _RATES[key]


def copy_rate(device: torch.device) -> float:
    """Bytes/s of copying one buffer into another on this machine (measured once per run, the median of 5): 64 MiB
    on CPU, 1 GiB on a GPU (far beyond its L2 cache)."""
    size = (1 << 30) if device.type == "cuda" else (1 << 26)
    key = ("copy", device.type)
    if key not in _RATES:
        a = torch.ones(size, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        _RATES[key] = size / max(time_call(lambda: b.copy_(a), device, repeats=5)["seconds"], 1e-9)
    return _RATES[key]


def bandwidth(device: torch.device) -> float:
    """Bytes/s moved to and from memory (a copy reads and writes each byte: twice `copy_rate`)."""
    return 2 * copy_rate(device)


def max_abs(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item() if a.numel() else 0.0


def rel_max(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (gradients: their scale depends on the shape)."""
    scale = ref.double().abs().max().item() if ref.numel() else 0.0
    return max_abs(a, ref) / scale if scale > 0 else max_abs(a, ref)


@dataclass
class Method:
    """One row: `call()` runs it once and returns what `error(result)` compares with the float64 reference."""
    name: str
    role: str                      # "ours" | "peer"
    runs_as: str                   # e.g. "torch path", "Triton", "Triton interpreter", "eager", "inductor"
    call: Optional[Callable] = None
    skipped: Optional[str] = None  # one-line reason when it cannot run here


@dataclass
class Case:
    name: str
    shape: dict
    dtype: str
    flops: float
    methods: list
    error: Callable                # result -> {output: error vs float64}
    grad_bytes: int = 0
    extra: dict = field(default_factory=dict)
    copy_bytes: float = 0          # no FLOPs: bytes it must copy at least once (the bound at the memcpy rate)
    device: Optional[str] = None   # "cpu": host-side work, timed and metered on the CPU
    # () -> (config dict, [roofline.Step]): our kernel's chosen configuration, called after the rows ran (autotuned
    # tiles are known then)
    roofline: Optional[Callable] = None


def run_case(case: Case, device: torch.device, repeats: int, log=print) -> dict:
    from .roofline import predict

    device = torch.device(case.device) if case.device else device
    bound = case.flops / matmul_rate(getattr(torch, case.dtype), device) if case.flops else None
    out = {"name": case.name, "shape": case.shape, "dtype": case.dtype, "flops": case.flops,
           "bound_s": bound, "methods": [], **case.extra}
    if not case.flops and case.copy_bytes:
        bound = out["bound_s"] = case.copy_bytes / copy_rate(device)
        out["bound_kind"] = "copy"
    for m in case.methods:
        row = {"name": m.name, "role": m.role, "runs_as": m.runs_as}
        if m.skipped is None:
            try:
                timed = time_call(m.call, device, repeats, case.grad_bytes)
                result = timed.pop("result")
                row.update(timed, error=case.error(result), ratio_to_bound=timed["seconds"] / bound if bound else None)
                del result
            except Exception as exc:  # noqa: BLE001 - a peer that fails here is a skipped row with its reason
                row["skipped"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        else:
            row["skipped"] = m.skipped
        out["methods"].append(row)
        log(f"  {case.name} {m.name}: " + (f"{row['seconds']:.4f} s" if "seconds" in row else row["skipped"]))
    if case.roofline is not None:
        config, steps = case.roofline()
        rl = out["roofline"] = {"config": config, **predict(steps, matmul_rate(getattr(torch, case.dtype), device),
                                                            bandwidth(device))}
        for row in out["methods"]:
            if row["role"] == "ours" and "seconds" in row:
                row["ratio_to_roofline"] = row["seconds"] / rl["bound_s"]
    return out


def op_result(op: str, preset: Preset, device: torch.device, cases: list, wall: float, load_before,
              repeats: int) -> dict:
    return {"op": op, "preset": preset.name, "model": preset.as_dict(), "machine": machine(device),
            "versions": versions(), "load": {"before": load_before, "after": load_average()},
            "wall_s": round(wall, 2), "repeats": repeats, "cases": cases}


# ------------------------------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------------------------------
def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _err(error: dict) -> str:
    return " ".join(f"{k} {v:.1e}" for k, v in error.items())


def _time(m: dict) -> str:
    spread = f" ({m['seconds_min']:.4f}–{m['seconds_max']:.4f})" if m.get("repeats", 1) > 1 else ""
    return f"{m['seconds']:.4f}{spread}"


def _config(config: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in config.items())


def table(result: dict, markdown: bool = False) -> str:
    """One table per op: per case and row, time (median of the timed repeats, min–max), speed of ours relative to
    the row (row time / ours time), peak memory and memory ratio (ours / row), max error vs float64, ratio to the
    bound and to our roofline. Skipped rows give the reason. Then, where cases have one, the roofline of our chosen
    configuration per case: FLOPs, bytes, the predicted time and what limits it; then the cases' notes (once each)."""
    head = ["case", "method", "runs as", "time s (min–max)", "ours ×faster", "peak MiB", "mem ours/row",
            "err vs float64", "× bound", "× roofline"]
    rows, roof, notes = [], [], []
    for case in result["cases"]:
        notes += [n for n in case.get("notes", []) if n not in notes]
        ran = [m for m in case["methods"] if "seconds" in m]
        ours = next((m for m in ran if m["role"] == "ours"), None)
        for m in case["methods"]:
            label = f"{m['name']} (ours)" if m["role"] == "ours" else m["name"]
            if "skipped" in m:
                rows.append([case["name"], label, m["runs_as"], "skipped: " + m["skipped"]] + [""] * 6)
                continue
            faster = ours["seconds"] / m["seconds"] if ours and m is not ours else None
            mem = ours["peak_bytes"] / m["peak_bytes"] if ours and m is not ours and m["peak_bytes"] > 0 else None
            rows.append([case["name"], label, m["runs_as"], _time(m), _fmt(1 / faster if faster else None, ".2f"),
                         _fmt(m["peak_bytes"] / 2 ** 20, ".1f"), _fmt(mem, ".3f"), _err(m["error"]),
                         _fmt(m["ratio_to_bound"], ".1f"), _fmt(m.get("ratio_to_roofline"), ".1f")])
        if case.get("roofline"):
            rl = case["roofline"]
            roof.append([case["name"], _config(rl["config"]), f"{rl['flops'] / 1e9:.3g}",
                         f"{rl['bytes'] / 2 ** 20:.4g}", f"{rl['bound_s'] * 1e3:.4g}", rl["limit"]])
    m = result["model"]
    title = (f"{result['op']} — preset {result['preset']} ({m['model']}: hidden {m['hidden']}, vocab "
             f"{m['vocab']} ({m['vocab_per_rank']}/rank), heads {m['heads']}/{m['kv_heads']} kv, head dim "
             f"{m['head_dim']}, TP {m['tp']}); {result['machine'].get('gpu') or result['machine']['device']}, "
             f"{result['machine']['torch_threads']} "
             f"threads, {result.get('repeats', 1)} timed repeats, load {result['load']['before']} -> "
             f"{result['load']['after']}, wall {result['wall_s']} s")
    roof_head = ["case", "our configuration", "GFLOP", "MiB moved", "roofline ms", "limit"]
    if markdown:
        lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        if roof:
            lines += ["", "| " + " | ".join(roof_head) + " |", "|" + "---|" * len(roof_head)]
            lines += ["| " + " | ".join(r) + " |" for r in roof]
        lines += [""] + [f"- {n}" for n in notes] if notes else []
        return "\n".join(lines)

    def block(hd, rs):
        widths = [min(60, max(len(h), *(len(r[i]) for r in rs)) if rs else len(h)) for i, h in enumerate(hd)]
        return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [hd] + rs]
    return "\n".join([title] + block(head, rows) + (["roofline of our configuration:"] + block(roof_head, roof)
                                                      if roof else []) + notes)
