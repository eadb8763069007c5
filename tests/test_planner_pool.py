"""The planners on engine-style inputs: slot ids into a paged kv pool (``s_kv`` up to ``2**31 - 1``),
packed and wide tile columns, rows repeated in one list, NaN in unselected kv rows, the caller's workspace.

CPU: the torch planner directly, the Triton planner and kernels through the interpreter (marker
``interpret``, tiny fp16 shapes); GPU (marker ``gpu``): the same at full list size, and no host sync.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import HAS_CUDA, KERNEL_DEVICE, KERNELS_CAN_RUN, assert_matches_reference, gen, make_inputs, randn
from quilt_attn import PlanSettings, quantize_fp8, sparse_prefill, sparse_prefill_reference
from quilt_attn.kv_cache import dequantize_fp8
from quilt_attn.planner import PACK_ROW_MASK, PACK_SHIFT, member_masks, packs_columns, plan, plan_workspace_bytes
from test_planner import _plans_equal, add_invalid, check_structure, owned_pairs, workload

POOL = 2**31 - 2  # the largest pool of slot ids (rows 0 .. 2**31 - 3)
F16 = torch.float16
DV = 64  # CPU kernel shapes: d_qk 80 = 64 + 16
PLAN_FIELDS = ("tile_level", "tile_members", "group_tiles", "group_rows", "dropped", "priv_n", "valid_pairs")
CONFIGS = [  # G, M, T, tau, importance_clip, split_private, mask_method
    (1, 1, 4, 0.5, False, False, "bitmap"), (2, 1, 4, 0.5, True, False, "sort"), (4, 2, 8, 1.0, False, True, "bitmap"),
    (4, 4, 4, 0.5, False, False, "sort"), (8, 1, 2, 0.75, True, False, "bitmap"), (8, 4, 4, 0.5, True, True, "bitmap"),
    (16, 4, 4, 0.5, False, True, "bitmap"), (16, 1, 8, 0.25, False, False, "sort"),
]
triton_planner = pytest.mark.skipif(not KERNELS_CAN_RUN, reason="the Triton planner needs CUDA or TRITON_INTERPRET=1")


def scatter_rows(idx: torch.Tensor, s_kv: int, hi: int, seed: int) -> torch.Tensor:
    """``idx`` (rows of ``[0, s_kv)``) with every row mapped to a distinct random slot id in ``[0, hi)`` (0 and
    ``hi - 1`` among them); -1 stays, an invalid row ``>= s_kv`` becomes one ``>= hi``."""
    g = gen(seed)
    if hi <= 4 * s_kv:  # a small range: a permutation of it (random draws would collide too often)
        rest = torch.randperm(hi - 2, generator=g)[:s_kv - 2] + 1
    else:  # 2 s_kv draws from > 4 s_kv values: enough distinct ones
        cand = torch.randint(1, hi - 1, (2 * s_kv + 8,), generator=g, dtype=torch.int64).unique()
        rest = cand[torch.randperm(cand.numel(), generator=g)][:s_kv - 2]
    ids = torch.cat([torch.tensor([0, hi - 1]), rest])
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    assert ids.unique().numel() == s_kv
    x = idx.long()
    out = torch.where((x >= 0) & (x < s_kv), ids[x.clamp(0, s_kv - 1)], x)
    out = torch.where(x >= s_kv, (hi + x - s_kv).clamp_max(2**31 - 1), out)
    return out.to(torch.int32)


def _case(G, s_q=21, topk=12, s_kv=48, seed=0, invalid=0.1):
    idx, s_kv = workload("correlated", s_q, s_kv, topk, seed=seed)
    idx = add_invalid(idx, s_kv, invalid, seed=seed)
    tl = torch.randint(0, topk + 1, (s_q,), generator=gen(seed + 5), dtype=torch.int32)
    return idx, s_kv, tl


def _kw(G, M, T, tau, imp, split, mask_method, **extra):
    return dict(group_size=G, merge_level=M, tile=T, clip_threshold=tau, importance_clip=imp, split_private=split,
                mask_method=mask_method, **extra)


# ----------------------------------------------------------------------------- slot ids over a 2**31 - 2 pool
@pytest.mark.parametrize("G,M,T,tau,imp,split,mask_method", CONFIGS)
def test_scattered_slot_ids_plan_like_the_compact_rows(G, M, T, tau, imp, split, mask_method):
    """Rows renamed to slot ids anywhere in a 2**31 - 2 pool plan exactly as the compact rows do (the plan's
    rows renamed the same way): nothing in a plan depends on the row values but their identity."""
    idx, s_kv, tl = _case(G, seed=G + M)
    rename = scatter_rows(torch.arange(s_kv, dtype=torch.int32), s_kv, POOL, seed=G * 7 + M).long()
    for pool_s_kv in (POOL, None):
        if pool_s_kv is None:  # then only negatives are invalid: rows past the pool would be rows
            idx = torch.where(idx >= s_kv, -1, idx)
        ids = scatter_rows(idx, s_kv, POOL, seed=G * 7 + M)
        small = plan(idx, s_kv=s_kv, topk_length=tl, backend="torch", **_kw(G, M, T, tau, imp, split, mask_method))
        big = plan(ids, s_kv=pool_s_kv, topk_length=tl, backend="torch", **_kw(G, M, T, tau, imp, split, mask_method))
        if not split:  # (check_structure counts no private lists)
            check_structure(big)
        assert small.packed == (G <= 8) and not big.packed
        (r0, m0), (r1, m1) = small.columns(), big.columns()
        assert torch.equal(torch.where(r0 >= 0, rename[r0.clamp_min(0)], -1), r1.long()) and torch.equal(m0, m1)
        for f in PLAN_FIELDS:
            a, b = getattr(small, f), getattr(big, f)
            assert (a is None and b is None) or torch.equal(a, b), f
        if split:
            pi = small.priv_idx.long()
            assert torch.equal(torch.where(pi >= 0, rename[pi.clamp_min(0)], -1), big.priv_idx.long())


@triton_planner
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside Triton's interpreter
@pytest.mark.parametrize("G,M,T,tau,imp,split,mask_method", CONFIGS)
def test_triton_planner_matches_torch_on_pool_slot_ids(G, M, T, tau, imp, split, mask_method):
    """Triton (hash table) and torch (dense ids) planners agree on slot ids over the whole pool, with s_kv of the
    pool (wide columns), None (wide) and a packed-size bound (rows renamed into [0, 2**24 - 1))."""
    dev = KERNEL_DEVICE
    idx, s_kv, tl = _case(G, seed=G + 3 * M)
    bounds = [(POOL, POOL), (PACK_ROW_MASK, PACK_ROW_MASK)] + ([(POOL, None)] if G in (4, 16) else [])
    for hi, bound in bounds:
        ids = scatter_rows(idx, s_kv, hi, seed=G + M).to(dev)
        kw = _kw(G, M, T, tau, imp, split, mask_method, s_kv=bound, topk_length=tl.to(dev))
        want = plan(ids, backend="torch", **kw)
        _plans_equal(plan(ids, backend="triton", **kw), want)
        assert want.packed == packs_columns(bound, G)


def test_torch_planner_memory_and_time_do_not_depend_on_s_kv():
    """s_kv = 2**31 - 1 on the CPU: the plan takes well under a second of work and a few MB (a table of s_kv
    entries a group would ask for 128 GB). Measured in a fresh process (peak RSS over the planning call)."""
    code = textwrap.dedent("""
        import resource, time, torch
        from quilt_attn import plan
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, 2**31 - 2, (512, 256), generator=g, dtype=torch.int32)
        idx[1::2] = idx[0::2]  # pairs of queries share their lists, nothing else is shared
        plan(idx[:8], s_kv=2**31 - 1)  # first-call costs out of the measurement
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.perf_counter()
        for s_kv in (2**31 - 1, None):
            p = plan(idx, s_kv=s_kv, group_size=8, merge_level=2, split_private=True, backend="torch")
            assert p.stats["rows_processed"] == 256 * 256, p.stats
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base, time.perf_counter() - t)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr[-2000:]
    grew_kb, seconds = map(float, res.stdout.split())
    assert grew_kb < 256 * 1024, f"peak RSS grew by {grew_kb / 1024:.0f} MB"
    assert seconds < 30, f"{seconds:.1f} s"


