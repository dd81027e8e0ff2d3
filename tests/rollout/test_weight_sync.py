"""Weight sync Megatron -> a real SGLang CPU server (issue 14 item 4), one process, tiny Qwen3 in fp32.

Each method (tensor, disk, distributed over a gloo update group) after a perturbation of the trainer's weights: the
probe check fails before the sync (the engine serves older weights: the check can fail) and passes after it, and the
engine's weight version is the sync's. A corrupted bucket (wrong name, shape or dtype) is rejected with WeightMismatch
and the engine still serves the previous version (same version, probe still equal to the trainer's).
Fast: the manifest check and the bucket grouping, without a server."""
import os

import pytest
import torch

from opid_mega.rollout.sglang_engine import WeightMismatch, _buckets, check_against_manifest, read_manifest

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_cpu.yaml")


def test_manifest_rejects_wrong_name_shape_dtype(tiny_qwen3):
    m = read_manifest(tiny_qwen3)
    name, (shape, dtype) = next(iter(m.items()))
    good = torch.randn(shape, dtype=getattr(torch, dtype))
    check_against_manifest(m, [(name, good)], "x")
    with pytest.raises(WeightMismatch, match="has no tensor 'model.nope'"):
        check_against_manifest(m, [(name, good), ("model.nope", good)], "x")
    with pytest.raises(WeightMismatch, match=r"has shape"):
        check_against_manifest(m, [(name, good.reshape(-1)[:-1])], "x")
    with pytest.raises(WeightMismatch, match="float64"):
        check_against_manifest(m, [(name, good.double())], "x")
    with pytest.raises(WeightMismatch, match="pairs"):
        check_against_manifest(m, [(name, [1.0])], "x")
    # a server running another dtype than the checkpoint: the manifest carries the served dtype
    assert {d for _, d in read_manifest(tiny_qwen3, "bfloat16").values()} == {"bfloat16"}


def test_buckets_group_by_size_and_keep_caller_buckets():
    ts = [(f"t{i}", torch.ones(256)) for i in range(5)]  # 1 KiB each
    assert [len(b) for b in _buckets(iter(ts), 2048)] == [2, 2, 1]
    assert [len(b) for b in _buckets(iter([ts[:3], ts[3:]]), 1)] == [3, 2]


def _listeners(port: int) -> list:
    """Local addresses listening on TCP `port` (from /proc/net/tcp{,6}; state 0A is LISTEN)."""
    import ipaddress

    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                raw = bytes.fromhex(addr)  # little-endian 32-bit words
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.append(str(ipaddress.ip_address(raw)))
    return out


def test_update_store_listens_on_its_address_alone_and_goes_once_the_group_formed():
    """The weight-update group's store: bound to the address given (loopback here), never to every address; once
    closed (after the group's first update) nothing listens on its port and a store call says it was closed."""
    import datetime
    import socket

    from torch.distributed import TCPStore

    from opid_mega.megatron.weight_sync import open_store

    timeout = datetime.timedelta(seconds=5)
    store = open_store("127.0.0.1", 2, timeout)
    port = store.port
    assert _listeners(port) == ["127.0.0.1"]  # TCPStore("127.0.0.1", 0, ...) alone listens on [::]
    member = TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    member.set("k", "v1")
    assert store.get("k") == b"v1"
    store.close()
    assert _listeners(port) == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with pytest.raises(RuntimeError, match="closed once the group had formed"):
        store.get("k")


# The server side of update_weights_from_distributed as SGLang 0.5.23 runs it (srt/model_executor/model_runner.py
# init_weights_update_group / update_weights_from_distributed): its ranks join the group with
# sglang.srt.utils.common.init_custom_process_group over tcp://master_address:master_port (a PrefixStore named by the
# group), and each update receives the bucket's tensors by broadcast from rank 0. Here one rank, in its own process:
# a line of shapes on stdin per update, the sums of what it received on stdout.
_GROUP_PEER = r"""
import datetime, json, sys
import torch, torch.distributed as dist
from sglang.srt.utils.common import init_custom_process_group
host, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
group = init_custom_process_group(backend="gloo", init_method=f"tcp://{host}:{port}", world_size=2, rank=1,
                                  group_name=name, timeout=datetime.timedelta(seconds=60))
for line in sys.stdin:
    got = [torch.empty(shape) for shape in json.loads(line)]
    for t in got:
        dist.broadcast(t, src=0, group=group)
    print(json.dumps([float(t.sum()) for t in got]), flush=True)
"""


