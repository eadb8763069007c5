"""Sparse prefill in the shapes inference engines call it, beside FlashMLA on the same board.

Engines (``../shared/ENGINES.md``) pass **global slot ids** into a paged kv pool (``page[tok // 64] * 64 +
tok % 64``, pages scattered over the pool), plan nothing ahead (new indices every layer), batch requests of odd
lengths back to back (RAGGED: a group of neighbouring queries can straddle two requests) and prefill in chunks
whose context includes a prefix already in the cache. Each case times, interleaved in one process:

* ``call``: ``quilt_attn.sparse_prefill(q, kv, indices)`` with default arguments (it plans every call);
* ``kernel``: the CUDA attention kernel alone with a plan built beforehand (what the call would be if
  planning were free);
* ``flashmla``: FlashMLA's sm90 sparse prefill at 64 heads (engines pad to 64; ``--flashmla``, optional).

Two index sets (and two q / kv sets) alternate between calls, so no call finds the previous one's indices or
rows in L2. Every variant's output starts NaN-poisoned and is checked against the float32 reference on sampled
queries in the same run; the call's extra device memory (peak above inputs and outputs) is recorded.

    python benchmarks/run.py engine-shapes --out benchmarks/results/engine_shapes.json [--flashmla LIB] [--cases ...]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import quilt_attn
from quilt_attn.ops import cuda_backend, cuda_call
from quilt_attn import dispatch
from quilt_attn.reference import sparse_prefill_reference
from quilt_attn.workloads import generate
from quilt_bench import bench

D_QK, D_V, PAGE = 576, 512, 64


@dataclass(frozen=True)
class Shape:
    """One engine call: queries ``s_q`` (per request for varlen) at the end of contexts ``ctx`` in a pool."""
    name: str
    s_q: tuple[int, ...]   # queries of each request in the batch
    ctx: tuple[int, ...]   # each request's context (its queries are the last s_q positions)
    pool: int              # kv rows of the pool the slot ids point into


SHAPES = {s.name: s for s in [
    Shape("pool-64K", (16384,), (65536,), 65536),
    Shape("pool-256K", (16384,), (65536,), 1 << 18),
    Shape("pool-1M", (16384,), (65536,), 1 << 20),
    Shape("pool-4M", (16384,), (65536,), 1 << 22),
    Shape("ctx-128K", (8192,), (131072,), 131072),
    Shape("ctx-256K", (8192,), (262144,), 262144),
    Shape("ctx-1M", (8192,), (1 << 20,), 1 << 20),
    # five requests of odd lengths, each at the end of its own context, back to back in one call
    Shape("varlen", (517, 1999, 3001, 7000, 1867), (24517, 33999, 41001, 47000, 17867), 1 << 20),
    # a chunk of a long prompt whose first 124K tokens are already in the cache
    Shape("chunk-prefix", (4096,), (131072,), 1 << 20),
    # short prefills: one prompt's last s_q tokens, and a batch of short prompts (one call's GPU work is
    # small, so what the host spends a call shows)
    Shape("short-512", (512,), (8192,), 1 << 20),
    Shape("short-1K", (1024,), (16384,), 1 << 20),
    Shape("short-2K", (2048,), (32768,), 1 << 20),
    Shape("varlen-short", (311, 97, 640, 205, 452, 129), (2359, 4193, 8832, 2253, 6596, 3201), 1 << 20),
]}


def paged_indices(shape: Shape, workload: str, topk: int, seed: int, device) -> torch.Tensor:
    """Global slot ids ``[sum(s_q), topk]``: each request's causal top-K positions, mapped through its own
    block table of distinct random pages of the pool (-1 stays -1)."""
    g = torch.Generator(device="cpu").manual_seed(1000 + seed)
    n_pages = [math.ceil(c / PAGE) for c in shape.ctx]
    pages = torch.randperm(shape.pool // PAGE, generator=g)[:sum(n_pages)].to(device)
    out, p0 = [], 0
    for s_q, ctx, n in zip(shape.s_q, shape.ctx, n_pages):
        pos = generate(workload, s_q, ctx, topk, seed=seed, device=device)
        table = pages[p0:p0 + n]
        p0 += n
        slot = table[(pos.clamp_min(0) // PAGE).long()] * PAGE + pos.clamp_min(0) % PAGE
        out.append(torch.where(pos >= 0, slot, -1).to(torch.int32))
    return torch.cat(out).contiguous()


def check(out, max_logits, lse, q, kv, idx, rows, natural: bool) -> dict:
    """rel-L2 of ``out`` and max |d lse| / |d max_logits| (natural log) on ``rows`` against the float32 reference."""
    ro, rm, rl = sparse_prefill_reference(q[rows], kv, idx[rows], compute_dtype=torch.float32)
    ml, ls = max_logits[rows], lse[rows]
    if not natural:  # the kernel's own state is base 2
        ml, ls = ml * math.log(2.0), ls * math.log(2.0)
    fin = torch.isfinite(rl)
    return {"rel_err": ((out[rows].float() - ro).norm() / ro.norm()).item(),
            "lse_err": (ls - rl)[fin].abs().max().item() if fin.any() else 0.0,
            "max_logits_err": (ml - rm)[torch.isfinite(rm)].abs().max().item() if torch.isfinite(rm).any() else 0.0,
            "nan": bool(torch.isnan(out[rows]).any().item())}


def extra_mib(fn, out_bytes: int) -> float:
    """Peak device memory one call adds above what was allocated before it, less its outputs (MiB)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del res
    return (peak - base - out_bytes) / 2**20