def test_torch_planner_reads_nothing_back_on_the_host(monkeypatch):
    """No host sync on the torch planner's path (the CPU stand-in for a device sync: every tensor-to-Python
    conversion raises), whatever s_kv is."""
    idx = scatter_rows(*_case(4, s_q=19)[:2], POOL, seed=1)
    tl = torch.randint(0, 13, (19,), generator=gen(2), dtype=torch.int32)

    def host_sync(*a, **k):
        raise AssertionError("host sync in the planner")

    for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_sync)
    for s_kv in (None, POOL, 2**31 - 1):
        for mask_method in ("bitmap", "sort"):
            plan(idx, s_kv=s_kv, topk_length=tl, group_size=4, merge_level=2, split_private=True,
                 mask_method=mask_method, backend="torch")
            plan(idx, s_kv=s_kv, group_size=8, importance_clip=True, mask_method=mask_method, backend="torch")
    monkeypatch.undo()


# ----------------------------------------------------------------------------- packed and wide columns
def test_packing_rule():
    assert packs_columns(2**24 - 1, 8) and packs_columns(1, 1)
    assert not packs_columns(2**24, 8) and not packs_columns(None, 4) and not packs_columns(100, 16)
    assert PACK_SHIFT == 24 and PACK_ROW_MASK == 2**24 - 1


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=triton_planner)])
@pytest.mark.parametrize("G,M,split", [(4, 2, True), (8, 1, False), (2, 2, False)])
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_packed_and_wide_plans_have_the_same_columns(backend, G, M, split):
    """Packed (s_kv given) and wide (s_kv None) plans of indices whose only invalid entries are negative: the
    same decoded columns and fields; packed words are row | mask << 24, padding -1."""
    idx, s_kv = workload("correlated", 21, 40, 12, seed=G)
    idx = torch.where(torch.rand(idx.shape, generator=gen(G)) < 0.1, -1, idx).to(KERNEL_DEVICE)
    kw = dict(group_size=G, merge_level=M, tile=4, split_private=split, backend=backend)
    packed, wide = plan(idx, s_kv=s_kv, **kw), plan(idx, **kw)
    assert packed.packed and packed.tile_mask is None and not wide.packed and wide.tile_mask is not None
    for x, y in zip(packed.columns(), wide.columns()):
        assert torch.equal(x, y)
    rows, masks = wide.columns()
    assert torch.equal(packed.tile_kv, torch.where(rows >= 0, rows | (masks << PACK_SHIFT), -1))
    assert (masks >> 7).any() or G < 8  # group 8: some word has bit 31 set (a negative word that is not padding)
    for f in PLAN_FIELDS + ("priv_idx",):
        a, b = getattr(packed, f), getattr(wide, f)
        assert (a is None and b is None) or torch.equal(a, b), f
    assert packed.stats == wide.stats
    if not split:
        check_structure(packed)


