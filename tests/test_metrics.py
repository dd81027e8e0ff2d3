"""MetricsLogger / Timer / read_metrics: JSONL round trip, resume truncation, TensorBoard output."""
import json
import math
import random
import time
import types

import numpy as np
import pytest
import torch

from opid_mega.metrics import METRICS_FILE, MetricsLogger, Timer, read_metrics


def _random_metrics(rng):
    return {"train/success_rate": rng.random(), "train/score": rng.uniform(0, 10),
            "adv/outcome_abs_mean": rng.uniform(0.1, 2), "adv/skill_abs_mean": rng.uniform(1e-4, 1e-2),
            "ppo/kl": rng.uniform(0, 0.05), "ppo/clipfrac": rng.random() * 0.1,
            "train/episode_length": rng.randint(3, 30)}


def test_jsonl_round_trip(tmp_path):
    rng = random.Random(0)
    written = []
    t_start = time.time()
    with MetricsLogger(tmp_path, tensorboard=False, progress=False) as log:
        for step in range(1, 6):
            m = _random_metrics(rng)
            written.append(m)
            rec = log.log(step, m)
            assert rec["step"] == step
    t_end = time.time()
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    for r, m in zip(recs, written):
        for k, v in m.items():
            assert r[k] == v  # json round-trips Python floats exactly
        # the clock fields: the unix time of the call, the seconds since the logger started (both within the run)
        assert t_start <= r["time"] <= t_end and 0 <= r["elapsed_s"] <= t_end - t_start
    assert [r["elapsed_s"] for r in recs] == sorted(r["elapsed_s"] for r in recs)
    # exactly one line per log call
    assert len((tmp_path / METRICS_FILE).read_text().splitlines()) == 5


def test_scalar_types_nonfinite_and_errors(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, progress=False) as log:
        rec = log.log(1, {"a": np.float32(0.25), "b": torch.tensor(3.5), "c": np.int64(7), "d": True,
                          "e": float("nan"), "f": float("inf"), "g": None})
        assert rec["a"] == 0.25 and rec["b"] == 3.5 and rec["c"] == 7 and rec["d"] == 1
        assert rec["e"] is None and rec["f"] is None and rec["g"] is None
        with pytest.raises(TypeError, match="'h'"):
            log.log(2, {"h": "text"})
        with pytest.raises(TypeError, match="'v'"):
            log.log(2, {"v": torch.ones(3)})
        with pytest.raises(ValueError, match="reserved"):
            log.log(2, {"step": 1.0})
    line = (tmp_path / METRICS_FILE).read_text().splitlines()[0]
    json.loads(line)  # strict JSON: NaN was written as null
    assert "NaN" not in line and "Infinity" not in line


def test_same_step_lines_merge(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, progress=False) as log:
        log.log(0, {"eval/success_rate": 0.125})
        log.log(1, {"train/success_rate": 0.5})
        log.log(1, {"eval/success_rate": 0.25})
    merged = read_metrics(tmp_path)
    assert [r["step"] for r in merged] == [0, 1]
    assert merged[1]["train/success_rate"] == 0.5 and merged[1]["eval/success_rate"] == 0.25
    assert len(read_metrics(tmp_path, merge=False)) == 3


def test_resume_truncates_later_steps_and_torn_line(tmp_path):
    rng = random.Random(1)
    with MetricsLogger(tmp_path, tensorboard=False, progress=False) as log:
        for step in range(1, 8):
            log.log(step, _random_metrics(rng))
    # the killed run took 100 s per step (written here: far above anything this test's own clock reaches)
    lines = [{**json.loads(line), "elapsed_s": 100.0 * (k + 1)}
             for k, line in enumerate((tmp_path / METRICS_FILE).read_text().splitlines())]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in lines))
    before = read_metrics(tmp_path)
    with open(tmp_path / METRICS_FILE, "a") as f:  # a run killed mid-write
        f.write('{"step": 8, "train/succ')
    # resume from the checkpoint of step 4: steps 5..8 are replayed, so their lines must go
    t_resume = time.time()
    with MetricsLogger(tmp_path, tensorboard=False, progress=False, resume_step=4) as log:
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
        log.log(5, {"train/success_rate": 0.75})
    t_end = time.time()
    after = read_metrics(tmp_path)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5]
    assert after[:4] == before[:4]
    assert after[4]["train/success_rate"] == 0.75
    # wall time continues from the kept step 4 (400 s), plus this logger's own seconds
    assert 400.0 <= after[4]["elapsed_s"] <= 400.0 + (t_end - t_resume)


def test_fresh_run_moves_old_metrics_aside(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, progress=False) as log:
        log.log(1, {"x": 1.5})
    with MetricsLogger(tmp_path, tensorboard=False, progress=False) as log:
        log.log(1, {"x": 2.5})
    assert [r["x"] for r in read_metrics(tmp_path)] == [2.5]
    backups = list(tmp_path.glob(METRICS_FILE + ".*.bak"))
    assert len(backups) == 1 and read_metrics(backups[0])[0]["x"] == 1.5


def test_tensorboard_and_progress(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, tensorboard=True, progress=True, total=3) as log:
        for step in (1, 2, 3):
            log.log(step, {"train/success_rate": step / 4, "ppo/kl": 0.01 * step})
        assert log.bar.n == 3
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    vals = [(e.step, e.value) for e in acc.Scalars("ppo/kl")]
    assert [s for s, _ in vals] == [1, 2, 3]
    assert all(math.isclose(v, 0.01 * s, rel_tol=1e-6) for s, v in vals)


def test_timer_accumulates_and_pops():
    clock = iter([10.0, 11.0, 20.0, 22.5, 30.0, 30.25])  # perf_counter at each stage's start and end
    timer = Timer()
    with pytest.MonkeyPatch.context() as mp:  # the module's clock only (not time.perf_counter for everyone)
        mp.setattr("opid_mega.metrics.time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
        with timer("rollout"):
            pass
        with timer("rollout"):
            pass
        with timer("update"):
            pass
    m = timer.pop()
    assert m == {"time/rollout": 1.0 + 2.5, "time/update": 0.25}  # a repeated stage adds up
    assert timer.pop() == {}
    calls = []
    t2 = Timer(sync=lambda: calls.append(1))
    with pytest.raises(RuntimeError):
        with t2("boom"):
            raise RuntimeError("x")
    assert "time/boom" in t2.as_metrics() and len(calls) == 2
