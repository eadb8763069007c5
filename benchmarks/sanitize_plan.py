"""A small run of the CUDA planner for compute-sanitizer (memcheck / racecheck / synccheck).

    compute-sanitizer --tool memcheck  python benchmarks/sanitize_plan.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize_plan.py

Plans a few small index sets with the CUDA planner (groups 8 / 4 / 2 / 1, merge levels at and below the group,
importance clipping, split private rows, ``topk_length``, invalid entries, a partial last group; and group 8
over 1000-entry lists, where a thread holds two runs of 16 entries) and
compares every plan field by field with the torch planner's (on the CPU, so only the planner kernel
runs under the sanitizer). Exits non-zero on a mismatch.
"""
import sys

import torch

from quilt_attn import plan as make_plan
from quilt_attn.bench import plans_equal
from quilt_attn.workloads import generate


s_q, s_kv, topk = 44, 4096, 300  # 44: a partial last group for every group size
bad = 0


def compare(label, indices, topk_length, **kw):
    """Plan ``indices`` (CPU) with the CUDA planner and the torch planner; print and count a mismatch."""
    global bad
    got = make_plan(indices.cuda(), backend="cuda", s_kv=s_kv,
                    topk_length=None if topk_length is None else topk_length.cuda(), **kw)
    torch.cuda.synchronize()
    ok = plans_equal(got, make_plan(indices, backend="torch", s_kv=s_kv, topk_length=topk_length, **kw))
    bad += not ok
    print(f"{label}: {'same as torch' if ok else 'DIFFERS'}")


idx = generate("glm53-like", s_q, s_kv, topk, seed=3)
idx[3, :40] = -1
idx[5, 7] = s_kv + 3
lengths = torch.full((s_q,), topk, dtype=torch.int32)
lengths[9], lengths[20] = 17, 0
for G, M, iclip, split, tl in [(8, 8, False, False, False), (8, 4, False, False, True), (8, 1, False, False, False),
                               (4, 4, False, False, True), (4, 2, True, True, False), (2, 2, False, True, True),
                               (1, 1, True, False, False), (8, 8, True, True, True),
                               (2, 2, False, False, False)]:
    compare(f"G={G} merge={M} iclip={iclip} split={split} topk_length={tl}", idx, lengths if tl else None,
            group_size=G, merge_level=M, tile=64, importance_clip=iclip, split_private=split)
# group 8 over lists of more than 512 entries: two runs of 16 entries a thread (512-thread CTAs)
long = generate("glm53-like", s_q, s_kv, 1000, seed=5)
long[3, 100:400] = -1
long[6, 9] = s_kv + 1
long_len = torch.full((s_q,), 1000, dtype=torch.int32)
long_len[9], long_len[20] = 700, 0
for T, tau in ((64, 0.5), (16, 1.0)):
    compare(f"topk=1000 G=8 merge=8 tile={T} tau={tau}", long, long_len, group_size=8, merge_level=8, tile=T,
            clip_threshold=tau)
sys.exit(1 if bad else 0)
