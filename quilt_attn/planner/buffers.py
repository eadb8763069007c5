"""The layout of a plan's tensors: packed or wide tile columns, per-group tile capacity, and the buffers every
planner writes (allocated, or carved from a caller's workspace).

Shared by the torch planner (``plan.py``) and the kernel planners (``triton_plan.py``, ``cuda_plan.py``), which
``plan.py`` calls: its own module, so that none of them imports another.
"""
from __future__ import annotations

import math

import torch

from .membership import check_group_size

# Packed tile columns (see ``packs_columns``): a slot's word is ``row | (member_mask << PACK_SHIFT)``.
PACK_SHIFT = 24
PACK_ROW_MASK = (1 << PACK_SHIFT) - 1  # also the row field of a padding word (-1): never a row of a packed plan
WORKSPACE_ALIGN = 16  # bytes; every tensor carved from a caller's workspace starts at a multiple of it


def packs_columns(s_kv: int | None, group_size: int) -> bool:
    """Whether a plan stores its tile columns packed (one int32 word a slot, ``Plan.tile_mask`` None).

    Packed needs every row below the row field of a padding word (``s_kv <= PACK_ROW_MASK``) and
    the member mask in the 8 bits above the row (``group_size <= 8``); otherwise (``s_kv`` None, a
    larger pool, group 16) the columns are wide: rows and masks in two tensors.
    """
    return s_kv is not None and s_kv <= PACK_ROW_MASK and group_size <= 8


def levels_desc(G: int, lowest: int) -> list[int]:
    """``[G, G/2, ..., lowest]``."""
    out, L = [], G
    while L >= max(lowest, 1):
        out.append(L)
        L //= 2
    return out


