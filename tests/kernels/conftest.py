"""Kernel tests: Triton runs under the CPU interpreter here (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA,
before any test module is imported). On a machine with CUDA the same tests run the compiled kernels on the GPU
(tools/gpu_check.sh). Spawned multi-rank tests inherit the variable.
"""

import pytest
import torch

ON_GPU = torch.cuda.is_available()


@pytest.fixture
def device():
    return torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture
def shrink_tiles(monkeypatch):
    """shrink_tiles(module): under the interpreter, small epilogue tiles and column splits in `module` (a `*_triton`
    kernel module) so small shapes still run multi-tile loops and several splits per chunk (restored after the test;
    on a GPU the autotuned configurations run); returns the module. Several chunks: the tests' chunk_size."""
    def shrink(module):
        if not ON_GPU:
            for name, value in (("BLOCK_N", 8), ("BLOCK_V", 16), ("SPLIT", 32)):
                monkeypatch.setattr(module, name, value)
        return module
    return shrink


@pytest.fixture
def small_tiles(shrink_tiles):
    import opid_mega.kernels.logprob_triton as lt

    return shrink_tiles(lt)


@pytest.fixture(autouse=True)
def _fixed_tiles(request, monkeypatch):
    """On a GPU the kernels run the modules' fixed tiles (one compile per flag combination, no tuning run); a test
    marked `autotune` keeps the autotuner."""
    if ON_GPU and request.node.get_closest_marker("autotune") is None:
        import opid_mega.kernels.fork_attention_triton as ft
        import opid_mega.kernels.logprob_triton as lt

        monkeypatch.setattr(lt, "AUTOTUNE", False)
        monkeypatch.setattr(ft, "AUTOTUNE", False)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Kernel tests use tiny shapes: one intra-op thread avoids OpenMP spin-wait stalls on a loaded shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
