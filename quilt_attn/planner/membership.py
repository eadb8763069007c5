"""Stage 1 of planning: who else in my group selected this kv row?

For an aligned group of ``G`` neighbouring queries, every valid entry ``(i, j)`` of
``indices [s_q, topk]`` gets a ``G``-bit member mask: bit ``k`` is set iff query
``(i // G) * G + k`` selected the same kv row. Everything QUILT decides (shared
segments, cascade levels, unions, overlap statistics) is a function of these masks.

Two exact methods compute them; both give identical masks:

* ``"sort"`` -- Shift-and-Compare Set Decomposition (SCSD, paper section 3.1):
  concatenate the group's lists, sort, find equal neighbours by a shift and compare,
  OR the member bits of each run of equal rows, scatter back.
* ``"bitmap"`` -- a per-group membership table indexed by kv row: each member ORs its
  bit into the row's slot, then every entry reads its row's slot back. No sort; memory
  ``groups_per_chunk * s_kv * 4`` bytes, processed in chunks of groups.
"""
from __future__ import annotations

import torch

from .._checks import canonical_indices, check_topk_length
from ..reference import valid_index_mask

METHODS = ("sort", "bitmap")
_BITMAP_BUDGET_BYTES = {"cuda": 1 << 30, "cpu": 1 << 26}


def check_group_size(group_size: int, max_group: int = 16) -> int:
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 1 or group_size > max_group or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two in [1, {max_group}], got {group_size}")
    return group_size


def pad_to_groups(x: torch.Tensor, group_size: int, fill: int) -> torch.Tensor:
    """Append rows of ``fill`` so that ``x [s_q, ...]`` has a multiple of ``group_size`` rows (empty queries)."""
    pad = (-x.shape[0]) % group_size
    return torch.cat([x, x.new_full((pad, *x.shape[1:]), fill)]) if pad else x


def _masks_sort(idx: torch.Tensor, valid: torch.Tensor, G: int) -> torch.Tensor:
    """SCSD over padded ``idx [n_groups * G, topk]``; returns masks of the same shape."""
    rows, topk = idx.shape
    n_groups = rows // G
    member = torch.arange(G, device=idx.device, dtype=torch.int64).repeat_interleave(topk)  # [G*topk]
    sentinel = torch.iinfo(torch.int64).max // 2
    key = torch.where(valid, idx.to(torch.int64), sentinel).view(n_groups, G * topk) * G + member
    key_sorted, perm = torch.sort(key, dim=1)  # (C, T) = Sort(A || B)
    row_sorted = key_sorted // G
    mem_sorted = key_sorted - row_sorted * G
    # Shift and compare: a run of equal kv rows starts where the row differs from its left neighbour.
    starts = torch.ones_like(row_sorted, dtype=torch.bool)
    starts[:, 1:] = row_sorted[:, 1:] != row_sorted[:, :-1]
    # A (row, member) pair repeated inside one query's list contributes its bit once.
    first = torch.ones_like(starts)
    first[:, 1:] = key_sorted[:, 1:] != key_sorted[:, :-1]
    bits = torch.where(first, torch.ones_like(mem_sorted) << mem_sorted, torch.zeros_like(mem_sorted))
    run_id = torch.cumsum(starts.to(torch.int64), dim=1) - 1
    run_mask = torch.zeros_like(bits).scatter_add_(1, run_id, bits)
    mask_sorted = torch.gather(run_mask, 1, run_id)
    masks = torch.empty_like(mask_sorted).scatter_(1, perm, mask_sorted).view(rows, topk)
    return torch.where(valid, masks, 0).to(torch.int32)  # the sentinel run of invalid entries gets no mask


def _masks_bitmap(idx: torch.Tensor, valid: torch.Tensor, G: int, s_kv: int) -> torch.Tensor:
    """Membership table over padded ``idx [n_groups * G, topk]``, chunked over groups."""
    rows, topk = idx.shape
    n_groups = rows // G
    s_kv = max(s_kv, 1)  # all-invalid input (s_kv 0 or inferred from negatives only): keep the table non-empty
    budget = _BITMAP_BUDGET_BYTES["cuda" if idx.is_cuda else "cpu"]
    chunk = max(1, min(n_groups, budget // (4 * max(s_kv, 1))))
    masks = torch.zeros(rows, topk, dtype=torch.int32, device=idx.device)
    table = torch.zeros(chunk * s_kv, dtype=torch.int32, device=idx.device)
    safe = torch.where(valid, idx, 0).to(torch.int64)
    for g0 in range(0, n_groups, chunk):
        g1 = min(n_groups, g0 + chunk)
        table.zero_()
        sl = slice(g0 * G, g1 * G)
        slot = (torch.arange(g1 - g0, device=idx.device).repeat_interleave(G)[:, None] * s_kv + safe[sl]).view(g1 - g0, G, topk)
        ok = valid[sl].view(g1 - g0, G, topk)
        for k in range(G):  # each member ORs its bit; within one member the slots are distinct (up to repeats)
            s_k = slot[:, k][ok[:, k]]
            table[s_k] = table[s_k] | (1 << k)
        masks[sl] = torch.where(valid[sl], table[slot.view(-1, topk)], 0)
    return masks


def member_masks(
    indices: torch.Tensor,
    group_size: int,
    *,
    s_kv: int | None = None,
    topk_length: torch.Tensor | None = None,
    method: str = "sort",
):
    """Member masks of every entry for aligned groups of ``group_size`` queries.

    Parameters
    ----------
    indices : int32 ``[s_q, topk]`` (or ``[s_q, 1, topk]``).
    group_size : power of two in [1, 16].
    s_kv : context length; entries ``>= s_kv`` are invalid. ``None``: only negatives are invalid.
    topk_length : optional int32 ``[s_q]``.
    method : ``"sort"`` (SCSD) or ``"bitmap"``.

    Returns
    -------
    masks : int32 ``[s_q, topk]``; bit ``k`` set iff query ``(i // G) * G + k`` selected the row; 0 if invalid.
    valid : bool ``[s_q, topk]``.
    """
    indices = canonical_indices(indices)
    G = check_group_size(group_size)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    s_q = indices.shape[0]
    topk_length = check_topk_length(topk_length, s_q, indices.device)
    bound = s_kv if s_kv is not None else torch.iinfo(torch.int32).max
    valid = valid_index_mask(indices, bound, topk_length)
    idx, valid_p = pad_to_groups(indices, G, -1), pad_to_groups(valid, G, False)
    if method == "sort":
        masks = _masks_sort(idx, valid_p, G)
    else:
        if s_kv is None:
            s_kv = int(indices.max().item()) + 1 if indices.numel() else 1
        masks = _masks_bitmap(idx, valid_p, G, s_kv)
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
