"""Megatron-LM >= core_v0.19.0's model construction (ModelConfig -> ModelBuilder) with OPID's model, under
megatron-core 0.19.2 (its wheel ships megatron.training), from the folder the README install fills
(tools/install_compat.sh; nothing is downloaded here): Megatron-LM's own parser and ``gpt_config_from_args(args,
model_config_cls=OpidGPTModelConfig)`` -> ``build_distributed_models`` as ``pretrain()`` calls it gives OPID's model
with the flags' epsilon and the same log-probs as the model_provider path; the example trains identically through the
provider and the builder, and as under the installed megatron-core (0.16.1 in CI)."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from test_megatron_compat_019 import VERSION, _free_port, compat_megatron_core

pytestmark = pytest.mark.slow
pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_model_builder_worker.py")
EXAMPLE = os.path.join(ROOT, "examples", "megatron_lm_opid.py")
# megatron-core 0.19 declares Python >= 3.12; on 3.11 it needs typing.override, which typing_extensions has
RUN_EXAMPLE = ("import runpy, sys, typing, typing_extensions\n"
               "if not hasattr(typing, 'override'): typing.override = typing_extensions.override\n"
               "sys.argv = sys.argv[1:]\n"
               "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def _env(compat: str = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (compat, ROOT, os.path.dirname(WORKER)) if p)
    return env


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    target = compat_megatron_core()
    out = tmp_path_factory.mktemp("builder") / "result.json"
    p = subprocess.run([sys.executable, WORKER, str(out)], env=_env(target), cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return json.loads(out.read_text())


def test_builder_builds_opid_model_as_pretrain_does(built):
    assert built["megatron_core_version"] == VERSION
    assert built["builder_cls"] == "OpidGPTModelBuilder" and built["model_cls"] == "OpidGPTModel"
    assert built["chunks"] == 1
    assert built["vocab"] == 1024 and built["tied"] is False  # --vocab-size 1000 padded to 128 x TP1


def test_builder_model_has_the_flags_epsilon(built):
    """Megatron-LM's parser stores --norm-epsilon 1e-6 as layernorm_epsilon; every RMSNorm is built with it."""
    assert built["args_layernorm_epsilon"] == 1e-6 and built["args_has_norm_epsilon"] is False
    assert built["eps"] == [1e-6]


def test_builder_and_provider_paths_agree(built):
    assert built["same_parameter_names"] and built["logprobs_finite"] and built["logprobs_equal"]


def test_builder_refuses_apply_layernorm_1p_in_one_line(built):
    lines = built["layernorm_1p_error"].splitlines()
    assert len(lines) == 2 and "--apply-layernorm-1p" in lines[1], lines


def _example(compat, *flags):
    p = subprocess.run([sys.executable, "-c", RUN_EXAMPLE, EXAMPLE, "--train-iters", "2", *flags], env=_env(compat),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    found = re.findall(r"iteration\s+\d+/\s*\d+ \| loss (\S+) \|.*\| grad norm (\S+) \|", out)
    assert len(found) == 2 and all(math.isfinite(float(x)) for pair in found for x in pair), out[-4000:]
    return [tuple(map(float, pair)) for pair in found]


def test_example_on_both_generations():
    """One process, fp32: provider and builder under 0.19.2 and the provider under the installed megatron-core print
    the same losses and gradient norms (the same model, data and step; the printed digits are compared)."""
    target = compat_megatron_core()
    installed = _example(None)
    assert _example(target) == installed
    assert _example(target, "--model-builder") == installed


def test_builder_module_names_the_provider_without_megatron_training_models():
    try:
        import megatron.training.models  # noqa: F401
        pytest.skip("megatron.training.models is importable here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="opid_mega.megatron.provider"):
        import opid_mega.megatron.model_builder  # noqa: F401
