"""``sparse_prefill_pipelined`` (chunked QUILT prefill with the planner one chunk ahead) and ``plan_ahead``
(a plan built on a side stream beside the next attention), quilt_attn/pipeline.py.

The claim it rests on: groups are aligned to query 0 and planned independently, so the plan of a
chunk of whole groups equals those groups of the full plan; the pipelined outputs then equal the
unchunked ``sparse_prefill`` bit for bit (same kernels, same tiles, each query's rows in the same
order). CPU part: tiny fp16 shapes through Triton's interpreter (helpers and sizes of
test_sparse_attention.py), every output NaN-poisoned, and the backend argument's errors. GPU part
(marker ``gpu``): the production width in bf16, where the side stream and its events are actually
used, on the Triton kernels and (sm_90 only) on the CUDA backend.
"""
from __future__ import annotations

import pytest
import torch

from conftest import (HAS_CUDA, KERNEL_DEVICE, TOLERANCES, assert_matches_reference, indexer_aligned_inputs,
                      make_inputs, randn)
from quilt_attn import plan as make_plan
from quilt_attn import plan_ahead, quantize_fp8, sparse_prefill, sparse_prefill_pipelined
from quilt_attn.bench import plans_equal
from quilt_attn.dispatch import quilt_pays_off
from quilt_attn.ops.sparse_attention import default_group_size, program_shape
from quilt_attn.pipeline import chunk_bounds, plan_chunks
from quilt_attn.workloads import generate
from test_sparse_attention import CLIP_MODEL, DV, F16, kept_indices, no_interp, ref, run

# GPU tests of the Triton path pin it: "auto" picks the CUDA kernel on an sm_90 GPU
TRITON = {"backend": "triton"}
PLAN_FIELDS = ("tile_kv", "tile_level", "tile_members", "group_tiles", "group_rows")  # + columns() masks
QUERY_FIELDS = ("dropped", "priv_idx", "priv_n")


@pytest.fixture(autouse=True)
def _poison_outputs(nan_poison):
    """NaN-filled ``torch.empty``: every row of the preallocated outputs must be written by its chunk."""
    yield


def pipelined(q, kv, idx, sm_scale=None, **kw):
    kw.setdefault("d_v", DV)
    kw.setdefault("tile", 16)
    return sparse_prefill_pipelined(q, kv, idx, sm_scale, **kw)


def assert_same_bits(got, want, what=""):
    for name, a, b in zip(("out", "max_logits", "lse"), got, want):
        assert torch.equal(a, b), f"[{what}] {name} differs from the unchunked run"


def test_chunk_bounds():
    assert chunk_bounds(64, 24, 8) == [(0, 24), (24, 48), (48, 64)]
    assert chunk_bounds(60, 16, 4, first_chunk=8) == [(0, 8), (8, 24), (24, 40), (40, 56), (56, 60)]
    assert chunk_bounds(10, 64, 8) == [(0, 10)]
    assert chunk_bounds(0, 8, 8) == []


@pytest.mark.parametrize("bad", [12, 0, -8, 8.0, True])
def test_chunk_must_hold_whole_groups(bad):
    with pytest.raises(ValueError, match=r"\bchunk must be a positive multiple of group_size = 8"):
        chunk_bounds(64, bad, 8)
    with pytest.raises(ValueError, match=r"\bfirst_chunk must be a positive multiple of group_size = 8"):
        chunk_bounds(64, 16, 8, first_chunk=bad)


@pytest.mark.interpret
def test_pipelined_rejects_a_chunk_of_partial_groups():
    q, kv, idx = make_inputs(16, 2, s_kv=64, topk=16)
    with pytest.raises(ValueError, match=r"\bchunk must be a positive multiple of group_size = 4"):
        pipelined(q, kv, idx, chunk=6, group_size=4)


def test_backend_argument_is_checked():
    q = randn(16, 2, 576, seed=0, dtype=torch.bfloat16)
    kv = randn(64, 576, seed=1, dtype=torch.bfloat16)
    idx = torch.zeros(16, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'cuda'\), got 'cutlass'"):
        sparse_prefill_pipelined(q, kv, idx, backend="cutlass")
    # choose_backend's reason, as sparse_prefill(backend="cuda") gives it, before anything is planned
    with pytest.raises(ValueError, match="backend='cuda': the CUDA backend needs a CUDA device, got cpu"):
        sparse_prefill_pipelined(q, kv, idx, backend="cuda")


