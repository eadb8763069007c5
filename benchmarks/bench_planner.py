"""Planner timing: ``quilt_attn.planner.plan`` per workload, member-mask method and merge level.

    python benchmarks/bench_planner.py                      # H200 defaults, JSON to benchmarks/results/
    python benchmarks/bench_planner.py --backends auto,torch --out /tmp/planner.json
    python benchmarks/bench_planner.py --device cpu --s-q 256 --s-kv 4096 --topk 128   # smoke test

The timed call is the whole ``plan(...)`` (allocations included: they are part of its cost), median
of ``triton.testing.do_bench`` on CUDA (a perf_counter median on the CPU). Each row also records the
plan's statistics and whether the ``sort`` and ``bitmap`` plans of that configuration are identical.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import re
import subprocess
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON output (default benchmarks/results/planner_<gpu>.json)")
    p.add_argument("--workloads", default="glm53-like,ds32-like,random", help="comma list of generate() names")
    p.add_argument("--methods", default="sort,bitmap", help="member-mask methods (comma list)")
    p.add_argument("--backends", default="auto", help="planner backends (comma list; 'auto' = Triton on CUDA)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--merge-levels", default="1,4", help="comma list")
    p.add_argument("--tile", type=int, default=64)
    p.add_argument("--clip-threshold", type=float, default=0.5)
    p.add_argument("--s-q", type=int, default=16384)
    p.add_argument("--s-kv", type=int, default=65536)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=10, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    return p.parse_args(argv)


def git_commit() -> str | None:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip() or None
    except Exception:  # no git, no repository, no commit yet
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from quilt_attn.planner import plan
    from quilt_attn.workloads import generate

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for a smoke test)", file=sys.stderr)
        return 2
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton, triton_version = None, None
    cuda = args.device == "cuda"
    gpu = torch.cuda.get_device_name() if cuda else f"cpu-{platform.machine()}"
    env = dict(gpu=gpu, torch=torch.__version__, triton=triton_version, commit=git_commit())
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"planner_{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}.json")
    has_backend = "backend" in inspect.signature(plan).parameters

    def bench_ms(fn) -> float:
        if cuda:
            return float(triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median"))
        fn()
        times = []
        t_end = time.perf_counter() + args.rep / 1000
        while len(times) < 3 or time.perf_counter() < t_end:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
        return sorted(times)[len(times) // 2]

    print(f"# {env}  s_q={args.s_q} s_kv={args.s_kv} topk={args.topk} G={args.group_size} tile={args.tile} "
          f"tau={args.clip_threshold}", flush=True)
    head = f"{'workload':<14}{'backend':<8}{'method':<8}{'M':>3}{'ms':>10}{'rows/valid':>12}{'tiles':>10}{'util':>7}{'same':>6}"
    print(head, flush=True)
    rows = []
    for wl in args.workloads.split(","):
        idx = generate(wl, args.s_q, args.s_kv, args.topk, seed=args.seed, device=args.device)
        for backend in args.backends.split(","):
            for M in map(int, args.merge_levels.split(",")):
                kw = dict(s_kv=args.s_kv, group_size=args.group_size, tile=args.tile,
                          clip_threshold=args.clip_threshold, merge_level=M)
                if has_backend:
                    kw["backend"] = backend
                plans = {}
                for method in args.methods.split(","):
                    fn = lambda: plan(idx, method=method, **kw)  # noqa: E731
                    ms = bench_ms(fn)
                    p = plans[method] = fn()
                    st = p.stats
                    rows.append(dict(env, workload=wl, s_q=args.s_q, s_kv=args.s_kv, topk=args.topk, method=method,
                                     backend=backend, group_size=args.group_size, merge_level=M, tile=args.tile,
                                     clip_threshold=args.clip_threshold, median_ms=ms,
                                     rows_per_valid=st["rows_processed"] / max(1, st["valid_pairs"]), **st))
                same = None
                if len(plans) > 1:  # the methods must give the same plan
                    a, *others = plans.values()
                    names = ("tile_kv", "tile_mask", "tile_level", "tile_members", "group_tiles", "dropped")
                    same = all(torch.equal(getattr(a, n), getattr(b, n)) for b in others for n in names)
                for r in rows[-len(plans):]:
                    r["methods_identical"] = same
                    print(f"{wl:<14}{backend:<8}{r['method']:<8}{M:>3}{r['median_ms']:>10.3f}{r['rows_per_valid']:>12.3f}"
                          f"{r['tiles']:>10}{r['tile_utilization']:>7.3f}{str(same)[0] if same is not None else '-':>6}",
                          flush=True)
                del plans
        del idx
        if cuda:
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"# {len(rows)} rows -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
