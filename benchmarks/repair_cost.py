"""What the repair pass costs a QUILT call on the CUDA backend (``sparse_attention.run_plan_passes``).

Each case (workload, heads; s_q 16384, 64K context, Top-2048, bf16, plan prebuilt) times, interleaved in one
process, on the same inputs:

* ``before``: the launch without the repair: a library built with ``-DQUILT_NO_NAN_QUEUE`` (the epilogue's NaN
  test left out) and no repair queue or pass;
* ``repair``: the shipping launch: the NaN test in the epilogue, the queue zeroed, the repair pass over an empty
  queue;
* ``repair-nan``: the same on kv whose ``--nan-rows`` rows, each selected by one query only, hold a NaN: their
  selecting queries and every tile partner are queued, and the partners are recomputed query by query.

Every output starts NaN-poisoned and is checked against the float32 reference on sampled queries (for
``repair-nan``: the queries that select no NaN row, and the selecting ones must be NaN).

    python benchmarks/run.py repair-cost --out F [--heads 8,16,32] [--workloads glm53-like]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from engine_shapes import time_alternating
from quilt_attn.ops import cuda_backend
from quilt_bench import bench

D_QK, D_V = 576, 512


def run_case(workload: str, h: int, nan_rows: int, rounds: int, warmup: int, rep: int, before_lib) -> list[dict]:
    case = bench.Case(workload, h, s_q=16384, s_kv=65536, topk=2048, dtype="bf16")
    inp = bench.make_inputs(case)
    plan = bench.cuda_work(inp, h)["plan"]
    idx, sm_scale = inp.indices, D_QK ** -0.5
    bad_rows = bench.rows_selected_once(idx, case.s_kv, nan_rows)
    owner = (idx[:, :, None] == bad_rows).any(2).any(1)
    nan_sets = []
    for q, kv in inp.sets:
        kv = kv.clone()
        kv[bad_rows, 11] = float("nan")
        nan_sets.append((q, kv))
    # variant -> (kernel library (None: the package's), input sets, work)
    variants = {"before": (before_lib, inp.sets, dict(plan=plan)),
                "repair": (None, inp.sets, dict(plan=plan, indices=idx)),
                "repair-nan": (None, nan_sets, dict(plan=plan, indices=idx))}
    last = {}

    def variant(name):
        lib, sets, work = variants[name]

        def fn(i):
            if cuda_backend._OVERRIDE != lib:
                cuda_backend.use_library(lib)
            q, kv = sets[i]
            last[name] = cuda_backend.launch_sparse_attention_cuda(q, kv, sm_scale, D_V, **work)
        return fn

    fns = {name: variant(name) for name in variants}
    rows_chk = torch.randperm(case.s_q, generator=torch.Generator().manual_seed(3))[:512].to(idx.device)
    checks = {}
    for name, fn in fns.items():
        fn(0)
        torch.cuda.synchronize()
        out, ml, lse = last[name]
        sel = rows_chk
        if name == "repair-nan":  # not the NaN rows' owners; all their partners (the queries a leak could reach)
            sel = torch.unique(torch.cat([rows_chk[~owner[rows_chk]],
                                          (plan_partners(owner, plan.group_size) & ~owner).nonzero().flatten()]))
        chk = bench.check(bench.Inputs(case, idx, variants[name][1]), out, ml, lse, rows=sel, base2=True)
        checks[name] = dict(chk, checked=int(sel.numel()),
                            owners_nan=bool(torch.isnan(out[owner]).any(-1).any(-1).all()) if name == "repair-nan" else None)
    times = time_alternating(fns, rounds, warmup, rep)
    cuda_backend.use_library(None)
    rows = []
    for name in fns:
        r = dict(workload=workload, h=h, s_q=case.s_q, s_kv=case.s_kv, topk=case.topk, kv="bf16", variant=name,
                 nan_rows=nan_rows if name == "repair-nan" else 0, rounds_ms=times[name],
                 ms=statistics.median(times[name]), **checks[name])
        rows.append(r)
    return rows


def plan_partners(owner: torch.Tensor, group_size: int) -> torch.Tensor:
    """Queries sharing a plan group with an ``owner`` query (the ones a leak could reach)."""
    s_q = owner.shape[0]
    pad = -s_q % group_size
    g = torch.nn.functional.pad(owner, (0, pad)).view(-1, group_size).any(1, keepdim=True)
    return g.expand(-1, group_size).reshape(-1)[:s_q]


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--heads", default="8,16,32")
    p.add_argument("--workloads", default="glm53-like")
    p.add_argument("--nan-rows", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rep", type=int, default=100)
    a = p.parse_args(argv)
    before_lib = cuda_backend.build(defines=("-DQUILT_NO_NAN_QUEUE",))
    rows = []
    for wl in a.workloads.split(","):
        for h in map(int, a.heads.split(",")):
            rows += run_case(wl, h, a.nan_rows, a.rounds, a.warmup, a.rep, before_lib)
            torch.cuda.empty_cache()
    if a.out:
        bench.save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
    print("| workload | h | variant | ms | vs before | rel_err | checked | NaN in checked | owners NaN |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        base = next(x["ms"] for x in rows if x["workload"] == r["workload"] and x["h"] == r["h"]
                    and x["variant"] == "before")
        print(f"| {r['workload']} | {r['h']} | {r['variant']} | {r['ms']:.3f} | {100 * (r['ms'] / base - 1):+.2f}% | "
              f"{r['rel_err']:.2e} | {r['checked']} | {r['nan']} | {r['owners_nan']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
