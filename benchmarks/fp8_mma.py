"""The FP8 tensor-core mode (``precision="fp8"``) beside the exact bf16 kernel, interleaved, on the same inputs.

Issue 19's shape: s_q 16384 at the end of a 64K-token context, Top-2048, an FP8 cache of N(0, 1) rows, plan
prebuilt (query programs at h >= 64, as the default call runs them). Per head count, on two input sets that
alternate (so that no call finds the last one's rows in L2):

* ``exact``: ``sparse_prefill`` on the cache dequantized to bf16 (what FlashMLA would run on it), the baseline;
* ``fp8``: ``sparse_prefill(..., precision="fp8")`` on the cache itself, q quantized in the call;
* ``quantize-q``: the q quantization alone (part of ``fp8``).

Both outputs are checked against the float32 reference on sampled queries (the FP8 mode's rel_err is its
accuracy, BENCHMARKS.md), and the call's extra device memory is recorded.

    python benchmarks/run.py fp8-mma --out F [--heads 16,8,32,64,128]
    python benchmarks/run.py fp8-mma --out F --ablation [--heads 16,64]

``--ablation``: where the kernel's time goes, launches only, interleaved: ``full``; ``one-scale-rows`` (a copy
of the cache whose four block scales a row are set to their max: no re-rounding, other values); and
``no-transform`` (a build with ``-DQUILT_F8_SKIP_TRANSFORM``: the producer's transform left out, results
invalid, so unchecked). The full launch's output is checked as above.

``--against DIR``: a change to the kernel judged against an earlier build, launches only, interleaved in one
process: ``DIR`` holds the earlier ``csrc`` (e.g. ``git archive HEAD quilt_attn/ops/csrc``), built beside the
package's own. Two caches: ``gauss`` (N(0, 1) rows) and ``channels`` (each column times a log-normal factor,
sigma 1, so a row's four block scales differ as real activations' do). Each build's outputs are compared bit
for bit with the other's, and the package's against the float32 reference.

    python benchmarks/run.py fp8-mma --out F --against DIR [--heads 16,64]
"""
from __future__ import annotations

import argparse
import statistics

import torch

import quilt_attn
from engine_shapes import check, extra_mib, time_alternating
from quilt_attn import dispatch
from quilt_attn.kv_cache import dequantize_fp8, quantize_fp8
from quilt_attn.ops import cuda_backend
from quilt_attn.workloads import generate
from quilt_bench import bench

D_QK, D_V = 576, 512


def run_heads(h: int, s_q: int, s_kv: int, topk: int, workload: str, rounds: int, warmup: int, rep: int) -> list:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(11)
    meth = "quilt" if dispatch.decide("cuda", "quilt", h).quilt else "query_parallel"
    sets = []
    for seed in range(2):
        idx = generate(workload, s_q, s_kv, topk, seed=seed, device=dev)
        q = torch.randn(s_q, h, D_QK, device=dev, dtype=torch.bfloat16, generator=gen)
        cache = quantize_fp8(torch.randn(s_kv, D_QK, device=dev, dtype=torch.bfloat16, generator=gen))
        plan = quilt_attn.plan(idx, s_kv=s_kv, **dispatch.plan_settings(h, "cuda")) if meth == "quilt" else None
        sets.append((q, cache, dequantize_fp8(cache), idx, plan))
    calls = {
        "exact": lambda i: quilt_attn.sparse_prefill(sets[i][0], sets[i][2], sets[i][3], plan=sets[i][4],
                                                     backend="cuda", method=meth),
        "fp8": lambda i: quilt_attn.sparse_prefill(sets[i][0], sets[i][1], sets[i][3], plan=sets[i][4],
                                                   precision="fp8", method=meth),
        "quantize-q": lambda i: cuda_backend.quantize_q_fp8(sets[i][0]),
    }
    rows_chk = torch.randperm(s_q, generator=torch.Generator().manual_seed(3))[:256].to(dev)
    q, cache, kvd, idx, _ = sets[0]
    got = {}
    for name in ("exact", "fp8"):
        out, ml, lse = calls[name](0)
        got[name] = check(out, ml, lse, q, kvd, idx, rows_chk, natural=True)
    out_bytes = s_q * h * (D_V * 2 + 8)
    mib = {name: extra_mib(lambda n=name: calls[n](0), out_bytes) for name in ("exact", "fp8")}
    times = time_alternating(calls, rounds, warmup, rep)
    rows = []
    for name, ts in times.items():
        row = dict(method=name, h=h, path=meth, s_q=s_q, s_kv=s_kv, topk=topk, workload=workload,
                   precision="fp8" if name != "exact" else "exact", ms=statistics.median(ts), round_ms=ts)
        if name in got:
            row.update(got[name], extra_mib=mib[name])
        rows.append(row)
    return rows


