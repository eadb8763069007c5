"""A small run of the Triton kernels for compute-sanitizer (memcheck): every path a call can take.

    compute-sanitizer --tool memcheck python benchmarks/run.py sanitize-triton

Runs ``sparse_prefill(..., backend="triton")`` on production head dims (576 / 512) at a few heads: QUILT with
its plan (Triton planner), private rows split off, query programs, invalid indices (-1 and past ``s_kv``),
``topk_length`` (with values past topk), ``attn_sink``, the FP8 cache read inside the kernel, and NaN in kv rows
one query selects (its tile partners queued and repaired). Each result is checked against the float64
reference (exit 1 above a relative L2 error of ``CALL_REL_L2["bf16"]``, or on a NaN; the NaN rows' own queries excepted). Outputs start
NaN-poisoned inside the call; a read outside ``kv``, the plan or the indices is the sanitizer's to report.
Without a GPU it runs through Triton's interpreter (slowly, as a smoke test; the interpreter checks nothing of
memory safety).
"""
from __future__ import annotations

import argparse
import sys

import torch

import quilt_attn
from quilt_attn import PlanSettings, sparse_prefill_reference
from quilt_attn.kv_cache import dequantize_fp8, quantize_fp8
from quilt_attn.workloads import generate
from quilt_bench.bench import rows_selected_once
from sanitize_cuda import verdict

# (heads, method, settings, kv format)
CASES = [(16, "quilt", PlanSettings(split_private=False), "bf16"), (8, "quilt", PlanSettings(split_private=True), "bf16"),
         (3, "quilt", PlanSettings(), "bf16"), (64, "query_parallel", None, "bf16"),
         (16, "quilt", PlanSettings(), "fp8"), (64, "query_parallel", None, "fp8"),
         (16, "quilt", PlanSettings(split_private=False), "bf16-nan")]  # NaN rows: the repair queue and pass


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON file for the rows (optional)")
    p.add_argument("--s-q", type=int, default=32)
    p.add_argument("--s-kv", type=int, default=1024)
    p.add_argument("--topk", type=int, default=192)
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16  # (the interpreter's bf16 dot is wrong)
    g = torch.Generator().manual_seed(0)
    s_q, s_kv, topk = a.s_q, a.s_kv, a.topk
    idx_cpu = generate("glm53-like", s_q, s_kv, topk, seed=1)
    idx_cpu[3, :20] = -1
    idx_cpu[5, 7] = s_kv + 3
    idx = idx_cpu.to(dev)
    lengths = torch.randint(0, topk + 10, (s_q,), generator=g, dtype=torch.int32)
    kv = torch.randn(s_kv, 576, generator=g).to(dtype)
    rows = []
    for h, method, settings, kvf in CASES:
        q = torch.randn(s_q, h, 576, generator=g).to(dtype)
        sink = torch.randn(h, generator=g)
        cache = quantize_fp8(kv) if kvf == "fp8" else None
        kv_case, keep = kv, torch.ones(s_q, dtype=torch.bool)
        if kvf == "bf16-nan":
            bad = rows_selected_once(idx_cpu, s_kv, 3)
            kv_case = kv.clone()
            kv_case[bad, 9] = float("nan")
            keep = ~(idx_cpu[:, :, None] == bad).any(2).any(1)
        kv_pass = kv_case.to(dev) if cache is None else cache.to(dev)
        kv_ref = kv_case if cache is None else dequantize_fp8(cache, dtype)
        kw = dict(settings=settings) if settings is not None else {}
        out = quilt_attn.sparse_prefill(q.to(dev), kv_pass, idx, 576**-0.5, topk_length=lengths.to(dev),
                                        attn_sink=sink.to(dev), backend="triton", method=method,
                                        _triton=dict(fp8_expand=False), **kw)[0]
        if dev == "cuda":
            torch.cuda.synchronize()
        ro = sparse_prefill_reference(q, kv_ref, idx_cpu, 576**-0.5, d_v=512, topk_length=lengths,
                                      attn_sink=sink)[0]
        out, ro = out.cpu()[keep], ro[keep]
        err = float((out.double() - ro).norm() / ro.norm())
        nan = bool(out.isnan().any())
        rows.append(dict(h=h, method=method, kv=kvf, split_private=bool(settings and settings.split_private),
                         rel_err=err, nan=nan))
        print(f"h={h:<3} {method:<14} kv={kvf:<5} split={rows[-1]['split_private']!s:<5} rel-L2 {err:.2e}  nan={nan}")
    return verdict(rows, a.out)


if __name__ == "__main__":
    sys.exit(main())
