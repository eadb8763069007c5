"""Planner timing on the GPU (issue 3): the CUDA planner, the fused Triton planner (bitmap and SCSD
masks) and, with ``--torch``, the torch planner, at s_q 16384 over a 65536-token context, Top-2048.

Configurations are the ones the attention backends plan with: group and merge level 64 // h, tile 64
(h = 8: group 8; h = 16: group 4, private rows split off as Triton runs them, or kept as CUDA runs them;
h = 32: group 2), the group-8 plans at h = 16 / 32 that they used before session 9, and the paper's full
cascade (group 8, merge 1). Every plan is compared field by field with the Triton bitmap
plan of the same configuration; ``alloc`` times ``plan_buffers`` alone as that backend calls it, part of
its planner's time (Triton: the tile arrays filled with their unused-slot values; CUDA: left uninitialized,
the kernel writes every slot; the torch planner builds its own). Times: median of
``triton.testing.do_bench``; the indices (128 MB, larger than L2) are built outside the timed region.

Usage: PYTHONPATH=$PWD python benchmarks/plan_timing.py --out $OUT/plan_timing.json [--workloads glm53-like,random]
"""
from __future__ import annotations

import argparse

import torch

from quilt_attn import plan
from quilt_attn.bench import plans_equal, save, time_ms
from quilt_attn.planner.plan import plan_buffers
from quilt_attn.workloads import generate

S_Q, S_KV, TOPK = 16384, 65536, 2048
CONFIGS = [  # (label, group_size, merge_level, split_private)
    ("h8", 8, 8, False), ("h16-cuda", 4, 4, False), ("h16-triton", 4, 4, True), ("h32-cuda", 2, 2, False),
    ("h16-cuda G8", 8, 4, False), ("h16-triton G8", 8, 4, True), ("h32-cuda G8", 8, 2, False),
    ("full-cascade", 8, 1, False),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", default="glm53-like,ds32-like,random")
    ap.add_argument("--torch", action="store_true", help="also time the torch planner (slow)")
    args = ap.parse_args()
    rows = []
    for wl in args.workloads.split(","):
        idx = generate(wl, S_Q, S_KV, TOPK, seed=0, device="cuda")
        for label, G, M, split in CONFIGS:
            kw = dict(s_kv=S_KV, group_size=G, merge_level=M, split_private=split)
            ref = plan(idx, backend="triton", **kw)
            variants = [("cuda", "bitmap"), ("triton", "bitmap"), ("triton", "sort")]
            if args.torch:
                variants.append(("torch", "bitmap"))
            alloc = {filled: time_ms(lambda: plan_buffers(S_Q, TOPK, G, M, 64, split, idx.device, filled=filled),
                                     warmup=5, rep=40) for filled in (True, False)}
            for backend, method in variants:
                alloc_ms = alloc[backend != "cuda"]
                f = lambda: plan(idx, backend=backend, method=method, **kw)  # noqa: E731
                got = f()
                torch.cuda.synchronize()
                ms = time_ms(f, warmup=5, rep=40)
                st = got.stats
                rows.append({"workload": wl, "config": label, "group_size": G, "merge_level": M,
                             "split_private": split, "backend": backend, "method": method, "ms": ms,
                             "alloc_ms": alloc_ms, "same_as_triton_bitmap": plans_equal(got, ref),
                             "tiles": st["tiles"], "rows_processed": st["rows_processed"],
                             "reduction": st["reduction"]})
                r = rows[-1]
                print(f"{wl:<11} {label:<13} {backend:<6} {method:<6} {ms:8.3f} ms  (alloc {alloc_ms:.3f})  "
                      f"same={r['same_as_triton_bitmap']}  tiles {st['tiles']}  reduction {st['reduction']:.3f}",
                      flush=True)
    save(rows, args.out, {"what": "planner time by backend, s_q 16384, s_kv 65536, topk 2048"})
    print(f"\n{'workload':<11} {'config':<13} " + " ".join(f"{b + '/' + m:>14}" for b, m in
                                                      [("cuda", "bitmap"), ("triton", "bitmap"), ("triton", "sort")]))
    for wl in args.workloads.split(","):
        for label, *_ in CONFIGS:
            sel = {(r["backend"], r["method"]): r for r in rows if r["workload"] == wl and r["config"] == label}
            cells = " ".join(f"{sel[k]['ms']:>12.3f}{'  ' if sel[k]['same_as_triton_bitmap'] else ' !'}"
                             for k in [("cuda", "bitmap"), ("triton", "bitmap"), ("triton", "sort")])
            print(f"{wl:<11} {label:<13} {cells}")


if __name__ == "__main__":
    main()
