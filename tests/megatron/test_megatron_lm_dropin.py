"""Megatron-LM drop-in: the argument adapter, the model_provider, checkpoint interop with a plain megatron-core
GPTModel (local spec, no OPID classes) and the example script."""
import argparse
import dataclasses
import math
import os
import random
import re
import shlex
import subprocess
import sys

import pytest
import torch

from tolerance import assert_close_scaled

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "megatron_lm_opid.py")

# A Llama/Qwen-style Megatron-LM command line (tiny): what a pretrain_gpt.py user passes.
GOOD_FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --group-query-attention "
              "--num-query-groups 2 --kv-channels 16 --vocab-size 1000 --max-position-embeddings 128 "
              "--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-6 "
              "--swiglu --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.05")


def _parse(flags: str) -> argparse.Namespace:
    from opid_mega.megatron.megatron_lm import add_megatron_lm_args

    return add_megatron_lm_args(argparse.ArgumentParser()).parse_args(shlex.split(flags))


def _good(**over) -> argparse.Namespace:
    a = _parse(GOOD_FLAGS)
    for k, v in over.items():
        setattr(a, k, v)
    return a


# ------------------------------------------------------------------ adapter (no process group)
def test_megatron_lm_flags_map_to_arch_and_config():
    from opid_mega.megatron.megatron_lm import config_from_args

    arch, tc = config_from_args(_parse(GOOD_FLAGS + " --add-qkv-bias --qk-layernorm --untie-embeddings-and-output-"
                                       "weights --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"))
    assert arch == dict(model_type="megatron", hidden=64, ffn=96, layers=2, heads=4, kv_heads=2, head_dim=16,
                        vocab=1024,  # Megatron-LM pads 1000 to a multiple of 128 x tp
                        eps=1e-6, rope_theta=500000.0, qkv_bias=True, qk_norm=True, tied=False, max_pos=128)
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size, tc.num_attention_heads, tc.num_query_groups,
            tc.kv_channels) == (2, 64, 96, 4, 2, 16)
    assert tc.normalization == "RMSNorm" and tc.gated_linear_unit and tc.activation_func is torch.nn.functional.silu
    assert tc.add_qkv_bias and tc.qk_layernorm and not tc.add_bias_linear and tc.layernorm_epsilon == 1e-6
    assert tc.tensor_model_parallel_size == 2 and tc.pipeline_model_parallel_size == 2
    assert tc.hidden_dropout == tc.attention_dropout == 0.0 and tc.init_method_std == 0.05
    assert tc.params_dtype == torch.float32 and tc.calculate_per_token_loss


def test_megatron_lm_derived_defaults():
    """Megatron-LM's rules: no GQA flag -> kv heads = heads (num_query_groups ignored), kv_channels = hidden/heads,
    --swiglu ffn default, padded_vocab_size wins over vocab_size, --bf16, virtual stages from layers per stage."""
    from opid_mega.megatron.megatron_lm import arch_from_args, config_from_args

    a = _good(group_query_attention=False, num_query_groups=2, kv_channels=None, ffn_hidden_size=None,
              padded_vocab_size=640)
    arch = arch_from_args(a)
    assert arch["kv_heads"] == 4 and arch["head_dim"] == 16 and arch["ffn"] == int((4 * 64 * 2 / 3) / 64) * 64
    assert arch["vocab"] == 640 and arch["tied"]
    _, tc = config_from_args(_good(bf16=True, num_layers=8, pipeline_model_parallel_size=2,
                                   num_layers_per_virtual_pipeline_stage=2))
    assert tc.params_dtype == torch.bfloat16 and tc.bf16 and tc.virtual_pipeline_model_parallel_size == 2
    _, tc = config_from_args({**vars(_good()), "recompute_granularity": "full", "recompute_method": "uniform",
                              "recompute_num_layers": 1})  # a dict works too
    assert tc.recompute_granularity == "full" and tc.recompute_method == "uniform"


