"""Triton kernels for top-K sparse-attention prefill: query-parallel and QUILT.

One kernel body serves both methods. A program owns ``M = QP * HB`` matrix rows
(``QP`` queries x ``HB`` heads) and streams kv tiles of ``BT`` gathered rows:

* query-parallel (``FROM_PLAN=False``): ``QP = 1``; tiles are consecutive slices of the
  query's own Top-K list;
* QUILT (``FROM_PLAN=True``): ``QP`` neighbouring queries of a plan group; tiles come from
  the plan's work list and every tile column carries the member bits of the queries that own
  its row, so one gathered (and dequantized) tile serves all of its owners in one matrix product.

Each row keeps an online-softmax state (base 2) across all the tiles of its query, whatever
cascade level they come from. When the plan splits private rows off (``split_private``), a second,
query-parallel pass continues that state from the first (one float32 partial state a query) over
the rows that query owns alone, which a 64-row tile would compute mostly masked.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .shapes import default_group_size, program_shape, sm_count  # noqa: F401  (also imported from here)

LAST_COMPILED: dict = {}


@triton.jit
def column_row(w, s_kv, PACKED: tl.constexpr):
    """A plan column word's (or an index entry's) kv row and whether it names one. ``PACKED``: ``row | member
    bits << 24``, whose row field 0xFFFFFF (``planner.PACK_ROW_MASK``, the padding word -1's) is never a row;
    else the row itself, negative or ``>= s_kv`` naming none."""
    if PACKED:
        row = w & 0xFFFFFF
        ok = (row < s_kv) & (row != 0xFFFFFF)
    else:
        row = w
        ok = (w >= 0) & (w < s_kv)
    return row, ok


@triton.jit
def _gather(ptrs, row_ok):
    """``tl.load`` of gathered rows ``[BT, n]``; rows that are not ``row_ok`` (padding, invalid; None: all
    are valid) read as 0 without touching memory, so no unselected value (a NaN) enters a product."""
    if row_ok is None:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=row_ok[:, None], other=0)
    return x


@triton.jit
def _load_nope(kv_ptr, kv_f32_ptr, stride_kv, rows, c0, FP8: tl.constexpr, BT: tl.constexpr, NC: tl.constexpr,
               DTYPE: tl.constexpr, row_ok=None):
    """Latent columns ``c0 .. c0 + NC`` of ``BT`` gathered kv rows, ``[BT, NC]`` in DTYPE (FP8 dequantized);
    0 where not ``row_ok``."""
    cols = c0 + tl.arange(0, NC)
    rows = rows.to(tl.int64)  # row x 656 bytes (or x stride) passes 2^31 in pools of 3.3M+ rows
    if FP8:
        # 656-byte rows: 512 e4m3 | 4 float32 scales (one per 128 values) | 64 bf16 rope
        raw = _gather(kv_ptr + rows[:, None] * 656 + cols[None, :], row_ok)
        sc = _gather(kv_f32_ptr + rows[:, None] * 164 + 128 + c0 // 128 + tl.arange(0, NC // 128)[None, :], row_ok)
        # (dequantizing in DTYPE instead of float32 measured slower: 9.4 vs 8.6 ms, docs/learned.md)
        val = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        k = tl.reshape(tl.reshape(val, [BT, NC // 128, 128]) * sc[:, :, None], [BT, NC]).to(DTYPE)
    else:
        k = _gather(kv_ptr + rows[:, None] * stride_kv + cols[None, :], row_ok)
    return k


@triton.jit
def _load_rope(kv_ptr, kv_b16_ptr, stride_kv, rows, FP8: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
               DTYPE: tl.constexpr, row_ok=None):
    """Rope columns ``[BT, DR]`` of the gathered rows (0 where not ``row_ok``)."""
    offs_r = tl.arange(0, DR)
    rows = rows.to(tl.int64)  # (as in _load_nope)
    if FP8:
        kr = _gather(kv_b16_ptr + rows[:, None] * 328 + 264 + offs_r[None, :], row_ok).to(DTYPE)
    else:
        kr = _gather(kv_ptr + rows[:, None] * stride_kv + DV + offs_r[None, :], row_ok)
    return kr


@triton.jit
def _synthetic_kv(rows, c0, BT: tl.constexpr, NC: tl.constexpr, DTYPE: tl.constexpr):
    """A ``[BT, NC]`` stand-in for kv columns ``c0 .. c0 + NC`` of ``rows``, from registers (``SKIP_KV``).

    Values in [-0.5, 0.5) built from the row and column numbers: no kv memory is read, yet the tile
    depends on this iteration's indices, so the compiler can neither drop nor hoist the products.
    """
    v = (rows.to(tl.int32)[:, None] + c0 + tl.arange(0, NC)[None, :]) & 15
    return (v.to(tl.float32) * 0.0625 - 0.5).to(DTYPE)


@triton.jit
def _flag_for_repair(repair_ptr, s_q, qrow, bad):
    """Queue the queries of the rows ``bad`` for the repair pass, each once: ``repair_ptr`` int32
    ``[1 + 2 s_q]`` = count, a flag a query, the queued queries (``repair_buffer``)."""
    old = tl.atomic_xchg(repair_ptr + 1 + qrow, 1, mask=bad)
    first = bad & (old == 0)
    slot = tl.atomic_add(repair_ptr + qrow * 0, 1, mask=first)
    tl.store(repair_ptr + 1 + s_q + slot, qrow, mask=first)


@triton.jit
def _program(
    pid, hb, vs,  # the program, its head block, its slice of the value columns (DVS wide)
    q_ptr, kv_ptr, kv_f32_ptr, kv_b16_ptr, idx_ptr, len_ptr, tile_kv_ptr, tile_mask_ptr, prog_tiles_ptr,
    prog_ntiles_ptr, sink_ptr, out_ptr, maxl_ptr, lse_ptr, init_o_ptr, init_m_ptr, init_lse_ptr, repair_ptr,
    s_q, s_kv, h, topk, prog_cap, stride_qs, stride_qh, stride_kv, stride_idx, stride_os, stride_oh, sm_scale2,
    FROM_PLAN: tl.constexpr, HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, FP8: tl.constexpr,
    HAS_INIT: tl.constexpr, PARTIAL: tl.constexpr, PACKED: tl.constexpr, FLAG_NAN: tl.constexpr,
    G: tl.constexpr, QP: tl.constexpr, HB: tl.constexpr, BT: tl.constexpr,
    DV: tl.constexpr, DR: tl.constexpr, DVS: tl.constexpr, SKIP_KV: tl.constexpr,
):
    """One program of the kernel below: its rows' attention over its tiles, written out."""
    M: tl.constexpr = QP * HB
    NSUB: tl.constexpr = G // QP
    g = pid // NSUB
    sub = pid % NSUB
    q0 = g * G + sub * QP

    r = tl.arange(0, M)
    qi = r // HB
    head = hb * HB + (r % HB)
    row_ok = (q0 + qi < s_q) & (head < h)
    qrow = tl.where(row_ok, q0 + qi, 0)
    hrow = tl.where(row_ok, head, 0)
    member_bit = sub * QP + qi

    # With d_v split in two, a program accumulates its own half of the value columns but still
    # needs all of q.k: it loads its own half first ("a") and the other half ("b").
    c_own = vs * DVS
    c_oth = DVS - c_own
    offs_o = c_own + tl.arange(0, DVS)
    q_base = q_ptr + qrow[:, None].to(tl.int64) * stride_qs + hrow[:, None] * stride_qh  # (s_q x h x 576: past 2^31)
    q_a = tl.load(q_base + offs_o[None, :])
    if DVS < DV:
        q_b = tl.load(q_base + c_oth + tl.arange(0, DVS)[None, :])
    q_rope = tl.load(q_base + DV + tl.arange(0, DR)[None, :])
    DTYPE = q_a.dtype

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DVS], tl.float32)
    if HAS_INIT:  # continue the state a previous pass left (normalized out, max, lse; lse = +inf: empty)
        m0 = tl.load(init_m_ptr + qrow * h + hrow)
        lse0 = tl.load(init_lse_ptr + qrow * h + hrow)
        o0 = tl.load(init_o_ptr + qrow[:, None].to(tl.int64) * stride_os + hrow[:, None] * stride_oh + offs_o[None, :])
        seen = lse0 != float("inf")
        m_i = tl.where(seen, m0, float("-inf"))
        l_i = tl.where(seen, tl.exp2(lse0 - tl.where(seen, m0, 0.0)), 0.0)
        acc = tl.where(seen[:, None], o0 * l_i[:, None], 0.0)
    cols = tl.arange(0, BT)

    if FROM_PLAN:
        n_iter = tl.load(prog_ntiles_ptr + pid)
    else:
        if HAS_LEN:
            n_valid = tl.minimum(tl.load(len_ptr + q0), topk)
        else:
            n_valid = topk
        n_iter = tl.cdiv(n_valid, BT)

    for it in range(0, n_iter):
        if FROM_PLAN:
            t = tl.load(prog_tiles_ptr + pid * prog_cap + it).to(tl.int64)
            w = tl.load(tile_kv_ptr + t * BT + cols)
            kidx, col_ok = column_row(w, s_kv, PACKED)
            if PACKED:  # the member bits ride in the word
                cmask = (w >> 24) & 0xFF
            else:
                cmask = tl.load(tile_mask_ptr + t * BT + cols)
            own = (((cmask[None, :] >> member_bit[:, None]) & 1) != 0) & col_ok[None, :]
        else:
            pos = it * BT + cols
            kidx = tl.load(idx_ptr + q0.to(tl.int64) * stride_idx + pos, mask=pos < n_valid, other=-1)
            kidx, col_ok = column_row(kidx, s_kv, False)
            own = col_ok[None, :] & (qi[:, None] >= 0)
        rows = tl.where(col_ok, kidx, 0).to(tl.int64)
        if SKIP_KV:
            ka = _synthetic_kv(rows, c_own, BT, DVS, DTYPE)
            kr = _synthetic_kv(rows, DV, BT, DR, DTYPE)
        else:
            ka = _load_nope(kv_ptr, kv_f32_ptr, stride_kv, rows, c_own, FP8, BT, DVS, DTYPE, col_ok)
            kr = _load_rope(kv_ptr, kv_b16_ptr, stride_kv, rows, FP8, DV, DR, DTYPE, col_ok)
        s = tl.dot(q_a, tl.trans(ka))
        if DVS < DV:
            if SKIP_KV:
                kb = _synthetic_kv(rows, c_oth, BT, DVS, DTYPE)
            else:
                kb = _load_nope(kv_ptr, kv_f32_ptr, stride_kv, rows, c_oth, FP8, BT, DVS, DTYPE, col_ok)
            s = tl.dot(q_b, tl.trans(kb), s)
        s = tl.dot(q_rope, tl.trans(kr), s)
        s = tl.where(own, s * sm_scale2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(DTYPE), ka, acc)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
    o = acc / l_safe[:, None]
    if HAS_SINK and not PARTIAL:
        sink = tl.load(sink_ptr + hrow)
        # exp(lse_e) / (exp(lse_e) + exp(sink)), lse_e = lse * ln 2; an empty row stays 0
        fac = 1.0 / (1.0 + tl.exp(sink - lse * 0.6931471805599453))
        o = o * tl.where(empty, 0.0, fac)[:, None]
    o = tl.where(empty[:, None], 0.0, o)
    if FLAG_NAN:  # a NaN may be a shared tile's 0 x inf from a partner's row: the repair pass redoes the query
        _flag_for_repair(repair_ptr, s_q, qrow, (tl.max((o != o).to(tl.int32), 1) > 0) & row_ok)
    out_base = out_ptr + qrow[:, None].to(tl.int64) * stride_os + hrow[:, None] * stride_oh
    tl.store(out_base + offs_o[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if vs == 0:
        tl.store(maxl_ptr + qrow * h + hrow, m_i, mask=row_ok)
        tl.store(lse_ptr + qrow * h + hrow, lse, mask=row_ok)


@triton.jit
def _sparse_attention_kernel(
    q_ptr, kv_ptr, kv_f32_ptr, kv_b16_ptr,
    idx_ptr, len_ptr,  # query-parallel: indices [s_q, topk], optional topk_length [s_q]
    tile_kv_ptr, tile_mask_ptr, prog_tiles_ptr, prog_ntiles_ptr,  # QUILT plan
    sink_ptr, out_ptr, maxl_ptr, lse_ptr,
    init_o_ptr, init_m_ptr, init_lse_ptr,  # HAS_INIT: online-softmax state to continue from (fp32)
    repair_ptr,  # FLAG_NAN / REPAIR: the repair queue (repair_buffer)
    s_q, s_kv, h, topk, prog_cap,
    stride_qs, stride_qh, stride_kv, stride_idx, stride_os, stride_oh,
    sm_scale2,
    FROM_PLAN: tl.constexpr, HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, FP8: tl.constexpr,
    HAS_INIT: tl.constexpr, PARTIAL: tl.constexpr, PACKED: tl.constexpr,
    G: tl.constexpr, QP: tl.constexpr, HB: tl.constexpr, BT: tl.constexpr,
    DV: tl.constexpr, DR: tl.constexpr, DVS: tl.constexpr,
    FLAG_NAN: tl.constexpr = False,  # queue the queries whose output holds a NaN for the repair pass
    REPAIR: tl.constexpr = False,  # query programs over the queued queries only (persistent over the queue)
    SKIP_KV: tl.constexpr = False,  # timing study only: kv tiles from registers, no kv loads (wrong outputs)
):
    if REPAIR:  # persistent over the queue: program x takes entries x, x + programs, ...
        start, stop, step = tl.program_id(0), tl.load(repair_ptr), tl.num_programs(0)
    else:
        start, stop, step = 0, 1, 1  # (one trip of constant bounds: folded away)
    for i in range(start, stop, step):
        if REPAIR:
            pid = tl.load(repair_ptr + 1 + s_q + i)
        else:
            pid = tl.program_id(0)
        _program(pid, tl.program_id(1), tl.program_id(2),
                 q_ptr, kv_ptr, kv_f32_ptr, kv_b16_ptr, idx_ptr, len_ptr, tile_kv_ptr, tile_mask_ptr,
                 prog_tiles_ptr, prog_ntiles_ptr, sink_ptr, out_ptr, maxl_ptr, lse_ptr, init_o_ptr, init_m_ptr,
                 init_lse_ptr, repair_ptr, s_q, s_kv, h, topk, prog_cap, stride_qs, stride_qh, stride_kv,
                 stride_idx, stride_os, stride_oh, sm_scale2,
                 FROM_PLAN, HAS_LEN, HAS_SINK, FP8, HAS_INIT, PARTIAL, PACKED, FLAG_NAN and not REPAIR,
                 G, QP, HB, BT, DV, DR, DVS, SKIP_KV)


# ----------------------------------------------------------------------------- launchers

# (num_warps, num_stages) by matrix rows a program; measured on the H200 (docs/learned.md)
DEFAULT_CONFIG = {16: (4, 2), 32: (4, 2), 64: (8, 2)}


def default_config(rows: int) -> tuple[int, int]:
    return DEFAULT_CONFIG.get(rows, (8, 2))


def _launch(q, kv, sm_scale, d_v, out, max_logits, lse, *, indices=None, topk_length=None, plan=None,
            attn_sink=None, init=None, partial=False, dv_split=1, num_warps=None, num_stages=None,
            repair=None, repair_pass=False, _skip_kv=False):
    """One kernel pass over ``plan``'s tiles or, without a plan, over ``indices`` query by query.

    ``repair`` (``repair_buffer``): this pass queues the queries whose output holds a NaN; with
    ``repair_pass``, it is the pass over the queued queries instead (query programs over ``indices``).

    ``_skip_kv`` (private, timing studies): the kernel reads no kv rows and multiplies synthetic
    tiles instead, so its time is compute + softmax + index reads; the outputs are meaningless.
    """
    import torch

    from ..reference import LOG2E

    s_q, h, d_qk = q.shape
    fp8 = kv.dtype == torch.uint8
    G = plan.group_size if plan is not None else 1
    QP, HB = program_shape(h, G)
    w, st = default_config(QP * HB)
    num_warps, num_stages = num_warps or w, num_stages or st
    dummy = torch.empty(1, dtype=torch.int32, device=q.device)
    if plan is not None:
        prog_tiles, prog_ntiles = plan.work_list(QP)
        grid = (prog_tiles.shape[0], triton.cdiv(h, HB), dv_split)
        tile_kv, prog_cap, bt = plan.tile_kv, prog_tiles.shape[1], plan.tile
        tile_mask = plan.tile_kv if plan.packed else plan.tile_mask  # (packed: not read)
        idx, topk = dummy, plan.topk
    else:
        prog_tiles = prog_ntiles = tile_kv = tile_mask = dummy
        prog_cap, bt = 0, 64
        grid = (repair_programs(q.device, s_q) if repair_pass else s_q, triton.cdiv(h, HB), dv_split)
        idx, topk = indices, indices.shape[1]
    init_o, init_m, init_lse = init if init is not None else (out, max_logits, lse)
    compiled = _sparse_attention_kernel[grid](
        q, kv, kv.view(torch.float32) if fp8 else kv, kv.view(torch.bfloat16) if fp8 else kv,
        idx, topk_length if topk_length is not None else dummy,
        tile_kv, tile_mask, prog_tiles, prog_ntiles,
        attn_sink if attn_sink is not None else max_logits, out, max_logits, lse,
        init_o, init_m, init_lse, repair if repair is not None else dummy,
        s_q, kv.shape[0], h, topk, prog_cap,
        q.stride(0), q.stride(1), 0 if fp8 else kv.stride(0), idx.stride(0) if plan is None else 0,
        out.stride(0), out.stride(1),
        float(sm_scale) * LOG2E,
        FROM_PLAN=plan is not None, HAS_LEN=topk_length is not None and plan is None,
        HAS_SINK=attn_sink is not None, FP8=fp8, HAS_INIT=init is not None, PARTIAL=partial,
        PACKED=plan is not None and plan.packed,
        G=G, QP=QP, HB=HB, BT=bt, DV=d_v, DR=d_qk - d_v, DVS=d_v // dv_split,
        FLAG_NAN=repair is not None and not repair_pass and not partial, REPAIR=repair_pass, SKIP_KV=bool(_skip_kv),
        num_warps=num_warps, num_stages=num_stages,
    )
    LAST_COMPILED["kernel"] = compiled  # registers / spills, for benchmarks


def launch_sparse_attention(q, kv, sm_scale, d_v, *, indices=None, topk_length=None, plan=None,
                            attn_sink=None, dv_split=1, num_warps=None, num_stages=None, _skip_kv=False):
    """Allocate outputs and run the kernel pass(es); arguments are already checked.

    ``q [s_q, h, d_qk]``; ``kv`` dense ``[s_kv, d_qk]`` of q's dtype or FP8 ``uint8 [s_kv, 656]``.
    Without a plan: query-parallel over ``indices [s_q, topk]``. With a plan: its tiles; when the plan
    split private rows off, a second, query-parallel pass over ``plan.priv_idx`` continues each
    row's online-softmax state from the first (kept in float32) and writes the outputs; ``indices`` (and
    ``topk_length``), when given with the plan, are those it was built from, for the repair pass
    (``run_plan_passes``).
    ``_skip_kv`` (private): no kv loads, synthetic tiles (see ``_launch``); outputs meaningless.
    """
    out, max_logits, lse = alloc_outputs(q, d_v)
    if q.shape[0] == 0:
        return out, max_logits, lse
    kw = dict(dv_split=dv_split, num_warps=num_warps, num_stages=num_stages, _skip_kv=_skip_kv)
    if plan is None:
        _launch(q, kv, sm_scale, d_v, out, max_logits, lse, indices=indices, topk_length=topk_length,
                attn_sink=attn_sink, **kw)
    else:
        repair_from = None if indices is None or _skip_kv else (indices, topk_length)
        run_plan_passes(q, kv, sm_scale, d_v, out, max_logits, lse, plan=plan, attn_sink=attn_sink,
                        repair_from=repair_from, **kw)
    return out, max_logits, lse


def alloc_outputs(q, d_v: int, out_dtype=None):
    """Uninitialized ``out [s_q, h, d_v]`` (q's dtype, or ``out_dtype``), ``max_logits, lse [s_q, h]`` float32
    (the two halves of one buffer, so that ``dispatch.natural_log_stats`` converts both in one launch)."""
    import torch

    s_q, h, _ = q.shape
    stats = torch.empty(2, s_q, h, dtype=torch.float32, device=q.device)
    return torch.empty(s_q, h, d_v, dtype=out_dtype or q.dtype, device=q.device), stats[0], stats[1]


REPAIR_SPARE = 2  # zeroed int32 words after a repair queue: the work counters of a call's CUDA launches


def repair_buffer(s_q: int, device):
    """A call's repair queue, int32 ``[1 + 2 s_q + REPAIR_SPARE]``: the count of queued queries, a flag a query
    (both zeroed here), the queued queries, then ``REPAIR_SPARE`` zeroed words (``spare_word``). A plan pass
    queues each query whose output holds a NaN, once."""
    import torch

    # (one fill; the queue part need not be 0)
    return torch.zeros(1 + 2 * s_q + REPAIR_SPARE, dtype=torch.int32, device=device)


def spare_word(repair, i: int):
    """Spare word ``i`` (< ``REPAIR_SPARE``) of ``repair_buffer``'s buffer, an int32 ``[1]`` view, zero until a
    launch uses it (the CUDA backend: a launch's work counter, so that no memset of its own is needed)."""
    at = _spare_at(repair, i)
    return repair[at:at + 1]


def spare_address(repair, i: int) -> int:
    """The device address of ``spare_word(repair, i)`` (no view made: a launcher that passes addresses)."""
    return repair.data_ptr() + 4 * _spare_at(repair, i)


def _spare_at(repair, i: int) -> int:
    if not 0 <= i < REPAIR_SPARE:
        raise ValueError(f"spare word {i} of {REPAIR_SPARE}")
    return repair.numel() - REPAIR_SPARE + i


def repair_programs(device, s_q: int) -> int:
    """Programs of the repair pass (each loops over the queue): a few an SM, so that an empty queue costs one
    short launch and a full one still fills the GPU."""
    if device.type != "cuda":
        return min(s_q, 2)
    return min(s_q, 4 * sm_count(device))


def run_plan_passes(q, kv, sm_scale, d_v, out, max_logits, lse, *, plan, attn_sink=None, tile_pass=None,
                    repair_from=None, repair_pass=None, **kw):
    """Run ``plan`` into the given outputs (any row slices of the call's outputs).

    One pass over the plan's tiles; or, when the plan split private rows off, the tiles into a
    float32 partial state and then the query pass over ``plan.priv_idx`` that continues it and writes
    the outputs. ``tile_pass(out, max_logits, lse, partial, repair)`` runs the tiles and
    ``repair_pass(out, max_logits, lse, indices, topk_length, queue)`` the queued queries (default: this module's
    kernel; the CUDA backend passes its own); ``kw`` tunes this module's kernel.

    ``repair_from = (indices, topk_length)``, the plan's own: the repair pass. In a shared tile a row that one
    query selects is multiplied by its partners' zero weights too, and ``0 x inf`` or ``0 x NaN`` is NaN, so a
    non-finite kv value would reach queries that never selected it. The pass that writes the outputs queues
    every query whose output holds a NaN (on the device, no host sync), and query programs then recompute
    exactly those queries over their own rows: a NaN that a query's own rows give comes back, a partner's
    does not. With no NaN the repair pass is one launch that reads the empty queue.
    """
    import torch

    repair = repair_buffer(q.shape[0], q.device) if repair_from is not None else None
    if tile_pass is None:
        def tile_pass(o, m, l, partial, rep):
            _launch(q, kv, sm_scale, d_v, o, m, l, plan=plan, attn_sink=None if partial else attn_sink,
                    partial=partial, repair=rep, **kw)
    if not plan.split_private:
        tile_pass(out, max_logits, lse, False, repair)
    else:
        part = alloc_outputs(q, d_v, torch.float32)
        tile_pass(*part, True, None)
        _launch(q, kv, sm_scale, d_v, out, max_logits, lse, indices=plan.priv_idx, topk_length=plan.priv_n,
                attn_sink=attn_sink, init=part, repair=repair, **kw)
    if repair is not None:
        if repair_pass is None:
            def repair_pass(o, m, l, idx, lengths, queue):
                _launch(q, kv, sm_scale, d_v, o, m, l, indices=idx, topk_length=lengths, attn_sink=attn_sink,
                        repair=queue, repair_pass=True)
        repair_pass(out, max_logits, lse, *repair_from, repair)
