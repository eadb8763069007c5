"""GPU time per kernel of one ``sparse_prefill`` call (torch profiler): where a call's time goes beside the attention.

Cases: bf16 kv of a 64K context and an FP8 pool of 4M rows (slot ids, ``engine_shapes.SHAPES["pool-4M"]``),
GLM-5.3-like, s_q 16384, h = 16 and 8 (``--heads``), default arguments. Ten calls are profiled after five warm-up calls; each
kernel's device time is averaged over them. The call's output is checked against the float32 reference on
sampled queries first (``rel_err`` printed; exit 1 above ``CALL_REL_L2`` or on a NaN).

With ``--timeline SHAPES`` (engine shapes, e.g. ``pool-4M,chunk-prefix``; bf16 pools) it prints instead, per shape
and h, the GPU operations of one call in order (start, duration, gap before it) and the host's time a call:
enqueueing 20 calls without waiting, and the same calls waited for. ``--host`` adds, per shape and h, the host time
of the call and of its pieces (the planner, each launch, the allocations; the call also through the general path,
``ops/cuda_call.py``'s short host path off), each timed over 50 calls while a sleep kernel holds the GPU, so that
nothing the host does waits on it (the least of three rounds).

    python benchmarks/run.py call-breakdown [--out F.txt] [--timeline pool-4M,chunk-prefix [--host]]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import quilt_attn
from engine_shapes import SHAPES, paged_indices, switched_off
from quilt_attn.kv_cache import quantize_fp8
from quilt_attn.tolerances import CALL_REL_L2
from quilt_attn.workloads import generate
from quilt_bench.bench import Case, Inputs, check, environment


def profile(call, calls: int = 10) -> tuple[dict, float, int]:
    """``({kernel name: us a call}, span us a call, launches a call)`` of ``call`` (after five warm-up calls)."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    tot = {}
    for e in ev:
        tot[e.name[:70]] = tot.get(e.name[:70], 0.0) + e.device_time / calls
    span = (max(e.time_range.end for e in ev) - min(e.time_range.start for e in ev)) / calls
    return tot, span, len(ev) // calls


