"""A small run of the CUDA kernel for compute-sanitizer (memcheck / racecheck / synccheck).

    compute-sanitizer --tool memcheck  python benchmarks/run.py sanitize-cuda
    compute-sanitizer --tool racecheck python benchmarks/run.py sanitize-cuda [--strict-sync]

Launches only the sm_90a kernel (plan built by the torch planner on the CPU, so no Triton kernel
runs under the sanitizer): QUILT with a plan at h=16 and h=3, query-parallel with invalid indices
and topk_length at h=64, fp16 partial output, the FP8 cache widened in the kernel (QUILT and query-parallel); checks each against the float64 reference (exit 1 above a
relative L2 error of ``CALL_REL_L2["bf16"]``). Then the FP8 tensor-core mode through the public call (``precision="fp8"``: the
CUDA planner, q's quantization, the FP8 kernel and its repair pass, all CUDA), checked against its emulation
(``fp8_mode.sparse_prefill_fp8_kernel_reference``), the FP8 compaction's CUDA mark pass, and the public bf16 call (its launches chained) with a NaN
kv row, and on its short host path with a workspace, ``topk_length`` and ``attn_sink``. ``--out``: the rows as JSON (with GPU, commit, versions).

``--strict-sync`` runs the kernel built with QUILT_SANITIZER_SYNC: hand-offs racecheck can model
(rendezvous barriers, copies waited for) in place of bar.arrive and copy-completion mbarrier
arrivals. racecheck reports hazards at those two hand-offs in the default build; a clean report on
this build says the protocol itself has no race.
"""
from __future__ import annotations

import argparse
import sys

import torch

from quilt_attn import plan as make_plan
from quilt_attn import sparse_prefill, sparse_prefill_reference
from quilt_attn.fp8_mode import sparse_prefill_fp8_kernel_reference
from quilt_attn.kv_cache import dequantize_fp8, quantize_fp8
from quilt_attn.ops import cuda_backend
from quilt_attn.ops.sparse_attention import program_shape
from quilt_attn.tolerances import CALL_REL_L2, FP8_MODE_TOL
from quilt_attn.workloads import generate

# (heads, with a plan, kv dtype, persistent CTAs): None is one an SM, more than this run's work items; fewer make
# each CTA run several programs, the hand-over between them included; uint8 is the FP8 cache widened in the kernel
CASES = [(16, True, torch.bfloat16, None), (3, True, torch.bfloat16, 2), (64, False, torch.bfloat16, 3),
         (16, True, torch.float16, 1), (16, True, torch.uint8, 2), (64, False, torch.uint8, 3)]
# the FP8 tensor-core mode: (heads, method, non-finite q values); query programs with topk_length, a QUILT call
# with an odd head count, and non-finite q values (their queries recomputed by the exact repair pass)
FP8MMA_CASES = [(16, "quilt", False), (5, "quilt", False), (64, "query_parallel", False), (16, "quilt", True),
                (64, "query_parallel", True)]
