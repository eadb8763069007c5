"""Planner timing: the CUDA planner, the fused Triton planner (bitmap and SCSD masks) and, with ``--torch``, the
torch planner, at s_q 16384 over a 65536-token context, Top-2048 (``--s-q`` / ``--s-kv`` / ``--topk``).

Configurations are the ones the attention backends plan with: group and merge level 64 // h, tile 64
(h = 8: group 8; h = 16: group 4, private rows split off as Triton runs them, or kept as CUDA runs them;
h = 32: group 2), group-8 plans at h = 16 / 32, and the paper's full cascade (group 8, merge 1). Every plan is
compared field by field with the reference plan of the same configuration (the Triton bitmap plan on a GPU,
the torch bitmap plan with ``--device cpu``); ``alloc`` times ``plan_buffers`` alone as that backend calls it,
part of its planner's time (Triton: the tile arrays filled with their unused-slot values; CUDA: left
uninitialized, the kernel writes every slot; the torch planner builds its own). Times: median of
``triton.testing.do_bench`` (on the CPU: the wall time of one call, a smoke run); the indices (128 MB, larger
than L2) are built outside the timed region.

    python benchmarks/run.py plan-timing --out PLAN.json [--workloads glm53-like,random] [--torch]
    python benchmarks/run.py plan-timing --out /tmp/p.json --device cpu --s-q 256 --s-kv 4096 --topk 128
    python benchmarks/run.py plan-timing --out AB.json --against OLD_CSRC --configs h8,h16-cuda,h32-cuda
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from quilt_attn import plan
from quilt_attn.planner.buffers import plan_buffers
from quilt_bench.bench import earlier_build, plans_equal, save, time_ms

CONFIGS = [  # (label, group_size, merge_level, split_private)
    ("h8", 8, 8, False), ("h16-cuda", 4, 4, False), ("h16-triton", 4, 4, True), ("h32-cuda", 2, 2, False),
    ("h16-cuda G8", 8, 4, False), ("h16-triton G8", 8, 4, True), ("h32-cuda G8", 8, 2, False),
    ("full-cascade", 8, 1, False),
]


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", default="glm53-like,ds32-like,random")
    ap.add_argument("--torch", action="store_true", help="also time the torch planner (slow on a GPU)")
    ap.add_argument("--s-q", type=int, default=16384)
    ap.add_argument("--s-kv", type=int, default=65536)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the torch planner only, a smoke run (its times mean little)")
    ap.add_argument("--cuda-builds", default=None,
                    help="A/B builds of the CUDA planner instead of the backends: comma-separated -D settings, "
                         "'base' for none, '+' between the settings of one build (e.g. base,NAME=1,A+B); timed in "
                         "alternating rounds in this process, each plan checked against the reference")
    ap.add_argument("--table-slots", default=None,
                    help="with --cuda-builds: comma-separated membership-table slots a list entry to A/B as well "
                         "(cuda_backend.PLAN_TABLE_SLOTS_PER_ENTRY, e.g. 1.5,1.75)")
    ap.add_argument("--against", metavar="DIR", default=None,
                    help="A/B the package's CUDA planner against an earlier csrc (built beside it as 'base'), timed "
                         "in alternating rounds as --cuda-builds")
    ap.add_argument("--configs", default=None, help="comma-separated labels of CONFIGS (default all)")
    args = ap.parse_args(argv)
    from quilt_attn.workloads import generate

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    configs = [c for c in CONFIGS if args.configs is None or c[0] in args.configs.split(",")]
    if args.cuda_builds or args.against:
        return _ab_builds(args, generate, configs)
    cuda = args.device == "cuda"
    if cuda:
        variants = [("cuda", "bitmap"), ("triton", "bitmap"), ("triton", "sort")] + \
                   ([("torch", "bitmap")] if args.torch else [])
    else:
        variants = [("torch", "bitmap"), ("torch", "sort")]
    ref_backend = "triton" if cuda else "torch"
    rows = []
    for wl in args.workloads.split(","):
        idx = generate(wl, args.s_q, args.s_kv, args.topk, seed=0, device=args.device)
        for label, G, M, split in configs:
            kw = dict(s_kv=args.s_kv, group_size=G, merge_level=M, split_private=split)
            ref = plan(idx, backend=ref_backend, **kw)
            alloc = {filled: time_ms(lambda: plan_buffers(args.s_q, args.topk, G, M, 64, split, idx.device,
                                                          filled=filled), warmup=5, rep=40)
                     for filled in (True, False)}
            for backend, mask_method in variants:
                alloc_ms = alloc[backend != "cuda"]
                f = lambda: plan(idx, backend=backend, mask_method=mask_method, **kw)  # noqa: E731
                got = f()
                if cuda:
                    torch.cuda.synchronize()
                ms = time_ms(f, warmup=5, rep=40)
                st = got.stats
                rows.append({"workload": wl, "config": label, "group_size": G, "merge_level": M,
                             "split_private": split, "backend": backend, "mask_method": mask_method, "ms": ms,
                             "alloc_ms": alloc_ms, "same_as_reference": plans_equal(got, ref),
                             "tiles": st["tiles"], "rows_processed": st["rows_processed"],
                             "reduction": st["reduction"]})
                r = rows[-1]
                print(f"{wl:<11} {label:<13} {backend:<6} {mask_method:<6} {ms:8.3f} ms  (alloc {alloc_ms:.3f})  "
                      f"same={r['same_as_reference']}  tiles {st['tiles']}  reduction {st['reduction']:.3f}",
                      flush=True)
    save(rows, args.out, {"what": f"planner time by backend, s_q {args.s_q}, s_kv {args.s_kv}, topk {args.topk}",
                          "reference": f"the {ref_backend} bitmap plan of the same configuration",
                          "command": "python " + " ".join(sys.argv)})
    print(f"\n{'workload':<11} {'config':<13} " + " ".join(f"{b + '/' + m:>14}" for b, m in variants))
    for wl in args.workloads.split(","):
        for label, *_ in configs:
            sel = {(r["backend"], r["mask_method"]): r for r in rows if r["workload"] == wl and r["config"] == label}
            cells = " ".join(f"{sel[k]['ms']:>12.3f}{'  ' if sel[k]['same_as_reference'] else ' !'}" for k in variants)
            print(f"{wl:<11} {label:<13} {cells}")
    return 1 if not all(r["same_as_reference"] for r in rows) else 0


def _ab_builds(args, generate, configs) -> int:
    """The CUDA planner built with each of ``--cuda-builds``' settings (or ``--against``'s csrc and the package's),
    timed in alternating rounds."""
    from quilt_attn.ops import cuda_backend

    if args.against:
        libs = {"base": earlier_build(args.against), "new": cuda_backend.build()}
    else:
        libs = {b.strip(): cuda_backend.build(defines=() if b.strip() == "base" else
                                              tuple(f"-D{d}" for d in b.strip().split("+")))
                for b in args.cuda_builds.split(",")}
    default_slots = cuda_backend.PLAN_TABLE_SLOTS_PER_ENTRY
    slots = [float(x) for x in args.table_slots.split(",")] if args.table_slots else [default_slots]
    builds = [(b, sl) for b in libs for sl in slots]  # variants: (build, table slots an entry)

    def use(variant):
        cuda_backend.use_library(libs[variant[0]])
        cuda_backend.PLAN_TABLE_SLOTS_PER_ENTRY = variant[1]

    rows = []
    for wl in args.workloads.split(","):
        idx = generate(wl, args.s_q, args.s_kv, args.topk, seed=0, device="cuda")
        for label, G, M, split in configs:
            kw = dict(s_kv=args.s_kv, group_size=G, merge_level=M, split_private=split)
            ref = plan(idx, backend="triton", **kw)  # the reference of the backend comparison above
            same = {}
            for b in builds:
                use(b)
                same[b] = plans_equal(plan(idx, backend="cuda", **kw), ref)

            rounds = {b: [] for b in builds}
            for rnd in range(4):  # alternating order, as bench.interleaved_rounds, the library switched untimed
                for b in (builds if rnd % 2 == 0 else builds[::-1]):
                    use(b)
                    rounds[b].append(time_ms(lambda: plan(idx, backend="cuda", **kw), warmup=5, rep=40))
            for b in builds:
                ms = statistics.median(rounds[b])
                rows.append({"workload": wl, "config": label, "group_size": G, "merge_level": M,
                             "split_private": split, "backend": "cuda", "build": b[0], "table_slots": b[1], "ms": ms,
                             "rounds_ms": rounds[b], "same_as_reference": same[b]})
                print(f"{wl:<11} {label:<13} {b[0]:<20} slots {b[1]:<5} {ms:8.3f} ms  same={same[b]}  "
                      f"rounds {[round(x, 4) for x in rounds[b]]}", flush=True)
    cuda_backend.use_library(None)
    cuda_backend.PLAN_TABLE_SLOTS_PER_ENTRY = default_slots
    save(rows, args.out, {"what": f"CUDA planner builds A/B, s_q {args.s_q}, s_kv {args.s_kv}, topk {args.topk}",
                          "command": "python " + " ".join(sys.argv)})
    return 1 if not all(r["same_as_reference"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
