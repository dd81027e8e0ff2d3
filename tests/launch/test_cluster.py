"""Issue 23: the multi-node path on a simulated cluster (tools/cluster_sim.py): 2 nodes as 2 network namespaces, each
with its own address, loopback, host name and hosts file (a stock Debian one: its own name on 127.0.1.1), on this
machine's file system; tools/launch/torchrun.sh on each node with the c10d rendezvous on node 0's address
(NODE_ADDR -> torchrun --local-addr); one real SGLang CPU server per node; global rank 0 drives both.

Three launches, each holding two SGLang CPU servers (~6 GB RSS each) and 2-4 trainer ranks (the 2-core budget),
each also carrying the fault cases that fit it:
  A  2 nodes x 2 ranks (TP2 inside a node, DP2), client balancer, sync.method=distributed: iterations 1-2 served by
     both nodes, the API key checks; in iteration 3 node 1's server is killed mid-rollout (prompts re-sent, counted).
  B  2 x 1, SGLang's router, sync.method=disk: iterations 1-2 served by both; node 1's link down for 5 s during
     iteration 2's rollout (the run recovers within deploy.control_timeout_s); SIGTERM to the job in iteration 3 (no
     process left in any node).
  C  2 x 1, client balancer, sync.method=tensor (node 1's server fed by node 1's rank: per-node feeding); every
     process of every node SIGKILLed after a checkpoint; the same launch again resumes from it (--resume auto).

Needs root (network namespaces) and SGLang on CPU; skips with the reason otherwise.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_launch import BASE_ENV, CONFIG, LAUNCH, ROOT, metrics

sys.path.insert(0, str(ROOT / "tools"))
import cluster_sim  # noqa: E402  (tools/cluster_sim.py)

_REASON = cluster_sim.unavailable_reason()
KEY = "cluster-test-key-6d2f9a41c07b"  # the run's API key in launch A (OPID_SGLANG_API_KEY), to look for leaks

SERVER_ARGS = "rollout.sglang_args=[--dtype,float32,--max-total-tokens,4096,--max-running-requests,8," \
              "--disable-radix-cache]"
# random tiny Qwen3, 2 tasks x 2 trajectories per iteration, one SGLang server per node, the probe after every sync
ARGS = ["model.init_from=", "rollout.engine=sglang", "rollout.tasks_per_iter=2", "rollout.group_size=2",
        "eval.interval=0", "eval.num_tasks=0", "train.micro_batch_tokens=1024", "train.mini_batch_size=8",
        "logging.tensorboard=false", "logging.progress=false", "deploy.rollout_servers_per_node=1", SERVER_ARGS,
        "sync.check_interval=1", "deploy.nodes=2"]


def _needs_root():
    if _REASON:
        print(f"simulated cluster unavailable: {_REASON}")
        pytest.skip(f"simulated cluster unavailable: {_REASON}")


def _needs_cluster():
    _needs_root()
    import importlib.util

    import torch

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang not installed (tools/install_sglang_cpu.sh)")
    if torch.cuda.is_available():
        pytest.skip("these runs serve on CPU")


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------


def launch(cluster, run: Path, args: list, nproc: int, out_dir: Path, rdzv_id: str, extra_env=None,
           tag: str = "") -> list:
    """tools/launch/torchrun.sh on every node (NODE_RANK / NODE_ADDR / GLOO_SOCKET_IFNAME from the node), c10d on
    node 0's address; each node's output to out_dir/node<k><tag>.out (outside the run directory)."""
    env = {**BASE_ENV, "NNODES": str(len(cluster.nodes)), "NPROC_PER_NODE": str(nproc),
           "RDZV_ENDPOINT": f"{cluster.nodes[0].addr}:29400", "RDZV_ID": rdzv_id, "OMP_NUM_THREADS": "1",
           **(extra_env or {})}
    cmd = ["bash", str(LAUNCH / "torchrun.sh"), "--config", CONFIG, "--run-dir", str(run)] + list(args) + \
          [f"deploy.gpus_per_node={nproc}"]
    procs = []
    for k in range(len(cluster.nodes)):
        with open(out_dir / f"node{k}{tag}.out", "wb") as f:
            procs.append(cluster.popen(k, cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(ROOT)))
    return procs


def outputs(out_dir: Path, tag: str = "", n: int = 2) -> list:
    return [(out_dir / f"node{k}{tag}.out").read_text(errors="replace") for k in range(n)]


def tails(out_dir: Path, tag: str = "") -> str:
    return "\n----\n".join(o[-5000:] for o in outputs(out_dir, tag))


def wait_until(cond, procs: list, out_dir: Path, timeout: float, what: str, tag: str = "", may_end=False):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if not may_end and any(p.poll() is not None for p in procs):
            raise AssertionError(f"a node ended (codes {[p.poll() for p in procs]}) while waiting for {what}:\n"
                                 + tails(out_dir, tag))
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout:g} s:\n" + tails(out_dir, tag))


def wait_all(procs: list, out_dir: Path, timeout: float, tag: str = "") -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    if any(p.poll() is None for p in procs):
        raise AssertionError(f"the run did not end within {timeout:g} s:\n" + tails(out_dir, tag))
    return [p.returncode for p in procs]


def rows(run: Path) -> list:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def steps(run: Path) -> list:
    return [r["step"] for r in rows(run)]


def server_log(run: Path, addr: str) -> Path:
    """The log of the server bound to `addr` (its command line is the log's first line)."""
    for log in sorted((run / "sglang").glob("sglang_server_*.log")):
        if f"--host {addr} " in log.read_text(errors="replace").splitlines()[0]:
            return log
    raise AssertionError(f"no server log for {addr} in {run / 'sglang'}")


def generates(log: Path) -> int:
    return log.read_text(errors="replace").count("POST /generate")


def server_pid(cluster, k: int) -> int:
    """The main SGLang server process running on node k."""
    for pid in cluster.pids(k):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "sglang.launch_server" in cmd:
            return pid
    raise AssertionError(f"no SGLang server on node {k}")


def in_node(cluster, k: int, code: str, timeout: float = 60) -> str:
    r = cluster.run(k, [sys.executable, "-c", code], timeout=timeout, env=BASE_ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


# ---------------------------------------------------------------------------------------------------------------------
# the simulated cluster itself (fast: no SGLang, no trainer)
# ---------------------------------------------------------------------------------------------------------------------


def test_simulated_cluster_nodes_are_separate_hosts_and_leave_nothing_behind(tmp_path):
    """Each node: its own host name, hosts file (own name on 127.0.1.1, the others on their addresses), loopback and
    address; a server on node 0's cluster address is reached from node 1, one on node 0's loopback is not; a link
    taken down stops traffic and comes back; the host rules of opid_mega.infra.hosts hold there (auto bind address, exact
    local/remote); teardown (and the stale-instance sweep) leaves no namespace, process or /etc/netns entry."""
    _needs_root()
    probe = r'''
import json, os, socket, sys
from opid_mega.infra.hosts import bind_host, is_local_url
print(json.dumps({"host": socket.gethostname(), "own": socket.gethostbyname(socket.gethostname()),
                  "node0": socket.gethostbyname("node0"), "bind": bind_host("auto"),
                  "local": [is_local_url(u) for u in ("http://node1:1", "http://node12:1", "http://node0:1",
                                                     "http://198.18.0.2:1", "http://127.0.0.1:1")]}))
'''
    with cluster_sim.Cluster(2) as c:
        tag = c.tag
        assert [n.addr for n in c.nodes] == ["198.18.0.1", "198.18.0.2"]
        info = json.loads(in_node(c, 1, probe))
        assert info == {"host": "node1", "own": "127.0.1.1", "node0": "198.18.0.1", "bind": "198.18.0.2",
                        "local": [True, False, False, True, True]}, info
        # node 0 serves on its cluster address and on its loopback
        srv = ("import socket, sys, threading\n"
               "def serve(addr, port):\n"
               "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
               "    s.bind((addr, port)); s.listen()\n"
               "    while True:\n"
               "        c, _ = s.accept(); c.sendall(addr.encode()); c.close()\n"
               "threading.Thread(target=serve, args=('127.0.0.1', 7001), daemon=True).start()\n"
               "print('up', flush=True); serve('198.18.0.1', 7000)\n")
        server = c.popen(0, [sys.executable, "-c", srv], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "up"
        client = ("import socket, sys\n"
                  "for host, port in (('node0', 7000), ('127.0.0.1', 7001)):\n"
                  "    try:\n"
                  "        s = socket.create_connection((host, port), timeout=%s); print(s.recv(64).decode())\n"
                  "    except OSError as e:\n"
                  "        print(type(e).__name__)\n")
        assert in_node(c, 1, client % 3).split() == ["198.18.0.1", "ConnectionRefusedError"]
        c.link_down(1)
        # node 1's cable is out: no answer (a timeout, or no route once its ARP entry for node 0 has expired)
        assert in_node(c, 1, client % 1).split()[0] in ("TimeoutError", "OSError")
        c.link_up(1)
        assert in_node(c, 1, client % 3).split()[0] == "198.18.0.1"
        assert c.pids(0)  # the server
    names = cluster_sim._netns_list()
    assert not [n for n in names if n.startswith(tag)] and not os.path.exists(f"/etc/netns/{tag}-node0")
    assert server.poll() is not None
    # an instance whose process died (SIGKILL: no teardown) is removed by the next start
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{cluster_sim.PREFIX}{dead.pid}x0-node0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    with cluster_sim.Cluster(1):
        assert stale not in cluster_sim._netns_list()
    # the CLI: one command per node with the node's identity
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "cluster_sim.py"), "--nodes", "2", "--", "sh", "-c",
                        "echo {node} $NODE_ADDR $(hostname) $GLOO_SOCKET_IFNAME"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[node0] 0 198.18.0.1 node0 eth0", "[node1] 1 198.18.0.2 node1 eth0"]


# ---------------------------------------------------------------------------------------------------------------------
# A: client balancer, distributed sync, API key, a server killed mid-rollout
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_nodes_client_balancer_distributed_sync_and_a_dead_server(tmp_path):
    _needs_cluster()
    run = tmp_path / "run"
    args = ARGS + ["env.max_steps=3", "rollout.max_response_tokens=48", "train.iterations=3",
                   "train.save_interval=0", "parallel.tp=2", "deploy.balancer=client", "sync.method=distributed"]
    t0 = time.monotonic()
    with cluster_sim.Cluster(2) as c:
        procs = launch(c, run, args, 2, tmp_path, "cluster-a", extra_env={"OPID_SGLANG_API_KEY": KEY})
        n0, n1 = c.nodes[0].addr, c.nodes[1].addr
        # every server binds and advertises its node's cluster address (auto: the interface towards MASTER_ADDR)
        wait_until(lambda: all(f"rollout server(s) at http://{a}:" in o for a, o in zip((n0, n1), outputs(tmp_path))),
                   procs, tmp_path, 400, "servers on both nodes' addresses")
        logs = {0: server_log(run, n0), 1: server_log(run, n1)}
        port0 = re.search(r"--port (\d+)", logs[0].read_text().splitlines()[0]).group(1)
        # the control endpoints need the run's key, also from another node; the key is on no command line
        checks = in_node(c, 1, f'''
import requests
u = "http://{n0}:{port0}"
ok = {{"Authorization": "Bearer {KEY}"}}
print(requests.get(u + "/health", timeout=30).status_code,
      requests.post(u + "/update_weights_from_disk", json={{"model_path": "/tmp"}}, timeout=30).status_code,
      requests.post(u + "/pause_generation", json={{}}, timeout=30).status_code,
      requests.get(u + "/model_info", headers={{"Authorization": "Bearer wrong"}}, timeout=30).status_code,
      requests.get(u + "/model_info", headers=ok, timeout=30).status_code)
''')
        assert checks.split() == ["200", "401", "401", "401", "200"], checks
        for k in (0, 1):
            pid = server_pid(c, k)
            assert KEY not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        # iterations 1 and 2 complete; then node 1's server dies as iteration 3's rollout reaches it
        wait_until(lambda: steps(run)[-1:] == [2], procs, tmp_path, 600, "iteration 2")
        before = generates(logs[1])
        served = {k: generates(log) for k, log in logs.items()}
        wait_until(lambda: generates(logs[1]) > before, procs, tmp_path, 300, "iteration 3's rollout on node 1")
        os.killpg(os.getpgid(server_pid(c, 1)), signal.SIGKILL)
        codes = wait_all(procs, tmp_path, 600)
    took = time.monotonic() - t0
    outs = outputs(tmp_path)
    assert codes == [0, 0], tails(tmp_path)
    got = metrics(run)
    assert [r["step"] for r in got] == [1, 2, 3]
    for r in got:
        assert r["rollout/trajectories"] == 4 and r["rollout/env_errors"] == 0  # nothing lost, also in iteration 3
        assert r["weight_sync/version"] == r["step"] and r["weight_sync/probe_max_abs_diff"] <= 1e-3
    # both nodes served rollouts of iterations 1-2 (beyond 1 warm-up request and 2 probes each)
    assert all(n > 3 for n in served.values()), served
    assert got[1]["rollout/server0_prompts"] > 0 and got[1]["rollout/server1_prompts"] > 0
    last = got[-1]
    assert last["rollout/dead_servers"] == 1 and last["rollout/servers_alive"] == 1
    assert last["rollout/retried_requests"] >= 1, last  # node 1's prompts went to node 0
    # node 1's server joined its weight-update group at node 0's cluster address (rank 0 hosts the store)
    assert f"init custom process group: master_address={c.nodes[0].addr}," in logs[1].read_text(errors="replace")
    # the key is in no file of the run and no line the nodes printed (SGLang's own server_args line shows ***)
    leaked = [str(p) for p in run.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert not leaked and not any(KEY in o for o in outs), leaked
    assert "api_key='***'" in logs[0].read_text(errors="replace") or "'api_key': '***'" in logs[0].read_text(
        errors="replace")
    print(f"A: 2 nodes x 2 ranks, client balancer, distributed sync: {took:.1f} s; POST /generate per server after "
          f"iteration 2: {served}; iteration 3: { {k: v for k, v in last.items() if k.startswith('rollout/')} }")


# ---------------------------------------------------------------------------------------------------------------------
# B: the router, disk sync, node 1's link down for 5 s, SIGTERM to the job
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_nodes_router_disk_sync_link_down_and_sigterm(tmp_path):
    _needs_cluster()
    run = tmp_path / "run"
    control_timeout = 120
    args = ARGS + ["env.max_steps=2", "rollout.max_response_tokens=32", "train.iterations=5",
                   "train.save_interval=0", "deploy.balancer=router", "deploy.router_args=[--policy,round_robin]",
                   "sync.method=disk", f"deploy.control_timeout_s={control_timeout}", "rollout.request_timeout_s=60"]
    t0 = time.monotonic()
    with cluster_sim.Cluster(2) as c:
        procs = launch(c, run, args, 1, tmp_path, "cluster-b")
        n0, n1 = c.nodes[0].addr, c.nodes[1].addr
        wait_until(lambda: all(f"rollout server(s) at http://{a}:" in o for a, o in zip((n0, n1), outputs(tmp_path))),
                   procs, tmp_path, 400, "servers on both nodes' addresses")
        logs = {0: server_log(run, n0), 1: server_log(run, n1)}
        wait_until(lambda: steps(run)[-1:] == [1], procs, tmp_path, 600, "iteration 1")
        before = generates(logs[1])
        wait_until(lambda: generates(logs[1]) > before, procs, tmp_path, 300, "iteration 2's rollout on node 1")
        c.link_down(1)  # node 1's cable out for 5 s in the middle of a rollout
        down_at = time.monotonic()
        time.sleep(5)
        c.link_up(1)
        # the run recovers: iteration 2 completes well within deploy.control_timeout_s of the outage
        wait_until(lambda: steps(run)[-1:] == [2], procs, tmp_path, control_timeout + 60, "iteration 2 after the outage")
        recovered_s = time.monotonic() - down_at
        served = {k: generates(log) for k, log in logs.items()}
        # SIGTERM to the job (both torchrun agents, as scancel / a pre-emption) while iteration 3 runs
        # (on either node: after the outage the router may keep node 1's worker out of rotation)
        before = sum(generates(log) for log in logs.values())
        wait_until(lambda: sum(generates(log) for log in logs.values()) > before, procs, tmp_path, 300,
                   "iteration 3's rollout")
        for p in procs:
            p.send_signal(signal.SIGTERM)
        term_at = time.monotonic()
        wait_until(lambda: not c.pids(0) and not c.pids(1), procs, tmp_path, 90, "every process of both nodes gone",
                   may_end=True)
        gone_s = time.monotonic() - term_at
        codes = [p.wait(timeout=30) for p in procs]
    took = time.monotonic() - t0
    got = metrics(run)
    assert [r["step"] for r in got][:2] == [1, 2] and len(got) < 5, tails(tmp_path)
    for r in got[:2]:
        assert r["rollout/trajectories"] == 4 and r["rollout/env_errors"] == 0
        assert r["weight_sync/version"] == r["step"] and r["weight_sync/probe_max_abs_diff"] <= 1e-3
        assert r["rollout/router_alive"] == 1
    assert all(n > 3 for n in served.values()), served  # both nodes served (1 warm-up + 2 probes each, + rollouts)
    assert all(code != 0 for code in codes), codes
    # rank 0 (node 0) took the interrupt path: its one line, not only torchrun's "closing signal SIGTERM" log
    assert "opid-train: stopped by SIGTERM in iteration " in outputs(tmp_path)[0], tails(tmp_path)
    print(f"B: 2 nodes x 1 rank, router, disk sync: {took:.1f} s; iteration 2 done {recovered_s:.1f} s after node 1's "
          f"link went down for 5 s; POST /generate per server {served}; SIGTERM -> no process in any node after "
          f"{gone_s:.1f} s, exit codes {codes}; after the outage: router retries "
          f"{got[1].get('rollout/router_retries')}, fleet re-sent {got[1]['rollout/retried_requests']}, servers alive "
          f"{got[1]['rollout/servers_alive']}")


# ---------------------------------------------------------------------------------------------------------------------
# C: tensor sync fed per node; SIGKILL of every node, then the same launch resumes
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_nodes_tensor_sync_per_node_and_resume_after_sigkill_of_every_node(tmp_path):
    _needs_cluster()
    from opid_mega.megatron.checkpoint import latest_step

    run = tmp_path / "run"
    args = ARGS + ["env.max_steps=2", "rollout.max_response_tokens=32", "train.iterations=3", "train.save_interval=1",
                   "train.keep_checkpoints=1", "deploy.balancer=client", "sync.method=tensor"]
    t0 = time.monotonic()
    with cluster_sim.Cluster(2) as c:
        procs = launch(c, run, args, 1, tmp_path, "cluster-c", tag="-first")
        wait_until(lambda: latest_step(str(run / "checkpoints")) is not None, procs, tmp_path, 700,
                   "a first checkpoint", tag="-first")
        for _ in range(50):  # the power of every node is cut
            if not any(c.kill_node(k) for k in (0, 1)):
                break
            time.sleep(0.1)
        assert all(p.wait(timeout=30) != 0 for p in procs)
        assert not c.pids(0) and not c.pids(1)
        last = latest_step(str(run / "checkpoints"))
        first_rows = steps(run)
        first_logs = set((run / "sglang").glob("sglang_server_*.log"))
        killed_s = time.monotonic() - t0
        procs = launch(c, run, args, 1, tmp_path, "cluster-c", tag="-again")  # the same launch, run again
        codes = wait_all(procs, tmp_path, 700, tag="-again")
    took = time.monotonic() - t0
    assert codes == [0, 0], tails(tmp_path, "-again")
    got = metrics(run)
    assert [r["step"] for r in got] == [1, 2, 3], (first_rows, [r["step"] for r in got])
    for r in got:
        assert r["rollout/trajectories"] == 4 and r["rollout/env_errors"] == 0
        # node 1's server is fed by node 1's rank (shared memory on its node), and the probe says it serves our weights
        assert r["weight_sync/version"] == r["step"] and r["weight_sync/probe_max_abs_diff"] <= 1e-3
        assert r["rollout/servers_alive"] == 2
    # the re-run's servers: the resume's sync of the checkpoint's weights, then one per iteration after it (so it
    # continued from step `last`); node 1's server was fed by node 1's own rank (requests from node 1's address)
    again = sorted(set((run / "sglang").glob("sglang_server_*.log")) - first_logs)
    assert len(again) == 2
    for log in again:
        text = log.read_text(errors="replace")
        addr = re.search(r"--host (\S+) ", text.splitlines()[0]).group(1)
        feeds = re.findall(r"INFO:\s+(\S+):\d+ - \"POST /update_weights_from_tensor", text)
        assert len(feeds) == 1 + 3 - last and set(feeds) == {addr}, (log.name, feeds)
    record = run / "resume_overrides.jsonl"
    if record.exists():  # the resume says where it continued from
        assert json.loads(record.read_text().splitlines()[-1])["step"] == last
    assert latest_step(str(run / "checkpoints")) == 3
    print(f"C: 2 nodes x 1 rank, tensor sync per node: SIGKILL of every node at {killed_s:.1f} s (checkpoint step "
          f"{last}, metrics {first_rows}); the re-run resumed from step {last} and finished; {took:.1f} s in all")
