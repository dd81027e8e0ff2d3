"""Checkpoint integrity (opid_mega.megatron.checkpoint) on a tiny megatron-core model in one gloo process: the
step_N.tmp -> step_N rename, the fallback from an unreadable latest checkpoint, the removal of what a killed save
left, the free-space check and a real ENOSPC on a small tmpfs, and SIGKILL at every named point of a save (each in a
subprocess). The trainer-level fault tests are tests/trainer/test_run_integrity.py."""
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from _ckpt_fault_worker import perturb, tiny_model, weights  # noqa: E402
from megatron_testutil import launch  # noqa: E402

from opid_mega.megatron import checkpoint  # noqa: E402

WORKER = Path(__file__).with_name("_ckpt_fault_worker.py")


@pytest.fixture(scope="module")
def model():
    from opid_mega.megatron import parallel

    parallel.initialize(1, 1, backend="gloo")
    yield tiny_model(0)
    parallel.destroy_all()


def _assert_weights(model, ref: dict) -> None:
    got = weights(model)
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k


def _save_two(model, ckpt: Path) -> tuple[dict, dict]:
    checkpoint.save(str(ckpt), 1, [model], extra={"trainer_state": "{}"})
    one = weights(model)
    perturb(model, 1)
    checkpoint.save(str(ckpt), 2, [model], extra={"trainer_state": "{}"})
    return one, weights(model)