@pytest.mark.interpret
@pytest.mark.parametrize("G,M,split", [(4, 2, True), (8, 8, False), (2, 1, False)])
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_packed_and_wide_plans_give_identical_attention(nan_poison, G, M, split):
    s_q, h, s_kv = 16, 2, 64
    q, kv, idx = make_inputs(s_q, h, s_kv=s_kv, topk=24, seed=G + M)
    idx[3, ::4] = -1
    kw = dict(group_size=G, merge_level=M, tile=16, split_private=split)
    p_packed, p_wide = plan(idx, s_kv=s_kv, **kw), plan(idx, **kw)
    assert p_packed.packed and not p_wide.packed
    run = dict(method="quilt", d_v=DV, settings=PlanSettings(fallback=False), backend="triton")
    got = sparse_prefill(q, kv, idx, plan=p_packed, **run)
    for a, b in zip(got, sparse_prefill(q, kv, idx, plan=p_wide, **run)):
        assert torch.equal(a, b)
    assert_matches_reference(got, sparse_prefill_reference(q, kv, idx, d_v=DV), F16, what="packed")


# ----------------------------------------------------------------------------- repeated rows
def test_repeated_rows_masks():
    """The first occurrence of a row in a query's list carries the row's full mask, a later one its own bit."""
    idx = torch.tensor([[5, 5, 7, 5], [5, 9, 5, -1]], dtype=torch.int32)
    for mask_method in ("sort", "bitmap"):
        masks, valid = member_masks(idx, 2, s_kv=10, mask_method=mask_method)
        assert masks.tolist() == [[3, 1, 1, 1], [3, 2, 2, 0]], mask_method


