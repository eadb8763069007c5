"""Stage 2 of planning: cascade levels, tile-aware clipping, and the tile work list.

Each aligned group of ``G`` queries is decomposed into *segments*: a segment of level ``L``
belongs to an aligned block of ``L`` members and holds the kv rows that every member of the
block selected and that no larger block took (cascaded sharing, paper section 3.3). Segments
are cut into tiles of ``tile`` kv rows (tile-aware clipping, section 3.4).

Order inside a segment: the importance order of the block's first member (its *representative*).
Tile-aware clipping pushes down the representative's lowest-ranked shared rows; the other members
learn which rows moved through a per-group table indexed by kv row (one flag bit a block), so no
list is ever sorted. Importance-aware clipping drops each query's lowest-ranked private rows.

Three implementations give identical plans: a CUDA kernel (``planner/cuda_plan.py``, the Hopper
path, one CTA a group with its table in shared memory), a fused Triton kernel
(``planner/triton_plan.py``, one program a group, table in global memory) and vectorised torch
(this file; CPU path and test oracle).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import torch

from .._checks import canonical_indices, check_topk_length
from .membership import METHODS, cascade_levels, check_group_size, member_masks, pad_to_groups

BACKENDS = ("auto", "torch", "triton", "cuda")


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
        kv row of each tile slot; -1 marks a padding slot (masked, never computed as a row).
    tile_mask : int32 ``[n_groups, cap, tile]``
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
    valid_pairs : int64 scalar tensor, valid (query, row) pairs of the input.
    """

    s_q: int
    topk: int
    s_kv: int | None
    group_size: int
    tile: int
    clip_threshold: float
    importance_clip: bool
    merge_level: int
    method: str
    split_private: bool
    tile_kv: torch.Tensor
    tile_mask: torch.Tensor
    tile_level: torch.Tensor
    tile_members: torch.Tensor
    group_tiles: torch.Tensor
    group_rows: torch.Tensor
    dropped: torch.Tensor
    priv_idx: torch.Tensor | None
    priv_n: torch.Tensor | None
    valid_pairs: torch.Tensor
    _stats: dict | None = field(default=None, repr=False)
    _work: dict = field(default_factory=dict, repr=False)
    _ready: object = field(default=None, repr=False)  # plan_ahead: a CUDA event after the planner's work
    _waited: set = field(default_factory=set, repr=False)  # streams already ordered after that event

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
    def device(self) -> torch.device:
        return self.tile_kv.device

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
            f"merge_level={self.merge_level} split_private={self.split_private} method={self.method}",
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
        if queries_per_program < 1 or queries_per_program & (queries_per_program - 1):
            raise ValueError(f"queries_per_program must be a power of two >= 1, got {queries_per_program}")
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

    def program_order(self, queries_per_program: int) -> torch.Tensor:
        """Program ids of ``work_list(queries_per_program)`` by descending tile count (int32 [n_progs]).

        Launched in this order, the long programs start first and the last wave holds short ones, so
        less of the GPU idles at the end. Cached per width; no host sync.
        """
        key = ("order", min(queries_per_program, self.group_size))
        if key not in self._work:
            _, ntiles = self.work_list(queries_per_program)
            self._work[key] = torch.argsort(ntiles, descending=True, stable=True).to(torch.int32)
        return self._work[key]


def levels_desc(G: int, lowest: int) -> list[int]:
    """``[G, G/2, ..., lowest]``."""
    out, L = [], G
    while L >= max(lowest, 1):
        out.append(L)
        L //= 2
    return out


