"""Owner-exact prototype (issue 24): the swapped program on real plans, beside today's kernel, interleaved.

The prototype library (``swapped_sm90.cu``: the shipping library with its consumers replaced by the swapped
program of ``swapped_consumer.cuh`` for bf16 plans at h = 8 and 16) is driven through the package's launcher
(``cuda_backend.use_library``). Variants, on the same inputs (two sets that alternate; GLM-5.3-like,
DeepSeek-3.2-like or random indices, s_q 16384 of a 64K context, Top-2048):

* ``today``: the shipping kernel on the plan the call would build;
* ``today-regrouped``: the shipping kernel on the same plan with each group's columns sorted by their owners'
  span (first owner, then length) and cut into tiles again (``regroup``: the same columns and member bits, so
  the same result up to the order of the sums);
* ``spans-regrouped``: the prototype on the regrouped plan, each tile's products over its span (h = 16: the
  run of query slots holding its owners; h = 8: slots 0 to the last owner; ``swapped_consumer.cuh``);
* ``full-regrouped``: the prototype with every tile at full width (N = 64: today's products, the swapped
  program's bookkeeping), so ``spans`` against ``full`` is what the spans save;
* ``serial-regrouped``: ``full`` with a second wgmma shape in a case never taken, meant to make ptxas serialize
  the kernel's wgmma as it does the span builds (it did in a consumer built alone, not in the library: there it
  measures the dead shape's code);
* any kernel without ``-regrouped``: on the plan as built.

Every output starts NaN-poisoned and is checked against the float32 reference on sampled queries. Each row
records the tiles and the prototype's predicted work: per tile N = h x the span's length (``span_stats``).

    python benchmarks/run.py owner-exact-prototype --out F [--cases glm53-like:16,glm53-like:8,...] [--variants ...]

(builds the prototype libraries on first use, about 3 minutes each with nvcc 13)
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


# swapped_consumer.cuh's build switches (OE_FORM, OE_ONLY_H) of each library: the span forms one for each head
# count (ptxas serializes the h = 16 one's wgmma, and would the whole kernel's with it)
FORMS = {"spans8": (0, 8), "spans16": (0, 16), "full": (1, 0), "serial": (2, 0)}


def form_of(kernel: str, h: int) -> str:
    return f"{kernel}{h}" if kernel == "spans" else kernel


def library(form: str = "spans16", nvcc: str | None = None) -> Path:
    """The prototype library of ``form`` (``FORMS``): the package's build (``cuda_backend.build``) with
    ``swapped_sm90.cu`` as its attention unit, cached beside the package's library."""
    from quilt_attn.ops import cuda_backend

    oe_form, only_h = FORMS[form]
    return cuda_backend.build(nvcc, defines=(f"-DOE_FORM={oe_form}", f"-DOE_ONLY_H={only_h}"),
                              units=(HERE / "swapped_sm90.cu", cuda_backend.CSRC / "quilt_plan.cu"),
                              name=f"owner_exact_{form}")


def owner_span(masks: torch.Tensor):
    """(first owner, span length) of each column's member bits (int32; 0 bits: (0, 0))."""
    m = masks.to(torch.int64)
    lo = torch.where(m > 0, torch.log2((m & -m).double()).round().long(), 0)
    hi = torch.where(m > 0, torch.floor(torch.log2(m.double().clamp_min(1))).long(), -1)
    return lo, (hi - lo + 1).clamp_min(0)


def prefix(h: int) -> bool:
    """Whether the prototype's tiles at ``h`` heads span slot 0 to their last owner (h = 8), not their owners'
    run (h = 16): ``swapped_consumer.cuh``'s kPrefix."""
    return h == 8


def regroup(plan, h: int = 16):
    """``plan`` with each group's columns sorted by what the prototype's tile costs at ``h`` heads (span length,
    then first owner; with ``prefix(h)``, the last owner) and cut into tiles again (same columns, same member
    bits; padding only in a group's last tile). Only for plans whose program is the group (``qp ==
    group_size``), as the default plans at 8 and 16 heads."""
    rows, masks = plan.columns()
    n_groups, cap, tile = rows.shape
    rows, masks = rows.reshape(n_groups, -1), masks.reshape(n_groups, -1)
    lo, ln = owner_span(masks)
    valid = (rows >= 0) & (masks != 0)
    key = torch.where(valid, lo + ln if prefix(h) else ln * 64 + lo, 1 << 20)
    order = torch.sort(key, dim=1, stable=True).indices
    rows, masks, valid = (t.gather(1, order) for t in (rows, masks, valid.long()))
    n = valid.sum(1)
    tiles = (n + tile - 1) // tile
    if plan.tile_mask is None:
        from quilt_attn.planner.buffers import PACK_SHIFT

        words = torch.where(valid.bool(), rows | (masks << PACK_SHIFT), -1).to(torch.int32)
        new_mask = None
    else:
        words = torch.where(valid.bool(), rows, -1).to(torch.int32)
        new_mask = torch.where(valid.bool(), masks, 0).to(torch.int32).reshape(n_groups, cap, tile)
    used = torch.arange(cap, device=rows.device)[None, :] < tiles[:, None]
    all_bits = (1 << plan.group_size) - 1
    return dataclasses.replace(
        plan, tile_kv=words.reshape(n_groups, cap, tile), tile_mask=new_mask,
        tile_level=torch.where(used, 0, -1).to(torch.int32),
        tile_members=torch.where(used, all_bits, 0).to(torch.int32), group_tiles=tiles.to(torch.int32),
        _stats=None, _work={}, _ready=None, _waited=set(), source=None)


