"""The FP8 compaction's mark pass (``ops/fp8_compact.py``): variants of one kernel, interleaved on the same plan.

The pass sets a mark for every pool row that a plan column references (a call of a 64K context: ~14M columns,
~44K distinct rows, slot ids into a pool of 1M or 4M rows). Variants: int32 or byte marks; every column stores
its mark, or reads it first and stores only where it is still 0 (``read``); programs launched in column order
or in bit-reversed order (``spread``: the programs in flight together take columns of groups far apart, so they
do not all reach the same rows at once); and ``cuda_dedup``, the CUDA pass (``cuda_backend.mark_rows``: each CTA's
rows deduplicated in shared memory first, a new row's mark read before it is stored). Then the renumbering pass
that follows, into a copy of the words or in place (``remap_in_place`` writes only the words that reference a row;
the two results compared). Cases: the plan columns at h = 16 and 8, the index lists themselves at
h = 64 (query programs). Each variant's marks are compared with the first's (exit 1 if any
differs); times are medians of ``do_bench`` over alternating rounds, the marks' zeroing included.

    python benchmarks/run.py fp8-mark-ab [--out F.txt]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl

import quilt_attn
from engine_shapes import SHAPES, paged_indices
from quilt_attn import dispatch
from quilt_attn.ops import cuda_backend, fp8_compact
from quilt_attn.ops.sparse_attention import column_row
from quilt_bench.bench import environment


@triton.jit
def _mark(words_ptr, n, mark_ptr, s_kv, LOGP, PACKED: tl.constexpr, BLOCK: tl.constexpr, READ: tl.constexpr,
          BYTE: tl.constexpr, SPREAD: tl.constexpr):
    pid = tl.program_id(0)
    if SPREAD:  # bit-reversed program order (the grid is rounded up to a power of two)
        r = pid
        b = pid * 0
        for i in range(0, LOGP):
            b = (b << 1) | (r & 1)
            r = r >> 1
        pid = b
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(words_ptr + offs, mask=offs < n, other=-1)
    row, ok = column_row(w, s_kv, PACKED)
    ok &= offs < n
    if READ:
        seen = tl.load(mark_ptr + row, mask=ok, other=1)
        ok &= seen == 0
    if BYTE:
        tl.store(mark_ptr + row, tl.full([BLOCK], 1, tl.uint8), mask=ok)
    else:
        tl.store(mark_ptr + row, tl.full([BLOCK], 1, tl.int32), mask=ok)


VARIANTS = {"i32_store": (False, False, False), "u8_store": (False, True, False), "u8_read": (True, True, False),
            "i32_store_spread": (False, False, True), "u8_read_spread": (True, True, True)}


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args(argv)
    env = environment()
    lines = [f"# {env['gpu']}, commit {env['commit']}, {env['date']}; us a pass (marks zeroed and set)"]
    ok_all = True
    for name in ("pool-4M", "pool-1M"):
        shape = SHAPES[name]
        for h in (16, 8, 64):
            idx = paged_indices(shape, "glm53-like", 2048, 0, "cuda")
            if dispatch.decide("cuda", "quilt", h).quilt:
                pl = quilt_attn.plan(idx, s_kv=shape.pool, **dispatch.plan_settings(h, "cuda"))
                words, packed, kind = pl.tile_kv.contiguous(), pl.tile_mask is None, "plan columns"
            else:  # query programs: the index lists themselves
                words, packed, kind = idx.contiguous(), False, "index lists"
            n = words.numel()
            nprog = triton.cdiv(n, 1024)
            logp = (nprog - 1).bit_length()
            fns, marks = {}, {}
            for v, (rd, byte, spread) in VARIANTS.items():
                m = torch.zeros(shape.pool, dtype=torch.uint8 if byte else torch.int32, device="cuda")
                grid = ((1 << logp) if spread else nprog,)
                marks[v] = m
                fns[v] = (lambda m=m, rd=rd, byte=byte, spread=spread, grid=grid: (m.zero_(), _mark[grid](
                    words, n, m, shape.pool, logp, PACKED=packed, BLOCK=1024, READ=rd, BYTE=byte, SPREAD=spread)))
                fns[v]()
            m = marks["cuda_dedup"] = torch.zeros(shape.pool, dtype=torch.uint8, device="cuda")
            fns["cuda_dedup"] = lambda m=m: (m.zero_(), cuda_backend.mark_rows(words, shape.pool, m, packed))
            fns["cuda_dedup"]()
            # the renumbering pass after the marks, into a copy or in place (a plan made in the call: only the
            # referencing words are written); timed in place on a scratch copy of the words
            incl = torch.cumsum(m, 0, dtype=torch.int32)
            fits = torch.ones(1, dtype=torch.int32, device="cuda")
            copy, scratch = torch.empty_like(words), words.clone()
            grid = (triton.cdiv(n, fp8_compact.BLOCK),)
            for v, dst, src in (("remap_copy", copy, words), ("remap_in_place", scratch, scratch)):
                fns[v] = lambda dst=dst, src=src, ip=src is dst: fp8_compact._remap_kernel[grid](
                    src, n, incl, fits, dst, shape.pool, PACKED=packed, IN_PLACE=ip, BLOCK=fp8_compact.BLOCK)
                fns[v]()
            torch.cuda.synchronize()
            first = marks[next(iter(marks))].to(torch.uint8)
            same = {v: torch.equal(m.to(torch.uint8), first) for v, m in marks.items()}
            same["remap_copy"] = same["remap_in_place"] = torch.equal(copy, scratch)
            ok_all &= all(same.values())
            t = {v: [] for v in fns}
            for r in range(a.rounds):
                for v in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                    t[v].append(triton.testing.do_bench(fns[v], warmup=10, rep=40, return_mode="median"))
            lines.append(f"| {name} | {h} | {kind} {n} | {int(first.sum())} rows | " + " | ".join(
                f"{v} {statistics.median(t[v]) * 1e3:.1f}{'' if same[v] else ' DIFFERS'}" for v in fns) + " |")
            print(lines[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
