"""The run directory as a contract: one run per directory, a lock, atomic and verifiable state (docs/runs.md).

    plan = plan_run(config, run_dir, resume, overwrite, overrides)   # what opid-train does with its command line
    lock = RunLock(plan.run_dir)                                      # global rank 0, for the run's whole life

What a run directory holds and who writes it:
    config.yaml               the resolved config of the run's fresh start (written once, atomically, mode 0600)
    resume_overrides.jsonl    {"time", "step", "overrides"} for every resume that gave key=value overrides; they are
                              applied over config.yaml, in order, by every later resume
    run_id                    <directory name>-<8 hex>, fixed at the fresh start (sync.disk_dir/<run id>/)
    .lock                     held (fcntl) by the trainer writing the directory; names its pid
    checkpoints/              step_<N>/ + latest_step (opid_mega.megatron.checkpoint)
    metrics.jsonl, audit.jsonl, analysis_cache.jsonl, weight_sync/, ...

A fresh run into a directory that holds checkpoints is refused (--resume auto continues it, --overwrite moves it aside
to <dir>.old-<time>); resuming checks config.yaml (complete, and the config the checkpoint was saved with: a hash per
section stored in the checkpoint).
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional, Sequence

import yaml

from opid_mega.infra.files import write_atomic

CONFIG_FILE = "config.yaml"
OVERRIDES_FILE = "resume_overrides.jsonl"
LOCK_FILE = ".lock"


class RunDirError(Exception):
    """A run directory that cannot be used as asked; the message is one line naming the problem and what to do."""


def write_config(run_dir: str | os.PathLike, cfg) -> None:
    from opid_mega.config import dump_config

    write_atomic(Path(run_dir) / CONFIG_FILE, dump_config(cfg))


# ---------------------------------------------------------------------------------------------------------------------
# The config a run was started with, and its hash
# ---------------------------------------------------------------------------------------------------------------------


def section_names() -> list:
    from opid_mega.config import Config

    return [f.name for f in dataclasses.fields(Config)]


def config_digest(cfg) -> dict:
    """{"sha256": hash of the whole config, "sections": {section: hash}} of a resolved config as config.yaml holds it
    (dump_config), without the fields that may change between the start and a resume of the same run: the run
    directory's path (logging.run_dir) and analyzer.api_key (a secret, never hashed into a checkpoint)."""
    from opid_mega.config import dump_config

    data = yaml.safe_load(dump_config(cfg)) or {}
    if isinstance(data.get("logging"), dict):
        data["logging"].pop("run_dir", None)
    if isinstance(data.get("analyzer"), dict):
        data["analyzer"].pop("api_key", None)
    sections = {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
                for k, v in sorted(data.items())}
    whole = hashlib.sha256(json.dumps(sections, sort_keys=True).encode()).hexdigest()[:16]
    return {"sha256": whole, "sections": sections}


def digest_diff(a: dict, b: dict) -> list:
    """Sections whose hashes differ between two :func:`config_digest` results."""
    sa, sb = a.get("sections", {}), b.get("sections", {})
    return sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k))


def read_saved_config(run_dir: str | os.PathLike, where: Optional[str] = None, plugins: bool = True):
    """The Config in ``run_dir/config.yaml``, strictly: a missing, empty, unparseable or incomplete file (a section
    missing: a file cut short) is a :class:`RunDirError` (one line), never a run with default hyper-parameters.
    plugins=False: a plug-in env / analyzer (env.name, analyzer.backend import paths) is not imported (opid-export
    builds neither, so it works without the plug-in on the path)."""
    from opid_mega.config import ConfigError, config_from_dict, yaml_load

    path = Path(run_dir) / CONFIG_FILE
    where = where or f"--resume {run_dir}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunDirError(f"{where}: no {CONFIG_FILE} there (not a run directory)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RunDirError(f"{where}: cannot read {path} ({type(e).__name__}: {e})") from None
    if not text.strip():
        raise RunDirError(f"{where}: {path} is empty (damaged: opid-train writes it whole); restore it, or start "
                          "anew with --overwrite")
    try:
        data = yaml_load(text)  # YAML 1.2 floats, as config files (a hand-edited `lr: 1e-6` is a number)
    except yaml.YAMLError as e:
        raise RunDirError(f"{where}: {path} is not valid YAML ({str(e).splitlines()[0]}); restore it, or start anew "
                          "with --overwrite") from None
    if not isinstance(data, dict):
        raise RunDirError(f"{where}: {path} does not hold a config (its top level is no mapping of sections)")
    missing = [s for s in section_names() if not isinstance(data.get(s), dict)]
    if missing:
        raise RunDirError(f"{where}: {path} is incomplete (no section {', '.join(missing)}: cut short?); restore it, "
                          "or start anew with --overwrite")
    try:
        return config_from_dict(data, plugins=plugins)
    except ConfigError as e:
        raise RunDirError(f"{where}: {path}: {e}") from None