def test_megatron_lm_defaults_are_rejected_in_one_error():
    """Unset flags mean Megatron-LM's defaults (learned positions, LayerNorm, GeLU, biases, dropout 0.1): one error
    lists each with its fix."""
    from opid_mega.megatron.megatron_lm import UnsupportedSettings, arch_from_args

    with pytest.raises(UnsupportedSettings) as e:
        arch_from_args(argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=128))
    msg = str(e.value)
    for flag in ("--position-embedding-type='learned_absolute'", "--normalization='LayerNorm'", "--swiglu=False",
                 "--disable-bias-linear (add_bias_linear)=True", "--hidden-dropout=0.1", "--attention-dropout=0.1"):
        assert flag in msg, (flag, msg)
    assert msg.count("\n") == 6  # a header and one line per problem


BAD = [  # (attribute, value, text the error must contain)
    ("position_embedding_type", "learned_absolute", "--position-embedding-type"),
    ("rotary_percent", 0.5, "--rotary-percent"),
    ("use_rope_scaling", True, "--use-rope-scaling"),
    ("rotary_interleaved", True, "--rotary-interleaved"),
    ("normalization", "LayerNorm", "--normalization"),
    ("layernorm_zero_centered_gamma", True, "--apply-layernorm-1p"),
    ("swiglu", False, "--swiglu"),
    ("squared_relu", True, "--swiglu"),
    ("add_bias_linear", True, "--disable-bias-linear"),
    ("qk_l2_norm", True, "--qk-l2-norm"),
    ("hidden_dropout", 0.1, "--hidden-dropout"),
    ("attention_dropout", 0.05, "--attention-dropout"),
    ("num_experts", 8, "--num-experts"),
    ("mtp_num_layers", 1, "--mtp-num-layers"),
    ("multi_latent_attention", True, "--multi-latent-attention"),
    ("window_size", (128, 0), "--window-size"),
    ("context_parallel_size", 2, "--context-parallel-size"),
    ("expert_model_parallel_size", 2, "--expert-model-parallel-size"),
    ("decoder_first_pipeline_num_layers", 1, "--decoder-first-pipeline-num-layers"),
    ("num_layers", 0, "--num-layers"),
    ("vocab_size", None, "vocabulary size"),
]


@pytest.mark.parametrize("name,value,text", BAD, ids=[b[0] + "=" + str(b[1]) for b in BAD])
def test_each_unsupported_setting_is_named(name, value, text):
    from opid_mega.megatron.megatron_lm import UnsupportedSettings, config_from_args

    with pytest.raises(UnsupportedSettings) as e:
        config_from_args(_good(**{name: value}))
    assert text in str(e.value) and str(e.value).count("\n") == 1, str(e.value)


def test_arch_dict_is_checked():
    from opid_mega.megatron.megatron_lm import arch_from_args
    from opid_mega.megatron.model import arch_of

    a = arch_from_args(_good())
    assert arch_of(a) == a
    with pytest.raises(ValueError, match="lacks rope_theta, qkv_bias"):
        arch_of({k: v for k, v in a.items() if k not in ("rope_theta", "qkv_bias")})
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
        arch_of(dict(a, kv_heads=3))
    with pytest.raises(ValueError, match="ffn=0 must be a positive integer"):
        arch_of(dict(a, ffn=0))


def test_layout_errors_name_the_sizes():
    from opid_mega.megatron.megatron_lm import config_from_args

    with pytest.raises(ValueError, match=r"tp=3 must divide heads \(4\)"):
        config_from_args(_good(tensor_model_parallel_size=3, padded_vocab_size=999))
    with pytest.raises(ValueError, match=r"must divide the number of layers \(2\)"):
        config_from_args(_good(pipeline_model_parallel_size=4))
    with pytest.raises(ValueError, match="num-layers-per-virtual-pipeline-stage"):
        config_from_args(_good(num_layers=6, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2))


