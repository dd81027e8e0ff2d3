"""Run one rollout and report it: tasks, success rate, mean length, invalid-action rate, tokens/s.

    python tools/rollout_report.py --env search_qa --engine local --model tiny-qwen3 --tasks 4 --group 2
    python tools/rollout_report.py --env textworld --engine walkthrough --tasks 2 --group 2     # expert policy
    python tools/rollout_report.py --env search_qa --engine sglang --model smollm2-135m \
        --sglang-arg=--dtype --sglang-arg=float32                      # launches a server (CPU flags added)
    python tools/rollout_report.py --engine sglang --sglang-url http://127.0.0.1:30000 --model /path/to/hf_dir

--model is a built-in name (tools/prepare_models.py) or an HF directory. --env-option key=value (value parsed as
JSON when it can be, e.g. --env-option 'challenges=["coin_collector"]') goes to opid_mega.envs.make_env.
--json FILE also writes the metrics and every trajectory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse_options(pairs):
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"--env-option expects key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv=None) -> int:
    from opid_mega.envs import ENV_DEFAULTS, ENV_NAMES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="search_qa", choices=ENV_NAMES)
    ap.add_argument("--env-option", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--split", default="train")
    ap.add_argument("--engine", default="local", choices=["local", "sglang", "walkthrough"])
    ap.add_argument("--model", default="tiny-qwen3", help="built-in model name or HF model directory")
    ap.add_argument("--cache-dir", default=None, help="model cache (default ~/.cache/opid_mega/models)")
    ap.add_argument("--dtype", default="float32", help="local engine dtype")
    ap.add_argument("--sglang-url", default="", help="attach to this server instead of launching one")
    ap.add_argument("--sglang-arg", action="append", default=[], help="extra launch_server argument (verbatim)")
    ap.add_argument("--tasks", type=int, default=4, help="B: tasks")
    ap.add_argument("--group", type=int, default=2, help="G: trajectories per task")
    ap.add_argument("--max-steps", type=int, default=None, help="default: the env's (OPID setups)")
    ap.add_argument("--history-length", type=int, default=None, help="default: the env's (OPID setups)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--json", default="", help="write metrics + trajectories here")
    args = ap.parse_args(argv)

    from opid_mega.envs import make_env
    from opid_mega.models import BUILTIN_MODELS, load_tokenizer, prepare_model
    from opid_mega.rollout.agent_loop import AgentLoop
    from opid_mega.rollout.engine import SamplingParams
    from opid_mega.rollout.factory import make_engine

    defaults = ENV_DEFAULTS[args.env]
    max_steps = args.max_steps or defaults["max_steps"]
    history = args.history_length if args.history_length is not None else defaults["history_length"]
    env_options = _parse_options(args.env_option)
    env_options.setdefault("max_steps", max_steps)

    model_path = prepare_model(args.model, args.cache_dir) if args.model in BUILTIN_MODELS else args.model
    tokenizer = load_tokenizer(model_path)
    probe = make_env(args.env, **env_options)
    tasks = probe.tasks(args.split, args.tasks, seed=args.seed)

    t0 = time.perf_counter()
    if args.engine == "local":
        engine = make_engine("local", model_path, dtype=args.dtype)
    elif args.engine == "sglang":
        engine = (make_engine("sglang", None, url=args.sglang_url) if args.sglang_url else
                  make_engine("sglang", model_path, server_args=args.sglang_arg))
    else:
        from opid_mega.rollout.scripted_engine import ScriptedEngine, WalkthroughPolicy

        engine = ScriptedEngine(tokenizer, WalkthroughPolicy(probe, tasks))
    setup_s = time.perf_counter() - t0
    probe.close()

    loop = AgentLoop(engine, tokenizer, env_name=args.env, env_options=env_options, history_length=history,
                     max_steps=max_steps, num_workers=args.workers, model_path=model_path)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                              stop_token_ids=loop.stop_token_ids, seed=args.seed)
    try:
        batch = loop.run(tasks, args.group, sampling)
    finally:
        loop.close()
        engine.shutdown()
    m = batch.metrics()
    print(f"env {args.env} ({args.split}), engine {args.engine}, model {os.path.basename(model_path)}; "
          f"engine setup {setup_s:.1f} s")
    print(f"tasks: {', '.join(t.id for t in tasks)}")
    print(f"trajectories {m['num_trajectories']} (B={args.tasks} x G={args.group}), step-samples "
          f"{m['num_step_samples']}, failed {m['num_failed']}")
    print(f"success rate {m['success_rate']:.3f}  mean length {m['mean_length']:.2f}  "
          f"invalid-action rate {m['invalid_rate']:.3f}")
    print(f"response tokens {m['response_tokens']} in {m['generate_time_s']:.1f} s of generation: "
          f"{m['generate_tokens_per_s']:.1f} tok/s  (rollout wall {m['wall_time_s']:.1f} s, "
          f"{batch.num_generate_calls} engine calls)")
    for t in batch.trajectories:
        if t.error:
            print(f"  trajectory {t.traj_id} ({t.task_id}) failed: {t.error}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"metrics": m, "trajectories": [t.to_dict() for t in batch.trajectories]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
