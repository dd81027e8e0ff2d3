"""A Transformer Engine that is installed but broken (its .so fails to load: OSError; or any other exception at
import) falls back like a missing one: megatron-core imports, the model builds with the local spec and runs, one
warning line says why (opid_mega.megatron.te_guard)."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fake_te(tmp_path, body: str) -> str:
    pkg = tmp_path / "site" / "transformer_engine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    return str(tmp_path / "site")


def test_te_whose_library_fails_to_load_falls_back_to_the_local_spec(tmp_path):
    """In a fresh interpreter whose `import transformer_engine` raises OSError (as a TE with a missing or mismatched
    libtransformer_engine.so does): `import megatron.core` would die of it; through opid_mega.megatron the model
    builds with megatron-core's local layers and a packed forward + backward runs."""
    site = _fake_te(tmp_path, 'raise OSError("libtransformer_engine.so: cannot open shared object file")\n')
    script = textwrap.dedent("""
        import sys, warnings
        warnings.simplefilter("always")
        import torch
        from opid_mega.megatron import parallel, te_guard
        from opid_mega.megatron.model import build_model, transformer_config, layer_spec
        from opid_mega.megatron import attention
        assert te_guard.problem().startswith("OSError: libtransformer_engine.so"), te_guard.problem()
        assert not te_guard.usable() and not attention._te_available()
        try:
            import transformer_engine  # noqa: F401
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("a broken TE stayed importable")
        parallel.initialize(1, 1)
        arch = dict(hidden=32, ffn=64, layers=2, heads=4, kv_heads=2, head_dim=8, vocab=128, eps=1e-6,
                    rope_theta=10000.0, qkv_bias=False, qk_norm=True, tied=True, max_pos=64)
        cfg = transformer_config(arch)
        spec = layer_spec(cfg)
        assert "extensions.transformer_engine" not in spec.submodules.self_attention.submodules.linear_qkv.__module__
        model = build_model(arch, cfg)[0]
        assert not any("transformer_engine" in type(m).__module__ for m in model.modules())
        ids = torch.randint(0, 128, (1, 12))
        pos = torch.arange(12)[None]
        params = attention.packed_seq_params(torch.tensor([0, 5, 12]))
        out = model(ids, pos, None, packed_seq_params=params, score_rows=torch.arange(11),
                    score_targets=ids[0, 1:])
        out.sum().backward()
        assert torch.isfinite(out).all()
        print("BUILT", tuple(out.shape))
        parallel.destroy_all()
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "BUILT (1, 11)" in r.stdout
    warned = [ln for ln in r.stderr.splitlines() if "Transformer Engine is installed but cannot be imported" in ln]
    assert len(warned) == 1 and "OSError: libtransformer_engine.so" in warned[0], r.stderr[-2000:]


def test_guard_blocks_any_import_exception_once(tmp_path, monkeypatch):
    """In-process: a TE raising RuntimeError at import is blocked (later imports raise ModuleNotFoundError, which
    megatron-core's `except ImportError` clauses take as "not installed"), with one warning, once."""
    from opid_mega.megatron import te_guard

    site = _fake_te(tmp_path, 'raise RuntimeError("CUDA driver version is insufficient")\n')
    monkeypatch.syspath_prepend(site)
    saved = {m: sys.modules[m] for m in te_guard.TE_MODULES if m in sys.modules}
    monkeypatch.setattr(te_guard, "_DONE", False)
    monkeypatch.setattr(te_guard, "_PROBLEM", None)
    try:
        with pytest.warns(RuntimeWarning, match=r"cannot be imported \(RuntimeError: CUDA driver version"):
            assert te_guard.guard() == "RuntimeError: CUDA driver version is insufficient"
        assert te_guard.guard() == "RuntimeError: CUDA driver version is insufficient"  # no second warning/import
        with pytest.raises(ModuleNotFoundError):
            import transformer_engine  # noqa: F401
        assert not te_guard.usable()
    finally:
        for m in te_guard.TE_MODULES:
            sys.modules.pop(m, None)
        sys.modules.update(saved)
