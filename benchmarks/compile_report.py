"""Compile the Triton kernels for sm_90 on any machine (no GPU needed) and report resources.

Prints registers, stack frame (spills show up as STACK / LOCAL) and shared memory per
configuration, read with the cuobjdump that ships inside Triton's package.
"""
import argparse
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from quilt_attn.ops.sparse_attention import _sparse_attention_kernel
from quilt_attn.planner.triton_plan import _plan_kernel

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    return [ln.strip() for ln in out.splitlines() if "REG:" in ln][0]


def compile_kernel(fn, ptrs, scalars, constexprs, num_warps, num_stages=2):
    sig = {n: "*i32" for n in fn.arg_names}
    sig.update({"masks_ptr": "*i16", "lvl_ptr": "*i8"} if fn is _plan_kernel else {})
    sig.update(ptrs)
    sig.update(scalars)
    sig.update({k: "constexpr" for k in constexprs})
    # as the JIT specializes them at run time: pointers and strides divisible by 16
    div = [n for n in fn.arg_names if n.endswith("_ptr") or n.startswith("stride_")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=TARGET,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def attention(G, QP, HB, fp8, num_warps, num_stages, dvs=512, from_plan=True):
    ptrs = {"q_ptr": "*bf16", "kv_ptr": "*u8" if fp8 else "*bf16", "kv_f32_ptr": "*fp32", "kv_b16_ptr": "*bf16",
            "sink_ptr": "*fp32", "out_ptr": "*bf16", "maxl_ptr": "*fp32", "lse_ptr": "*fp32"}
    scalars = {n: "i32" for n in ["s_q", "s_kv", "h", "topk", "prog_cap", "stride_qs", "stride_qh", "stride_kv",
                                  "stride_idx", "stride_os", "stride_oh"]}
    scalars["sm_scale2"] = "fp32"
    cx = dict(FROM_PLAN=from_plan, HAS_LEN=False, HAS_SINK=False, FP8=fp8, G=G, QP=QP, HB=HB, BT=64, DV=512,
              DR=64, DVS=dvs)
    return compile_kernel(_sparse_attention_kernel, ptrs, scalars, cx, num_warps, num_stages)


def planner(G, M, num_warps):
    scalars = {n: "i32" for n in ["s_q", "s_kv", "topk", "n_groups", "cap"]}
    scalars["thr"] = "fp32"
    cx = dict(G=G, M=M, T=64, KP=2048, NTP=512, HAS_LEN=False, MASKS_GIVEN=False, ICLIP=False, SPLIT=True)
    return compile_kernel(_plan_kernel, {}, scalars, cx, num_warps)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--what", default="attention,planner")
    a = p.parse_args()
    if "planner" in a.what:
        for G, M in [(8, 4), (8, 1)]:
            for w in (4, 8, 16):
                print(f"planner G={G} M={M} warps={w}: {resources(planner(G, M, w))}", flush=True)
    if "attention" in a.what:
        for (G, QP, HB) in [(8, 4, 16), (8, 8, 8), (8, 8, 16), (1, 1, 64), (1, 1, 16)]:
            for fp8 in (False, True):
                for w, s in ([(8, 2), (8, 3), (16, 2)] if QP * HB <= 64 else [(16, 2), (16, 1)]):
                  for dvs in (512, 256):
                    try:
                        r = resources(attention(G, QP, HB, fp8, w, s, dvs=dvs, from_plan=G > 1))
                    except Exception as e:  # report, keep going
                        r = f"FAILED {type(e).__name__}: {str(e)[:120]}"
                    print(f"attention G={G} QP={QP} HB={HB} fp8={fp8} warps={w} stages={s} dvs={dvs}: {r}", flush=True)
