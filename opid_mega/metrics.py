"""Per-iteration metrics: RUN_DIR/metrics.jsonl, TensorBoard, and a progress bar (one line per iteration in a log).

    timer = Timer()
    with MetricsLogger(run_dir, total=cfg.train.iterations, resume_step=start_step) as log:
        for step in range(start_step + 1, cfg.train.iterations + 1):
            with timer("rollout"):
                ...
            log.log(step, {"train/success_rate": 0.4, **timer.pop()})

metrics.jsonl holds one JSON object per `log` call: `{"step": int, "time": unix seconds, "elapsed_s": float,
<key>: number | null, ...}`. Non-finite numbers are written as null (JSON has no NaN). Several lines may share a
step (e.g. an eval logged separately); `read_metrics(..., merge=True)` merges them, later keys winning.

Optional sinks, each a warning line on stderr when its package is missing (the run goes on without it):
- TensorBoard (RUN_DIR/tensorboard): every metric as a scalar; `config` (the resolved config, a nested dict) as the
  text "config" (its YAML) and as hyper-parameters (the HPARAMS tab, one entry per dotted key).
- Weights & Biases (`wandb=wandb_settings(cfg.logging, run_dir)`, None: off): `wandb.init(config=config, ...)`, then
  every line of metrics.jsonl as `wandb.log` (same keys, nulls left out) with "step" as the x axis. The W&B run id is
  the run id (RUN_DIR/run_id), so a resume continues the same W&B run. WANDB_MODE=offline writes RUN_DIR/wandb/
  (or WANDB_DIR) without a network; `wandb sync` uploads it later. A W&B error never stops the run (one warning).

In a distributed run create the logger on one rank only (e.g. global rank 0, after the trainer has reduced the
numbers); other ranks should not touch the files.

Resume: `MetricsLogger(run_dir, resume_step=N)` keeps the lines with step <= N (and drops a torn last line left by
a killed run), then appends; TensorBoard events after N are purged with `purge_step`. A fresh run
(`resume_step=None`) into a directory that already has metrics moves the old file aside to
`metrics.jsonl.<unix time>.bak` instead of mixing two runs.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import re
import sys
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tensorboard"

# Headline numbers for the progress bar: (metric key, short label, format).
PROGRESS_KEYS: tuple[tuple[str, str, str], ...] = (
    ("train/success_rate", "succ", "{:.2f}"),
    ("train/score", "score", "{:.2f}"),
    ("eval/success_rate", "eval", "{:.2f}"),
    ("adv/outcome_abs_mean", "|A|", "{:.3g}"),
    ("adv/skill_abs_mean", "|λΔ|", "{:.2g}"),
    ("ppo/kl", "kl", "{:.2g}"),
    ("ppo/clipfrac", "clip", "{:.3f}"),
)


def _to_scalar(key: str, value: Any) -> Optional[float | int]:
    """A plain int/float (None for NaN/inf) from a Python/numpy/torch scalar; TypeError naming the key otherwise."""
    if value is None:
        return None
    if hasattr(value, "item") and callable(value.item):  # numpy scalar / array, torch tensor
        size = getattr(value, "numel", None)
        n = size() if callable(size) else getattr(value, "size", 1)
        if n != 1:
            raise TypeError(f"metric {key!r}: expected a scalar, got an array/tensor with {n} elements")
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    raise TypeError(f"metric {key!r}: expected a number, got {type(value).__name__} ({value!r:.80})")


def _read_lines(path: Path) -> list[dict]:
    """Parsed records of a metrics file; a torn (unparseable) LAST line is skipped, a bad middle line is an error."""
    from opid_mega.skills.audit import read_jsonl

    if not path.exists():
        return []
    out = []
    for lineno, rec in read_jsonl(path):
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise ValueError(f"{path}:{lineno}: a metrics line must be a JSON object with an integer 'step'")
        out.append(rec)
    return out


def metrics_path(run_dir_or_file: str | os.PathLike) -> Path:
    p = Path(run_dir_or_file)
    return p / METRICS_FILE if p.is_dir() else p


def read_metrics(run_dir_or_file: str | os.PathLike, merge: bool = True) -> list[dict]:
    """Records of RUN_DIR/metrics.jsonl (or of the given file), sorted by step.

    merge=True: one dict per step, lines with the same step merged (later keys win).
    """
    recs = _read_lines(metrics_path(run_dir_or_file))
    if not merge:
        return recs
    by_step: "OrderedDict[int, dict]" = OrderedDict()
    for rec in recs:
        by_step.setdefault(rec["step"], {}).update(rec)
    return [by_step[s] for s in sorted(by_step)]


class Timer:
    """Wall-clock time per stage; repeated stages in one iteration add up.

        timer = Timer()
        with timer("rollout"): ...
        with timer("update"): ...
        metrics.update(timer.pop())   # {"time/rollout": s, "time/update": s}, and the timer is cleared

    `sync` (e.g. torch.cuda.synchronize) runs before reading the clock at both ends so GPU work is counted.
    """

    def __init__(self, prefix: str = "time/", sync: Optional[Callable[[], None]] = None):
        self.prefix = prefix
        self.sync = sync
        self.times: "OrderedDict[str, float]" = OrderedDict()

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if self.sync is not None:
            self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.times[stage] = self.times.get(stage, 0.0) + time.perf_counter() - t0

    def as_metrics(self) -> dict[str, float]:
        return {self.prefix + k: v for k, v in self.times.items()}

    def pop(self) -> dict[str, float]:
        out = self.as_metrics()
        self.times.clear()
        return out


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def flatten_config(config: dict, prefix: str = "") -> dict[str, bool | int | float | str]:
    """{"train": {"lr": 1e-6}} -> {"train.lr": 1e-6}: scalars kept, anything else (lists, None, ...) as its str()."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_config(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def wandb_settings(logging_cfg: Any, run_dir: str | os.PathLike) -> Optional[dict]:
    """wandb.init keyword arguments from the config's `logging` section (None when logging.wandb is off)."""
    if not getattr(logging_cfg, "wandb", False):
        return None
    from opid_mega.infra.files import run_id

    run_dir = Path(run_dir)
    rid = run_id(run_dir, create=False)
    kw: dict[str, Any] = {"project": logging_cfg.wandb_project or None, "name": logging_cfg.wandb_name or run_dir.name,
                          "entity": logging_cfg.wandb_entity or None, "tags": list(logging_cfg.wandb_tags) or None,
                          "mode": logging_cfg.wandb_mode or None}
    if rid:  # W&B ids may not hold / \ # ? % : (and at most 64 characters)
        kw["id"] = re.sub(r"[^A-Za-z0-9_.-]", "-", rid)[-64:]
    if not os.environ.get("WANDB_DIR"):
        kw["dir"] = str(run_dir)  # RUN_DIR/wandb/
    return kw


