"""Stage 1 of planning: who else in my group selected this kv row?

For an aligned group of ``G`` neighbouring queries, every valid entry ``(i, j)`` of
``indices [s_q, topk]`` gets a ``G``-bit member mask: bit ``k`` is set iff query
``(i // G) * G + k`` selected the same kv row. Everything QUILT decides (shared
segments, cascade levels, unions, overlap statistics) is a function of these masks.

Two exact methods compute them; both give identical masks:

* ``"sort"`` -- Shift-and-Compare Set Decomposition (SCSD, paper section 3.1):
  concatenate the group's lists, sort, find equal neighbours by a shift and compare,
  OR the member bits of each run of equal rows, scatter back.
* ``"bitmap"`` -- a per-group membership table: each member ORs its bit into its row's
  slot, then every entry reads its row's slot back. Here (torch) the table is indexed by the
  row's dense id inside its group (one sort of the group's entries, as SCSD's), so its size is
  the group's entries, never ``s_kv``; the kernel planners hash the rows instead.

Both cost time and memory O(s_q * topk) for any ``s_kv`` (slot ids into a pool of 2**31 - 2 rows
plan like positions in a short context), with no host sync.

A row repeated inside one query's list: the first occurrence (lowest position) gets the row's
full mask (the query's own bit once), every later one only the query's own bit: a private entry,
so each entry counts once for its own query and the partners are not affected.
"""
from __future__ import annotations

import numbers

import torch

from .._checks import canonical_indices, check_topk_length
from ..reference import valid_index_mask

MASK_METHODS = ("sort", "bitmap")
NO_S_KV_BOUND = 2**31 - 1  # the row bound without s_kv: only negatives (and this value) are invalid


def check_group_size(group_size: int, max_group: int = 16, name: str = "group_size") -> int:
    """``group_size`` (or the argument ``name``: ``merge_level``, ...) checked: a power of two in ``[1, max_group]``."""
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise TypeError(f"{name} must be an int, got {type(group_size).__name__}")
    if group_size < 1 or group_size > max_group or group_size & (group_size - 1):
        raise ValueError(f"{name} must be a power of two in [1, {max_group}], got {group_size}")
    return group_size


def check_clip_threshold(clip_threshold) -> float:
    """``clip_threshold`` checked: a real number in ``[0, 1]`` (tile-aware clipping's tau)."""
    if isinstance(clip_threshold, bool) or not isinstance(clip_threshold, numbers.Real) \
            or not 0.0 <= float(clip_threshold) <= 1.0:
        raise ValueError(f"clip_threshold must be in [0, 1], got {clip_threshold!r}")
    return float(clip_threshold)


def pad_to_groups(x: torch.Tensor, group_size: int, fill: int) -> torch.Tensor:
    """Append rows of ``fill`` so that ``x [s_q, ...]`` has a multiple of ``group_size`` rows (empty queries)."""
    pad = (-x.shape[0]) % group_size
    return torch.cat([x, x.new_full((pad, *x.shape[1:]), fill)]) if pad else x


def group_row_ids(idx: torch.Tensor, valid: torch.Tensor, G: int):
    """Dense row ids inside each group, from one stable sort of the group's ``G * topk`` entries.

    Parameters
    ----------
    idx : int32 ``[n_groups * G, topk]`` (padded rows), valid : bool of the same shape.

    Returns
    -------
    ids : int64 ``[n_groups * G, topk]`` in ``[0, G * topk)``: two valid entries of one group have the
        same id iff they select the same row (invalid entries share the group's last id).
    first : bool, the same shape: the entry is the first occurrence (lowest position) of its row in its
        query's list (True for every entry of a duplicate-free list).
    sorted_ : ``(key_sorted, perm, run_id, first_sorted)`` ``[n_groups, G * topk]``: the sort, for SCSD.
    """
    rows, topk = idx.shape
    n_groups = rows // G
    member = torch.arange(G, device=idx.device, dtype=torch.int64).repeat_interleave(topk)  # [G*topk]
    # key = row * G + member; invalid entries sort last (above every int32 row); stable: equal keys (a row
    # repeated by one query) keep their positions, so the first of a run is the lowest position
    key = torch.where(valid, idx.to(torch.int64), NO_S_KV_BOUND + 1).view(n_groups, G * topk) * G + member
    key_sorted, perm = torch.sort(key, dim=1, stable=True)
    row_sorted = key_sorted // G
    starts = torch.ones_like(row_sorted, dtype=torch.bool)
    starts[:, 1:] = row_sorted[:, 1:] != row_sorted[:, :-1]  # shift and compare: a new kv row
    first_sorted = torch.ones_like(starts)
    first_sorted[:, 1:] = key_sorted[:, 1:] != key_sorted[:, :-1]  # a new (row, member) pair
    run_id = torch.cumsum(starts.to(torch.int64), dim=1) - 1
    ids = torch.empty_like(run_id).scatter_(1, perm, run_id).view(rows, topk)
    first = torch.empty_like(first_sorted).scatter_(1, perm, first_sorted).view(rows, topk)
    return ids, first, (key_sorted, perm, run_id, first_sorted)