@pytest.mark.parametrize("mask_method", ["sort", "bitmap"])
@pytest.mark.parametrize("G", [1, 2, 4, 8, 16])
def test_repeated_rows_masks_brute_force(mask_method, G):
    s_q, topk = 23, 14
    idx = torch.randint(0, 9, (s_q, topk), generator=gen(G), dtype=torch.int32)  # many repeats
    idx = add_invalid(idx, 9, 0.1, seed=G)
    masks, _ = member_masks(idx, G, s_kv=9, mask_method=mask_method)
    rows = idx.tolist()
    for i in range(s_q):
        b0, seen = (i // G) * G, set()
        for j, r in enumerate(rows[i]):
            if not 0 <= r < 9:
                want = 0
            elif r in seen:
                want = 1 << (i % G)
            else:
                want = sum(1 << k for k in range(G) if b0 + k < s_q and r in rows[b0 + k])
            seen.add(r)
            assert int(masks[i, j]) == want, (i, j)


def _entry_counts(idx, s_kv, topk_length=None):
    """Sorted (query, row) pairs of every valid entry, with multiplicity."""
    out = []
    for i, row in enumerate(idx.tolist()):
        n = len(row) if topk_length is None else int(topk_length[i])
        out += [(i, r) for r in row[:n] if 0 <= r < s_kv]
    return sorted(out)


def _plan_pairs(p):
    """Sorted (query, row) pairs a plan computes: its tiles' and its private lists', with multiplicity."""
    pairs = [(q, r) for q, r in owned_pairs(p) if q < p.s_q]
    if p.priv_idx is not None:
        for i, (row, n) in enumerate(zip(p.priv_idx.tolist(), p.priv_n.tolist())):
            pairs += [(i, r) for r in row[:n]]
    return sorted(pairs)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=triton_planner)])