FP8MMA_REL_L2 = FP8_MODE_TOL.rel_l2  # the kernel against its emulation


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strict-sync", action="store_true", help="the kernel built with QUILT_SANITIZER_SYNC")
    p.add_argument("--out", default=None, help="JSON file for the rows (optional)")
    a = p.parse_args(argv)
    if a.strict_sync:
        cuda_backend.use_library(cuda_backend.build(defines=("-DQUILT_SANITIZER_SYNC",)))
        print("kernel built with QUILT_SANITIZER_SYNC")

    torch.manual_seed(0)
    s_q, s_kv, topk = 32, 1024, 200
    idx_cpu = generate("glm53-like", s_q, s_kv, topk, seed=1)
    idx_cpu[3, :20] = -1
    idx_cpu[5, 7] = s_kv + 3
    idx = idx_cpu.cuda()
    kv = torch.randn(s_kv, 576, dtype=torch.bfloat16, device="cuda")
    cache = quantize_fp8(kv)
    rows = []
    for h, use_plan, kv_dtype, ctas in CASES:
        dtype = torch.bfloat16 if kv_dtype == torch.uint8 else kv_dtype
        q = torch.randn(s_q, h, 576, dtype=dtype, device="cuda")
        kvd = cache if kv_dtype == torch.uint8 else kv.to(dtype)
        dense = dequantize_fp8(cache).to(dtype) if kv_dtype == torch.uint8 else kvd
        out = torch.full((s_q, h, 512), float("nan"), dtype=dtype, device="cuda")
        ml = torch.full((s_q, h), float("nan"), device="cuda")
        lse = torch.full_like(ml, float("nan"))
        lengths = None
        if use_plan:
            cuda_backend.launch(q, kvd, 576**-0.5, out, ml, lse, plan=torch_plan_on_gpu(idx_cpu, s_kv, h), _ctas=ctas)
        else:
            lengths = torch.randint(0, topk + 10, (s_q,), dtype=torch.int32, device="cuda")
            cuda_backend.launch(q, kvd, 576**-0.5, out, ml, lse, indices=idx, topk_length=lengths, _ctas=ctas)
        torch.cuda.synchronize()
        ro, _, rl = sparse_prefill_reference(q.cpu(), dense.cpu(), idx_cpu, 576**-0.5, d_v=512,
                                             topk_length=None if lengths is None else lengths.cpu())
        err = float((out.cpu().double() - ro).norm() / ro.norm())
        nan = bool(out.isnan().any())
        rows.append(dict(h=h, plan=use_plan, dtype=str(dtype), kv=str(kv_dtype), ctas=ctas, rel_err=err, nan=nan,
                         strict_sync=a.strict_sync))
        print(f"h={h:<3} plan={use_plan!s:<5} ctas={ctas!s:<4} kv {str(kv_dtype):<15} rel-L2 {err:.2e}  nan={nan}")
    rows.append(repair_queue_case(idx_cpu, kv))
    rows.append(chained_call_case(idx_cpu, kv))
    rows.append(short_path_case(idx_cpu, kv))
    rows += [mark_rows_case(packed) for packed in (False, True)]
    rows += [fp8mma_case(h, method, idx, cache, nonfinite) for h, method, nonfinite in FP8MMA_CASES]
    return verdict(rows, a.out)


def fp8mma_case(h: int, method: str, idx, cache, nonfinite: bool = False) -> dict:
    """``sparse_prefill(precision="fp8")`` at ``h`` heads against the emulation of its arithmetic (NaN-poisoned
    outputs are the call's own: it allocates them): rel-L2 over the elements the emulation has finite, and
    ``nan`` when out's or lse's NaN differ from the emulation's. ``nonfinite``: an inf in one (query, head)'s
    latent and a NaN in another's rope (the emulation's NaN rows: the exact path's, step 5)."""
    s_q, topk = idx.shape
    q = torch.randn(s_q, h, 576, dtype=torch.bfloat16, device="cuda")
    if nonfinite:
        q[1, 0, 3], q[2, h - 1, 520] = float("inf"), float("nan")
    lengths = None
    if method == "query_parallel":
        lengths = torch.randint(0, topk + 10, (s_q,), dtype=torch.int32, device="cuda")
    out, ml, lse = sparse_prefill(q, cache, idx, 576**-0.5, precision="fp8", method=method, topk_length=lengths)
    torch.cuda.synchronize()
    want, _, want_lse = sparse_prefill_fp8_kernel_reference(q.cpu(), cache.cpu(), idx.cpu(), 576**-0.5,
                                                             topk_length=None if lengths is None else lengths.cpu())
    o, w = out.cpu().double(), want.double()
    fin = w.isfinite()
    err = float((o - w)[fin].norm() / w[fin].norm())
    nan = not (torch.equal(o.isnan(), w.isnan()) and torch.equal(lse.cpu().isnan(), want_lse.isnan()))
    print(f"fp8 mode h={h:<3} {method:<15} non-finite q {nonfinite!s:<5} rel-L2 against its emulation {err:.2e}  "
          f"NaN differ={nan}")
    return dict(h=h, plan=method == "quilt", dtype="bfloat16", kv="fp8 cache, precision=fp8", ctas=None,
                rel_err=err, nan=nan, strict_sync=False, bound=FP8MMA_REL_L2, nonfinite_q=nonfinite)


