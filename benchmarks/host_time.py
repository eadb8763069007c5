"""Host (Python + launch) time of plan() and of the pipelined call against their GPU time (issue 3).

A call whose host work takes longer than its GPU work leaves the GPU idle between launches; do_bench
then times the host. For each call: ``host`` = wall time to enqueue it (no synchronization inside,
median of 20 calls each after a device sync), ``gpu`` = do_bench median. glm53-like, s_q 16384,
s_kv 65536, topk 2048, bf16, CUDA backend. Each attention call's output is checked against the float32
reference on sampled queries first.

    python benchmarks/host_time.py --out host.json
"""
import argparse
import statistics
import sys
import time

import torch

from quilt_attn import sparse_prefill, sparse_prefill_pipelined
from quilt_attn.bench import Case, check, cuda_work, make_inputs, save, time_ms

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--out", required=True)
p.add_argument("--h", default="8,16")
p.add_argument("--chunks", default="2048,4096,8192")
a = p.parse_args()


def host_ms(fn, n=20):
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


rows = []
for h in map(int, a.h.split(",")):
    inp = make_inputs(Case("glm53-like", h), n_sets=1)
    q, kv = inp.sets[0]
    idx = inp.indices
    calls = [("plan", lambda: cuda_work(inp, h)),  # the plan sparse_prefill(backend="cuda") builds
             ("serial", lambda: sparse_prefill(q, kv, idx, backend="cuda"))]
    calls += [(f"pipe/{C}", lambda C=C: sparse_prefill_pipelined(q, kv, idx, chunk=C, backend="cuda"))
              for C in map(int, a.chunks.split(","))]
    for name, fn in calls:
        got = fn()
        torch.cuda.synchronize()
        # the attention calls' outputs against the float32 reference (plan(): nothing to check)
        chk = check(inp, *got) if name != "plan" else {}
        r = dict(workload="glm53-like", h=h, backend="cuda", name=name, host_ms=host_ms(fn),
                 gpu_ms=time_ms(fn, warmup=20, rep=100), **chk)
        rows.append(r)
        print(f"h={h:<3} {name:<10} host {r['host_ms']:.3f} ms  do_bench {r['gpu_ms']:.3f} ms", flush=True)
save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
