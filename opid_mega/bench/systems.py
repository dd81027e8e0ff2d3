"""opid-bench ops of the systems around the model: the C++ batch builder, weight sync, environment workers.

All three are host-side work: timed and metered on the CPU (peak = this process's extra resident memory) whatever
the op's device. None has FLOPs; the bound, where one exists, is one copy of the bytes the case must move at this
machine's memcpy rate (core: `copy_bytes`, "bound_kind": "copy"); the env worker has none.

builder      one iteration's CPU-side batch work (outcome advantages -> fork-layout scoring micro-batches -> token
             advantages -> training micro-batches), C++ (opid_mega._C) vs the numpy reference; errors: the token
             and outcome advantages vs float64, and how many packed arrays differ from the numpy path's (0 =
             byte-identical). Shapes: one iteration of the paper's ALFWorld and Search-QA configs (7b, 32b), 1/8 of
             it (ci: 2 of 16 ALFWorld tasks, 16 of 128 Search-QA tasks), a toy batch (tiny).
weight_sync  the transfer of the preset model's HF weights (bf16, all of them: what replica 0's export sends after
             the TP gather; ci: the first 4 of its 24 layers, 119 MB, for the 2-core time budget) from the trainer to an engine process on this machine, per sync.method: tensor
             (shared-memory handles), tensor with inline bytes (pickle + base64, the cross-machine form), distributed
             (gloo broadcast), disk (safetensors). The engine process copies every tensor into its own weights, as
             SGLang's loader does; the Megatron export and SGLang's HTTP round trips are not in it (payloads cross a
             pipe). Error: the engine's weights vs the trainer's (float64 sums and a strided sample; exact: 0).
env_worker   TextWorld (the tiny config's coin_collector, easy) in a worker process (ProcessEnv, the default) vs in
             the trainer's process: walkthrough episodes (reset, then build_prompt + step per step), the worker's
             start (forkserver vs spawn) with its first reset, and a stuck step past its deadline (killed, the next
             reset in a fresh worker). Error: observations, rewards and done flags that differ from the in-process
             run's.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref

import numpy as np
import torch

from .core import Case, Method, Preset

CPU = "cpu"


# ------------------------------------------------------------------------------------------------------------------
# builder
# ------------------------------------------------------------------------------------------------------------------
# name: (tasks, trajectories per task, steps, prompt token range, response token range, critical steps K)
BUILDER_SHAPES = {
    "alfworld": (16, 8, 30, (1000, 2000), (50, 300), 5),
    "search_qa": (128, 8, 4, (800, 3000), (50, 300), 2),
}
BUILDER_PRESETS = {  # preset -> ({shape name: shape}, token budget per micro-batch, data-parallel ranks)
    "tiny": ({"alfworld": (1, 4, 6, (200, 400), (10, 40), 2)}, 2048, 2),
    "ci": ({"alfworld": (2, 8, 30, (1000, 2000), (50, 300), 5), "search_qa": (16, 8, 4, (800, 3000), (50, 300), 2)},
           32768, 4),
    "7b": (BUILDER_SHAPES, 32768, 4),
    "32b": (BUILDER_SHAPES, 32768, 4),
}
LAMBDAS = (0.001, 0.001)  # λ of the episode and the step skill type


def make_batch(shape, placement: str = "late", seed: int = 0, vocab: int = 151_000, token_dtype=np.int32) -> dict:
    """A synthetic rollout batch of `shape`: CSR contexts (original, +skill per step-sample) and per-sample arrays.
    The skill is inserted `late` (before the closing paragraph, DESIGN.md) or `faithful` (the episode skill right
    after the task line)."""
    from opid_mega.batching.layout import ContextBatch

    tasks, trajs, steps, prompt_rng, resp_rng, k_crit = shape
    rng = np.random.default_rng(seed)
    pieces, ctx_lens, resp_lens, gids, use_step, scores = [], [], [], [], [], []
    for t in range(tasks):
        step0 = rng.integers(0, vocab, int(rng.integers(*prompt_rng)))
        task_line = int(rng.integers(30, 80))
        for _ in range(trajs):
            won = rng.random() < 0.5
            critical = set(rng.choice(steps, size=min(k_crit, steps), replace=False).tolist())
            for s in range(steps):
                prompt = step0 if s == 0 else rng.integers(0, vocab, int(rng.integers(*prompt_rng)))
                resp = rng.integers(0, vocab, int(rng.integers(*resp_rng)))
                is_step = s in critical
                skill = rng.integers(0, vocab, int(rng.integers(40, 120)))
                if placement == "late" or is_step:
                    cut = prompt.size - int(rng.integers(60, 100))  # before the closing paragraph
                else:
                    cut = task_line
                pieces += [prompt, resp, prompt[:cut], skill, prompt[cut:], resp]
                ctx_lens += [prompt.size + resp.size, prompt.size + skill.size + resp.size]
                resp_lens += [resp.size, resp.size]
                gids.append(t)
                use_step.append(is_step)
                scores.append((10.0 if won else 0.0) - (0.1 if rng.random() < 0.05 else 0.0))
    tokens = np.concatenate(pieces).astype(token_dtype)
    ctx_offsets = np.concatenate([[0], np.cumsum(ctx_lens)]).astype(np.int64)
    n = len(gids)
    ctx = ContextBatch(tokens, ctx_offsets, np.array(resp_lens, np.int64), np.arange(0, 2 * n + 1, 2, dtype=np.int64))
    use_step = np.array(use_step, bool)
    resp = ctx.resp_lens[::2].copy()
    total = int(resp.sum())
    deltas = [rng.standard_normal(total).astype(np.float32) * 0.3 for _ in range(2)]
    starts, ends = ctx.ctx_offsets[0:-1:2], ctx.ctx_offsets[1::2]
    train_tokens = np.concatenate([ctx.tokens[a:b] for a, b in zip(starts, ends)])
    train_offsets = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64)
    return {"contexts": ctx, "group_ids": np.array(gids, np.int64), "scores": np.array(scores, np.float64),
            "use_step": use_step, "use_ep": ~use_step, "resp": resp, "deltas": deltas,
            "train": (train_tokens, train_offsets)}


def pipeline(data: dict, backend: str, budget: int, ranks: int, normalize: bool = False):
    """(scoring batches, token advantages, training batches, outcome advantages) of one iteration."""
    from opid_mega import batching

    a_out = batching.outcome_advantage(data["scores"], data["group_ids"], "mean_std_norm", backend=backend)
    scoring = batching.build_fork_batches(data["contexts"], budget, ranks, backend=backend)
    adv = batching.token_advantages(a_out, data["resp"], data["deltas"], [data["use_ep"], data["use_step"]],
                                    list(LAMBDAS), normalize=normalize, backend=backend)
    train = batching.build_train_batches(data["train"][0], data["train"][1], data["resp"], budget, ranks,
                                         token_values=adv, backend=backend)
    return scoring, adv, train, a_out


def reference_advantages(data: dict, eps: float = 1e-6) -> tuple:
    """float64 (outcome advantage per sample, token advantage per response token): mean_std_norm per group
    (unbiased σ; a one-sample group: μ 0, σ 1), then + Σ λ_k Δ_k on the samples of skill type k."""
    scores, gids = data["scores"], data["group_ids"]
    out = np.empty_like(scores)
    for g in np.unique(gids):
        idx = gids == g
        v = scores[idx]
        mu, sigma = (0.0, 1.0) if v.size == 1 else (v.mean(), v.std(ddof=1))
        out[idx] = (v - mu) / (sigma + eps)
    adv = np.repeat(out, data["resp"])
    for delta, mask, lam in zip(data["deltas"], (data["use_ep"], data["use_step"]), LAMBDAS):
        adv += lam * np.where(np.repeat(mask, data["resp"]), delta.astype(np.float64), 0.0)
    return out, adv


def _flat_differ(a: dict, b: dict) -> int:
    keys = set(a) | set(b)
    same = lambda x, y: (x.dtype == y.dtype and x.tobytes() == y.tobytes()) \
        if isinstance(x, np.ndarray) and isinstance(y, np.ndarray) else x == y  # noqa: E731
    return sum(1 for k in keys if k not in a or k not in b or not same(a[k], b[k]))


def _nbytes(flat: dict) -> int:
    return sum(v.nbytes for v in flat.values() if isinstance(v, np.ndarray))


def builder_cases(preset: Preset, device: torch.device, compile_peers: bool = True) -> list:
    from opid_mega import batching

    shapes, budget, ranks = BUILDER_PRESETS[preset.name]
    cpp_skip = None if batching.backend_name() == "cpp" else \
        "opid_mega._C is not built: pip install --no-build-isolation --no-deps -e ."
    cases = []
    for name, shape in shapes.items():
        data = make_batch(shape)
        ref_out, ref_adv = reference_advantages(data)
        numpy_out = pipeline(data, "python", budget, ranks)
        numpy_fork = numpy_out[0]
        ctx = data["contexts"]
        dims = {"step_samples": int(ctx.num_samples), "context_tokens": int(ctx.tokens.size),
                "scoring_tokens": int(numpy_fork.num_tokens), "response_tokens": int(data["resp"].sum()),
                "budget": budget, "dp_ranks": ranks}
        extra = {"shared_fraction": round(float(numpy_fork.shared_fraction), 4),
                 "scoring_micro_batches": numpy_fork.num_ranks * numpy_fork.micro_batches_per_rank}

        def error(res, ref_out=ref_out, ref_adv=ref_adv, numpy_out=numpy_out):
            scoring, adv, train, a_out = res
            return {"token_adv": float(np.abs(adv.astype(np.float64) - ref_adv).max()),
                    "outcome_adv": float(np.abs(a_out - ref_out).max()),
                    "arrays_differ": float(_flat_differ(scoring.flat, numpy_out[0].flat)
                                           + _flat_differ(train.flat, numpy_out[2].flat)
                                           + (adv.tobytes() != numpy_out[1].tobytes()))}

        out_bytes = _nbytes(numpy_out[0].flat) + _nbytes(numpy_out[2].flat) + numpy_out[1].nbytes
        rows = [Method("batch builder", "ours", "C++ (opid_mega._C)",
                       None if cpp_skip else lambda d=data: pipeline(d, "cpp", budget, ranks), cpp_skip),
                Method("numpy reference", "peer", "numpy + Python",
                       lambda d=data: pipeline(d, "python", budget, ranks))]
        cases.append(Case(f"iteration {name}", dims, "int32", 0, rows, error, extra=extra, copy_bytes=out_bytes,
                          device=CPU))

        def fork_error(res, numpy_fork=numpy_fork):
            return {"arrays_differ": float(_flat_differ(res.flat, numpy_fork.flat))}

        fork_rows = [Method("build_fork_batches", "ours", "C++ (opid_mega._C)", None if cpp_skip else
                            lambda c=ctx: batching.build_fork_batches(c, budget, ranks, backend="cpp"), cpp_skip),
                     Method("numpy reference", "peer", "numpy + Python",
                            lambda c=ctx: batching.build_fork_batches(c, budget, ranks, backend="python"))]
        cases.append(Case(f"fork scoring batches {name}", dims, "int32", 0, fork_rows, fork_error, extra=extra,
                          copy_bytes=_nbytes(numpy_fork.flat), device=CPU))
        del numpy_out
    return cases


# ------------------------------------------------------------------------------------------------------------------
# weight sync
# ------------------------------------------------------------------------------------------------------------------
# preset -> (layers, intermediate size, tied embeddings) of its model (Qwen2.5 configs; tiny: a toy of its shapes)
MODEL_DEPTH = {"tiny": (2, 256, True), "ci": (24, 4864, True), "7b": (28, 18944, False), "32b": (64, 27648, False)}
# presets that sync a part of the model (2 CPU cores, the time budget): the first N layers, no embedding
SYNC_LAYERS = {"ci": 4}
SYNC_DTYPE = "bfloat16"
BUCKET_BYTES = 512 << 20  # sync.bucket_mb's default
SAMPLE = 4096  # elements of each tensor the error check compares one by one (plus the float64 sum of all)


def hf_shapes(preset: Preset, whole: bool = False) -> list:
    """(HF name, shape) of every weight of the preset's model, whole (the engine gets them after the TP gather);
    unless `whole`, only the first SYNC_LAYERS layers where the preset names a part."""
    layers, inter, tied = MODEL_DEPTH[preset.name]
    part = None if whole else SYNC_LAYERS.get(preset.name)
    h, hd = preset.hidden, preset.head_dim
    q, kv = preset.heads * hd, preset.kv_heads * hd
    out = [] if part else [("model.embed_tokens.weight", (preset.vocab, h))]
    for i in range(part or layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.k_proj.bias", (kv,)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.bias", (kv,)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "post_attention_layernorm.weight", (h,)), (p + "mlp.gate_proj.weight", (inter, h)),
                (p + "mlp.up_proj.weight", (inter, h)), (p + "mlp.down_proj.weight", (h, inter))]
    if part:
        return out
    out.append(("model.norm.weight", (h,)))
    if not tied:
        out.append(("lm_head.weight", (preset.vocab, h)))
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _fingerprint(tensors: dict) -> dict:
    """name -> (float64 sum, a strided sample as float64): what the error check compares."""
    out = {}
    for name, t in tensors.items():
        flat = t.reshape(-1)
        step = max(1, flat.numel() // SAMPLE)
        out[name] = (float(flat.sum(dtype=torch.float64)), flat[::step].double().clone())
    return out


def _engine_loop(conn, shapes: list, dtype: str) -> None:
    """The engine process: its own weights (zeros until a sync), then commands from the trainer over `conn`:
    ("tensor", [payload, ...]) / ("disk", [file, ...]) / ("gloo", port, [(name, nbytes) per bucket]) load a sync and
    answer the bytes loaded; ("verify",) answers the fingerprint of the weights and zeroes them; ("exit",)."""
    import base64
    import datetime
    import pickle

    import torch.multiprocessing  # noqa: F401 - registers the shared-memory rebuilds the payloads name

    torch.set_num_threads(1)
    weights = {n: torch.zeros(s, dtype=getattr(torch, dtype)) for n, s in shapes}
    group = None

    def load(named):
        n = 0
        for name, t in named:
            weights[name].copy_(t)
            n += t.numel() * t.element_size()
        return n

    while True:
        msg = conn.recv()
        try:
            if msg[0] == "exit":
                return
            if msg[0] == "verify":
                reply = _fingerprint(weights)
                for t in weights.values():
                    t.zero_()
            elif msg[0] == "tensor":
                reply = sum(load(pickle.loads(base64.b64decode(p))) for p in msg[1])
            elif msg[0] == "disk":
                from safetensors.torch import load_file

                reply = sum(load(load_file(f).items()) for f in msg[1])
            elif msg[0] == "gloo":
                from torch.distributed import BroadcastOptions, ProcessGroupGloo, TCPStore

                if group is None:
                    store = TCPStore("127.0.0.1", msg[1], 2, is_master=False,
                                     timeout=datetime.timedelta(seconds=120))
                    group = ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=120))
                    conn.send(("ok", "joined"))
                opts = BroadcastOptions()
                opts.rootRank = 0
                reply = 0
                for bucket in msg[2]:
                    works = [group.broadcast([weights[name].view(-1).view(torch.uint8)], opts) for name in bucket]
                    for w in works:
                        w.wait()
                    reply += sum(weights[name].numel() * weights[name].element_size() for name in bucket)
            else:
                raise ValueError(f"unknown command {msg[0]!r}")
            conn.send(("ok", reply))
        except Exception as exc:  # noqa: BLE001 - the trainer side raises it
            conn.send(("err", f"{type(exc).__name__}: {exc}"))


class _Engine:
    """The trainer's handle of the engine process (started at the first sync, ended by close() or collection)."""

    TIMEOUT_S = 600.0

    def __init__(self, shapes: list, dtype: str):
        self.shapes, self.dtype = shapes, dtype
        self.proc = self.conn = None
        self.group = self.store = None  # the distributed method's update group (made at its first sync)
        self._finalizer = None

    def start(self):
        if self.proc is not None:
            return
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_loop, args=(child, self.shapes, self.dtype), daemon=True,
                                name="opid-bench-engine")
        self.proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _Engine._stop, self.proc, self.conn)

    def ask(self, *msg):
        self.start()
        self.conn.send(msg)
        return self.answer()

    def answer(self):
        if not self.conn.poll(self.TIMEOUT_S):
            raise TimeoutError(f"the engine process did not answer within {self.TIMEOUT_S:g} s")
        status, payload = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine process: {payload}")
        return payload

    @staticmethod
    def _stop(proc, conn):
        try:
            conn.send(("exit",))
        except (OSError, ValueError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)

    def close(self):
        if self._finalizer is not None:
            self._finalizer()
        self.proc = self.conn = self.group = self.store = None


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def weight_sync_cases(preset: Preset, device: torch.device, compile_peers: bool = True) -> list:
    from opid_mega.infra.buckets import size_buckets
    from opid_mega.rollout.sglang_engine import serialize_named_tensors

    shapes = hf_shapes(preset)
    dtype = getattr(torch, SYNC_DTYPE)
    nbytes = sum(_numel(s) for _, s in shapes) * dtype.itemsize
    layers = MODEL_DEPTH[preset.name][0]
    whole = sum(_numel(s) for _, s in hf_shapes(preset, whole=True)) * dtype.itemsize
    dims = {"model": preset.model, "params": nbytes // dtype.itemsize, "bytes": nbytes, "tensors": len(shapes),
            "layers": f"{SYNC_LAYERS.get(preset.name, layers)} of {layers}", "model_bytes": whole,
            "bucket_bytes": BUCKET_BYTES}
    name = f"sync {SYNC_DTYPE}" + (f", {dims['layers']} layers" if preset.name in SYNC_LAYERS else "")
    methods = [("tensor", "shared-memory handles (sync.method tensor, CPU)"),
               ("tensor, inline bytes", "pickle + base64 in the request (weight_transport inline)"),
               ("distributed", "gloo broadcast (sync.method distributed, CPU)"),
               ("disk", "safetensors files + load (sync.method disk)")]
    need = 3 * nbytes + (1 << 30)
    why = None
    if device.type != "cpu":
        why = "host transports only: run it with --device cpu (CUDA IPC and NCCL need a served model on the GPU)"
    elif need > _available_bytes():
        why = (f"needs ~{need / 2 ** 30:.0f} GiB of host memory (the weights in the trainer and the engine, one "
               f"bucket in flight), {_available_bytes() / 2 ** 30:.0f} GiB available")
    if why:
        rows = [Method(name, "ours", runs_as, skipped=why) for name, runs_as in methods]
        return [Case(name, dims, SYNC_DTYPE, 0, rows, lambda res: {}, copy_bytes=nbytes, device=CPU)]

    g = torch.Generator().manual_seed(0)
    weights = {n: torch.rand(s, generator=g).sub_(0.5).to(dtype) for n, s in shapes}
    expect = _fingerprint(weights)
    engine = _Engine(shapes, SYNC_DTYPE)
    scratch = tempfile.mkdtemp(prefix="opid-bench-sync-")
    state = {"version": 0}

    def buckets():
        return size_buckets(iter(weights.items()), BUCKET_BYTES)

    def via_tensor(transport):  # one request per bucket, as the engine's update_weights sends them
        return sum(engine.ask("tensor", [serialize_named_tensors(b, transport)]) for b in buckets())

    def via_disk():
        from safetensors.torch import save_file

        state["version"] += 1
        out = os.path.join(scratch, f"v{state['version']}")
        os.makedirs(out)
        files = []
        for i, bucket in enumerate(buckets()):
            files.append(os.path.join(out, f"model-{i:05d}.safetensors"))
            save_file({n: t.contiguous() for n, t in bucket}, files[-1], metadata={"format": "pt"})
        try:
            return engine.ask("disk", files)
        finally:
            shutil.rmtree(out, ignore_errors=True)  # the sync removes the version before it

    def via_gloo():
        import datetime

        from torch.distributed import BroadcastOptions, ProcessGroupGloo, TCPStore

        plan = [[n for n, _ in b] for b in buckets()]
        engine.start()
        if engine.group is None:  # the first sync creates the update group (timed in the warm-up call)
            store = TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=120),
                             wait_for_workers=False)
            engine.conn.send(("gloo", store.port, plan))
            engine.group = ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=120))
            engine.store = store
            engine.answer()  # joined
        else:
            engine.conn.send(("gloo", None, plan))
        opts = BroadcastOptions()
        opts.rootRank = 0
        for names in plan:
            works = [engine.group.broadcast([weights[n].view(-1).view(torch.uint8)], opts) for n in names]
            for w in works:
                w.wait()
        return engine.answer()

    calls = {"tensor": lambda: via_tensor("shm"), "tensor, inline bytes": lambda: via_tensor("inline"),
             "distributed": via_gloo, "disk": via_disk}
    last = methods[-1][0]

    def error(res):
        name, sent = res
        got = engine.ask("verify")
        if name == last:  # the last row: the engine process and the scratch directory go
            engine.close()
            shutil.rmtree(scratch, ignore_errors=True)
        return {"weights": max(float((got[n][1] - expect[n][1]).abs().max()) for n in expect),
                "sums": max(abs(got[n][0] - expect[n][0]) for n in expect),
                "bytes_missing": float(nbytes - sent)}

    rows = [Method(name, "ours", runs_as, lambda name=name: (name, calls[name]())) for name, runs_as in methods]
    case = Case(name, dims, SYNC_DTYPE, 0, rows, error, copy_bytes=nbytes, device=CPU,
                extra={"engine": "a process on this machine: copies each tensor into its own weights"})
    weakref.finalize(case, shutil.rmtree, scratch, True)
    return [case]