@pytest.mark.parametrize("G,M,T,tau,imp,split,mask_method", CONFIGS[1:6])
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_repeated_rows_are_computed_once_an_entry(backend, G, M, T, tau, imp, split, mask_method):
    """A row repeated in one list is computed as often as it is listed, for that query only; the partners'
    own entries are computed once each. Torch and Triton planners agree."""
    s_q, topk, s_kv = 19, 12, 14
    idx = torch.randint(0, s_kv, (s_q, topk), generator=gen(G + M), dtype=torch.int32)
    idx[::3, 1] = idx[::3, 0]  # back-to-back repeats besides the random ones
    tl = torch.randint(0, topk + 1, (s_q,), generator=gen(3), dtype=torch.int32)
    kw = _kw(G, M, T, tau, False, split, mask_method, s_kv=s_kv, topk_length=tl)
    p = plan(idx.to(KERNEL_DEVICE), backend=backend, **dict(kw, topk_length=tl.to(KERNEL_DEVICE)))
    if not split:
        check_structure(p)
    assert _plan_pairs(p) == _entry_counts(idx, s_kv, tl)
    assert int(p.valid_pairs) == len(_entry_counts(idx, s_kv, tl))
    if backend == "triton":
        _plans_equal(p, plan(idx, backend="torch", **kw))
        if imp and (M == 1 or split):
            kw["importance_clip"] = True
            _plans_equal(plan(idx.to(KERNEL_DEVICE), backend="triton", **dict(kw, topk_length=tl.to(KERNEL_DEVICE))),
                         plan(idx, backend="torch", **kw))


@pytest.mark.interpret
@pytest.mark.parametrize("G,M,split", [(4, 1, False), (4, 2, True), (8, 4, False), (2, 2, True)])
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_repeated_rows_attention_matches_reference(nan_poison, G, M, split):
    """QUILT with rows repeated in a list: every entry counts once for its query, as the reference counts it."""
    s_q, h, s_kv, topk = 16, 2, 24, 20
    q, kv, _ = make_inputs(s_q, h, s_kv=s_kv, topk=topk, seed=7 * G + M)
    idx = torch.randint(0, s_kv, (s_q, topk), generator=gen(G + M), dtype=torch.int32).to(q.device)
    idx[:, 5] = idx[:, 0]
    p = plan(idx, s_kv=s_kv, group_size=G, merge_level=M, tile=16, split_private=split)
    got = sparse_prefill(q, kv, idx, method="quilt", plan=p, d_v=DV, settings=PlanSettings(fallback=False),
                         backend="triton")
    assert_matches_reference(got, sparse_prefill_reference(q, kv, idx, d_v=DV), F16, what=f"G={G} M={M}")


# ----------------------------------------------------------------------------- NaN in unselected kv rows
@pytest.mark.interpret
@pytest.mark.parametrize("method", ["quilt", "query_parallel"])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_nan_in_unselected_kv_rows_does_not_reach_out(nan_poison, method, packed):
    """kv row 0 (what a padding slot or an invalid index used to read) and another unselected row hold NaN and
    inf: the result is finite and equals the reference with those rows zeroed."""
    s_q, h, s_kv, topk = 16, 2, 64, 21  # topk 21: tiles with padding slots
    q, kv, idx = make_inputs(s_q, h, s_kv=s_kv, topk=topk, seed=90)
    idx = torch.where((idx == 0) | (idx == 33), 17, idx)  # rows 0 and 33 selected by nobody
    idx[1, ::3] = -1
    idx[2, 4] = s_kv + 2
    idx[3, :] = idx[2, :]
    kv_z = kv.clone()
    kv_z[[0, 33]] = 0
    kv[0] = float("nan")
    kv[33, ::2] = float("inf")
    kw = dict(method=method, d_v=DV, backend="triton")
    if method == "quilt":
        kw.update(plan=plan(idx, s_kv=s_kv if packed else None, group_size=4, merge_level=2, tile=16,
                            split_private=True), settings=PlanSettings(fallback=False))
    elif not packed:
        pytest.skip("query-parallel reads no plan")
    got = sparse_prefill(q, kv, idx, **kw)
    assert_matches_reference(got, sparse_prefill_reference(q, kv_z, idx, d_v=DV), F16, what=method)


