"""A small run of the CUDA planner for compute-sanitizer (memcheck / racecheck / synccheck).

    compute-sanitizer --tool memcheck  python benchmarks/run.py sanitize-plan
    compute-sanitizer --tool racecheck python benchmarks/run.py sanitize-plan

Plans a few small index sets with the CUDA planner (groups 8 / 4 / 2 / 1, merge levels at and below the group,
importance clipping, split private rows, ``topk_length``, invalid entries, a partial last group; group 8
over 1000-entry lists, where a thread holds two runs of 16 entries; and slot ids spread over a pool of
2^31 - 1 rows, where the columns are not packed) and
compares every plan field by field with the torch planner's (on the CPU, so only the planner kernel
runs under the sanitizer). Exits non-zero on a mismatch. ``--out``: the rows as JSON (with GPU, commit,
versions).
"""
from __future__ import annotations

import argparse
import sys

import torch

from quilt_attn import plan as make_plan
from quilt_attn.workloads import generate
from quilt_bench.bench import plans_equal, save

S_Q, S_KV, TOPK = 44, 4096, 300  # 44: a partial last group for every group size
CONFIGS = [(8, 8, False, False, False), (8, 4, False, False, True), (8, 1, False, False, False),
           (4, 4, False, False, True), (4, 2, True, True, False), (2, 2, False, True, True),
           (1, 1, True, False, False), (8, 8, True, True, True), (2, 2, False, False, False)]


def compare(label, indices, topk_length, s_kv=S_KV, **kw) -> dict:
    """Plan ``indices`` (CPU) with the CUDA planner and the torch planner; print the verdict, return its row."""
    got = make_plan(indices.cuda(), backend="cuda", s_kv=s_kv,
                    topk_length=None if topk_length is None else topk_length.cuda(), **kw)
    torch.cuda.synchronize()
    ok = plans_equal(got, make_plan(indices, backend="torch", s_kv=s_kv, topk_length=topk_length, **kw))
    print(f"{label}: {'same as torch' if ok else 'DIFFERS'}")
    return dict(case=label, same_as_torch=ok)


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON file for the rows (optional)")
    a = p.parse_args(argv)
    idx = generate("glm53-like", S_Q, S_KV, TOPK, seed=3)
    idx[3, :40] = -1
    idx[5, 7] = S_KV + 3
    lengths = torch.full((S_Q,), TOPK, dtype=torch.int32)
    lengths[9], lengths[20] = 17, 0
    rows = []
    for G, M, iclip, split, tl in CONFIGS:
        rows.append(compare(f"G={G} merge={M} iclip={iclip} split={split} topk_length={tl}", idx,
                            lengths if tl else None, group_size=G, merge_level=M, tile=64, importance_clip=iclip,
                            split_private=split))
    # group 8 over lists of more than 512 entries: two runs of 16 entries a thread (512-thread CTAs)
    long = generate("glm53-like", S_Q, S_KV, 1000, seed=5)
    long[3, 100:400] = -1
    long[6, 9] = S_KV + 1
    long_len = torch.full((S_Q,), 1000, dtype=torch.int32)
    long_len[9], long_len[20] = 700, 0
    for T, tau in ((64, 0.5), (16, 1.0)):
        rows.append(compare(f"topk=1000 G=8 merge=8 tile={T} tau={tau}", long, long_len, group_size=8,
                            merge_level=8, tile=T, clip_threshold=tau))
    # slot ids of a pool of 2^31 - 1 rows (the largest int32 pool): row r of the context is slot slots[r];
    # the entries invalid in the context stay invalid (-1, or the pool's size)
    pool = 2**31 - 1
    slots = torch.randint(0, pool, (S_KV + 4,), generator=torch.Generator().manual_seed(11), dtype=torch.int64)
    for name, ix, ln in (("topk=300", idx, lengths), ("topk=1000", long, long_len)):
        ok = (ix >= 0) & (ix < S_KV)
        spread = torch.where(ok, slots[ix.clamp(0, S_KV - 1).long()], torch.where(ix < 0, -1, pool)).to(torch.int32)
        for G, M in ((8, 8), (4, 4), (4, 2)):
            rows.append(compare(f"{name} pool 2^31-1 G={G} merge={M}", spread, ln, s_kv=pool, group_size=G,
                                merge_level=M, tile=64))
    if a.out:
        save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
    return 0 if all(r["same_as_torch"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