class MetricsLogger:
    """metrics.jsonl + optional TensorBoard, W&B + optional tqdm bar. Use as a context manager or call close()."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, progress: bool = True,
                 total: Optional[int] = None, resume_step: Optional[int] = None, desc: str = "opid",
                 config: Optional[dict] = None, wandb: Optional[dict] = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.resume_step = resume_step
        self._t0 = time.time()
        self._elapsed_offset = 0.0

        if resume_step is None:
            if self.path.exists() and self.path.stat().st_size > 0:
                self.path.rename(self.path.with_name(f"{METRICS_FILE}.{int(time.time())}.bak"))
        else:
            if resume_step < 0:
                raise ValueError(f"resume_step must be >= 0, got {resume_step}")
            kept = [r for r in _read_lines(self.path) if r["step"] <= resume_step]
            tmp = self.path.with_name(METRICS_FILE + ".tmp")
            with open(tmp, "w") as f:
                for rec in kept:
                    f.write(json.dumps(rec) + "\n")
            os.replace(tmp, self.path)
            if kept:  # wall time continues from where the killed run was
                self._elapsed_offset = float(kept[-1].get("elapsed_s") or 0.0)
        self._file = open(self.path, "a")

        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except Exception as exc:  # tensorboard is optional
                SummaryWriter = None
                _warn(f"logging.tensorboard: TensorBoard is not available ({str(exc).splitlines()[0]}); the run goes "
                      "on without it (pip install tensorboard, or logging.tensorboard=false)")
            if SummaryWriter is not None:
                kw = {} if resume_step is None else {"purge_step": resume_step + 1}
                self.tb = SummaryWriter(log_dir=str(self.run_dir / TB_DIR), **kw)
                if config is not None:
                    self._tb_config(config, resume_step or 0)

        self.wandb = None
        if wandb is not None:
            self.wandb = self._wandb_init(wandb, config)

        self.bar = None
        if progress:  # a tqdm bar on a terminal, one line per iteration in a log file (opid_mega.infra.progress)
            from opid_mega.infra.progress import progress as make_progress

            self.bar = make_progress(total=total, initial=resume_step or 0, desc=desc, unit="it")

    def _tb_config(self, config: dict, step: int) -> None:
        """The resolved config as TensorBoard text (YAML, a Markdown code block) and as hyper-parameters."""
        import yaml
        from torch.utils.tensorboard.summary import hparams

        text = yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
        self.tb.add_text("config", "".join("    " + line for line in text.splitlines(True)), global_step=step)
        metrics = {key: 0.0 for key, _, _ in PROGRESS_KEYS}  # the headline scalars beside the hyper-parameters
        for summary in hparams(flatten_config(config), metrics):
            self.tb.file_writer.add_summary(summary, global_step=step)
        self.tb.flush()

    def _wandb_init(self, settings: dict, config: Optional[dict]):
        try:
            import wandb
        except ImportError as exc:
            _warn(f"logging.wandb: the wandb package is not installed ({exc}); the run goes on without W&B "
                  "(pip install wandb, or logging.wandb=false)")
            return None
        try:
            run = wandb.init(config=config, resume="allow", **settings)
            run.define_metric("step")
            run.define_metric("*", step_metric="step")  # resumed runs re-log steps: "step" is the x axis, not _step
            return run
        except Exception as exc:  # noqa: BLE001 - no network, no API key, ...: the run goes on
            _warn(f"logging.wandb: wandb.init failed ({type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}); "
                  "the run goes on without W&B (WANDB_MODE=offline logs without a network)")
            return None

    # ---------------------------------------------------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, Any]) -> dict:
        """Write one line for `step`; returns the record written. Advances the progress bar to `step`."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise TypeError(f"step must be an integer >= 0, got {step!r}")
        rec: dict[str, Any] = {"step": step, "time": time.time(),
                               "elapsed_s": self._elapsed_offset + time.time() - self._t0}
        for key, value in metrics.items():
            if key in ("step", "time", "elapsed_s"):
                raise ValueError(f"metric name {key!r} is reserved")
            rec[key] = _to_scalar(key, value)
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self.tb is not None:
            for key, value in rec.items():
                if key not in ("step", "time", "elapsed_s") and value is not None:
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            try:
                self.wandb.log({k: v for k, v in rec.items() if v is not None})
            except Exception as exc:  # noqa: BLE001 - W&B never stops a run
                _warn(f"logging.wandb: wandb.log failed ({type(exc).__name__}: {exc}); W&B logging is off from step "
                      f"{step}")
                self.wandb = None
        if self.bar is not None:
            self._update_bar(step, rec)
        return rec

    def _update_bar(self, step: int, rec: dict) -> None:
        parts = OrderedDict()
        for key, label, fmt in PROGRESS_KEYS:
            if rec.get(key) is not None:
                parts[label] = fmt.format(rec[key])
        if parts:
            self.bar.set_postfix(parts, refresh=False)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        else:
            self.bar.refresh()

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            run, self.wandb = self.wandb, None
            try:
                run.finish()
            except Exception as exc:  # noqa: BLE001
                _warn(f"logging.wandb: wandb finish failed ({type(exc).__name__}: {exc})")
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