@pytest.mark.interpret
@pytest.mark.parametrize("method", ["quilt", "query_parallel"])
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_nan_in_unselected_fp8_rows_does_not_reach_out(nan_poison, method):
    """The FP8 cache dequantized on load: a NaN scale in row 0, selected by nobody, changes nothing."""
    s_q, h, s_kv, topk = 8, 2, 64, 21
    q = randn(s_q, h, 576, seed=91, dtype=F16, device=KERNEL_DEVICE)
    kv = randn(s_kv, 576, seed=92, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    kv[0] = 0
    idx = torch.argsort(torch.rand(s_q, s_kv - 1, generator=gen(93)), dim=1)[:, :topk].to(torch.int32) + 1
    idx = idx.to(KERNEL_DEVICE)
    idx[1, 2] = -1
    cache = quantize_fp8(kv)
    clean = dequantize_fp8(cache, torch.float32)
    cache[0, 512:528] = torch.tensor([float("nan")] * 4).view(torch.uint8).to(cache.device)  # the row's 4 scales
    kw = dict(method=method, d_v=512, backend="triton", _triton={"fp8_expand": False})
    if method == "quilt":
        kw.update(plan=plan(idx, s_kv=s_kv, group_size=4, tile=16), settings=PlanSettings(fallback=False))
    got = sparse_prefill(q, cache, idx, **kw)
    assert_matches_reference(got, sparse_prefill_reference(q, clean, idx, d_v=512), F16, what=method)


# ----------------------------------------------------------------------------- caller-owned workspace
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=triton_planner)])
@pytest.mark.parametrize("s_kv,split", [(48, True), (None, False), (POOL, True)])
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_plan_in_a_callers_workspace(backend, s_kv, split):
    """The plan's tensors are views into the workspace (nothing left over outside it) and equal to an
    allocated plan's; the workspace is reusable."""
    idx, small, tl = _case(4, seed=11)
    idx = (idx if s_kv != POOL else scatter_rows(idx, small, POOL, seed=2)).to(KERNEL_DEVICE)
    kw = dict(s_kv=small if s_kv == 48 else s_kv, group_size=4, merge_level=2, tile=4, split_private=split,
              backend=backend)
    need = plan_workspace_bytes(idx.shape[0], idx.shape[1], group_size=4, merge_level=2, tile=4,
                                split_private=split, s_kv=kw["s_kv"])
    ws = torch.full((need + 64,), 0xA5, dtype=torch.uint8, device=KERNEL_DEVICE)  # poisoned, larger than needed
    lo, hi = ws.data_ptr(), ws.data_ptr() + need
    for _ in range(2 if backend == "torch" else 1):  # a second plan reuses the same bytes
        p = plan(idx, workspace=ws, **kw)
        for t in p.tensors():
            if t is not p.valid_pairs:
                assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi
        _plans_equal(p, plan(idx, **kw))
    assert p.packed == (s_kv == 48)
    wide = plan_workspace_bytes(21, 12, group_size=4, merge_level=2, tile=4, s_kv=None)
    assert plan_workspace_bytes(21, 12, group_size=4, merge_level=2, tile=4, s_kv=48) < wide


