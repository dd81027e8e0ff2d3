"""A launched server's port is chosen below the kernel's ephemeral range, so no outgoing connection can take it during
the server's start-up (SGLang binds its HTTP port only after loading the model)."""
import socket

from opid_mega.rollout import sglang_engine
from opid_mega.rollout.sglang_engine import free_port


def test_ports_are_free_and_below_the_ephemeral_range():
    lo, _ = sglang_engine._ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < lo for p in ports) and len(ports) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free indeed


def test_a_busy_port_is_never_returned(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        busy.listen()
        monkeypatch.setattr(sglang_engine, "_ephemeral_range", lambda: (taken + 1, 60999))
        monkeypatch.setattr(sglang_engine.random.Random, "randrange", lambda self, a, b: taken)
        assert free_port() != taken  # every draw busy: the kernel's choice