def test_adapter_fuzz_valid_and_invalid_combinations():
    """Random Megatron-LM settings: valid ones give the config they describe; a random set of unsupported ones gives
    one error naming every one of them (and nothing else)."""
    from opid_mega.megatron.megatron_lm import UnsupportedSettings, config_from_args

    rng = random.Random(0)
    n_ok = n_bad = 0
    for _ in range(40):
        heads = rng.choice([2, 4, 8])
        kv = rng.choice([d for d in (1, 2, 4, 8) if heads % d == 0])
        tp = rng.choice([d for d in (1, 2) if kv % d == 0])
        pp = rng.choice([1, 2])
        over = dict(num_attention_heads=heads, group_query_attention=True, num_query_groups=kv,
                    kv_channels=rng.choice([8, 16]), hidden_size=heads * 8, num_layers=pp * rng.choice([1, 2]),
                    tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    add_qkv_bias=rng.random() < 0.5, qk_layernorm=rng.random() < 0.5,
                    untie_embeddings_and_output_weights=rng.random() < 0.5, vocab_size=rng.randint(100, 3000))
        bad = rng.sample(BAD[:-2], rng.choice([0, 0, 1, 2, 3]))
        if len([b for b in bad if b[2] == "--swiglu"]) > 1:  # both spoil the MLP (one error line): drop both
            bad = [b for b in bad if b[2] != "--swiglu"]
        args = _good(**over, **{b[0]: b[1] for b in bad})
        if not bad:
            arch, tc = config_from_args(args)
            assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels, tc.num_layers) == \
                (heads, kv, over["kv_channels"], over["num_layers"])
            assert tc.add_qkv_bias == over["add_qkv_bias"] and tc.qk_layernorm == over["qk_layernorm"]
            assert arch["tied"] != over["untie_embeddings_and_output_weights"]
            assert arch["vocab"] % (128 * tp) == 0 and arch["vocab"] - over["vocab_size"] < 128 * tp
            n_ok += 1
        else:
            with pytest.raises(UnsupportedSettings) as e:
                config_from_args(args)
            msg = str(e.value)
            for b in bad:
                assert b[2] in msg, (b, msg)
            assert msg.count("\n") == len(bad), msg
            n_bad += 1
    assert n_ok >= 5 and n_bad >= 5


def _plain_tc(**over):
    """A megatron-core TransformerConfig as Megatron-LM's core_transformer_config_from_args would build it."""
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
              kv_channels=16, normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
              activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True,
              hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.05, use_cpu_initialization=True,
              bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
              persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
              pipeline_dtype=torch.float32)
    if "cuda_graph_scope" in {f.name for f in dataclasses.fields(TransformerConfig)}:
        kw["cuda_graph_scope"] = []  # megatron-core's default warns that it is deprecated
    kw.update(over)
    return TransformerConfig(**kw)


def test_transformer_config_maps_and_is_checked():
    from opid_mega.megatron.megatron_lm import UnsupportedSettings, config_from_transformer_config

    arch, tc = config_from_transformer_config(_plain_tc(), padded_vocab_size=256, max_position_embeddings=64,
                                              rotary_base=10000)
    assert (arch["heads"], arch["kv_heads"], arch["head_dim"], arch["ffn"], arch["eps"], arch["qk_norm"],
            arch["vocab"], arch["tied"]) == (4, 2, 16, 96, 1e-6, True, 256, True)
    assert tc.num_query_groups == 2 and tc.qk_layernorm and tc.init_method_std == 0.05
    with pytest.raises(UnsupportedSettings) as e:
        config_from_transformer_config(
            _plain_tc(gated_linear_unit=False, activation_func=torch.nn.functional.gelu, add_bias_linear=True,
                      hidden_dropout=0.1, normalization="LayerNorm"), padded_vocab_size=256)
    for text in ("--swiglu", "gated_linear_unit=True", "--disable-bias-linear", "--hidden-dropout",
                 "TransformerConfig.normalization"):
        assert text in str(e.value), (text, str(e.value))