def group_masks(idx: torch.Tensor, valid: torch.Tensor, G: int, mask_method: str):
    """Member masks (repeated rows: see the module docstring) and dense row ids over padded
    ``idx [n_groups * G, topk]``; returns ``(masks int32, ids int64)`` of idx's shape (masks 0 where invalid)."""
    rows, topk = idx.shape
    n_groups = rows // G
    ids, first, (key_sorted, perm, run_id, first_sorted) = group_row_ids(idx, valid, G)
    member = (torch.arange(rows, device=idx.device) % G)[:, None]
    own = torch.ones_like(ids) << member
    if mask_method == "sort":  # SCSD: OR the member bits of each run of equal rows in the sorted order
        mem_sorted = key_sorted % G
        bits = torch.where(first_sorted, torch.ones_like(mem_sorted) << mem_sorted, 0)  # a pair's bit once
        run_mask = torch.zeros_like(bits).scatter_add_(1, run_id, bits)
        masks = torch.empty_like(run_mask).scatter_(1, perm, torch.gather(run_mask, 1, run_id)).view(rows, topk)
    else:  # membership table by dense id: every first (row, member) pair adds its bit once (= OR)
        slot = (torch.arange(n_groups, device=idx.device).repeat_interleave(G)[:, None] * (G * topk) + ids).view(-1)
        table = torch.zeros(n_groups * G * topk, dtype=torch.int64, device=idx.device)
        table.scatter_add_(0, slot, torch.where(first & valid, own, 0).view(-1))
        masks = table[slot].view(rows, topk)
    masks = torch.where(first, masks, own)  # a repeat: a private entry of its own query
    return torch.where(valid, masks, 0).to(torch.int32), ids  # the sentinel run of invalid entries: no mask


def member_masks(
    indices: torch.Tensor,
    group_size: int,
    *,
    s_kv: int | None = None,
    topk_length: torch.Tensor | None = None,
    mask_method: str = "sort",
):
    """Member masks of every entry for aligned groups of ``group_size`` queries.

    Parameters
    ----------
    indices : int32 ``[s_q, topk]`` (or ``[s_q, 1, topk]``).
    group_size : power of two in [1, 16].
    s_kv : context length; entries ``>= s_kv`` are invalid. ``None``: only negatives are invalid (rows up
        to ``2**31 - 2``). Time and memory do not depend on it.
    topk_length : optional int32 ``[s_q]``.
    mask_method : ``"sort"`` (SCSD) or ``"bitmap"`` (same masks).

    Returns
    -------
    masks : int32 ``[s_q, topk]``; bit ``k`` set iff query ``(i // G) * G + k`` selected the row; 0 if invalid;
        a later repeat of a row in one query's list: the query's own bit only.
    valid : bool ``[s_q, topk]``.
    """
    indices = canonical_indices(indices)
    G = check_group_size(group_size)
    if mask_method not in MASK_METHODS:
        raise ValueError(f"mask_method must be one of {MASK_METHODS}, got {mask_method!r}")
    s_q = indices.shape[0]
    topk_length = check_topk_length(topk_length, s_q, indices.device)
    bound = s_kv if s_kv is not None else NO_S_KV_BOUND
    valid = valid_index_mask(indices, bound, topk_length)
    idx, valid_p = pad_to_groups(indices, G, -1), pad_to_groups(valid, G, False)
    masks, _ = group_masks(idx, valid_p, G, mask_method)
    return masks[:s_q], valid


def block_full(masks: torch.Tensor, member: torch.Tensor, level: int) -> torch.Tensor:
    """True where the aligned block of ``level`` members containing ``member`` all selected the row."""
    full = (1 << level) - 1
    shift = (member // level) * level
    return ((masks >> shift) & full) == full


def cascade_levels(masks: torch.Tensor, group_size: int) -> torch.Tensor:
    """Level of the largest aligned all-selecting block that contains each entry's query.

    With cascaded sharing (G -> G/2 -> ... -> 1) this is the level at which the entry's
    row is processed for that query. int32 ``[s_q, topk]``, 0 for invalid entries.
    """
    s_q = masks.shape[0]
    member = (torch.arange(s_q, device=masks.device) % group_size)[:, None]
    level = torch.zeros_like(masks)
    L = group_size
    while L >= 1:
        level = torch.where((level == 0) & (masks != 0) & block_full(masks, member, L), L, level)
        L //= 2
    return level
