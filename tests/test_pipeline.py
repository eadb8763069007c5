"""``plan_ahead`` (quilt_attn/pipeline.py: a plan built on a side stream beside the next attention), and the
planner property that context-parallel ranks rest on: groups are aligned to query 0 and planned independently,
so the plan of a row slice of whole groups equals those groups of the full plan.

CPU part: tiny shapes (the torch planner; the Triton planner in the interpreter), ``plan_ahead``'s settings and
argument errors. GPU part (marker ``gpu``): the production width in bf16, where the side stream and its events
are actually used, on the Triton kernels and (sm_90 only) on the CUDA backend.
"""
from __future__ import annotations

import pytest
import torch

from conftest import KERNEL_DEVICE, randn
from quilt_attn import PlanSettings
from quilt_attn import plan as make_plan
from quilt_attn import plan_ahead, sparse_prefill
from quilt_attn.dispatch import plan_settings
from quilt_attn.ops.sparse_attention import default_group_size, program_shape
from quilt_attn.workloads import generate
from quilt_bench.bench import plans_equal
from test_sparse_attention import no_interp

PLAN_FIELDS = ("tile_kv", "tile_level", "tile_members", "group_tiles", "group_rows")  # + columns() masks
QUERY_FIELDS = ("dropped", "priv_idx", "priv_n")


def assert_same_bits(got, want, what=""):
    for name, a, b in zip(("out", "max_logits", "lse"), got, want):
        assert torch.equal(a, b), f"[{what}] {name} differs"


@pytest.mark.parametrize("G,M,split,iclip", [(8, 4, True, False), (8, 1, False, True), (4, 4, True, True),
                                             (2, 1, False, False)])
def test_chunk_plan_is_a_slice_of_the_full_plan(G, M, split, iclip):
    """Row slices of whole groups (the last one ending in a partial, padded group), invalid entries and
    topk_length: every field of every slice's plan equals its groups (queries) of the full plan."""
    s_q, s_kv, topk = 60, 512, 64
    idx = generate("glm53-like", s_q, s_kv, topk, seed=G + 3 * M)
    idx[5, :7] = -1
    idx[40, 3] = s_kv + 9
    lengths = torch.full((s_q,), topk, dtype=torch.int32)
    lengths[17], lengths[59] = 20, 0
    kw = dict(s_kv=s_kv, topk_length=lengths, group_size=G, tile=16, importance_clip=iclip, merge_level=M,
              split_private=split)
    full = make_plan(idx, **kw)
    cuts = [0, G, *range(4 * G, s_q, 3 * G), s_q]  # a first slice of one group, then three groups each
    bounds = list(zip(cuts[:-1], cuts[1:]))
    chunks = [make_plan(idx[q0:q1], **dict(kw, topk_length=lengths[q0:q1])) for q0, q1 in bounds]
    if iclip:
        assert int(full.dropped.sum()) > 0, "the workload should make importance clipping drop something"
    for p, (q0, q1) in zip(chunks, bounds):
        g0, g1 = q0 // G, -(-q1 // G)
        for f in PLAN_FIELDS:
            assert torch.equal(getattr(p, f), getattr(full, f)[g0:g1]), f"{f} of chunk {q0}:{q1}"
        assert p.packed == full.packed and torch.equal(p.columns()[1], full.columns()[1][g0:g1])
        for f in QUERY_FIELDS:
            a, b = getattr(p, f), getattr(full, f)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b[q0:q1])), f"{f} of chunk {q0}:{q1}"
    assert sum(int(p.valid_pairs) for p in chunks) == int(full.valid_pairs)


