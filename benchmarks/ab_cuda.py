"""Kernel variants of the CUDA backend timed against each other on the same inputs, interleaved.

A variant is ``name=library[@ctas][#order][%group]``: a prebuilt kernel library (``package``: this checkout's
build), optionally a CTA count (``all``: one CTA a work item, what a non-persistent launch does; default
one an SM) and, for plans, the order programs are handed out in (``lpt``: the plan's, longest first;
``group_lpt``: groups longest first, a group's programs together; ``natural``: query order) and the plan's
group size (default 8; merge level: the queries a program holds). Every variant is checked against the float32 reference on sampled queries (NaN-poisoned
outputs first) and compared bit for bit with the first. The variants alternate, each round in the
other order: clock and thermal drift between timings otherwise favour whichever runs first (a fixed
order showed +-7% that the alternating rounds did not; ``bench.interleaved_rounds``). A row's ms is the median of its rounds.
Shape: s_q 16384, s_kv 65536, topk 2048, bf16; inputs rotate over two sets larger than L2.

    python benchmarks/run.py ab-cuda --out ab.json --variants old=/path/v4a.so,new=package
    python benchmarks/run.py ab-cuda --out ab.json --variants one_cta_a_work_item=package@all,persistent=package
    python benchmarks/run.py ab-cuda --out ab.json --cases glm53-like:16 --variants g8=package%8,g4=package%4
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

from quilt_attn.ops import cuda_backend
from quilt_attn.ops.sparse_attention import program_shape
from quilt_bench import bench
from quilt_bench.bench import Case, make_inputs, rotating, save


def parse_variants(text: str) -> list[tuple]:
    """``name=library[@ctas][#order][%group],...`` as ``(name, library or None, ctas, order, group)``."""
    variants = []
    for spec in text.split(","):
        name, lib = spec.split("=", 1)
        lib, _, group = lib.partition("%")
        lib, _, order = lib.partition("#")
        lib, _, ctas = lib.partition("@")
        variants.append((name, None if lib == "package" else lib, ctas or None, order or "lpt", int(group or 8)))
    return variants


def program_order(pl, qp, order):
    """Launch order of the plan's programs (see the module docstring)."""
    ntiles = pl.work_list(qp)[1]
    if order == "lpt":  # what Plan.program_order computes (its cache is overwritten by the variants)
        return torch.argsort(ntiles, descending=True, stable=True).to(torch.int32)
    if order == "natural":
        return torch.arange(ntiles.shape[0], dtype=torch.int32, device=ntiles.device)
    nsub = pl.group_size // qp
    groups = torch.argsort(ntiles.view(-1, nsub).sum(1), descending=True, stable=True)
    return (groups[:, None] * nsub + torch.arange(nsub, device=groups.device)).flatten().to(torch.int32)


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="glm53-like:8,glm53-like:16,glm53-like:32,glm53-like:64,glm53-like:128,"
                                      "random:64,random:128")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--variants", default="one_cta_a_work_item=package@all,persistent=package")
    a = p.parse_args(argv)
    variants = parse_variants(a.variants)
    rows = []
    for case_s in a.cases.split(","):
        wl, h = case_s.split(":")
        h = int(h)
        case = Case(wl, h, s_q=16384, s_kv=65536, topk=2048, dtype="bf16")
        inp = make_inputs(case)
        works = {G: bench.cuda_work(inp, h, G) for G in sorted({v[4] for v in variants})}
        outs, fns, case_rows = {}, {}, {}
        for name, lib, ctas_s, order, G in variants:
            qp, work = program_shape(h, G)[0], works[G]
            pl = work.get("plan")
            n_work = cuda_backend.work_items(h, case.s_q, pl)
            ctas = n_work if ctas_s == "all" else (int(ctas_s) if ctas_s else None)
            prog_order = program_order(pl, qp, order) if pl is not None else None
            launch, out, ml, lse = bench.cuda_call(inp, h, work, _ctas=ctas)

            def call(q, kv, launch=launch, lib=lib, prog_order=prog_order, pl=pl, qp=qp):
                if cuda_backend._OVERRIDE != (None if lib is None else Path(lib)):
                    cuda_backend.use_library(lib)
                if prog_order is not None:  # (the cached order launch() reads)
                    pl._work[("order", min(qp, pl.group_size))] = prog_order
                launch(q, kv)

            call(*inp.sets[0])
            torch.cuda.synchronize()
            chk = bench.check(inp, out, ml, lse, base2=True)  # a raw launch keeps base-2 statistics
            outs[name] = (out.clone(), lse.clone())
            fns[name] = rotating(inp, call)
            case_rows[name] = dict(
                method="quilt" if pl is not None else "query_parallel", backend="cuda", workload=wl, kv="bf16", h=h,
                s_q=case.s_q, s_kv=case.s_kv, topk=case.topk, variant=name, lib=lib or "package", order=order,
                group_size=G if pl is not None else 1, merge_level=qp if pl is not None else 1,
                ctas=min(n_work, ctas or torch.cuda.get_device_properties(0).multi_processor_count), n_work=n_work,
                rel_err=chk["rel_err"], lse_err=chk["lse_err"], max_logits_err=chk["max_logits_err"], nan=chk["nan"])
        times = bench.interleaved_rounds(fns, a.rounds, warmup=a.warmup, rep=a.rep)
        first = variants[0][0]
        for name, r in case_rows.items():
            r["rounds_ms"] = times[name]
            r["ms"] = statistics.median(r["rounds_ms"])
            r["tflops"] = bench.useful_flops(case.s_q, case.topk, h) / r["ms"] / 1e9
            r["bit_identical_to_first"] = all(torch.equal(x, y) for x, y in zip(outs[name], outs[first]))
            rows.append(r)
            print(bench.ab_row_text(wl, h, name, r) + f"  same as {first}: {r['bit_identical_to_first']}", flush=True)
        cuda_backend.use_library(None)
        inp = pl = work = works = outs = fns = None
        torch.cuda.empty_cache()

    save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
    names = [v[0] for v in variants]
    print("\n| workload | h | " + " | ".join(f"{n} (ms)" for n in names) + " | change vs " + names[0] + " |")
    print("| --- | --- |" + " --- |" * (len(names) + 1))
    for i in range(0, len(rows), len(names)):
        g = rows[i:i + len(names)]
        print(f"| {g[0]['workload']} | {g[0]['h']} | " + " | ".join(f"{r['ms']:.3f}" for r in g) + " | " +
              ", ".join(f"{100 * (r['ms'] / g[0]['ms'] - 1):+.1f}%" for r in g[1:]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
