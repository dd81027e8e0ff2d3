"""A resume on more ranks than saved the checkpoint: a rank without rng/rank<R>.pt starts from RNG states seeded by
(step, rank) (opid_mega.megatron.checkpoint.rank_rng_state); a rank with its file gets exactly the saved states."""
import os
import random

import torch

from opid_mega.megatron.checkpoint import _rng_state, _set_rng_state, fallback_seed, rank_rng_state


def _draws():
    return random.random(), torch.rand(4, dtype=torch.float64).tolist()


def test_saved_rank_gets_its_file_and_a_new_rank_a_fixed_seed(tmp_path):
    os.makedirs(tmp_path / "rng")
    random.seed(7)
    torch.manual_seed(7)
    torch.save(_rng_state(), tmp_path / "rng" / "rank0.pt")
    expected0 = _draws()  # what the saved states draw next

    _set_rng_state(rank_rng_state(str(tmp_path), 0, step=5))
    assert _draws() == expected0

    # rank 1 has no file: seeded by (step, rank), the same on every resume, different from rank 2 and another step
    _set_rng_state(rank_rng_state(str(tmp_path), 1, step=5))
    first = _draws()
    _set_rng_state(rank_rng_state(str(tmp_path), 1, step=5))
    assert _draws() == first
    seed = fallback_seed(5, 1)
    ref = torch.Generator().manual_seed(seed)
    assert first == (random.Random(seed).random(), torch.rand(4, generator=ref, dtype=torch.float64).tolist())
    _set_rng_state(rank_rng_state(str(tmp_path), 2, step=5))
    assert _draws() != first
    _set_rng_state(rank_rng_state(str(tmp_path), 1, step=6))
    assert _draws() != first


def test_fallback_seed_values():
    # (step * 1_000_003 + rank * 7_919 + 12_345) mod (2^31 - 1), by hand
    assert fallback_seed(0, 0) == 12_345
    assert fallback_seed(1, 0) == 1_012_348
    assert fallback_seed(0, 1) == 20_264
    assert fallback_seed(3000, 2) == (3_000_009_000 + 15_838 + 12_345) % 2_147_483_647 == 852_553_536
    assert len({fallback_seed(s, r) for s in range(50) for r in range(64)}) == 50 * 64