def launcher(lib, qf8, qs, cache, res, kw):
    """A launch-only call of the FP8 kernel from library ``lib`` (None: the package's own build) into the
    output tensors ``res`` (out, max_logits, lse)."""
    def f():
        cuda_backend.use_library(lib)
        cuda_backend.launch(qf8, cache, D_QK ** -0.5, *res, q_scale=qs, **kw)
    return f


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit equal (NaNs included): the tensors viewed as integers of their width."""
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


def run_ablation(h: int, s_q: int, s_kv: int, topk: int, workload: str, rounds: int, warmup: int, rep: int) -> list:
    from quilt_attn.ops.sparse_attention import alloc_outputs

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(11)
    qp = not dispatch.decide("cuda", "quilt", h).quilt
    idx = generate(workload, s_q, s_kv, topk, seed=0, device=dev)
    q = torch.randn(s_q, h, D_QK, device=dev, dtype=torch.bfloat16, generator=gen)
    cache = quantize_fp8(torch.randn(s_kv, D_QK, device=dev, dtype=torch.bfloat16, generator=gen))
    one = cache.clone()
    sc = one[:, 512:528].view(torch.float32)
    sc[:] = sc.amax(-1, keepdim=True)
    plan = None if qp else quilt_attn.plan(idx, s_kv=s_kv, **dispatch.plan_settings(h, "cuda"))
    kw = dict(indices=idx) if qp else dict(plan=plan)
    qf8, qs = cuda_backend.quantize_q_fp8(q)
    out, ml, lse = alloc_outputs(q, D_V)
    skip = cuda_backend.build(defines=("-DQUILT_F8_SKIP_TRANSFORM",))

    def variant(lib, c):
        return launcher(lib, qf8, qs, c, (out, ml, lse), kw)

    out.fill_(float("nan"))
    variant(None, cache)()
    rows_chk = torch.randperm(s_q, generator=torch.Generator().manual_seed(3))[:256].to(dev)
    chk = check(out, ml, lse, q, dequantize_fp8(cache), idx, rows_chk, natural=False)
    fns = {"full": variant(None, cache), "one-scale-rows": variant(None, one), "no-transform": variant(skip, cache)}
    times = bench.interleaved_rounds(fns, rounds, warmup=warmup, rep=rep)
    cuda_backend.use_library(None)
    return [dict(method=n, h=h, path="query_parallel" if qp else "quilt", s_q=s_q, s_kv=s_kv, topk=topk,
                 workload=workload, precision="fp8", ms=statistics.median(ts), round_ms=ts,
                 **(chk if n == "full" else {"checked": False})) for n, ts in times.items()]


def run_against(h: int, s_q: int, s_kv: int, topk: int, workload: str, rounds: int, warmup: int, rep: int,
                base_dir: str) -> list:
    from quilt_attn.ops.sparse_attention import alloc_outputs

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(11)
    qp = not dispatch.decide("cuda", "quilt", h).quilt
    idx = generate(workload, s_q, s_kv, topk, seed=0, device=dev)
    q = torch.randn(s_q, h, D_QK, device=dev, dtype=torch.bfloat16, generator=gen)
    rows = torch.randn(s_kv, D_QK, device=dev, generator=gen)
    chan = torch.exp(torch.randn(D_QK, device=dev, generator=gen))
    caches = {"gauss": quantize_fp8(rows.bfloat16()), "channels": quantize_fp8((rows * chan).bfloat16())}
    plan = None if qp else quilt_attn.plan(idx, s_kv=s_kv, **dispatch.plan_settings(h, "cuda"))
    kw = dict(indices=idx) if qp else dict(plan=plan)
    qf8, qs = cuda_backend.quantize_q_fp8(q)
    libs = {"base": bench.earlier_build(base_dir), "new": None}
    fns, checks = {}, {}
    rows_chk = torch.randperm(s_q, generator=torch.Generator().manual_seed(3))[:256].to(dev)
    for cname, c in caches.items():
        got = {}
        for lname, lib in libs.items():
            res = alloc_outputs(q, D_V)
            for t in res:
                t.fill_(float("nan"))
            fns[f"{lname}-{cname}"] = launcher(lib, qf8, qs, c, res, kw)
            fns[f"{lname}-{cname}"]()
            got[lname] = res
        same = all(same_bits(a, b) for a, b in zip(got["base"], got["new"]))
        checks[cname] = dict(check(*got["new"], q, dequantize_fp8(c), idx, rows_chk, natural=False), bit_equal=same)
    times = bench.interleaved_rounds(fns, rounds, warmup=warmup, rep=rep)
    cuda_backend.use_library(None)
    return [dict(method=n, h=h, path="query_parallel" if qp else "quilt", s_q=s_q, s_kv=s_kv, topk=topk,
                 workload=workload, precision="fp8", ms=statistics.median(ts), round_ms=ts,
                 **checks[n.split("-", 1)[1]]) for n, ts in times.items()]


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--heads", default="16,8,32,64,128")
    p.add_argument("--workload", default="glm53-like")
    p.add_argument("--s-q", type=int, default=16384)
    p.add_argument("--s-kv", type=int, default=65536)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rep", type=int, default=20)
    p.add_argument("--ablation", action="store_true", help="launch-only variants: where the time goes")
    p.add_argument("--against", metavar="DIR", help="an earlier csrc to A/B the kernel against")
    a = p.parse_args(argv)
    rows = []
    if a.against:
        print("| h | cache | base ms | new ms | new / base | bit-equal | rel_err new |", flush=True)
        print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
        for h in (int(x) for x in a.heads.split(",")):
            got = {r["method"]: r for r in run_against(h, a.s_q, a.s_kv, a.topk, a.workload, a.rounds, a.warmup,
                                                       a.rep, a.against)}
            rows += got.values()
            for c in ("gauss", "channels"):
                b, n = got[f"base-{c}"], got[f"new-{c}"]
                print(f"| {h} | {c} | {b['ms']:.3f} | {n['ms']:.3f} | {n['ms'] / b['ms']:.3f} | {n['bit_equal']} | "
                      f"{n['rel_err']:.1e} |", flush=True)
            bench.save(rows, a.out)
        return 0
    if a.ablation:
        print("| h | full ms | one-scale rows ms | no transform ms | rel_err full |", flush=True)
        print("| --- | --- | --- | --- | --- |", flush=True)
        for h in (int(x) for x in a.heads.split(",")):
            got = {r["method"]: r for r in run_ablation(h, a.s_q, a.s_kv, a.topk, a.workload, a.rounds, a.warmup,
                                                        a.rep)}
            rows += got.values()
            print(f"| {h} | {got['full']['ms']:.3f} | {got['one-scale-rows']['ms']:.3f} | "
                  f"{got['no-transform']['ms']:.3f} | {got['full']['rel_err']:.1e} |", flush=True)
            bench.save(rows, a.out)
        return 0
    print("| h | path | exact ms | fp8 ms | fp8 / exact | quantize q ms | rel_err exact / fp8 | max dlse fp8 | "
          "extra MiB exact / fp8 |", flush=True)
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for h in (int(x) for x in a.heads.split(",")):
        got = {r["method"]: r for r in run_heads(h, a.s_q, a.s_kv, a.topk, a.workload, a.rounds, a.warmup, a.rep)}
        rows += got.values()
        e, f = got["exact"], got["fp8"]
        print(f"| {h} | {e['path']} | {e['ms']:.3f} | {f['ms']:.3f} | {f['ms'] / e['ms']:.2f} | "
              f"{got['quantize-q']['ms']:.3f} | {e['rel_err']:.1e} / {f['rel_err']:.1e} | {f['lse_err']:.1e} | "
              f"{e['extra_mib']:.0f} / {f['extra_mib']:.0f} |", flush=True)
        bench.save(rows, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