# ------------------------------------------------------------------------------------------------------------------
# env worker
# ------------------------------------------------------------------------------------------------------------------
ENV_NAME = "textworld"
ENV_OPTIONS = {"challenges": ["coin_collector"], "difficulties": ["easy"],
               "pool_size": {"train": 16, "valid": 4, "test": 8}}  # configs/tiny_cpu.yaml's env
ENV_GAMES = {"tiny": 2, "ci": 4, "7b": 16, "32b": 16}  # walkthrough episodes per timed call
HISTORY = 2
STEP_TIMEOUT_S = 60.0  # env.step_timeout_s's default
STUCK_DEADLINE_S = 0.5
STUCK_ACTION = "\x00\x01\x02"  # jericho never returns from this step


def play(env, tasks, history_length: int = HISTORY) -> list:
    """The walkthrough of each task (reset, then build_prompt + step per step): [(obs, reward, done)] per call."""
    out = []
    for task in tasks:
        obs = env.reset(task)
        out.append((obs, 0.0, False))
        history = []
        for action in env.walkthrough():
            env.build_prompt(history, obs, history_length)
            new_obs, reward, done, info = env.step(action)
            out.append((new_obs, float(reward), bool(done)))
            history.append((obs, action))
            obs = new_obs
    return out


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def env_worker_cases(preset: Preset, device: torch.device, compile_peers: bool = True) -> list:
    from opid_mega.envs import make_env
    from opid_mega.envs.base import EnvTimeout

    common = dict(max_steps=100, **ENV_OPTIONS)  # the walkthroughs play to the end
    bare = make_env(ENV_NAME, process=False, step_timeout_s=None, **common)
    tasks = bare.task_pool("train")[:ENV_GAMES[preset.name]]
    bare.prepare(tasks)  # game generation (cached on disk) is not timed
    reference = play(bare, tasks)
    n_steps = len(reference) - len(tasks)
    local = make_env(ENV_NAME, process=False, step_timeout_s=STEP_TIMEOUT_S, **common)
    worker = make_env(ENV_NAME, process=True, step_timeout_s=STEP_TIMEOUT_S, **common)
    first_start = worker.start_time_s  # the forkserver's own start too when this is the process's first worker
    play(worker, tasks[:1])
    worker_rss = _rss_bytes(worker.pid)

    def differ(res, reference=reference):
        return {"obs_differ": float(sum(a != b for a, b in zip(res, reference)) + abs(len(res) - len(reference)))}

    episodes = Case(
        "episodes", {"env": ENV_NAME, "games": len(tasks), "steps": n_steps}, "n/a", 0,
        [Method("worker process (default)", "ours", "ProcessEnv (forkserver)", lambda: play(worker, tasks)),
         Method("in-process, thread deadline", "peer", "process: false", lambda: play(local, tasks)),
         Method("in-process, no deadline", "peer", "step_timeout_s: null", lambda: play(bare, tasks))],
        differ, device=CPU, extra={"worker_rss_bytes": worker_rss, "step_timeout_s": STEP_TIMEOUT_S,
                                   "first_worker_start_s": round(first_start, 4)})

    def start(method):
        env = make_env(ENV_NAME, process=True, step_timeout_s=STEP_TIMEOUT_S, start_method=method, **common)
        try:
            return [(env.reset(tasks[0]), 0.0, False)]
        finally:
            env.close()

    starts = Case(
        "worker start + first reset", {"env": ENV_NAME, "games": 1}, "n/a", 0,
        [Method("forkserver (default)", "ours", "ProcessEnv", lambda: start("forkserver")),
         Method("spawn", "peer", "ProcessEnv", lambda: start("spawn"))],
        lambda res: differ(res, reference[:1]), device=CPU,
        extra={"note": "forkserver: the server already runs (its start: the episodes' first_worker_start_s)"})

    stuck_env = make_env(ENV_NAME, process=True, step_timeout_s=STEP_TIMEOUT_S, admissible_only=False, **common)

    def stuck():
        stuck_env.reset(tasks[0])
        t0 = time.perf_counter()
        try:
            stuck_env.step_with_timeout(STUCK_ACTION, STUCK_DEADLINE_S)
            raise AssertionError("the stuck step returned")
        except EnvTimeout:
            returned = time.perf_counter() - t0
        return returned, [(stuck_env.reset(tasks[0]), 0.0, False)]

    def stuck_error(res):
        returned, obs = res
        return {"past_deadline_s": returned - STUCK_DEADLINE_S, **differ(obs, reference[:1])}

    recovery = Case(
        "stuck step, then reset", {"env": ENV_NAME, "deadline_s": STUCK_DEADLINE_S}, "n/a", 0,
        [Method("worker process: killed at the deadline, reset in a fresh one", "ours", "ProcessEnv (forkserver)",
                stuck),
         Method("in-process, thread deadline", "peer", "process: false",
                skipped="cannot recover: the stuck call goes on in its thread holding TextWorld's lock")],
        stuck_error, device=CPU)
    for env in (bare, local, worker, stuck_env):
        weakref.finalize(recovery, env.close)
    return [episodes, starts, recovery]


OPS = {
    "builder": ("C++ batch builder vs numpy: one iteration's advantages and micro-batches (host)", builder_cases),
    "weight_sync": ("trainer -> engine weight transfer per sync.method, the preset model's bf16 weights (host)",
                    weight_sync_cases),
    "env_worker": ("TextWorld in a worker process vs in-process: episodes, worker start, stuck-step recovery",
                   env_worker_cases),
}
