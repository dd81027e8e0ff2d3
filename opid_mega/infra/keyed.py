"""Start a server tied to the process that launched it, with an API key that is on no command line and in no log.

    OPID_SGLANG_API_KEY=<key> python -m opid_mega.infra.keyed sglang.launch_server --model-path M ...
    OPID_SGLANG_API_KEY=<key> python -m opid_mega.infra.keyed sglang_router.launch_router --worker-urls ...
    env, fds = key_channel(key); Popen([..., "-m", "opid_mega.infra.keyed", ...], env={**env, ...}, pass_fds=fds)

runs `python -m MODULE ARGS --api-key <key>` in this process (runpy, as `python -m` does), with the key read from
the pipe whose file descriptor OPID_SGLANG_API_KEY_FD names (what the trainer uses: `key_channel`), else from the
environment variable OPID_SGLANG_API_KEY (by hand); both variables are removed first, so the server's own child
processes do not inherit them. The process's command line, which every local user can read (`ps`), therefore shows
the module and its arguments but no key, and with the pipe the key is not in the process's environment either
(/proc/PID/environ keeps the environment a process started with; readable by its user and root). SGLang 0.5.23 writes its resolved
server arguments, api_key included, into its log at start, and either server may print it elsewhere: every byte this
process and its children write to stdout/stderr goes through a pipe in which the key is replaced by ***, before it
reaches the log file. Without the variable (or empty) the module runs unchanged, without a key.

With $OPID_OWNER set (the launcher's `opid_mega.infra.tether.owner_env()`), a watcher kills the server's process
group once the launching process is gone (opid_mega.infra.tether.watch_owner), SIGKILL and the OOM killer included.

SGLang: `--api-key` protects every endpoint but /health*, /ready*, /metrics* (clients send
`Authorization: Bearer <key>`). sglang-router 0.3.2: `--api-key` is both what it sends to the workers and what it
asks of its own clients (/generate, /workers; /health stays open).
"""
from __future__ import annotations

import atexit
import os
import runpy
import select
import sys
import threading
import time

from opid_mega.infra.hosts import API_KEY_ENV
from opid_mega.infra.tether import watch_owner

API_KEY_FD_ENV = API_KEY_ENV + "_FD"
MASK = b"***"


def key_channel(key: str) -> tuple[dict, tuple]:
    """(environment entries, pass_fds) that hand `key` to a `python -m opid_mega.infra.keyed ...` child through a pipe:
    give both to subprocess.Popen, then os.close() the fd (the child has its own copy)."""
    r, w = os.pipe()
    try:
        os.write(w, key.encode())  # a key is far below a pipe's buffer: this never blocks
    finally:
        os.close(w)
    return {API_KEY_FD_ENV: str(r)}, (r,)


def read_key() -> str:
    """The key handed to this process ($OPID_SGLANG_API_KEY_FD's pipe, else $OPID_SGLANG_API_KEY; both removed from
    the environment), or ""."""
    fd = os.environ.pop(API_KEY_FD_ENV, "")
    env_key = os.environ.pop(API_KEY_ENV, "")
    if fd:
        chunks = []
        with os.fdopen(int(fd), "rb") as f:
            while True:
                b = f.read(4096)
                if not b:
                    break
                chunks.append(b)
        return b"".join(chunks).decode().strip()
    return env_key.strip()


def _redacting_pump(read_fd: int, out_fd: int, secret: bytes) -> None:
    """Copy read_fd to out_fd line by line with `secret` replaced by ***; a line longer than 64 KiB goes out in
    pieces that keep len(secret) - 1 bytes back (so a key is never split between two writes)."""
    keep = max(len(secret) - 1, 0)
    buf = b""
    while True:
        try:
            chunk = os.read(read_fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            if buf:
                _write_all(out_fd, buf.replace(secret, MASK))
            return
        buf += chunk
        if b"\n" in buf:
            head, buf = buf.rsplit(b"\n", 1)
            _write_all(out_fd, (head + b"\n").replace(secret, MASK))
        if len(buf) > 65536:
            buf = buf.replace(secret, MASK)
            head, buf = buf[:len(buf) - keep], buf[len(buf) - keep:]
            _write_all(out_fd, head)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            n = os.write(fd, data)
        except OSError:
            return
        data = data[n:]


def redact_output(secret: str) -> None:
    """From now on, fds 1 and 2 of this process (and of the children it starts) go through a pipe to the original
    stdout with `secret` replaced by ***."""
    sys.stdout.flush()
    sys.stderr.flush()
    out_fd = os.dup(1)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    pump = threading.Thread(target=_redacting_pump, args=(read_fd, out_fd, secret.encode()), daemon=True,
                            name="redact-output")
    pump.start()

    def drain() -> None:  # at a normal exit: what was written last reaches the log
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read_fd], [], [], 0.1)
            if not ready:
                return

    atexit.register(drain)


def main(argv: list) -> None:
    if not argv:
        print("usage: python -m opid_mega.infra.keyed MODULE [ARGS...] (key in $" + API_KEY_ENV + ")",
              file=sys.stderr)
        sys.exit(2)
    module, args = argv[0], list(argv[1:])
    key = read_key()
    watch_owner()  # before the server starts: it ends when the process that launched it is gone
    if key:
        if any(a == "--api-key" or a.startswith("--api-key=") for a in args):
            print(f"opid_mega.infra.keyed: {module} got --api-key on its command line and in ${API_KEY_ENV}; "
                  "give it once, in the environment", file=sys.stderr)
            sys.exit(2)
        redact_output(key)
        args += [f"--api-key={key}"]  # one token: a key may begin with "-", which argparse would take for an option
    sys.argv = [module] + args
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
