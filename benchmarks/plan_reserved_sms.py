"""Planner beside the attention kernel on SMs the attention leaves free (issue 3, overlap).

The CUDA attention kernel is persistent, one CTA an SM with ~200 KB of shared memory, so a planner
launched on a second stream gets no SM until it ends. Launched with ``132 - k`` CTAs it leaves ``k`` SMs
free; this times, on glm53-like s_q 16384 / s_kv 65536 / topk 2048 (bf16):

- ``attn``: the attention over a prebuilt plan with ``132 - k`` CTAs, alone;
- ``both``: ``quilt_attn.plan_ahead`` of a second index set (another seed: the next call's) on a
  high-priority side stream, then the same launch; the planner does not wait for the attention; timed
  from before the attention to after both (the current stream waits for the plan at the end).

``both`` over ``attn`` at k = 0 is the serial cost of planning; a steady-state chunk pipeline runs
one ``both`` a chunk. Every attention output is checked against the float32 reference (NaN-poisoned
outputs) and every side plan against a plan made alone.

    python benchmarks/plan_reserved_sms.py --out reserved.json --h 8,16 --free 0,4,8,12,16
"""
import argparse
import statistics
import sys

import torch

from quilt_attn import bench
from quilt_attn.bench import Case, make_inputs, plans_equal, rotating, save
from quilt_attn.pipeline import plan_ahead
from quilt_attn.planner import plan as make_plan
from quilt_attn.workloads import generate

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--out", required=True)
p.add_argument("--workload", default="glm53-like")
p.add_argument("--h", default="8,16")
p.add_argument("--free", default="0,4,8,12,16", help="SMs left free for the planner")
p.add_argument("--rounds", type=int, default=4)
a = p.parse_args()

n_sm = torch.cuda.get_device_properties(0).multi_processor_count
side = torch.cuda.Stream(priority=-1)
rows = []
for h in map(int, a.h.split(",")):
    case = Case(a.workload, h)
    inp = make_inputs(case)
    work = bench.cuda_work(inp, h)
    pl = work["plan"]
    pkw = dict(s_kv=case.s_kv, group_size=pl.group_size, merge_level=pl.merge_level, split_private=False)
    idx2 = generate(a.workload, case.s_q, case.s_kv, case.topk, seed=case.seed + 7, device="cuda")
    ref_plan = make_plan(idx2, **pkw)
    plan_alone = bench.time_ms(lambda: make_plan(idx2, **pkw), warmup=20, rep=100)
    fns, case_rows = {}, {}
    for k in map(int, a.free.split(",")):
        launch, out, ml, lse = bench.cuda_call(inp, h, work, _ctas=n_sm - k)
        side_plans = []

        def both(q, kv, launch=launch, side_plans=side_plans):
            # quilt_attn.plan_ahead: the planner waits for the work before the attention, not for it
            sp = plan_ahead(idx2, h, **pkw, plan_stream=side)
            launch(q, kv)
            sp.wait()  # the current stream waits for the planner
            side_plans[:] = [sp]

        both(*inp.sets[0])
        torch.cuda.synchronize()
        chk = bench.check(inp, out, ml, lse)
        same = plans_equal(side_plans[0], ref_plan)
        out.fill_(float("nan"))
        launch(*inp.sets[0])
        torch.cuda.synchronize()
        chk_alone = bench.check(inp, out, ml, lse)
        fns[k] = (rotating(inp, launch), rotating(inp, both))
        case_rows[k] = dict(workload=a.workload, h=h, backend="cuda", group_size=pl.group_size,
                            merge_level=pl.merge_level, free_sms=k, ctas=n_sm - k, plan_alone_ms=plan_alone,
                            rel_err=max(chk["rel_err"], chk_alone["rel_err"]), nan=chk["nan"] or chk_alone["nan"],
                            lse_err=max(chk["lse_err"], chk_alone["lse_err"]), side_plan_equal=same,
                            attn_rounds_ms=[], both_rounds_ms=[])
    for rnd in range(a.rounds):
        for k in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            case_rows[k]["attn_rounds_ms"].append(bench.time_ms(fns[k][0], warmup=20, rep=100))
            case_rows[k]["both_rounds_ms"].append(bench.time_ms(fns[k][1], warmup=20, rep=100))
    base = statistics.median(case_rows[min(case_rows)]["attn_rounds_ms"])
    for k, r in case_rows.items():
        r["attn_ms"] = statistics.median(r["attn_rounds_ms"])
        r["both_ms"] = statistics.median(r["both_rounds_ms"])
        r["both_over_full_attn"] = r["both_ms"] / base
        rows.append(r)
        print(f"{a.workload} h={h:<3} free {k:>2}: attn {r['attn_ms']:.3f}  attn+plan {r['both_ms']:.3f} ms  "
              f"= {r['both_over_full_attn']:.3f}x attn({n_sm - min(case_rows)} CTAs)  plan alone {plan_alone:.3f}  "
              f"rel_err {r['rel_err']:.2e} nan {r['nan']} side plan equal {r['side_plan_equal']}", flush=True)
    inp = work = pl = fns = None
    torch.cuda.empty_cache()

save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
