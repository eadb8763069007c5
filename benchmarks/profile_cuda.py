"""One CUDA-kernel launch to profile under Nsight Compute (glm53-like, bf16, s_kv 65536, topk 2048; --fp8: the
FP8 cache widened in the kernel).

    ncu --set full --import-source no -k regex:quilt_sm90 -c 1 -o prof python benchmarks/run.py profile --h 64
    ncu --set full --import-source no -k regex:plan_kernel -c 1 -o prof python benchmarks/run.py profile --plan
      (the planner kernel at the settings a default call at --h heads plans with; without ncu it prints the kernel's and plan()'s times)
    python benchmarks/run.py profile --summarize prof.ncu-rep   # hottest SASS lines by warp stall samples
"""
import argparse
import csv
import io
import subprocess
import sys


def summarize(a) -> int:
    """Print the stall summary of an .ncu-rep file (``--summarize``)."""
    txt = subprocess.run(["ncu", "-i", a.summarize, "--page", "source", "--csv", "--print-source", "sass"],
                         capture_output=True, text=True).stdout
    lines = txt.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"Address"') or ln.startswith('"#"')), None)
    if start is None:
        print(txt[:3000])
        return 1
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    cols = list(rows[0])
    key = next(k for k in cols if k.startswith("Warp Stall Sampling (All"))
    reasons = [k for k in cols if k.startswith("stall_")] or [k for k in cols if "stall" in k.lower() and k != key]
    total = sum(float(r[key] or 0) for r in rows)
    base = int(rows[0]["Address"], 16)  # offsets match cuobjdump -sass of the same build
    print(f"{len(rows)} SASS lines, {total:.0f} stall samples")
    if a.regions:  # a kernel's phases end at __syncthreads: instructions and stalls phase by phase
        ikey = next((k for k in cols if k.startswith("Instructions Executed")), None)
        itot = sum(float(r[ikey] or 0) for r in rows) if ikey else 0.0
        start, inst, st = 0, 0.0, 0.0
        for r in rows:
            inst += float(r[ikey] or 0) if ikey else 0.0
            st += float(r[key] or 0)
            if "BAR" in r.get("Source", "") or r is rows[-1]:
                off = int(r["Address"], 16) - base
                print(f"{start:#07x}-{off:#07x}  instructions {inst / max(itot, 1):6.1%}  stalls {st / total:6.1%}  "
                      f"ends with {r.get('Source', '')[:40]}")
                start, inst, st = off, 0.0, 0.0
        if not ikey:
            print("no instruction counts; columns:", cols)
        return 0
    for r in sorted(rows, key=lambda r: -float(r[key] or 0))[:a.top]:
        top = sorted(((float(r[k] or 0), k) for k in reasons), reverse=True)[:2]
        why = " ".join(f"{k.replace('stall_', '')}={v / max(float(r[key] or 1), 1):.0%}" for v, k in top if v)
        print(f"{float(r[key] or 0) / total:6.1%}  {int(r['Address'], 16) - base:#07x}  {r.get('Source', '')[:70]:<70} {why}")
    return 0


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--h", type=int, default=64)
    p.add_argument("--s-q", type=int, default=4096)
    p.add_argument("--skip", type=int, default=0, help="0 full, 1 no gather, 2 no matmul, 3 neither")
    p.add_argument("--workload", default="glm53-like")
    p.add_argument("--ctas", type=int, default=None, help="persistent CTAs (default one an SM; 0: one a work item)")
    p.add_argument("--summarize", default=None, help="an .ncu-rep file: print the stall summary instead")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--plan", action="store_true", help="the planner kernel instead of attention")
    p.add_argument("--fp8", action="store_true", help="kv as the FP8 cache, widened in the kernel")
    p.add_argument("--regions", action="store_true",
                   help="with --summarize: totals between consecutive barriers (BAR) instead of the hottest lines")
    a = p.parse_args(argv)
    if a.summarize:
        return summarize(a)
    import torch

    from quilt_attn import plan as make_plan
    from quilt_attn.ops import cuda_backend
    from quilt_attn.ops.sparse_attention import program_shape
    from quilt_attn.workloads import generate

    torch.manual_seed(0)
    idx = generate(a.workload, a.s_q, 65536, 2048, seed=7, device="cuda")
    if a.plan:
        import triton

        from quilt_attn.planner.buffers import plan_buffers

        from quilt_attn import dispatch

        kw = dispatch.plan_settings(a.h, "cuda")  # the plan a default call at h heads builds
        G, M = kw["group_size"], kw["merge_level"]
        buf = plan_buffers(a.s_q, 2048, G, M, 64, False, idx.device)
        thr = kw["clip_threshold"] * 64
        run = lambda: cuda_backend.launch_plan(idx, None, 65536, G, M, 64, thr, False, False, buf)  # noqa: E731
        run()
        torch.cuda.synchronize()
        t_kernel = triton.testing.do_bench(run, warmup=5, rep=40, return_mode="median")
        t_plan = triton.testing.do_bench(lambda: make_plan(idx, s_kv=65536, backend="cuda", **kw), warmup=5,
                                         rep=40, return_mode="median")
        print(f"planner kernel {t_kernel:.3f} ms, plan() {t_plan:.3f} ms (s_q {a.s_q}, group {G}, merge {M})")
        return 0
    q = torch.randn(a.s_q, a.h, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(65536, 576, device="cuda", dtype=torch.bfloat16)
    kv_in = kv
    if a.fp8:  # the kernel reads the cache; the reference its bf16 dequantization (the same values)
        from quilt_attn.kv_cache import dequantize_fp8, quantize_fp8

        kv_in = quantize_fp8(kv)
        kv = dequantize_fp8(kv_in)
    qp = program_shape(a.h, 8)[0]
    kw = dict(plan=make_plan(idx, s_kv=65536, merge_level=qp, split_private=False)) if qp > 1 else dict(indices=idx)
    out = torch.full((a.s_q, a.h, 512), float("nan"), dtype=q.dtype, device="cuda")
    ml = torch.empty(a.s_q, a.h, dtype=torch.float32, device="cuda")
    lse = torch.empty_like(ml)
    ctas = a.ctas if a.ctas != 0 else cuda_backend.work_items(a.h, a.s_q, kw.get("plan"))
    cuda_backend.launch(q, kv_in, 576**-0.5, out, ml, lse, _skip=a.skip, _ctas=ctas, **kw)
    torch.cuda.synchronize()
    if a.skip == 0:  # the launch checked against the float32 reference on sampled queries (after the profiled kernel)
        from quilt_attn.reference import sparse_prefill_reference

        rows = torch.randperm(a.s_q, generator=torch.Generator().manual_seed(123))[:256].to("cuda")
        ro, _, _ = sparse_prefill_reference(q[rows], kv, idx[rows], compute_dtype=torch.float32)
        err = float((out[rows].float() - ro).norm() / ro.norm())
        print(f"h={a.h} s_q={a.s_q} {a.workload}: rel_err {err:.2e} on 256 sampled queries")
        from quilt_attn.tolerances import CALL_REL_L2

        return 0 if err < CALL_REL_L2["bf16"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
