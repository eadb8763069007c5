"""Expanding the 656-byte FP8 cache to dense rows once per call, on the device (Triton).

A prefill over ``s_q`` queries reads each cached row many times (``s_q * topk`` gathers over
``s_kv`` rows), so dequantizing every gathered row in the attention kernel repeats the same work
over and over; expanding the cache once costs one read of it and one write of ``1152`` bytes a row.
The values equal ``kv_cache.dequantize_fp8`` bit for bit (the scales are powers of two).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..kv_cache import D_NOPE, D_QK, FP8_BYTES, dequantize_fp8
from .sparse_attention import _load_nope, _load_rope

ROWS_PER_PROGRAM = 32


@triton.jit
def _expand_fp8_kernel(kv_ptr, kv_f32_ptr, kv_b16_ptr, out_ptr, src_ptr, count_ptr, n_rows, stride_out,
                       BR: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr, GATHER: tl.constexpr,
                       COUNTED: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR).to(tl.int64)  # (row x 1152 bytes passes 2^31 at 1.9M rows)
    ok = rows < n_rows
    if COUNTED:  # only the first count[0] rows (a count known on the device alone)
        ok &= rows < tl.load(count_ptr)
    safe = tl.where(ok, rows, 0)
    if GATHER:  # output row i widens cache row src[i]
        safe = tl.load(src_ptr + safe, mask=ok, other=0)
    dtype = out_ptr.dtype.element_ty
    nope = _load_nope(kv_ptr, kv_f32_ptr, 0, safe, 0, True, BR, DV, dtype)
    tl.store(out_ptr + rows[:, None] * stride_out + tl.arange(0, DV)[None, :], nope, mask=ok[:, None])
    rope = _load_rope(kv_ptr, kv_b16_ptr, 0, safe, True, DV, DR, dtype)
    tl.store(out_ptr + rows[:, None] * stride_out + DV + tl.arange(0, DR)[None, :], rope, mask=ok[:, None])


def expand_fp8(cache: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *, rows: torch.Tensor | None = None,
               count: torch.Tensor | None = None) -> torch.Tensor:
    """``uint8 [s_kv, 656]`` FP8 cache -> dense ``[s_kv, 576]`` of ``dtype`` (one Triton launch on a GPU,
    ``kv_cache.dequantize_fp8`` where Triton cannot run). ``rows`` (int32 ``[n]``, each in ``[0, s_kv)``):
    only those rows, in that order, ``[n, 576]``; ``count`` (int32 ``[1]`` on the device, with ``rows``): only
    the first ``count[0]`` of them are written (the others are left as allocated)."""
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != FP8_BYTES:
        raise ValueError(f"cache must be uint8 [s_kv, {FP8_BYTES}], got {cache.dtype} {tuple(cache.shape)}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be bfloat16 or float16, got {dtype}")
    if rows is not None and (rows.dtype != torch.int32 or rows.dim() != 1 or rows.device != cache.device):
        raise ValueError(f"rows must be int32 [n] on the cache's device, got {rows.dtype} {tuple(rows.shape)}")
    if count is not None and (rows is None or count.dtype != torch.int32 or count.numel() != 1
                              or count.device != cache.device):
        raise ValueError("count must be an int32 [1] tensor on the cache's device, given with rows")
    if cache.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return dequantize_fp8(cache if rows is None else cache[rows.long()], dtype)  # (count: all rows written)
    cache = cache.contiguous()
    n_rows = cache.shape[0] if rows is None else rows.shape[0]
    out = torch.empty(n_rows, D_QK, dtype=dtype, device=cache.device)
    if n_rows:
        src = rows.contiguous() if rows is not None else out  # (unread without rows)
        _expand_fp8_kernel[(triton.cdiv(n_rows, ROWS_PER_PROGRAM),)](
            cache, cache.view(torch.float32), cache.view(torch.bfloat16), out, src,
            count if count is not None else src, n_rows, out.stride(0),
            BR=ROWS_PER_PROGRAM, DV=D_NOPE, DR=D_QK - D_NOPE, GATHER=rows is not None, COUNTED=count is not None,
            num_warps=4)
    return out


def expansion_pays_off(s_kv: int, s_q: int, topk: int) -> bool:
    """Whether expanding the whole cache beats dequantizing gathered rows in the kernel: when the call
    gathers at least as many rows as the cache holds (each cached row read once or more on average)."""
    return s_kv <= s_q * topk
