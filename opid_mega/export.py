"""opid-export: a Hugging Face model directory from a run checkpoint (model weights only).

    opid-export RUN_DIR OUT_DIR [--step N] [--dtype bf16|fp32] [--force]

reads checkpoint ``RUN_DIR/checkpoints/step_<N>`` (default: the newest complete one, the one a resume would take:
``opid_mega.megatron.checkpoint.select_step``) into ONE process at TP1/PP1, whatever TP/PP layout the run saved it
with (megatron-core's distributed checkpoints are resharded on load), and writes ``OUT_DIR``: ``config.json``,
``model.safetensors`` (``model-<i>-of-<n>.safetensors`` + ``model.safetensors.index.json`` beyond ``shard_bytes``),
the tokenizer files, ``generation_config.json`` and ``opid_export.json`` (run, step, dtype). Only the model's own
entries of the checkpoint are read (``checkpoint.load_model``): no optimizer, no RNG, no reference copy, so a 7B run
exports with the memory of one bf16 copy of the model plus one shard.

The run's ``config.yaml`` (with the overrides of its resumes) names the model it started from (``model.init_from`` /
``model.path`` / ``model.builtin``; the ``sft`` warm start shares its base model's config and tokenizer): config,
tokenizer and generation config come from there; the weights only from the checkpoint. ``--dtype`` sets the saved
tensors' dtype and config.json's ``dtype`` / ``torch_dtype`` (default: the run's ``model.dtype``).

The directory is written as ``OUT_DIR.tmp`` and renamed into place when complete; an existing non-empty ``OUT_DIR``
is refused unless ``--force`` (then it is replaced, after the new one is complete). Every problem (no such run, no
checkpoint, a step that is not there, an unreadable config.yaml, a checkpoint that does not fit the model) is one
line on stderr and exit status 2. ``opid-eval --checkpoint RUN_DIR`` goes through the same path
(:func:`export_hf` into a temporary directory).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Iterator, Optional, Sequence

from opid_mega.infra.files import fsync_path

DTYPES = {"bf16": "bfloat16", "fp32": "float32", "bfloat16": "bfloat16", "float32": "float32",
          "float16": "float16"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
PROVENANCE = "opid_export.json"
SHARD_BYTES = 4 << 30  # safetensors shard size (Hugging Face's convention: a few GB per file)


class ExportError(Exception):
    """A run that cannot be exported as asked; the message is one line naming the problem."""


@dataclasses.dataclass
class ExportPlan:
    """What an export reads, checked before any model is built."""
    run_dir: Path
    cfg: object  # opid_mega.config.Config of the run (config.yaml + its resumes' overrides)
    ckpt_root: str  # RUN_DIR/checkpoints
    step: int
    source_dir: str  # the HF directory the run started from (config, tokenizer, generation config)
    warning: Optional[str] = None  # newer checkpoints skipped as unreadable


@dataclasses.dataclass
class RunModel:
    """A run's model, loaded model-only into one process at TP1/PP1."""
    plan: ExportPlan
    chunks: list
    hf_config: object

    def hf_tensors(self, dtype=None) -> Iterator[tuple[str, "torch.Tensor"]]:  # noqa: F821
        """(HF name, CPU tensor) for every weight, in ``dtype`` (default: the model's), each its own copy."""
        from opid_mega.megatron.weights import export_hf_weights

        for bucket in export_hf_weights(self.chunks, self.hf_config):
            for name, t in bucket:
                yield name, t.detach().to("cpu", dtype or t.dtype, copy=True).contiguous()


def source_model_dir(cfg) -> str:
    """The HF directory a run's config started from, without building anything but a missing built-in model:
    model.init_from (an HF dir), else model.path / the built-in model (also for init_from=sft: the warm start is that
    model's weights trained, with its config and tokenizer)."""
    from opid_mega.models import resolve_model_path

    init = cfg.model.init_from
    if init and init != "sft":
        return resolve_model_path(init)
    return resolve_model_path(cfg.model.path, cfg.model.builtin, cfg.model.cache_dir)


