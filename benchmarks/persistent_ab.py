"""The CUDA kernel's persistent grid against one CTA a work item, on the same inputs and build.

Both launches run the same code (a CTA takes work items from a counter until none is left);
only the CTA count differs: one an SM (the default) or one a work item (``_ctas``, what a
non-persistent launch does). Every variant is checked against the float32 reference on sampled
queries (NaN-poisoned outputs first), and the two variants' outputs must be bit-identical.
Shape: s_q 16384, s_kv 65536, topk 2048, bf16; inputs rotate over two sets larger than L2.
"""
import argparse
import statistics
import sys

import torch

from quilt_attn import bench
from quilt_attn.bench import Case, make_inputs, rotating, save
from quilt_attn.ops import cuda_backend
from quilt_attn.ops.sparse_attention import program_shape
from quilt_attn.planner import plan as make_plan

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--out", required=True)
p.add_argument("--cases", default="glm53-like:8,glm53-like:16,glm53-like:32,glm53-like:64,glm53-like:128,"
                                  "random:64,random:128")
p.add_argument("--warmup", type=int, default=20)
p.add_argument("--rep", type=int, default=100)
p.add_argument("--rounds", type=int, default=4)
a = p.parse_args()

rows = []
for case_s in a.cases.split(","):
    wl, h = case_s.split(":")
    h = int(h)
    case = Case(wl, h, s_q=16384, s_kv=65536, topk=2048, dtype="bf16")
    inp = make_inputs(case)
    qp = program_shape(h, 8)[0]
    pl = make_plan(inp.indices, s_kv=case.s_kv, merge_level=qp, split_private=False) if qp > 1 else None
    kw = dict(plan=pl) if pl is not None else dict(indices=inp.indices)
    n_work = (pl.work_list(qp)[0].shape[0] if pl is not None else case.s_q) * -(-h // program_shape(h, 8)[1])
    q0, _ = inp.sets[0]
    outs, fns, case_rows = {}, {}, {}
    for name, ctas in (("one_cta_a_work_item", n_work), ("persistent", None)):
        out = torch.full((case.s_q, h, bench.D_V), float("nan"), dtype=q0.dtype, device=q0.device)
        ml = torch.empty(case.s_q, h, dtype=torch.float32, device=q0.device)
        lse = torch.empty_like(ml)

        def call(q, kv, out=out, ml=ml, lse=lse, ctas=ctas):
            cuda_backend.launch(q, kv, bench.D_QK ** -0.5, out, ml, lse, _ctas=ctas, **kw)

        call(*inp.sets[0])
        torch.cuda.synchronize()
        chk = bench.check(inp, out, ml, lse)
        outs[name] = (out.clone(), lse.clone())
        fns[name] = rotating(inp, call)
        case_rows[name] = dict(
            method="quilt" if pl is not None else "query_parallel", backend="cuda", workload=wl, kv="bf16", h=h,
            s_q=case.s_q, s_kv=case.s_kv, topk=case.topk, variant=name,
            ctas=n_work if ctas else min(n_work, torch.cuda.get_device_properties(0).multi_processor_count),
            n_work=n_work, rel_err=chk["rel_err"], lse_err=chk["lse_err"], nan=chk["nan"], rounds_ms=[])
    # the variants alternate, each round in the other order (clock and thermal drift between timings
    # otherwise favours whichever runs first); the row's ms is the median of its rounds
    for rnd in range(a.rounds):
        for name in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            case_rows[name]["rounds_ms"].append(bench.time_ms(fns[name], warmup=a.warmup, rep=a.rep))
    for name, r in case_rows.items():
        r["ms"] = statistics.median(r["rounds_ms"])
        r["tflops"] = bench.useful_flops(case.s_q, case.topk, h) / r["ms"] / 1e9
        rows.append(r)
        print(f"{wl:<11} h={h:<4} {name:<20} {r['ms']:7.3f} ms  rounds {['%.3f' % x for x in r['rounds_ms']]}  "
              f"rel_err {r['rel_err']:.2e}  nan {r['nan']}", flush=True)
    same = all(torch.equal(x, y) for x, y in zip(outs["persistent"], outs["one_cta_a_work_item"]))
    rows[-1]["bit_identical_to_one_cta_a_work_item"] = same
    rows[-2]["bit_identical_to_one_cta_a_work_item"] = same
    print(f"    bit-identical: {same}", flush=True)
    inp = pl = kw = outs = fns = None
    torch.cuda.empty_cache()

save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
print("\n| workload | h | one CTA a work item (ms) | persistent (ms) | change | bit-identical |")
print("| --- | --- | --- | --- | --- | --- |")
for i in range(0, len(rows), 2):
    x, y = rows[i], rows[i + 1]
    print(f"| {x['workload']} | {x['h']} | {x['ms']:.3f} | {y['ms']:.3f} | {100 * (y['ms'] / x['ms'] - 1):+.1f}% | "
          f"{x['bit_identical_to_one_cta_a_work_item']} |")
