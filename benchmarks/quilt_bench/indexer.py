"""Fused lightning-indexer scores: one Triton kernel instead of a ``[s, heads, n]`` float32 intermediate.

The DSA indexer scores query ``t`` against key ``i`` as

    I[t, i] = scale * sum_j w[t, j] * relu(q_idx[t, j, :] . k_idx[i, :])

(``w`` already holds the ``index_n_heads**-0.5`` factor; ``scale = index_head_dim**-0.5``) and masks
the keys past the query's position, ``i > pos[t]``, with ``-inf``. Written with torch ops the per-head
logits ``[s, heads, n]`` go to memory and back several times (matmul output, float32 copy, relu,
weighted reduction): on an H200 that took ~20x the matrix arithmetic (docs/learned.md, "Against the
paper's figures"). Here a program holds ``BLOCK_S`` keys and, for each of its ``BLOCK_T`` queries in turn,
multiplies that query's head matrix ``[heads, d]`` by the key block (the heads are the rows of the
product, so a 64-head indexer fills a 64-row tile by itself), applies relu and the head weights in
registers and writes one float32 score per key: only the ``[s, n]`` scores reach memory.

Rope on q's first ``qk_rope_dim`` dims (and on the keys) is applied by the caller, in torch.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quilt_attn._checks import require_dtype, require_ndim, require_same_device, require_tensor

INPUT_DTYPES = (torch.bfloat16, torch.float16)

# Launch configuration, not timed yet (written without GPU time). BLOCK_S 128 with 4 warps: one warpgroup
# computes a query's 64-head x 128-key product (wgmma on sm_90); BLOCK_T 16: each key block loaded serves
# 16 queries. Compiled for sm_90 at 64 heads x 128 dims (bf16): 128 registers, no spills, 66 KB shared
# memory (the key block and 2 stages of q, loaded with cp.async), so 3 programs fit an SM.
BLOCK_T = 16
BLOCK_S = 128
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def _indexer_scores_kernel(
    q_ptr, k_ptr, w_ptr, pos_ptr, out_ptr,
    s, n, stride_os,
    scale,
    H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # Key blocks on the fast grid axis: the programs resident at one time share a block of queries, so
    # its q rows are read from HBM once and then served from L2 (all keys, 16 MB at 64K x 128 bf16, fit too).
    pid_s = tl.program_id(0)
    pid_t = tl.program_id(1)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_h = tl.arange(0, HP)
    offs_d = tl.arange(0, DP)
    key_ok = offs_s < n
    head_ok = offs_h < H
    # The heads H and the head dim D are compile-time constants (one pair a model) and q, k, w are
    # contiguous, so at D == DP this mask is known to be all-true and every row start is known to be
    # aligned: q then loads in 16-byte vectors, which Triton's pipeliner needs to turn the loads into
    # cp.async copies (compiled for sm_90 with run-time dims or strides whose divisibility the compiler
    # did not know, they stayed synchronous)
    dim_ok = offs_d < D
    t0 = pid_t * BLOCK_T
    offs_t = t0 + tl.arange(0, BLOCK_T)
    t_ok = offs_t < s
    last = tl.max(tl.load(pos_ptr + offs_t, mask=t_ok, other=-1), axis=0)
    if pid_s * BLOCK_S > last:
        # every key of the block is in the future of every query of the block: no products needed
        minus_inf = tl.full([BLOCK_T, BLOCK_S], float("-inf"), tl.float32)
        tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_os + offs_s[None, :], minus_inf,
                 mask=t_ok[:, None] & key_ok[None, :])
    else:
        # padded heads / dims load as zeros: a zero head row has weight 0, a zero dim adds nothing
        k = tl.load(k_ptr + offs_s.to(tl.int64)[:, None] * D + offs_d[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        k_t = tl.trans(k)  # [DP, BLOCK_S], reused by every query of the program
        for i in range(BLOCK_T):
            t = t0 + i
            ok = t < s
            t64 = t.to(tl.int64)
            q = tl.load(q_ptr + t64 * (H * D) + offs_h[:, None] * D + offs_d[None, :],
                        mask=ok & head_ok[:, None] & dim_ok[None, :], other=0.0)
            w = tl.load(w_ptr + t64 * H + offs_h, mask=ok & head_ok, other=0.0)
            logits = tl.dot(q, k_t)  # [HP, BLOCK_S], float32 accumulation
            score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0) * scale
            p = tl.load(pos_ptr + t, mask=ok, other=0)
            score = tl.where(offs_s > p, float("-inf"), score)
            tl.store(out_ptr + t64 * stride_os + offs_s, score, mask=ok & key_ok)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _launch(q_idx, k_idx, w, pos, out, scale, *, block_t, block_s, num_warps, num_stages):
    """Run the kernel over ``out [s, n]``; inputs already checked and contiguous, ``pos`` int32."""
    s, h, d = q_idx.shape
    n = k_idx.shape[0]
    grid = (triton.cdiv(n, block_s), triton.cdiv(s, block_t))
    _indexer_scores_kernel[grid](
        q_idx, k_idx, w, pos, out,
        s, n, out.stride(0),
        float(scale),
        H=h, D=d, HP=max(16, _next_pow2(h)), DP=max(16, _next_pow2(d)), BLOCK_T=block_t, BLOCK_S=block_s,
        num_warps=num_warps, num_stages=num_stages,
    )


def indexer_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, pos: torch.Tensor, *,
                   scale: float, block_t: int | None = None, block_s: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Causally masked lightning-indexer scores of ``s`` queries against ``n`` keys, fused.

    Parameters
    ----------
    q_idx : bf16 / fp16 ``[s, heads, d]``
        Indexer queries, rope already applied.
    k_idx : ``[n, d]``, q_idx's dtype
        Indexer keys ``0 .. n-1`` (one head shared by all query heads), rope already applied.
    w : floating ``[s, heads]``
        Per-head weights, including ``heads**-0.5``; used in float32.
    pos : integer ``[s]``
        Position of each query; key ``i`` is masked for query ``t`` when ``i > pos[t]``.
    scale : float
        Factor of the weighted sum (``d**-0.5`` in DeepSeek-V3.2).
    block_t, block_s, num_warps, num_stages : int, optional
        Launch configuration (queries and keys a program, powers of two; block_s >= 16); defaults
        ``BLOCK_T``, ``BLOCK_S``, ``NUM_WARPS``, ``NUM_STAGES`` (block_t capped at the next power of two of s).

    Returns
    -------
    torch.Tensor
        float32 ``[s, n]``: ``scale * sum_j w[t, j] * relu(q_idx[t, j] . k_idx[i])`` with float32
        accumulation, and exactly ``-inf`` where ``i > pos[t]``.

    Raises
    ------
    TypeError, ValueError
        Bad dtype, shape or device (naming the argument); CPU tensors without ``TRITON_INTERPRET=1``.
    """
    for name, x in (("q_idx", q_idx), ("k_idx", k_idx), ("w", w), ("pos", pos)):
        require_tensor(name, x)
    require_dtype("q_idx", q_idx, INPUT_DTYPES)
    require_ndim("q_idx", q_idx, (3,), "[s, heads, d]")
    require_ndim("k_idx", k_idx, (2,), "[n, d]")
    require_ndim("w", w, (2,), "[s, heads]")
    require_ndim("pos", pos, (1,), "[s]")
    if k_idx.dtype != q_idx.dtype:
        raise TypeError(f"k_idx must have q_idx's dtype {q_idx.dtype}, got {k_idx.dtype}")
    if not w.is_floating_point():
        raise TypeError(f"w must be floating point, got {w.dtype}")
    if pos.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"pos must be int32 or int64, got {pos.dtype}")
    s, h, d = q_idx.shape
    if k_idx.shape[1] != d:
        raise ValueError(f"k_idx must have q_idx's head dim {d}, got shape {tuple(k_idx.shape)}")
    if tuple(w.shape) != (s, h):
        raise ValueError(f"w must have shape [s, heads] = [{s}, {h}], got {tuple(w.shape)}")
    if pos.shape[0] != s:
        raise ValueError(f"pos must have shape [s] = [{s}], got {tuple(pos.shape)}")
    if h < 1 or d < 1:
        raise ValueError(f"q_idx must have heads >= 1 and d >= 1, got shape {tuple(q_idx.shape)}")
    for name, x in (("k_idx", k_idx), ("w", w), ("pos", pos)):
        require_same_device(name, x, "q_idx", q_idx)
    block_t = block_t or min(BLOCK_T, _next_pow2(max(1, s)))
    block_s = block_s or BLOCK_S
    if block_t & (block_t - 1) or block_s & (block_s - 1) or block_s < 16:
        raise ValueError(f"block_t and block_s must be powers of two, block_s >= 16; got {block_t}, {block_s}")
    if q_idx.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"indexer_scores runs a Triton kernel: q_idx must be on a CUDA device (or set "
                         f"TRITON_INTERPRET=1 to run it on the CPU); got {q_idx.device}")
    n = k_idx.shape[0]
    out = torch.empty(s, n, dtype=torch.float32, device=q_idx.device)
    if s == 0 or n == 0:
        return out
    # clamping to [-1, n] masks the same keys and makes any int64 position fit in int32
    pos32 = pos.clamp(-1, n).to(torch.int32).contiguous()
    _launch(q_idx.contiguous(), k_idx.contiguous(), w.to(torch.float32).contiguous(), pos32, out, scale,
            block_t=block_t, block_s=block_s, num_warps=num_warps or NUM_WARPS, num_stages=num_stages or NUM_STAGES)
    return out
