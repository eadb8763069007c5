"""``quilt-attn demo`` (``make demo``): a generated workload planned, run by QUILT and query-parallel, both checked
against the float32 reference, with the kv reduction and the timings: at full size on a GPU, at a tiny size in
Triton's CPU interpreter elsewhere (where the timings mean nothing)."""
from __future__ import annotations

import math
import sys
import time

import torch

from . import dispatch
from .api import sparse_prefill
from .cli_args import Progress, UsageError, check_merge_level, interpreting
from .dispatch import PlanSettings
from .planner import plan as make_plan
from .reference import sparse_prefill_reference
from .tolerances import CALL_REL_L2
from .workloads import generate

# full size on a GPU; a tiny problem on the CPU (Triton interpreter, 2 cores, seconds)
DEMO_GPU = dict(s_q=16384, s_kv=65536, topk=2048, heads=16, d_v=512, d_rope=64, dtype="bf16", tile=64)
DEMO_CPU = dict(s_q=32, s_kv=2048, topk=64, heads=8, d_v=64, d_rope=16, dtype="fp16", tile=16)
TOLERANCE = CALL_REL_L2  # relative L2 error of out against the float32 reference


def _check(out, lse, ref_out, ref_lse, tol: float) -> dict:
    o = out.float()
    err = float((o - ref_out).norm() / ref_out.norm().clamp_min(1e-30))
    fin = torch.isfinite(ref_lse)
    lse_err = float((lse - ref_lse)[fin].abs().max()) if bool(fin.any()) else 0.0
    nan = bool(torch.isnan(o).any())
    return {"rel_err": err, "lse_err": lse_err, "nan": nan, "ok": (not nan) and math.isfinite(err) and err <= tol}


