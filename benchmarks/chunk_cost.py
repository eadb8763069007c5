"""What chunking one call costs the CUDA attention, chunk by chunk (issue 3, the in-call pipeline).

For glm53-like s_q 16384 / s_kv 65536 / topk 2048, bf16, CUDA backend, at each ``--h``: the attention over
the unchunked plan, each chunk's attention alone (``sparse_prefill`` on ``q[q0:q1]`` with that chunk's
plan from ``plan_chunks``), their sum, and ``sparse_prefill_pipelined(plans=...)`` (the chunks back to
back, no planning). Every chunk's output is compared bit for bit with the unchunked call's rows, which is
checked against the float32 reference first. Median of ``triton.testing.do_bench``, inputs rotating over
two sets.

    python benchmarks/chunk_cost.py --out chunk_cost.json --h 8,16 --chunks 4096,8192
"""
import argparse
import sys

import torch

from quilt_attn import sparse_prefill, sparse_prefill_pipelined
from quilt_attn.bench import Case, check, make_inputs, rotating, save, time_ms
from quilt_attn.pipeline import chunk_bounds, plan_chunks

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--out", required=True)
p.add_argument("--h", default="8,16")
p.add_argument("--chunks", default="4096,8192")
p.add_argument("--workload", default="glm53-like")
a = p.parse_args()

rows = []
for h in map(int, a.h.split(",")):
    case = Case(a.workload, h)
    inp = make_inputs(case)
    idx = inp.indices
    B = dict(backend="cuda")
    full_plans = plan_chunks(idx, h, s_kv=case.s_kv, chunk=case.s_q, split_private=False)
    q, kv = inp.sets[0]
    full_out = sparse_prefill(q, kv, idx, plan=full_plans[0], **B)
    torch.cuda.synchronize()
    chk = check(inp, *full_out)
    full_ms = time_ms(rotating(inp, lambda q, kv: sparse_prefill(q, kv, idx, plan=full_plans[0], **B)))
    rows.append(dict(workload=a.workload, h=h, backend="cuda", name="full", ms=full_ms, **chk,
                     tiles=full_plans[0].stats["tiles"]))
    print(f"{a.workload} h={h:<3} full            {full_ms:.3f} ms  rel_err {chk['rel_err']:.2e}", flush=True)
    for C in map(int, a.chunks.split(",")):
        group = full_plans[0].group_size
        plans = plan_chunks(idx, h, s_kv=case.s_kv, chunk=C, split_private=False)
        bounds = chunk_bounds(case.s_q, C, group)
        alone = []
        for (q0, q1), pl in zip(bounds, plans):
            got = sparse_prefill(q[q0:q1], kv, idx[q0:q1], plan=pl, **B)
            torch.cuda.synchronize()
            same = all(torch.equal(x, y[q0:q1]) for x, y in zip(got, full_out))
            ms = time_ms(rotating(inp, lambda q, kv, q0=q0, q1=q1, pl=pl: sparse_prefill(q[q0:q1], kv, idx[q0:q1],
                                                                                       plan=pl, **B)))
            alone.append(ms)
            rows.append(dict(workload=a.workload, h=h, backend="cuda", name=f"chunk {q0}:{q1} alone", chunk=C, ms=ms,
                             same_bits_as_full=same, tiles=pl.stats["tiles"]))
            print(f"{a.workload} h={h:<3} chunk {q0:>5}:{q1:<5}  {ms:.3f} ms  tiles {pl.stats['tiles']}  "
                  f"same bits as full: {same}", flush=True)
        piped = sparse_prefill_pipelined(q, kv, idx, plans=plans, **B)
        torch.cuda.synchronize()
        same = all(torch.equal(x, y) for x, y in zip(piped, full_out))
        pipe_ms = time_ms(rotating(inp, lambda q, kv, plans=plans: sparse_prefill_pipelined(q, kv, idx, plans=plans,
                                                                                          **B)))
        rows.append(dict(workload=a.workload, h=h, backend="cuda", name=f"chunks/{C}", chunk=C, ms=pipe_ms,
                         sum_alone_ms=sum(alone), same_bits_as_full=same))
        print(f"{a.workload} h={h:<3} chunks/{C:<6}   {pipe_ms:.3f} ms  (sum alone {sum(alone):.3f}, full "
              f"{full_ms:.3f})  same bits as full: {same}", flush=True)
    inp = full_plans = plans = full_out = piped = None
    torch.cuda.empty_cache()
save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
