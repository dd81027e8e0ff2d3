"""Ahead-of-time compile of the Triton kernels for real GPUs (sm_80, sm_90) without a GPU.

The interpreter runs the kernels' Python semantics but never the compiler, so this catches what only the compiled
path would reject (typing, constexpr use, tl.dot shapes) and checks shared memory fits A100 / H100-class GPUs.
Runs in a subprocess WITHOUT TRITON_INTERPRET (the conftest sets it for this process).
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
    import opid_mega.kernels.fork_attention_triton as FT
    assert not LT.INTERPRETED and not FT.INTERPRETED
    out = []

    def comp(fn, sig, consts, name, arch, num_warps, num_stages):
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": num_warps, "num_stages": num_stages})
        out.append({"name": name, "arch": arch, "shared": k.metadata.shared, "ptx": "ptx" in k.asm})

    # sm_90 for every dtype; sm_80 only where shared memory is tightest (fp32 tiles, head_dim 128)
    jobs = [(90, "fp32"), (90, "bf16"), (90, "fp16"), (80, "fp32")]
    for arch, dt in jobs:
        tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dt]
        prec = LT._precision(tdt)
        p = {"h_ptr": "*" + dt, "w_ptr": "*" + dt, "tgt_ptr": "*i64"}
        blocks = {"BLOCK_N": LT.BLOCK_N, "BLOCK_V": LT.BLOCK_V, "BLOCK_H": LT.BLOCK_H, "PRECISION": prec,
                  "UPCAST": False}
        sig = dict(p, m_ptr="*fp32", s_ptr="*fp32", u_ptr="*fp32", t_ptr="*fp32", N="i32", V="i32", HD="i32",
                   stride_h="i32", stride_w="i32", v_per_split="i32", temperature="fp32", WITH_ENT="constexpr",
                   SCALED="constexpr")
        sig.update({k: "constexpr" for k in blocks})
        # SCALED: the sampling-temperature path (logits / T), a superset of the T = 1 code
        comp(LT._fwd_partials_kernel, sig, dict(blocks, WITH_ENT=True, SCALED=True), "logprob_fwd_" + dt, arch,
             LT.NUM_WARPS, 3)
        if dt != "fp16":
            sig = dict(p, logz_ptr="*fp32", ent_ptr="*fp32", glp_ptr="*fp32", gent_ptr="*fp32", g_ptr="*" + dt,
                       glo_ptr="*" + dt, N="i32", C="i32", HD="i32", stride_h="i32", stride_w="i32", stride_g="i32", c0="i32",
                       temperature="fp32", HAS_GLP="constexpr", HAS_GENT="constexpr", SCALED="constexpr", SPLIT="constexpr")
            sig.update({k: "constexpr" for k in blocks})
            # SPLIT: the hi + lo half-precision d-logits written for an fp32 main_grad (bf16 weights)
            comp(LT._bwd_grad_logits_kernel, sig, dict(blocks, HAS_GLP=True, HAS_GENT=True, SCALED=True,
                                                       SPLIT=dt != "fp32"),
                 "logprob_bwd_" + dt, arch, LT.NUM_WARPS, 3)
        d = 128
        bm, bn, stages = FT._config(tdt, d)
        sig = {"q_ptr": "*" + dt, "k_ptr": "*" + dt, "v_ptr": "*" + dt, "o_ptr": "*" + dt, "cu_ptr": "*i32",
               "pend_ptr": "*i32", "seg_ptr": "*i32"}
        for s in ("q", "k", "v", "o"):
            sig["stride_%sn" % s] = "i32"
            sig["stride_%sh" % s] = "i32"
        sig.update(HEAD_DIM="i32", GQA_GROUP="i32", qk_scale="fp32", BLOCK_M="constexpr", BLOCK_N="constexpr",
                   BLOCK_D="constexpr", PRECISION="constexpr", UPCAST="constexpr")
        prec = "ieee" if tdt == torch.float32 else "tf32"
        comp(FT._fork_attn_fwd_kernel, sig, {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": d, "PRECISION": prec,
                                              "UPCAST": False}, "fork_attention_%s_d%d" % (dt, d), arch,
             FT.NUM_WARPS, stages)
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
def test_triton_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    results = json.loads(line[len("RESULT "):])
    assert len(results) == 11
    limits = {80: 163 * 1024, 90: 227 * 1024}  # max dynamic shared memory per block
    for r in results:
        assert r["ptx"], r
        assert r["shared"] <= limits[r["arch"]], r
