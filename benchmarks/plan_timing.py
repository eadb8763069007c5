"""Planner timing on the GPU: fused Triton (bitmap / SCSD masks) vs the torch planner."""
import sys
import torch
import quilt_attn.planner.triton_plan as tp
import triton
from quilt_attn import plan
from quilt_attn.workloads import generate

s_q, s_kv, topk = 16384, 65536, 2048
rows = []
for wl in sys.argv[1].split(","):
    idx = generate(wl, s_q, s_kv, topk, device="cuda")
    for G, M in [(8, 1), (8, 4), (8, 8), (4, 4), (2, 2)]:
        for backend, method, w in [("triton", "bitmap", 16), ("triton", "bitmap", 8), ("triton", "sort", 16), ("torch", "bitmap", 0)]:
            tp.PLAN_WARPS = w or 16
            f = lambda: plan(idx, s_kv=s_kv, group_size=G, merge_level=M, method=method, backend=backend)
            ms = triton.testing.do_bench(f, warmup=5, rep=40, return_mode="median")
            st = f().stats
            print(f"{wl:<12} G={G} M={M} {backend:<6} {method:<6} w={w:<2} {ms:8.3f} ms  rows {st['rows_processed']/st['valid_pairs']:.3f} tiles {st['tiles']} util {st['tile_utilization']:.3f}", flush=True)
    a = plan(idx, s_kv=s_kv, group_size=8, merge_level=4, backend="torch")
    b = plan(idx, s_kv=s_kv, group_size=8, merge_level=4, backend="triton")
    c = plan(idx, s_kv=s_kv, group_size=8, merge_level=4, backend="triton", method="sort")
    same = all(torch.equal(getattr(a, f), getattr(x, f)) for x in (b, c) for f in
               ("tile_kv", "tile_mask", "tile_level", "tile_members", "group_tiles", "group_rows", "dropped"))
    print(f"{wl}: torch == triton(bitmap) == triton(sort) at full size: {same}", flush=True)
