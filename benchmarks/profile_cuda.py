"""One CUDA-kernel launch to profile under Nsight Compute (glm53-like, bf16, s_kv 65536, topk 2048).

    ncu --set full --import-source no -k regex:quilt_sm90 -c 1 -o prof python benchmarks/profile_cuda.py --h 64
    python benchmarks/profile_cuda.py --summarize prof.ncu-rep   # hottest SASS lines by warp stall samples
"""
import argparse
import csv
import io
import subprocess
import sys

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--h", type=int, default=64)
p.add_argument("--s-q", type=int, default=4096)
p.add_argument("--skip", type=int, default=0, help="0 full, 1 no gather, 2 no matmul, 3 neither")
p.add_argument("--summarize", default=None, help="an .ncu-rep file: print the stall summary instead")
p.add_argument("--top", type=int, default=40)
a = p.parse_args()

if a.summarize:
    txt = subprocess.run(["ncu", "-i", a.summarize, "--page", "source", "--csv", "--print-source", "sass"],
                         capture_output=True, text=True).stdout
    lines = txt.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"Address"') or ln.startswith('"#"')), None)
    if start is None:
        print(txt[:3000])
        sys.exit(1)
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    cols = list(rows[0])
    key = next(k for k in cols if k.startswith("Warp Stall Sampling (All"))
    reasons = [k for k in cols if k.startswith("stall_")] or [k for k in cols if "stall" in k.lower() and k != key]
    total = sum(float(r[key] or 0) for r in rows)
    base = int(rows[0]["Address"], 16)  # offsets match cuobjdump -sass of the same build
    print(f"{len(rows)} SASS lines, {total:.0f} stall samples")
    for r in sorted(rows, key=lambda r: -float(r[key] or 0))[:a.top]:
        top = sorted(((float(r[k] or 0), k) for k in reasons), reverse=True)[:2]
        why = " ".join(f"{k.replace('stall_', '')}={v / max(float(r[key] or 1), 1):.0%}" for v, k in top if v)
        print(f"{float(r[key] or 0) / total:6.1%}  {int(r['Address'], 16) - base:#07x}  {r.get('Source', '')[:70]:<70} {why}")
    sys.exit()

import torch

from quilt_attn import plan as make_plan
from quilt_attn.ops import cuda_backend
from quilt_attn.ops.sparse_attention import program_shape
from quilt_attn.workloads import generate

torch.manual_seed(0)
idx = generate("glm53-like", a.s_q, 65536, 2048, seed=7, device="cuda")
q = torch.randn(a.s_q, a.h, 576, device="cuda", dtype=torch.bfloat16)
kv = torch.randn(65536, 576, device="cuda", dtype=torch.bfloat16)
qp = program_shape(a.h, 8)[0]
kw = dict(plan=make_plan(idx, s_kv=65536, merge_level=qp, split_private=False)) if qp > 1 else dict(indices=idx)
out = torch.empty(a.s_q, a.h, 512, dtype=q.dtype, device="cuda")
ml = torch.empty(a.s_q, a.h, dtype=torch.float32, device="cuda")
lse = torch.empty_like(ml)
cuda_backend.launch(q, kv, 576**-0.5, out, ml, lse, _skip=a.skip, **kw)
torch.cuda.synchronize()
