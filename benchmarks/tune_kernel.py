"""Kernel-configuration sweep on the GPU: which settings win, per method and head count.

Each --variants item is method[:key=value,...], e.g. "quilt:split_private=0,num_stages=2"
or "query_parallel:num_warps=4".
"""
import argparse
import time

import torch

from quilt_attn.bench import Case, format_rows, make_inputs, run_case, save

p = argparse.ArgumentParser()
p.add_argument("--out", default="tune.json")
p.add_argument("--heads", default="16,8")
p.add_argument("--workload", default="glm53-like")
p.add_argument("--kv", default="bf16")
p.add_argument("--s_q", type=int, default=16384)
p.add_argument("--variants", default="quilt,quilt:split_private=0,query_parallel")
a = p.parse_args()


def parse(v):
    method, _, rest = v.partition(":")
    kw = {}
    for item in filter(None, rest.split(",")):
        k, _, val = item.partition("=")
        kw[k] = int(val) if val.lstrip("-").isdigit() else float(val)
    if "split_private" in kw:
        kw["split_private"] = bool(kw["split_private"])
    return method, kw


rows = []
for h in map(int, a.heads.split(",")):
    t = time.time()
    inp = make_inputs(Case(a.workload, h, kv=a.kv, s_q=a.s_q))
    print(f"inputs h={h}: {time.time() - t:.1f}s", flush=True)
    for v in a.variants.split(";"):
        method, kw = parse(v)
        try:
            r = run_case(inp, method, **kw)
        except Exception as e:  # a config that fails to compile is a result too
            print(f"FAILED {v} h={h}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        rows.append(r)
        print(format_rows([r]).splitlines()[1], flush=True)
    del inp
    torch.cuda.empty_cache()
save(rows, a.out)
print(format_rows(rows))