def cmd_demo(args, log: Progress) -> int:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    base = DEMO_GPU if cuda else DEMO_CPU
    val = {k: (getattr(args, k) if getattr(args, k, None) is not None else v) for k, v in base.items()}
    s_q, s_kv, topk, h = val["s_q"], val["s_kv"], val["topk"], val["heads"]
    d_v, d_rope, dtype_name, tile = val["d_v"], val["d_rope"], val["dtype"], val["tile"]
    d_qk = d_v + d_rope
    if s_q > s_kv:
        raise UsageError(f"argument --s-q: s_q ({s_q}) must be <= --s-kv ({s_kv})")
    if h > 128:
        raise UsageError(f"argument --heads: the kernels take 1..128 heads, got {h}")
    if tile < 16:
        raise UsageError(f"argument --tile: the kernel needs a power of two >= 16, got {tile}")
    for name, v in (("--d-v", d_v), ("--d-rope", d_rope)):
        if v < 16:
            raise UsageError(f"argument {name}: the kernels need a power of two >= 16, got {v}")
    if not cuda and not interpreting():
        raise UsageError("no CUDA device and TRITON_INTERPRET is not 1: the Triton kernels cannot run "
                         "(unset TRITON_INTERPRET so that quilt-attn sets it, or set it to 1)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    tol = TOLERANCE[dtype_name]

    # the kernel module is imported here, after the command line set TRITON_INTERPRET (it picks the interpreter
    # when first imported)
    from .ops import sparse_attention as ops

    if not cuda and type(ops._sparse_attention_kernel).__name__ != "InterpretedFunction":
        raise UsageError("the Triton kernels were imported before TRITON_INTERPRET=1 was set, so they cannot "
                         "run on the CPU; run quilt-attn in a fresh process (or set TRITON_INTERPRET=1 first)")
    if not cuda and dtype == torch.bfloat16:
        print("warning: Triton's CPU interpreter computes bf16 dot products wrongly; expect the check to fail "
              "(use --dtype fp16 on the CPU)", file=sys.stderr)

    try:
        backend = dispatch.choose_backend(args.backend, torch.empty(1, h, d_qk, dtype=dtype, device=dev),
                                          torch.empty(1, d_qk, dtype=dtype, device=dev), d_v, tile=tile)
    except ValueError as err:
        raise UsageError(f"argument --backend: {err}") from None
    group_size = args.group_size if args.group_size is not None else ops.default_group_size(h)
    check_merge_level(args.merge_level, group_size)
    qp, hb = ops.program_shape(h, group_size)
    try:  # the plan sparse_prefill builds for this backend (CUDA: private rows stay in the 64-row tiles)
        plan_kw = dispatch.plan_settings(h, backend, PlanSettings(group_size=group_size, tile=tile,
                                                                  clip_threshold=args.clip_threshold,
                                                                  merge_level=args.merge_level))
    except ValueError as err:
        raise UsageError(f"argument --tile: {err}") from None
    merge_level = plan_kw["merge_level"]
    mode = ("GPU: " + torch.cuda.get_device_name()) if cuda else "CPU: Triton interpreter (TRITON_INTERPRET=1)"
    print(f"quilt-attn demo on {mode}")
    print(f"  workload {args.workload}: s_q={s_q} s_kv={s_kv} topk={topk} seed={args.seed}")
    print(f"  q [{s_q}, {h}, {d_qk}] {dtype_name}, kv [{s_kv}, {d_qk}] (d_qk = {d_v} + {d_rope}, d_v = {d_v}); "
          f"QUILT group_size={group_size} tile={tile} clip_threshold={args.clip_threshold} "
          f"merge_level={merge_level}; program = {qp} queries x {min(hb, h)} heads; backend {backend}")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    log(f"generating workload {args.workload} on {dev}")
    try:
        indices = generate(args.workload, s_q, s_kv, topk, seed=args.seed, device=dev)
    except ValueError as err:
        raise UsageError(f"workload {args.workload!r}: {err}") from None
    log("generating q and kv")
    g = torch.Generator(device=dev).manual_seed(args.seed + 1)
    q = torch.randn(s_q, h, d_qk, generator=g, device=dev, dtype=torch.float32).to(dtype)
    kv = torch.randn(s_kv, d_qk, generator=g, device=dev, dtype=torch.float32).to(dtype)

    log("planning" + (" (the first call compiles the Triton planner)" if cuda else " (torch planner)"))
    t0 = time.perf_counter()
    try:
        pl = make_plan(indices, s_kv=s_kv, **plan_kw)
        st = pl.stats
    except ValueError as err:
        raise UsageError(str(err)) from None
    plan_first_ms = (time.perf_counter() - t0) * 1e3

    results, first_ms = {}, {}
    for method in ("quilt", "query_parallel"):
        log(f"running {method}" + (" (Triton interpreter)" if not cuda else " (first call compiles)"))
        # the QUILT kernels themselves, even where sparse_prefill would fall back (reported below)
        kw = dict(plan=pl, settings=PlanSettings(fallback=False)) if method == "quilt" else {}
        t0 = time.perf_counter()
        try:
            results[method] = sparse_prefill(q, kv, indices, method=method, d_v=d_v, backend=backend, **kw)
        except ValueError as err:
            raise UsageError(f"{method}: {err}") from None
        sync()
        first_ms[method] = (time.perf_counter() - t0) * 1e3

    n_check = min(args.check_rows, s_q)
    log(f"float32 reference on {n_check} of {s_q} queries")
    rows = torch.randperm(s_q, generator=torch.Generator().manual_seed(123))[:n_check].to(dev)
    ref_out, _, ref_lse = sparse_prefill_reference(q[rows], kv, indices[rows], d_v=d_v, compute_dtype=torch.float32)
    checks = {m: _check(o[rows], lse[rows], ref_out, ref_lse, tol) for m, (o, _, lse) in results.items()}

    # KV reduction (the plan's logical rows and tiles against query-parallel's)
    valid = (indices >= 0) & (indices < s_kv)
    qp_pairs = int(valid.sum())
    qp_tiles = int(((valid.sum(1) + tile - 1) // tile).sum())
    _, ntiles = pl.work_list(qp)
    quilt_loads = int(ntiles.sum()) * math.ceil(h / hb)
    qp_loads = s_q * math.ceil(topk / 64) * math.ceil(h / ops.program_shape(h, 1)[1])

    print()
    print(f"check against the float32 reference ({n_check} of {s_q} queries; tolerance rel L2 err <= {tol:g} "
          f"for {dtype_name}):")
    for m, c in checks.items():
        print(f"  {m:<15} rel L2 err {c['rel_err']:.2e}   max |d lse| {c['lse_err']:.2e}"
              f"{'   NaN in output' if c['nan'] else ''}   {'OK' if c['ok'] else 'FAIL'}")
    print()
    print("KV reduction (plan statistics):")
    print(f"  kv rows processed : quilt {st['rows_processed']} vs query-parallel {qp_pairs} "
          f"-> {st['rows_processed'] / max(1, qp_pairs):.3f}x (reduction {st['reduction']:.1%})")
    print(f"  tiles of {tile:<9}: quilt {st['tiles']} vs query-parallel {qp_tiles} "
          f"-> {st['tiles'] / max(1, qp_tiles):.3f}x   (tile utilization {st['tile_utilization']:.1%}, "
          f"per level {st['tiles_per_level']})")
    priv_loads = (0 if pl.priv_n is None  # no private split (CUDA backend): those rows are in the tiles
                  else int(((pl.priv_n + 63) // 64).sum()) * math.ceil(h / ops.program_shape(h, 1)[1]))
    print(f"  kernel tile loads : quilt {quilt_loads} x {tile} rows shared + {priv_loads} x 64 rows private vs "
          f"query-parallel {qp_loads} x 64 rows -> gathered kv rows "
          f"{(quilt_loads * tile + priv_loads * 64) / max(1, qp_loads * 64):.3f}x")
    # sparse_prefill decides from the settings (dispatch.decide); the measured tile-cost rule is an opt-in
    # (fallback="cost"; the demo passes the resolved backend, so no automatic switch to Triton)
    runs = dispatch.decide(backend, "quilt", h, plan=pl)
    cost = dispatch.decide(backend, "quilt", h, PlanSettings(fallback="cost"), plan=pl, auto=args.backend == "auto")
    print(f"  sparse_prefill(method='quilt') at this size runs: "
          f"{'the QUILT kernels' if runs.quilt else 'query-parallel (one query fills a 64-row tile)'}; "
          f"the tile-cost rule (fallback='cost') would run "
          f"{'the QUILT kernels' if cost.quilt else 'query-parallel (sharing would not pay off)'}")
    print()
    if cuda:
        import triton.testing

        log("timing with triton.testing.do_bench (median)")

        def bench(fn):
            return float(triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median"))

        pkw = dict(s_kv=s_kv, **plan_kw)
        run = dict(d_v=d_v, backend=backend)
        t_plan = bench(lambda: make_plan(indices, **pkw))
        t_quilt = bench(lambda: sparse_prefill(q, kv, indices, method="quilt", plan=pl, **run))
        t_e2e = bench(lambda: sparse_prefill(q, kv, indices, method="quilt", plan=make_plan(indices, **pkw), **run))
        t_qp = bench(lambda: sparse_prefill(q, kv, indices, method="query_parallel", **run))
        flops = 2.0 * s_q * topk * h * (d_qk + d_v)
        print("timing (triton.testing.do_bench median; first call includes compilation):")
        print(f"  plan                  {t_plan:9.3f} ms")
        print(f"  quilt kernel          {t_quilt:9.3f} ms  ({flops / t_quilt / 1e9:6.1f} TFLOP/s useful)   "
              f"first call {first_ms['quilt']:.0f} ms")
        print(f"  quilt plan + kernel   {t_e2e:9.3f} ms")
        print(f"  query_parallel        {t_qp:9.3f} ms  ({flops / t_qp / 1e9:6.1f} TFLOP/s useful)   "
              f"first call {first_ms['query_parallel']:.0f} ms")
        print(f"  speedup vs query_parallel: kernel {t_qp / t_quilt:.2f}x, with planning {t_qp / t_e2e:.2f}x")
    else:
        print("timing (CPU, Triton interpreter: these times measure the interpreter and mean NOTHING about "
              "kernel speed):")
        print(f"  plan (torch planner)  {plan_first_ms:9.1f} ms wall")
        print(f"  quilt                 {first_ms['quilt']:9.1f} ms wall (one call)")
        print(f"  query_parallel        {first_ms['query_parallel']:9.1f} ms wall (one call)")
    print()
    failed = [m for m, c in checks.items() if not c["ok"]]
    if failed:
        print(f"demo: FAIL ({', '.join(failed)} above the {dtype_name} tolerance {tol:g})")
    else:
        print("demo: PASS (quilt and query_parallel match the reference)")
    log("done")
    return 1 if failed else 0
