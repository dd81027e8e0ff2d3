"""opid-export: a Hugging Face model directory from a run checkpoint saved at TP2 x PP2 (model weights only), and
opid-eval --checkpoint through the same model-only path (no optimizer, no Policy)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tolerance import assert_close_scaled

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_export_worker.py")
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
STEPS = (3, 5)


def _seqs(vocab: int):
    g = torch.Generator().manual_seed(11)
    return [[torch.randint(0, vocab, (n,), generator=g).tolist(), k] for n, k in ((40, 5), (23, 1), (64, 30))]


@pytest.fixture(scope="module")
def tp2pp2_run(tmp_path_factory):
    """A run directory whose checkpoints step_3 and step_5 were saved by the trainer's Policy at TP2 x PP2 (4 gloo
    ranks; model + Adam state + RNG), with the trainer's log-probs and HF tensors of each step."""
    from transformers import AutoConfig

    from opid_mega.models import prepare_model

    hf_dir = prepare_model("tiny-qwen3")
    base = tmp_path_factory.mktemp("export")
    run = base / "run"
    seqs = _seqs(AutoConfig.from_pretrained(hf_dir).vocab_size)
    spec = {"hf_dir": hf_dir, "run_dir": str(run), "tp": 2, "pp": 2, "steps": list(STEPS), "seqs": seqs,
            "ref": str(base / "ref_step")}
    (base / "spec.json").write_text(json.dumps(spec))
    r = subprocess.run([sys.executable, str(WORKER), str(base / "spec.json")], env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    refs = {s: torch.load(base / f"ref_step{s}.pt", weights_only=True) for s in STEPS}
    return run, seqs, refs, base


def _safetensors(out: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(out.glob("*.safetensors"))
    assert [f.name for f in files] == ["model.safetensors"]
    return load_file(str(files[0]))


def _hf_logprobs(out: Path, seqs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    res = []
    with torch.no_grad():
        for tokens, k in seqs:
            logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)
            res.append(logp[torch.arange(k - 1, len(tokens) - 1), torch.tensor(tokens[k:])])
    return res


@pytest.mark.slow
def test_export_tp2pp2_checkpoint_matches_the_trainer(tp2pp2_run, capsys):
    """Latest checkpoint (step_5), fp32: the exported tensors are the trainer's model exactly, and transformers'
    fp32 log-probs on the same tokens equal the trainer's TP2 x PP2 Policy.logprobs within 1e-5 of their magnitude.
    --step 3 exports that checkpoint's weights; the tokenizer and generation config come along."""
    from transformers import AutoTokenizer

    from opid_mega import export

    run, seqs, refs, base = tp2pp2_run
    out = base / "hf"
    assert export.main([str(run), str(out), "--dtype", "fp32"]) == 0
    assert "step_5" in capsys.readouterr().out
    assert not (base / "hf.tmp").exists()
    got = _safetensors(out)
    assert set(got) == set(refs[5]["hf"]) and "lm_head.weight" not in got  # tied embeddings
    for name, t in refs[5]["hf"].items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], t), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32" and cfg["model_type"] == "qwen3"
    assert json.loads((out / "opid_export.json").read_text())["step"] == 5
    assert (out / "generation_config.json").is_file() and not list(out.glob(".*"))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.decode(tok("go north").input_ids) == "go north"
    lps = _hf_logprobs(out, seqs)
    for i, (a, e) in enumerate(zip(lps, refs[5]["logprobs"])):
        assert a.shape == e.shape and e.numel() > 0
        assert_close_scaled(a, e, rel=1e-5, msg=f"sequence {i}")
    # an earlier step on request; an existing OUT_DIR only with --force
    assert export.main([str(run), str(out), "--step", "3"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert export.main([str(run), str(out), "--step", "3", "--force"]) == 0
    got3 = _safetensors(out)
    assert all(torch.equal(got3[n], t) for n, t in refs[3]["hf"].items())
    assert not any(torch.equal(got3[n], refs[5]["hf"][n]) for n in got3)


@pytest.mark.slow
def test_export_bf16(tp2pp2_run):
    """--dtype bf16 (console script): bf16 tensors (the trainer's rounded), config dtype bfloat16, loadable."""
    from transformers import AutoModelForCausalLM

    run, seqs, refs, base = tp2pp2_run
    out = base / "hf_bf16"
    r = subprocess.run(["opid-export", str(run), str(out), "--dtype", "bf16"], env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = _safetensors(out)
    for name, t in refs[5]["hf"].items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16)), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.model.embed_tokens.weight, got["model.embed_tokens.weight"])