def test_model_provider_without_megatron_training_says_how():
    from opid_mega.megatron.provider import model_provider

    try:
        import megatron.training  # noqa: F401
        pytest.skip("megatron.training is installed")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="make_model_provider"):
        model_provider(pre_process=True, post_process=True)


# ------------------------------------------------------------------ provider + checkpoint interop (1 gloo rank)
ARCHS = {  # Qwen3-like (q/k norm, tied) and Qwen2-like (QKV bias, untied)
    "qk_norm_tied": dict(qk_layernorm=True),
    "qkv_bias_untied": dict(add_qkv_bias=True, untie_embeddings_and_output_weights=True),
}


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() == 1 else 0.05))


def _plain_gpt(args, vocab):
    """megatron-core's GPTModel with megatron-core's own local spec: what Megatron-LM's gpt_builder builds
    (--transformer-impl local), its TransformerConfig written out by hand from the Megatron-LM arguments."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tc = _plain_tc(num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
                   num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                   kv_channels=args.kv_channels, layernorm_epsilon=args.layernorm_epsilon,
                   qk_layernorm=args.qk_layernorm,
                   add_qkv_bias=args.add_qkv_bias, init_method_std=0.02)
    return GPTModel(config=tc, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm,
                                                                              normalization="RMSNorm"),
                    vocab_size=vocab, max_sequence_length=args.max_position_embeddings, pre_process=True,
                    post_process=True, parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type="rope", rotary_base=args.rotary_base).float()


def _plain_logprobs(plain, tokens):
    """float32 log p(tokens[:, j] | tokens[:, :j]) from the plain GPTModel's logits under a causal mask."""
    b, s = tokens.shape
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    plain.eval()
    with torch.no_grad():
        logits = plain(tokens, torch.arange(s)[None].expand(b, s), causal)  # [b, s, V]
    logp = torch.log_softmax(logits.float(), -1)
    return logp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]


def _our_logprobs(chunks, tokens):
    from opid_mega.megatron.logprobs import Sample, compute_logprobs

    return torch.stack(compute_logprobs(chunks, [Sample(t.tolist(), 1) for t in tokens]))


