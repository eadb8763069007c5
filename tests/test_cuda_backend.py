"""The CUDA backend: choice and errors (CPU), build check (nvcc, no GPU needed), sm_90a specifics (GPU).

The production-shape correctness tests of both backends are in ``test_sparse_attention.py``
(parametrized by ``backend``); this file holds what only the CUDA backend has.
"""
from __future__ import annotations

import ctypes
import os

import pytest
import torch

from conftest import (HAS_CUDA, KERNEL_DEVICE, TOLERANCES, assert_matches_reference, make_inputs, natural_stats,
                      random_indices, randn)
from quilt_attn import plan as make_plan
from quilt_attn import PlanSettings, dispatch, sparse_prefill, sparse_prefill_reference
from quilt_attn.dispatch import choose_backend
from quilt_attn.ops import cuda_backend
from quilt_attn.ops.shapes import program_shape

BF16 = torch.bfloat16


def test_backend_argument_is_checked():
    q = randn(4, 2, 80, seed=0)
    kv = randn(32, 80, seed=1)
    idx = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend must be one of"):
        sparse_prefill(q, kv, idx, method="quilt", d_v=64, backend="cutlass")


def test_launch_refuses_an_out_it_cannot_write_in_16_byte_pieces():
    q, kv = randn(4, 2, 576, seed=0), randn(32, 576, seed=1)
    ml, lse = torch.empty(4, 2), torch.empty(4, 2)
    idx = torch.zeros(4, 8, dtype=torch.int32)
    misaligned = torch.empty(4, 2, 513, dtype=q.dtype)[:, :, 1:]  # 2 bytes off
    with pytest.raises(ValueError, match="16-byte"):
        cuda_backend.launch(q, kv, 0.05, misaligned, ml, lse, indices=idx)


def test_cuda_backend_refuses_cpu_and_names_why():
    q = randn(4, 2, 576, seed=0, dtype=BF16)
    kv = randn(32, 576, seed=1, dtype=BF16)
    with pytest.raises(ValueError, match="backend='cuda': the CUDA backend needs a CUDA device"):
        choose_backend("cuda", q, kv, 512)
    assert choose_backend("auto", q, kv, 512) == "triton"
    assert choose_backend("triton", q, kv, 512) == "triton"


def test_cuda_backend_scope():
    q = randn(4, 2, 80, seed=0)
    assert "d_qk = 576" in cuda_backend.unsupported_reason(q, randn(8, 80, seed=1), 64)
    q = randn(4, 2, 576, seed=0, dtype=torch.float32)
    assert "bf16 / fp16" in cuda_backend.unsupported_reason(q, randn(8, 576, seed=1, dtype=torch.float32), 512)
    q = randn(4, 2, 576, seed=0, dtype=BF16)
    assert cuda_backend.unsupported_reason(q, randn(8, 576, seed=1, dtype=BF16), 512) is None
    p = make_plan(torch.zeros(4, 8, dtype=torch.int32), s_kv=8, tile=16)
    assert "tile = 64" in cuda_backend.unsupported_reason(q, randn(8, 576, seed=1, dtype=BF16), 512, p)


@pytest.mark.interpret
@pytest.mark.parametrize("h,runs_cuda", [(4, False), (64, True)])
def test_auto_query_parallel_below_64_heads_runs_triton(cuda_stand_in, h, runs_cuda):
    """With backend="auto" the CUDA backend hands query-parallel calls below 64 heads to Triton's
    smaller query programs (a CUDA program computes a whole 64-row tile); "cuda" itself never does."""
    calls = cuda_stand_in
    q, kv, idx = make_inputs(8, h, s_kv=64, topk=16, device=KERNEL_DEVICE)
    for backend, expect in (("auto", runs_cuda), ("cuda", True)):
        calls.clear()
        got = sparse_prefill(q, kv, idx, method="query_parallel", d_v=64, backend=backend)
        assert bool(calls) == expect, backend
        assert_matches_reference(got, sparse_prefill_reference(q, kv, idx, d_v=64), torch.float16)


@pytest.mark.interpret
@pytest.mark.parametrize("fallback,iclip,runs_plan", [(True, False, False), (False, False, True), (True, True, True)])
def test_given_plan_at_64_heads_runs_query_programs(cuda_stand_in, fallback, iclip, runs_plan):
    """As on Triton: one query fills a 64-row program at h = 64, so a given plan runs query by query
    unless fallback is off or the plan clips (its dropped pairs must stay dropped)."""
    plans = cuda_stand_in
    q, kv, idx = make_inputs(16, 64, s_kv=128, topk=32, device=KERNEL_DEVICE)
    p = make_plan(idx, s_kv=128, tile=16, merge_level=1, importance_clip=iclip, split_private=iclip)
    got = sparse_prefill(q, kv, idx, plan=p, d_v=64, settings=PlanSettings(fallback=fallback), backend="cuda")
    assert (plans[0] is not None) == runs_plan
    if not iclip:
        assert_matches_reference(got, sparse_prefill_reference(q, kv, idx, d_v=64), torch.float16)


@pytest.mark.interpret
@pytest.mark.parametrize("in_kernel,dtype,reaches", [(False, BF16, "expanded"), (True, BF16, "cache"),
                                                     (True, torch.float16, "expanded")])