@pytest.mark.slow
def test_eval_checkpoint_builds_no_optimizer(tp2pp2_run, monkeypatch, capsys):
    """opid-eval --checkpoint RUN_DIR: the checkpoint's weights reach the rollout engine through the model-only
    export; neither the trainer's Policy nor megatron's optimizer is ever built."""
    from opid_mega import cli
    from opid_mega.megatron import policy, train_step
    from opid_mega.rollout import launch

    def refuse(*a, **k):
        raise AssertionError("opid-eval --checkpoint built the training state")

    monkeypatch.setattr(policy.Policy, "__init__", refuse)
    monkeypatch.setattr(train_step, "build_optimizer", refuse)
    import megatron.core.optimizer as mco

    monkeypatch.setattr(mco, "get_megatron_optimizer", refuse)
    engines = []
    real = launch.build_engine

    def capture(cfg, hf_dir, *a, **k):
        engines.append(real(cfg, hf_dir, *a, **k))
        return engines[-1]

    monkeypatch.setattr(launch, "build_engine", capture)
    run, _, refs, _ = tp2pp2_run
    rc = cli.eval_main(["--config", str(ROOT / "configs" / "tiny_cpu.yaml"), "--checkpoint", str(run),
                        "eval.num_tasks=1", "env.max_steps=1", "rollout.max_response_tokens=4",
                        "logging.progress=false"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["episodes"] == 1 and res["failed_episodes"] == 0
    state = engines[0].model.state_dict()
    for name, t in refs[5]["hf"].items():
        assert torch.equal(state[name].float(), t), name


def _config_only_run(path: Path) -> Path:
    from opid_mega import rundir
    from opid_mega.config import load_config

    path.mkdir()
    rundir.write_config(path, load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), ["model.init_from="]))
    return path


@pytest.mark.parametrize("case", ["missing", "file", "no_config", "bad_config", "no_checkpoint", "incomplete",
                                  "bad_step", "incomplete_step"])
def test_export_errors_are_one_line(tmp_path, capsys, case):
    """Bad input: one line on stderr naming the problem, exit status 2, nothing written."""
    from opid_mega import export

    run = tmp_path / "run"
    step = []
    if case == "file":
        run.write_text("x")
    elif case == "no_config":
        run.mkdir()
    elif case == "bad_config":
        run.mkdir()
        (run / "config.yaml").write_text("model: [unclosed\n")
    elif case != "missing":
        _config_only_run(run)
        if case in ("incomplete", "bad_step", "incomplete_step"):
            (run / "checkpoints" / "step_2").mkdir(parents=True)  # a save killed before its metadata
            (run / "checkpoints" / "latest_step").write_text("2")
        step = {"bad_step": ["--step", "7"], "incomplete_step": ["--step", "2"]}.get(case, [])
    out = tmp_path / "out"
    assert export.main([str(run), str(out), *step]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opid-export: ") and len(err.splitlines()) == 1, err
    expect = {"missing": "does not exist", "file": "not a directory", "no_config": "no config.yaml",
              "bad_config": "not valid YAML", "no_checkpoint": "no checkpoint in",
              "incomplete": "step_2 (no metadata.json)", "bad_step": "no checkpoint step_7",
              "incomplete_step": "incomplete (no metadata.json)"}[case]
    assert expect in err, err
    assert not out.exists() and not (tmp_path / "out.tmp").exists()


def test_export_refuses_to_replace_the_run_dir(tmp_path, capsys):
    from opid_mega import export

    run = _config_only_run(tmp_path / "run")
    (run / "checkpoints").mkdir()
    for out in (run, tmp_path):
        assert export.main([str(run), str(out), "--force"]) == 2
        assert "is or holds the run directory" in capsys.readouterr().err
    assert (run / "config.yaml").is_file() and (run / "checkpoints").is_dir()
