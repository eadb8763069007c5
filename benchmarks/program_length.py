"""What a program boundary costs the CUDA kernel: the same number of 64-row tiles in programs of different
lengths (query-parallel, h=64: one query a program, topk / 64 tiles each; s_q x topk fixed).

If a tile costs t and each program adds b, time / tiles = t + b * 64 / topk: two lengths give t and b.
Every configuration is checked against the float32 reference on sampled queries (NaN-poisoned outputs).

    python benchmarks/program_length.py --out pl.json [--workloads random,glm53-like]
"""
import argparse
import sys

import torch

from quilt_attn import bench
from quilt_attn.bench import Case, make_inputs, rotating, save

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--out", required=True)
p.add_argument("--workloads", default="random,glm53-like")
p.add_argument("--h", type=int, default=64)
p.add_argument("--shapes", default="32768:1024,16384:2048,8192:4096,4096:8192", help="s_q:topk,...")
a = p.parse_args()

rows = []
for wl in a.workloads.split(","):
    for shape in a.shapes.split(","):
        s_q, topk = (int(x) for x in shape.split(":"))
        case = Case(wl, a.h, s_q=s_q, s_kv=65536, topk=topk)
        inp = make_inputs(case)
        call, out, ml, lse = bench.cuda_call(inp, a.h, dict(indices=inp.indices))
        call(*inp.sets[0])
        torch.cuda.synchronize()
        chk = bench.check(inp, out, ml, lse)
        ms = bench.time_ms(rotating(inp, call), warmup=20, rep=200)
        tiles = s_q * topk // 64
        r = dict(workload=wl, h=a.h, s_q=s_q, topk=topk, tiles=tiles, ms=ms, ns_per_tile_x_sms=ms * 1e6 / tiles,
                 rel_err=chk["rel_err"], lse_err=chk["lse_err"], nan=chk["nan"], backend="cuda",
                 method="query_parallel")
        rows.append(r)
        print(f"{wl:<11} h={a.h} s_q={s_q:<6} topk={topk:<5} {ms:7.3f} ms  {r['ns_per_tile_x_sms']:.2f} ns a tile  "
              f"rel_err {chk['rel_err']:.2e} nan {chk['nan']}", flush=True)
        inp = out = None
        torch.cuda.empty_cache()
    # least squares of time / tiles = t + b * (64 / topk) over the shapes
    sel = [r for r in rows if r["workload"] == wl]
    xs = [64 / r["topk"] for r in sel]
    ys = [r["ns_per_tile_x_sms"] for r in sel]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    t = my - b * mx
    print(f"{wl}: a tile {t:.2f} ns, a program boundary {b:.1f} ns (grid-aggregate; x SM count for one SM's time)")
    rows.append(dict(workload=wl, h=a.h, fit="time/tiles = t + b * 64/topk", t_ns=t, b_ns=b))
save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
