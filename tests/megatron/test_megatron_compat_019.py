"""Compatibility of the Megatron backend with megatron-core 0.19.2 (what GPU users run on Python 3.12).

megatron-core 0.19.2 declares Python >= 3.12 but works on 3.11: the README install puts it, without dependencies, in
~/.cache/opid_mega/megatron-core-0.19.2 (tools/install_compat.sh; OPID_COMPAT_DIR names another folder), next to,
not over, the installed megatron-core; it shadows that one through PYTHONPATH in ONE 4-rank launch of the test worker
(TP2xPP2 and PP2 with 2 virtual stages, Qwen2 and Qwen3). Checked under 0.19.2: log-probs, entropy and reference
log-probs equal the float64 HF reference within 1e-5, the HF -> Megatron -> HF round trip is bit-exact, one OPID/PPO
training step equals the same step under the installed megatron-core (0.16.1 in CI; computed in this process at
TP1/PP1), and a distributed-checkpoint resume continues exactly."""
import json
import os

import pytest
import torch

from megatron_testutil import hf_logprobs, launch, make_hf_model, random_sequences
from tolerance import assert_close_scaled

pytestmark = pytest.mark.slow

VERSION = "0.19.2"
CACHE = os.environ.get("OPID_COMPAT_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "opid_mega",
                                                        f"megatron-core-{VERSION}")
ARCHS = ("qwen2", "qwen3")  # untied + QKV bias, tied + q/k norm
LAYOUTS = [[2, 2, None], [1, 2, 2]]
LOSS = dict(clip_low=0.2, clip_high=0.2, dual_clip=3.0, kl_coef=0.1, kl_kind="low_var_kl", entropy_coef=0.01)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_megatron_worker.py")


def _installed(target: str) -> bool:
    return os.path.exists(os.path.join(target, "megatron", "core", "package_info.py")) and \
        os.path.isdir(os.path.join(target, f"megatron_core-{VERSION}.dist-info"))


def compat_megatron_core(target: str = CACHE) -> str:
    """The folder holding megatron-core VERSION, as the README install left it; the test skips (a failure under CI)
    naming the command when it is missing. Nothing is downloaded here."""
    if not _installed(target):
        pytest.skip(f"megatron-core {VERSION} is not in {target}: run `bash tools/install_compat.sh` (part of the "
                    "README install)")
    return target


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _installed_megatron_step(spec: dict) -> dict:
    """The same model and training step under the megatron-core installed in this process (TP1/PP1, one rank)."""
    import megatron.core

    from _megatron_worker import _run_model
    from opid_mega.megatron import parallel
    from opid_mega.megatron.train_step import LossConfig

    out = {"megatron_core_version": megatron.core.__version__}
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        parallel.initialize(1, 1)
        try:
            for m in spec["models"]:
                out[m["arch"]] = _run_model(dict(spec, **m), 1, 1, None, "tp1pp1vpp1", LossConfig(**spec["loss"]))
        finally:
            parallel.destroy_all()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    target = compat_megatron_core()
    root = tmp_path_factory.mktemp("mc019")
    seqs = random_sequences(11, [(9, 3), (14, 5), (6, 1), (11, 4), (8, 2), (13, 6)])
    models, hf, refs = [], {}, {}
    for i, arch in enumerate(ARCHS):
        d = str(root / arch)
        hf[arch] = make_hf_model(arch, d, seed=20 + i)
        refs[arch] = [hf_logprobs(hf[arch], t, k, entropy=True) for t, k in seqs]  # float64 (log-prob, entropy)
        models.append(dict(arch=arch, model=d, base_logprobs=[lp.float().tolist() for lp, _ in refs[arch]]))
    spec = dict(world=4, layouts=LAYOUTS, models=models, sequences=seqs, micro_tokens=24, train=True, lr=1e-4,
                loss=LOSS, steps=2, resume=1, resume_layouts=["tp2pp2vpp1"], out=str(root), timeout_s=240,
                expect_megatron_core=VERSION)
    with open(root / "spec.json", "w") as f:
        json.dump(spec, f)
    with pytest.MonkeyPatch.context() as mp:  # the ranks import megatron-core from `target` first
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (target, os.environ.get("PYTHONPATH")) if p))
        rc, log = launch([WORKER, str(root / "spec.json")], root / "worker.log", timeout=300)
    assert rc == 0, log[-8000:]
    results = torch.load(root / "results.pt", weights_only=False)
    return results, _installed_megatron_step(dict(spec, out=str(root / "installed"))), hf, refs