@pytest.mark.interpret
def test_prebuilt_plans_must_cover_q():
    q, kv, idx = make_inputs(16, 2, s_kv=64, topk=16)
    plans = plan_chunks(idx[:8], 2, s_kv=64, chunk=8, tile=16)
    with pytest.raises(ValueError, match="plans cover 8 queries but q has s_q = 16"):
        pipelined(q, kv, idx, plans=plans)
    with pytest.raises(TypeError, match=r"plans\[0\] must be a quilt_attn.Plan"):
        pipelined(q, kv, idx, plans=["plan"])


@pytest.mark.parametrize("G,M,split,iclip", [(8, 4, True, False), (8, 1, False, True), (4, 4, True, True),
                                             (2, 1, False, False)])
def test_chunk_plan_is_a_slice_of_the_full_plan(G, M, split, iclip):
    """Chunks of whole groups, s_q not a multiple of chunk nor of G (padded last group), invalid entries
    and topk_length: every field of every chunk plan equals its groups (queries) of the full plan."""
    s_q, s_kv, topk = 60, 512, 64
    idx = generate("glm53-like", s_q, s_kv, topk, seed=G + 3 * M)
    idx[5, :7] = -1
    idx[40, 3] = s_kv + 9
    lengths = torch.full((s_q,), topk, dtype=torch.int32)
    lengths[17], lengths[59] = 20, 0
    kw = dict(s_kv=s_kv, topk_length=lengths, group_size=G, tile=16, importance_clip=iclip, merge_level=M,
              split_private=split)
    full = make_plan(idx, **kw)
    chunks = plan_chunks(idx, 4, chunk=3 * G, first_chunk=G, **kw)
    bounds = chunk_bounds(s_q, 3 * G, G, first_chunk=G)
    assert [p.s_q for p in chunks] == [q1 - q0 for q0, q1 in bounds]
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


@pytest.mark.interpret
def test_pipelined_equals_unchunked():
    """QUILT forced (fallback=False): bit for bit the unchunked run, for chunks that divide s_q or not,
    with a smaller first chunk, and with prebuilt chunk plans; s_q = 36 ends in a partial (padded) group."""
    s_q, s_kv, topk, h = 36, 384, 48, 4
    idx = generate("glm53-like", s_q, s_kv, topk, seed=11).to(KERNEL_DEVICE)
    q, kv, idx = make_inputs(s_q, h, s_kv=s_kv, topk=topk, seed=12, indices=idx)
    whole = run(q, kv, idx, "quilt", 0.1, fallback=False)
    assert_matches_reference(whole, ref(q, kv, idx, 0.1), F16, what="unchunked")
    for kw in (dict(chunk=16), dict(chunk=24, first_chunk=8)):
        assert_same_bits(pipelined(q, kv, idx, 0.1, fallback=False, **kw), whole, what=str(kw))
    plans = plan_chunks(idx, h, s_kv=s_kv, chunk=24, tile=16)  # 24 + 12 queries
    assert_same_bits(pipelined(q, kv, idx, 0.1, fallback=False, plans=plans), whole, what="prebuilt plans")


@pytest.mark.interpret
def test_fallback_is_decided_per_chunk():
    """With ``fallback="cost"`` and prebuilt plans, each chunk runs the kernel its own plan's cost decision
    picks: QUILT where its groups share (first half, identical lists), query-parallel where they do not
    (second half, random lists); invalid entries, topk_length and attn_sink go to whichever kernel runs.
    The default runs every chunk's plan, and the cost rule needs prebuilt plans."""
    s_q, s_kv, topk, h = 32, 1024, 32, 16
    shared = generate("identical", 16, s_kv, topk, seed=1, group=16)
    lonely = generate("random", 16, s_kv, topk, seed=2)
    idx = torch.cat([shared, lonely]).to(KERNEL_DEVICE)
    idx[20, :5] = -1
    q, kv, idx = make_inputs(s_q, h, s_kv=s_kv, topk=topk, seed=13, indices=idx)
    lengths = torch.full((s_q,), topk, dtype=torch.int32, device=q.device)
    lengths[3], lengths[25] = 9, 0
    sink = torch.linspace(-1.0, 1.0, h, device=q.device)
    extra = dict(topk_length=lengths, attn_sink=sink)
    chunks = plan_chunks(idx, h, s_kv=s_kv, chunk=16, tile=16, topk_length=lengths)
    assert [quilt_pays_off(p, h) for p in chunks] == [True, False]
    got = pipelined(q, kv, idx, plans=chunks, fallback="cost", **extra)
    assert_matches_reference(got, ref(q, kv, idx, **extra), F16, what="pipelined, fallback per chunk")
    quilt = run(q, kv, idx, "quilt", fallback=False, **extra)
    qpar = run(q, kv, idx, "query_parallel", **extra)
    for a, b, c in zip(got, quilt, qpar):
        assert torch.equal(a[:16], b[:16]), "chunk 0 should run QUILT"
        assert torch.equal(a[16:], c[16:]), "chunk 1 should fall back to query-parallel"
    assert_same_bits(pipelined(q, kv, idx, chunk=16, **extra), quilt, what="default: every chunk runs its plan")
    with pytest.raises(ValueError, match="fallback='cost' reads the tile counts of prebuilt plans"):
        pipelined(q, kv, idx, chunk=16, fallback="cost", **extra)


