"""CUDA planner variants timed against each other on the same indices, interleaved (issue 3).

A variant is ``name=library`` (a prebuilt kernel library; ``package``: this checkout's build). Each round
times every variant's ``plan()`` (median of ``triton.testing.do_bench``), alternating the order between
rounds; every plan is compared tensor field by tensor field with the first variant's. s_q 16384, s_kv 65536, topk 2048,
tile 64; the indices are built outside the timed region.

    python benchmarks/ab_plan.py --out ab.json --variants old=/path/old.so,new=package
"""
import argparse
import statistics
import sys
from pathlib import Path

from quilt_attn.bench import plans_equal, save, time_ms
from quilt_attn.ops import cuda_backend
from quilt_attn.planner import plan as make_plan
from quilt_attn.workloads import generate

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--out", required=True)
p.add_argument("--variants", required=True)
p.add_argument("--cases", default="glm53-like:8,glm53-like:4,ds32-like:8,ds32-like:4",
               help="workload:merge_level[:group_size],... (group size default 8)")
p.add_argument("--rounds", type=int, default=4)
a = p.parse_args()
variants = [tuple(v.split("=", 1)) for v in a.variants.split(",")]

rows = []
for case in a.cases.split(","):
    wl, merge, *group = case.split(":")
    G = int(group[0]) if group else 8
    idx = generate(wl, 16384, 65536, 2048, seed=0, device="cuda")
    kw = dict(s_kv=65536, group_size=G, merge_level=int(merge), backend="cuda")
    ref, times = None, {name: [] for name, _ in variants}
    same = {}
    for name, lib in variants:
        cuda_backend.use_library(None if lib == "package" else Path(lib))
        pl = make_plan(idx, **kw)
        if ref is None:
            ref = pl
        same[name] = plans_equal(pl, ref)
    for rnd in range(a.rounds):
        for name, lib in (variants if rnd % 2 == 0 else variants[::-1]):
            cuda_backend.use_library(None if lib == "package" else Path(lib))
            times[name].append(time_ms(lambda: make_plan(idx, **kw), warmup=20, rep=100))
    for name, lib in variants:
        r = dict(workload=wl, group_size=G, merge_level=int(merge), variant=name, lib=lib, rounds_ms=times[name],
                 ms=statistics.median(times[name]), same_plan_as_first=same[name])
        rows.append(r)
        print(f"{wl:<11} G={G} merge={merge} {name:<10} {r['ms']:.4f} ms  rounds {['%.4f' % x for x in times[name]]}  "
              f"same as {variants[0][0]}: {same[name]}", flush=True)
    cuda_backend.use_library(None)
save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