def test_fp8_cache_reaches_the_cuda_kernel_as_the_knob_says(cuda_stand_in, monkeypatch, in_kernel, dtype, reaches):
    """``cuda_backend.FP8_IN_KERNEL`` hands the CUDA kernel the FP8 cache itself (bf16 q: widened in the
    kernel), else the cache expanded to q's dtype once per call; fp16 q is always expanded."""
    from quilt_attn import quantize_fp8

    monkeypatch.setattr(cuda_backend, "FP8_IN_KERNEL", in_kernel)
    seen = []  # (the stand-in's routing to "cuda", its kernel replaced by a recorder of what kv reaches it)
    monkeypatch.setattr(cuda_backend, "launch", lambda q, kv, *a, **k: seen.append(kv.dtype))
    q = randn(8, 2, 576, seed=90, dtype=dtype, device=KERNEL_DEVICE)
    cache = quantize_fp8(randn(64, 576, seed=91, dtype=BF16, device=KERNEL_DEVICE))
    idx = random_indices(8, 64, 16, seed=92, device=KERNEL_DEVICE)
    sparse_prefill(q, cache, idx, d_v=512, method="query_parallel", backend="cuda")
    assert seen == [torch.uint8 if reaches == "cache" else dtype]


def test_cuda_scope_of_the_fp8_cache():
    """The kernel reads the FP8 cache ``uint8 [s_kv, 656]`` with bf16 q; anything else is named."""
    q = torch.empty(4, 2, 576, dtype=BF16)
    assert cuda_backend.unsupported_reason(q, torch.empty(8, 656, dtype=torch.uint8), 512) is None
    for qd, kv in ((torch.float16, torch.empty(8, 656, dtype=torch.uint8)), (BF16, torch.empty(8, 655, dtype=torch.uint8)),
                   (BF16, torch.empty(8, 2, 656, dtype=torch.uint8))):
        reason = cuda_backend.unsupported_reason(q.to(qd), kv, 512)
        assert reason is not None and "FP8 cache" in reason


needs_nvcc = pytest.mark.skipif(cuda_backend.find_nvcc() is None, reason="needs nvcc (a compile-only check)")


@pytest.fixture(scope="module")
def kernel_library(tmp_path_factory):
    """The library nvcc builds (no GPU needed) into a fresh cache, once for the tests that read it."""
    cache = tmp_path_factory.mktemp("quilt_cuda_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUILT_CUDA_CACHE", str(cache))
        return cuda_backend.build()


@needs_nvcc
def test_kernel_library_builds_and_matches_the_parameter_block(kernel_library, tmp_path, monkeypatch):
    """nvcc builds the sm_90a library without a GPU; its Params block has the layout Python sends."""
    path = kernel_library
    monkeypatch.setenv("QUILT_CUDA_CACHE", str(path.parent))
    assert path.exists() and cuda_backend.library_path() == path
    assert cuda_backend.build() == path  # cached: no second build
    lib = ctypes.CDLL(str(path))
    assert lib.quilt_sm90_params_size() == ctypes.sizeof(cuda_backend._Params)
    assert lib.quilt_sm90_smem_bytes() <= 232448
    variant = tmp_path / "variant.so"  # a prebuilt variant (tools: sanitizer build, -D switches)
    variant.write_bytes(path.read_bytes())
    try:
        cuda_backend.use_library(variant)
        assert cuda_backend._library()._name == str(variant)
    finally:
        cuda_backend.use_library(None)
    assert cuda_backend._LIB is None and cuda_backend._OVERRIDE is None


@needs_nvcc
def test_parameter_blocks_match_the_ctypes_mirrors_field_by_field(kernel_library, monkeypatch):
    """ABI: every field of Params and PlanParams (name, order, byte offset, as the library compiled them)
    equals the ctypes mirror's (``_Params.<field>.offset``), and loading the library checks the same."""
    lib = ctypes.CDLL(str(kernel_library))
    for struct, prefix in ((cuda_backend._Params, "quilt_sm90"), (cuda_backend._PlanParams, "quilt_plan")):
        compiled = cuda_backend.library_layout(lib, prefix)
        assert [name for name, _ in compiled] == [name for name, _ in struct._fields_], prefix
        for name, offset in compiled:
            assert getattr(struct, name).offset == offset, (prefix, name)
        assert getattr(lib, prefix + "_params_size")() == ctypes.sizeof(struct)
    try:
        cuda_backend.use_library(kernel_library)
        assert cuda_backend._library()._name == str(kernel_library)  # the load-time check passes
        cuda_backend.use_library(kernel_library)
        real = cuda_backend.mirror_layout  # a mirror whose nslots sits 1 byte off: refused at load
        moved = [(name, off + (name == "nslots")) for name, off in real(cuda_backend._PlanParams)]
        monkeypatch.setattr(cuda_backend, "mirror_layout",
                            lambda struct: moved if struct is cuda_backend._PlanParams else real(struct))
        with pytest.raises(cuda_backend.CudaBackendError, match="PlanParams block's layout differs"):
            cuda_backend._library()
    finally:
        cuda_backend.use_library(None)


