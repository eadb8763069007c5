"""The Triton attention kernel's PTX for a few configurations, compiled for sm_90 without a GPU (CPU tool).

Prints each configuration's instruction count and a hash of its instruction stream with virtual registers and
labels renamed, so that two trees can be compared: equal hashes mean the same code whatever the source's shape
(a refactor), and a count says what a change adds. ``--root`` picks the tree (a checkout, e.g. a
``git worktree``); ``--flag-nan`` compiles the final-output configurations with the repair queue's NaN test.

    python benchmarks/run.py triton-ptx [--root DIR] [--flag-nan]
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys

CONFIGS = {
    "query programs, h 16": dict(FROM_PLAN=False, HAS_LEN=True, HAS_SINK=True, FP8=False, HAS_INIT=False,
                                 PARTIAL=False, PACKED=False, G=1, QP=1, HB=16),
    "plan tiles, h 16, partial": dict(FROM_PLAN=True, HAS_LEN=False, HAS_SINK=False, FP8=False, HAS_INIT=False,
                                      PARTIAL=True, PACKED=True, G=4, QP=4, HB=16),
    "plan tiles, h 16, final": dict(FROM_PLAN=True, HAS_LEN=False, HAS_SINK=True, FP8=False, HAS_INIT=False,
                                    PARTIAL=False, PACKED=True, G=4, QP=4, HB=16),
}
F32_PTRS = ("kv_f32_ptr", "maxl_ptr", "lse_ptr", "init_m_ptr", "init_lse_ptr", "sink_ptr")
BF16_PTRS = ("q_ptr", "kv_ptr", "kv_b16_ptr", "out_ptr", "init_o_ptr")


def instructions(ptx: str) -> list[str]:
    """The PTX instruction lines, virtual registers and labels renamed."""
    t = re.sub(r"%(r|rd|p|f|rs|h|hh|b)\d+", r"%\1", ptx)
    t = re.sub(r"\$L__\w+", "L", t)
    t = re.sub(r"\w+_param_\d+", "P", t)
    return [x.strip() for x in t.splitlines()
            if x.strip().endswith(";") and not x.strip().startswith(".") and "ld.param" not in x]


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=None, help="the tree whose quilt_attn is compiled (default: this one)")
    p.add_argument("--flag-nan", action="store_true")
    a = p.parse_args(argv)
    if a.root:
        sys.path.insert(0, a.root)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import quilt_attn.ops.sparse_attention as sa

    fn = sa._sparse_attention_kernel
    print(f"tree: {sa.__file__}")
    for label, cfg in CONFIGS.items():
        const = dict(cfg, BT=64, DV=512, DR=64, DVS=512, SKIP_KV=False)
        if "FLAG_NAN" in fn.arg_names:
            const.update(FLAG_NAN=a.flag_nan and not cfg["PARTIAL"], REPAIR=False)
        sig = {}
        for i, n in enumerate(fn.arg_names):
            if fn.params[i].is_constexpr:
                sig[n] = "constexpr"
            elif n.endswith("_ptr"):
                sig[n] = "*fp32" if n in F32_PTRS else "*bf16" if n in BF16_PTRS else "*i32"
            else:
                sig[n] = "fp32" if n == "sm_scale2" else "i32"
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=4, num_stages=2))
        ins = instructions(k.asm["ptx"])
        print(f"{label:28s} {len(ins):6d} instructions  {hashlib.sha1(chr(10).join(ins).encode()).hexdigest()[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