def chained_call_case(idx_cpu, kv) -> dict:
    """The public bf16 call at h = 16 as an engine makes it (the CUDA planner, then the order kernel, the attention
    and the repair pass as chained launches, their work counters the repair queue's spare words), with a NaN in a kv
    row that one query selects: that query NaN, every other one equal to the float64 reference (its tile partners
    recomputed by the chained repair pass). A row: rel-L2 over the other queries; ``nan`` when the NaNs differ."""
    from quilt_bench.bench import rows_selected_once

    s_q, h = idx_cpu.shape[0], 16
    kv = kv.clone()
    bad = rows_selected_once(idx_cpu, kv.shape[0], 1)
    kv[bad.cuda(), 9] = float("nan")
    q = torch.randn(s_q, h, 576, dtype=kv.dtype, device="cuda")
    assert cuda_backend.CHAIN_LAUNCHES
    out, _, _ = sparse_prefill(q, kv, idx_cpu.cuda(), 576**-0.5, backend="cuda")
    torch.cuda.synchronize()
    ro, _, _ = sparse_prefill_reference(q.cpu(), kv.cpu(), idx_cpu, 576**-0.5, d_v=512)
    selecting = (idx_cpu == bad).any(1)
    o = out.cpu().double()
    err = float((o[~selecting] - ro[~selecting]).norm() / ro[~selecting].norm())
    nan = not (torch.equal(o.isnan().flatten(1).any(1), selecting) and bool(o[selecting].isnan().any()))
    print(f"chained call h={h} (NaN row of {int(selecting.sum())} query): rel-L2 of the others {err:.2e}  "
          f"NaN differ={nan}")
    return dict(h=h, plan=True, dtype=str(kv.dtype), kv="bf16 with a NaN row, chained launches", ctas=None,
                rel_err=err, nan=nan, strict_sync=False)


def short_path_case(idx_cpu, kv) -> dict:
    """The public bf16 call at h = 8 on its short host path (``ops/cuda_call.py``: the planner writing into the
    caller's workspace, the order kernel, the attention and the repair pass launched from addresses), with
    ``topk_length`` and ``attn_sink``, against the float64 reference. A row: rel-L2 of out."""
    from quilt_attn import dispatch
    from quilt_attn.ops import cuda_call

    s_q, topk, h = idx_cpu.shape[0], idx_cpu.shape[1], 8
    q = torch.randn(s_q, h, 576, dtype=kv.dtype, device="cuda")
    lengths = torch.randint(0, topk + 10, (s_q,), dtype=torch.int32)
    sink = torch.randn(h, dtype=torch.float32)
    ws = torch.empty(dispatch.workspace_bytes(s_q, topk, h, s_kv=kv.shape[0], backend="cuda"), dtype=torch.uint8,
                     device="cuda")
    taken = []
    real_run = cuda_call.run
    cuda_call.run = lambda *a, **k: taken.append(real_run(*a, **k)) or taken[-1]
    try:
        out, _, _ = sparse_prefill(q, kv, idx_cpu.cuda(), 576**-0.5, topk_length=lengths.cuda(), attn_sink=sink.cuda(),
                                   workspace=ws)
    finally:
        cuda_call.run = real_run
    torch.cuda.synchronize()
    ro, _, _ = sparse_prefill_reference(q.cpu(), kv.cpu(), idx_cpu, 576**-0.5, d_v=512, topk_length=lengths,
                                        attn_sink=sink)
    err = float((out.cpu().double() - ro).norm() / ro.norm())
    nan = bool(out.isnan().any()) or not (taken and taken[-1] is not None)
    print(f"short path h={h} (workspace, topk_length, attn_sink): rel-L2 {err:.2e}  nan or not taken={nan}")
    return dict(h=h, plan=True, dtype=str(kv.dtype), kv="bf16, the call's short host path", ctas=None,
                rel_err=err, nan=nan, strict_sync=False)