def segment_count(G: int, M: int) -> int:
    """Segments a group: every block of levels G..M, plus one merged segment a block of M when M > 1."""
    return sum(G // L for L in levels_desc(G, M)) + (G // M if M > 1 else 0)


def tile_capacity(G: int, M: int, topk: int, T: int) -> int:
    return -(-G * topk // T) + segment_count(G, M)


def _buffer_shapes(s_q: int, topk: int, G: int, M: int, T: int, split_private: bool, s_kv: int | None) -> dict:
    """``{name: shape}`` of the int32 tensors ``plan_buffers`` makes, in workspace order."""
    n_groups = -(-s_q // G)
    cap = tile_capacity(G, M, topk, T)
    shapes = {"tile_kv": (n_groups, cap, T)}
    if not packs_columns(s_kv, G):
        shapes["tile_mask"] = (n_groups, cap, T)
    shapes.update(tile_level=(n_groups, cap), tile_members=(n_groups, cap), group_tiles=(n_groups,),
                  group_rows=(n_groups,), group_valid=(n_groups,), dropped=(s_q,))
    if split_private:
        shapes.update(priv_idx=(s_q, topk), priv_n=(s_q,))
    return shapes


def _aligned_bytes(shape) -> int:
    return -(-4 * math.prod(shape) // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def buffer_layout(s_q: int, topk: int, G: int, M: int, T: int, split_private: bool,
                  s_kv: int | None) -> tuple[dict, dict, int]:
    """``(shapes, offsets, bytes)`` of a plan's int32 tensors in one workspace: ``{name: shape}``, ``{name: byte
    offset}`` (each ``WORKSPACE_ALIGN``-aligned, in ``plan_buffers``' order) and the bytes they take."""
    shapes = _buffer_shapes(s_q, topk, G, M, T, split_private, s_kv)
    offsets, off = {}, 0
    for name, shape in shapes.items():
        offsets[name] = off
        off += _aligned_bytes(shape)
    return shapes, offsets, off


def plan_workspace_bytes(s_q: int, topk: int, *, group_size: int = 8, merge_level: int = 1, tile: int = 64,
                         split_private: bool = False, s_kv: int | None = None) -> int:
    """Bytes of the caller-owned ``workspace`` that ``plan(..., workspace=...)`` carves the plan's tensors from.

    The arguments are ``plan``'s (``s_q, topk`` of the indices; ``s_kv`` decides packed or wide columns).
    The plan's tensors are views into the workspace: it stays the caller's, and a plan lives as long as
    its workspace is not reused.
    """
    G = check_group_size(group_size)
    M = check_group_size(merge_level, G, "merge_level")
    for name, v in (("s_q", s_q), ("topk", topk), ("tile", tile)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "tile" else 0):
            raise ValueError(f"{name} must be a {'positive' if name == 'tile' else 'non-negative'} int, got {v!r}")
    return buffer_layout(s_q, topk, G, M, tile, bool(split_private), s_kv)[2]


def _carve(workspace, layout: tuple, device) -> dict:
    """Int32 views of ``layout``'s (``buffer_layout``'s) tensors cut from a caller's uint8 ``workspace``
    (checked), each slice aligned."""
    shapes, offsets, need = layout
    check_workspace(workspace, need, device)
    flat, out = workspace.view(-1), {}
    for name, shape in shapes.items():
        off = offsets[name]
        out[name] = flat[off:off + 4 * math.prod(shape)].view(torch.int32).view(shape)
    return out


def check_workspace(workspace, need: int, device) -> None:
    """A caller's ``workspace`` for a plan of ``need`` bytes on ``device``: ``TypeError`` / ``ValueError`` naming
    it unless it is a contiguous, ``WORKSPACE_ALIGN``-aligned uint8 tensor there of at least ``need`` bytes."""
    if not isinstance(workspace, torch.Tensor):
        raise TypeError(f"workspace must be a uint8 torch.Tensor, got {type(workspace).__name__}")
    if workspace.dtype != torch.uint8:
        raise ValueError(f"workspace must be a uint8 tensor, got {str(workspace.dtype).replace('torch.', '')}")
    if workspace.device != torch.device(device):
        raise ValueError(f"workspace is on {workspace.device} but the indices are on {torch.device(device)}")
    if not workspace.is_contiguous() or workspace.data_ptr() % WORKSPACE_ALIGN:
        raise ValueError(f"workspace must be contiguous and start at a {WORKSPACE_ALIGN}-byte aligned address")
    if workspace.numel() < need:
        raise ValueError(f"workspace holds {workspace.numel()} bytes, the plan needs {need} "
                         f"(plan_workspace_bytes)")


def plan_buffers(s_q: int, topk: int, G: int, M: int, T: int, split_private: bool, device,
                 filled: bool = True, *, s_kv: int | None = None, workspace: torch.Tensor | None = None) -> dict:
    """The Plan's tensors, allocated for a planner to fill (unused tile slots: kv -1, mask 0).

    ``s_kv`` decides the column format (``packs_columns``): packed plans have no ``tile_mask`` (None),
    and padding words are -1. ``workspace``: a caller's uint8 tensor on ``device`` of at least
    ``plan_workspace_bytes`` bytes to carve the tensors from (``ValueError`` naming ``workspace`` when it
    is too small, of another dtype or device); None allocates them. ``filled=False``: the tile arrays and
    ``dropped`` come uninitialized, for a planner that writes every slot and every query's count itself.
    """
    if workspace is None:
        shapes = _buffer_shapes(s_q, topk, G, M, T, split_private, s_kv)
        out = {name: torch.empty(shape, dtype=torch.int32, device=device) for name, shape in shapes.items()}
    else:
        out = _carve(workspace, buffer_layout(s_q, topk, G, M, T, split_private, s_kv), device)
    out.setdefault("tile_mask", None)
    out.setdefault("priv_idx", None)
    out.setdefault("priv_n", None)
    if filled:  # unused slots: kv and level -1, mask and members 0
        for name, value in (("tile_kv", -1), ("tile_mask", 0), ("tile_level", -1), ("tile_members", 0)):
            if out[name] is not None:
                out[name].fill_(value)
        out["dropped"].zero_()
    if split_private:
        out["priv_idx"].fill_(-1)
        out["priv_n"].zero_()
    return out