def test_save_goes_through_a_tmp_dir_and_loads_with_weights_only(model, tmp_path):
    ckpt = tmp_path / "ckpt"
    one, two = _save_two(model, ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest_step", "step_1", "step_2"]
    assert checkpoint.latest_step(str(ckpt)) == 2 and checkpoint.checkpoint_problem(str(ckpt / "step_2")) is None
    common = torch.load(ckpt / "step_2" / "common.pt", weights_only=True)  # no pickle of arbitrary objects needed
    assert common["extra"]["world_size"] == 1 and common["step"] == 2
    perturb(model, 2)
    assert checkpoint.load(str(ckpt), [model])[0] == 2
    _assert_weights(model, two)


def test_an_unreadable_latest_checkpoint_falls_back_with_one_warning(model, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    one, _ = _save_two(model, ckpt)
    step2 = ckpt / "step_2"
    damage = {
        "no metadata.json": lambda: (step2 / "metadata.json").unlink(),
        "unreadable common.pt": lambda: (step2 / "common.pt").write_bytes(b"\x80\x02garbage"),
        "no rng/rank0.pt": lambda: (step2 / "rng" / "rank0.pt").unlink(),
        "truncated __0_0.distcp": lambda: os.truncate(step2 / "__0_0.distcp", 100),
    }
    backup = tmp_path / "backup"
    shutil.copytree(step2, backup)
    for why, spoil in damage.items():
        shutil.rmtree(step2)
        shutil.copytree(backup, step2)
        spoil()
        assert why in checkpoint.checkpoint_problem(str(step2))
        capsys.readouterr()
        perturb(model, 3)
        assert checkpoint.load(str(ckpt), [model])[0] == 1
        _assert_weights(model, one)
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and "step_2" in err[0] and why in err[0] and "step_1" in err[0], err


def test_clean_uncommitted_removes_only_what_a_killed_save_left(model, tmp_path):
    ckpt = tmp_path / "ckpt"
    _save_two(model, ckpt)
    (ckpt / "latest_step").write_text("1")  # step_2 renamed, latest_step not yet written
    for name in ("step_3.tmp", "step_2.old"):
        (ckpt / name).mkdir()
    (ckpt / "latest_step.tmp").write_text("3")
    (ckpt / "notes").mkdir()  # not ours
    assert checkpoint.clean_uncommitted(str(ckpt)) == ["latest_step.tmp", "step_2", "step_2.old", "step_3.tmp"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest_step", "notes", "step_1"]
    (ckpt / "latest_step").unlink()  # no latest_step: only temporaries go, never a step directory
    (ckpt / "step_4.tmp").mkdir()
    assert checkpoint.clean_uncommitted(str(ckpt)) == ["step_4.tmp"] and (ckpt / "step_1").is_dir()


@contextmanager
def tmpfs(path: Path, size: int):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount permission): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(where: Path, leave: int) -> Path:
    """A file that leaves `leave` bytes free on `where`'s file system."""
    filler = where / "filler"
    free = shutil.disk_usage(where).free
    with open(filler, "ab") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def test_too_little_disk_space_is_refused_before_anything_is_written(model, tmp_path):
    with tmpfs(tmp_path / "fs", 8 << 20) as fs:
        ckpt = fs / "ckpt"
        checkpoint.save(str(ckpt), 1, [model], extra={"trainer_state": "{}"})
        one = weights(model)
        size = checkpoint.dir_bytes(str(ckpt / "step_1"))
        _fill(fs, size // 2)
        free = shutil.disk_usage(fs).free
        perturb(model, 4)
        with pytest.raises(checkpoint.CheckpointError) as e:
            checkpoint.save(str(ckpt), 2, [model], extra={"trainer_state": "{}"})
        msg = str(e.value)
        need = int(size * 1.01) + (1 << 20)
        assert f"needs about {need} bytes (the size of step_1)" in msg and f"only {free} bytes free" in msg, msg
        assert "nothing of it was written" in msg and "step_1" in msg and "\n" not in msg
        assert sorted(p.name for p in ckpt.iterdir()) == ["latest_step", "step_1"]
        assert checkpoint.load(str(ckpt), [model])[0] == 1
        _assert_weights(model, one)


def test_enospc_while_writing_leaves_no_partial_checkpoint(model, tmp_path):
    """The free-space check passes, then the disk fills up while the tensors are written (a real ENOSPC)."""
    with tmpfs(tmp_path / "fs", 8 << 20) as fs:
        ckpt = fs / "ckpt"
        checkpoint.save(str(ckpt), 1, [model], extra={"trainer_state": "{}"})
        one = weights(model)
        hook = lambda point, step, path: _fill(fs, 64 << 10) if point == "tmp_made" else None  # noqa: E731
        checkpoint.FAULT_HOOKS.append(hook)
        try:
            perturb(model, 5)
            with pytest.raises(checkpoint.CheckpointError, match=r"no space left .* while writing it \(\d+ bytes free"
                                                                 r" now, after removing the partial step_2\.tmp\); the"
                                                                 r" last complete checkpoint is step_1"):
                checkpoint.save(str(ckpt), 2, [model], extra={"trainer_state": "{}"})
        finally:
            checkpoint.FAULT_HOOKS.remove(hook)
        assert sorted(p.name for p in ckpt.iterdir()) == ["latest_step", "step_1"]
        (fs / "filler").unlink()
        assert checkpoint.load(str(ckpt), [model])[0] == 1
        _assert_weights(model, one)


@pytest.mark.slow
@pytest.mark.parametrize("point", checkpoint.FAULT_POINTS)
def test_sigkill_inside_a_save_resumes_from_the_last_complete_checkpoint(model, tmp_path, point):
    """The saving process is SIGKILLed at `point` of step 2's save: what it left is removed, step 1 loads whole."""
    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref.pt"
    saved = dict(os.environ)
    os.environ.update({checkpoint.FAULT_ENV: f"{point}@2", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    try:  # (launch: its own session, output to a file; what the killed process left running is killed after)
        rc, log = launch([str(WORKER), str(ckpt), str(ref)], tmp_path / "worker.log", timeout=300)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert rc == -9 and "saved step_2" not in log, (rc, log[-2000:])
    assert checkpoint.latest_step(str(ckpt)) == 1
    left = {"tmp_made": ["step_2.tmp"], "tensors_written": ["step_2.tmp"], "rng_written": ["step_2.tmp"],
            "before_rename": ["step_2.tmp"], "renamed": ["step_2"]}[point]
    assert checkpoint.clean_uncommitted(str(ckpt)) == left
    assert checkpoint.select_step(str(ckpt)) == (1, None)
    perturb(model, 6)
    assert checkpoint.load(str(ckpt), [model])[0] == 1
    _assert_weights(model, torch.load(ref, weights_only=True))
