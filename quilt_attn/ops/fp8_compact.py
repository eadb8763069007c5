"""An FP8 pool's referenced rows widened into a compact bf16 buffer (Triton and torch, no sync).

Expanding a whole FP8 pool costs ``s_kv x 1152`` bytes and a pass over it (4.6 GB and ~2 ms at 4M rows), and
widening inside the CUDA kernel takes about twice the kernel's time (BENCHMARKS.md). A call reads far fewer
distinct rows than a pool holds, so: mark the rows the call's columns reference (the plan's tile columns, or
the query-parallel index lists), number them by a prefix sum, widen the first ``cap`` of them into a dense
``[cap, 576]`` buffer, and rewrite the columns to the compact numbers. The numbering (``compact_columns``) is
a function of the columns alone, which a plan keeps; the widening (``Compaction.widen``) is the only step that
reads the cache, once a call. Nothing waits for the distinct-row count: ``fits`` (a one-element int32 tensor)
says on the device whether it was at most ``cap``; the caller launches the kernel on the compact rows to run
when it is 1 and the in-kernel widening to run when it is 0 (``cuda_backend.launch``'s ``run_if``), so exactly
one of them writes the outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..planner.buffers import PACK_ROW_MASK
from .fp8_expand import expand_fp8
from .sparse_attention import column_row

BLOCK = 1024


@triton.jit
def _mark_kernel(words_ptr, n, mark_ptr, s_kv, LOGP, PACKED: tl.constexpr, BLOCK: tl.constexpr):
    # A call's ~14M columns reference ~44K rows, and neighbouring groups share most of theirs: launched in column
    # order, the programs in flight together all reach the same rows at once. Bit-reversed program order (the
    # grid rounded up to 2^LOGP) spreads them over the call, and a mark read first is stored only while still 0
    # (benchmarks/fp8_mark_ab.py: 397 -> 196 us at h = 16, 250 -> 171 us at h = 8, 4M-row pool; either change
    # alone gained nothing).
    r = tl.program_id(0)
    pid = r * 0
    for _ in range(0, LOGP):
        pid = (pid << 1) | (r & 1)
        r = r >> 1
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(words_ptr + offs, mask=offs < n, other=-1)
    row, ok = column_row(w, s_kv, PACKED)
    ok &= offs < n
    seen = tl.load(mark_ptr + row, mask=ok, other=1)
    tl.store(mark_ptr + row, tl.full([BLOCK], 1, tl.uint8), mask=ok & (seen == 0))


@triton.jit
def _remap_kernel(words_ptr, n, incl_ptr, fits_ptr, out_ptr, s_kv, PACKED: tl.constexpr, IN_PLACE: tl.constexpr,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    w = tl.load(words_ptr + offs, mask=live, other=-1)
    row, ok = column_row(w, s_kv, PACKED)
    ok &= tl.load(fits_ptr) != 0  # (overflowing: the words stay as they are, for the launch over the cache)
    pos = tl.load(incl_ptr + row, mask=ok & live, other=1) - 1  # the row's compact number
    if PACKED:
        new = pos | (w & -16777216)  # (-16777216: the member bits 0xFF000000)
    else:
        new = pos
    # a column without a row keeps its word: past the compact buffer too (>= s_kv > cap), so still none; in place
    # it is not written at all (most of a plan's words are the padding past its groups' last tiles)
    if IN_PLACE:
        tl.store(out_ptr + offs, new, mask=live & ok)
    else:
        tl.store(out_ptr + offs, tl.where(ok, new, w), mask=live)


@dataclass(frozen=True)
class Compaction:
    """The rows a set of columns references, numbered in pool order, and the columns renumbered to them: a
    function of the columns alone (the indices), so a plan keeps its own and reuses it on every call over any
    FP8 cache of ``s_kv`` rows; only the widening (``widen``) reads the cache.

    Attributes
    ----------
    rows : int32 ``[cap]``, compact row ``i``'s pool row (the ``i``-th referenced row; past ``count``: unused).
    count : int32 ``[1]``, the distinct referenced rows (on the device, never read on the host).
    fits : int32 ``[1]``, 1 when ``count <= cap`` (else the compact rows miss some and the caller's other
        launch must run).
    columns : int32 like the words: each referencing word with its row renumbered, the others unchanged; all
        of them unchanged when the rows do not fit (``fits`` 0: the caller's launch over the cache reads them).
    """

    rows: torch.Tensor
    count: torch.Tensor
    fits: torch.Tensor
    columns: torch.Tensor

    def widen(self, cache: torch.Tensor) -> torch.Tensor:
        """bf16 ``[cap, 576]``: the referenced rows of ``cache`` dequantized (rows past ``count`` not written)."""
        return expand_fp8(cache, rows=self.rows, count=self.count)  # (a 64K context: at most half the buffer)


def compact_columns(words: torch.Tensor, s_kv: int, cap: int, *, packed: bool, in_place: bool = False,
                    cuda_mark: bool = False) -> Compaction:
    """Number the rows of a pool of ``s_kv`` rows that ``words`` reference and renumber the words to them.

    Parameters
    ----------
    words : int32 columns, contiguous (any shape): plan tile columns (``packed``: ``row | bits << 24``, -1
        padding) or kv rows (query-parallel indices: negative or ``>= s_kv`` reference no row).
    s_kv : rows of the pool the words address.
    cap : rows of the compact numbering, ``1 <= cap <= s_kv``.
    in_place : renumber ``words`` themselves (``columns`` is then ``words``; left as they are when the rows
        overflow ``cap``): for columns nobody reads after this call, a plan made inside it (saves a copy of
        them: 128 MiB at s_q 16384, Top-2048).
    cuda_mark : mark the referenced rows by the CUDA backend's kernel (``cuda_backend.mark_rows``, the same marks)
        instead of this module's Triton pass.
    """
    if words.dtype != torch.int32 or not words.is_contiguous():
        raise ValueError(f"words must be contiguous int32, got {words.dtype}")
    if not isinstance(cap, int) or not 1 <= cap <= s_kv:
        raise ValueError(f"cap must be an int in [1, s_kv={s_kv}], got {cap!r}")
    if packed and s_kv > PACK_ROW_MASK:
        raise ValueError(f"packed columns address at most {PACK_ROW_MASK} rows, got s_kv={s_kv}")
    n = words.numel()
    mark = torch.zeros(s_kv, dtype=torch.uint8, device=words.device)  # (a byte a pool row)
    grid = (triton.cdiv(n, BLOCK),)
    if n and cuda_mark:
        from .cuda_backend import mark_rows  # (the CUDA library: loaded only when its pass is asked for)
        mark_rows(words, s_kv, mark, packed)
    elif n:
        logp = (grid[0] - 1).bit_length()
        _mark_kernel[(1 << logp,)](words, n, mark, s_kv, logp, PACKED=packed, BLOCK=BLOCK)
    incl = torch.cumsum(mark, 0, dtype=torch.int32)  # referenced rows up to and including each row
    count = incl[-1:]  # the distinct referenced rows (on the device)
    fits = (count <= cap).to(torch.int32)
    # compact row i is the first pool row where the count reaches i + 1
    want = torch.arange(1, cap + 1, dtype=torch.int32, device=words.device)
    rows = torch.searchsorted(incl, want, out_int32=True).clamp_(max=s_kv - 1)
    columns = words if in_place else torch.empty_like(words)  # (each word is read, then written, by one lane)
    if n:
        _remap_kernel[grid](words, n, incl, fits, columns, s_kv, PACKED=packed, IN_PLACE=in_place, BLOCK=BLOCK)
    return Compaction(rows, count.clone(), fits, columns)
