"""Stage 2 of planning: cascade levels, tile-aware clipping, and the tile work list.

Each aligned group of ``G`` queries is decomposed into *segments*: a segment of level ``L``
belongs to an aligned block of ``L`` members and holds the kv rows that every member of the
block selected and that no larger block took (cascaded sharing, paper section 3.3). Segments
are cut into tiles of ``tile`` kv rows (tile-aware clipping, section 3.4).

Order inside a segment: the importance order of the block's first member (its *representative*).
Tile-aware clipping pushes down the representative's lowest-ranked shared rows; the other members
learn which rows moved through a per-group table of the group's distinct rows (one flag bit a
block), so no list is ever sorted by rank. Importance-aware clipping drops each query's lowest-ranked
private rows.

Three implementations give identical plans: a CUDA kernel (``planner/cuda_plan.py``, the Hopper
path, one CTA a group with a hash table in shared memory), a fused Triton kernel
(``planner/triton_plan.py``, one program a group, a hash table in global memory) and vectorised torch
(this file; CPU path and test oracle; its table is indexed by dense row ids from one sort). All
three cost the same for any ``s_kv`` (up to ``2**31 - 1``: slot ids into a paged kv pool).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import torch

from .._checks import canonical_indices, check_topk_length
from ..reference import valid_index_mask
from .buffers import PACK_ROW_MASK, PACK_SHIFT, levels_desc, plan_buffers, segment_count, tile_capacity
from .cuda_plan import plan_cuda, unsupported_reason
from .membership import (MASK_METHODS, NO_S_KV_BOUND, cascade_levels, check_clip_threshold, check_group_size,
                         group_masks, pad_to_groups)
from .source import PlanSource, plan_source

PLANNER_BACKENDS = ("auto", "torch", "triton", "cuda")


@dataclass
class Plan:
    """A QUILT execution plan: a flat, tile-granular work list per group of queries.

    Tensors live on the device of the indices. ``n_groups = ceil(s_q / group_size)`` and
    ``cap`` is a per-group tile capacity large enough for any input. A plan from ``plan_ahead`` is
    still being written on another stream: code that reads its tensors itself calls ``wait()`` first
    (the library's readers do).

    Attributes
    ----------
    tile_kv : int32 ``[n_groups, cap, tile]``
        wide columns (``tile_mask`` given): kv row of each tile slot; -1 marks a padding slot (masked,
        never computed as a row). Packed columns (``tile_mask`` None, see ``packs_columns``): the word
        ``row | (mask << PACK_SHIFT)``; a word whose row field (``w & PACK_ROW_MASK``) is ``>= s_kv``
        (padding: -1) is padding with mask 0. ``columns()`` decodes either.
    tile_mask : int32 ``[n_groups, cap, tile]`` or None (packed)
        member bits (bit k = query ``g * group_size + k``) that own each slot's row; 0 for padding.
    tile_level : int32 ``[n_groups, cap]``
        level (block size) of the segment a tile belongs to; 0 for a merged tile, -1 unused.
    tile_members : int32 ``[n_groups, cap]``
        the block whose members may own the tile's rows (bits), 0 unused.
    group_tiles : int32 ``[n_groups]``
        tiles used by each group (slots ``0 .. group_tiles[g] - 1``).
    group_rows : int32 ``[n_groups]``
        logical (segment, row) entries of each group, each shared row counted once.
    dropped : int32 ``[s_q]``
        (query, row) pairs removed by importance-aware clipping, per query.
    priv_idx, priv_n : int32 ``[s_q, topk]`` and ``[s_q]``, or None
        with ``split_private``: each query's private rows (importance order, -1 padded) and their
        count; these rows are in no tile and are run query by query (16-row programs) instead.
    group_valid : int32 ``[n_groups]``
        valid (query, row) pairs of each group's input; ``valid_pairs`` is their sum (int64 scalar tensor,
        computed when first read).
    """

    s_q: int
    topk: int
    s_kv: int | None
    group_size: int
    tile: int
    clip_threshold: float
    importance_clip: bool
    merge_level: int
    mask_method: str
    split_private: bool
    tile_kv: torch.Tensor
    tile_mask: torch.Tensor | None
    tile_level: torch.Tensor
    tile_members: torch.Tensor
    group_tiles: torch.Tensor
    group_rows: torch.Tensor
    dropped: torch.Tensor
    priv_idx: torch.Tensor | None
    priv_n: torch.Tensor | None
    group_valid: torch.Tensor
    _stats: dict | None = field(default=None, repr=False)
    _work: dict = field(default_factory=dict, repr=False)
    _ready: object = field(default=None, repr=False)  # plan_ahead: a CUDA event after the planner's work
    _waited: set = field(default_factory=set, repr=False)  # streams already ordered after that event
    # what the plan was built for (the indices' identity, s_kv, topk_length): sparse_prefill refuses a plan
    # whose source does not match its arguments; None for a plan assembled by hand
    source: "PlanSource | None" = field(default=None, repr=False)

    def tensors(self):
        """The plan's tensor fields (those a planner wrote), in field order."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                yield v

    def wait(self, stream=None) -> "Plan":
        """Order ``stream`` (default: the current stream) after the planner of a plan that ``plan_ahead``
        built on another stream, and keep the plan's memory from being reused before that stream's work on
        it is done. Every reader of a plan calls it (``sparse_prefill``, ``stats``, ``work_list``); for any
        other plan it does nothing. No host sync."""
        if self._ready is None:
            return self
        s = torch.cuda.current_stream(self.device) if stream is None else stream
        if s.cuda_stream not in self._waited:
            s.wait_event(self._ready)
            for t in self.tensors():  # allocated on the planner's stream, read on this one
                t.record_stream(s)
            self._waited.add(s.cuda_stream)
        return self

    @property
    def valid_pairs(self) -> torch.Tensor:
        """Valid (query, row) pairs of the input (int64 scalar tensor on the plan's device; no host sync)."""
        return self.cached(("plan.valid_pairs",), lambda: self.wait().group_valid.sum(dtype=torch.int64))

    @property
    def device(self) -> torch.device:
        return self.tile_kv.device

    @property
    def packed(self) -> bool:
        """Whether the tile columns are packed words (``tile_mask`` None; see ``packs_columns``)."""
        return self.tile_mask is None

    def columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, masks)`` int32 ``[n_groups, cap, tile]`` of the tile slots, whatever the format: rows -1
        and masks 0 at padding (wide plans: ``tile_kv`` and ``tile_mask`` themselves). For tests and tools."""
        self.wait()
        if self.tile_mask is not None:
            return self.tile_kv, self.tile_mask
        w = self.tile_kv
        row = w & PACK_ROW_MASK
        ok = (row < self.s_kv) & (row != PACK_ROW_MASK)
        return torch.where(ok, row, -1), torch.where(ok, (w >> PACK_SHIFT) & 0xFF, 0)

    @property
    def n_groups(self) -> int:
        return self.tile_kv.shape[0]

    @property
    def capacity(self) -> int:
        return self.tile_kv.shape[1]

    @property
    def stats(self) -> dict:
        """Plan statistics (computed once; reading them syncs with the device)."""
        if self._stats is None:
            self.wait()
            tiles = int(self.group_tiles.sum())
            tile_rows = int(self.group_rows.sum())
            priv = int(self.priv_n.sum()) if self.priv_n is not None else 0
            priv_tiles = int(((self.priv_n + self.tile - 1) // self.tile).sum()) if self.priv_n is not None else 0
            rows = tile_rows + priv
            valid = int(self.valid_pairs)
            levels = torch.bincount((self.tile_level + 1).view(-1).long(), minlength=self.group_size + 2).tolist()
            per_level = {("merged" if lv == 0 else lv): levels[lv + 1]
                         for lv in [*(self.group_size >> i for i in range(int(math.log2(self.group_size)) + 1)), 0]
                         if levels[lv + 1]}
            self._stats = {
                "valid_pairs": valid,
                "rows_processed": rows,
                "padded_slots": tiles * self.tile - tile_rows,
                "tiles": tiles,
                "private_rows": priv,
                "private_tiles": priv_tiles,
                "tiles_per_level": per_level,
                "tile_utilization": tile_rows / max(1, tiles * self.tile),
                "reduction": 1.0 - rows / max(1, valid),
                "dropped_pairs": int(self.dropped.sum()),
            }
        return self._stats

    def summary(self) -> str:
        s = self.stats
        return "\n".join([
            f"QUILT plan: s_q={self.s_q} topk={self.topk} group_size={self.group_size} tile={self.tile} "
            f"clip_threshold={self.clip_threshold} importance_clip={self.importance_clip} "
            f"merge_level={self.merge_level} split_private={self.split_private} mask_method={self.mask_method}",
            f"  valid (query, row) pairs : {s['valid_pairs']}",
            f"  rows processed (logical) : {s['rows_processed']}  (reduction {s['reduction']:.1%})",
            f"  tiles                    : {s['tiles']}  per level {s['tiles_per_level']}",
            f"  private rows (run apart) : {s['private_rows']}  in {s['private_tiles']} query tiles",
            f"  padded slots             : {s['padded_slots']}  (tile utilization {s['tile_utilization']:.1%})",
            f"  dropped pairs            : {s['dropped_pairs']}",
        ])

    def work_list(self, queries_per_program: int):
        """Per-program tile lists for a kernel whose program owns ``queries_per_program`` queries.

        Returns ``(prog_tiles int32 [n_progs, cap], prog_ntiles int32 [n_progs])``; a tile id is
        ``g * cap + slot``. With fewer queries a program than the group has, a program runs every
        tile of its group whose block meets its queries (shared rows are then re-read by the
        sibling programs, from L2). Cached per width; no host sync.
        """
        _check_program_width(queries_per_program)
        qp = min(queries_per_program, self.group_size)
        if qp not in self._work:
            self.wait()
            n_sub, cap, dev = self.group_size // qp, self.capacity, self.device
            if n_sub == 1:
                ids = torch.arange(self.n_groups * cap, device=dev, dtype=torch.int32).view(self.n_groups, cap)
                self._work[qp] = (ids, self.group_tiles)
            else:
                sub_bits = ((1 << qp) - 1) << (torch.arange(n_sub, device=dev, dtype=torch.int32) * qp)
                inc = (self.tile_members[:, None, :] & sub_bits[None, :, None]) != 0
                inc = inc.reshape(-1, cap)
                dest = torch.where(inc, torch.cumsum(inc, dim=1, dtype=torch.int32) - 1, cap)
                ids = (torch.arange(self.n_groups, device=dev, dtype=torch.int32).repeat_interleave(n_sub)[:, None] * cap
                       + torch.arange(cap, device=dev, dtype=torch.int32)[None, :])
                out = torch.zeros(ids.shape[0], cap + 1, dtype=torch.int32, device=dev)
                out.scatter_(1, dest.long(), ids)  # excluded tiles land in the cut-off last column
                self._work[qp] = (out[:, :cap].contiguous(), inc.sum(1, dtype=torch.int32))
        return self._work[qp]

    def program_counts(self, queries_per_program: int) -> torch.Tensor:
        """Tiles of each program of ``work_list(queries_per_program)`` (int32 [n_progs]): with one program a
        group, the group's own counts (``group_tiles``; no work list is built). No host sync."""
        _check_program_width(queries_per_program)
        if queries_per_program >= self.group_size:
            return self.wait().group_tiles
        return self.work_list(queries_per_program)[1]

    def program_order(self, queries_per_program: int, sort=None) -> torch.Tensor:
        """Program ids of ``work_list(queries_per_program)`` by descending tile count, equal counts by id
        (int32 [n_progs]).

        Launched in this order, the long programs start first and the last wave holds short ones, so
        less of the GPU idles at the end. ``sort``: a function of ``program_counts`` giving that order (the
        CUDA backend's one-launch kernel); None: torch's stable sort. Cached per width; no host sync.
        """
        _check_program_width(queries_per_program)
        key = ("order", min(queries_per_program, self.group_size))
        if key not in self._work:
            counts = self.program_counts(queries_per_program)
            self._work[key] = sort(counts) if sort is not None else \
                torch.argsort(counts, descending=True, stable=True).to(torch.int32)
        return self._work[key]

    def cached(self, key: tuple, make):
        """``make()`` computed once per plan and ``key``, then kept with the plan (like its work lists).

        For what other modules derive from a plan and reuse with it (``dispatch.quilt_pays_off``): ``key``
        a tuple whose first item names the owner (``("dispatch.quilt_pays_off", h)``), so keys of
        different owners never collide; ``make`` a function of no argument returning the value.
        """
        if not isinstance(key, tuple) or not key or not isinstance(key[0], str):
            raise TypeError(f"key must be a tuple starting with its owner's name, got {key!r}")
        if key not in self._work:
            self._work[key] = make()
        return self._work[key]


