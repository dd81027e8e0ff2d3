"""Weight sync at TP2 x DP2 (4 gloo ranks): only data-parallel replica 0 gathers (ranks 0 and 1 run the TP
all-gathers, ranks 2 and 3 none), and global rank 0's engine receives every HF tensor, equal to the checkpoint the
policy was loaded from (no update ran, so the weights must be bit-identical)."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


@pytest.mark.slow
def test_only_replica0_gathers_and_rank0_gets_the_whole_model(tmp_path):
    from opid_mega.models import prepare_model

    model = prepare_model("tiny-qwen3", str(tmp_path / "models"))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        os.path.join(HERE, "_sync_worker.py"), model, str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    res = {d["rank"]: d for d in (json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(4))}
    assert res[0]["gathers"] > 0 and res[1]["gathers"] == res[0]["gathers"]
    assert res[2]["gathers"] == 0 and res[3]["gathers"] == 0
    assert res[0]["names_equal"] and res[0]["max_diff"] == 0.0
    assert res[0]["metrics"]["weight_sync/bytes"] > 0 and res[2]["metrics"] == {}