def _state(m):
    return {k: v for k, v in m.state_dict().items() if not k.endswith("_extra_state")}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_checkpoint_interop_with_plain_gptmodel(arch, mp1, tmp_path):
    """OPID checkpoint -> plain megatron-core GPTModel (raw dist_checkpointing.load) -> equal weights and equal
    outputs; plain GPTModel saved the Megatron-LM way -> OPID's load_model -> equal outputs; export_megatron_lm and its
    CLI; clear errors."""
    from megatron.core import dist_checkpointing

    from opid_mega.megatron import checkpoint
    from opid_mega.megatron.provider import make_model_provider

    args = _good(**ARCHS[arch], rotary_base=500000)
    provider = make_model_provider(args)
    ours = provider(pre_process=True, post_process=True, config=None, pg_collection=None)  # as get_model calls it
    _perturb(ours, 1)
    plain = _plain_gpt(args, 1024)
    assert sorted(_state(ours)) == sorted(_state(plain))  # same module tree, same names

    # OPID -> plain, with nothing but megatron-core
    checkpoint.save(str(tmp_path / "ours"), 3, [ours], optimizer=None, extra={"trainer_state": "{}"})
    step_dir = str(tmp_path / "ours" / "step_3")
    loaded = dist_checkpointing.load({"model": plain.sharded_state_dict()}, step_dir)
    plain.load_state_dict(loaded["model"])
    for k, v in _state(ours).items():
        assert torch.equal(v, _state(plain)[k]), k
    tokens = torch.randint(0, 1024, (3, 24), generator=torch.Generator().manual_seed(5))
    ref = _plain_logprobs(plain, tokens)
    got = _our_logprobs([ours], tokens)
    assert_close_scaled(got, ref, msg="OPID model vs plain GPTModel")  # two fp32 paths: 1e-5 of the largest
    common = dist_checkpointing.load_common_state_dict(step_dir)
    assert common["iteration"] == 3 and common["checkpoint_version"] == 3.0 and common["step"] == 3

    # plain -> OPID: the plain model trained on (new weights), saved as Megatron-LM saves (iter dir + tracker)
    _perturb(plain, 2)
    mlm = tmp_path / "mlm"
    (mlm / "iter_0000007").mkdir(parents=True)
    dist_checkpointing.save({"model": plain.sharded_state_dict(), "iteration": 7, "checkpoint_version": 3.0},
                            str(mlm / "iter_0000007"))
    (mlm / "latest_checkpointed_iteration.txt").write_text("7")
    fresh = provider(pre_process=True, post_process=True, config=None, pg_collection=None)
    assert checkpoint.load_model(str(mlm), [fresh]).endswith("iter_0000007")
    for k, v in _state(plain).items():
        assert torch.equal(v, _state(fresh)[k]), k
    assert_close_scaled(_our_logprobs([fresh], tokens), _plain_logprobs(plain, tokens), msg="Megatron-LM -> OPID")

    # OPID -> Megatron-LM layout (the converter), read back by megatron-core
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import convert_checkpoint
    finally:
        sys.path.pop(0)
    assert convert_checkpoint.main(["to-megatron-lm", str(tmp_path / "ours"), str(tmp_path / "exported")]) == 0
    exp = tmp_path / "exported"
    assert (exp / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert not (exp / "iter_0000003" / "rng").exists()
    common = dist_checkpointing.load_common_state_dict(str(exp / "iter_0000003"))
    assert common["iteration"] == 3 and common["checkpoint_version"] == 3.0
    checkpoint.load_model(str(exp), [plain])
    assert (_plain_logprobs(plain, tokens) - ref).abs().max() == 0

    # errors name the problem
    assert convert_checkpoint.main(["to-megatron-lm", str(tmp_path / "ours"), str(exp)]) == 2  # exists
    with pytest.raises(FileNotFoundError, match="no distributed checkpoint"):
        checkpoint.load_model(str(tmp_path), [fresh])
    other = make_model_provider(_good(qk_layernorm=not args.qk_layernorm, rotary_base=500000))(
        pre_process=True, post_process=True)
    if other.config.qk_layernorm:  # a model with q/k norms from a checkpoint without them
        with pytest.raises(ValueError, match="lacks .* tensor.*layernorm"):
            checkpoint.load_model(step_dir, [other])
    wider = make_model_provider(_good(**ARCHS[arch], ffn_hidden_size=128))(pre_process=True, post_process=True)
    with pytest.raises(ValueError, match="does not fit the model: .*shape mismatch.*linear_fc"):
        checkpoint.load_model(step_dir, [wider])


def test_provider_checks_process_groups(mp1):
    from opid_mega.megatron.provider import make_model_provider

    with pytest.raises(ValueError, match=r"the arguments say tp=2 pp=1 but the process groups are tp=1 pp=1"):
        make_model_provider(_good(tensor_model_parallel_size=2))(pre_process=True, post_process=True)


def test_provider_takes_megatron_lm_config(mp1):
    """get_model(config=TransformerConfig): the config's shape, the vocabulary etc. from the arguments."""
    from opid_mega.megatron.model import OpidGPTModel
    from opid_mega.megatron.provider import model_provider

    from megatron.core.process_groups_config import ProcessGroupCollection

    m = model_provider(pre_process=True, post_process=False, config=_plain_tc(qk_layernorm=False),
                       pg_collection=ProcessGroupCollection.use_mpu_process_groups(), args=_good(qk_layernorm=True))
    assert isinstance(m, OpidGPTModel) and not m.post_process and not m.config.qk_layernorm
    assert m.embedding.word_embeddings.weight.shape == (1024, 64)


# ------------------------------------------------------------------ the example script
def _run_example(cmd, timeout=600):
    """Run the example; returns its output and [(loss, grad norm)] per iteration (2 iterations, finite)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    found = [(float(a), float(b)) for a, b in
             re.findall(r"iteration\s+\d+/\s*\d+ \| loss (\S+) \|.*\| grad norm (\S+) \|", out)]
    assert len(found) == 2 and all(math.isfinite(x) for pair in found for x in pair), out[-4000:]
    return out, found


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, mp1):
    """The example in one process from initial weights written here (so other layouts can start from the same),
    2 iterations: (output, [(loss, grad norm)], its checkpoint, the initial checkpoint)."""
    from opid_mega.megatron import checkpoint
    from opid_mega.megatron.provider import make_model_provider

    root = tmp_path_factory.mktemp("example")
    model = make_model_provider(_example_module().parse_args([]))(pre_process=True, post_process=True)
    _perturb(model, 7)
    checkpoint.save(str(root / "init"), 0, [model])
    out, found = _run_example([sys.executable, EXAMPLE, "--train-iters", "2", "--load", str(root / "init"),
                               "--save", str(root / "ckpt")])
    return out, found, root / "ckpt", root / "init"


def _example_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("megatron_lm_opid", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_example_refuses_bad_flags_and_layouts_before_starting(monkeypatch, capsys):
    """main() returns 2 with the message (no process group started) for unsupported flags and a layout that does
    not fit the world size (torchrun's WORLD_SIZE)."""
    example = _example_module()
    monkeypatch.setenv("WORLD_SIZE", "3")
    for flags, texts in ((["--normalization", "LayerNorm", "--hidden-dropout", "0.1"],
                          ["--normalization='LayerNorm'", "--hidden-dropout=0.1"]),
                         (["--tensor-model-parallel-size", "2"], ["world size 3 is not divisible by tp*pp*cp"])):
        assert example.main(flags) == 2
        err = capsys.readouterr().err
        assert err.startswith("megatron_lm_opid: ") and all(t in err for t in texts), err


@pytest.mark.slow
def test_example_trains_two_steps(single_run):
    out, found, ckpt, init = single_run
    assert f"loaded model weights from {init}/step_0" in out
    assert out.count("update ok True") == 2 and found[0] != found[1]
    assert (ckpt / "latest_step").read_text().strip() == "2"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["--tensor-model-parallel-size 2 --sequence-parallel",
                                    "--pipeline-model-parallel-size 2"])
def test_example_under_torchrun_and_its_checkpoint_in_a_plain_gptmodel(layout, single_run, mp1, tmp_path):
    """2 ranks (TP2 with sequence parallel, or PP2) train with the single process's losses and gradient norms and
    save; the checkpoint (with the optimizer) loads, resharded to one rank, into a plain GPTModel and into OPID's
    model with equal weights and outputs."""
    from opid_mega.megatron import checkpoint
    from opid_mega.megatron.provider import make_model_provider

    _, found = _run_example([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             str(29500 + random.randint(1, 5000)), EXAMPLE, "--train-iters", "2", *layout.split(),
                             "--load", str(single_run[3]), "--save", str(tmp_path / "ckpt")])
    for (loss, gn), (loss1, gn1) in zip(found, single_run[1]):
        # 2 ranks vs 1: fp32 reductions in another order; the loss is printed as %.6E, the grad norm as %.6f
        assert_close_scaled(loss, loss1, floor=1.0, msg=f"loss {found} vs {single_run[1]}")  # a mean of O(1) terms
        assert_close_scaled(gn, gn1, rel=1e-4, floor=0.1, msg=f"grad norm {found} vs {single_run[1]}")
    args = _example_module().parse_args([])  # the example's tiny model, at TP1 PP1
    plain = _plain_gpt(args, 512)
    ours = make_model_provider(args)(pre_process=True, post_process=True, config=None, pg_collection=None)
    checkpoint.load_model(str(tmp_path / "ckpt"), [plain])
    checkpoint.load_model(str(tmp_path / "ckpt"), [ours])
    for k, v in _state(plain).items():
        assert torch.equal(v, _state(ours)[k]), k
    tokens = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(3))
    assert_close_scaled(_our_logprobs([ours], tokens), _plain_logprobs(plain, tokens), msg="resharded checkpoint")