@pytest.mark.interpret
def test_pipelined_importance_clip():
    """Importance clipping (approximate, per query): the chunked plans drop exactly the unchunked plan's
    pairs, so the outputs are the unchunked ones bit for bit, and exact on the kept pairs."""
    s_q, s_kv, topk, h, G = 24, 256, 64, 2, 4
    q, kv, idx, scale = indexer_aligned_inputs("glm53-like", s_q, s_kv, topk, h, d_qk=80, dtype=F16,
                                               device=KERNEL_DEVICE, seed=7, local_bonus=0.0, **CLIP_MODEL)
    kw = dict(group_size=G, importance_clip=True, clip_threshold=0.5)
    whole = run(q, kv, idx, "quilt", scale, **kw)
    got = pipelined(q, kv, idx, scale, chunk=8, **kw)
    assert_same_bits(got, whole, what="importance_clip")
    p = make_plan(idx, s_kv=s_kv, tile=16, merge_level=program_shape(h, G)[0], split_private=True, **kw)
    kept, n_dropped = kept_indices(p, idx, s_kv)
    assert n_dropped > 0
    assert_matches_reference(got, ref(q, kv, kept, scale), F16, what="kept pairs")


@pytest.mark.interpret
@pytest.mark.parametrize("h,fp8", [(4, False), (2, True), (64, False)])
def test_cuda_path_with_a_stand_in_kernel(cuda_stand_in, h, fp8):
    """The CUDA path's dispatch, on the CPU: with the CUDA kernel replaced by the Triton pass it mirrors (same
    arguments, outputs written in place), the pipeline runs what ``sparse_prefill(backend="cuda")`` runs, bit
    for bit: dense kv (an FP8 cache expanded), plans without a private split at merge level 64 // h, QUILT on
    every chunk even where the Triton rule would fall back (random lists), no plan at h >= 64; prebuilt
    split plans run their private rows in the Triton pass after the CUDA tiles."""
    seen = cuda_stand_in
    d_qk, d_v = (576, 512) if fp8 else (80, DV)
    s_q, s_kv, topk = 36, 384, 48
    q, kv, idx = make_inputs(s_q, h, s_kv=s_kv, topk=topk, d_qk=d_qk, d_v=d_v, seed=21)
    kv_in = quantize_fp8(kv) if fp8 else kv
    lengths = torch.full((s_q,), topk, dtype=torch.int32, device=q.device)
    lengths[3], lengths[30] = 9, 0
    kw = dict(d_v=d_v, tile=16, topk_length=lengths, attn_sink=torch.linspace(-1.0, 1.0, h, device=q.device),
              backend="cuda")
    M = program_shape(h, 8)[0]
    if M > 1:
        assert not any(quilt_pays_off(p, h) for p in plan_chunks(idx, h, s_kv=s_kv, chunk=16, tile=16)), \
            "random lists: the Triton cost rule would fall back, the CUDA path must not"

    whole = sparse_prefill(q, kv_in, idx, **kw)
    n_whole = len(seen)
    got = sparse_prefill_pipelined(q, kv_in, idx, chunk=16, **kw)
    assert_same_bits(got, whole, what=f"h={h} fp8={fp8}")
    if M == 1:  # one query fills a tile: one query-parallel launch over all queries
        assert seen == [None, None]
    else:
        assert n_whole == 1 and len(seen) == 1 + 3, "one launch unchunked, one a chunk (16 + 16 + 4 queries)"
        for p in seen:
            assert not p.split_private and p.merge_level == M and p.tile == 16, p
    if not fp8:
        assert_matches_reference(got, ref(q, kv, idx, topk_length=lengths, attn_sink=kw["attn_sink"]), F16,
                                 what=f"h={h}")
    for split in (False, True):
        pkw = dict(s_kv=s_kv, topk_length=lengths, group_size=default_group_size(h), tile=16, merge_level=M,
                   split_private=split)
        want = sparse_prefill(q, kv_in, idx, plan=make_plan(idx, **pkw), **kw)
        plans = plan_chunks(idx, h, chunk=16, **pkw)
        assert_same_bits(sparse_prefill_pipelined(q, kv_in, idx, plans=plans, **kw), want, what=f"split={split}")


