"""tools/launch: opid-train through torchrun.sh (c10d rendezvous), the SLURM template and Ray, for real.

Multi-node is simulated on one machine: two torchrun agents ("nodes") on localhost meet at one c10d rendezvous
store; the SLURM template runs with fake `scontrol` / `srun` on PATH (srun starts its command once per node with
SLURM_NODEID set, in parallel, as SLURM does); Ray mode starts a local Ray instance. Every run is the tiny CPU config
with a random tiny model, 1 iteration, and must write that iteration's metrics.
"""
import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "tools" / "launch"
CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")
# random tiny Qwen3 (no warm start), 1 task x 2 trajectories of <= 2 steps, 1 iteration, no evaluation or checkpoint
TWO_BY_TWO = ["deploy.nodes=2", "deploy.gpus_per_node=2"]  # the launch shape is the config's (CPU: "GPU" = rank)
TINY = ["model.init_from=", "rollout.tasks_per_iter=1", "rollout.group_size=2", "env.max_steps=2",
        "rollout.max_response_tokens=8", "eval.interval=0", "eval.num_tasks=0", "train.iterations=1",
        "train.save_interval=0", "train.micro_batch_tokens=512", "train.mini_batch_size=2",
        "logging.tensorboard=false", "logging.progress=false"]
BASE_ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHON": sys.executable}
for _k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NNODES",
           "NODE_RANK", "NPROC_PER_NODE", "RDZV_ENDPOINT", "RDZV_ID", "OMP_NUM_THREADS", "RAY_ADDRESS"):
    BASE_ENV.pop(_k, None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(run_dir: Path) -> list:
    path = run_dir / "metrics.jsonl"
    assert path.exists(), f"no metrics.jsonl in {run_dir}: {sorted(p.name for p in run_dir.iterdir())}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_one_iteration(run_dir: Path) -> None:
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["train/step_samples"] >= 2 and rows[0]["ppo/loss"] == rows[0]["ppo/loss"]  # not NaN
    assert (run_dir / "config.yaml").exists() and (run_dir / "audit.jsonl").exists()


def rendezvous_results(log: str) -> list:
    """torchrun's rendezvous results (LOGLEVEL=INFO; one field per log line): one dict per rendezvous of an agent."""
    fields = re.findall(r"\s(group_rank|group_world_size|global_ranks|global_world_sizes)=(\d+|\[[\d, ]*\])$", log,
                        re.M)
    out = []
    for name, value in fields:
        if name == "group_rank":
            out.append({})
        out[-1][name] = int(value) if value.isdigit() else [int(x) for x in value.strip("[]").split(",")]
    return out


# ---------------------------------------------------------------------------------------------------------------
# fast: syntax, the printed commands, the pre-start checks
# ---------------------------------------------------------------------------------------------------------------


def test_scripts_parse():
    for name in ("torchrun.sh", "opid.sbatch"):
        r = subprocess.run(["bash", "-n", str(LAUNCH / name)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert os.access(LAUNCH / "torchrun.sh", os.X_OK)
    sbatch = (LAUNCH / "opid.sbatch").read_text()
    for directive in ("#SBATCH --nodes=", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8"):
        assert directive in sbatch


def test_torchrun_sh_prints_the_command_per_node():
    env = {**BASE_ENV, "NNODES": "2", "NPROC_PER_NODE": "2", "RDZV_ENDPOINT": "head:29400", "RDZV_ID": "job7",
           "OPID_LAUNCH_DRY_RUN": "1"}
    lines = {}
    for node in (0, 1):
        r = subprocess.run([str(LAUNCH / "torchrun.sh"), "--config", CONFIG, "parallel.tp=2", "train.iterations=3",
                            *TWO_BY_TWO], env={**env, "NODE_RANK": str(node), "NODE_ADDR": f"10.9.0.{node + 1}"},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        lines[node] = r.stderr.strip().splitlines()[-1]
    for node, line in lines.items():
        assert f"node {node}/2" in line
        assert "-m torch.distributed.run --nnodes 2 --nproc-per-node 2" in line
        assert "--rdzv-backend c10d --rdzv-endpoint head:29400 --rdzv-id job7" in line
        assert f"--rdzv-conf is_host={int(node == 0)} --local-addr 10.9.0.{node + 1} " in line  # NODE_ADDR
        # --resume auto: a torchrun restart or a requeue of this command line continues the run
        assert line.endswith(f"-m opid_mega.cli --resume auto --config {CONFIG} parallel.tp=2 train.iterations=3 "
                             "deploy.nodes=2 deploy.gpus_per_node=2")
    # 2 cores here, 2 ranks per node: each rank gets its share (not torchrun's forced 1 on a bigger machine)
    from opid_mega.infra.runtime import available_cores

    assert f"OMP_NUM_THREADS={max(1, available_cores() // 2)}:" in lines[0]


def test_launchers_add_resume_auto_unless_the_arguments_choose(tmp_path):
    """torchrun.sh and ray_launch.py put --resume auto first, except when the arguments say --resume or --overwrite
    themselves (an explicit --resume RUN_DIR is kept as given; --resume auto stays "auto", not a path)."""
    env = {**BASE_ENV, "NNODES": "1", "NPROC_PER_NODE": "1", "RDZV_ENDPOINT": "localhost:29999",
           "OPID_LAUNCH_DRY_RUN": "1"}
    run = tmp_path / "run"
    for args, tail in ((["--config", CONFIG, "--overwrite"], f"-m opid_mega.cli --config {CONFIG} --overwrite"),
                       (["--config", CONFIG, "--resume", "auto"], f"-m opid_mega.cli --config {CONFIG} --resume auto")):
        r = subprocess.run([str(LAUNCH / "torchrun.sh"), *args], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stderr.strip().splitlines()[-1].endswith(tail), r.stderr
    sys.path.insert(0, str(LAUNCH))
    try:
        import ray_launch
    finally:
        sys.path.remove(str(LAUNCH))
    assert ray_launch.with_resume_auto(["--config", "c.yaml", "a=1"]) == ["--resume", "auto", "--config", "c.yaml", "a=1"]
    assert ray_launch.with_resume_auto(["--resume", "/r"]) == ["--resume", "/r"]
    assert ray_launch.with_resume_auto(["--config", "c", "--overwrite"]) == ["--config", "c", "--overwrite"]
    assert ray_launch.absolute_paths(["--resume", "auto", "--run-dir", "r"]) == ["--resume", "auto", "--run-dir",
                                                                                  os.path.abspath("r")]
    assert ray_launch.absolute_paths([f"--resume={run}"]) == [f"--resume={run}"]


def test_torchrun_sh_stops_on_a_bad_layout_or_key_before_torchrun():
    env = {**BASE_ENV, "NNODES": "2", "NPROC_PER_NODE": "2", "RDZV_ENDPOINT": "localhost:1"}
    r = subprocess.run([str(LAUNCH / "torchrun.sh"), "--config", CONFIG, "parallel.tp=3", *TWO_BY_TWO], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "opid-train (2 node(s) x 2 rank(s) = world 4): tp=3 does not divide the 4 attention heads of tiny-qwen3"]
    # the shape is the config's: NNODES / NPROC_PER_NODE that disagree are refused in one line
    for extra, want in ((["deploy.gpus_per_node=2"], "NNODES=2 disagrees with deploy.nodes = 1"),
                        (["deploy.nodes=2", "deploy.gpus_per_node=3"],
                         "NPROC_PER_NODE=2 disagrees with the config's ranks per node")):
        r = subprocess.run([str(LAUNCH / "torchrun.sh"), "--config", CONFIG, *extra], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and want in r.stderr, r.stderr
    r = subprocess.run([str(LAUNCH / "torchrun.sh"), "--config", CONFIG, "parallel.tpp=2", *TWO_BY_TWO], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "config error: parallel.tpp" in r.stderr and "torch.distributed.run" not in r.stderr
    r = subprocess.run([str(LAUNCH / "torchrun.sh"), "--config", CONFIG, *TWO_BY_TWO], env={**env, "NODE_RANK": "2"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "NODE_RANK=2" in r.stderr


def fake_slurm(tmp_path: Path, nodes: int) -> dict:
    """scontrol and srun stand-ins on PATH and the variables sbatch would set for a `nodes`-node job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\n'
        '# scontrol show hostnames a,b,... -> one host per line; scontrol show node X -> its record, NodeAddr from\n'
        '# $FAKE_NODE_ADDRS ("name=addr,..."; SLURM reports the name itself when slurm.conf gives no address)\n'
        'if [[ "$1 $2" == "show hostnames" ]]; then tr "," "\\n" <<< "$3"; exit 0; fi\n'
        '[[ "$1 $2" == "show node" ]] || { echo "fake scontrol: $*" >&2; exit 1; }\n'
        'addr="$3"; for kv in ${FAKE_NODE_ADDRS//,/ }; do [[ "${kv%%=*}" == "$3" ]] && addr="${kv#*=}"; done\n'
        'echo "NodeName=$3 Arch=x86_64 CoresPerSocket=8"; echo "   NodeAddr=$addr NodeHostName=$3 Version=24.05"\n')
    (bin_dir / "srun").write_text(
        '#!/usr/bin/env bash\n'
        '# srun --nodes=N ... CMD ARGS: CMD once per node, in parallel, SLURM_NODEID/SLURM_PROCID/SLURMD_NODENAME set;\n'
        '# fails if one does\n'
        'n=1; while [[ "$1" == --* ]]; do case "$1" in --nodes=*) n="${1#--nodes=}";; esac; shift; done\n'
        'echo "$*" > "$FAKE_SRUN_LOG.cmd"\n'
        'IFS=, read -r -a names <<< "$SLURM_JOB_NODELIST"\n'
        'pids=(); for ((i = 0; i < n; i++)); do\n'
        '  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURMD_NODENAME="${names[$i]}" "$@" > "$FAKE_SRUN_LOG.$i" 2>&1 &\n'
        '  pids+=($!)\n'
        'done\n'
        'rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc\n')
    for f in ("scontrol", "srun"):
        (bin_dir / f).chmod((bin_dir / f).stat().st_mode | stat.S_IEXEC)
    return {**BASE_ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": ",".join(["localhost"] * nodes), "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NNODES": str(nodes), "SLURM_SUBMIT_DIR": str(ROOT), "FAKE_SRUN_LOG": str(tmp_path / "srun")}


def test_sbatch_template_generates_one_torchrun_per_node(tmp_path):
    """The rendezvous is on the head node's SLURM address (NodeAddr), each node's NODE_ADDR (torchrun
    --local-addr) its own; a node SLURM knows by name only gets no NODE_ADDR (torchrun.sh finds its interface)."""
    env = {**fake_slurm(tmp_path, 2), "SLURM_GPUS_PER_NODE": "h100:8", "OPID_LAUNCH_DRY_RUN": "1",
           "FAKE_NODE_ADDRS": "gpu-a=10.1.0.1"}
    env["SLURM_JOB_NODELIST"] = "gpu-a,gpu-b"  # a dry run resolves no host
    r = subprocess.run(["bash", str(LAUNCH / "opid.sbatch"), "--config", CONFIG, "parallel.tp=2", "parallel.pp=2",
                        "deploy.nodes=2", "deploy.gpus_per_node=8"], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + "".join((tmp_path / f"srun.{i}").read_text() for i in range(2))
    assert "rendezvous 10.1.0.1:29400" in r.stderr
    for node in (0, 1):
        line = (tmp_path / f"srun.{node}").read_text().strip().splitlines()[-1]
        assert f"node {node}/2" in line and "--nnodes 2 --nproc-per-node 8" in line
        assert "--rdzv-endpoint 10.1.0.1:29400 --rdzv-id opid-4242" in line and f"is_host={int(node == 0)}" in line
        assert line.count("--local-addr") == (node == 0) and ("--local-addr 10.1.0.1 " in line) == (node == 0)
        assert line.endswith(f"-m opid_mega.cli --resume auto --config {CONFIG} parallel.tp=2 parallel.pp=2 "
                             "deploy.nodes=2 deploy.gpus_per_node=8")  # DP4: 8 ranks per node from the config
    assert "#SBATCH --requeue" in (LAUNCH / "opid.sbatch").read_text()  # a requeued job continues (--resume auto)


# ---------------------------------------------------------------------------------------------------------------
# slow: real launches
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_sh_two_nodes_of_two_ranks_on_localhost(tmp_path):
    """4 ranks as 2 simulated nodes x 2 over one c10d rendezvous, TP2 x PP2 (so the run needs all 4 ranks in one
    world: two separate 2-rank worlds could not hold the layout)."""
    run_dir = tmp_path / "run"
    env = {**BASE_ENV, "NNODES": "2", "NPROC_PER_NODE": "2", "RDZV_ENDPOINT": f"localhost:{free_port()}",
           "RDZV_ID": "test-2x2", "LOGLEVEL": "INFO"}
    cmd = [str(LAUNCH / "torchrun.sh"), "--config", CONFIG, "--run-dir", str(run_dir)] + TINY + \
          ["parallel.tp=2", "parallel.pp=2"] + TWO_BY_TWO
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, env={**env, "NODE_RANK": str(n)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print(f"2 nodes x 2 ranks: {time.monotonic() - t0:.1f} s")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    results = [rendezvous_results(log) for log in logs]
    assert all(len(r) == 1 for r in results), logs
    (a,), (b,) = results
    assert {a["group_rank"], b["group_rank"]} == {0, 1} and a["group_world_size"] == b["group_world_size"] == 2
    assert set(a["global_world_sizes"] + b["global_world_sizes"]) == {4} and sorted(a["global_ranks"] + b["global_ranks"]) == [0, 1, 2, 3]
    assert_one_iteration(run_dir)


@pytest.mark.slow
def test_sbatch_template_runs_two_nodes_on_localhost(tmp_path):
    """The template's own command path (scontrol -> head node, srun -> torchrun.sh per node with NODE_RANK from
    SLURM_NODEID) with 2 simulated nodes x 1 rank (DP2) on localhost."""
    run_dir = tmp_path / "run"
    env = {**fake_slurm(tmp_path, 2), "SLURM_GPUS_PER_NODE": "1", "RDZV_PORT": str(free_port())}
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(LAUNCH / "opid.sbatch"), "--config", CONFIG, "--run-dir", str(run_dir)] + TINY
                       + ["deploy.nodes=2"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    print(f"sbatch, 2 nodes x 1 rank: {time.monotonic() - t0:.1f} s")
    logs = [(tmp_path / f"srun.{i}").read_text() for i in range(2)]
    assert r.returncode == 0, r.stderr + "\n".join(x[-3000:] for x in logs)
    for node, log in enumerate(logs):
        assert f"torchrun.sh: node {node}/2" in log and f"is_host={int(node == 0)}" in log
    assert "opid-train: done" in "".join(logs)
    assert_one_iteration(run_dir)


@pytest.mark.slow
def test_ray_launch_two_ranks_local_cluster(tmp_path):
    """2 ranks as 2 simulated nodes x 1 (two STRICT_PACK placement groups on the one local Ray node), DP2."""
    pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(LAUNCH / "ray_launch.py"), "--nodes", "2", "--trainers-per-node", "1",
                        "--timeout", "400",
                        "--config", CONFIG, "--run-dir", str(run_dir)] + TINY + ["deploy.nodes=2"],
                       env=BASE_ENV, cwd=tmp_path, capture_output=True, text=True, timeout=480)
    print(f"ray, 2 nodes x 1 rank: {time.monotonic() - t0:.1f} s")
    assert r.returncode == 0, r.stderr[-6000:]
    assert "ray_launch.py: 2 rank(s) (2 x 1), bundles {'CPU': 1}" in r.stderr, r.stderr[-4000:]
    assert re.search(r"rank 0: node 0 local rank 0/1 on [\d.]+\n", r.stderr)
    assert re.search(r"rank 1: node 1 local rank 0/1 on [\d.]+\n", r.stderr)
    assert "all 2 rank(s) finished" in r.stderr
    assert_one_iteration(run_dir)


@pytest.mark.slow
def test_ray_launch_names_the_failing_rank(tmp_path):
    """Rank 0 fails (its run directory is a file, so it cannot create it) while rank 1 waits for it on a collective:
    the launcher names rank 0 and its error, stops rank 1 at once (no waiting for a collective's timeout) and
    removes the placement group."""
    pytest.importorskip("ray")
    blocker = tmp_path / "run"
    blocker.write_text("not a directory")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(LAUNCH / "ray_launch.py"), "--trainers-per-node", "2", "--timeout", "300",
                        "--config", CONFIG, "--run-dir", str(blocker)] + TINY + ["deploy.gpus_per_node=2"],
                       env=BASE_ENV, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    print(f"ray, failing rank 0: {time.monotonic() - t0:.1f} s")
    # exit 1 on rank 0's failure, not 124 after --timeout 300 ("still running after"): rank 1 was not waited for
    assert r.returncode == 1, r.stderr[-4000:]
    assert "ray_launch.py: rank 0 failed: FileExistsError" in r.stderr, r.stderr[-4000:]
    assert "all 2 rank(s) finished" not in r.stderr and "still running after" not in r.stderr


def test_ray_launch_stops_on_a_bad_layout_before_starting_ray(tmp_path):
    r = subprocess.run([sys.executable, str(LAUNCH / "ray_launch.py"), "--nodes", "2", "--trainers-per-node", "2",
                        "--config", CONFIG, "parallel.tp=3", *TWO_BY_TWO], env=BASE_ENV, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "opid-train (2 node(s) x 2 rank(s) = world 4): tp=3 does not divide the 4 attention heads of tiny-qwen3"]
    # nodes and ranks per node are the config's: a different --nodes is refused before Ray starts
    r = subprocess.run([sys.executable, str(LAUNCH / "ray_launch.py"), "--nodes", "3", "--config", CONFIG,
                        *TWO_BY_TWO], env=BASE_ENV, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "opid-train: --nodes=3 disagrees with deploy.nodes = 2; leave --nodes unset (the launchers take it from the "
        "config) or change the config (deploy.nodes=3)"]


def test_torchrun_sh_overwrite_only_on_a_first_start(tmp_path):
    """--overwrite moves the run directory's progress aside: refused with torchrun restarts (each would move the
    job's own checkpoints away); on a requeued SLURM job (SLURM_RESTART_COUNT > 0) dropped for --resume auto."""
    env = {**BASE_ENV, "OPID_LAUNCH_DRY_RUN": "1", "RDZV_ENDPOINT": "localhost:29555"}
    cmd = [str(LAUNCH / "torchrun.sh"), "--config", CONFIG, "--run-dir", str(tmp_path / "run"), "--overwrite",
           "train.iterations=3"]
    r = subprocess.run(cmd, env={**env, "MAX_RESTARTS": "2"}, capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("torchrun.sh: --overwrite with MAX_RESTARTS=2")
    r = subprocess.run(cmd, env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "requeued job (SLURM_RESTART_COUNT=1): --overwrite applied on the first start only" in r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(
        f"-m opid_mega.cli --resume auto --config {CONFIG} --run-dir {tmp_path / 'run'} train.iterations=3")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)  # a first start: as given
    assert r.returncode == 0 and r.stderr.strip().splitlines()[-1].endswith(
        f"-m opid_mega.cli --config {CONFIG} --run-dir {tmp_path / 'run'} --overwrite train.iterations=3"), r.stderr


def test_preflight_names_a_missing_model_directory_or_tokenizer(tmp_path):
    """A model.path given as a local directory is checked before any rank starts: one line, exit 2."""
    def preflight(path):
        return subprocess.run([sys.executable, str(LAUNCH / "preflight.py"), "--", "--config", CONFIG,
                               f"model.path={path}"], env=BASE_ENV, capture_output=True, text=True, timeout=120)

    r = preflight(tmp_path / "nope")
    assert r.returncode == 2 and r.stderr.strip() == f"opid-train: model.path={tmp_path / 'nope'}: no such directory " \
                                                     f"on this node ({os.uname().nodename})", r.stderr
    (tmp_path / "m").mkdir()
    r = preflight(tmp_path / "m")
    assert r.returncode == 2 and "no config.json there" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "m" / "config.json").write_text("{}")
    r = preflight(tmp_path / "m")
    assert r.returncode == 2 and "no tokenizer there" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    r = preflight(tmp_path / "m")
    assert "model.path" not in r.stderr, r.stderr  # what follows (the layout against this model) is not ours here
