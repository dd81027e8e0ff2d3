"""The checkpoint writer's Manager (opid_mega.megatron.checkpoint.prepare_writer: the results queue megatron's async
file writer reports through) ends with the rank that started it. A Manager's server serves until it is told to stop:
a rank SIGKILLed (the OOM killer, a lost node's kill, the node-lost tests' stopped rank) used to leave it, and its
resource tracker, running for good (~0.2-0.5 GB each). It imports what it unpickles as it starts, not in a save."""
import os
import signal
import subprocess
import sys
import time

from procs import children

CODE = """
import os, sys, time
from opid_mega.megatron import checkpoint
checkpoint.prepare_writer()
checkpoint._writer_ready()
from megatron.core.dist_checkpointing.strategies import filesystem_async
q = filesystem_async._results_queue
q.put({"rank": 0}); assert q.get(timeout=30) == {"rank": 0}  # the queue megatron's writer uses works
print("ready", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_the_writer_manager_ends_with_a_sigkilled_rank():
    p = subprocess.Popen([sys.executable, "-c", CODE], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    try:
        assert p.stdout.readline().strip() == "ready"
        spawned = [pid for pid, cmd in children(p.pid).items() if "spawn_main" in cmd]  # the Manager's server
        assert len(spawned) == 1, spawned
        manager = spawned[0]
        # it imported torch (torch.distributed.checkpoint) as it started, before any save: it unpickles the write
        # results each save sends, and importing their classes on the first save's put cost that save ~1.7 s
        with open(f"/proc/{manager}/maps") as f:
            assert "libtorch" in f.read(), "the writer's Manager did not import torch.distributed.checkpoint up front"
        time.sleep(1.5)
        assert _alive(manager)  # it serves while the rank runs
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(manager) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(manager), f"the checkpoint writer's Manager {manager} outlived its SIGKILLed rank"
