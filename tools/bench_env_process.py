"""What running TextWorld in a worker process (ProcessEnv, the default) costs against running it in the trainer's
process, on the tiny config's env (configs/tiny_cpu.yaml: coin_collector, easy).

Paired, side by side in one run: each round plays the same episodes (reset, then per step what the agent loop does:
build_prompt + step, following the expert walkthrough) in each mode, the order of the modes alternating between
rounds. Modes: `in-process` (make_env(process=False): each reset/step in a deadline thread, env.step_timeout_s),
`in-process, no deadline` (step_timeout_s=None: the call in the caller's thread, no limit) and `worker` (the
default: a ProcessEnv, one pipe round trip per call). Also measured: worker start (forkserver: the first start
starts the server, later ones fork it; spawn for comparison), the first reset in a fresh worker, the recovery after
a kill (a stuck step past its deadline, then the next reset in a fresh worker) and the worker's resident memory.

    python tools/bench_env_process.py --rounds 5 --json /tmp/bench_env_process.json

Run it on an otherwise idle machine. Games are generated (once, cached) before anything is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def play(env, tasks, history_length: int) -> tuple[float, float, int, int]:
    """(reset seconds, step seconds, resets, steps): the walkthrough of each task, build_prompt + step per step."""
    t_reset = t_step = 0.0
    n_steps = 0
    for task in tasks:
        t0 = time.perf_counter()
        obs = env.reset(task)
        t_reset += time.perf_counter() - t0
        plan = env.walkthrough()
        history = []
        for action in plan:
            t0 = time.perf_counter()
            env.build_prompt(history, obs, history_length)
            new_obs, reward, done, info = env.step(action)
            t_step += time.perf_counter() - t0
            history.append((obs, action))
            obs = new_obs
            n_steps += 1
        assert done and info["won"], f"the walkthrough of {task.id} did not win"
    return t_reset, t_step, len(tasks), n_steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    ap.add_argument("--tasks", type=int, default=4, help="games of the train pool played per round and mode")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--starts", type=int, default=5, help="worker starts timed per start method")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    from opid_mega.config import load_config
    from opid_mega.envs import make_env
    from opid_mega.envs.base import EnvTimeout

    cfg = load_config(args.config).env
    opts = dict(cfg.options)
    opts.pop("process", None)
    common = dict(max_steps=max(cfg.max_steps, 100), **opts)  # the walkthroughs play to the end
    local = make_env(cfg.name, process=False, step_timeout_s=cfg.step_timeout_s, **common)
    tasks = local.task_pool(cfg.train_split)[: args.tasks]
    local.prepare(tasks)  # generation is not timed
    bare = make_env(cfg.name, process=False, step_timeout_s=None, **common)

    # worker starts: forkserver (first = server start) and spawn; the first reset in each fresh worker
    starts: dict = {}
    for method in ("forkserver", "spawn"):
        times, first_resets = [], []
        for _ in range(args.starts):
            t0 = time.perf_counter()
            env = make_env(cfg.name, process=True, step_timeout_s=cfg.step_timeout_s, start_method=method, **common)
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            env.reset(tasks[0])
            first_resets.append(time.perf_counter() - t0)
            env.close()
        starts[method] = {"start_s": times, "first_reset_s": first_resets}
    worker = make_env(cfg.name, process=True, step_timeout_s=cfg.step_timeout_s, **common)
    play(worker, tasks[:1], cfg.history_length)  # warm: imports and the game loaded once, like `local` and `bare`
    play(local, tasks[:1], cfg.history_length)
    play(bare, tasks[:1], cfg.history_length)

    modes = {"in-process": local, "in-process, no deadline": bare, "worker": worker}
    order = list(modes)
    rounds: dict = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in (order if r % 2 == 0 else order[::-1]):
            t_reset, t_step, n_resets, n_steps = play(modes[m], tasks, cfg.history_length)
            rounds[m].append({"reset_ms": 1e3 * t_reset / n_resets, "step_ms": 1e3 * t_step / n_steps,
                              "steps": n_steps})
    worker_rss = rss_mb(worker.pid)

    # recovery: a step stuck past a 2 s deadline (the real jericho hang), then the next reset in a fresh worker
    stuck = make_env(cfg.name, process=True, step_timeout_s=2.0, admissible_only=False, **common)
    stuck.reset(tasks[0])
    t0 = time.perf_counter()
    try:
        stuck.step("\x00\x01\x02")
        raise AssertionError("the stuck step returned")
    except EnvTimeout:
        t_timeout = time.perf_counter() - t0
    t0 = time.perf_counter()
    stuck.reset(tasks[0])
    t_recover = time.perf_counter() - t0
    stuck.close()
    for env in modes.values():
        env.close()

    med = statistics.median
    result = {
        "config": os.path.relpath(args.config, ROOT), "env": cfg.name, "options": opts, "tasks": len(tasks),
        "rounds": args.rounds, "steps_per_round": rounds["worker"][0]["steps"],
        "modes": {m: {"step_ms_median": med(x["step_ms"] for x in v), "reset_ms_median": med(x["reset_ms"] for x in v),
                      "rounds": v} for m, v in rounds.items()},
        "paired_step_ms_worker_minus_in_process": med(
            w["step_ms"] - i["step_ms"] for w, i in zip(rounds["worker"], rounds["in-process"])),
        "paired_step_ms_worker_minus_no_deadline": med(
            w["step_ms"] - i["step_ms"] for w, i in zip(rounds["worker"], rounds["in-process, no deadline"])),
        "starts": {m: {"first_start_s": v["start_s"][0], "later_start_s_median": med(v["start_s"][1:] or v["start_s"]),
                       "first_reset_s_median": med(v["first_reset_s"]), **v} for m, v in starts.items()},
        "stuck_step_returned_s": t_timeout, "stuck_step_deadline_s": 2.0, "reset_after_kill_s": t_recover,
        "worker_rss_mb": worker_rss,
    }
    print(f"{cfg.name} {opts}: {len(tasks)} games, {result['steps_per_round']} steps per round, {args.rounds} rounds")
    print("| mode | ms per step (build_prompt + step) | ms per reset |")
    print("|---|---|---|")
    for m, v in result["modes"].items():
        print(f"| {m} | {v['step_ms_median']:.2f} | {v['reset_ms_median']:.2f} |")
    print(f"paired, worker - in-process: {result['paired_step_ms_worker_minus_in_process']:+.2f} ms per step; "
          f"worker - in-process without deadline: {result['paired_step_ms_worker_minus_no_deadline']:+.2f} ms")
    for m, v in result["starts"].items():
        print(f"worker start ({m}): first {v['first_start_s']:.2f} s, later {v['later_start_s_median']:.3f} s; "
              f"first reset in a fresh worker {v['first_reset_s_median']:.2f} s")
    print(f"stuck step (deadline 2.0 s) returned after {t_timeout:.2f} s; reset in a fresh worker after the kill "
          f"{t_recover:.2f} s; worker RSS {worker_rss:.0f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
