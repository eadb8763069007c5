"""Triton vs CUDA backend on the benchmark shape (s_q 16384, s_kv 65536, topk 2048, d_qk 576).

Per (workload, h, method, backend): attention time with a prebuilt plan (median of do_bench over
two rotating input sets), useful TFLOP/s, relative L2 error against the float32 reference on 256
sampled queries. Writes a JSON (GPU, commit, versions, command) to --out and prints a table.
"""
import argparse
import sys
import time

import torch

from quilt_attn import plan as make_plan
from quilt_attn import sparse_prefill
from quilt_attn.bench import Case, check, make_inputs, save, time_ms, useful_flops
from quilt_attn.ops.sparse_attention import default_group_size, program_shape

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--out", required=True)
p.add_argument("--cases", default="glm53-like:8,glm53-like:16,glm53-like:32,glm53-like:64,random:64,glm53-like:128")
p.add_argument("--backends", default="triton,cuda")
p.add_argument("--kv", default="bf16")
p.add_argument("--s-q", type=int, default=16384)
a = p.parse_args()
rows = []
t0 = time.time()
for spec in a.cases.split(","):
    wl, h = spec.split(":")
    h = int(h)
    inp = make_inputs(Case(wl, h, kv=a.kv, s_q=a.s_q))
    for backend in a.backends.split(","):
        for method in ("query_parallel", "quilt"):
            G = default_group_size(h)  # sparse_prefill's plan settings
            qp = program_shape(h, G)[0]
            if method == "quilt" and qp == 1:
                continue  # one query fills a 64-row tile: QUILT is query-parallel here
            kw = dict(method=method, backend=backend)
            if method == "quilt":
                kw["plan"] = make_plan(inp.indices, s_kv=65536, group_size=G, merge_level=qp,
                                       split_private=backend == "triton")
                kw["fallback"] = False
            state = {"i": 0}

            def fn():
                q, kv = inp.sets[state["i"] % 2]
                state["i"] += 1
                return sparse_prefill(q, kv, inp.indices, **kw)

            try:
                out = fn()
                torch.cuda.synchronize()
                state["i"] = 0
                chk = check(inp, *sparse_prefill(inp.sets[0][0], inp.sets[0][1], inp.indices, **kw))
                ms = time_ms(fn, warmup=25, rep=150)
            except Exception as e:  # recorded, not hidden
                rows.append(dict(workload=wl, h=h, method=method, backend=backend, error=f"{type(e).__name__}: {e}"[:300]))
                print("ERROR", rows[-1], flush=True)
                continue
            r = dict(workload=wl, kv=a.kv, h=h, method=method, backend=backend, s_q=a.s_q, s_kv=65536, topk=2048,
                     ms=ms, tflops=useful_flops(a.s_q, 2048, h) / ms / 1e9, rel_err=chk["rel_err"],
                     lse_err=chk["lse_err"], nan=chk["nan"])
            rows.append(r)
            print(f"[{time.time() - t0:5.0f}s] {wl:<12}{h:>4} {method:<15}{backend:<7}{ms:8.3f} ms {r['tflops']:6.0f} TF/s "
                  f"err {chk['rel_err']:.1e} lse {chk['lse_err']:.1e}", flush=True)
    del inp
    torch.cuda.empty_cache()
save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
print(f"{'workload':<12}{'h':>4} {'method':<15}{'backend':<7}{'ms':>8} {'TF/s':>6} {'rel_err':>8}")
for r in rows:
    if "ms" in r:
        print(f"{r['workload']:<12}{r['h']:>4} {r['method']:<15}{r['backend']:<7}{r['ms']:8.3f} {r['tflops']:6.0f} {r['rel_err']:8.1e}")
    else:
        print(f"{r['workload']:<12}{r['h']:>4} {r['method']:<15}{r['backend']:<7} ERROR {r['error'][:80]}")