def switched_off(module, flag: str, fn, *args):
    """``fn(*args)`` with ``module.flag`` (a measurement switch, True as shipped) False for its duration."""
    setattr(module, flag, False)
    try:
        return fn(*args)
    finally:
        setattr(module, flag, True)


def time_alternating(variants: dict, rounds: int, warmup: int, rep: int) -> dict:
    """``bench.interleaved_rounds`` of ``variants`` (name -> fn(set index)), each call on the other of two input
    sets than the call before (so that none finds the last one's indices or rows in L2): name -> round times."""
    state = {"i": 0}

    def rotate(fn):
        def step():
            state["i"] ^= 1
            return fn(state["i"])
        return step

    return bench.interleaved_rounds({n: rotate(f) for n, f in variants.items()}, rounds, warmup=warmup, rep=rep)


def run_shape(shape: Shape, h: int, workload: str, topk: int, fm, rounds: int, warmup: int, rep: int,
              unchained: bool = False, general: bool = False) -> list[dict]:
    dev = torch.device("cuda")
    s_q, h_run = sum(shape.s_q), max(64, h)
    gen = torch.Generator(device=dev).manual_seed(7)
    sets = []
    for seed in range(2):
        idx = paged_indices(shape, workload, topk, seed, dev)
        q = torch.randn(s_q, h_run, D_QK, device=dev, dtype=torch.bfloat16, generator=gen)
        kv = torch.randn(shape.pool, D_QK, device=dev, dtype=torch.bfloat16, generator=gen)
        sets.append((q, kv, idx))
    sm_scale = D_QK ** -0.5
    rows = torch.randperm(s_q, generator=torch.Generator().manual_seed(3))[:256].to(dev)

    # call: the public function, default arguments, planning inside
    def ours_call(q, kv, idx):
        return quilt_attn.sparse_prefill(q[:, :h], kv, idx, sm_scale)

    # kernel: the same attention with plans built beforehand
    # the plan the call builds (its settings and its decision whether to plan, from the dispatch rule)
    pkw = dispatch.plan_settings(h, "cuda") if dispatch.decide("cuda", "quilt", h).quilt else None
    plans = [quilt_attn.plan(idx, s_kv=shape.pool, **pkw) if pkw else None
             for _, _, idx in sets]
    k_out = torch.full((s_q, h, D_V), float("nan"), dtype=torch.bfloat16, device=dev)
    k_ml, k_lse = torch.empty(s_q, h, device=dev), torch.empty(s_q, h, device=dev)

    def ours_kernel(q, kv, idx, plan):
        work = dict(plan=plan) if plan is not None else dict(indices=idx)
        cuda_backend.launch(q[:, :h], kv, sm_scale, k_out, k_ml, k_lse, **work)

    variants = {"call": lambda i: ours_call(*sets[i]),
                "kernel": lambda i: ours_kernel(*sets[i], plans[i])}
    if unchained:  # the call with cuda_backend.CHAIN_LAUNCHES off (memsets, no chain)
        variants["call-unchained"] = lambda i: switched_off(cuda_backend, "CHAIN_LAUNCHES", ours_call, *sets[i])
    if general:  # the call with cuda_call.ENABLED off: planner.plan, then the plan's passes
        variants["call-general"] = lambda i: switched_off(cuda_call, "ENABLED", ours_call, *sets[i])
    if fm is not None:
        f_out, f_ml, f_lse = fm.outputs(s_q, h_run, torch.bfloat16, dev)
        variants["flashmla"] = lambda i: fm.launch(sets[i][0], sets[i][1], sets[i][2], f_out, f_ml, f_lse,
                                                   sm_scale=sm_scale)

    base = dict(shape=shape.name, workload=workload, h=h, s_q=s_q, topk=topk, pool=shape.pool,
                ctx=list(shape.ctx), requests=len(shape.s_q), kv="bf16")
    result = {}
    for name, fn in variants.items():  # reference check of each variant on set 0, outputs poisoned first
        q, kv, idx = sets[0]
        if name in ("call", "call-unchained", "call-general"):
            out, ml, lse = fn(0)
            chk = check(out, ml, lse, q[:, :h], kv, idx, rows, natural=True)
        elif name == "kernel":
            k_out.fill_(float("nan"))
            fn(0)
            chk = check(k_out, k_ml, k_lse, q[:, :h], kv, idx, rows, natural=False)
        else:
            f_out.fill_(float("nan"))
            fn(0)
            chk = check(f_out, f_ml, f_lse, q, kv, idx, rows, natural=True)
        result[name] = dict(base, method=name, h_run=h_run if name == "flashmla" else h, **chk)
    out_bytes = s_q * h * (D_V * 2 + 8)
    result["call"]["extra_mib"] = extra_mib(lambda: ours_call(*sets[0]), out_bytes)
    # planning alone, as the call plans (default settings for h)
    plan_ms = bench.time_ms(lambda: quilt_attn.plan(sets[0][2], s_kv=shape.pool, **pkw),
                            warmup=warmup, rep=rep) if pkw else 0.0

    times = time_alternating(variants, rounds, warmup, rep)
    out_rows = []
    for name, r in result.items():
        r["rounds_ms"] = times[name]
        r["ms"] = statistics.median(times[name])
        out_rows.append(r)
    call, kern = result["call"]["ms"], result["kernel"]["ms"]
    result["call"]["plan_ms"] = plan_ms
    result["call"]["call_over_kernel"] = call / kern
    if "flashmla" in result:
        result["call"]["flashmla_over_call"] = result["flashmla"]["ms"] / call
    for other in ("call-unchained", "call-general"):
        if other in result:
            result[other]["call_over_kernel"] = result[other]["ms"] / kern
    return out_rows


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--flashmla", default=None, help="FlashMLA library (benchmarks/flashmla.py); omitted: not timed")
    p.add_argument("--cases", default=",".join(SHAPES), help=f"comma-separated, from {list(SHAPES)}")
    p.add_argument("--heads", default="16,8")
    p.add_argument("--workload", default="glm53-like")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--unchained", action="store_true",
                   help="also time the call with cuda_backend.CHAIN_LAUNCHES off (a memset before each launch, no "
                        "programmatic dependent launches), interleaved with the others")
    p.add_argument("--general", action="store_true",
                   help="also time the call with its short path off (ops/cuda_call.py's ENABLED: planner.plan, then "
                        "the plan's passes), interleaved with the others")
    a = p.parse_args(argv)
    fm = None
    if a.flashmla:
        sys.path.insert(0, str(Path(__file__).parent))
        from flashmla import FlashMLA

        fm = FlashMLA(a.flashmla)
    rows = []
    print("| case | h | call ms | kernel ms | call / kernel | plan ms | FlashMLA ms | FlashMLA / call | extra MiB | "
          "rel_err (call) |", flush=True)
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for name in a.cases.split(","):
        for h in (int(x) for x in a.heads.split(",")):
            got = run_shape(SHAPES[name], h, a.workload, a.topk, fm, a.rounds, a.warmup, a.rep, a.unchained,
                            a.general)
            rows += got
            c = next(r for r in got if r["method"] == "call")
            k = next(r for r in got if r["method"] == "kernel")
            f = next((r for r in got if r["method"] == "flashmla"), None)
            print(f"| {name} | {h} | {c['ms']:.3f} | {k['ms']:.3f} | {c['call_over_kernel']:.3f} | {c['plan_ms']:.3f} | "
                  f"{f['ms'] if f else float('nan'):.3f} | {c.get('flashmla_over_call', float('nan')):.2f} | "
                  f"{c['extra_mib']:.0f} | {c['rel_err']:.1e} (kernel {k['rel_err']:.1e}"
                  f"{', FlashMLA %.1e' % f['rel_err'] if f else ''}) |", flush=True)
            for method in ("call-unchained", "call-general"):
                u = next((r for r in got if r["method"] == method), None)
                if u:
                    print(f"| {name} {method[5:]} | {h} | {u['ms']:.3f} | | {u['call_over_kernel']:.3f} | | | | | "
                          f"{u['rel_err']:.1e} |", flush=True)
            torch.cuda.empty_cache()
            # saved after each case: a run cut short keeps the rows it has
            bench.save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