# =============================================================================================
# GPU: the side stream, events and record_stream at the production width (d_qk 576, d_v 512, bf16)
@pytest.mark.gpu
@no_interp
@pytest.mark.parametrize("h", [8, 16])
def test_gpu_pipelined_equals_unchunked(h):
    s_q, s_kv, topk = 2048, 8192, 2048
    idx = generate("glm53-like", s_q, s_kv, topk, seed=3, device="cuda")
    q = randn(s_q, h, 576, seed=40 + h, dtype=torch.bfloat16, device="cuda")
    kv = randn(s_kv, 576, seed=41, dtype=torch.bfloat16, device="cuda")
    whole = sparse_prefill(q, kv, idx, fallback=False, **TRITON)
    stream = torch.cuda.Stream()  # the caller's current stream need not be the default one
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for kw in (dict(chunk=512), dict(chunk=1024, first_chunk=256)):
            for _ in range(3):  # repeated: plan memory is recycled between calls
                got = sparse_prefill_pipelined(q, kv, idx, fallback=False, **kw, **TRITON)
                assert_same_bits(got, whole, what=f"h={h} {kw}")
        got = sparse_prefill_pipelined(q, kv, idx, chunk=512, **TRITON)  # the default: every chunk's plan runs
    torch.cuda.synchronize()
    assert_same_bits(got, whole, what=f"h={h} default fallback")
    ro, _, rl = ref(q[:128], kv, idx[:128], d_v=512)
    tol = TOLERANCES[torch.bfloat16]
    assert ((got[0][:128].double() - ro.double()).norm() / ro.double().norm()).item() < tol.rel_l2
    assert (got[2][:128].double() - rl.double()).abs().max().item() < tol.stat_atol


on_hopper = pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0),
                               reason="the CUDA backend needs an sm_90 GPU")


@pytest.mark.gpu
@no_interp
@on_hopper
@pytest.mark.parametrize("h,kv_kind", [(8, "bf16"), (16, "fp8"), (64, "bf16")])
def test_gpu_cuda_pipelined_equals_unchunked(h, kv_kind):
    """The CUDA backend: every chunk runs QUILT on a plan built as ``sparse_prefill(backend="cuda")`` builds
    it (no private split, merge level 64 // h), so the outputs equal its outputs bit for bit; at h = 64
    neither plans (query-parallel over all queries). With attn_sink, topk_length, invalid entries, a
    partial last group (s_q = 2044), the FP8 cache (expanded once a call), "auto" (which picks the CUDA
    kernel here) and prebuilt chunk plans, unsplit and split (the CUDA tiles then the Triton private pass).
    """
    s_q, s_kv, topk = 2044, 8192, 2048
    idx = generate("glm53-like", s_q, s_kv, topk, seed=5, device="cuda")
    idx[100, :50] = -1
    q = randn(s_q, h, 576, seed=50 + h, dtype=torch.bfloat16, device="cuda")
    kv = randn(s_kv, 576, seed=51, dtype=torch.bfloat16, device="cuda")
    if kv_kind == "fp8":
        kv = quantize_fp8(kv)
    lengths = torch.full((s_q,), topk, dtype=torch.int32, device="cuda")
    lengths[7], lengths[1500] = 100, 0
    extra = dict(topk_length=lengths, attn_sink=torch.linspace(-1.0, 1.0, h, device="cuda"))
    whole = sparse_prefill(q, kv, idx, backend="cuda", **extra)
    stream = torch.cuda.Stream()  # the caller's current stream need not be the default one
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for kw in (dict(chunk=512), dict(chunk=1024, first_chunk=256), dict(chunk=512, backend="auto")):
            kw.setdefault("backend", "cuda")
            for _ in range(2):  # repeated: plan memory is recycled between calls
                got = sparse_prefill_pipelined(q, kv, idx, **kw, **extra)
                assert_same_bits(got, whole, what=f"cuda h={h} {kv_kind} {kw}")
    torch.cuda.synchronize()
    # prebuilt plans: against the unchunked run of the same plan settings (at h = 64 that is a plan too)
    G = default_group_size(h)
    M = program_shape(h, G)[0]
    for split in (False, True):
        pkw = dict(s_kv=s_kv, topk_length=lengths, group_size=G, merge_level=M, split_private=split)
        want = sparse_prefill(q, kv, idx, plan=make_plan(idx, **pkw), backend="cuda", **extra)
        if h < 64 and not split:
            assert_same_bits(want, whole, what=f"cuda h={h}: sparse_prefill plans with these settings")
        got = sparse_prefill_pipelined(q, kv, idx, plans=plan_chunks(idx, h, chunk=512, **pkw), backend="cuda",
                                       **extra)
        assert_same_bits(got, want, what=f"cuda h={h} {kv_kind} prebuilt plans, split_private={split}")
    rows = torch.cat([torch.arange(0, s_q, 16), torch.tensor([7, 100, 1500, s_q - 1])]).to("cuda")
    ro, _, rl = ref(q[rows], kv, idx[rows], d_v=512, topk_length=lengths[rows], attn_sink=extra["attn_sink"])
    tol = TOLERANCES[torch.bfloat16]
    assert ((whole[0][rows].double() - ro.double()).norm() / ro.double().norm()).item() < tol.rel_l2
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(whole[2][rows]), fin)
    assert (whole[2][rows][fin].double() - rl[fin].double()).abs().max().item() < tol.stat_atol