def flag_bit(G: int, L: int, block: int) -> int:
    """Table bit that marks a row pushed down out of block ``block`` of level ``L`` (bits 16..30)."""
    return 16 + (G // L - 1) + block


def segment_count(G: int, M: int) -> int:
    """Segments a group: every block of levels G..M, plus one merged segment a block of M when M > 1."""
    return sum(G // L for L in levels_desc(G, M)) + (G // M if M > 1 else 0)


def tile_capacity(G: int, M: int, topk: int, T: int) -> int:
    return -(-G * topk // T) + segment_count(G, M)


def plan_buffers(s_q: int, topk: int, G: int, M: int, T: int, split_private: bool, device,
                 filled: bool = True) -> dict:
    """The Plan's tensors, allocated for a kernel planner to fill (unused tile slots: kv -1, mask 0).

    ``filled=False``: the tile arrays come uninitialized, for a planner that writes every slot itself.
    """
    n_groups = -(-s_q // G)
    cap = tile_capacity(G, M, topk, T)
    i32 = dict(dtype=torch.int32, device=device)
    tiles = dict(tile_kv=torch.empty(n_groups, cap, T, **i32), tile_mask=torch.empty(n_groups, cap, T, **i32),
                 tile_level=torch.empty(n_groups, cap, **i32), tile_members=torch.empty(n_groups, cap, **i32))
    if filled:  # unused slots: kv and level -1, mask and members 0
        for name, value in (("tile_kv", -1), ("tile_mask", 0), ("tile_level", -1), ("tile_members", 0)):
            tiles[name].fill_(value)
    out = dict(**tiles,
               group_tiles=torch.empty(n_groups, **i32), group_rows=torch.empty(n_groups, **i32),
               group_valid=torch.empty(n_groups, **i32), dropped=torch.zeros(s_q, **i32), priv_idx=None, priv_n=None)
    if split_private:
        out["priv_idx"], out["priv_n"] = torch.full((s_q, topk), -1, **i32), torch.zeros(s_q, **i32)
    return out


def _plan_torch(idx, valid, masks, G, M, T, thr, importance_clip, split_private):
    """Vectorised torch planner over padded rows ``idx [n_groups * G, topk]`` (rank order)."""
    rows, topk = idx.shape
    n_groups, dev = rows // G, idx.device
    member = (torch.arange(rows, device=dev) % G)[:, None]
    gid = (torch.arange(rows, device=dev) // G)[:, None].expand(rows, topk)
    level = cascade_levels(masks, G)
    s_tab = int(torch.where(valid, idx, 0).max().item()) + 1 if valid.any() else 1  # table over valid rows only
    slot_of = (gid * s_tab + torch.where(valid, idx, 0)).long()

    for L in levels_desc(G, max(M, 2)):  # tile-aware clipping, top level first
        sel = level == L
        n = sel.sum(1, keepdim=True)
        pos = torch.cumsum(sel, 1) - 1
        r = n % T
        rep = member % L == 0
        pushed = sel & rep & (r > 0) & (r < thr) & (pos >= n - r)
        table = torch.zeros(n_groups * s_tab, dtype=torch.int64, device=dev)
        table.scatter_add_(0, slot_of[pushed], (1 << (member // L)).expand(rows, topk)[pushed])
        moved = sel & (((table[slot_of] >> (member // L)) & 1) == 1)
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
            priv_idx = torch.full_like(idx, -1)
            q = torch.arange(rows, device=dev)[:, None].expand(rows, topk)
            priv_idx[q[keep], pos[keep]] = idx[keep]
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
    seg_rows.scatter_add_(0, (gid * nseg + sid.clamp_min(0))[is_rep], torch.ones_like(sid, dtype=torch.int64)[is_rep])
    seg_rows = seg_rows.view(n_groups, nseg)
    seg_tiles = (seg_rows + T - 1) // T
    seg_off = torch.cumsum(seg_tiles, 1) - seg_tiles
    cap = tile_capacity(G, M, topk, T)
    slot = torch.gather(seg_off, 1, sid.clamp_min(0).view(n_groups, G * topk).long()).view(rows, topk) + spos // T
    flat = ((gid * cap + slot) * T + spos % T)[is_rep]
    tile_kv = torch.full((n_groups * cap * T,), -1, dtype=torch.int32, device=dev)
    tile_mask = torch.zeros(n_groups * cap * T, dtype=torch.int32, device=dev)
    tile_kv[flat] = idx[is_rep]
    tile_mask[flat] = colmask[is_rep].to(torch.int32)

    seg_level, seg_bits = [], []
    for L in levels_desc(G, M):
        seg_level += [L] * (G // L)
        seg_bits += [((1 << L) - 1) << (b * L) for b in range(G // L)]
    if M > 1:
        seg_level += [0] * (G // M)
        seg_bits += [((1 << M) - 1) << (b * M) for b in range(G // M)]
    seg_of_tile = torch.repeat_interleave(torch.arange(nseg, device=dev).repeat(n_groups), seg_tiles.view(-1))
    used = torch.arange(cap, device=dev)[None, :] < seg_tiles.sum(1, keepdim=True)
    tile_level = torch.full((n_groups, cap), -1, dtype=torch.int32, device=dev)
    tile_members = torch.zeros(n_groups, cap, dtype=torch.int32, device=dev)
    tile_level[used] = torch.tensor(seg_level, dtype=torch.int32, device=dev)[seg_of_tile]
    tile_members[used] = torch.tensor(seg_bits, dtype=torch.int32, device=dev)[seg_of_tile]
    return dict(tile_kv=tile_kv.view(n_groups, cap, T), tile_mask=tile_mask.view(n_groups, cap, T),
                tile_level=tile_level, tile_members=tile_members,
                group_tiles=seg_tiles.sum(1).to(torch.int32), group_rows=seg_rows.sum(1).to(torch.int32),
                dropped=dropped, priv_idx=priv_idx, priv_n=priv_n)


def _planner_backend(device: torch.device, backend: str, tile: int, G: int, topk: int, s_kv: int | None,
                     method: str) -> str:
    """The planner that runs: ``backend`` checked, or for ``"auto"`` the CUDA planner where it can run
    (``s_kv`` given), else Triton on a GPU (power-of-two tiles), else torch."""
    if backend == "torch":
        return "torch"
    if backend == "cuda":
        from .cuda_plan import unsupported_reason

        reason = unsupported_reason(device, G, topk, s_kv, tile, method)
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
    from .cuda_plan import unsupported_reason

    if s_kv is not None and unsupported_reason(device, G, topk, s_kv, tile, method) is None:
        return "cuda"  # (without s_kv the table's size is known only after a host sync: Triton)
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
    method: str = "bitmap",
    backend: str = "auto",
) -> Plan:
    """Decompose the Top-K lists of aligned query groups into shared segments and tiles.

    Parameters
    ----------
    indices : int32 ``[s_q, topk]`` (or ``[s_q, 1, topk]``), rows in descending importance. A row
        must not repeat a kv row (Top-K lists never do): a repeated entry is not de-duplicated and
        would be counted again for the query's group partners.
    s_kv : context length; entries ``>= s_kv`` or ``< 0`` are ignored (``None``: only negatives).
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
    method : member masks by ``"bitmap"`` (membership table) or ``"sort"`` (SCSD); same plan.
    backend : ``"cuda"`` (Hopper kernel, group sizes <= 8, ``group_size * topk <= 16384``, contexts up to
        about 150K rows, method ``"bitmap"``), ``"triton"`` (fused kernel), ``"torch"``, or ``"auto"``: CUDA where it can run,
        else Triton on a GPU, else torch.
    """
    indices = canonical_indices(indices)
    G = check_group_size(group_size)
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"tile must be a positive int, got {tile!r}")
    if not 0.0 <= float(clip_threshold) <= 1.0:
        raise ValueError(f"clip_threshold must be in [0, 1], got {clip_threshold}")
    M = check_group_size(merge_level, G)
    if importance_clip and M != 1 and not split_private:
        raise ValueError("importance_clip needs merge_level=1 or split_private=True (it clips private rows)")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if s_kv is not None and (not isinstance(s_kv, int) or s_kv < 1):
        raise ValueError(f"s_kv must be a positive int or None, got {s_kv!r}")
    s_q, topk = indices.shape
    dev = indices.device
    topk_length = check_topk_length(topk_length, s_q, dev)
    thr = float(clip_threshold) * tile

    which = _planner_backend(dev, backend, tile, G, topk, s_kv, method)
    # the kernel planners size their tables by the rows; without s_kv only negatives are invalid, so the
    # largest row bounds them (one host sync)
    rows_bound = s_kv if s_kv is not None or which == "torch" else (
        int(indices.max().item()) + 1 if indices.numel() else 1)
    if which == "cuda":
        from .cuda_plan import plan_cuda

        parts, valid_pairs = plan_cuda(indices, rows_bound, topk_length, G, M, tile, thr, importance_clip,
                                       split_private)
    elif which == "triton":
        from .triton_plan import plan_triton

        parts, valid_pairs = plan_triton(indices, rows_bound, topk_length, G, M, tile, thr, importance_clip, method,
                                         split_private)
    else:
        masks, valid = member_masks(indices, G, s_kv=s_kv, topk_length=topk_length, method=method)
        idx, masks, valid = pad_to_groups(indices, G, -1), pad_to_groups(masks, G, 0), pad_to_groups(valid, G, False)
        parts = _plan_torch(idx, valid, masks, G, M, tile, thr, importance_clip, split_private)
        for k in ("dropped", "priv_idx", "priv_n"):
            parts[k] = parts[k][:s_q] if parts[k] is not None else None
        valid_pairs = valid.sum()
    return Plan(s_q=s_q, topk=topk, s_kv=s_kv, group_size=G, tile=tile, clip_threshold=float(clip_threshold),
                importance_clip=bool(importance_clip), merge_level=M, method=method,
                split_private=bool(split_private), valid_pairs=valid_pairs,
                **parts)