def recorded_overrides(run_dir: str | os.PathLike) -> list:
    """The key=value overrides of earlier resumes (resume_overrides.jsonl), in order."""
    path = Path(run_dir) / OVERRIDES_FILE
    out: list = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return out
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                continue  # torn by a kill: that resume never started training
            raise RunDirError(f"{path}:{i + 1}: not a JSON line") from None
        out += [str(o) for o in rec.get("overrides", [])]
    return out



def record_resume(run_dir: str | os.PathLike, step: int, overrides: Sequence[str]) -> None:
    """Append {"time", "step", "overrides"} to resume_overrides.jsonl (nothing when there are no overrides). A secret
    (config.SECRET_KEYS: analyzer.api_key) is never written: a later resume reads it from the environment again."""
    from opid_mega.config import SECRET_KEYS

    overrides = [o for o in overrides if str(o).partition("=")[0].strip() not in SECRET_KEYS]
    if not overrides:
        return
    from opid_mega.infra.jsonl import cut_to_last_line

    path = Path(run_dir) / OVERRIDES_FILE
    cut_to_last_line(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.time(), "step": int(step), "overrides": list(overrides)}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def resume_config(run_dir: str | os.PathLike, overrides: Sequence[str], where: Optional[str] = None,
                  plugins: bool = True):
    """(the config a resume runs with, the digest of config.yaml's own config): config.yaml (strictly) with the
    overrides of earlier resumes and then ``overrides`` applied (`plugins`: read_saved_config)."""
    from opid_mega.config import _set_dotted, config_from_dict, parse_override

    base = read_saved_config(run_dir, where, plugins=plugins)
    data = base.to_dict()
    for item in list(recorded_overrides(run_dir)) + list(overrides):  # a bad one: ConfigError
        key, value = parse_override(item)
        _set_dotted(data, key, value)
    return config_from_dict(data, plugins=plugins), config_digest(base)


def checkpoint_digest(ckpt_dir: str, step: int) -> Optional[dict]:
    """The config digest checkpoint ``step`` was saved with (None for checkpoints older than the digest)."""
    import torch

    try:
        common = torch.load(os.path.join(ckpt_dir, f"step_{step}", "common.pt"), map_location="cpu",
                            weights_only=True)
        raw = (common.get("extra") or {}).get("config")
        return json.loads(raw) if raw else None
    except Exception:  # noqa: BLE001 - checked for completeness by checkpoint.select_step already
        return None


# ---------------------------------------------------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------------------------------------------------


class RunLock:
    """An exclusive fcntl lock on run_dir/.lock held until :meth:`release` or the process ends (a POSIX record lock:
    the kernel drops it when the process dies, however it dies, and forked children such as megatron's checkpoint
    writers do not inherit it, so a killed trainer never leaves its directory locked). The file names the holder
    (pid, host). A second trainer gets a :class:`RunDirError` at once."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").split()
            os.close(fd)
            who = f"pid {holder[0]}" + (f" on {holder[1]}" if len(holder) > 1 else "") if holder else "another process"
            raise RunDirError(f"{self.run_dir} is in use by another trainer ({who} holds {self.path}); wait for it "
                              "to end or use another --run-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self.fd: Optional[int] = fd

    def release(self) -> None:
        if self.fd is not None:
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ---------------------------------------------------------------------------------------------------------------------
# What opid-train does with a run directory
# ---------------------------------------------------------------------------------------------------------------------


def checkpoint_names(run_dir: str | os.PathLike) -> list:
    """Names in run_dir/checkpoints that make it hold a run: latest_step and step_<N> directories (committed or
    not)."""
    ckpt = Path(run_dir) / "checkpoints"
    if not ckpt.is_dir():
        return []
    return sorted(p.name for p in ckpt.iterdir()
                  if p.name == "latest_step" or (p.name.startswith("step_") and p.name[5:].split(".")[0].isdigit()))


def move_aside(run_dir: str | os.PathLike) -> Path:
    """Rename run_dir to <run_dir>.old-<YYYYmmdd-HHMMSS> (a suffix -2, -3 ... when taken); returns the new path."""
    run_dir = Path(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dst = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 2
    while dst.exists():
        dst = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
        n += 1
    os.rename(run_dir, dst)
    return dst


def move_file_aside(path: Path) -> Optional[Path]:
    """A fresh run's predecessor file (an append-only log of a run that never saved a checkpoint) -> path.<time>.bak."""
    if path.exists() and path.stat().st_size > 0:
        dst = path.with_name(f"{path.name}.{int(time.time())}.bak")
        os.replace(path, dst)
        return dst
    return None


