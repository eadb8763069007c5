"""The recorded benchmark grid (benchmarks/results/<gpu>.json): realistic workloads first.

Runs each (workload, kv, h) input set once, then its methods; speedup = query-parallel ms / ms.
"""
import argparse
import time

import torch

from quilt_attn.bench import Case, format_rows, make_inputs, run_case, save

GRID = [  # (workload, kv, heads, methods)
    ("glm53-like", "bf16", (8, 16, 32, 64, 128), ("query_parallel", "quilt")),
    ("glm53-like", "bf16", (8, 16), ("quilt+iclip",)),
    ("ds32-like", "bf16", (8, 16, 32), ("query_parallel", "quilt")),
    ("qasper-like", "bf16", (8, 16), ("query_parallel", "quilt")),
    ("random", "bf16", (16, 64), ("query_parallel", "quilt")),
    ("glm53-like", "fp8", (8, 16, 64), ("query_parallel", "quilt")),
]

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--out", required=True)
p.add_argument("--only", default="", help="comma-separated workloads to keep")
a = p.parse_args()
rows = []
t0 = time.time()
for wl, kv, heads, methods in GRID:
    if a.only and wl not in a.only.split(","):
        continue
    for h in heads:
        inp = make_inputs(Case(wl, h, kv=kv))
        for m in methods:
            try:
                r = run_case(inp, m.replace("+iclip", ""), importance_clip=m.endswith("+iclip"))
            except Exception as e:  # recorded, not hidden
                r = {"method": m, "workload": wl, "kv": kv, "h": h, "error": f"{type(e).__name__}: {e}"[:400]}
                print("ERROR", r, flush=True)
                rows.append(r)
                continue
            base = [x for x in rows if x.get("method") == "query_parallel" and x["workload"] == wl
                    and x["kv"] == kv and x["h"] == h and "ms" in x]
            if base:
                r["speedup_vs_query_parallel"] = base[0]["ms"] / r["ms"]
            rows.append(r)
            print(f"[{time.time() - t0:6.1f}s] " + format_rows([r]).splitlines()[1], flush=True)
        del inp
        torch.cuda.empty_cache()
        save(rows, a.out)
print(format_rows([r for r in rows if "ms" in r]))