@pytest.mark.interpret
def test_triton_planner_chunk_is_a_slice():
    """The fused Triton planner (the GPU path) keeps the slice property too."""
    s_q, s_kv, topk, G = 24, 256, 32, 8
    idx = generate("glm53-like", s_q, s_kv, topk, seed=5).to(KERNEL_DEVICE)
    kw = dict(s_kv=s_kv, group_size=G, tile=16, merge_level=4, split_private=True, backend="triton")
    full = make_plan(idx, **kw)
    part = make_plan(idx[8:24], **kw)
    for f in PLAN_FIELDS:
        assert torch.equal(getattr(part, f), getattr(full, f)[1:3]), f
    assert part.packed == full.packed and torch.equal(part.columns()[1], full.columns()[1][1:3])
    for f in QUERY_FIELDS:
        assert torch.equal(getattr(part, f), getattr(full, f)[8:24]), f


def test_plan_ahead_on_the_cpu_plans_at_once():
    """On the CPU ``plan_ahead`` plans on the spot: the plan is the one ``sparse_prefill`` builds with the same
    settings for the attention backend it names (Triton: private rows split off; CUDA: not, unless importance
    clipping), carries no event, and ``wait`` does nothing. Bad arguments name themselves."""
    s_q, s_kv, topk, h = 40, 256, 24, 4
    idx = generate("glm53-like", s_q, s_kv, topk, seed=2)
    lengths = torch.full((s_q,), topk, dtype=torch.int32)
    lengths[3] = 5
    for backend, st, split in (("triton", PlanSettings(tile=16), True), ("cuda", PlanSettings(tile=16), False),
                               ("cuda", PlanSettings(tile=16, importance_clip=True), True)):
        got = plan_ahead(idx, h, s_kv=s_kv, topk_length=lengths, settings=st, backend=backend)
        want = make_plan(idx, s_kv=s_kv, topk_length=lengths, **plan_settings(h, backend, st))
        assert got._ready is None and got.wait() is got
        assert got.split_private is split and plans_equal(got, want) and got.stats == want.stats, backend
    with pytest.raises(ValueError, match="backend must be one of"):
        plan_ahead(idx, h, s_kv=s_kv, backend="cpu")
    with pytest.raises(ValueError, match="h must be a positive int"):
        plan_ahead(idx, 0, s_kv=s_kv)


@pytest.mark.gpu
@no_interp
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_plan_ahead_beside_the_attention(backend):
    """``plan_ahead`` plans the next index set on the planning stream beside an attention call on the current
    stream: that index set is written on the current stream just before (the planner must wait for it) and,
    in the first rounds, dropped right after (plan_ahead keeps its memory for the planner); the plans equal
    one made on the current stream, and the attention the last one serves equals ``sparse_prefill``'s own
    bit for bit. Three rounds, so plan memory is recycled between them; a non-default current stream."""
    if backend == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CUDA backend needs an sm_90 GPU")
    s_q, s_kv, topk, h = 2048, 8192, 2048, 16
    idx1 = generate("glm53-like", s_q, s_kv, topk, seed=7, device="cuda")
    q = randn(s_q, h, 576, seed=60, dtype=torch.bfloat16, device="cuda")
    kv = randn(s_kv, 576, seed=61, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for r in range(3):
            idx2 = generate("glm53-like", s_q, s_kv, topk, seed=8, device="cuda")
            ahead = plan_ahead(idx2, h, s_kv=s_kv, backend=backend)
            if r < 2:  # dropped right after; the last round's indices serve the attention (a plan is bound
                del idx2  # to the tensor it was built from)
                dropped = ahead
            sparse_prefill(q, kv, idx1, backend=backend)  # the attention the planner runs beside
        got = sparse_prefill(q, kv, idx2, plan=ahead, backend=backend)
    torch.cuda.synchronize()
    G = default_group_size(h)
    here = make_plan(idx2, s_kv=s_kv, group_size=G, merge_level=program_shape(h, G)[0],
                     split_private=backend == "triton")
    for p in (dropped, ahead):
        assert plans_equal(p, here) and p.stats == here.stats
    assert_same_bits(got, sparse_prefill(q, kv, idx2, backend=backend), what=f"plan_ahead, {backend}")