def span_stats(plan, h: int) -> dict:
    """The plan's tiles, their spans (the OR of their columns' member bits) and the useful share of the swapped
    program's products: owned (query, column) pairs over the pairs its tiles compute (64 x span length)."""
    rows, masks = plan.columns()
    n_groups, cap, tile = rows.shape
    used = torch.arange(cap, device=rows.device)[None, :] < plan.group_tiles[:, None]
    m = masks.to(torch.int64)
    orr = torch.zeros(n_groups, cap, dtype=torch.int64, device=rows.device)
    for b in range(plan.group_size):
        orr |= (((m >> b) & 1).amax(2) << b)
    lo, ln = owner_span(orr)
    ln = (lo + ln if prefix(h) else ln)[used]  # the slots a tile's products cover
    owned = sum(((m >> b) & 1).sum() for b in range(plan.group_size))
    tiles = int(used.sum())
    hist = torch.bincount(ln, minlength=plan.group_size + 1).tolist()
    return dict(tiles=tiles, span_hist=hist, swapped_useful=float(owned) / float(tile * int(ln.sum())),
                today_useful=float(owned) / float(tile * tiles * plan.group_size),
                swapped_work=float(ln.sum()) / float(tiles * plan.group_size))


def main(argv=None, prog=None) -> int:
    from quilt_attn.ops import cuda_backend
    from quilt_bench import bench
    from quilt_bench.bench import Case, make_inputs, rotating, save

    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="glm53-like:16,glm53-like:8,ds32-like:16,ds32-like:8,random:16")
    p.add_argument("--s-q", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=50)
    p.add_argument("--variants", default="today,today-regrouped,spans-regrouped,full-regrouped,serial-regrouped,"
                                          "spans")
    p.add_argument("--profile", default=None, help="VARIANT: run it on the first case three times, nothing else "
                                                    "(for Nsight Compute: its third launch)")
    a = p.parse_args(argv)
    names = [a.profile] if a.profile else a.variants.split(",")
    heads = {int(c.split(":")[1]) for c in a.cases.split(",")}
    libs = {f: str(library(f)) for f in sorted({form_of(n.partition("-")[0], h) for n in names for h in heads}
                                               - {"today"})}
    rows = []
    for case_s in a.cases.split(","):
        wl, h = case_s.split(":")
        h = int(h)
        case = Case(wl, h, s_q=a.s_q, s_kv=65536, topk=2048, dtype="bf16")
        inp = make_inputs(case)
        plan = bench.cuda_work(inp, h)["plan"]
        plans = {"plan": plan, "regrouped": regroup(plan, h)}
        stats = {k: span_stats(v, h) for k, v in plans.items()}
        fns, case_rows = {}, {}
        for name in names:
            kernel, _, which = name.partition("-")
            pl = plans["regrouped" if which == "regrouped" else "plan"]
            libpath = None if kernel == "today" else libs[form_of(kernel, h)]
            call_, out, ml, lse = bench.cuda_call(inp, h, dict(plan=pl))

            def call(q, kv, call_=call_, libpath=libpath):
                if cuda_backend._OVERRIDE != (None if libpath is None else Path(libpath)):
                    cuda_backend.use_library(libpath)
                call_(q, kv)

            call(*inp.sets[0])
            torch.cuda.synchronize()
            if a.profile:
                call(*inp.sets[1])
                call(*inp.sets[0])
                torch.cuda.synchronize()
                return 0
            chk = bench.check(inp, out, ml, lse, base2=True)
            fns[name] = rotating(inp, call)
            st = stats["regrouped" if which == "regrouped" else "plan"]
            case_rows[name] = dict(workload=wl, h=h, s_q=case.s_q, s_kv=case.s_kv, topk=case.topk, variant=name,
                                   kernel=kernel, plan=which or "as built", **st, rel_err=chk["rel_err"],
                                   lse_err=chk["lse_err"], max_logits_err=chk["max_logits_err"], nan=chk["nan"])
            print(f"{wl} h={h} {name}: checked rel_err {chk['rel_err']:.2e} lse_err {chk['lse_err']:.2e} "
                  f"nan {chk['nan']}", flush=True)
        times = bench.interleaved_rounds(fns, a.rounds, warmup=a.warmup, rep=a.rep)
        for name, r in case_rows.items():
            r["rounds_ms"] = times[name]
            r["ms"] = statistics.median(times[name])
            r["vs_today"] = r["ms"] / statistics.median(times[names[0]])
            rows.append(r)
        cuda_backend.use_library(None)
        inp = plan = plans = fns = None
        torch.cuda.empty_cache()
    save(rows, a.out, {"command": "python " + " ".join(sys.argv), "libraries": {k: Path(v).name for k, v in libs.items()}})
    print("\n| workload | h | variant | plan | tiles | span length hist | swapped work | ms | vs today | rel_err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['workload']} | {r['h']} | {r['variant']} | {r['plan']} | {r['tiles']} | {r['span_hist']} | "
              f"{r['swapped_work']:.3f} | {r['ms']:.3f} | {r['vs_today']:.3f} | {r['rel_err']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
