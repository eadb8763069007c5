"""Fused Triton planner: one program a query group, no sort, no host sync.

A program walks its group's ``G`` lists a few times (each list is one ``[KP]`` vector):
membership bits go into a per-program table indexed by kv row (atomic ``table[row] |= 1 << k``),
every entry reads its row's member mask back, levels follow from the mask, tile-aware clipping
marks pushed rows with one flag bit a block in the same table, and the tile lists are written
with prefix sums. The table is cleared on the way out, so the workspace stays zero between calls.
Same results as the torch planner in ``plan.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .membership import member_masks, pad_to_groups
from .plan import plan_buffers

_WORKSPACE: dict = {}
PLAN_WARPS = 16  # measured on the H200: see benchmarks/NOTES.md
PLAN_PROGS_PER_SM = 4


@triton.jit
def _load_list(idx_ptr, len_ptr, q, s_q, s_kv, topk, offs, HAS_LEN: tl.constexpr):
    """Row ``q`` of the indices and its validity (in range, inside topk_length, q < s_q)."""
    lim = topk
    if HAS_LEN:
        lim = tl.minimum(tl.load(len_ptr + tl.minimum(q, s_q - 1)), topk)
    inb = (offs < lim) & (q < s_q)
    idx = tl.load(idx_ptr + q * topk + offs, mask=inb, other=-1)
    ok = inb & (idx >= 0) & (idx < s_kv)
    return tl.where(ok, idx, 0), ok


@triton.jit
def _push_level(idx_ptr, len_ptr, lvl_ptr, tbl, q0, s_q, s_kv, topk, thr, offs,
                G: tl.constexpr, L: tl.constexpr, T: tl.constexpr, HAS_LEN: tl.constexpr):
    """Tile-aware clipping of the level-L blocks of one group (flags in the table, bits 16..30)."""
    for b in tl.static_range(G // L):
        FLAG = 1 << (16 + (G // L - 1) + b)
        rep = q0 + b * L
        idx, ok = _load_list(idx_ptr, len_ptr, rep, s_q, s_kv, topk, offs, HAS_LEN)
        lv = tl.load(lvl_ptr + rep * topk + offs, mask=offs < topk, other=0).to(tl.int32)
        sel = lv == L
        n = tl.sum(sel.to(tl.int32))
        r = n % T
        if (r > 0) & (r.to(tl.float32) < thr):
            pos = tl.cumsum(sel.to(tl.int32), 0) - 1
            pushed = sel & (pos >= n - r)
            tl.atomic_or(tbl + idx, tl.where(pushed, FLAG, 0), mask=pushed, sem="relaxed", scope="cta")
            tl.debug_barrier()
            for j in tl.static_range(L):
                q = rep + j
                idx, ok = _load_list(idx_ptr, len_ptr, q, s_q, s_kv, topk, offs, HAS_LEN)
                lv = tl.load(lvl_ptr + q * topk + offs, mask=offs < topk, other=0).to(tl.int32)
                at = lv == L
                f = tl.load(tbl + idx, mask=at, other=0)
                lv = tl.where(at & ((f & FLAG) != 0), L // 2, lv)
                tl.store(lvl_ptr + q * topk + offs, lv.to(tl.int8), mask=offs < topk)
            tl.debug_barrier()


@triton.jit
def _write_level(idx_ptr, len_ptr, lvl_ptr, tile_kv_ptr, tile_mask_ptr, tile_level_ptr, tile_members_ptr,
                 q0, s_q, s_kv, topk, tbase, off, nrows, offs, tcol, tnum,
                 G: tl.constexpr, L: tl.constexpr, T: tl.constexpr, KP: tl.constexpr, NTP: tl.constexpr,
                 HAS_LEN: tl.constexpr):
    """Write the tiles of the level-L segments of one group; returns the next free slot and row count."""
    for b in tl.static_range(G // L):
        BITS = ((1 << L) - 1) << (b * L)
        rep = q0 + b * L
        idx, ok = _load_list(idx_ptr, len_ptr, rep, s_q, s_kv, topk, offs, HAS_LEN)
        lv = tl.load(lvl_ptr + rep * topk + offs, mask=offs < topk, other=0).to(tl.int32)
        sel = lv == L
        n = tl.sum(sel.to(tl.int32))
        pos = tl.cumsum(sel.to(tl.int32), 0) - 1
        dst = (tbase + off + pos // T) * T + pos % T
        tl.store(tile_kv_ptr + dst, idx, mask=sel)
        tl.store(tile_mask_ptr + dst, tl.zeros([KP], tl.int32) + BITS, mask=sel)
        off, nrows = _close_segment(tile_kv_ptr, tile_mask_ptr, tile_level_ptr, tile_members_ptr, tbase, off, nrows,
                                    n, tcol, tnum, L, BITS, T, NTP)
    return off, nrows


@triton.jit
def _close_segment(tile_kv_ptr, tile_mask_ptr, tile_level_ptr, tile_members_ptr, tbase, off, nrows, n, tcol, tnum,
                   LEVEL, BITS, T: tl.constexpr, NTP: tl.constexpr):
    """Pad a segment's last tile (kv -1, mask 0) and record its tiles' level and block."""
    nt = (n + T - 1) // T
    pp = n + tcol
    pm = pp < nt * T
    tl.store(tile_kv_ptr + (tbase + off + pp // T) * T + pp % T, tl.full([T], -1, tl.int32), mask=pm)
    tl.store(tile_mask_ptr + (tbase + off + pp // T) * T + pp % T, tl.zeros([T], tl.int32), mask=pm)
    tl.store(tile_level_ptr + tbase + off + tnum, tl.zeros([NTP], tl.int32) + LEVEL, mask=tnum < nt)
    tl.store(tile_members_ptr + tbase + off + tnum, tl.zeros([NTP], tl.int32) + BITS, mask=tnum < nt)
    return off + nt, nrows + n


@triton.jit
def _plan_kernel(
    idx_ptr, len_ptr, masks_ptr, lvl_ptr, table_ptr,
    tile_kv_ptr, tile_mask_ptr, tile_level_ptr, tile_members_ptr,
    group_tiles_ptr, group_rows_ptr, dropped_ptr, valid_ptr, priv_idx_ptr, priv_n_ptr,
    s_q, s_kv, topk, n_groups, cap, thr,
    G: tl.constexpr, M: tl.constexpr, T: tl.constexpr, KP: tl.constexpr, NTP: tl.constexpr,
    HAS_LEN: tl.constexpr, MASKS_GIVEN: tl.constexpr, ICLIP: tl.constexpr, SPLIT: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, KP)
    tcol = tl.arange(0, T)
    tnum = tl.arange(0, NTP)
    tbl = table_ptr + pid.to(tl.int64) * s_kv
    for g in range(pid, n_groups, nprog):
        q0 = g * G
        # 1. member masks: every member ORs its bit into the row's table slot
        if not MASKS_GIVEN:
            for k in tl.static_range(G):  # ORs commute: all members' updates may be in flight at once
                idx, ok = _load_list(idx_ptr, len_ptr, q0 + k, s_q, s_kv, topk, offs, HAS_LEN)
                tl.atomic_or(tbl + idx, tl.zeros([KP], tl.int32) + (1 << k), mask=ok, sem="relaxed", scope="cta")
            tl.debug_barrier()
        # 2. read masks back; cascade level = largest aligned all-selecting block holding the query
        nvalid = 0
        for k in tl.static_range(G):
            q = q0 + k
            idx, ok = _load_list(idx_ptr, len_ptr, q, s_q, s_kv, topk, offs, HAS_LEN)
            if MASKS_GIVEN:
                m = tl.load(masks_ptr + q * topk + offs, mask=ok, other=0).to(tl.int32) & 0xFFFF
            else:
                m = tl.load(tbl + idx, mask=ok, other=0) & 0xFFFF
                tl.store(masks_ptr + q * topk + offs, m.to(tl.int16), mask=offs < topk)
            lv = tl.zeros([KP], tl.int32)
            for e in tl.static_range(G.bit_length()):  # level G >> e
                full = ((m >> ((k // (G >> e)) * (G >> e))) & ((1 << (G >> e)) - 1)) == ((1 << (G >> e)) - 1)
                lv = tl.where((lv == 0) & ok & full, G >> e, lv)
            tl.store(lvl_ptr + q * topk + offs, lv.to(tl.int8), mask=offs < topk)
            nvalid += tl.sum(ok.to(tl.int32))
        tl.store(valid_ptr + g, nvalid)
        tl.debug_barrier()
        # 3. tile-aware clipping, top level first: the representative's lowest-ranked tail moves down
        for e in tl.static_range(G.bit_length()):
            if (G >> e) >= 2 and (G >> e) >= M:
                _push_level(idx_ptr, len_ptr, lvl_ptr, tbl, q0, s_q, s_kv, topk, thr, offs, G, G >> e, T, HAS_LEN)
        # 4. private rows: importance-aware clipping (rows are in importance order), and with
        #    SPLIT the per-query private lists (those rows then leave the tiles: level -1)
        if ICLIP or SPLIT:
            for k in tl.static_range(G):
                q = q0 + k
                lv = tl.load(lvl_ptr + q * topk + offs, mask=offs < topk, other=0).to(tl.int32)
                if M == 1:
                    priv = lv == 1
                else:
                    m = tl.load(masks_ptr + q * topk + offs, mask=offs < topk, other=0).to(tl.int32) & 0xFFFF
                    mb = (m >> ((k // M) * M)) & ((1 << M) - 1)
                    priv = (lv > 0) & (lv < M) & ((mb & (mb - 1)) == 0)
                n = tl.sum(priv.to(tl.int32))
                pos = tl.cumsum(priv.to(tl.int32), 0) - 1
                keep = priv
                if ICLIP:
                    r = n % T
                    clip = (r > 0) & (r.to(tl.float32) < thr)
                    drop = priv & clip & (pos >= n - r)
                    lv = tl.where(drop, 0, lv)
                    keep = priv & (pos < n - tl.where(clip, r, 0))
                    tl.store(dropped_ptr + q, tl.where(clip, r, 0), mask=q < s_q)
                if SPLIT:
                    idx, ok = _load_list(idx_ptr, len_ptr, q, s_q, s_kv, topk, offs, HAS_LEN)
                    tl.store(priv_idx_ptr + q * topk + pos, idx, mask=keep & (q < s_q))
                    tl.store(priv_n_ptr + q, tl.sum(keep.to(tl.int32)), mask=q < s_q)
                    lv = tl.where(keep, -1, lv)
                tl.store(lvl_ptr + q * topk + offs, lv.to(tl.int8), mask=offs < topk)
        tl.debug_barrier()
        # 5. segments, in order: blocks of level G .. M, then the merged block segments
        off = 0
        nrows = 0
        tbase = g * cap
        for e in tl.static_range(G.bit_length()):
            if (G >> e) >= M:
                off, nrows = _write_level(idx_ptr, len_ptr, lvl_ptr, tile_kv_ptr, tile_mask_ptr, tile_level_ptr,
                                          tile_members_ptr, q0, s_q, s_kv, topk, tbase, off, nrows, offs, tcol, tnum,
                                          G, G >> e, T, KP, NTP, HAS_LEN)
        if M > 1:
            for b in tl.static_range(G // M):
                BBITS = ((1 << M) - 1) << (b * M)
                start = 0
                for j in tl.static_range(M):
                    q = q0 + b * M + j
                    idx, ok = _load_list(idx_ptr, len_ptr, q, s_q, s_kv, topk, offs, HAS_LEN)
                    lv = tl.load(lvl_ptr + q * topk + offs, mask=offs < topk, other=0).to(tl.int32)
                    m = tl.load(masks_ptr + q * topk + offs, mask=offs < topk, other=0).to(tl.int32) & 0xFFFF
                    mb = (m >> (b * M)) & ((1 << M) - 1)
                    rep = (lv > 0) & (lv < M) & ((mb & (0 - mb)) == (1 << j))
                    pos = start + tl.cumsum(rep.to(tl.int32), 0) - 1
                    dst = (tbase + off + pos // T) * T + pos % T
                    tl.store(tile_kv_ptr + dst, idx, mask=rep)
                    tl.store(tile_mask_ptr + dst, mb << (b * M), mask=rep)
                    start += tl.sum(rep.to(tl.int32))
                off, nrows = _close_segment(tile_kv_ptr, tile_mask_ptr, tile_level_ptr, tile_members_ptr, tbase, off,
                                            nrows, start, tcol, tnum, 0, BBITS, T, NTP)
        tl.store(group_tiles_ptr + g, off)
        tl.store(group_rows_ptr + g, nrows)
        # 6. leave the table zero for the next group
        tl.debug_barrier()
        for k in tl.static_range(G):
            idx, ok = _load_list(idx_ptr, len_ptr, q0 + k, s_q, s_kv, topk, offs, HAS_LEN)
            tl.store(tbl + idx, tl.zeros([KP], tl.int32), mask=ok)
        tl.debug_barrier()


def _workspace(device: torch.device, n_prog: int, s_kv: int) -> torch.Tensor:
    """A zeroed ``[n_prog, s_kv]`` int32 table, kept per device and stream (the kernel leaves it zero): plans
    on two streams (``plan_ahead`` beside a ``sparse_prefill`` that plans) may run at once; on one stream
    they run in order, and a table that grows is freed in that order."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    ws = _WORKSPACE.get(key)
    if ws is None or ws.numel() < n_prog * s_kv:
        ws = torch.zeros(n_prog * s_kv, dtype=torch.int32, device=device)
        _WORKSPACE[key] = ws
    return ws


