"""opid-train checks the model directory, its tokenizer and the env's data (ALFWorld games, a WebShop server, the
Search-QA corpus) before any model is built: one line each on stderr, exit 2, nothing built and nothing written."""
import json
import os
import socket

import pytest
import yaml

from opid_mega.cli import train_main
from opid_mega.config import load_config

ROOT = os.path.join(os.path.dirname(__file__), "..")
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
PAPER_SEARCH = ["qwen2.5-3b_search_qa", "qwen2.5-7b_search_qa", "qwen3-1.7b_search_qa"]


@pytest.fixture
def builds(monkeypatch, capsys):
    """Every attempt to build or load a model (the trainer, a built-in model's build, the opid-sft warm start)."""
    import opid_mega.models
    import opid_mega.sft
    import opid_mega.trainer

    calls = []
    monkeypatch.setattr(opid_mega.trainer, "train", lambda *a, **k: calls.append("trainer"))
    monkeypatch.setattr(opid_mega.models, "prepare_model", lambda *a, **k: calls.append("prepare_model"))
    monkeypatch.setattr(opid_mega.sft, "ensure_sft", lambda *a, **k: calls.append("ensure_sft"))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    capsys.readouterr()  # what the imports printed is not opid-train's output
    return calls


def _config(tmp_path, env: dict, **model) -> str:
    """tiny_cpu.yaml with another env section (and model keys), written to tmp_path."""
    with open(TINY) as f:
        cfg = yaml.safe_load(f)
    cfg["env"] = {**{k: v for k, v in cfg["env"].items() if k != "options"}, **env}
    cfg["model"].update(model)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _start(capsys, config, run_dir, *overrides) -> tuple:
    rc = train_main(["--config", config, "--run-dir", str(run_dir), *overrides])
    return rc, capsys.readouterr().err.strip().splitlines()


def _refused(rc, lines, builds, run_dir, *want):
    assert rc == 2 and len(lines) == 1, lines
    for w in want:
        assert w in lines[0], lines
    assert builds == []  # refused before any model was built or loaded
    assert not run_dir.exists()  # and before anything was written


def _fake_model(d, tokenizer=True):
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                               "num_hidden_layers": 2, "vocab_size": 1024, "hidden_size": 128,
                                               "intermediate_size": 256}))
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return d


def test_missing_model_directory(tmp_path, capsys, builds):
    run = tmp_path / "run"
    rc, lines = _start(capsys, TINY, run, f"model.path={tmp_path / 'nope'}", "model.init_from=")
    _refused(rc, lines, builds, run, f"opid-train: model.path={tmp_path / 'nope'}: no such directory on this node "
                                     f"({socket.gethostname()})")
    # model.init_from naming a directory is checked the same way
    rc, lines = _start(capsys, TINY, run, f"model.init_from={tmp_path / 'gone'}")
    _refused(rc, lines, builds, run, f"opid-train: model.init_from={tmp_path / 'gone'}: no such directory")


def test_missing_config_json_and_missing_tokenizer(tmp_path, capsys, builds):
    run = tmp_path / "run"
    (tmp_path / "empty").mkdir()
    rc, lines = _start(capsys, TINY, run, f"model.path={tmp_path / 'empty'}", "model.init_from=")
    _refused(rc, lines, builds, run, "no config.json there (not a Hugging Face model directory)")
    m = _fake_model(tmp_path / "m", tokenizer=False)
    rc, lines = _start(capsys, TINY, run, f"model.path={m}", "model.init_from=")
    _refused(rc, lines, builds, run, f"opid-train: model.path={m}: no tokenizer there (none of tokenizer.json")