@needs_nvcc
def test_timeline_slots_the_benchmark_reads_are_the_kernels(kernel_library):
    """benchmarks/boundary_timeline.py reads the QUILT_TIMELINE stamps by slot name: every name it uses is
    in the library's table (QUILT_TIMELINE_SLOTS), each once."""
    import re
    from pathlib import Path

    lib = ctypes.CDLL(str(kernel_library))
    lib.quilt_sm90_timeline_slots.restype = ctypes.c_char_p
    slots = lib.quilt_sm90_timeline_slots().decode().rstrip(",").split(",")
    assert len(slots) == len(set(slots)) == 10
    script = (Path(__file__).parents[1] / "benchmarks" / "boundary_timeline.py").read_text()
    used = set(re.findall(r'\b(?:ts|cur|prev)\["(\w+)"\]', script))
    assert used and used <= set(slots), used - set(slots)


def test_wgmma_wrappers_are_the_generators_output():
    """wgmma_ops.cuh is generated (its operand lists are long): regenerating it gives the file as it is."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_wgmma_ops", cuda_backend.CSRC / "gen_wgmma_ops.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)  # (defines render(); writes nothing when imported)
    assert gen.render() == (cuda_backend.CSRC / "wgmma_ops.cuh").read_text()


def test_build_hash_covers_every_kernel_source():
    """The build cache is keyed by a hash of SOURCES: every unit and header beside them is in it."""
    on_disk = {p.name for p in cuda_backend.CSRC.iterdir() if p.suffix in (".cu", ".cuh")}
    assert set(cuda_backend.SOURCES) == on_disk and set(cuda_backend.UNITS) <= on_disk


def test_program_heads_are_powers_of_two():
    """The kernel splits a program's rows into query and head with shifts (q copies, epilogue): the
    program shape must give a power-of-two head block, at most 64 rows, for every head count and group."""

    for G in (1, 2, 4, 8, 16):
        for h in range(1, 129):
            qp, hb = program_shape(h, G)
            assert hb & (hb - 1) == 0 and 16 <= qp * hb <= 64 and qp <= G, (h, G, qp, hb)


# =============================================================================================
# GPU (sm_90)
# =============================================================================================
gpu = pytest.mark.gpu
on_hopper = pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0),
                               reason="the CUDA backend needs an sm_90 GPU")


def _inputs(h, s_q=256, s_kv=4096, topk=2048, workload="glm53-like", dtype=BF16, seed=3):
    from quilt_attn.workloads import generate

    q = randn(s_q, h, 576, seed=seed, dtype=dtype, device="cuda")
    kv = randn(s_kv, 576, seed=seed + 1, dtype=dtype, device="cuda")
    idx = generate(workload, s_q, s_kv, topk, seed=seed, device="cuda")
    return q, kv, idx


@gpu
@on_hopper
@pytest.mark.parametrize("n,max_tiles", [(1, 0), (31, 5), (33, 1), (4096, 271), (8193, 135), (20000, 40),
                                         (3000, cuda_backend.PROGRAM_ORDER_MAX_TILES)])
def test_program_order_kernel_is_torchs_stable_descending_sort(n, max_tiles):
    """The order kernel's launch order is ``argsort(descending=True, stable=True)`` exactly: ties (few bins,
    many ids) keep id order across the warp's 32-id steps and the 8192-id chunks."""
    g = torch.Generator(device="cuda").manual_seed(n + max_tiles)
    ntiles = torch.randint(0, min(max_tiles, 60) + 1, (n,), generator=g, device="cuda", dtype=torch.int32)
    ntiles[: n // 3] = max_tiles  # the top bin, and the bin of 0 beside it
    got = cuda_backend.program_order(ntiles, max_tiles)
    assert got.dtype == torch.int32
    assert torch.equal(got, torch.argsort(ntiles, descending=True, stable=True).to(torch.int32))


@gpu
@on_hopper
@pytest.mark.parametrize("G,qp", [(4, 4), (8, 8), (8, 4), (8, 1)])
def test_plan_programs_of_one_program_a_group_read_no_list(G, qp):
    """One program a group: no tile list (the kernel reads the group's slots in order) and the group's tile
    counts; fewer queries a program: the plan's work list. The launch order is the plan's in both."""
    _, _, idx = _inputs(16, s_q=200)
    p = make_plan(idx, s_kv=4096, group_size=G, merge_level=min(G, qp) if qp > 1 else 1)
    tiles, ntiles, order = cuda_backend.plan_programs(p, qp)
    if qp >= G:
        assert tiles is None and ntiles is p.group_tiles
    else:
        assert tiles is p.work_list(qp)[0] and torch.equal(ntiles, p.work_list(qp)[1])
    assert torch.equal(order, torch.argsort(ntiles, descending=True, stable=True).to(torch.int32))
    assert p.program_order(qp) is order and cuda_backend.plan_programs(p, qp)[2] is order  # kept with the plan


@gpu
@on_hopper
@pytest.mark.parametrize("h", [3, 12, 40, 100])
def test_cuda_odd_head_counts(h, nan_poison):
    """Head counts that pad a program's rows (HB a power of two, rows < 64, two head blocks)."""
    q, kv, idx = _inputs(h)
    for method in ("quilt", "query_parallel"):
        got = sparse_prefill(q, kv, idx, method=method, backend="cuda")
        assert_matches_reference(got, sparse_prefill_reference(q, kv, idx), BF16, what=f"{method} h={h}")


@gpu
@on_hopper
@pytest.mark.parametrize("h,use_plan", [(16, True), (100, False)])
def test_cuda_persistent_ctas_hand_over_programs(h, use_plan):
    """A CTA runs program after program (q, barrier phases and the work counter carried over): any CTA
    count gives the reference result, bit-identical to one CTA a work item. Empty programs (no tiles: q's
    shared memory is released by the epilogue instead of the last QK) sit between full ones."""

    q, kv, idx = _inputs(h, s_q=200)  # s_q not a multiple of the group: a partial last group
    idx[7, :100] = -1  # a short list, and rows past the context
    idx[9, 5] = kv.shape[0] + 2
    idx[11] = -1  # an empty query (a query program without tiles)
    idx[16:24] = -1  # an empty group of 8 (plan programs without tiles)
    qp = program_shape(h, 8)[0]
    kw = dict(plan=make_plan(idx, s_kv=kv.shape[0], merge_level=qp, split_private=False)) if use_plan else \
        dict(indices=idx)
    n_work = cuda_backend.work_items(h, q.shape[0], kw.get("plan"))
    want = sparse_prefill_reference(q, kv, idx)
    runs = []
    for ctas in (n_work, 1, 3, None):
        out = torch.full((q.shape[0], h, 512), float("nan"), dtype=BF16, device="cuda")
        ml, lse = (torch.full((q.shape[0], h), float("nan"), device="cuda") for _ in range(2))
        cuda_backend.launch(q, kv, 576**-0.5, out, ml, lse, _ctas=ctas, **kw)  # raw launch: base-2 statistics
        assert_matches_reference(natural_stats((out, ml, lse)), want, BF16, what=f"ctas={ctas}")
        runs.append((out, ml, lse))
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


@gpu
@on_hopper
@pytest.mark.parametrize("h", [16, 64])
@pytest.mark.parametrize("order", ["rising", "falling"])
def test_cuda_logits_far_apart_across_tiles(h, order, nan_poison):
    """The softmax reference moves lazily (only past 2^8): logits that rise by far more than that from
    tile to tile make it move, and rescale O, on every tile; falling ones never after the first. Both
    must give the reference out, lse and the true max_logits."""
    s_q, s_kv, topk = 24, 2048, 512
    v = randn(576, seed=5, device="cuda", dtype=torch.float32)
    v = v / v.norm()
    q = (40 * v + 0.5 * randn(s_q, h, 576, seed=6, device="cuda", dtype=torch.float32)).to(BF16)
    ramp = torch.linspace(0, 60, s_kv, device="cuda")[:, None]  # ~ +1000 base-2 units over the context
    kv = (ramp * v + randn(s_kv, 576, seed=7, device="cuda", dtype=torch.float32)).to(BF16)
    idx = random_indices(s_q, s_kv, topk, seed=8, device="cuda").sort(dim=1, descending=order == "falling").values
    want = sparse_prefill_reference(q, kv, idx)
    for method in ("quilt", "query_parallel"):
        got = sparse_prefill(q, kv, idx, method=method, backend="cuda")
        assert_matches_reference(got, want, BF16, what=f"{method} h={h} {order}")


@gpu
@on_hopper
def test_cuda_fp16_and_split_plan(nan_poison):
    """fp16 inputs; a split-private plan runs its shared tiles in CUDA and its private rows in Triton."""
    q, kv, idx = _inputs(16, dtype=torch.float16)
    want = sparse_prefill_reference(q, kv, idx)
    got = sparse_prefill(q, kv, idx, backend="cuda")
    e = assert_matches_reference(got, want, torch.float16, what="fp16")
    assert e <= TOLERANCES[torch.float16].rel_l2
    p = make_plan(idx, s_kv=kv.shape[0], merge_level=4, split_private=True)
    got = sparse_prefill(q, kv, idx, plan=p, backend="cuda")
    assert_matches_reference(got, want, torch.float16, what="split plan")


@gpu
@on_hopper
def test_cuda_auto_picks_cuda_and_strided_q(nan_poison):
    q, kv, idx = _inputs(16)
    assert choose_backend("auto", q, kv, 512) == "cuda"
    assert choose_backend("auto", q, kv, 512, triton_knobs=True) == "triton"
    wide = torch.zeros(q.shape[0], 16, 640, dtype=BF16, device="cuda")
    wide[:, :, :576] = q
    got = sparse_prefill(wide[:, :, :576], kv, idx, backend="cuda")
    assert_matches_reference(got, sparse_prefill_reference(q, kv, idx), BF16, what="strided q")


def _fp8_case(h, method, s_q=192, s_kv=8192, topk=2048):
    """An FP8 cache call's inputs with scales that are not powers of two (as an engine's amax / 448), invalid
    entries, a short list, an empty query, topk_length and attn_sink; and its result on the expanded cache
    (the pool is below ``FP8_COMPACT_POOL``): ``q, cache, idx, kw, want``."""
    from quilt_attn import quantize_fp8

    q, kv, idx = _inputs(h, s_q=s_q, s_kv=s_kv, topk=topk)
    cache = quantize_fp8(kv)
    cache[:, 512:528].view(torch.float32).mul_(1.37)
    idx[5, :300] = -1
    idx[6, 7] = s_kv + 5
    idx[9] = -1
    lengths = torch.randint(0, topk + 50, (s_q,), device="cuda", dtype=torch.int32,
                            generator=torch.Generator(device="cuda").manual_seed(4))
    sink = torch.linspace(-2, 3, h, device="cuda")
    kw = dict(method=method, backend="cuda", topk_length=lengths, attn_sink=sink)
    return q, cache, idx, kw, sparse_prefill(q, cache, idx, **kw)


@gpu
@on_hopper
@pytest.mark.parametrize("h", [8, 16, 64, 128])
@pytest.mark.parametrize("method", ["quilt", "query_parallel"])
def test_cuda_fp8_cache_widened_in_kernel_equals_expanded(h, method, monkeypatch, nan_poison):
    """FP8 cache rows widened in the kernel give the expanded cache's result bit for bit (the same bf16
    values: e4m3 x scale rounds once either way, scales not powers of two), with invalid entries, a short list, an empty query,
    topk_length and attn_sink; and the call allocates no copy of the cache (1152 bytes a row)."""
    from quilt_attn import dequantize_fp8

    q, cache, idx, kw, want = _fp8_case(h, method)
    s_q, s_kv, lengths, sink = q.shape[0], cache.shape[0], kw["topk_length"], kw["attn_sink"]
    monkeypatch.setattr(cuda_backend, "FP8_IN_KERNEL", True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = sparse_prefill(q, cache, idx, **kw)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - s_q * h * (512 * 2 + 8)
    for a, b, name in zip(got, want, ("out", "max_logits", "lse")):
        assert torch.equal(a, b), f"{method} h={h}: {name} differs from the expanded cache's"
    # the kernel's kv is the cache dequantized to bf16 (scales that are not powers of two round there)
    dense = dequantize_fp8(cache)
    assert_matches_reference(got, sparse_prefill_reference(q, dense, idx, topk_length=lengths, attn_sink=sink),
                             BF16, what=f"fp8 in-kernel {method} h={h}")
    assert extra < s_kv * 1152 // 2, f"the call allocated {extra} bytes: an expanded copy?"


@gpu
@on_hopper
@pytest.mark.parametrize("cap", ["fits", "overflows"])
@pytest.mark.parametrize("h", [8, 16, 64, 128])
@pytest.mark.parametrize("method", ["quilt", "query_parallel"])
def test_cuda_fp8_pool_compacted_equals_expanded(h, method, cap, monkeypatch, nan_poison):
    """An FP8 pool above ``FP8_COMPACT_POOL`` rows: the call widens only its referenced rows into the compact
    buffer (or, when they are more than ``FP8_COMPACT_ROWS``, the launch chosen on the device widens them in
    the kernel) and gives the expanded pool's result bit for bit, with invalid entries, an empty query,
    topk_length and attn_sink. The plan the call makes is renumbered in place (no copy of its columns)."""
    from quilt_attn import dequantize_fp8
    from quilt_attn.ops import fp8_compact

    q, cache, idx, kw, want = _fp8_case(h, method)
    lengths, sink = kw["topk_length"], kw["attn_sink"]
    monkeypatch.setattr(cuda_backend, "FP8_COMPACT_POOL", 1024)
    monkeypatch.setattr(cuda_backend, "FP8_COMPACT_ROWS", cache.shape[0] if cap == "fits" else 256)
    in_place = []
    real = fp8_compact.compact_columns
    monkeypatch.setattr(fp8_compact, "compact_columns",
                        lambda *a, **k: in_place.append(k.get("in_place", False)) or real(*a, **k))
    got = sparse_prefill(q, cache, idx, **kw)
    assert in_place == [dispatch.decide("cuda", method, h).quilt], f"{method} h={h}: numbered {in_place}"
    for a, b, name in zip(got, want, ("out", "max_logits", "lse")):
        assert torch.equal(a, b), f"{method} h={h} {cap}: {name} differs from the expanded pool's"
    dense = dequantize_fp8(cache)
    assert_matches_reference(got, sparse_prefill_reference(q, dense, idx, topk_length=lengths, attn_sink=sink),
                             BF16, what=f"fp8 compacted {method} h={h} {cap}")


@gpu
@on_hopper
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_mark_rows_marks_every_referenced_row(packed):
    """``cuda_backend.mark_rows`` (each CTA's rows deduplicated in shared memory before it stores) marks exactly the
    referenced rows: neighbouring lists that share rows, a span of more distinct rows than its hash set holds (the
    entries it cannot place mark their rows themselves), invalid and padding words, a count of words that is not a
    multiple of a CTA's span, one word and none. The compaction through it equals the Triton pass's, in place as
    well, fitting or not; bad arguments raise ``ValueError``."""
    from quilt_attn.ops import fp8_compact

    s_kv = 3_000_000 if not packed else 1 << 20
    g = torch.Generator(device="cuda").manual_seed(2)
    shared = torch.randint(0, s_kv, (4096,), device="cuda", generator=g, dtype=torch.int32)
    lists = shared[torch.randint(0, 4096, (70, 2048), device="cuda", generator=g)]  # mostly the same rows
    wide = torch.randint(0, s_kv, (40000,), device="cuda", generator=g, dtype=torch.int32)  # mostly distinct
    words = torch.cat([lists.view(-1), wide])
    words[::97] = -1
    words[5::101] = s_kv + 3
    if packed:
        bits = torch.randint(1, 256, words.shape, device="cuda", generator=g, dtype=torch.int32)
        words = torch.where(words >= 0, words | (bits << 24), words)
    rows = (words & 0xFFFFFF) if packed else words
    valid = (rows >= 0) & (rows < s_kv) & (words != -1)
    for n in (words.numel(), 12345, 1, 0):
        w, ok = words[:n].contiguous(), valid[:n]
        want = torch.zeros(s_kv, dtype=torch.uint8, device="cuda")
        want[rows[:n][ok].long()] = 1
        got = torch.zeros(s_kv, dtype=torch.uint8, device="cuda")
        cuda_backend.mark_rows(w, s_kv, got, packed)
        assert torch.equal(got, want), f"{n} words: {int((got != want).sum())} marks differ"
    for cap in (60000, 1000):  # fits, overflows
        a = fp8_compact.compact_columns(words, s_kv, cap, packed=packed)
        b = fp8_compact.compact_columns(words, s_kv, cap, packed=packed, cuda_mark=True)
        spent = words.clone()
        c = fp8_compact.compact_columns(spent, s_kv, cap, packed=packed, in_place=True, cuda_mark=True)
        assert c.columns is spent and int(a.fits) == (cap == 60000)
        for d in (b, c):
            for x, y, name in zip((a.rows, a.count, a.fits, a.columns), (d.rows, d.count, d.fits, d.columns),
                                  ("rows", "count", "fits", "columns")):
                assert torch.equal(x, y), f"cap {cap}, in place {d is c}: {name} differs from the Triton pass's"
    marks = torch.zeros(s_kv, dtype=torch.uint8, device="cuda")
    for bad in (dict(words=words.long()), dict(words=words.cpu()), dict(s_kv=s_kv + 1), dict(mark=marks.int())):
        kw = dict(dict(words=words, s_kv=s_kv, mark=marks, packed=packed), **bad)
        with pytest.raises(ValueError, match="mark_rows"):
            cuda_backend.mark_rows(**kw)


@gpu
@on_hopper
@pytest.mark.parametrize("h", [8, 16, 32])
@pytest.mark.parametrize("cap", ["fits", "overflows"])
def test_cuda_fp8_caller_plan_keeps_its_row_numbering(h, cap, monkeypatch, nan_poison):
    """A caller's plan over an FP8 cache (any pool size): the numbering of the plan's rows is made on its first
    call and kept with the plan; later calls only widen, and a second cache of other values through the same
    plan gets its own result. Both equal the expanded cache's bit for bit (compacted or, overflowing, widened in
    the kernel)."""
    from quilt_attn import quantize_fp8
    from quilt_attn.ops import fp8_compact

    q, cache, idx, kw, _ = _fp8_case(h, "quilt")
    lengths = kw["topk_length"]
    monkeypatch.setattr(cuda_backend, "FP8_COMPACT_ROWS", cache.shape[0] if cap == "fits" else 256)
    p = make_plan(idx, s_kv=cache.shape[0], topk_length=lengths, **dispatch.plan_settings(h, "cuda"))
    made = []
    real = fp8_compact.compact_columns
    monkeypatch.setattr(fp8_compact, "compact_columns", lambda *a, **k: made.append(1) or real(*a, **k))
    other = quantize_fp8(torch.randn(cache.shape[0], 576, device="cuda", dtype=BF16,
                                     generator=torch.Generator(device="cuda").manual_seed(11)))
    for c in (cache, other, cache):
        got = sparse_prefill(q, c, idx, plan=p, **kw)
        want = sparse_prefill(q, c, idx, **kw, _triton={"fp8_expand": True})  # the whole cache expanded
        for a, b, name in zip(got, want, ("out", "max_logits", "lse")):
            assert torch.equal(a, b), f"h={h} {cap}: {name} differs from the expanded cache's"
    assert len(made) == 1, f"the plan's rows were numbered {len(made)} times"


@gpu
@on_hopper
def test_cuda_fp8_cache_widened_in_kernel_split_plan_and_pool(monkeypatch, nan_poison):
    """A split-private plan (shared tiles widened in the CUDA kernel, private rows dequantized on load by
    Triton) and slot ids into a pool of 2^22 FP8 rows (2.6 GB; its expansion would be 4.6 GB)."""
    from quilt_attn import quantize_fp8

    monkeypatch.setattr(cuda_backend, "FP8_IN_KERNEL", True)
    q, kv, idx = _inputs(16, s_q=128)
    cache = quantize_fp8(kv)
    p = make_plan(idx, s_kv=kv.shape[0], merge_level=4, split_private=True)
    got = sparse_prefill(q, cache, idx, plan=p, backend="cuda")
    assert_matches_reference(got, sparse_prefill_reference(q, cache, idx), BF16, what="fp8 split plan")
    pool = torch.zeros(1 << 22, 656, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(1 << 22, device="cuda")[:kv.shape[0]]
    pool[slots] = cache
    gidx = torch.where(idx >= 0, slots[idx.clamp_min(0).long()].to(torch.int32), idx)
    got = sparse_prefill(q, pool, gidx, backend="cuda")
    assert_matches_reference(got, sparse_prefill_reference(q, cache, idx), BF16, what="fp8 pool of 4M rows")


@gpu
@on_hopper
@pytest.mark.parametrize("h", [8, 16])
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_pool", "split"])
def test_cuda_nonfinite_row_reaches_only_its_queries(h, kind, monkeypatch, nan_poison):
    """NaN / inf in kv rows that one or two queries select: under QUILT every row of a program's tile is
    multiplied by all its queries' weights (0 for the partners, and 0 x inf is NaN). Without the repair pass
    the partners get NaN (checked on the raw launch); the call gives them the reference result, and the
    selecting queries their NaN. bf16, the FP8 cache (expanded, and compacted as in a large pool), and a
    split-private plan (rows two queries share stay in the CUDA tiles, the Triton pass writes the outputs)."""
    from quilt_attn import quantize_fp8

    q, kv, idx = _inputs(h)
    counts = torch.bincount(idx[idx >= 0].long(), minlength=kv.shape[0])
    rows = torch.cat([(counts == 1).nonzero().flatten()[:2], (counts == 2).nonzero().flatten()[:2]])
    owner = (idx[:, :, None] == rows).any(2).any(1)
    assert 0 < int(owner.sum()) <= 6
    if kind in ("fp8", "fp8_pool"):
        kv = quantize_fp8(kv)
        kv[rows[0::2], 7] = 0x7F  # an e4m3 NaN
        bad = kv[rows[1::2]]
        bad[:, 516:520].view(torch.float32)[:] = float("inf")  # the scale of values 128..255
        bad[:, 534:536].view(torch.bfloat16)[:] = float("inf")  # rope value 3
        kv[rows[1::2]] = bad
        if kind == "fp8_pool":
            monkeypatch.setattr(cuda_backend, "FP8_COMPACT_POOL", 1024)
    else:
        kv[rows[0::2], 7] = float("nan")
        kv[rows[1::2], 200] = float("inf")
        kv[rows[1::2], 520] = float("inf")
    kw = dict(backend="cuda")
    if kind == "split":
        kw["plan"] = make_plan(idx, s_kv=kv.shape[0], merge_level=program_shape(h, 8)[0], split_private=True)
    want = sparse_prefill_reference(q, kv, idx)
    got = sparse_prefill(q, kv, idx, **kw)
    keep = ~owner
    assert torch.isnan(got[0][owner]).any(), "the selecting queries keep their NaN"
    assert_matches_reference(tuple(t[keep] for t in got), tuple(t[keep] for t in want), BF16, what=kind)
    if kind == "bf16":  # the raw launch (no repair pass) shows what the repair is for
        p = make_plan(idx, s_kv=kv.shape[0], merge_level=program_shape(h, 8)[0], split_private=False)
        out = torch.empty(q.shape[0], h, 512, dtype=BF16, device="cuda")
        ml, lse = (torch.empty(q.shape[0], h, device="cuda") for _ in range(2))
        cuda_backend.launch(q, kv, 576**-0.5, out, ml, lse, plan=p)
        assert torch.isnan(out[keep]).any(), "no partner saw a NaN: the case does not reach a shared tile"


@gpu
@on_hopper
@pytest.mark.parametrize("h", [8, 16, 128])
@pytest.mark.parametrize("fp8", [False, True])
def test_repair_pass_runs_exactly_the_queued_queries(h, fp8):
    """The CUDA repair pass (``launch(queue=...)``) reads the queue's count on the device and writes the queued
    queries only, each over its own rows (the reference's values); every other row keeps what it held (NaN
    here), and an empty queue writes nothing."""
    from quilt_attn import quantize_fp8
    from quilt_attn.ops.sparse_attention import repair_buffer

    q, kv, idx = _inputs(h, s_q=96, topk=512)
    if fp8:
        kv = quantize_fp8(kv)
    lengths = torch.randint(0, 513, (96,), device="cuda", dtype=torch.int32,
                            generator=torch.Generator(device="cuda").manual_seed(h))
    sink = randn(h, seed=h, dtype=torch.float32, device="cuda")
    want = sparse_prefill_reference(q, kv, idx, topk_length=lengths, attn_sink=sink)
    chosen = [0, 95, 7, 41, 8]  # (any order: a pass queues them as they come)
    for queued in ([], chosen):
        queue = repair_buffer(96, torch.device("cuda"))
        queue[0] = len(queued)
        queue[1 + 96:1 + 96 + len(queued)] = torch.tensor(queued, dtype=torch.int32, device="cuda")
        out = torch.full((96, h, 512), float("nan"), dtype=BF16, device="cuda")
        ml, lse = (torch.full((96, h), float("nan"), device="cuda") for _ in range(2))
        cuda_backend.launch(q, kv, 576**-0.5, out, ml, lse, indices=idx, topk_length=lengths, attn_sink=sink,
                            queue=queue)
        rest = torch.ones(96, dtype=torch.bool, device="cuda")
        rest[queued] = False
        assert out[rest].isnan().all() and ml[rest].isnan().all() and lse[rest].isnan().all()
        if queued:
            got = natural_stats((out[queued], ml[queued], lse[queued]))
            assert_matches_reference(got, tuple(t[queued] for t in want), BF16, what=f"h={h} fp8={fp8}")


@gpu
@on_hopper
@pytest.mark.parametrize("h", [8, 16, 64])
def test_chained_launches_equal_unchained_bit_for_bit(h, monkeypatch, nan_poison):
    """A call's launches chained (programmatic dependent launches, work counters from the repair queue's spare
    words) give the outputs of the same call made with a memset before each launch and nothing chained, bit for
    bit; with a NaN in a kv row that one query selects, so that its tile partners are queued and the chained
    repair pass recomputes them (none of them NaN, the selecting query NaN)."""
    from quilt_bench.bench import rows_selected_once

    q, kv, idx = _inputs(h, s_q=512, s_kv=8192)
    bad = rows_selected_once(idx.cpu(), kv.shape[0], 1).cuda()
    kv[bad, 7] = float("nan")
    selecting = (idx == bad).any(1)
    got = {}
    for chained in (True, False):
        monkeypatch.setattr(cuda_backend, "CHAIN_LAUNCHES", chained)
        got[chained] = sparse_prefill(q, kv, idx, backend="cuda")
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    out = got[True][0]
    assert out[selecting].isnan().any() and not out[~selecting].isnan().any()


@gpu
@on_hopper
def test_cuda_library_cached_between_processes(tmp_path):
    """A second process loads the cached library without nvcc."""
    import subprocess
    import sys

    env = dict(os.environ, QUILT_CUDA_CACHE=str(tmp_path))
    code = ("import torch; from quilt_attn.ops import cuda_backend as c; p = c.build(); "
            "import os; os.environ['PATH'] = ''; os.environ.pop('CUDA_HOME', None); c.find_nvcc = lambda: None; "
            "print(c.unavailable_reason(torch.device('cuda')), c.build() == p)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("None True")


def test_views_the_kernel_cannot_copy_in_place_are_copied():
    """The kernel copies 16-byte pieces: a view that starts inside a row (or has odd strides) is copied
    first, an aligned one is passed as it is (a misaligned view once crashed the kernel)."""
    from quilt_attn.ops.cuda_backend import aligned_16, copies_16_bytes

    big = torch.randn(6, 584, dtype=torch.bfloat16)
    inside = big[:, 4:580]  # starts 8 bytes into a row
    assert not copies_16_bytes(inside)
    fixed = aligned_16(inside)
    assert copies_16_bytes(fixed) and torch.equal(fixed, inside)
    ok = big[:, 8:584]  # 16 bytes in, row stride 1168 bytes: readable in place
    assert copies_16_bytes(ok) and aligned_16(ok) is ok
    assert not copies_16_bytes(torch.randn(4, 3, 576, dtype=torch.bfloat16)[:, :, ::2].contiguous()[:, :, 1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("sm_scale", [-0.2, 0.0])
def test_cuda_scale_not_positive(nan_poison, sm_scale):
    """A negative or zero sm_scale (the kernel's running max assumes a positive one) matches the reference."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(40, 16, 576, generator=g).to(torch.bfloat16).cuda()
    kv = torch.randn(300, 576, generator=g).to(torch.bfloat16).cuda()
    idx = torch.randint(0, 300, (40, 128), generator=g, dtype=torch.int32).cuda()
    got = sparse_prefill(q, kv, idx, sm_scale, backend="cuda")
    assert_matches_reference(got, sparse_prefill_reference(q, kv, idx, sm_scale), torch.bfloat16,
                             what=f"sm_scale={sm_scale}")
    q[3, 2, 7] = float("nan")  # q.k x scale is NaN for every row of that query's head, whatever the scale
    got = sparse_prefill(q, kv, idx, sm_scale, backend="cuda")
    assert torch.isnan(got[0][3, 2]).all(), "a NaN in q reaches its head's output"
    keep = torch.ones(40, 16, dtype=torch.bool, device="cuda")
    keep[3, 2] = False
    want = sparse_prefill_reference(q, kv, idx, sm_scale)
    assert_matches_reference(tuple(t[keep] for t in got), tuple(t[keep] for t in want), torch.bfloat16,
                             what=f"sm_scale={sm_scale}, NaN in q")


def test_launch_refuses_a_scale_it_cannot_run():
    """The kernel launch itself takes positive scales only (the call maps the others); checked before any
    device work, so it holds without a GPU."""
    q = torch.zeros(1, 1, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1, 576, dtype=torch.bfloat16)
    out = torch.zeros(1, 1, 512, dtype=torch.bfloat16)
    stats = torch.zeros(1, 1)
    for bad in (0.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="sm_scale"):
            cuda_backend.launch(q, kv, bad, out, stats, stats.clone(), indices=torch.zeros(1, 1, dtype=torch.int32))
