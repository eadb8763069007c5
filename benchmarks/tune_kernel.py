"""Kernel-configuration sweep on the GPU: which tile engine settings win, per method and head count."""
import argparse
import json
import sys
import time

import torch

from quilt_attn.bench import Case, format_rows, make_inputs, run_case, save

p = argparse.ArgumentParser()
p.add_argument("--out", default="tune.json")
p.add_argument("--heads", default="16,8")
p.add_argument("--workload", default="glm53-like")
p.add_argument("--configs", default="8:2:1,8:3:1,4:2:1,8:2:2,8:1:1")
p.add_argument("--methods", default="quilt,query_parallel")
p.add_argument("--s_q", type=int, default=16384)
p.add_argument("--groups", default="8")
p.add_argument("--kv", default="bf16")
a = p.parse_args()
rows = []
for h in map(int, a.heads.split(",")):
    t = time.time()
    inp = make_inputs(Case(a.workload, h, kv=a.kv, s_q=a.s_q))
    print(f"inputs h={h}: {time.time() - t:.1f}s", flush=True)
    for m in a.methods.split(","):
        for cfg, G in [(c, int(g)) for c in a.configs.split(",") for g in (a.groups.split(",") if m == "quilt" else "1")]:
            w, s, d = map(int, cfg.split(":"))
            try:
                r = run_case(inp, m, num_warps=w, num_stages=s, dv_split=d, group_size=max(G, 1))
            except Exception as e:  # a config that fails to compile is a result too
                print(f"FAILED {m} h={h} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            rows.append(r)
            print(format_rows([r]).splitlines()[1], flush=True)
    del inp
    torch.cuda.empty_cache()
save(rows, a.out)
print(format_rows(rows))