@dataclasses.dataclass
class RunPlan:
    cfg: object
    run_dir: Path
    resume: bool  # continue from the run directory's checkpoint
    overrides: list  # resume overrides to record (an explicit --resume RUN_DIR with key=value)
    digest: dict  # config_digest of the run's config.yaml (what every checkpoint of the run stores)
    overwrite: bool = False  # move an existing run aside first (global rank 0, under the lock)


def _committed(run_dir: Path) -> Optional[int]:
    from opid_mega.megatron.checkpoint_steps import latest_step

    return latest_step(str(run_dir / "checkpoints"))


def plan_run(config: Optional[str], run_dir: Optional[str], resume: Optional[str], overwrite: bool,
             overrides: Sequence[str]) -> RunPlan:
    """What opid-train's command line asks of the run directory (no side effects), or a one-line RunDirError:

    --resume RUN_DIR            continue RUN_DIR (config.yaml + earlier resume overrides + ``overrides``)
    --config X --resume auto    continue the run in the run directory when it has a committed checkpoint and was
                                started with the same config (X + overrides), else start fresh
    --config X [--overwrite]    start fresh; a directory holding checkpoints is refused unless --overwrite
    """
    if resume and overwrite:
        raise RunDirError("--overwrite starts a new run and --resume continues one: give one of them")
    if resume and resume != "auto":
        rd = Path(resume)
        if not rd.is_dir():
            raise RunDirError(f"--resume {rd}: no such directory")
        cfg, digest = resume_config(rd, overrides)
        cfg.logging.run_dir = str(rd)
        step = _check_checkpoint(rd, digest, f"--resume {rd}")
        if step is None:
            raise RunDirError(f"--resume {rd}: no complete checkpoint in {rd / 'checkpoints'}; start it again "
                              f"(--config FILE --run-dir {rd} --overwrite)")
        return RunPlan(cfg, rd, True, list(overrides), digest)
    if not config:
        raise RunDirError("--config is required (or --resume RUN_DIR)")
    from opid_mega.config import load_config

    cfg = load_config(config, list(overrides))  # a bad key or value: ConfigError
    rd = Path(run_dir or cfg.logging.run_dir)
    cfg.logging.run_dir = str(rd)
    digest = config_digest(cfg)
    if resume == "auto" and _committed(rd) is not None:
        saved, saved_digest = resume_config(rd, (), where=f"--resume auto ({rd})")
        differ = digest_diff(digest, saved_digest)
        if differ:
            raise RunDirError(f"--resume auto: {rd} holds a run of another config (sections {', '.join(differ)} "
                              f"differ from its {CONFIG_FILE}); continue it with --resume {rd} [key=value ...], or "
                              "start anew with --overwrite")
        saved.logging.run_dir = str(rd)
        step = _check_checkpoint(rd, saved_digest, f"--resume auto ({rd})")
        if step is not None:
            return RunPlan(saved, rd, True, [], saved_digest)
        raise RunDirError(f"--resume auto: {rd} has checkpoints but none is complete; move it aside with "
                          "--overwrite (nothing is deleted)")
    found = checkpoint_names(rd)
    if found and resume != "auto" and not overwrite:
        last = _committed(rd)
        what = f"checkpoint step_{last}" if last is not None else f"checkpoint files ({', '.join(found[:3])})"
        raise RunDirError(f"{rd} holds a run ({what}); continue it with --resume auto (or --resume {rd}), or move "
                          "it aside and start anew with --overwrite")
    occupied = rd.is_dir() and any(p.name != LOCK_FILE for p in rd.iterdir())
    return RunPlan(cfg, rd, False, [], digest, overwrite=overwrite and occupied)


def _check_checkpoint(rd: Path, digest: dict, where: str) -> Optional[int]:
    """The step a resume of ``rd`` will load (checkpoint.select_step), after checking that config.yaml is the config
    that checkpoint was saved with."""
    from opid_mega.megatron.checkpoint import select_step

    ckpt = str(rd / "checkpoints")
    step, _ = select_step(ckpt)
    if step is None:
        return None
    stored = checkpoint_digest(ckpt, step)
    if stored is not None:
        differ = digest_diff(digest, stored)
        if differ:
            raise RunDirError(f"{where}: {rd / CONFIG_FILE} is not the config checkpoint step_{step} was saved with "
                              f"(sections {', '.join(differ)} differ); restore it, or start anew with --overwrite")
    return step
