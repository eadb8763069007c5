"""Does planning chunk i+1 on a side stream while chunk i attends hide the planner? (issue 3)

For each (workload, h) at s_q 16384, s_kv 65536, Top-2048, bf16, and each attention backend, with the
API's default plan settings for that backend (group and merge level 64 // h, tile 64, clip threshold 0.5;
private rows split off on Triton, not on CUDA, whose tiles are all 64-row products):

  attn          (a) attention alone, prebuilt unchunked plan
  plan          (b) the unchunked plan alone
  serial        (c) plan then attention on one stream (``sparse_prefill`` without a plan)
  pipe/C        (d) ``sparse_prefill_pipelined(chunk=C)``; at C = 4096 also a 1024-query first chunk, and
                    on Triton: a normal-priority planning stream, the planner at 1 program an SM, and
                    fallback=False (no per-chunk host sync; the CUDA backend makes none anyway)
  chunks/C      (e) attention alone on prebuilt chunk plans: what chunking costs without any planning

Backends (``--backends``): ``triton`` at every ``--chunks``, ``cuda`` (the sm_90a kernel) at
``--cuda-chunks`` only, to keep the run short. Each row records its backend; ratios are to (a) of the
same backend.

Times: median of ``triton.testing.do_bench`` over two rotating q / kv input sets (``quilt_attn.bench``);
inputs and plans for (a) / (e) are built outside the timed region. The outputs of (c) and (d) are checked
against the float32 reference on sampled queries (``quilt_attn.bench.check``) and compared bit for bit
with (a) of the same backend. The issue's bar: pipe/attn <= 1.05.

Usage: PYTHONPATH=$PWD python benchmarks/plan_overlap.py --out $OUT/plan_overlap.json
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import quilt_attn.planner.triton_plan as triton_plan
from quilt_attn import plan as make_plan
from quilt_attn import sparse_prefill, sparse_prefill_pipelined
from quilt_attn.bench import Case, check, make_inputs, rotating, save, time_ms
from quilt_attn.dispatch import decide
from quilt_attn.ops.sparse_attention import default_group_size, program_shape
from quilt_attn.pipeline import plan_chunks

WARMUP_MS, REP_MS = 25, 200  # per timing; 4 cases x (13 Triton + 8 CUDA) timings
BACKENDS = ("triton", "cuda")


def measure(inputs, backend, name, call, *, baseline=None, check_rows=0, rows=None, **fields):
    """Time ``call``; optionally check its set-0 outputs (reference, and bits against ``baseline``)."""
    q, kv = inputs.sets[0]
    row = {"workload": inputs.case.workload, "h": inputs.case.h, "backend": backend, "name": name, **fields}
    if check_rows or baseline is not None:
        got = call(q, kv)
        torch.cuda.synchronize()
        if check_rows:
            row.update(check(inputs, *got, n_check=check_rows))
        if baseline is not None:
            row["same_bits_as_attn"] = all(torch.equal(a, b) for a, b in zip(got, baseline))
        del got
    row["ms"] = time_ms(rotating(inputs, call), warmup=WARMUP_MS, rep=REP_MS)
    if rows is not None:
        rows.append(row)
    return row


def run_case(inputs, backend, chunks, check_rows, log) -> list[dict]:
    """The rows of one (workload, h) on one backend; ``chunks``: the chunk sizes of (d) / (e)."""
    c = inputs.case
    triton = backend == "triton"
    G = default_group_size(c.h)
    M = program_shape(c.h, G)[0]
    # the plans sparse_prefill builds for this backend (the CUDA kernel splits no private rows off)
    pkw = dict(s_kv=c.s_kv, group_size=G, tile=64, clip_threshold=0.5, merge_level=M, split_private=triton)
    B = dict(backend=backend)
    idx = inputs.indices
    rows: list[dict] = []

    def run(name, call, **kw):
        row = measure(inputs, backend, name, call, rows=rows, **kw)
        log(row)
        return row

    full = make_plan(idx, **pkw)
    # what sparse_prefill runs for this plan (decided from the settings: no host sync)
    quilt_full = decide(backend, "quilt", c.h, plan=full).quilt
    q, kv = inputs.sets[0]
    base = sparse_prefill(q, kv, idx, plan=full, **B)
    torch.cuda.synchronize()
    a = run("attn", lambda q, kv: sparse_prefill(q, kv, idx, plan=full, **B), check_rows=check_rows,
            runs_quilt=quilt_full)
    run("plan", lambda q, kv: make_plan(idx, **pkw))
    run("serial", lambda q, kv: sparse_prefill(q, kv, idx, **B), baseline=base, check_rows=check_rows)
    del full

    for C in chunks:
        plans = plan_chunks(idx, c.h, chunk=C, **pkw)
        decided = {"chunks_quilt": [decide(backend, "quilt", c.h, plan=p).quilt for p in plans]}
        run(f"chunks/{C}", lambda q, kv: sparse_prefill_pipelined(q, kv, idx, plans=plans, **B), chunk=C, **decided)
        del plans
        run(f"pipe/{C}", lambda q, kv: sparse_prefill_pipelined(q, kv, idx, chunk=C, **B), baseline=base,
            check_rows=check_rows, chunk=C, **decided)

    C = 4096 if 4096 in chunks else chunks[0]
    variants = [(f"pipe/{C} first 1024", dict(first_chunk=1024))]
    # CUDA: the first-chunk variant only, to keep the run short (its pipeline makes no host sync, so a
    # fallback=False variant would time the same calls)
    if triton:
        normal = torch.cuda.Stream(priority=0)
        variants += [
            (f"pipe/{C} normal-priority stream", dict(plan_stream=normal)),
            (f"pipe/{C} planner 1 prog/SM", dict(_progs_per_sm=1)),
            (f"pipe/{C} fallback=False", dict(fallback=False)),
        ]
    for name, kw in variants:
        pps = kw.pop("_progs_per_sm", None)
        saved = triton_plan.PLAN_PROGS_PER_SM
        if pps is not None:
            triton_plan.PLAN_PROGS_PER_SM = pps
        try:
            run(name, lambda q, kv: sparse_prefill_pipelined(q, kv, idx, chunk=C, **kw, **B), baseline=base,
                check_rows=check_rows, chunk=C, **{k: str(v) for k, v in kw.items()},
                **({"plan_progs_per_sm": pps} if pps else {}))
        finally:
            triton_plan.PLAN_PROGS_PER_SM = saved
    for r in rows:
        r["ratio_to_attn"] = r["ms"] / a["ms"]
    return rows


def table(rows) -> str:
    """Ratios to attention alone (a) of the same backend: a column a (workload, h), a block of lines a backend,
    a line a configuration."""
    cases = list(dict.fromkeys((r["workload"], r["h"]) for r in rows))
    by = {(r["backend"], r["workload"], r["h"], r["name"]): r for r in rows}
    w = 17
    out = ["ratio to (a) attention alone of the same backend; the issue's bar for (d): <= 1.05",
           f"{'':<44}" + "".join(f"{f'{wl} h={h}':>{w}}" for wl, h in cases)]
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        chunks = list(dict.fromkeys(r["chunk"] for r in mine if r["name"].startswith("chunks/")))
        names = ["serial"] + [f"pipe/{C}" for C in chunks] + [f"chunks/{C}" for C in chunks]
        names += list(dict.fromkeys(r["name"] for r in mine if " " in r["name"]))
        label = {"serial": "(c) serial plan + attn"} | {f"pipe/{C}": f"(d) pipelined, chunk {C}" for C in chunks} \
            | {f"chunks/{C}": f"(e) attn alone, chunk {C}" for C in chunks}
        out.append(f"-- backend {backend}")
        for key, what in (("attn", "(a) attention alone, ms"), ("plan", "(b) plan alone, ms")):
            cells = [by.get((backend, wl, h, key)) for wl, h in cases]
            out.append(f"{what:<44}" + "".join(f"{c['ms']:>{w}.3f}" if c else f"{'-':>{w}}" for c in cells))
        for n in names:
            cells = [by.get((backend, wl, h, n)) for wl, h in cases]
            out.append(f"{label.get(n, '(d) ' + n):<44}"
                       + "".join(f"{c['ratio_to_attn']:>{w}.3f}" if c else f"{'-':>{w}}" for c in cells))
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON path for the rows, environment and command line")
    p.add_argument("--workloads", default="glm53-like,ds32-like")
    p.add_argument("--heads", default="8,16")
    p.add_argument("--backends", default="triton,cuda", help="attention backends, of: " + ",".join(BACKENDS))
    p.add_argument("--chunks", default="2048,4096,8192", help="chunk sizes (queries) on the Triton backend")
    p.add_argument("--cuda-chunks", default="4096,8192", help="chunk sizes on the CUDA backend")
    p.add_argument("--check-rows", type=int, default=256, help="queries checked against the reference")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("plan_overlap.py needs a CUDA GPU")
    backends = a.backends.split(",")
    if not set(backends) <= set(BACKENDS):
        sys.exit(f"--backends: each of {BACKENDS}, got {a.backends!r}")
    chunks = {"triton": [int(x) for x in a.chunks.split(",")], "cuda": [int(x) for x in a.cuda_chunks.split(",")]}
    extra = {"command": "python " + " ".join(sys.argv), "warmup_ms": WARMUP_MS, "rep_ms": REP_MS,
             "backends": backends, "chunks": {b: chunks[b] for b in backends}, "s_q": 16384, "s_kv": 65536,
             "topk": 2048, "dtype": "bf16"}
    t0 = time.time()
    if "cuda" in backends:  # say why at once rather than after the Triton rows of the first case
        from quilt_attn.ops import cuda_backend

        reason = cuda_backend.unavailable_reason(torch.device("cuda"))
        if reason:
            sys.exit(f"--backends cuda: {reason} (or run --backends triton)")
        cuda_backend.build()  # nvcc on first use, ~10 s: here, not inside a case
        print(f"[{time.time() - t0:6.1f}s] CUDA backend library ready", flush=True)

    def log(r):
        keys = ("rel_err", "lse_err", "same_bits_as_attn", "chunks_quilt")
        more = " ".join(f"{k}={r[k]:.2e}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys if k in r)
        print(f"[{time.time() - t0:6.1f}s] {r['workload']:<11} h={r['h']:<3} {r['backend']:<6} {r['name']:<34} "
              f"{r['ms']:8.3f} ms  {more}", flush=True)

    rows: list[dict] = []
    for wl in a.workloads.split(","):
        for h in (int(x) for x in a.heads.split(",")):
            inputs = make_inputs(Case(wl, h))
            for backend in backends:
                rows += run_case(inputs, backend, chunks[backend], a.check_rows, log)
                save(rows, a.out, extra)  # after every case: a cut-short run keeps what it measured
            del inputs
            torch.cuda.empty_cache()
    print(f"\ntotal {time.time() - t0:.0f} s; rows in {a.out}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
