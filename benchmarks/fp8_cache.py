"""The DeepSeek FP8 cache on the CUDA backend: expanded once a call against widened inside the kernel.

Each case (an engine shape of ``engine_shapes.SHAPES``, slot ids into an FP8 pool) times, interleaved in one
process, on the same inputs:

* ``bf16-kernel``: the attention kernel on the pool already dequantized to bf16, plan prebuilt (the baseline the
  issue's "no slower than the bf16 kernel" means);
* ``expand-kernel``: today's FP8 path with the plan prebuilt: the whole pool expanded to bf16, then the kernel;
* ``widen-kernel``: the kernel reading the FP8 rows themselves (``cuda_backend.FP8_IN_KERNEL``), plan prebuilt;
* ``compact-kernel``: the referenced rows widened into a compact buffer, then the kernel on it (or, chosen on
  the device when they overflow it, the widening kernel; ``cuda_backend.launch_fp8_compact``), plan prebuilt
  (its row numbering made on its first call and kept: a call widens only); ``compact-fresh-kernel``: the same
  with the rows numbered again every call (what a plan made in the call pays; query programs always do);
* ``expand-call`` / ``widen-call`` / ``compact-call``: ``sparse_prefill(q, cache, indices)`` made to take each
  path; ``default-call``: as it is (expanded up to ``FP8_COMPACT_POOL`` rows, compacted above).

Every output starts NaN-poisoned and is checked against the float32 reference on sampled queries; the widened
kernel's output is compared with the bf16 kernel's bit for bit (the same bf16 values); each call's extra device
memory is recorded.

    python benchmarks/run.py fp8-cache --out F [--cases pool-64K,pool-1M,pool-4M] [--heads 16,8,64,128]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

import quilt_attn
from engine_shapes import SHAPES, check, extra_mib, paged_indices, time_alternating
from quilt_attn import dispatch
from quilt_attn.kv_cache import dequantize_fp8, quantize_fp8
from quilt_attn.ops import cuda_backend
from quilt_attn.ops.fp8_expand import expand_fp8
from quilt_bench import bench

D_QK, D_V = 576, 512


def run_shape(shape, h: int, workload: str, topk: int, rounds: int, warmup: int, rep: int,
              builds: dict | None = None) -> list[dict]:
    dev = torch.device("cuda")
    s_q = sum(shape.s_q)
    gen = torch.Generator(device=dev).manual_seed(7)
    sets = []
    for seed in range(2):  # two sets alternate: no call finds the last one's rows in L2
        idx = paged_indices(shape, workload, topk, seed, dev)
        q = torch.randn(s_q, h, D_QK, device=dev, dtype=torch.bfloat16, generator=gen)
        cache = quantize_fp8(torch.randn(shape.pool, D_QK, device=dev, dtype=torch.bfloat16, generator=gen))
        sets.append((q, cache, dequantize_fp8(cache), idx))
    sm_scale = D_QK ** -0.5
    rows = torch.randperm(s_q, generator=torch.Generator().manual_seed(3))[:256].to(dev)
    pkw = dispatch.plan_settings(h, "cuda") if dispatch.decide("cuda", "quilt", h).quilt else None
    plans = [quilt_attn.plan(idx, s_kv=shape.pool, **pkw) if pkw else None for *_, idx in sets]
    k_out = torch.full((s_q, h, D_V), float("nan"), dtype=torch.bfloat16, device=dev)
    k_ml, k_lse = torch.empty(s_q, h, device=dev), torch.empty(s_q, h, device=dev)

    def kernel(q, kv, idx, plan):
        work = dict(plan=plan) if plan is not None else dict(indices=idx)
        cuda_backend.launch(q, kv, sm_scale, k_out, k_ml, k_lse, **work)

    def compact_kernel(q, cache, idx, plan):
        work = dict(plan=plan) if plan is not None else dict(indices=idx)
        cuda_backend.launch_fp8_compact(q, cache, sm_scale, k_out, k_ml, k_lse, **work)

    def compact_fresh(q, cache, idx, plan):  # the rows numbered again every call, as a plan made in the call is
        if plan is not None:
            for key in [k for k in plan._work if isinstance(k, tuple) and k[0] == "cuda_backend.fp8_compact"]:
                del plan._work[key]
        compact_kernel(q, cache, idx, plan)

    def triton_mark(fn):  # the compaction's Triton mark pass (FP8_CUDA_MARK's A/B)
        def run(*a):
            knob, cuda_backend.FP8_CUDA_MARK = cuda_backend.FP8_CUDA_MARK, False
            try:
                return fn(*a)
            finally:
                cuda_backend.FP8_CUDA_MARK = knob
        return run

    def call(q, cache, idx, mode: str):
        knobs = (cuda_backend.FP8_IN_KERNEL, cuda_backend.FP8_COMPACT_POOL)
        cuda_backend.FP8_IN_KERNEL = mode == "widen"
        cuda_backend.FP8_COMPACT_POOL = 0 if mode == "compact" else knobs[1]
        try:  # (expand: the pool expanded whatever its size)
            kw = dict(_triton={"fp8_expand": True}) if mode == "expand" else {}
            return quilt_attn.sparse_prefill(q, cache, idx, sm_scale, **kw)
        finally:
            cuda_backend.FP8_IN_KERNEL, cuda_backend.FP8_COMPACT_POOL = knobs

    variants = {
        "bf16-kernel": lambda i: kernel(sets[i][0], sets[i][2], sets[i][3], plans[i]),
        "expand-kernel": lambda i: kernel(sets[i][0], expand_fp8(sets[i][1]), sets[i][3], plans[i]),
        "widen-kernel": lambda i: kernel(sets[i][0], sets[i][1], sets[i][3], plans[i]),
        "compact-kernel": lambda i: compact_kernel(sets[i][0], sets[i][1], sets[i][3], plans[i]),
        "compact-fresh-kernel": lambda i: compact_fresh(sets[i][0], sets[i][1], sets[i][3], plans[i]),
        "expand-call": lambda i: call(sets[i][0], sets[i][1], sets[i][3], "expand"),
        "widen-call": lambda i: call(sets[i][0], sets[i][1], sets[i][3], "widen"),
        "compact-call": lambda i: call(sets[i][0], sets[i][1], sets[i][3], "compact"),
        "default-call": lambda i: call(sets[i][0], sets[i][1], sets[i][3], "default"),
    }

    variants["compact-fresh-triton-kernel"] = lambda i: triton_mark(compact_fresh)(sets[i][0], sets[i][1], sets[i][3],
                                                                                   plans[i])

    def with_library(path, fn):
        def run(i):
            cuda_backend.use_library(path)
            try:
                return fn(i)
            finally:
                cuda_backend.use_library(None)
        return run

    for bname, path in (builds or {}).items():  # other builds of the kernel library, the in-kernel widening A/B
        variants[f"widen-kernel:{bname}"] = with_library(path, variants["widen-kernel"])
    base = dict(shape=shape.name, workload=workload, h=h, s_q=s_q, topk=topk, pool=shape.pool, kv="fp8")
    result, kernel_out = {}, {}
    q, cache, dense, idx = sets[0]
    for name, fn in variants.items():
        if "kernel" in name:
            k_out.fill_(float("nan"))
            fn(0)
            chk = check(k_out, k_ml, k_lse, q, dense, idx, rows, natural=False)
            kernel_out[name] = k_out.clone()
        else:
            out, ml, lse = fn(0)
            chk = check(out, ml, lse, q, dense, idx, rows, natural=True)
        result[name] = dict(base, method=name, **chk)
    for name in kernel_out:
        if name.startswith(("widen-kernel", "compact-")):
            result[name]["same_bits_as_bf16"] = bool(torch.equal(kernel_out[name], kernel_out["bf16-kernel"]))
    out_bytes = s_q * h * (D_V * 2 + 8)
    for name in ("expand-call", "widen-call", "compact-call", "default-call"):
        result[name]["extra_mib"] = extra_mib(lambda n=name: variants[n](0), out_bytes)
    times = time_alternating(variants, rounds, warmup, rep)
    for name, r in result.items():
        r["rounds_ms"] = times[name]
        r["ms"] = statistics.median(times[name])
        r["over_bf16_kernel"] = r["ms"] / statistics.median(times["bf16-kernel"])
    return list(result.values())


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="pool-64K,pool-1M,pool-4M", help=f"comma-separated, from {list(SHAPES)}")
    p.add_argument("--heads", default="16,8,32,64,128")
    p.add_argument("--workload", default="glm53-like")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=50)
    p.add_argument("--builds", default="", help="name=library,...: more builds' widen-kernel, timed beside")
    a = p.parse_args(argv)
    builds = dict(spec.split("=", 1) for spec in a.builds.split(",") if spec)
    rows = []
    print("| case | h | bf16 kernel | expand + kernel | widen kernel | compact + kernel | compact fresh + kernel | "
          "expand call | widen call | compact call | default call | compact / bf16, kept / fresh | same bits widen / "
          "compact / fresh | extra MiB expand / widen / compact | rel_err compact |", flush=True)
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for name in a.cases.split(","):
        for h in (int(x) for x in a.heads.split(",")):
            got = {r["method"]: r for r in run_shape(SHAPES[name], h, a.workload, a.topk, a.rounds, a.warmup, a.rep,
                                                     builds)}
            rows += got.values()
            w, c, cf = got["widen-kernel"], got["compact-kernel"], got["compact-fresh-kernel"]
            print(f"| {name} | {h} | {got['bf16-kernel']['ms']:.3f} | {got['expand-kernel']['ms']:.3f} | "
                  f"{w['ms']:.3f} | {c['ms']:.3f} | {cf['ms']:.3f} | {got['expand-call']['ms']:.3f} | {got['widen-call']['ms']:.3f} | "
                  f"{got['compact-call']['ms']:.3f} | {got['default-call']['ms']:.3f} | "
                  f"{c['over_bf16_kernel']:.3f} / {cf['over_bf16_kernel']:.3f} | {w['same_bits_as_bf16']} / "
                  f"{c['same_bits_as_bf16']} / {cf['same_bits_as_bf16']} | "
                  f"{got['expand-call']['extra_mib']:.0f} / {got['widen-call']['extra_mib']:.0f} / "
                  f"{got['compact-call']['extra_mib']:.0f} | {c['rel_err']:.1e} |", flush=True)
            ck = got["compact-fresh-triton-kernel"]  # the rows numbered every call, marked by the Triton pass
            print(f"|   Triton mark | {h} | | | | | {ck['ms']:.3f} | | | | | {ck['over_bf16_kernel']:.3f} | "
                  f"{ck['same_bits_as_bf16']} | | {ck['rel_err']:.1e} |", flush=True)
            for bname in builds:
                r = got[f"widen-kernel:{bname}"]
                print(f"|   build {bname} | {h} | | | {r['ms']:.3f} | | | {r['over_bf16_kernel']:.3f} | "
                      f"{r['same_bits_as_bf16']} | | {r['rel_err']:.1e} |", flush=True)
            torch.cuda.empty_cache()
    bench.save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