def plan_triton(indices, s_kv: int, topk_length, G, M, T, thr, importance_clip, method, split_private=False):
    """Run the fused planner (rows ``>= s_kv`` invalid); returns the Plan's tensor fields and the valid-pair
    count."""
    s_q, topk = indices.shape
    dev = indices.device
    n_groups = -(-s_q // G)
    rows = n_groups * G
    KP = triton.next_power_of_2(topk)
    NTP = triton.next_power_of_2(-(-max(G * topk, 1) // T) + 1)
    indices = indices.contiguous()
    masks_given = method == "sort"
    if masks_given:
        masks, _ = member_masks(indices, G, s_kv=s_kv, topk_length=topk_length, method="sort")
        masks = pad_to_groups(masks, G, 0)
        masks = masks.to(torch.int16).contiguous()  # G <= 16 bits
    else:
        masks = torch.empty(rows, topk, dtype=torch.int16, device=dev)
    lvl = torch.empty(rows, topk, dtype=torch.int8, device=dev)
    buf = plan_buffers(s_q, topk, G, M, T, split_private, dev)
    cap = buf["tile_kv"].shape[1]
    if dev.type == "cuda":
        n_prog = min(n_groups, PLAN_PROGS_PER_SM * torch.cuda.get_device_properties(dev).multi_processor_count)
    else:
        n_prog = min(n_groups, 4)
    table = _workspace(dev, n_prog, s_kv)
    _plan_kernel[(n_prog,)](
        indices, topk_length if topk_length is not None else indices, masks, lvl, table,
        buf["tile_kv"], buf["tile_mask"], buf["tile_level"], buf["tile_members"], buf["group_tiles"],
        buf["group_rows"], buf["dropped"], buf["group_valid"],
        buf["priv_idx"] if split_private else buf["dropped"], buf["priv_n"] if split_private else buf["dropped"],
        s_q, s_kv, topk, n_groups, cap, float(thr),
        G=G, M=M, T=T, KP=KP, NTP=NTP, HAS_LEN=topk_length is not None, MASKS_GIVEN=masks_given,
        ICLIP=bool(importance_clip), SPLIT=bool(split_private), num_warps=PLAN_WARPS,
    )
    group_valid = buf.pop("group_valid")
    return buf, group_valid.sum(dtype=torch.int64)
