"""Command-line entry points: opid-train, opid-sft, opid-eval.

    opid-train --config configs/tiny_cpu.yaml [--run-dir DIR] [key.sub=value ...]    # a fresh run (refused when
                                                           # DIR holds one: --resume auto / --overwrite)
    opid-train --config X --run-dir DIR --resume auto [...] # continue DIR's run if it has a checkpoint, else start it
    opid-train --config X --run-dir DIR --overwrite [...]   # move DIR's run aside (DIR.old-<time>), start fresh
    opid-train --resume RUN_DIR [key.sub=value ...]        # continues from RUN_DIR's last complete checkpoint
    opid-sft   --config configs/tiny_cpu.yaml [--out DIR] [--epochs N] [--lr X]   # defaults: the `sft` section
    opid-eval  --config configs/tiny_cpu.yaml [--model HF_DIR | --checkpoint RUN_DIR] [--group-size N] [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from opid_mega.config import ConfigError, load_config
from opid_mega.infra.hosts import BindHostError
from opid_mega.infra.runtime import apply_core_budget, quiet


def first_run_notice(cfg) -> str:
    """One line: what this run builds once (cached under ~/.cache/opid_mega) and roughly how long that takes here;
    when nothing is to be built, what was found (only what this notice checked: the model directory or the cached
    built-in model, cached generated games, the env's data, the cached warm start). opid-train checked the model
    directory and the env's data before it (one line each, exit 2: opid_mega.checks).

    Estimates are from the 2-core CI machine (tiny-qwen3 built in ~10 s, a TextWorld game in ~5 s, an opid-sft
    epoch over 16 coin-collector games in ~3 s); other machines and models differ."""
    from opid_mega.models import BUILTIN_MODELS, is_prepared

    parts, seconds = [], 0.0
    found = []  # what is there already, as far as this notice checked it (named in the line when nothing is built)
    model_missing = False
    if cfg.model.init_from not in ("", "sft"):
        found.append(f"model {cfg.model.init_from}")
    elif cfg.model.path:
        found.append(f"model {cfg.model.path}")
    else:  # the built-in model is the starting point
        target = Path(os.path.expanduser(cfg.model.cache_dir)) / cfg.model.builtin
        if cfg.model.builtin in BUILTIN_MODELS and not is_prepared(target, cfg.model.builtin):
            model_missing = True
            est = 40.0 if cfg.model.builtin == "smollm2-135m" else 10.0
            parts.append(f"the {cfg.model.builtin} model (~{est:.0f} s)")
            seconds += est
        else:
            found.append(f"the {cfg.model.builtin} model cached")
    try:
        from opid_mega.envs import make_env

        # in this process (no env worker): the notice reads the task pool only, and must not delay rank 0's start
        # past the other ranks' rendezvous timeout (deploy.train_timeout_s)
        opts = {**dict(cfg.env.options), "process": False}
        env = make_env(cfg.env.name, max_steps=cfg.env.max_steps, step_timeout_s=cfg.env.step_timeout_s, **opts)
        unprepared = getattr(env, "unprepared", None)
        if unprepared is not None and hasattr(env, "task_pool"):
            splits = {cfg.env.train_split, cfg.env.eval_split}
            n = sum(unprepared(env.task_pool(s)) for s in splits)
            if n:
                parts.append(f"{n} {cfg.env.name} games (~{5 * n:.0f} s)")
                seconds += 5.0 * n
            else:
                found.append(f"{cfg.env.name} games cached")
        check = getattr(env, "data_problem", None)  # opid_mega.checks: ALFWorld games, WebShop server, Search corpus
        if check is not None and check(sorted({cfg.env.train_split, cfg.env.eval_split})) is None:
            found.append(f"{cfg.env.name} data present")
        env.close()
    except Exception:  # noqa: BLE001 - the notice never stops a run and claims nothing it could not check
        pass
    if cfg.model.init_from == "sft":
        cached = False
        if not model_missing:
            try:
                from opid_mega.sft import is_cached

                cached = is_cached(cfg)
            except Exception:  # noqa: BLE001
                cached = False
        if cached:
            found.append("the opid-sft warm start cached")
        else:
            pool = cfg.env.options.get("pool_size", {}) if isinstance(cfg.env.options, dict) else {}
            games = pool.get(cfg.env.train_split, 16) if isinstance(pool, dict) else 16
            tiny = cfg.model.builtin.startswith("tiny") and not cfg.model.path
            est = cfg.sft.epochs * 3.0 * max(1, int(games)) / 16 if tiny else None
            parts.append(f"the opid-sft warm start ({cfg.sft.epochs} epochs" +
                         (f", ~{est / 60:.0f} min)" if est else ", minutes to hours by model size)"))
            seconds += est or 0.0
    if not parts:
        return "opid-train: nothing to build first" + (f" ({', '.join(found)})" if found else "") + "; starting"
    when = f"; roughly {max(1, round(seconds / 60))} min on 2 cores" if seconds else ""
    return ("opid-train: first run of this config: building once (cached under ~/.cache/opid_mega) "
            + ", ".join(parts) + when + "; later runs skip this")


def _load(config: Optional[str], overrides: Sequence[str]):
    try:
        return load_config(config, list(overrides))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2)


def layout_ok(prog: str, cfg) -> bool:
    """Check the config's parallel layout against the world size and the model before any rank or process group
    starts (``opid_mega.megatron.layout``); on a problem print ONE line to stderr (rank 0) and return False."""
    from opid_mega.megatron.layout import config_layout_error

    msg = config_layout_error(cfg)
    if msg and os.environ.get("RANK", "0") == "0":
        print(f"{prog}: {msg}", file=sys.stderr)
    return msg is None


def model_ok(prog: str, cfg) -> bool:
    """The model directories the run starts from (opid_mega.checks.model_problems), on every rank (each node needs
    them), before the layout check reads their config.json: on a problem ONE line each on stderr (a node's first
    rank) and False."""
    from opid_mega.checks import model_problems

    problems = model_problems(cfg)
    if problems and os.environ.get("LOCAL_RANK", "0") == "0":
        for msg in problems:
            print(f"{prog}: {msg}", file=sys.stderr, flush=True)
    return not problems


def env_data_ok(prog: str, cfg) -> bool:
    """The env's data (opid_mega.checks.env_problems: ALFWorld games, a WebShop server, the Search-QA corpus), on
    global rank 0 (the rank that runs the envs), before any model is built: on a problem ONE line on stderr and
    False. The other ranks return True (torchrun ends them when rank 0 exits)."""
    if os.environ.get("RANK", "0") != "0":
        return True
    from opid_mega.checks import env_problems

    problems = env_problems(cfg)
    for msg in problems:
        print(f"{prog}: {msg}", file=sys.stderr, flush=True)
    return not problems


def train_main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="opid-train", description="OPID / GRPO training (see configs/README.md)")
    p.add_argument("--config", help="YAML config (configs/<name>.yaml)")
    p.add_argument("--run-dir", help="output directory (default: logging.run_dir)")
    p.add_argument("--resume", metavar="RUN_DIR|auto",
                   help="continue RUN_DIR from its last complete checkpoint; auto (with --config): continue the run "
                        "in the run directory when it has a checkpoint, else start it (what the launchers pass)")
    p.add_argument("--overwrite", action="store_true",
                   help="the run directory holds a run: move it aside to DIR.old-<time> (nothing is deleted) and "
                        "start fresh")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = p.parse_args(argv)
    quiet()
    from opid_mega import rundir

    rank0 = os.environ.get("RANK", "0") == "0"
    lock = None
    try:
        plan = rundir.plan_run(args.config, args.run_dir, args.resume, args.overwrite, args.overrides)
        # before anything is written (the run directory included) and before any model is built or loaded: the
        # model directory and its tokenizer, the layout against that model, the env's data (one line each, exit 2)
        if not model_ok("opid-train", plan.cfg) or not layout_ok("opid-train", plan.cfg):
            return 2
        if not env_data_ok("opid-train", plan.cfg):
            return 2
        if rank0:  # one trainer per run directory, for the run's whole life (released when the process ends)
            lock = rundir.RunLock(plan.run_dir)
            # again under the lock: another trainer may have written the directory since
            plan = rundir.plan_run(args.config, args.run_dir, args.resume, args.overwrite, args.overrides)
            if plan.overwrite:
                moved = rundir.move_aside(plan.run_dir)
                old, lock = lock, rundir.RunLock(plan.run_dir)
                old.release()
                print(f"opid-train: --overwrite: moved the run that was in {plan.run_dir} to {moved}", flush=True)
    except ConfigError as e:
        if rank0:
            print(f"config error: {e}", file=sys.stderr)
        return 2
    except rundir.RunDirError as e:
        if rank0:
            print(f"opid-train: {e}", file=sys.stderr)
        return 2
    try:
        if not rank0:
            return _train_planned(plan, rank0)
        with _train_log(plan, argv):  # rank 0's console, also in <run_dir>/train.log
            return _train_planned(plan, rank0)
    finally:
        if lock is not None:
            lock.release()


def _train_log(plan, argv: Optional[Sequence[str]]):
    """tee_console into <run_dir>/train.log: appended on a resume; a fresh start moves a predecessor's file (a run
    that never saved a checkpoint) aside to train.log.<time>.bak, as it does with audit.jsonl."""
    from opid_mega import rundir
    from opid_mega.infra.console_log import TRAIN_LOG, tee_console

    path = Path(plan.run_dir) / TRAIN_LOG
    try:
        Path(plan.run_dir).mkdir(parents=True, exist_ok=True)
        if not plan.resume:
            rundir.move_file_aside(path)
    except OSError:  # tee_console names the problem when it cannot open the file
        pass
    return tee_console(path, argv=["opid-train", *(sys.argv[1:] if argv is None else argv)])


def _train_planned(plan, rank0: bool) -> int:
    """opid-train after its run directory has been planned (and locked by global rank 0)."""
    cfg, run_dir = plan.cfg, plan.run_dir
    if not apply_core_budget("opid-train", cfg):
        return 2
    from opid_mega.infra import shutdown

    # SIGTERM / SIGHUP take Ctrl-C's path: a checkpoint write completes, the launched servers and the router are
    # shut down, one line, exit 128 + signum (opid_mega.infra.shutdown; a watchdog covers a rank blocked in C code)
    shutdown.install_signal_handlers("opid-train")
    try:
        if os.environ.get("RANK", "0") == "0":
            print(first_run_notice(cfg), flush=True)
            from opid_mega.checks import collapse_warning

            warning = collapse_warning(cfg)
            if warning:
                print(f"opid-train: {warning}", file=sys.stderr, flush=True)
        from opid_mega.megatron.checkpoint import CheckpointError
        from opid_mega.skills.llm_analyzer import AnalyzerUnavailable
        from opid_mega.pipeline import AnalyzerFailed
        from opid_mega.megatron.parallel import NODE_LOST_EXIT, NodeLost
        from opid_mega.rollout.launch import RolloutEngineDied
        from opid_mega.trainer import TrainingInterrupted, train

        train(cfg, str(run_dir), resume=plan.resume, resume_overrides=tuple(plan.overrides),
              config_digest=plan.digest)
    except AnalyzerUnavailable as e:  # the start-up probe: a bad analyzer key / URL / model
        print(f"opid-train: {e}", file=sys.stderr, flush=True)
        return 2
    except BindHostError as e:  # no interface for gloo / NCCL, or deploy.bind_host: one line per node
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"opid-train: {e}", file=sys.stderr, flush=True)
        return 2
    except (RolloutEngineDied, AnalyzerFailed) as e:
        print(f"opid-train: {e}", file=sys.stderr)
        return 3
    except NodeLost as e:  # a rank gave no word on the control group within its bound: one line naming its node
        if e.report:  # one rank of the job says it; the others leave quietly (torchrun ends the rest)
            print(f"opid-train: {e}", file=sys.stderr, flush=True)
        shutdown.exit_now(NODE_LOST_EXIT)  # the launched servers are stopped; no wait on a dead peer's socket
    except CheckpointError as e:  # e.g. too little disk space: one line, the previous checkpoint intact
        if rank0:
            print(f"opid-train: {e}", file=sys.stderr, flush=True)
        return 4
    except TrainingInterrupted as e:  # Ctrl-C / SIGTERM / SIGHUP: one line, on rank 0
        if os.environ.get("RANK", "0") == "0":
            print(f"opid-train: {e}", file=sys.stderr, flush=True)
        shutdown.exit_now(128 + e.signum)  # what is still registered is stopped; threads are not waited for
    except KeyboardInterrupt as e:  # while importing
        signum = shutdown.signal_of(e)
        if os.environ.get("RANK", "0") == "0":
            print(f"opid-train: {shutdown.describe(signum)} before training started; nothing to resume",
                  file=sys.stderr, flush=True)
        shutdown.exit_now(128 + signum)
    if os.environ.get("RANK", "0") == "0":
        print(f"opid-train: done, run directory {run_dir} (plots: opid-report {run_dir})")
    return 0


def sft_main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="opid-sft", description="supervised warm start on expert walkthroughs")
    p.add_argument("--config", required=True)
    p.add_argument("--out", help="HF output directory (default: cached under model.cache_dir)")
    p.add_argument("--epochs", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    quiet()
    cfg = _load(args.config, args.overrides)
    if not layout_ok("opid-sft", cfg):
        return 2
    from opid_mega.megatron import parallel
    from opid_mega.sft import run_sft

    out = run_sft(cfg, args.out, epochs=args.epochs, lr=args.lr)
    parallel.destroy()
    print(out)
    return 0


def eval_main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="opid-eval", description="evaluate a policy on held-out tasks (no skills)")
    p.add_argument("--config", required=True)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", help="HF model directory (default: the config's model / init_from)")
    which.add_argument("--checkpoint", metavar="RUN_DIR",
                       help="evaluate the newest complete checkpoint of a training run (model weights only, through "
                            "opid-export's path into a temporary HF directory; no optimizer is built)")
    p.add_argument("--group-size", type=int, default=1, help="episodes per task")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    quiet()
    cfg = _load(args.config, args.overrides)
    import shutil
    import tempfile

    tmp = None
    try:
        if args.checkpoint:  # the run's model, exported model-only (opid_mega.export), is what the engine serves
            from opid_mega.export import ExportError, export_hf

            tmp = tempfile.mkdtemp(prefix="opid-eval-")
            try:
                r = export_hf(args.checkpoint, os.path.join(tmp, "model"), prog="opid-eval",
                              log=lambda line: print(line, file=sys.stderr, flush=True))
            except (ExportError, OSError) as e:
                print(f"opid-eval: --checkpoint {args.checkpoint}: {e}", file=sys.stderr)
                return 2
            hf_dir = r.out_dir
            print(f"opid-eval: checkpoint step {r.step} of {args.checkpoint}", file=sys.stderr)
        else:
            from opid_mega.trainer import resolve_init

            hf_dir = args.model or resolve_init(cfg)
        return _evaluate(cfg, hf_dir, args.group_size)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _evaluate(cfg, hf_dir: str, group_size: int) -> int:
    from opid_mega.models import load_tokenizer
    from opid_mega.experience import mean, outcome_info_means
    from opid_mega.pipeline import play
    from opid_mega.rollout.launch import build_agent_loop, build_engine, env_factory

    engine = build_engine(cfg, hf_dir)
    env = env_factory(cfg)()
    tasks = env.tasks(cfg.env.eval_split, cfg.eval.num_tasks, seed=cfg.train.seed)
    env.close()
    loop = build_agent_loop(cfg, engine, load_tokenizer(hf_dir), hf_dir)
    trajs = play(loop, cfg, tasks, group_size, cfg.eval.temperature,
                 seed=cfg.train.seed * 100_003 + 77_777).trajectories
    loop.close()
    result = {"eval/success_rate": mean(t.won for t in trajs), "eval/episode_length": mean(t.length for t in trajs),
              "eval/invalid_rate": mean(not s.valid for t in trajs for s in t.steps),
              **outcome_info_means(trajs, "eval"), "episodes": len(trajs),
              "failed_episodes": sum(t.failed for t in trajs)}
    print(json.dumps(result))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(train_main())
