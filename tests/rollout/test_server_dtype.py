"""Rollout servers serve model.dtype (SGLang 0.5.23's --dtype auto serves a float32 checkpoint as float16): every
server the trainer launches gets --dtype model.dtype unless rollout.sglang_args set it, and the manifest the weight
sync casts to is the dtype the server computes in (launched: our --dtype; attached: its /server_info, `auto` resolved
as SGLang resolves it)."""
import json

import pytest

from opid_mega.config import load_config
from opid_mega.rollout.sglang_engine import SGLangEngine, build_server_command, served_dtype, with_dtype
from sglang_fake import StrictSGLang

from .test_weight_sync import CONFIG


def _flag_values(cmd, flag):
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == flag] + [a.split("=", 1)[1] for a in cmd
                                                                  if a.startswith(flag + "=")]


def test_with_dtype_and_the_command():
    assert with_dtype(["--tp", "2"], "bfloat16") == ["--tp", "2", "--dtype", "bfloat16"]
    assert with_dtype(["--dtype", "float16"], "bfloat16") == ["--dtype", "float16"]  # the user's choice wins
    assert with_dtype(["--dtype=float16"], "bfloat16") == ["--dtype=float16"]
    assert with_dtype(["--tp", "2"], None) == ["--tp", "2"]
    cmd = build_server_command("/m", "127.0.0.1", 1, ["--tp", "2"], dtype="float32")
    assert _flag_values(cmd, "--dtype") == ["float32"]
    assert _flag_values(build_server_command("/m", "127.0.0.1", 1, ["--dtype", "half"], dtype="float32"),
                        "--dtype") == ["half"]


def test_served_dtype_resolves_auto_like_sglang(tmp_path):
    def ckpt(**config):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        return str(d)

    assert served_dtype("bfloat16", None) == "bfloat16" and served_dtype("float", None) == "float32"
    assert served_dtype("auto", ckpt(torch_dtype="float32", model_type="qwen3")) == "float16"
    assert served_dtype(None, ckpt(model_type="llama")) == "float16"  # no dtype in the config: float32
    assert served_dtype("auto", ckpt(torch_dtype="float32", model_type="gemma2")) == "bfloat16"
    assert served_dtype("auto", ckpt(dtype="bfloat16", model_type="qwen2")) == "bfloat16"
    assert served_dtype("auto", str(tmp_path / "missing")) is None


class _Launched(Exception):
    pass


@pytest.mark.parametrize("dtype,extra,want", [("float32", [], "float32"), ("bfloat16", [], "bfloat16"),
                                              ("float32", ["--dtype", "float16"], "float16")])
def test_every_launched_rollout_server_gets_the_model_dtype(monkeypatch, tmp_path, dtype, extra, want):
    from opid_mega.rollout.launch import launch_node_servers

    commands = []

    def launch(self, *a, **kw):  # the real command, built by trainer -> launch_fleet -> SGLangEngine; not started
        commands.append(list(self.command))
        raise _Launched

    monkeypatch.setattr(SGLangEngine, "_launch", launch)
    cfg = load_config(CONFIG, ["rollout.engine=sglang", f"model.dtype={dtype}", "deploy.rollout_servers_per_node=2",
                               f"rollout.sglang_args={json.dumps(extra)}", f"logging.run_dir={tmp_path}"])
    with pytest.raises(Exception, match="failed to start"):
        launch_node_servers(cfg, "/some/hf_dir")
    assert len(commands) == 2 and all(_flag_values(c, "--dtype") == [want] for c in commands), commands


@pytest.mark.parametrize("served,want", [("auto", "float16"), ("bfloat16", "bfloat16"), ("float32", "float32")])
def test_the_manifest_is_the_served_dtype(fake_sglang, tiny_qwen3, served, want):
    server = fake_sglang(routes=StrictSGLang(model_path=tiny_qwen3, dtype=served))
    e = SGLangEngine(url=server.url, max_retries=1)
    assert {d for _, d in e.manifest.values()} == {want}  # the sync casts every tensor to it