def test_worker_ranks_ran_megatron_core_0192(run):
    results, installed = run[:2]
    assert results["megatron_core_version"] == VERSION  # every rank also checked its own import
    assert set(results) == {"megatron_core_version", *ARCHS}
    assert all(set(results[a]) == {"tp2pp2vpp1", "tp1pp2vpp2"} for a in ARCHS)
    if installed["megatron_core_version"] == VERSION:
        pytest.skip(f"the installed megatron-core is {VERSION} itself: no second version to compare with")


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_entropy_and_reference_match_hf(run, arch):
    results, _, _, refs = run
    for tag, res in results[arch].items():
        assert len(res["logprobs"]) == len(res["entropy"]) == len(res["ref_logprobs"]) == len(refs[arch]), tag
        for (want_lp, want_ent), lp, ent, ref_lp in zip(refs[arch], res["logprobs"], res["entropy"],
                                                         res["ref_logprobs"]):
            assert lp.shape == want_lp.shape, tag
            assert_close_scaled(lp, want_lp, msg=f"{tag} log-probs")  # fp32 vs float64: 1e-5 of the largest
            assert_close_scaled(ent, want_ent, msg=f"{tag} entropy")
            assert_close_scaled(ref_lp, want_lp, msg=f"{tag} reference log-probs")


@pytest.mark.parametrize("arch", ARCHS)
def test_roundtrip_is_bit_exact(run, arch):
    results, _, hf, _ = run
    want = hf[arch].state_dict()
    if hf[arch].config.tie_word_embeddings:
        want = {k: v for k, v in want.items() if k != "lm_head.weight"}
    for tag, res in results[arch].items():
        assert set(res["export"]) == set(want), tag
        for name, t in want.items():
            assert torch.equal(res["export"][name], t), (tag, name)


@pytest.mark.parametrize("arch", ARCHS)
def test_training_step_equals_installed_megatron_core(run, arch):
    results, installed = run[:2]
    base = installed[arch]
    want = base["metrics"][0]
    assert want["update_ok"] == 1.0 and want["grad_norm"] > 0
    for tag, res in results[arch].items():
        got = res["metrics"][0]
        assert set(got) == set(want), tag
        for key, value in want.items():
            assert_close_scaled(got[key], value, floor=1.0, msg=f"{tag} {key}")  # means of O(1) terms: scale >= 1
        moved = max((base["after_step1"][n] - base["export"][n]).abs().max() for n in base["export"])
        assert moved > 1e-5  # the step changed the weights
        assert set(res["after_step1"]) == set(base["after_step1"]), tag
        # Adam's first step is lr * g / (|g| + eps): a gradient difference δ at fp32 noise level moves a weight whose
        # gradient is near 0 by up to lr * δ / eps (~1e-5 here), so weights are compared at a quarter of a step (the
        # gradients themselves are compared through grad_norm above, relative 1e-5)
        for name, t in base["after_step1"].items():
            assert_close_scaled(res["after_step1"][name], t, rel=0.25, scale=1e-4, msg=f"{tag} {name}")  # lr 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_resume_matches_uninterrupted_run(run, arch):
    res = run[0][arch]["tp2pp2vpp1"]
    assert len(res["metrics"]) == 2 and res["resumed_metrics"] == res["metrics"][1:]
    for name, t in res["final"].items():
        assert torch.equal(res["resumed_final"][name], t), name
