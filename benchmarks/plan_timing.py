"""Planner timing on the GPU: fused Triton kernel (bitmap or SCSD masks, launch shapes) vs torch.

Usage: python benchmarks/plan_timing.py WORKLOAD[,WORKLOAD...] [--full]
"""
import sys

import torch
import triton

import quilt_attn.planner.triton_plan as tp
from quilt_attn import plan
from quilt_attn.workloads import generate

s_q, s_kv, topk = 16384, 65536, 2048
full = "--full" in sys.argv
FIELDS = ("tile_kv", "tile_mask", "tile_level", "tile_members", "group_tiles", "group_rows", "dropped")
for wl in sys.argv[1].split(","):
    idx = generate(wl, s_q, s_kv, topk, device="cuda")
    for G, M in [(8, 4), (8, 8), (4, 4), (8, 1)]:
        variants = [("triton", "bitmap", pps, w) for pps, w in [(1, 16), (2, 16), (4, 16), (2, 32), (4, 8)]]
        if full:
            variants += [("triton", "sort", 4, 16), ("torch", "bitmap", 0, 0)]
        for backend, method, pps, w in variants:
            tp.PLAN_PROGS_PER_SM, tp.PLAN_WARPS = pps or 4, w or 16
            f = lambda: plan(idx, s_kv=s_kv, group_size=G, merge_level=M, method=method, backend=backend)
            ms = triton.testing.do_bench(f, warmup=5, rep=40, return_mode="median")
            st = f().stats
            print(f"{wl:<12} G={G} M={M} {backend:<6} {method:<6} progs/SM={pps} warps={w:<2} {ms:8.3f} ms  "
                  f"rows {st['rows_processed'] / st['valid_pairs']:.3f} tiles {st['tiles']} "
                  f"util {st['tile_utilization']:.3f}", flush=True)
    tp.PLAN_PROGS_PER_SM, tp.PLAN_WARPS = 4, 16
    a = plan(idx, s_kv=s_kv, group_size=8, merge_level=4, backend="torch")
    b = plan(idx, s_kv=s_kv, group_size=8, merge_level=4, backend="triton")
    c = plan(idx, s_kv=s_kv, group_size=8, merge_level=4, backend="triton", method="sort")
    same = all(torch.equal(getattr(a, f), getattr(x, f)) for x in (b, c) for f in FIELDS)
    print(f"{wl}: torch == triton(bitmap) == triton(sort) at full size: {same}", flush=True)
