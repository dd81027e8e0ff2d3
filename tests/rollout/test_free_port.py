"""A launched server's port is reserved, not probed: held by a socket until the server listens on it, so two servers
started together never get the same port; and it is chosen below the kernel's ephemeral range, so no outgoing
connection can take it during the server's start-up (SGLang binds its HTTP port only after loading the model)."""
import socket

from opid_mega.rollout import sglang_engine
from opid_mega.rollout.sglang_engine import reserve_port


def test_ports_are_below_the_ephemeral_range_and_held_until_released():
    lo, _ = sglang_engine._ephemeral_range()
    held = [reserve_port() for _ in range(20)]
    try:
        ports = {h.getsockname()[1] for h in held}
        assert all(10000 <= p < lo for p in ports) and len(ports) == 20
        port = held[0].getsockname()[1]
        with socket.socket() as probe:  # a probe or another start's reservation cannot take it
            try:
                probe.bind(("127.0.0.1", port))
                taken = False
            except OSError:
                taken = True
        assert taken
        with socket.socket() as server:  # the server binds it with SO_REUSEADDR (uvicorn, tokio) and listens
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        for h in held:
            h.close()


def test_servers_started_together_never_get_the_same_port(monkeypatch):
    """Every draw below the ephemeral range is the same free port: the first start holds it, the second gets
    another (before: both probed it free and both servers were told to bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(sglang_engine, "_ephemeral_range", lambda: (port + 1, 60999))
    monkeypatch.setattr(sglang_engine.random.Random, "randrange", lambda self, a, b: port)
    first, second = reserve_port(), reserve_port()
    try:
        assert first.getsockname()[1] == port and second.getsockname()[1] != port
    finally:
        first.close()
        second.close()


def test_a_busy_port_is_never_returned(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        busy.listen()
        monkeypatch.setattr(sglang_engine, "_ephemeral_range", lambda: (taken + 1, 60999))
        monkeypatch.setattr(sglang_engine.random.Random, "randrange", lambda self, a, b: taken)
        held = reserve_port()
        assert held.getsockname()[1] != taken  # every draw busy: the kernel's choice
        held.close()
