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


def _has_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_the_writer_manager_ends_with_a_sigkilled_rank():
    p = subprocess.Popen([sys.executable, "-c", CODE], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    try:
        assert p.stdout.readline().strip() == "ready"
        spawned = [pid for pid, cmd in children(p.pid).items() if "spawn_main" in cmd]  # the Manager's server
        assert len(spawned) == 1, spawned
        manager = spawned[0]
        # it imports torch (torch.distributed.checkpoint) in the background as it starts, before any save: it
        # unpickles the write results each save sends, and importing their classes on the first save's put cost that
        # save ~1.7 s (only dicts were sent here)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _has_torch(manager):
            time.sleep(0.2)
        assert _has_torch(manager), "the writer's Manager did not import torch.distributed.checkpoint up front"
        time.sleep(1.5)
        assert _alive(manager)  # it serves while the rank runs
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(manager) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(manager), f"the checkpoint writer's Manager {manager} outlived its SIGKILLed rank"


def _quick_rank():
    """A multiprocessing child that prepares the writer and ends as soon as the Manager's server process exists,
    before the Manager has started (it starts serving once the server has imported, about a second later)."""
    import multiprocessing as mp

    from opid_mega.megatron import checkpoint

    checkpoint.prepare_writer()
    deadline = time.monotonic() + 60
    while not mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert mp.active_children(), "the writer's Manager process did not start"


def test_a_multiprocessing_child_that_ends_while_the_manager_starts_exits():
    """A process started by multiprocessing runs its exit function without joining its threads: that function joins
    the child processes it started (the writer's Manager among them, serving until told to stop). The writer's exit
    finalizer waits for the Manager's start and stops it, so the child exits instead of hanging."""
    import multiprocessing as mp

    for method in ("spawn", "forkserver"):  # fresh interpreters: nothing of this process's writer state inherited
        p = mp.get_context(method).Process(target=_quick_rank)
        p.start()
        p.join(timeout=60)
        alive = p.is_alive()
        if alive:
            p.kill()
        assert not alive and p.exitcode == 0, (method, p.exitcode)
