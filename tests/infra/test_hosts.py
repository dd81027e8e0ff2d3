"""Issue 23: the address rules (opid_mega.infra.hosts), the keyed server launcher (opid_mega.infra.keyed), who feeds which server
(weight_sync.feeders), the bucket broadcast to feeders, and the planner's weight-sync reachability rules. Fast; the
same rules on a real simulated cluster: tests/launch/test_cluster.py."""
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from opid_mega.infra import hosts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bind_host_auto_explicit_and_refused(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert hosts.bind_host("auto") == "127.0.0.1"  # one process: nothing on the network
    for loop in ("localhost", "127.0.0.1", "127.0.1.1"):
        monkeypatch.setenv("MASTER_ADDR", loop)
        assert hosts.bind_host("auto") == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", socket.gethostname())  # this machine's own name: its address towards itself
    got = hosts.bind_host("auto")
    assert got == "127.0.0.1" or hosts.is_local_host(got)
    assert hosts.bind_host("127.0.0.1") == "127.0.0.1"
    assert hosts.bind_host("lo") == "127.0.0.1"  # an interface name
    for bad, words in (("0.0.0.0", "wildcard"), ("192.0.2.77", "not an address of this node"),
                       ("nosuchif0", "not an address and not a network interface")):
        with pytest.raises(hosts.BindHostError, match=words):
            hosts.bind_host(bad)
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    with pytest.raises(hosts.BindHostError, match="does not resolve"):
        hosts.bind_host("auto")


def test_local_or_remote_is_an_exact_host_comparison():
    name = socket.gethostname()
    assert hosts.is_local_url("http://127.0.0.1:30000") and hosts.is_local_url("http://localhost:1/x")
    assert hosts.is_local_url(f"http://{name}:1") and hosts.is_local_url("http://[::1]:5")
    assert hosts.is_local_url("127.0.0.1:30000")  # no scheme
    # a name that merely starts like this machine's (the old substring test: //node1 matched //node12)
    assert not hosts.is_local_url(f"http://{name}2.invalid:1")
    assert not hosts.is_local_url("http://192.0.2.1:1")  # TEST-NET-1: never ours
    assert hosts.url_host("http://[fd00::5]:30000/generate") == "fd00::5"
    assert hosts.http_url("fd00::5", 7) == "http://[fd00::5]:7" and hosts.http_url("10.0.0.5", 7) == "http://10.0.0.5:7"
    from opid_mega.megatron.weight_sync import _is_local

    assert _is_local("http://127.0.0.1:1") and not _is_local(f"http://{name}2.invalid:1")


def test_run_api_key_is_random_unless_given(monkeypatch):
    monkeypatch.delenv(hosts.API_KEY_ENV, raising=False)
    a, b = hosts.run_api_key(), hosts.run_api_key()
    assert a != b and len(a) >= 40
    monkeypatch.setenv(hosts.API_KEY_ENV, "operator-key-123")
    assert hosts.run_api_key() == "operator-key-123"


def test_keyed_launcher_adds_the_key_and_redacts_every_output(tmp_path):
    """The key reaches the module's argv through a pipe (not the command line, not the environment), and every byte
    the process and its children write to stdout/stderr has it replaced by ***."""
    key = "-k3y-" + "x" * 40  # a random key may begin with "-": the server's argparse must still read it as the value
    (tmp_path / "fakeserver.py").write_text(textwrap.dedent(f'''
        import argparse, os, subprocess, sys
        ap = argparse.ArgumentParser()
        ap.add_argument("--port")
        ap.add_argument("--api-key", required=True)
        key = ap.parse_args().api_key
        print("argv", sys.argv[1:], flush=True)
        print("stderr has", key, file=sys.stderr, flush=True)
        print("env", sorted(k for k in os.environ if k.startswith("OPID_SGLANG")), flush=True)
        subprocess.run([sys.executable, "-c", "import sys; print('child', sys.argv[1])", key])
        sys.stdout.write("long " + "y" * 70000 + key + "z" * 10 + "\\n")
    '''))
    from opid_mega.infra.keyed import key_channel

    env, fds = key_channel(key)
    env = {**os.environ, **env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        r = subprocess.run([sys.executable, "-m", "opid_mega.infra.keyed", "fakeserver", "--port", "1"], env=env,
                           pass_fds=fds, capture_output=True, timeout=60)
    finally:
        for fd in fds:
            os.close(fd)
    out = r.stdout.decode() + r.stderr.decode()
    assert r.returncode == 0, out[-2000:]
    assert key not in out
    assert "argv ['--port', '1', '--api-key=***']" in out and "stderr has ***" in out and "child ***" in out
    assert "env []" in out  # neither variable reaches the server's own children
    assert ("y" * 100 + "***" + "z" * 10) in out  # a line longer than the pump's 64 KiB window
    from opid_mega.infra.keyed import API_KEY_FD_ENV

    by_hand = {k: v for k, v in env.items() if k != API_KEY_FD_ENV}
    r = subprocess.run([sys.executable, "-m", "opid_mega.infra.keyed", "fakeserver", "--api-key", "x"],
                       env={**by_hand, hosts.API_KEY_ENV: "abcdefgh"}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "give it once" in r.stderr


def test_redacting_pump_masks_a_key_split_across_writes():
    from opid_mega.infra.keyed import _redacting_pump

    secret = b"SECRET-KEY-0123456789"
    r, w = os.pipe()
    r2, w2 = os.pipe()
    t = threading.Thread(target=_redacting_pump, args=(r, w2, secret))
    t.start()
    for piece in (b"a line with SECRET-KE", b"Y-0123456789 in two writes\nand ", b"SECRET-KEY-0123456789"):
        os.write(w, piece)
    os.close(w)
    t.join(5)
    os.close(w2)
    got = b""
    while True:
        b = os.read(r2, 65536)
        if not b:
            break
        got += b
    assert got == b"a line with *** in two writes\nand ***"


def test_feeders_each_server_by_a_rank_of_its_own_node():
    from opid_mega.megatron.weight_sync import feeders

    # CPU, 2 nodes x 2 ranks: each node's first rank launched (and feeds) its server
    ranks = [{"rank": r, "node": r // 2, "gpu": None} for r in range(4)]
    servers = [{"url": "http://a:1", "rank": 0, "gpus": []}, {"url": "http://b:1", "rank": 2, "gpus": []}]
    assert feeders(servers, ranks) == {"http://a:1": 0, "http://b:1": 2}
    # GPU colocated, 2 nodes x 2 training GPUs, one server per training GPU: the rank on the server's own GPU
    ranks = [{"rank": r, "node": r // 2, "gpu": r % 2} for r in range(4)]
    servers = [{"url": f"http://n{n}:{g}", "rank": 2 * n, "gpus": [g]} for n in (0, 1) for g in (0, 1)]
    assert feeders(servers, ranks) == {"http://n0:0": 0, "http://n0:1": 1, "http://n1:0": 2, "http://n1:1": 3}
    # disaggregated: servers on GPUs no rank trains on -> the node's first rank
    servers = [{"url": "http://n1:7", "rank": 2, "gpus": [6, 7]}]
    assert feeders(servers, ranks) == {"http://n1:7": 2}


_BUCKET_WORKER = r'''
import os, sys, torch, torch.distributed as dist
from opid_mega.megatron.weight_sync import WeightSync
dist.init_process_group("gloo")
ws = WeightSync.__new__(WeightSync)
ws.bucket_group = dist.group.WORLD
g = torch.Generator().manual_seed(5)
bucket = [("a.weight", torch.randn(3, 5, generator=g)), ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
          ("c.ids", torch.arange(3, dtype=torch.int64)), ("d.half", torch.randn(1, 3, generator=g).half()),
          ("e.empty", torch.zeros(0, 4))]
if dist.get_rank() == 0:
    ws._send_to_receivers(bucket); ws._send_to_receivers(bucket[1:2]); ws._send_to_receivers(None)
else:
    got = [ws._receive_bucket(), ws._receive_bucket(), ws._receive_bucket()]
    assert got[2] is None
    for want, have in ((bucket, got[0]), (bucket[1:2], got[1])):
        assert [n for n, _ in have] == [n for n, _ in want]
        for (_, a), (_, b) in zip(want, have):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    print("ok")
del ws  # it holds the group: kept until interpreter teardown, gloo's threads abort the process there (SIGABRT)
dist.destroy_process_group()
'''


def test_bucket_broadcast_to_feeders_is_bit_exact(tmp_path):
    """Global rank 0 -> a feeder outside data-parallel replica 0: mixed dtypes and odd sizes arrive bit-exact."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _BUCKET_WORKER], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[1].strip().endswith("ok")


def test_planner_refuses_a_sync_method_that_cannot_reach_the_servers(capsys):
    from opid_mega import plan as P

    def run(config, *over):
        rc = P.main(["--config", os.path.join(ROOT, "configs", config), "--json", *over])
        return rc, json.loads(capsys.readouterr().out)

    rc, res = run("cluster/qwen2.5-7b_alfworld_2x8_colocated.yaml")  # tensor, fed per node
    assert rc == 0 and res["time"]["sync_method"] == "tensor"
    assert "NNODES=2 NPROC_PER_NODE=6" in res["launch"]["torchrun"]
    assert res["launch"]["slurm"].startswith("sbatch --nodes 2 --gpus-per-node 8 tools/launch/opid.sbatch --config ")
    assert "--nodes 2 --trainers-per-node 6" in res["launch"]["ray"]
    rc, res = run("cluster/qwen2.5-7b_alfworld_2x8_colocated.yaml", "sync.method=distributed")
    assert rc == 1 and any("NCCL refuses two ranks of a group on one GPU" in e for e in res["errors"])
    rc, res = run("cluster/qwen2.5-7b_alfworld_2x8_colocated.yaml", "sync.method=auto")
    assert rc == 0 and res["time"]["sync_method"] == "tensor"
    over = ["rollout.engine=sglang", "rollout.sglang_url=http://node5:30000,http://127.0.0.1:30001"]
    rc, res = run("tiny_cpu.yaml", *over, "sync.method=tensor")
    assert rc == 1 and any("sync.method: tensor" in e and "node5" in e for e in res["errors"])
    rc, res = run("tiny_cpu.yaml", *over)  # auto: disk for a server elsewhere
    assert rc == 0 and res["time"]["sync_method"] == "disk"
    rc, res = run("cluster/qwen2.5-7b_alfworld_2x8_disaggregated.yaml")
    assert rc == 0 and res["time"]["sync_method"] == "distributed"


def test_deploy_bind_host_is_validated():
    from opid_mega.config import ConfigError, load_config

    assert load_config(None, ["deploy.bind_host=ib0"]).deploy.bind_host == "ib0"
    assert load_config(None, []).deploy.bind_host == "auto"
    for bad in ("0.0.0.0", "a b", "::"):
        with pytest.raises(ConfigError, match="deploy.bind_host"):
            load_config(None, [f"deploy.bind_host={bad}"])


def test_socket_ifname_follows_node_addr_then_the_route_and_refuses_a_name_on_loopback(monkeypatch):
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME when unset (tools/launch/torchrun.sh): the interface holding NODE_ADDR,
    else the one routing to the rendezvous host; loopback for a one-node run or a rendezvous spelled as loopback; a
    host NAME resolving to loopback on a multi-node run is one line naming the fix."""
    import socket

    from opid_mega.infra import hosts

    lo = hosts.interface_of("127.0.0.1")
    assert lo is not None and hosts.interface_address(lo) == "127.0.0.1"
    assert hosts.socket_ifname("localhost", 1) == lo and hosts.socket_ifname("127.0.0.1", 4) == lo
    others = [(name, hosts.interface_address(name)) for _, name in socket.if_nameindex()]
    others = [(n, a) for n, a in others if a and not a.startswith("127.")]
    if others:  # an interface with a real address: it is found by its address and by the route to it
        name, addr = others[0]
        assert hosts.socket_ifname("localhost", 2, node_addr=addr) == name
        assert hosts.socket_ifname(addr, 2) == name
    with pytest.raises(hosts.BindHostError, match="NODE_ADDR=192.0.2.250 is not an IPv4 address of an interface"):
        hosts.socket_ifname("localhost", 2, node_addr="192.0.2.250")
    # a stock Debian/Ubuntu /etc/hosts: this node's own name on 127.0.1.1 (the rendezvous is on this node)
    real = hosts._resolve
    monkeypatch.setattr(hosts, "_resolve", lambda h: ["127.0.1.1"] if h == "node0" else real(h))
    assert hosts.socket_ifname("node0", 1) == lo  # one node: nothing needs the network
    monkeypatch.setattr(hosts, "cluster_interfaces", lambda: ["eth7"])
    assert hosts.socket_ifname("node0", 2) == "eth7"  # its one cluster interface is where the others reach it
    monkeypatch.setattr(hosts, "cluster_interfaces", lambda: ["eth0", "ib0"])
    with pytest.raises(hosts.BindHostError) as e:
        hosts.socket_ifname("node0", 2)
    msg = str(e.value)
    assert "\n" not in msg and "'node0' resolves to 127.0.1.1 (loopback)" in msg and "set NODE_ADDR" in msg
    assert "this node has 2 (eth0, ib0)" in msg
    r = subprocess.run([sys.executable, "-m", "opid_mega.infra.hosts", "socket-ifname", "nosuch.invalid", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert "'nosuch.invalid' does not resolve" in r.stderr


def test_cluster_interfaces_are_up_and_not_loopback():
    from opid_mega.infra import hosts

    found = hosts.cluster_interfaces()
    assert hosts.interface_of("127.0.0.1") not in found
    for name in found:
        assert hosts._is_up(name) and not hosts.interface_address(name).startswith("127.")


def test_every_launcher_gets_the_interface_at_process_group_set_up(monkeypatch):
    """opid_mega.megatron.parallel.initialize sets GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME when unset
    (hosts.set_socket_ifname), from MASTER_ADDR, the job's node count and NODE_ADDR: a plain torchrun, the Ray
    launcher and one process get what tools/launch/torchrun.sh sets."""
    from opid_mega.infra import hosts

    lo = hosts.interface_of("127.0.0.1")
    env = {"MASTER_ADDR": "198.18.0.1"}  # a lone process meets no one: gloo on loopback, NCCL left to itself
    assert hosts.set_socket_ifname(env) == lo and env == {"MASTER_ADDR": "198.18.0.1", "GLOO_SOCKET_IFNAME": lo}
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "localhost"}
    assert hosts.set_socket_ifname(env) == lo and env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == lo
    env = {"WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "ib0", "MASTER_ADDR": "127.0.0.1"}  # one given: kept
    assert hosts.set_socket_ifname(env) == lo and env["GLOO_SOCKET_IFNAME"] == "ib0" and env["NCCL_SOCKET_IFNAME"] == lo
    env = {"WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib1"}
    assert hosts.set_socket_ifname(env) is None and env["GLOO_SOCKET_IFNAME"] == "ib0"
    with hosts.gloo_interface("127.0.0.1") as name:  # a weight-update group's own interface while it is made
        assert name == lo and os.environ["GLOO_SOCKET_IFNAME"] == lo
    assert hosts.job_nodes({"GROUP_WORLD_SIZE": "3", "WORLD_SIZE": "6"}) == 3
    assert hosts.job_nodes({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}) == 1
    assert hosts.job_nodes({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}) == 2 and hosts.job_nodes({}) == 1
    real = hosts._resolve
    monkeypatch.setattr(hosts, "_resolve", lambda h: ["127.0.1.1"] if h == "node0" else real(h))
    monkeypatch.setattr(hosts, "cluster_interfaces", lambda: ["eth0", "ib0"])
    with pytest.raises(hosts.BindHostError, match="torchrun --local-addr"):  # a plain torchrun on a stock node 0
        hosts.set_socket_ifname({"MASTER_ADDR": "node0", "GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "2"})
