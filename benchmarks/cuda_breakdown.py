"""Where the CUDA kernel's time goes: the same launch with the kv gather and/or the matrix products
skipped (measurement only: those variants' results are invalid and not checked; the full kernel is
checked against the reference). Shape: s_q 16384, s_kv 65536, topk 2048, bf16.

``--libs name=path,...`` times prebuilt variants of the kernel library (e.g. built with -D switches)
on the same inputs, one after another; by default the package's own build runs."""
import argparse
import sys
from pathlib import Path

import torch

from quilt_attn import plan as make_plan
from quilt_attn.bench import Case, check, make_inputs, save, time_ms, useful_flops
from quilt_attn.ops import cuda_backend
from quilt_attn.ops.sparse_attention import program_shape

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--out", required=True)
p.add_argument("--cases", default="glm53-like:64,glm53-like:16")
p.add_argument("--libs", default="", help="name=path,... prebuilt kernel libraries to compare")
p.add_argument("--variants", default="0,1,2,3", help="skip codes: 0 full, 1 no gather, 2 no matmul, 3 neither")
a = p.parse_args()
LIBS = [tuple(x.split("=", 1)) for x in a.libs.split(",") if x] or [("package", None)]


def use_library(path):
    """Point the CUDA backend at a prebuilt library (None: the package's own build)."""
    cuda_backend._LIB = None
    if path is not None:
        cuda_backend.library_path = lambda defines=(): Path(path)


rows = []
for spec in a.cases.split(","):
    wl, h = spec.split(":")
    h = int(h)
    inp = make_inputs(Case(wl, h))
    q, kv = inp.sets[0]
    qp = program_shape(h, 8)[0]
    pl = make_plan(inp.indices, s_kv=65536, merge_level=qp, split_private=False) if qp > 1 else None
    out = torch.empty(q.shape[0], h, 512, dtype=q.dtype, device="cuda")
    ml = torch.empty(q.shape[0], h, dtype=torch.float32, device="cuda")
    lse = torch.empty_like(ml)
    kw = dict(plan=pl) if pl is not None else dict(indices=inp.indices)
    for lib, path in LIBS:
        use_library(path)
        out.fill_(float("nan"))
        cuda_backend.launch(q, kv, 576**-0.5, out, ml, lse, **kw)
        chk = check(inp, out, ml, lse)
        for skip in (int(v) for v in a.variants.split(",")):
            name = ["full", "no gather", "no matmul", "neither"][skip]
            ms = time_ms(lambda: cuda_backend.launch(q, kv, 576**-0.5, out, ml, lse, _skip=skip, **kw), warmup=20,
                         rep=100)
            rows.append(dict(workload=wl, h=h, lib=lib, mode="quilt" if pl is not None else "query_parallel",
                             variant=name, ms=ms, tflops=useful_flops(q.shape[0], 2048, h) / ms / 1e9,
                             rel_err=chk["rel_err"] if skip == 0 else None))
            print(f"{wl:<12}{h:>4} {lib:<9}{rows[-1]['mode']:<15}{name:<10}{ms:8.3f} ms {rows[-1]['tflops']:6.0f} TF/s"
                  + (f" err {chk['rel_err']:.1e}" if skip == 0 else ""), flush=True)
save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
