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


def test_update_store_listens_on_its_address_alone_and_only_until_the_group_formed():
    """The weight-update group's store: bound to the address given (loopback here), never to every address; once
    close_listener ran (after the group's first update) its members keep working and a new connection is refused."""
    import datetime
    import socket

    from torch.distributed import TCPStore

    from opid_mega.megatron.weight_sync import close_listener, open_store

    timeout = datetime.timedelta(seconds=5)
    store, fd = open_store("127.0.0.1", 2, timeout)
    port = store.port
    assert _listeners(port) == ["127.0.0.1"]  # TCPStore("127.0.0.1", 0, ...) alone listens on [::]
    member = TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    member.set("k", "v1")
    close_listener(fd)
    assert _listeners(port) == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    store.set("k", "v2")  # both established connections still work, both ways
    assert member.get("k") == b"v2"
    member.set("j", "w")
    assert store.get("j") == b"w"


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
