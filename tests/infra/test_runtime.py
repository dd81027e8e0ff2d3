"""What a user sees of the machine: thread counts, the first-run notice, checkpoint pruning, dependency warnings."""
import os
import subprocess
import sys
import warnings

import pytest


def _run(code, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    full.update(env)
    r = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


CODE = "from opid_mega.infra.runtime import configure_threads, available_cores; n = configure_threads(); " \
       "import torch; print(n, torch.get_num_threads(), available_cores())"


def test_threads_follow_the_cores_available_to_the_process():
    n, torch_n, cores = map(int, _run(CODE).split())
    assert n == torch_n == cores == len(os.sched_getaffinity(0))
    # pinned to one core (taskset / a cpuset): one thread
    one = _run(f"import os; os.sched_setaffinity(0, {{{min(os.sched_getaffinity(0))}}}); " + CODE).split()
    assert one[:3] == ["1", "1", "1"]


def test_threads_split_among_local_ranks_and_respect_omp_num_threads():
    cores = len(os.sched_getaffinity(0))
    n, torch_n, _ = map(int, _run(CODE, LOCAL_WORLD_SIZE="4", WORLD_SIZE="4").split())
    assert n == torch_n == max(1, cores // 4)
    n, torch_n, _ = map(int, _run(CODE, OMP_NUM_THREADS="1").split())
    assert n == torch_n == 1


def test_dependency_warnings_are_filtered_but_ours_are_not():
    from opid_mega.infra.runtime import filter_dependency_warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        filter_dependency_warnings()
        warnings.warn("builtin type SwigPyPacked has no __module__ attribute", DeprecationWarning)
        warnings.warn("builtin type swigvarlink has no __module__ attribute", DeprecationWarning)
        warnings.warn_explicit("old arg", DeprecationWarning, "x.py", 1, module="megatron.core.transformer")
        warnings.warn("opid: something real", DeprecationWarning)
        warnings.warn("opid: user warning", UserWarning)
    assert [str(w.message) for w in seen] == ["opid: something real", "opid: user warning"]


def test_first_run_notice_names_what_is_built(tmp_path):
    from opid_mega.cli import first_run_notice
    from opid_mega.config import load_config

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_cpu.yaml"),
                      [f"model.cache_dir={tmp_path}/models", f"env.options.cache_dir={tmp_path}/games"])
    line = first_run_notice(cfg)
    assert "\n" not in line and line.startswith("opid-train: first run")
    # 16 train + 8 test games, the tiny model, 60 SFT epochs
    assert "the tiny-qwen3 model" in line and "24 textworld games" in line and "opid-sft warm start (60 epochs" in line
    assert "min on 2 cores" in line
    nothing = load_config(None, [f"model.cache_dir={tmp_path}/models", "model.path=" + str(tmp_path),
                                 "env.name=search_qa"])
    line = first_run_notice(nothing)  # names only what it checked: no games or warm start it never looked for
    assert line == f"opid-train: nothing to build first (model {tmp_path}, search_qa data present); starting", line


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    from opid_mega.megatron.checkpoint import prune, saved_steps

    for s in (2, 4, 6, 8):
        (tmp_path / f"step_{s}").mkdir()
    (tmp_path / "step_x").mkdir()  # not a checkpoint: left alone
    (tmp_path / "latest_step").write_text("6")  # step_8 is newer than the latest complete one: being written
    assert prune(str(tmp_path), 2) == [2]
    assert saved_steps(str(tmp_path)) == [4, 6, 8] and (tmp_path / "step_x").is_dir()
    assert prune(str(tmp_path), 1) == [4]
    assert saved_steps(str(tmp_path)) == [6, 8]
    with pytest.raises(ValueError, match="keep"):
        prune(str(tmp_path), 0)
    assert prune(str(tmp_path / "missing"), 1) == []


def test_ctrl_c_during_a_checkpoint_write_waits_for_the_write():
    """SIGINT inside checkpoint._ctrl_c_after_write is held until the block ends, then raised; forked children made
    inside the block inherit the holding handler (they survive the same Ctrl-C); the default handler comes back."""
    import os
    import signal

    from opid_mega.megatron.checkpoint import _ctrl_c_after_write

    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a CI job may ignore it)
    try:
        reached_end = False
        with pytest.raises(KeyboardInterrupt):
            with _ctrl_c_after_write():
                pid = os.fork()
                if pid == 0:  # child: the same signal must not interrupt it (exit 7: it was not interrupted)
                    code = 1
                    try:
                        os.kill(os.getpid(), signal.SIGINT)
                        sum(range(100_000))  # bytecode runs: a pending signal's handler runs here
                        code = 7
                    finally:
                        os._exit(code)
                os.kill(os.getpid(), signal.SIGINT)
                _, status = os.waitpid(pid, 0)
                reached_end = True
        assert reached_end and os.waitstatus_to_exitcode(status) == 7
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)
