"""One rank (gloo, CPU or one GPU) under Megatron-LM >= core_v0.19.0 (megatron-core's wheel ships megatron.training):
Megatron-LM's own parser and gpt_config_from_args make an OpidGPTModelConfig, its builder builds the model as
pretrain() does (build_distributed_models), and the result is compared with the model_provider path.

    python _model_builder_worker.py OUT.json

On Python 3.11 (megatron-core 0.19 declares 3.12), typing.override comes from typing_extensions."""
import json
import shlex
import sys
import typing
import warnings

if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override
warnings.filterwarnings("ignore")

import torch  # noqa: E402

# a tiny Qwen2-style model with Megatron-LM's flags (local layers, fusions off: no Transformer Engine here)
FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --kv-channels 16 --vocab-size 1000 --max-position-embeddings 128 --seq-length 64 "
         "--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-6 "
         "--swiglu --disable-bias-linear --add-qkv-bias --untie-embeddings-and-output-weights --hidden-dropout 0 "
         "--attention-dropout 0 --micro-batch-size 1 --transformer-impl local --use-cpu-initialization "
         "--tokenizer-type NullTokenizer --no-rope-fusion --no-bias-swiglu-fusion --no-masked-softmax-fusion "
         "--no-bias-dropout-fusion --no-gradient-accumulation-fusion --no-persist-layer-norm")


def megatron_lm_args(extra: str = ""):
    from megatron.training.arguments import parse_args

    sys.argv = ["pretrain_gpt.py"] + shlex.split(FLAGS + " " + extra)
    args = parse_args()
    args.params_dtype = torch.float32  # validate_args sets it (and needs CUDA)
    return args


def main() -> int:
    out_path = sys.argv[1]
    import megatron.core
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args

    from opid_mega.megatron import parallel
    from opid_mega.megatron.logprobs import Sample, compute_logprobs
    from opid_mega.megatron.megatron_lm import UnsupportedSettings
    from opid_mega.megatron.model_builder import OpidGPTModelBuilder, OpidGPTModelConfig
    from opid_mega.megatron.provider import make_model_provider

    res = dict(megatron_core_version=megatron.core.__version__)
    args = megatron_lm_args()
    res["args_layernorm_epsilon"] = args.layernorm_epsilon
    res["args_has_norm_epsilon"] = hasattr(args, "norm_epsilon")
    cfg = gpt_config_from_args(args, model_config_cls=OpidGPTModelConfig)  # the one line changed in pretrain_gpt.py
    res["builder_cls"] = cfg.get_builder_cls().__name__
    parallel.initialize(1, 1, seed=1234)
    try:
        pg = ProcessGroupCollection.use_mpu_process_groups()
        built = cfg.get_builder_cls()(cfg).build_distributed_models(pg, wrap_with_ddp=False)  # as pretrain() calls it
        res["chunks"] = len(built)
        model = built[0]
        res["model_cls"] = type(model).__name__
        res["eps"] = sorted({m.eps for m in model.modules() if isinstance(m, torch.nn.RMSNorm)})
        res["vocab"] = int(model.embedding.word_embeddings.weight.shape[0])
        res["tied"] = bool(model.share_embeddings_and_output_weights)
        provided = make_model_provider(args)(pre_process=True, post_process=True)
        res["same_parameter_names"] = sorted(n for n, _ in model.named_parameters()) == \
            sorted(n for n, _ in provided.named_parameters())
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        provided.load_state_dict(model.state_dict())
        samples = [Sample(torch.randint(0, 1000, (n,), generator=g).tolist(), s) for n, s in ((9, 3), (14, 5))]
        a = compute_logprobs([model], samples)
        b = compute_logprobs([provided], samples)
        res["logprobs_equal"] = all(torch.equal(x, y) for x, y in zip(a, b))
        res["logprobs_finite"] = all(bool(torch.isfinite(x).all()) for x in a)
        try:  # --apply-layernorm-1p, parsed by Megatron-LM into layernorm_zero_centered_gamma
            bad = gpt_config_from_args(megatron_lm_args("--apply-layernorm-1p"), model_config_cls=OpidGPTModelConfig)
            OpidGPTModelBuilder(bad).build_model(pg)
            res["layernorm_1p_error"] = None
        except UnsupportedSettings as e:
            res["layernorm_1p_error"] = str(e)
    finally:
        parallel.destroy_all()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