def plan_export(run_dir: str | os.PathLike, step: Optional[int] = None) -> ExportPlan:
    """Check a run directory and pick the checkpoint (cheap: no model is built). Raises :class:`ExportError`."""
    from opid_mega import rundir
    from opid_mega.config import ConfigError
    from opid_mega.megatron import checkpoint

    rd = Path(run_dir)
    if not rd.exists():
        raise ExportError(f"run directory {rd} does not exist")
    if not rd.is_dir():
        raise ExportError(f"{rd} is not a directory (expected a run directory of opid-train)")
    try:
        # the model only: a plug-in env / analyzer of the run need not be importable here (docs/custom_env.md)
        cfg, _ = rundir.resume_config(rd, (), where=str(rd), plugins=False)
    except rundir.RunDirError as e:
        raise ExportError(str(e)) from None
    except ConfigError as e:
        raise ExportError(f"{rd / rundir.CONFIG_FILE}: {e}") from None
    ckpt_root = str(rd / "checkpoints")
    steps = checkpoint.saved_steps(ckpt_root)
    warning = None
    if step is None:
        step, warning = checkpoint.select_step(ckpt_root)
        if step is None:  # the warning names each unreadable checkpoint and why
            raise ExportError(warning.removeprefix("warning: ") if warning else
                              f"no checkpoint in {ckpt_root} (the run saved none yet)")
    else:
        if step not in steps:
            have = ", ".join(map(str, steps)) if steps else "none"
            raise ExportError(f"--step {step}: no checkpoint step_{step} in {ckpt_root} (steps there: {have})")
        why = checkpoint.checkpoint_problem(os.path.join(ckpt_root, f"step_{step}"))
        if why is not None:
            raise ExportError(f"--step {step}: checkpoint {ckpt_root}/step_{step} is incomplete ({why})")
    try:
        checkpoint.checkpoint_dir(ckpt_root, step)
    except FileNotFoundError as e:
        raise ExportError(str(e)) from None
    try:
        src = source_model_dir(cfg)
    except Exception as e:  # noqa: BLE001 - FileNotFoundError, ModelBuildError, ...: one line
        raise ExportError(f"the model the run started from (model section of {rd / rundir.CONFIG_FILE}) is not "
                          f"available: {e}") from None
    if not any((Path(src) / f).is_file() for f in TOKENIZER_FILES):
        raise ExportError(f"the run's model directory {src} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return ExportPlan(rd, cfg, ckpt_root, int(step), src, warning)


@contextlib.contextmanager
def _one_process():
    """megatron's parallel state for one process (TP1/PP1, gloo on CPU) for the duration; left as found."""
    import torch.distributed as dist

    from opid_mega.megatron import cpu_compat, parallel

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ExportError(f"the export runs in one process; this one is rank {dist.get_rank()} of "
                              f"{dist.get_world_size()}")
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(1, 1)
        yield
        return
    world = os.environ.get("WORLD_SIZE", "1")
    if world.strip() not in ("", "1"):
        raise ExportError(f"the export runs in one process (WORLD_SIZE={world}); start it without torchrun")
    shims_before = cpu_compat._APPLIED
    parallel.initialize(1, 1, backend="auto")
    try:
        yield
    finally:
        parallel.destroy()
        if not shims_before:
            cpu_compat.remove()


@contextlib.contextmanager
def load_run_model(plan: ExportPlan) -> Iterator[RunModel]:
    """The model of checkpoint ``plan.step``, model entries only (``checkpoint.load_model``), in one process at
    TP1/PP1 in the run's model.dtype; the parallel state is torn down on exit."""
    import torch
    from transformers import AutoConfig

    from opid_mega.megatron import checkpoint
    from opid_mega.megatron.model import build_model, transformer_config
    from opid_mega.models import torch_dtype

    try:
        hf_config = AutoConfig.from_pretrained(plan.source_dir)
        tcfg = transformer_config(hf_config, tp=1, pp=1, dtype=torch_dtype(plan.cfg.model.dtype),
                                  perform_initialization=False)  # every weight comes from the checkpoint
    except (OSError, ValueError) as e:
        raise ExportError(f"{plan.source_dir}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    with _one_process():
        chunks = build_model(hf_config, tcfg, kernel_backend=plan.cfg.scoring.kernel_backend)
        try:
            with warnings.catch_warnings():  # torch's notice about megatron's ShardedTensor, on every load
                warnings.filterwarnings("ignore", message=".*Please use DTensor instead", category=FutureWarning)
                checkpoint.load_model(plan.ckpt_root, chunks, step=plan.step)
        except (ValueError, FileNotFoundError) as e:
            raise ExportError(f"checkpoint step_{plan.step} of {plan.run_dir}: {str(e).splitlines()[0]}") from None
        try:
            yield RunModel(plan, chunks, hf_config)
        finally:
            del chunks
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _support_files(src: str) -> list[Path]:
    """The files of an HF directory besides its weights: config, tokenizer, generation config, chat template, ...
    (hidden files such as the model cache's completion markers left out)."""
    out = []
    for f in sorted(Path(src).iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        if f.name.endswith(WEIGHT_SUFFIXES) or f.name in WEIGHT_INDEXES or f.name == PROVENANCE:
            continue
        out.append(f)
    return out


def _write_weights(tensors: Iterator, tmp: Path, shard_bytes: int) -> tuple[int, int]:
    """Save (name, tensor) pairs as safetensors shards in ``tmp``; returns (tensor count, total bytes)."""
    from safetensors.torch import save_file

    parts: list[tuple[Path, list[str]]] = []
    shard: dict = {}
    size = total = count = 0

    def flush():
        nonlocal shard, size
        if shard:
            path = tmp / f".part-{len(parts):05d}.safetensors"
            save_file(shard, str(path), metadata={"format": "pt"})
            fsync_path(path)
            parts.append((path, list(shard)))
            shard, size = {}, 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
        if name in shard or any(name in names for _, names in parts):
            raise ExportError(f"tensor {name} exported twice (a bug in the weight mapping)")
        shard[name] = t
        size += nbytes
        total += nbytes
        count += 1
    flush()
    if not parts:
        raise ExportError("the model has no weights to export")
    if len(parts) == 1:
        os.replace(parts[0][0], tmp / "model.safetensors")
        return count, total
    n = len(parts)
    weight_map = {}
    for i, (path, names) in enumerate(parts, 1):
        final = f"model-{i:05d}-of-{n:05d}.safetensors"
        os.replace(path, tmp / final)
        weight_map.update({k: final for k in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return count, total


def _same_or_inside(a: Path, b: Path) -> bool:
    """Whether ``a`` is ``b`` or a directory above it."""
    try:
        a, b = a.resolve(), b.resolve()
    except OSError:
        return False
    return a == b or a in b.parents


@dataclasses.dataclass
class ExportResult:
    out_dir: str
    step: int
    dtype: str
    tensors: int
    bytes: int
    source_dir: str


def export_hf(run_dir: str | os.PathLike, out_dir: str | os.PathLike, step: Optional[int] = None,
              dtype: Optional[str] = None, force: bool = False, shard_bytes: int = SHARD_BYTES,
              log=None, prog: str = "opid-export") -> ExportResult:
    """Write the HF directory ``out_dir`` from checkpoint ``step`` (default: the newest complete) of ``run_dir``
    (module docstring). ``dtype``: bf16 | fp32 (or bfloat16 | float32 | float16; None: the run's model.dtype).
    ``log``: a callable for the warning line when newer checkpoints were skipped as unreadable."""
    from opid_mega.models import torch_dtype

    out = Path(out_dir)
    if str(out).rstrip("/") in ("", "."):
        raise ExportError(f"output directory {str(out_dir)!r}: name a new directory")
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose bf16 or fp32")
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"output directory {out} exists and is not empty (--force replaces it)")
    if _same_or_inside(out, Path(run_dir)):  # --force would replace the run itself
        raise ExportError(f"output directory {out} is or holds the run directory {run_dir}; choose another")
    plan = plan_export(run_dir, step)
    if plan.warning and log:
        log(f"{prog}: {plan.warning}")
    name = DTYPES[dtype] if dtype is not None else plan.cfg.model.dtype
    out_dtype = torch_dtype(name)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed export's leftover
    tmp.mkdir(parents=True)
    try:
        with load_run_model(plan) as model:
            count, nbytes = _write_weights(model.hf_tensors(out_dtype), tmp, shard_bytes)
            hf_config = model.hf_config
        for f in _support_files(plan.source_dir):
            shutil.copy(f, tmp / f.name)
        cfg_json = json.loads((Path(plan.source_dir) / "config.json").read_text())
        cfg_json["dtype"] = cfg_json["torch_dtype"] = name  # transformers >= 4.56 reads dtype, older torch_dtype
        (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
        if not (tmp / "generation_config.json").exists():
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(hf_config).save_pretrained(str(tmp))
        (tmp / PROVENANCE).write_text(json.dumps({
            "run_dir": str(plan.run_dir.resolve()), "step": plan.step, "dtype": name,
            "source_model": str(Path(plan.source_dir).resolve()), "tensors": count, "bytes": nbytes}, indent=2) + "\n")
        fsync_path(tmp)
        old = out.with_name(out.name + ".old")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(str(out), plan.step, name, count, nbytes, plan.source_dir)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="opid-export", description="a Hugging Face model directory (config.json, "
                                "safetensors, tokenizer, generation_config.json) from a run checkpoint, model "
                                "weights only, whatever the TP/PP layout it was saved with")
    p.add_argument("run_dir", metavar="RUN_DIR", help="an opid-train run directory (holds config.yaml, checkpoints/)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the HF directory to write (written as OUT_DIR.tmp, renamed)")
    p.add_argument("--step", type=int, help="checkpoint step_N to export (default: the newest complete one)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="dtype of the saved tensors (default: model.dtype of "
                   "the run)")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR when it exists and is not empty")
    args = p.parse_args(argv)
    from opid_mega.infra.runtime import quiet

    quiet()
    try:
        r = export_hf(args.run_dir, args.out_dir, step=args.step, dtype=args.dtype, force=args.force,
                      log=lambda line: print(line, file=sys.stderr, flush=True))
    except ExportError as e:
        print(f"opid-export: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. no permission / no space for OUT_DIR
        print(f"opid-export: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(f"opid-export: wrote {r.out_dir} from step_{r.step} of {args.run_dir} ({r.tensors} tensors, "
          f"{r.bytes / 1e6:.1f} MB {r.dtype}); load it with transformers.AutoModelForCausalLM.from_pretrained"
          f"({r.out_dir!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
