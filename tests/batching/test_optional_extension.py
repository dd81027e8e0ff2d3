"""The C++ extension is optional at install time: a build with a broken compiler (CC=CXX=false) exits 0 with ONE
warning that the numpy builder will be used; the package imports and opid_mega.batching runs on numpy. Without
pybind11 the build says so loudly instead of silently building nothing. Runs in a temporary copy of the source
tree (the checkout's own extension is left alone)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WARNING = "WARNING: opid_mega._C (the C++ batch builder) is not built"


def _copy_tree(dst) -> str:
    src_ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info", "build")
    for name in ("opid_mega", "kernels", "csrc"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(dst, name), ignore=src_ignore)
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy2(os.path.join(ROOT, name), os.path.join(dst, name))
    return str(dst)


def test_broken_compiler_build_succeeds_with_one_warning_and_numpy_fallback(tmp_path):
    tree = _copy_tree(tmp_path / "src")
    env = dict(os.environ, CC="false", CXX="false", LDSHARED="false", LDCXXSHARED="false")
    env.pop("PYTHONPATH", None)
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "--build-temp",
                        str(tmp_path / "tmp")], cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert out.count(WARNING) == 1, out[-3000:]
    assert "numpy builder" in out
    assert not [f for f in os.listdir(os.path.join(tree, "opid_mega")) if f.startswith("_C")]  # nothing built
    check = textwrap.dedent(f"""
        import sys, warnings
        # the copy, not the checkout that `pip install -e` maps opid_mega to (its finder precedes sys.path)
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__ + repr(f)]
        sys.path.insert(0, {tree!r})
        import numpy as np
        import opid_mega
        assert opid_mega.__file__.startswith({tree!r}), opid_mega.__file__
        from opid_mega import batching
        assert batching.backend_name() == "python", batching.backend_name()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = batching.build_train_batches(np.array([1, 2, 3, 4, 5, 6, 7], dtype=np.int32),
                                               np.array([0, 3, 7], dtype=np.int64), np.array([1, 2], dtype=np.int64),
                                               budget=16)
        assert any("numpy batch builder" in str(x.message) for x in w), [str(x.message) for x in w]
        print("NUMPY", type(out).__name__)
    """)
    r = subprocess.run([sys.executable, "-c", check], cwd=tree, env=dict(env, PYTHONPATH=tree),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "NUMPY PackedBatches" in r.stdout


def test_missing_pybind11_is_said_loudly(tmp_path):
    """setup.py under an interpreter where `pybind11` cannot be imported (a module finder refuses it): the build
    still succeeds and names pybind11 in the one warning."""
    tree = _copy_tree(tmp_path / "src")
    (tmp_path / "block").mkdir()
    (tmp_path / "block" / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys
        class _NoPybind11:
            def find_spec(self, name, path=None, target=None):
                if name == "pybind11" or name.startswith("pybind11."):
                    raise ModuleNotFoundError(f"No module named {name!r}")
                return None
        sys.meta_path.insert(0, _NoPybind11())
    """))
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "block"))
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "--build-temp", str(tmp_path / "tmp")],
                       cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert out.count(WARNING) == 1 and "pybind11 is not installed" in out, out[-3000:]