def mark_rows_case(packed: bool) -> dict:
    """The FP8 compaction's CUDA mark pass (``cuda_backend.mark_rows``) over words of two CTAs' spans and a part,
    invalid, padding and out-of-pool words among them, rows shared by neighbouring lists and rows past what a CTA's
    hash set holds. A row: ``rel_err`` 0 when the marks equal the referenced rows exactly."""
    s_kv = 1 << 20
    g = torch.Generator(device="cuda").manual_seed(3)
    words = torch.cat([torch.randint(0, 3000, (40000,), device="cuda", generator=g, dtype=torch.int32),
                       torch.randint(0, s_kv, (30000,), device="cuda", generator=g, dtype=torch.int32)])
    words[::53] = -1
    words[7::61] = s_kv + 1
    if packed:
        words = torch.where(words >= 0, words | (5 << 24), words)
    rows_ = (words & 0xFFFFFF) if packed else words
    want = torch.zeros(s_kv, dtype=torch.uint8, device="cuda")
    want[rows_[(rows_ >= 0) & (rows_ < s_kv)].long()] = 1
    got = torch.zeros_like(want)
    cuda_backend.mark_rows(words, s_kv, got, packed)
    torch.cuda.synchronize()
    ok = torch.equal(got, want)
    print(f"mark rows packed={packed!s:<5} {words.numel()} words, {int(want.sum())} rows: {'OK' if ok else 'DIFFER'}")
    return dict(h=0, plan=packed, dtype="int32", kv="FP8 compaction marks", ctas=None, rel_err=0.0 if ok else 1.0,
                nan=False, strict_sync=False)


def torch_plan_on_gpu(idx_cpu, s_kv: int, h: int):
    """The plan of ``idx_cpu`` at ``h`` heads (no private split) built by the torch planner on the CPU, so that no
    Triton kernel runs under the sanitizer, with its tensors moved to the GPU."""
    p = make_plan(idx_cpu, s_kv=s_kv, merge_level=program_shape(h, 8)[0], split_private=False, backend="torch")
    return type(p)(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in p.__dict__.items()
                      if not k.startswith("_")})


def repair_queue_case(idx_cpu, kv) -> dict:
    """The epilogue's repair queue (``Params::repair``): a NaN in kv rows that one query selects reaches its tile
    partners, whose queries the kernel queues, each once (only the CUDA kernel runs: the queue is checked here,
    not repaired). A row: ``rel_err`` 0 when the queue holds exactly the queries whose output has a NaN."""
    from quilt_attn.ops.sparse_attention import repair_buffer
    from quilt_bench.bench import rows_selected_once

    s_q, h = idx_cpu.shape[0], 16
    kv = kv.clone()
    kv[rows_selected_once(idx_cpu, kv.shape[0], 2).cuda(), 5] = float("nan")
    q = torch.randn(s_q, h, 576, dtype=kv.dtype, device="cuda")
    p_ = torch_plan_on_gpu(idx_cpu, kv.shape[0], h)
    out = torch.full((s_q, h, 512), float("nan"), dtype=kv.dtype, device="cuda")
    ml, lse = torch.empty(s_q, h, device="cuda"), torch.empty(s_q, h, device="cuda")
    buf = repair_buffer(s_q, "cuda")
    cuda_backend.launch(q, kv, 576**-0.5, out, ml, lse, plan=p_, repair=buf, _ctas=3)
    torch.cuda.synchronize()
    buf = buf.cpu()
    n = int(buf[0])
    queued = sorted(buf[1 + s_q:1 + s_q + n].tolist())
    want = sorted(out.isnan().flatten(1).any(1).nonzero().flatten().tolist())
    flags = sorted(buf[1:1 + s_q].nonzero().flatten().tolist())
    ok = queued == want == flags and len(want) > 0
    print(f"repair queue: {n} queued, {len(want)} queries with a NaN, flags {len(flags)}: {'OK' if ok else 'DIFFER'}")
    return dict(h=h, plan=True, dtype=str(kv.dtype), kv="bf16 with NaN rows", ctas=3, rel_err=0.0 if ok else 1.0,
                nan=False, strict_sync=False, queued=n)


def verdict(rows: list[dict], out: str | None) -> int:
    """A sanitizer case's end: the rows saved to ``out`` (optional), exit 1 if a result was off (relative L2
    error at or above the row's ``bound``, ``CALL_REL_L2["bf16"]`` where it has none, or a NaN), else 0."""
    if out:
        from quilt_bench.bench import save

        save(rows, out, {"command": "python " + " ".join(sys.argv)})
    worst = max(r["rel_err"] for r in rows)
    if any(r["rel_err"] >= r.get("bound", CALL_REL_L2["bf16"]) for r in rows) or any(r["nan"] for r in rows):
        print(f"sanitize case FAILED: worst rel-L2 {worst:.2e}")
        return 1
    print("sanitize case OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