def test_plan_ahead_on_the_cpu_plans_at_once():
    """On the CPU ``plan_ahead`` plans on the spot: the plan equals ``plan_chunks``' unchunked one with the
    settings ``sparse_prefill`` uses for the attention backend it names (Triton: private rows split off;
    CUDA: not), carries no event, and ``wait`` does nothing. Bad arguments name themselves."""
    s_q, s_kv, topk, h = 40, 256, 24, 4
    idx = generate("glm53-like", s_q, s_kv, topk, seed=2)
    lengths = torch.full((s_q,), topk, dtype=torch.int32)
    lengths[3] = 5
    for backend, split in (("triton", True), ("cuda", False)):
        got = plan_ahead(idx, h, s_kv=s_kv, topk_length=lengths, tile=16, backend=backend)
        want = plan_chunks(idx, h, s_kv=s_kv, chunk=s_q, topk_length=lengths, tile=16, split_private=split)[0]
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
    stream: that index set is written on the current stream just before (the planner must wait for it) and
    dropped right after (plan_ahead keeps its memory for the planner); the plan equals one made on the
    current stream, and the attention it then serves equals ``sparse_prefill``'s own bit for bit. Three
    rounds, so plan memory is recycled between them; a non-default current stream."""
    if backend == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CUDA backend needs an sm_90 GPU")
    s_q, s_kv, topk, h = 2048, 8192, 2048, 16
    idx1 = generate("glm53-like", s_q, s_kv, topk, seed=7, device="cuda")
    q = randn(s_q, h, 576, seed=60, dtype=torch.bfloat16, device="cuda")
    kv = randn(s_kv, 576, seed=61, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            idx2 = generate("glm53-like", s_q, s_kv, topk, seed=8, device="cuda")
            ahead = plan_ahead(idx2, h, s_kv=s_kv, backend=backend)
            del idx2
            sparse_prefill(q, kv, idx1, backend=backend)  # the attention the planner runs beside
            got = sparse_prefill(q, kv, generate("glm53-like", s_q, s_kv, topk, seed=8, device="cuda"),
                                 plan=ahead, backend=backend)
    torch.cuda.synchronize()
    idx2 = generate("glm53-like", s_q, s_kv, topk, seed=8, device="cuda")
    G = default_group_size(h)
    here = make_plan(idx2, s_kv=s_kv, group_size=G, merge_level=program_shape(h, G)[0],
                     split_private=backend == "triton")
    assert plans_equal(ahead, here) and ahead.stats == here.stats
    assert_same_bits(got, sparse_prefill(q, kv, idx2, backend=backend), what=f"plan_ahead, {backend}")
