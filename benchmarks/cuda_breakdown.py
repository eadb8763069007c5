"""Where the CUDA kernel's time goes: the same launch with the kv gather and/or the matrix products
skipped (measurement only: those variants' results are invalid and not checked; the full kernel is
checked against the reference). Shape: s_q 16384, s_kv 65536, topk 2048, bf16.

The measuring loop is ``quilt_attn.sweeps.cuda_breakdown_rows`` (also behind ``quilt-attn report``'s
breakdown part on a Hopper GPU). ``--libs name=path,...`` times prebuilt variants of the kernel library
(e.g. built with -D switches) on the same inputs, one after another; by default the package's build runs.
"""
import argparse
import sys

from quilt_attn.bench import save
from quilt_attn.sweeps import CUDA_BREAKDOWN_VARIANTS, cuda_breakdown_md, cuda_breakdown_rows

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--out", required=True)
p.add_argument("--cases", default="glm53-like:64,glm53-like:16", help="workload:h,...")
p.add_argument("--libs", default="", help="name=path,... prebuilt kernel libraries to compare")
p.add_argument("--variants", default=",".join(CUDA_BREAKDOWN_VARIANTS), help="of " + ", ".join(CUDA_BREAKDOWN_VARIANTS))
a = p.parse_args()
cases = [(wl, int(h)) for wl, h in (c.split(":") for c in a.cases.split(","))]
libs = [tuple(x.split("=", 1)) for x in a.libs.split(",") if x] or None
rows = cuda_breakdown_rows(cases, libs=libs, variants=tuple(a.variants.split(",")), timing=dict(warmup=20, rep=100),
                           log=lambda m: print(m, flush=True))
save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
print("\n".join(cuda_breakdown_md(rows)))