def test_workspace_errors_name_the_workspace():
    idx, s_kv, _ = _case(4, seed=12)
    kw = dict(s_kv=s_kv, group_size=4, tile=4)
    need = plan_workspace_bytes(21, 12, **kw)
    with pytest.raises(ValueError, match="workspace holds .* bytes, the plan needs"):
        plan(idx, workspace=torch.empty(need - 1, dtype=torch.uint8), **kw)
    with pytest.raises(ValueError, match="workspace must be a uint8"):
        plan(idx, workspace=torch.empty(need, dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match="workspace is on meta"):
        plan(idx, workspace=torch.empty(need, dtype=torch.uint8, device="meta"), **kw)
    with pytest.raises(ValueError, match="workspace must be contiguous and start at a 16-byte aligned"):
        plan(idx, workspace=torch.empty(need + 16, dtype=torch.uint8)[1:], **kw)
    with pytest.raises(TypeError, match="workspace"):
        plan(idx, workspace=bytearray(need), **kw)
    with pytest.raises(ValueError, match="s_kv"):
        plan(idx, s_kv=2**31)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("G,M,split", [(8, 4, True), (8, 1, False), (4, 4, False), (16, 2, True)])
@pytest.mark.parametrize("bound", [POOL, None, PACK_ROW_MASK])
def test_gpu_triton_planner_pool_full_lists(G, M, split, bound):
    """Full lists (topk 2048) of slot ids spread over the pool, a few repeats: Triton equals torch, no host sync
    on either planner's path."""
    from quilt_attn.workloads import generate

    idx = generate("glm53-like", 300, 65536, 2048, seed=4).cpu()
    hi = POOL if bound != PACK_ROW_MASK else PACK_ROW_MASK
    idx = scatter_rows(idx, 65536, hi, seed=5)
    idx[::7, 100] = idx[::7, 3]
    idx = idx.cuda()
    kw = dict(s_kv=bound, group_size=G, merge_level=M, split_private=split)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        a, b = plan(idx, backend="triton", **kw), plan(idx, backend="torch", **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _plans_equal(a, b)


def _group_columns(p) -> torch.Tensor:
    """Each group's (row, member bits) columns as a sorted multiset, int64 ``[n_groups, cap * tile]``."""
    rows, masks = p.columns()
    key = rows.view(rows.shape[0], -1).long() * 256 + masks.view(masks.shape[0], -1).long()
    return torch.sort(key, dim=1).values


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("G,M,imp,split", [(8, 8, False, False), (4, 4, False, False), (2, 2, False, False),
                                           (8, 4, False, False), (8, 2, True, True), (4, 1, True, False),
                                           (1, 1, False, False)])
@pytest.mark.parametrize("bound", [65536, PACK_ROW_MASK, POOL + 1, None])
def test_gpu_cuda_planner_pool_full_lists(G, M, imp, split, bound):
    """The CUDA planner's hash table over full lists (topk 2048) of slot ids spread over pools of any size:
    identical to the torch planner, packed (s_kv < 2^24) and wide, with no host sync."""
    from quilt_attn.workloads import generate

    idx = generate("glm53-like", 300, 65536, 2048, seed=6).cpu()
    hi = 65536 if bound == 65536 else PACK_ROW_MASK if bound == PACK_ROW_MASK else POOL
    idx = scatter_rows(idx, 65536, hi, seed=7).cuda()
    kw = dict(s_kv=bound, group_size=G, merge_level=M, importance_clip=imp, split_private=split)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        a = plan(idx, backend="cuda", **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    b = plan(idx, backend="torch", **kw)
    assert a.packed == (bound is not None and bound <= PACK_ROW_MASK)
    _plans_equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("G,M", [(8, 8), (4, 4), (8, 2)])
def test_gpu_cuda_planner_repeated_rows(G, M):
    """Rows repeated in a list: the CUDA planner may tile either occurrence as the first (its table inserts
    race), so each group's columns equal the torch planner's as a multiset, and every entry is run once."""
    from quilt_attn.workloads import generate

    idx = generate("glm53-like", 256, 65536, 2048, seed=8)
    idx[::5, 7] = idx[::5, 2]
    idx[::9, 1500] = idx[::9, 40]
    kw = dict(s_kv=65536, group_size=G, merge_level=M, clip_threshold=0.0)  # no clipping: rank order irrelevant
    a, b = plan(idx.cuda(), backend="cuda", **kw), plan(idx, backend="torch", **kw)
    assert torch.equal(_group_columns(a).cpu(), _group_columns(b).cpu())
    assert torch.equal(a.group_tiles.cpu(), b.group_tiles) and torch.equal(a.group_rows.cpu(), b.group_rows)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("h", [8, 16, 32])
@pytest.mark.parametrize("pool", [1 << 22, POOL + 1])
def test_gpu_cuda_attention_on_pool_slot_ids(nan_poison, h, pool):
    """The whole CUDA call on slot ids into a pool (packed and wide plans), rows repeated and invalid ones
    mixed in, NaN in unselected rows: matches the reference."""
    from quilt_attn.workloads import generate

    s_q, topk, rows = 256, 2048, 8192
    idx = scatter_rows(generate("glm53-like", s_q, rows, topk, seed=9).cpu(), rows, min(pool, 1 << 22), seed=10)
    idx[::6, 3] = idx[::6, 0]
    idx[::10, 50] = -1
    kv = torch.zeros(min(pool, 1 << 22), 576, dtype=torch.bfloat16, device="cuda")
    used = idx[idx >= 0].unique().long().cuda()
    kv[used] = randn(used.numel(), 576, seed=11, dtype=torch.bfloat16, device="cuda")
    unused = torch.ones(kv.shape[0], dtype=torch.bool, device="cuda")
    unused[used] = False
    kv[unused.nonzero()[0]] = float("nan")  # a row no index selects (the pool's garbage) must not reach out
    q = randn(s_q, h, 576, seed=12, dtype=torch.bfloat16, device="cuda")
    idx = idx.cuda()
    s_kv = kv.shape[0] if pool <= PACK_ROW_MASK else None  # None: a plan without s_kv is a wide plan
    p = plan(idx, s_kv=s_kv, group_size=min(8, 64 // h), merge_level=min(8, 64 // h))
    assert p.packed == (s_kv is not None)
    for kw in (dict(), dict(plan=p)):
        got = sparse_prefill(q, kv, idx, backend="cuda", **kw)
        assert_matches_reference(got, sparse_prefill_reference(q, kv, idx), torch.bfloat16, what=f"h={h} {kw.keys()}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_kind", ["bf16", "fp8"])
def test_gpu_rows_past_2_31_bytes_of_a_pool(nan_poison, kv_kind):
    """Pools of 2^22 rows put rows past 2^31 bytes (a bf16 row is 1152, an FP8 row 656 bytes): the Triton
    kernels, the FP8 expansion and the compaction address them in 64 bits (row x 656 in int32 wrapped and gave
    NaN). Rows at the top of the pool, every path against the reference."""
    from quilt_attn.ops.fp8_expand import expand_fp8
    from quilt_attn.workloads import generate

    pool, s_q, topk, h = 1 << 22, 64, 512, 16
    idx = (generate("glm53-like", s_q, 4096, topk, seed=3).cuda() + (pool - 4096)).to(torch.int32)  # top rows
    kv = torch.zeros(pool, 576, dtype=torch.bfloat16, device="cuda")
    kv[pool - 4096:] = randn(4096, 576, seed=4, dtype=torch.bfloat16, device="cuda")
    q = randn(s_q, h, 576, seed=5, dtype=torch.bfloat16, device="cuda")
    if kv_kind == "fp8":
        kv = quantize_fp8(kv)
        top = torch.arange(pool - 8, pool, dtype=torch.int32, device="cuda")
        assert torch.equal(expand_fp8(kv)[pool - 8:].view(torch.int16), dequantize_fp8(kv[pool - 8:]).view(torch.int16))
        assert torch.equal(expand_fp8(kv, rows=top).view(torch.int16), dequantize_fp8(kv[pool - 8:]).view(torch.int16))
    want = sparse_prefill_reference(q, kv, idx)
    runs = {"triton": dict(backend="triton"), "triton query-parallel": dict(backend="triton", method="query_parallel")}
    if kv_kind == "fp8":
        runs["triton, rows dequantized on load"] = dict(backend="triton", _triton={"fp8_expand": False})
        runs["cuda (compacted)"] = dict(backend="cuda")
        runs["cuda (expanded)"] = dict(backend="cuda", _triton={"fp8_expand": True})
    else:
        runs["cuda"] = dict(backend="cuda")
    for name, kw in runs.items():
        assert_matches_reference(sparse_prefill(q, kv, idx, **kw), want, torch.bfloat16, what=name)
