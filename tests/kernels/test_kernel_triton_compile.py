"""Ahead-of-time compile of every Triton kernel for real GPUs (sm_80, sm_90) without a GPU.

The interpreter runs the kernels' Python semantics but never the compiler, so this catches what only the compiled
path would reject (typing, constexpr use, tl.dot shapes) and checks shared memory against A100 / H100-class GPUs: the
epilogues at their largest autotuning tile (they stage no operands in shared memory), fork attention at every
configuration its autotuner keeps for bf16 and fp32. Runs in a subprocess WITHOUT TRITON_INTERPRET (the conftest sets
it for this process).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(r"""
    import json, warnings
    warnings.simplefilter("ignore")
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import opid_mega.kernels.logprob_triton as LT
    import opid_mega.kernels.dual_context_divergence_triton as DT
    import opid_mega.kernels.fork_attention_triton as FT
    assert not (LT.INTERPRETED or DT.INTERPRETED or FT.INTERPRETED)
    out = []

    def comp(fn, sig, consts, name, arch, num_warps, num_stages):
        sig = dict(sig, **{k: "constexpr" for k in consts})
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": num_warps, "num_stages": num_stages})
        kernel, dtype, config = name.split(" ")
        out.append({"kernel": kernel, "dtype": dtype, "config": config, "arch": arch, "shared": k.metadata.shared,
                    "ptx": "ptx" in k.asm})

    # the epilogues: every flag on (temperature, entropy / both KLs, hi + lo halves), the largest tile
    n, v, w, st = max(LT.CONFIGS, key=lambda c: (c[0] * c[1], c[3]))
    for arch, dt in ((90, "bf16"), (80, "fp32")):
        tiles = {"BLOCK_N": n, "BLOCK_V": v}
        stats = {"x_ptr": "*fp32", "tgt_ptr": "*i64", "part_ptr": "*fp32", "N": "i32", "C": "i32",
                 "stride_x": "i32", "c0": "i32", "slot0": "i32", "plane": "i32", "temperature": "fp32",
                 "ROWS_BUCKET": "i32"}
        comp(LT._stats_kernel, stats, dict(tiles, SPLIT=LT.SPLIT, WITH_ENT=True, SCALED=True),
             f"logprob_stats {dt} {n}x{v}", arch, w, st)
        comp(DT._stats_kernel, stats, dict(tiles, SPLIT=DT.SPLIT, SCALED=True), f"divergence_stats {dt} {n}x{v}",
             arch, w, st)
        grad = {"x_ptr": "*fp32", "tgt_ptr": "*i64", "logz_ptr": "*fp32", "ent_ptr": "*fp32", "glp_ptr": "*fp32",
                "gent_ptr": "*fp32", "g_ptr": "*" + dt, "glo_ptr": "*" + dt, "N": "i32", "C": "i32",
                "stride_x": "i32", "stride_g": "i32", "c0": "i32", "temperature": "fp32", "ROWS_BUCKET": "i32"}
        comp(LT._grad_kernel, grad, dict(tiles, HAS_GLP=True, HAS_GENT=True, SCALED=True, HI_LO=dt != "fp32"),
             f"logprob_grad {dt} {n}x{v}", arch, w, st)
        grad = {"x_ptr": "*fp32", "tgt_ptr": "*i64", "lses_ptr": "*fp32", "lseo_ptr": "*fp32", "klr_ptr": "*fp32",
                "glo_ptr": "*fp32", "gkf_ptr": "*fp32", "gkr_ptr": "*fp32", "g_ptr": "*" + dt,
                "glow_ptr": "*" + dt, "N": "i32", "C": "i32", "stride_x": "i32", "b_row0": "i32",
                "stride_g": "i32", "c0": "i32", "temperature": "fp32", "ROWS_BUCKET": "i32"}
        comp(DT._grad_kernel, grad, dict(tiles, HAS_GLO=True, HAS_GKF=True, HAS_GKR=True, NEED_S=True,
                                         SCALED=True, HI_LO=dt != "fp32"), f"divergence_grad {dt} {n}x{v}", arch,
             w, st)

    # fork attention: every configuration the autotuner keeps for the dtype (head_dim 128), sm_90; sm_80 for fp32,
    # where shared memory is tightest
    class Arg:
        def __init__(self, dtype):
            self.dtype = dtype

    for arch, dt in ((90, "fp32"), (90, "bf16"), (80, "fp32")):
        tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dt]
        sig = {"q_ptr": "*" + dt, "k_ptr": "*" + dt, "v_ptr": "*" + dt, "o_ptr": "*" + dt, "cu_ptr": "*i32",
               "pend_ptr": "*i32", "seg_ptr": "*i32"}
        for s in ("q", "k", "v", "o"):
            sig["stride_%sn" % s] = "i32"
            sig["stride_%sh" % s] = "i32"
        sig.update(HEAD_DIM="i32", GQA_GROUP="i32", qk_scale="fp32", SEQ_BUCKET="i32")
        prec = "ieee" if tdt == torch.float32 else "tf32"
        for cfg in FT._prune(FT._configs(), {"q_ptr": Arg(tdt), "HEAD_DIM": 128}):
            bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
            comp(FT._fork_attn_fwd_kernel, sig, {"BLOCK_D": 128, "PRECISION": prec, "UPCAST": False, "BLOCK_M": bm,
                                                 "BLOCK_N": bn},
                 f"fork_attention {dt} d128_{bm}x{bn}_w{cfg.num_warps}_s{cfg.num_stages}", arch, cfg.num_warps,
                 cfg.num_stages)
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
def test_every_triton_kernel_and_configuration_compiles_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    results = json.loads(line[len("RESULT "):])
    assert {r["kernel"] for r in results} == {"logprob_stats", "logprob_grad", "divergence_stats", "divergence_grad",
                                              "fork_attention"}
    assert {(r["dtype"], r["arch"]) for r in results if r["kernel"] == "fork_attention"} == {
        ("fp32", 90), ("bf16", 90), ("fp32", 80)}
    limits = {80: 163 * 1024, 90: 227 * 1024}  # max dynamic shared memory per block
    for r in results:
        assert r["ptx"], r
        assert r["shared"] <= limits[r["arch"]], r