def test_missing_alfworld_data(tmp_path, capsys, builds):
    run, data = tmp_path / "run", tmp_path / "alfworld"
    (data / "json_2.1.1" / "train").mkdir(parents=True)  # an empty download
    cfg = _config(tmp_path, {"name": "alfworld", "options": {"data_path": str(data)}, "train_split": "train",
                             "eval_split": "valid_seen"}, init_from="")
    rc, lines = _start(capsys, cfg, run)
    _refused(rc, lines, builds, run, f"opid-train: alfworld: no ALFWorld games under {data}/json_2.1.1/train "
                                     "(split train;", "alfworld-download", "env.options.source=generated")


def test_webshop_server_unreachable(tmp_path, capsys, builds):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    cfg = _config(tmp_path, {"name": "webshop", "options": {"url": f"http://127.0.0.1:{port}"}, "max_steps": 5},
                  init_from="")
    rc, lines = _start(capsys, cfg, run)
    _refused(rc, lines, builds, run, f"opid-train: webshop: no WebShop server answers at http://127.0.0.1:{port} "
                                     "(ConnectionError)", "env.options.url")


def test_missing_search_corpus(tmp_path, capsys, builds):
    run = tmp_path / "run"
    cfg = _config(tmp_path, {"name": "search_qa", "options": {"corpus_path": str(tmp_path / "wiki.jsonl")},
                             "max_steps": 4}, init_from="")
    rc, lines = _start(capsys, cfg, run)
    _refused(rc, lines, builds, run, f"opid-train: search_qa: env.options.corpus_path={tmp_path / 'wiki.jsonl'}: "
                                     "no such file on this node")


@pytest.mark.parametrize("name", PAPER_SEARCH)
def test_paper_search_configs_name_their_corpus(name):
    """A paper Search-QA config names its corpus and questions: it never trains on the bundled country-facts set."""
    env = load_config(os.path.join(ROOT, "configs", f"{name}.yaml")).env
    assert env.options["corpus_path"] == "~/data/search_r1/wiki-18.jsonl"
    assert env.options["qa_path"] == "~/data/search_r1/nq_hotpotqa.jsonl"


def test_paper_search_config_without_its_corpus_stops(tmp_path, capsys, builds, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # ~/data/search_r1/... is not there
    m, run = _fake_model(tmp_path / "model"), tmp_path / "run"
    rc, lines = _start(capsys, os.path.join(ROOT, "configs", "qwen2.5-3b_search_qa.yaml"), run,
                       f"model.path={m}", "parallel.backend=gloo")
    _refused(rc, lines, builds, run, f"opid-train: search_qa: env.options.corpus_path={tmp_path}/data/search_r1/"
                                     "wiki-18.jsonl: no such file on this node")


def test_shipped_warm_start_resolves_and_an_unknown_one_is_one_line(tmp_path, capsys, builds):
    """model.init_from=shipped:NAME names a warm start shipped with the package (weights, config, tokenizer); an
    unknown NAME stops the start with one line naming the shipped ones."""
    from opid_mega.models import resolve_model_path
    from opid_mega.warm_starts import shipped_model

    d = resolve_model_path("shipped:footprints")
    assert d == shipped_model("footprints")
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(d, f)), f
    with pytest.raises(FileNotFoundError, match="shipped:footprints"):
        shipped_model("nope")
    with pytest.raises(FileNotFoundError, match="no warm start of that name"):
        shipped_model("../footprints")
    run = tmp_path / "run"
    rc, lines = _start(capsys, TINY, run, "model.init_from=shipped:nope")
    _refused(rc, lines, builds, run, "opid-train: model.init_from=shipped:nope: no warm start of that name is "
                                     "shipped (shipped: shipped:footprints)")


def test_shipped_footprints_warm_start_is_the_mechanism_experiments():
    """The main job starts from the committed warm start of the mechanism experiment v3 (same weight bytes)."""
    import sys

    from opid_mega.warm_starts import shipped_model

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import mechanism

    prereg = json.load(open(os.path.join(ROOT, "docs", "mechanism_v3", "prereg.json")))
    assert mechanism.weights_hash(shipped_model("footprints")) == prereg["warm_start"]["weights_sha256_16"]
