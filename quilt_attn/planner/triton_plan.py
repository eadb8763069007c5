"""Fused Triton planner: one program a query group, no sort, no host sync.

A program walks its group's ``G`` lists a few times (each list is one ``[KP]`` vector). Its
membership table is an open-addressing hash table in global memory, ``HS`` slots (a power of two
``>= 2 * G * topk``, so at most half full) whatever ``s_kv`` is: keys ``row + 1`` (0 = empty) placed by
a multiplicative hash and linear probing (``atomic_cas``), and a value word a slot holding the member
bits (bits 0..15, ``atomic_or``) and tile-aware clipping's push-down flags (bits 16..30). Each entry's
slot is kept in a per-program scratch, so later passes index the table by slot without probing again.
Levels follow from the masks, and the tile lists are written with prefix sums. The table is cleared on
the way out, so the workspace stays zero between calls. Same results as the torch planner in ``plan.py``
(repeated rows in one list included: the first occurrence keeps the row's mask, later ones are private).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .membership import NO_S_KV_BOUND, member_masks, pad_to_groups
from .buffers import PACK_SHIFT, plan_buffers
from ..ops.shapes import sm_count

_WORKSPACE: dict = {}
PLAN_WARPS = 16  # measured on the H200: see docs/learned.md
PLAN_PROGS_PER_SM = 4
HASH_MULT = tl.constexpr(-1640531527)  # 0x9E3779B1 (Knuth's multiplicative hash) as int32
HASH_WORDS = 2  # int32 words a slot: key, value (member bits | flags)
HASH_WORDS_C = tl.constexpr(HASH_WORDS)
PACK_SHIFT_C = tl.constexpr(PACK_SHIFT)


def hash_slots(G: int, topk: int) -> int:
    """Slots of a program's hash table: a power of two >= 2 * G * topk (load factor <= 1/2)."""
    return triton.next_power_of_2(max(2 * G * topk, 2))


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
def _insert(keys, idx, ok, LOG_HS: tl.constexpr):
    """Slot of each valid row in the hash table (inserted when new): multiplicative hash, linear probing.

    A lane claims an empty slot with ``atomic_cas(0 -> key)`` or finds its key there; a lane that is
    done (or invalid) compares and swaps ``-1 -> -1``, which never changes a slot.
    """
    HS: tl.constexpr = 1 << LOG_HS
    key = idx + 1
    slot = ((key * HASH_MULT) >> (32 - LOG_HS)) & (HS - 1)  # the product's top LOG_HS bits
    act = ok
    while tl.max(act.to(tl.int32), 0) > 0:
        prev = tl.atomic_cas(keys + slot, tl.where(act, 0, -1), tl.where(act, key, -1), sem="relaxed", scope="cta")
        act = act & (prev != 0) & (prev != key)
        slot = tl.where(act, (slot + 1) & (HS - 1), slot)
    return slot


@triton.jit
def _later_repeats(vals, slot, ok, offs, LOG_KP: tl.constexpr):
    """Which valid entries of one list repeat a row at a lower position of the same list.

    A tournament on the positions' bits, high to low, with bit 31 of the value word (free: flags end at 30)
    as a per-slot mark: entries still in the running whose bit is 0 mark their slot, and those whose bit is
    1 on a marked slot drop out; one entry a slot, its lowest position, is left.
    """
    MARK: tl.constexpr = -2147483648  # bit 31
    cand = ok
    for e in tl.static_range(LOG_KP):
        one = ((offs >> (LOG_KP - 1 - e)) & 1) != 0
        zero = cand & ~one
        tl.atomic_or(vals + slot, tl.zeros_like(slot) + MARK, mask=zero, sem="relaxed", scope="cta")
        tl.debug_barrier()
        marked = (tl.load(vals + slot, mask=cand, other=0) & MARK) != 0
        cand = cand & ~(one & marked)
        tl.debug_barrier()
        tl.atomic_and(vals + slot, tl.zeros_like(slot) + 0x7FFFFFFF, mask=zero, sem="relaxed", scope="cta")
        tl.debug_barrier()
    return ok & ~cand


