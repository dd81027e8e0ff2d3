"""OPID's Megatron-LM argument mapping against Megatron-LM's real parser: the flag -> destination table and a
namespace that parser produced are facts in tests/compat/megatron_lm_args.json, read at core_v0.16.1, core_v0.19.0 and
main by tests/compat/read_megatron_lm_args.py (its docstring says how to refresh them)."""
import argparse
import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "compat", "megatron_lm_args.json")
FACTS = json.load(open(FIXTURE))
TAGS = sorted(FACTS)


def _namespace(tag: str, **over) -> argparse.Namespace:
    """The namespace Megatron-LM's parse_args gave at `tag` for the Qwen2.5-7B command line, with overrides."""
    ns = argparse.Namespace(**FACTS[tag]["qwen2_5_7b"]["namespace"])
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


def test_fixture_covers_the_releases_users_run():
    assert {"core_v0.16.1", "core_v0.19.0", "main"} <= set(TAGS)
    for tag in TAGS:
        assert len(FACTS[tag]["commit"]) == 40, tag


@pytest.mark.parametrize("tag", TAGS)
def test_every_flag_is_read_where_megatron_lm_stores_it(tag):
    """Each destination OPID reads is the one Megatron-LM's parser stores the flag in, with Megatron-LM's default."""
    from opid_mega.megatron.megatron_lm import MEGATRON_LM_DEFAULTS, MEGATRON_LM_FLAGS

    flags = FACTS[tag]["flags"]
    for dest, flag in MEGATRON_LM_FLAGS.items():
        assert flags[flag] is not None, f"{flag} is not a Megatron-LM flag at {tag}"
        assert flags[flag]["dest"] == dest, (tag, flag, flags[flag])
        want = MEGATRON_LM_DEFAULTS[dest] if flag != "--disable-bias-linear" else True  # store_false: default True
        assert flags[flag]["default"] == want, (tag, flag, flags[flag])


@pytest.mark.parametrize("tag", TAGS)
def test_our_parser_stores_flags_where_megatron_lm_does(tag):
    """add_megatron_lm_args (the example's parser) gives every flag it declares Megatron-LM's destination."""
    from opid_mega.megatron.megatron_lm import add_megatron_lm_args

    parser = add_megatron_lm_args(argparse.ArgumentParser(add_help=False))
    ours = {o: a.dest for a in parser._actions for o in a.option_strings if o.startswith("--")}
    assert "--norm-epsilon" in ours and "--apply-layernorm-1p" in ours
    for flag, dest in ours.items():
        fact = FACTS[tag]["flags"].get(flag)
        assert fact is not None and fact["dest"] == dest, (tag, flag, dest, fact)


@pytest.mark.parametrize("tag", TAGS)
def test_qwen25_7b_namespace_maps_with_its_epsilon(tag):
    """Megatron-LM's namespace for Qwen2.5-7B flags (layernorm_epsilon=1e-6, no norm_epsilon) -> Qwen2.5-7B's shape
    (its HF config: hidden 3584, 28 layers, 28/4 heads, ffn 18944, rms_norm_eps 1e-6, rope_theta 1e6, QKV bias,
    untied, vocab 152064)."""
    from opid_mega.megatron.megatron_lm import config_from_args

    ns = _namespace(tag)
    assert not hasattr(ns, "norm_epsilon") and ns.layernorm_epsilon == 1e-6
    arch, tc = config_from_args(ns)
    assert arch == dict(model_type="megatron", hidden=3584, ffn=18944, layers=28, heads=28, kv_heads=4, head_dim=128,
                        vocab=152064, eps=1e-6, rope_theta=1e6, qkv_bias=True, qk_norm=False, tied=False,
                        max_pos=32768)
    assert tc.layernorm_epsilon == 1e-6 and tc.tensor_model_parallel_size == 2 and tc.params_dtype == torch.bfloat16


@pytest.mark.parametrize("tag", TAGS)
def test_namespace_builds_a_model_with_its_epsilon(tag, mp1):
    """The same namespace, shrunk to two small layers at TP1 in fp32, builds a model whose every RMSNorm has eps 1e-6
    (the mapping read args.norm_epsilon once, found nothing, and built 1e-5)."""
    from opid_mega.megatron.provider import make_model_provider

    ns = _namespace(tag, num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                    kv_channels=16, vocab_size=256, tensor_model_parallel_size=1, bf16=False)
    model = make_model_provider(ns)(pre_process=True, post_process=True)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 2 * 2 + 1  # two per layer and the final one
    assert all(m.eps == 1e-6 for m in norms), [m.eps for m in norms]


@pytest.mark.parametrize("tag", TAGS)
def test_apply_layernorm_1p_is_refused_in_one_line(tag):
    from opid_mega.megatron.megatron_lm import UnsupportedSettings, config_from_args

    with pytest.raises(UnsupportedSettings) as e:
        config_from_args(_namespace(tag, layernorm_zero_centered_gamma=True))
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and "--apply-layernorm-1p" in lines[1] and "layernorm_zero_centered_gamma" in lines[1]


@pytest.mark.parametrize("name,dest", [("norm_epsilon", "layernorm_epsilon"),
                                       ("apply_layernorm_1p", "layernorm_zero_centered_gamma")])
def test_a_name_megatron_lm_never_stores_is_an_error(name, dest):
    """A hand-made namespace with the flag's spelling would otherwise be ignored silently."""
    from opid_mega.megatron.megatron_lm import UnsupportedSettings, config_from_args

    with pytest.raises(UnsupportedSettings) as e:
        config_from_args(_namespace("core_v0.16.1", **{name: 1e-6}))
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and f"args.{name}" in lines[1] and f"args.{dest}" in lines[1], lines