def _check_program_width(queries_per_program) -> None:
    if queries_per_program < 1 or queries_per_program & (queries_per_program - 1):
        raise ValueError(f"queries_per_program must be a power of two >= 1, got {queries_per_program}")


def _plan_torch(idx, valid, masks, ids, G, M, T, thr, importance_clip, split_private, buf):
    """Vectorised torch planner over padded rows ``idx [n_groups * G, topk]`` (rank order), into ``buf``
    (``plan_buffers``'s tensors; packed columns when ``buf["tile_mask"]`` is None).

    ``ids``: the dense row ids of ``membership.group_row_ids``; the push-down flags live in a per-group
    table indexed by them, so memory and time are O(rows * topk) for any ``s_kv``. No host sync: masked
    writes go to a spare slot past the end of a scratch array.
    """
    rows, topk = idx.shape
    n_groups, dev = rows // G, idx.device
    n_ent = G * topk
    member = (torch.arange(rows, device=dev) % G)[:, None]
    gid = (torch.arange(rows, device=dev) // G)[:, None]
    level = cascade_levels(masks, G)
    slot_of = (gid * n_ent + ids).view(-1)

    for L in levels_desc(G, max(M, 2)):  # tile-aware clipping, top level first
        sel = level == L
        n = sel.sum(1, keepdim=True)
        pos = torch.cumsum(sel, 1) - 1
        r = n % T
        rep = member % L == 0
        pushed = sel & rep & (r > 0) & (r < thr) & (pos >= n - r)
        table = torch.zeros(n_groups * n_ent, dtype=torch.int64, device=dev)
        table.scatter_add_(0, slot_of, torch.where(pushed, 1 << (member // L), 0).view(-1))  # a row once a block
        moved = sel & (((table[slot_of].view(rows, topk) >> (member // L)) & 1) == 1)
        level = torch.where(moved, L // 2, level)

    dropped = torch.zeros(rows, dtype=torch.int32, device=dev)
    priv_idx = priv_n = None
    if importance_clip or split_private:
        if M == 1:
            priv = level == 1
        else:  # below the merge level, a row only one member of its block owns
            mb = (masks >> ((member // M) * M)) & ((1 << M) - 1)
            priv = (level > 0) & (level < M) & ((mb & (mb - 1)) == 0)
        n = priv.sum(1, keepdim=True)
        pos = torch.cumsum(priv, 1) - 1
        keep = priv
        if importance_clip:  # private rows are in importance order: drop the last r
            r = n % T
            drop = priv & (r > 0) & (r < thr) & (pos >= n - r)
            level = torch.where(drop, 0, level)
            dropped = drop.sum(1, dtype=torch.int32)
            keep = priv & ~drop
        if split_private:
            lists = torch.full((rows, topk + 1), -1, dtype=torch.int32, device=dev)  # column topk: the spare
            lists.scatter_(1, torch.where(keep, pos, topk), idx)
            priv_idx = lists[:, :topk]
            priv_n = keep.sum(1, dtype=torch.int32)
            level = torch.where(keep, -1, level)  # in no tile

    nseg = segment_count(G, M)
    sid = torch.full_like(level, -1)
    spos = torch.zeros_like(level)
    colmask = torch.zeros_like(masks)
    base = 0
    for L in levels_desc(G, M):
        sel = level == L
        rep = sel & (member % L == 0)
        sid = torch.where(rep, base + member // L, sid)
        spos = torch.where(rep, (torch.cumsum(sel, 1) - 1).to(spos.dtype), spos)
        colmask = torch.where(rep, ((1 << L) - 1) << ((member // L) * L), colmask)
        base += G // L
    if M > 1:
        sel = (level > 0) & (level < M)
        blk = member // M
        mb = (masks >> (blk * M)) & ((1 << M) - 1)
        rep = sel & ((mb & -mb) == (1 << (member % M)))  # the block's lowest owner holds the column
        cnt = rep.sum(1).view(n_groups, G // M, M)
        start = (torch.cumsum(cnt, 2) - cnt).view(rows, 1)
        sid = torch.where(rep, base + blk, sid)
        spos = torch.where(rep, (start + torch.cumsum(rep, 1) - 1).to(spos.dtype), spos)
        colmask = torch.where(rep, mb << (blk * M), colmask)

    is_rep = sid >= 0
    seg_rows = torch.zeros(n_groups * nseg, dtype=torch.int64, device=dev)
    seg_rows.scatter_add_(0, (gid * nseg + sid.clamp_min(0)).view(-1), is_rep.to(torch.int64).view(-1))
    seg_rows = seg_rows.view(n_groups, nseg)
    seg_tiles = (seg_rows + T - 1) // T
    seg_end = torch.cumsum(seg_tiles, 1)
    cap = tile_capacity(G, M, topk, T)
    slot = torch.gather(seg_end - seg_tiles, 1, sid.clamp_min(0).view(n_groups, n_ent).long()).view(rows, topk)
    n_slots = n_groups * cap * T
    dest = torch.where(is_rep, (gid * cap + slot + spos // T) * T + spos % T, n_slots).view(-1)  # n_slots: spare
    if buf["tile_mask"] is None:  # packed: row | mask << 24, as int32
        word = idx.to(torch.int64) | (colmask.to(torch.int64) << PACK_SHIFT)
        word = torch.where(word >= 2**31, word - 2**32, word)
        cols = [("tile_kv", word.to(torch.int32), -1)]
    else:
        cols = [("tile_kv", idx, -1), ("tile_mask", colmask.to(torch.int32), 0)]
    for name, value, pad in cols:
        flat = torch.full((n_slots + 1,), pad, dtype=torch.int32, device=dev)
        flat.scatter_(0, dest, value.view(-1))
        buf[name].view(-1).copy_(flat[:n_slots])

    # tile c of a group belongs to the first segment ending after it (empty segments end where they start)
    seg = torch.searchsorted(seg_end, torch.arange(cap, device=dev).expand(n_groups, cap).contiguous(), right=True)
    tile_level = torch.full_like(seg, -1)
    tile_members = torch.zeros_like(seg)
    base = 0
    blocks = [(L, L, G // L) for L in levels_desc(G, M)] + ([(0, M, G // M)] if M > 1 else [])
    for lv, width, count in blocks:  # segments base .. base + count - 1: the blocks of one level, in order
        inside = (seg >= base) & (seg < base + count)
        tile_level = torch.where(inside, lv, tile_level)
        block = (seg - base).clamp(0, count - 1)
        tile_members = torch.where(inside, ((1 << width) - 1) << (block * width), tile_members)
        base += count
    buf["tile_level"].copy_(tile_level)
    buf["tile_members"].copy_(tile_members)
    buf["group_tiles"].copy_(seg_tiles.sum(1))
    buf["group_rows"].copy_(seg_rows.sum(1))
    s_q = buf["dropped"].shape[0]
    buf["dropped"].copy_(dropped[:s_q])
    if split_private:
        buf["priv_idx"].copy_(priv_idx[:s_q])
        buf["priv_n"].copy_(priv_n[:s_q])
    buf["group_valid"].copy_(valid.view(n_groups, n_ent).sum(1))
    return buf


def _planner_backend(device: torch.device, backend: str, tile: int, G: int, topk: int, s_kv: int | None,
                     mask_method: str) -> str:
    """The planner that runs: ``backend`` checked, or for ``"auto"`` the CUDA planner where it can run
    (``s_kv`` given), else Triton on a GPU (power-of-two tiles), else torch."""
    if backend == "torch":
        return "torch"
    if backend == "cuda":
        reason = unsupported_reason(device, G, topk, s_kv, tile, mask_method)
        if reason:
            raise ValueError(f"backend='cuda': {reason}; use backend='triton' or 'torch'")
        return "cuda"
    can = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "triton":
        if not can:
            raise ValueError("backend='triton' needs a CUDA device (or TRITON_INTERPRET=1)")
        if tile & (tile - 1):
            raise ValueError(f"backend='triton' needs a power-of-two tile, got {tile}; use backend='torch'")
        return "triton"
    if device.type != "cuda":
        return "torch"
    if unsupported_reason(device, G, topk, s_kv, tile, mask_method) is None:
        return "cuda"
    return "triton" if not tile & (tile - 1) else "torch"  # other tiles: the torch planner


def plan(
    indices: torch.Tensor,
    *,
    s_kv: int | None = None,
    topk_length: torch.Tensor | None = None,
    group_size: int = 8,
    tile: int = 64,
    clip_threshold: float = 0.5,
    importance_clip: bool = False,
    merge_level: int = 1,
    split_private: bool = False,
    mask_method: str = "bitmap",
    backend: str = "auto",
    workspace: torch.Tensor | None = None,
) -> Plan:
    """Decompose the Top-K lists of aligned query groups into shared segments and tiles.

    Parameters
    ----------
    indices : int32 ``[s_q, topk]`` (or ``[s_q, 1, topk]``), rows in descending importance. A kv row
        listed twice by one query counts twice for that query, as in the reference: the first
        occurrence is planned as usual, every later one as a row of that query alone. The plan records
        this tensor's identity and in-place version, and those of ``topk_length`` (``Plan.source``,
        ``planner.source``): ``sparse_prefill`` runs it only with these tensors, unwritten since.
    s_kv : context length or kv pool size, up to ``2**31 - 1``; entries ``>= s_kv`` or ``< 0`` are
        ignored (``None``: only negatives). Planning time and memory do not depend on it. Given and
        ``<= PACK_ROW_MASK`` (with ``group_size <= 8``), the plan's tile columns are packed
        (``packs_columns``).
    topk_length : optional int32 ``[s_q]``; row i keeps its first ``topk_length[i]`` entries.
    group_size : queries a group, power of two in [1, 16] (1 = query-parallel).
    tile : kv rows a tile.
    clip_threshold : tile-aware clipping threshold tau in [0, 1]. A segment of ``q*tile + r`` rows
        with ``0 < r < tau * tile`` pushes its ``r`` lowest-ranked rows down a level (exact);
        otherwise the tail is padded.
    importance_clip : drop each query's ``r`` lowest-ranked private rows when they would fill a last
        tile below the threshold (approximate; counted in ``Plan.dropped``). Private rows are the
        level-1 rows (``merge_level=1``) or, with ``split_private``, the rows below the merge level
        that one member of the block owns alone.
    merge_level : the cascade stops at blocks of this many members (power of two <= group_size);
        what smaller sub-blocks share, and private rows, are packed into member-masked tiles of the
        block, one column a distinct row. 1 = the paper's full cascade.
    split_private : leave rows that a single query owns out of the tiles and list them per query
        (``Plan.priv_idx``); the kernel runs them in 16-row query programs, where a 64-row tile
        would compute mostly masked rows. Also the graceful fallback when nothing is shared.
    mask_method : member masks by ``"bitmap"`` (membership table) or ``"sort"`` (SCSD); same plan.
    backend : the planner: ``"cuda"`` (Hopper kernel, group sizes <= 8, ``group_size * topk <= 16384``,
        mask_method ``"bitmap"``), ``"triton"`` (fused kernel), ``"torch"``, or ``"auto"``: CUDA where it can
        run, else Triton on a GPU, else torch.
    workspace : optional uint8 tensor on the indices' device, contiguous and 16-byte aligned, of at least
        ``plan_workspace_bytes(s_q, topk, ...)`` bytes: the plan's tensors are carved from it (no
        allocation for them; the planners' own scratch is not in it). It stays the caller's: the plan
        is valid until the workspace is written again.
    """
    indices_arg, topk_length_arg = indices, topk_length  # the caller's tensors: the plan's source
    indices = canonical_indices(indices)
    G = check_group_size(group_size)
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"tile must be a positive int, got {tile!r}")
    check_clip_threshold(clip_threshold)
    M = check_group_size(merge_level, G, "merge_level")
    if importance_clip and M != 1 and not split_private:
        raise ValueError("importance_clip needs merge_level=1 or split_private=True (it clips private rows)")
    if mask_method not in MASK_METHODS:
        raise ValueError(f"mask_method must be one of {MASK_METHODS}, got {mask_method!r}")
    if backend not in PLANNER_BACKENDS:
        raise ValueError(f"backend must be one of {PLANNER_BACKENDS}, got {backend!r}")
    if s_kv is not None and (not isinstance(s_kv, int) or isinstance(s_kv, bool) or not 1 <= s_kv <= NO_S_KV_BOUND):
        raise ValueError(f"s_kv must be an int in [1, 2**31 - 1] or None, got {s_kv!r}")
    s_q, topk = indices.shape
    dev = indices.device
    topk_length = check_topk_length(topk_length, s_q, dev, topk)
    source = plan_source(indices_arg, s_kv, topk_length_arg)
    thr = float(clip_threshold) * tile

    which = _planner_backend(dev, backend, tile, G, topk, s_kv, mask_method)
    # every planner's tables are sized by the group's entries, not by s_kv: no bound to find (no host sync)
    if which == "cuda":
        parts = plan_cuda(indices, s_kv, topk_length, G, M, tile, thr, importance_clip, split_private,
                          workspace=workspace)
    elif which == "triton":
        # imported here, not above: a Triton kernel module picks the interpreter (TRITON_INTERPRET) when it is
        # first imported, which the CLI sets after importing the package
        from .triton_plan import plan_triton

        parts = plan_triton(indices, s_kv, topk_length, G, M, tile, thr, importance_clip, mask_method,
                            split_private, workspace=workspace)
    else:
        buf = plan_buffers(s_q, topk, G, M, tile, split_private, dev, filled=False, s_kv=s_kv, workspace=workspace)
        valid = valid_index_mask(indices, s_kv if s_kv is not None else NO_S_KV_BOUND, topk_length)
        idx, valid = pad_to_groups(indices, G, -1), pad_to_groups(valid, G, False)
        masks, ids = group_masks(idx, valid, G, mask_method)
        parts = _plan_torch(idx, valid, masks, ids, G, M, tile, thr, importance_clip, split_private, buf)
    return Plan(s_q=s_q, topk=topk, s_kv=s_kv, group_size=G, tile=tile, clip_threshold=float(clip_threshold),
                importance_clip=bool(importance_clip), merge_level=M, mask_method=mask_method,
                split_private=bool(split_private),
                source=source, **parts)