@triton.jit
def _slot_of(slots, k, offs, KP: tl.constexpr):
    """The table slot of member ``k``'s entries and whether each is a later repeat of a row in its list."""
    s = tl.load(slots + k * KP + offs)
    return tl.where(s >= 0, s, ~s), s < 0


@triton.jit
def _push_level(lvl_ptr, vals, slots, q0, topk, thr, offs,
                G: tl.constexpr, L: tl.constexpr, T: tl.constexpr, KP: tl.constexpr):
    """Tile-aware clipping of the level-L blocks of one group (flags in the table, bits 16..30)."""
    for b in tl.static_range(G // L):
        FLAG = 1 << (16 + (G // L - 1) + b)
        rep = q0 + b * L
        lv = tl.load(lvl_ptr + rep * topk + offs, mask=offs < topk, other=0).to(tl.int32)
        sel = lv == L
        n = tl.sum(sel.to(tl.int32))
        r = n % T
        if (r > 0) & (r.to(tl.float32) < thr):
            slot, _ = _slot_of(slots, b * L, offs, KP)
            pos = tl.cumsum(sel.to(tl.int32), 0) - 1
            pushed = sel & (pos >= n - r)
            tl.atomic_or(vals + slot, tl.where(pushed, FLAG, 0), mask=pushed, sem="relaxed", scope="cta")
            tl.debug_barrier()
            for j in tl.static_range(L):
                q = rep + j
                slot, _ = _slot_of(slots, b * L + j, offs, KP)
                lv = tl.load(lvl_ptr + q * topk + offs, mask=offs < topk, other=0).to(tl.int32)
                at = lv == L
                f = tl.load(vals + slot, mask=at, other=0)
                lv = tl.where(at & ((f & FLAG) != 0), L // 2, lv)
                tl.store(lvl_ptr + q * topk + offs, lv.to(tl.int8), mask=offs < topk)
            tl.debug_barrier()


@triton.jit
def _store_columns(tile_kv_ptr, tile_mask_ptr, dst, idx, bits, sel, PACKED: tl.constexpr):
    """Tile columns: packed words ``row | bits << PACK_SHIFT`` or wide rows and member bits."""
    if PACKED:
        tl.store(tile_kv_ptr + dst, idx | (bits << PACK_SHIFT_C), mask=sel)
    else:
        tl.store(tile_kv_ptr + dst, idx, mask=sel)
        tl.store(tile_mask_ptr + dst, bits, mask=sel)


@triton.jit
def _write_level(idx_ptr, len_ptr, lvl_ptr, tile_kv_ptr, tile_mask_ptr, tile_level_ptr, tile_members_ptr,
                 q0, s_q, s_kv, topk, tbase, off, nrows, offs, tcol, tnum,
                 G: tl.constexpr, L: tl.constexpr, T: tl.constexpr, KP: tl.constexpr, NTP: tl.constexpr,
                 HAS_LEN: tl.constexpr, PACKED: tl.constexpr):
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
        _store_columns(tile_kv_ptr, tile_mask_ptr, dst, idx, tl.zeros([KP], tl.int32) + BITS, sel, PACKED)
        off, nrows = _close_segment(tile_kv_ptr, tile_mask_ptr, tile_level_ptr, tile_members_ptr, tbase, off, nrows,
                                    n, tcol, tnum, L, BITS, T, NTP, PACKED)
    return off, nrows


@triton.jit
def _close_segment(tile_kv_ptr, tile_mask_ptr, tile_level_ptr, tile_members_ptr, tbase, off, nrows, n, tcol, tnum,
                   LEVEL, BITS, T: tl.constexpr, NTP: tl.constexpr, PACKED: tl.constexpr):
    """Pad a segment's last tile (kv -1, mask 0; packed: the word -1) and record its tiles' level and block."""
    nt = (n + T - 1) // T
    pp = n + tcol
    pm = pp < nt * T
    tl.store(tile_kv_ptr + (tbase + off + pp // T) * T + pp % T, tl.full([T], -1, tl.int32), mask=pm)
    if not PACKED:
        tl.store(tile_mask_ptr + (tbase + off + pp // T) * T + pp % T, tl.zeros([T], tl.int32), mask=pm)
    tl.store(tile_level_ptr + tbase + off + tnum, tl.zeros([NTP], tl.int32) + LEVEL, mask=tnum < nt)
    tl.store(tile_members_ptr + tbase + off + tnum, tl.zeros([NTP], tl.int32) + BITS, mask=tnum < nt)
    return off + nt, nrows + n


@triton.jit
def _plan_kernel(
    idx_ptr, len_ptr, masks_ptr, lvl_ptr, table_ptr, slots_ptr,
    tile_kv_ptr, tile_mask_ptr, tile_level_ptr, tile_members_ptr,
    group_tiles_ptr, group_rows_ptr, dropped_ptr, valid_ptr, priv_idx_ptr, priv_n_ptr,
    s_q, s_kv, topk, n_groups, cap, thr,
    G: tl.constexpr, M: tl.constexpr, T: tl.constexpr, KP: tl.constexpr, NTP: tl.constexpr,
    LOG_HS: tl.constexpr,
    HAS_LEN: tl.constexpr, MASKS_GIVEN: tl.constexpr, ICLIP: tl.constexpr, SPLIT: tl.constexpr,
    PACKED: tl.constexpr,
):
    HS: tl.constexpr = 1 << LOG_HS
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, KP)
    tcol = tl.arange(0, T)
    tnum = tl.arange(0, NTP)
    LOG_KP: tl.constexpr = KP.bit_length() - 1
    keys = table_ptr + pid.to(tl.int64) * (HASH_WORDS_C * HS)  # [HS] row + 1 (0 empty)
    vals = keys + HS  # [HS] member bits 0..15 | push-down flags 16..30 | bit 31: _later_repeats' mark
    slots = slots_ptr + pid.to(tl.int64) * (G * KP)  # [G, KP] each entry's slot (~slot: a later repeat)
    for g in range(pid, n_groups, nprog):
        q0 = g * G
        # 1. every member's rows into the hash table; member bits ORed into their slots' values
        for k in tl.static_range(G):  # ORs commute: all members' updates may be in flight at once
            idx, ok = _load_list(idx_ptr, len_ptr, q0 + k, s_q, s_kv, topk, offs, HAS_LEN)
            slot = _insert(keys, idx, ok, LOG_HS)
            if not MASKS_GIVEN:  # (given masks already say which entries repeat a row)
                old = tl.atomic_or(vals + slot, tl.zeros([KP], tl.int32) + (1 << k), mask=ok, sem="relaxed",
                                   scope="cta")
                if tl.max((ok & (((old >> k) & 1) != 0)).to(tl.int32), 0) > 0:
                    # a row repeated in this list (rare: Top-K lists never repeat): its lowest position keeps
                    # the row, the others become entries of this query alone
                    slot = tl.where(_later_repeats(vals, slot, ok, offs, LOG_KP), ~slot, slot)
            tl.store(slots + k * KP + offs, slot)
        tl.debug_barrier()
        # 2. read masks back; cascade level = largest aligned all-selecting block holding the query
        nvalid = 0
        for k in tl.static_range(G):
            q = q0 + k
            idx, ok = _load_list(idx_ptr, len_ptr, q, s_q, s_kv, topk, offs, HAS_LEN)
            if MASKS_GIVEN:
                m = tl.load(masks_ptr + q * topk + offs, mask=ok, other=0).to(tl.int32) & 0xFFFF
            else:
                slot, later = _slot_of(slots, k, offs, KP)
                m = tl.load(vals + slot, mask=ok, other=0) & 0xFFFF
                m = tl.where(later, 1 << k, m)
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
                _push_level(lvl_ptr, vals, slots, q0, topk, thr, offs, G, G >> e, T, KP)
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
                                          G, G >> e, T, KP, NTP, HAS_LEN, PACKED)
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
                    _store_columns(tile_kv_ptr, tile_mask_ptr, dst, idx, mb << (b * M), rep, PACKED)
                    start += tl.sum(rep.to(tl.int32))
                off, nrows = _close_segment(tile_kv_ptr, tile_mask_ptr, tile_level_ptr, tile_members_ptr, tbase, off,
                                            nrows, start, tcol, tnum, 0, BBITS, T, NTP, PACKED)
        tl.store(group_tiles_ptr + g, off)
        tl.store(group_rows_ptr + g, nrows)
        # 6. leave the table empty for the next group (keys and values of the slots this group used)
        tl.debug_barrier()
        for k in tl.static_range(G):
            idx, ok = _load_list(idx_ptr, len_ptr, q0 + k, s_q, s_kv, topk, offs, HAS_LEN)
            slot, _ = _slot_of(slots, k, offs, KP)
            tl.store(keys + slot, tl.zeros([KP], tl.int32), mask=ok)
            tl.store(vals + slot, tl.zeros([KP], tl.int32), mask=ok)
        tl.debug_barrier()


def _workspace(device: torch.device, n_prog: int, hs: int, G: int, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed hash table of ``n_prog * HASH_WORDS * hs`` int32 (the kernel leaves it zero) and a slot scratch
    of ``n_prog * G * kp`` int32, kept per device and stream; their sizes follow the group's entries, never
    ``s_kv``. Plans on two streams (``plan_ahead`` beside a ``sparse_prefill`` that plans) may run at once; on
    one stream they run in order, and a table that grows is freed in that order."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    table, scratch = _WORKSPACE.get(key, (None, None))
    if table is None or table.numel() < n_prog * HASH_WORDS * hs:
        table = torch.zeros(n_prog * HASH_WORDS * hs, dtype=torch.int32, device=device)
    if scratch is None or scratch.numel() < n_prog * G * kp:
        scratch = torch.empty(n_prog * G * kp, dtype=torch.int32, device=device)
    _WORKSPACE[key] = (table, scratch)
    return table, scratch


def plan_triton(indices, s_kv: int | None, topk_length, G, M, T, thr, importance_clip, mask_method,
                split_private=False, workspace=None):
    """Run the fused planner (rows ``>= s_kv`` invalid; None: only negatives); returns the Plan's tensor
    fields. ``workspace``: the caller's bytes for the plan's tensors (``plan``)."""
    s_q, topk = indices.shape
    dev = indices.device
    n_groups = -(-s_q // G)
    rows = n_groups * G
    KP = triton.next_power_of_2(topk)
    NTP = triton.next_power_of_2(-(-max(G * topk, 1) // T) + 1)
    hs = hash_slots(G, topk)
    indices = indices.contiguous()
    masks_given = mask_method == "sort"
    if masks_given:
        masks, _ = member_masks(indices, G, s_kv=s_kv, topk_length=topk_length, mask_method="sort")
        masks = pad_to_groups(masks, G, 0)
        masks = masks.to(torch.int16).contiguous()  # G <= 16 bits
    else:
        masks = torch.empty(rows, topk, dtype=torch.int16, device=dev)
    lvl = torch.empty(rows, topk, dtype=torch.int8, device=dev)
    buf = plan_buffers(s_q, topk, G, M, T, split_private, dev, s_kv=s_kv, workspace=workspace)
    cap = buf["tile_kv"].shape[1]
    packed = buf["tile_mask"] is None
    if dev.type == "cuda":
        n_prog = min(n_groups, PLAN_PROGS_PER_SM * sm_count(dev))
    else:
        n_prog = min(n_groups, 4)
    table, scratch = _workspace(dev, max(n_prog, 1), hs, G, KP)
    if n_groups == 0:
        return buf
    _plan_kernel[(n_prog,)](
        indices, topk_length if topk_length is not None else indices, masks, lvl, table, scratch,
        buf["tile_kv"], buf["tile_kv"] if packed else buf["tile_mask"], buf["tile_level"], buf["tile_members"],
        buf["group_tiles"], buf["group_rows"], buf["dropped"], buf["group_valid"],
        buf["priv_idx"] if split_private else buf["dropped"], buf["priv_n"] if split_private else buf["dropped"],
        s_q, NO_S_KV_BOUND if s_kv is None else s_kv, topk, n_groups, cap, float(thr),
        G=G, M=M, T=T, KP=KP, NTP=NTP, LOG_HS=hs.bit_length() - 1, HAS_LEN=topk_length is not None,
        MASKS_GIVEN=masks_given, ICLIP=bool(importance_clip), SPLIT=bool(split_private), PACKED=packed,
        num_warps=PLAN_WARPS,
    )
    return buf