def timeline(call) -> list[str]:
    """The GPU operations of one ``call`` in launch order (the middle of three profiled calls) and the host's time."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    n = len(ev) // 3
    ev = ev[n:2 * n]
    t0 = prev = ev[0].time_range.start
    lines = [f"  {n} GPU operations, span {ev[-1].time_range.end - t0:.1f} us"]
    for e in ev:
        lines.append(f"  start {e.time_range.start - t0:8.1f}  dur {e.device_time:8.1f}  gap {e.time_range.start - prev:6.1f}"
                     f"  {e.name[:80]}")
        prev = e.time_range.end
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        call()
    enqueue = (time.perf_counter() - t) / 20
    torch.cuda.synchronize()
    waited = (time.perf_counter() - t) / 20
    lines.append(f"  host: {enqueue * 1e3:.3f} ms a call to enqueue, {waited * 1e3:.3f} ms a call waited for")
    return lines


def host_parts(q, kv, idx) -> list[str]:
    """Host microseconds a call of the default call and of its pieces, the GPU held busy (see the docstring)."""
    from quilt_attn import dispatch
    from quilt_attn.ops import cuda_backend as cb
    from quilt_attn.ops import cuda_call
    from quilt_attn.ops import sparse_attention as sa

    s_q, h, _ = q.shape
    pkw = dispatch.plan_settings(h, "cuda")
    plan = quilt_attn.plan(idx, s_kv=kv.shape[0], **pkw)
    out, ml, lse = sa.alloc_outputs(q, 512)
    queue = sa.repair_buffer(s_q, q.device)
    scale = 576 ** -0.5
    parts = {
        "the call": lambda: quilt_attn.sparse_prefill(q, kv, idx),
        # (ops/cuda_call.py's short host path off)
        "the call, general path": lambda: switched_off(cuda_call, "ENABLED", quilt_attn.sparse_prefill, q, kv, idx),
        "the call, plan given": lambda: quilt_attn.sparse_prefill(q, kv, idx, plan=plan),
        "plan()": lambda: quilt_attn.plan(idx, s_kv=kv.shape[0], **pkw),
        "tile pass launch (CUDA)": lambda: cb.launch(q, kv, scale, out, ml, lse, plan=plan, repair=queue),
        "repair pass launch (CUDA)": lambda: cb.launch(q, kv, scale, out, ml, lse, indices=idx, queue=queue),
        "repair pass launch (Triton)": lambda: sa._launch(q, kv, scale, 512, out, ml, lse, indices=idx, repair=queue,
                                                          repair_pass=True),
        "repair_buffer": lambda: sa.repair_buffer(s_q, q.device),
        "alloc_outputs": lambda: sa.alloc_outputs(q, 512),
        "natural_log_stats": lambda: dispatch.natural_log_stats(ml, lse),
        "torch.empty": lambda: torch.empty(1, dtype=torch.int32, device=q.device),
    }
    for fn in parts.values():
        for _ in range(3):
            fn()
    best = {}
    for _ in range(3):
        for name, fn in parts.items():
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # (the GPU busy for longer than the 50 calls take)
            t = time.perf_counter()
            for _ in range(50):
                fn()
            us = (time.perf_counter() - t) / 50 * 1e6
            best[name] = min(best.get(name, us), us)
    torch.cuda.synchronize()
    return ["  host us a call, the GPU held busy:"] + [f"    {v:7.1f}  {n}" for n, v in best.items()]


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="a text file for the tables (optional)")
    p.add_argument("--timeline", default=None, help="comma-separated engine shapes: each call's operations in order")
    p.add_argument("--host", action="store_true", help="with --timeline: the host time of the call's pieces")
    p.add_argument("--heads", default="16,8", help="comma-separated head counts (default 16,8)")
    p.add_argument("--kinds", default="bf16,fp8", help="without --timeline: bf16 (64K context), fp8 (4M-row pool)")
    a = p.parse_args(argv)
    heads = [int(x) for x in a.heads.split(",")]
    env = environment()
    lines = [f"{env.get('gpu')}, commit {env.get('commit')}, {env.get('date')}, torch {env.get('versions', {}).get('torch')}"]
    worst = 0.0
    for name in (a.timeline.split(",") if a.timeline else []):
        shape = SHAPES[name]
        idx = paged_indices(shape, "glm53-like", 2048, 0, "cuda")
        s_q = idx.shape[0]
        kv = torch.randn(shape.pool, 576, device="cuda", dtype=torch.bfloat16)
        for h in heads:
            q = torch.randn(s_q, h, 576, device="cuda", dtype=torch.bfloat16)
            inputs = Inputs(Case("glm53-like", h, kv="bf16", s_q=s_q, s_kv=shape.pool), idx, [(q, kv)])
            chk = check(inputs, *quilt_attn.sparse_prefill(q, kv, idx), n_check=128)
            worst = float("inf") if chk["nan"] else max(worst, chk["rel_err"])
            lines.append(f"== {name} (bf16, s_q {s_q}, pool {shape.pool}) h {h}: rel_err {chk['rel_err']:.1e}")
            lines += timeline(lambda: quilt_attn.sparse_prefill(q, kv, idx))
            if a.host:
                lines += host_parts(q, kv, idx)
        kv = None
        torch.cuda.empty_cache()
    if a.timeline:
        return _finish(lines, a.out, worst)
    for kind in a.kinds.split(","):
        for h in heads:
            if kind == "bf16":
                s_q, s_kv = 16384, 65536
                idx = generate("glm53-like", s_q, s_kv, 2048, seed=7, device="cuda")
                kv = torch.randn(s_kv, 576, device="cuda", dtype=torch.bfloat16)
                name = f"bf16 64K context s_q {s_q} h {h}"
            else:
                shape = SHAPES["pool-4M"]
                s_q, s_kv, idx = sum(shape.s_q), shape.pool, paged_indices(shape, "glm53-like", 2048, 0, "cuda")
                kv = quantize_fp8(torch.randn(shape.pool, 576, device="cuda", dtype=torch.bfloat16))
                name = f"fp8 pool of 4M rows s_q {s_q} h {h}"
            q = torch.randn(s_q, h, 576, device="cuda", dtype=torch.bfloat16)
            inputs = Inputs(Case("glm53-like", h, kv=kind, s_q=s_q, s_kv=s_kv), idx, [(q, kv)])
            chk = check(inputs, *quilt_attn.sparse_prefill(q, kv, idx), n_check=128)
            err = chk["rel_err"]
            worst = float("inf") if chk["nan"] else max(worst, err)
            tot, span, n = profile(lambda: quilt_attn.sparse_prefill(q, kv, idx))
            lines.append(f"== {name}: GPU us a call by kernel ({n} launches a call; rel_err {err:.1e})")
            lines += [f"  {v:9.1f}  {k}" for k, v in sorted(tot.items(), key=lambda x: -x[1])]
            lines.append(f"  span {span:.1f} us a call; kernels busy {sum(tot.values()):.1f}")
            kv = inputs = None  # (the 4M-row pool freed before the next case's)
            torch.cuda.empty_cache()
    return _finish(lines, a.out, worst)


def _finish(lines, out, worst) -> int:
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return 0 if worst < CALL_REL_L2["bf16"] else 1


if __name__ == "__main__":
    sys.exit(main())