class _UpdateGroupPeer:
    """An engine whose weight-update group has one server rank in another process (see _GROUP_PEER)."""

    url, tp_size = "http://127.0.0.1:9", 1

    def init_weights_update_group(self, host, port, rank_offset, world_size, group_name, backend):
        import subprocess
        import sys

        assert (rank_offset, world_size, backend) == (1, 2, "gloo")
        self.names, self.port = getattr(self, "names", []) + [group_name], port
        self.proc = subprocess.Popen([sys.executable, "-c", _GROUP_PEER, host, str(port), group_name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def begin_update(self):
        pass

    def end_update(self, version):
        pass

    def update_weights_from_distributed(self, bucket, broadcast, group_name):
        import json

        self.proc.stdin.write(json.dumps([list(t.shape) for _, t in bucket]) + "\n")
        self.proc.stdin.flush()
        for work in broadcast([t for _, t in bucket]):
            work.wait()
        self.received = json.loads(self.proc.stdout.readline())
        return sum(t.numel() * t.element_size() for _, t in bucket)


def test_distributed_sync_leaves_no_store_polling_after_the_first_update():
    """sync.method=distributed on gloo against a server rank in another process: after the first update the group's
    store is gone (no listener on its port) and this process, waiting, uses no CPU to speak of (a store whose
    listening socket was only shut spun at ~0.9 of a core); later updates go through the same group. The group's
    name, which prefixes its keys in the store, is a fresh secret, not derived from the port."""
    import resource
    import time

    pytest.importorskip("sglang.srt.utils.common")
    from opid_mega.config import load_config
    from opid_mega.megatron.weight_sync import WeightSync

    def cpu_s():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    ws = object.__new__(WeightSync)  # the transfer alone: no policy, one engine
    ws.cfg, ws.groups, peer = load_config(CONFIG, ["model.init_from="]), {}, _UpdateGroupPeer()
    ws.engines = [peer]
    try:
        ws._via_distributed(iter([[("a", torch.ones(4)), ("b", torch.ones(2, 3))]]), "1")
        assert peer.received == [4.0, 6.0]
        (_, name), = ws.groups.values()
        assert name == peer.names[0] and name.startswith("opid_weights_") and str(peer.port) not in name
        assert len(name) == len("opid_weights_") + 32
        assert _listeners(peer.port) == []
        c0, t0 = cpu_s(), time.monotonic()
        time.sleep(3.0)
        rate = (cpu_s() - c0) / (time.monotonic() - t0)
        print(f"this process's CPU after the first distributed update, waiting: {rate:.3f} of a core")
        assert rate <= 0.05
        ws._via_distributed(iter([[("a", torch.full((4,), 2.0))]]), "2")
        assert peer.received == [8.0] and len(peer.names) == 1  # the same group
    finally:
        peer.proc.stdin.close()
        peer.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def rig(tiny_qwen3, tmp_path_factory, sglang_pool):
    """The engine: a shared server of the session pool (tests/rollout/conftest.py), left serving other weights (the
    pool reloads the checkpoint into it before it hands it out again)."""
    from opid_mega.config import load_config
    from opid_mega.megatron import parallel
    from opid_mega.megatron.policy import Policy
    from opid_mega.models import load_tokenizer

    cfg = load_config(CONFIG, ["model.init_from=", "sync.check_interval=1", "sync.bucket_mb=1"])
    policy = Policy(cfg, tiny_qwen3)
    engine = sglang_pool.shared(1)[0]
    yield cfg, policy, engine, load_tokenizer(tiny_qwen3), tmp_path_factory.mktemp("sync")
    parallel.destroy_all()


def _perturb(policy, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for c in policy.chunks:
            for p in c.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))


@pytest.mark.slow
@pytest.mark.sglang_servers(shared=1)  # changes its weights
def test_each_method_syncs_versions_and_a_bad_bucket_is_rejected(rig):
    from opid_mega.megatron.weight_sync import WeightSync, WeightSyncError

    cfg, policy, engine, tok, tmp = rig
    for version, method in enumerate(("tensor", "disk", "distributed"), start=1):
        _perturb(policy, version)
        cfg.sync.method = method
        ws = WeightSync(policy, engine, cfg, str(tmp), tok)
        assert ws.method == method
        ws.version = version - 1
        with pytest.raises(WeightSyncError, match="does not serve the trainer's weights"):
            ws.check()  # the engine still serves the previous weights
        out = ws(version)
        assert engine.weight_version() == str(version), method
        assert out["weight_sync/bytes"] > 0 and out["weight_sync/probe_max_abs_diff"] <= 1e-3, (method, out)
        print(f"{method}: {out}")
        if method == "disk":
            assert [p.name for p in (tmp / "weight_sync").iterdir()] == [f"v{version}"]

    # corrupted buckets: nothing is sent, the engine keeps serving version 3
    good = [(n, t.clone()) for b in policy_buckets(policy) for n, t in b]
    name, t = good[3]
    for bad in ([(name, t[:-1])], [("model.layers.0.no_such.weight", t)], [(name, t.double())],
                good[:5] + [(name, t[..., :-1])]):
        with pytest.raises(WeightMismatch, match="nothing of this bucket was sent"):
            engine.update_weights(bad, version="99")
    assert engine.weight_version() == "3"
    ws.version = 3
    assert ws.check() <= 1e-3  # still the trainer's weights
    # and the engine still takes a correct update afterwards (generation was continued)
    assert engine.update_weights(good, version="4") > 0 and engine.weight_version() == "4"


def policy_buckets(policy):
    from opid_mega.megatron.weights import export_hf_weights

    return list(export_hf_weights(policy.chunks, policy.hf_config))
