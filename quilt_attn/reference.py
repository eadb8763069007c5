"""Exact reference for top-K sparse-attention prefill (FlashMLA ``flash_mla_sparse_fwd`` semantics).

Conventions (one canonical layout for the whole package)::

    q        [s_q, h, d_qk]      query rows (d_qk = 576 = 512 latent + 64 rope in production)
    kv       [s_kv, d_qk]        MLA latent cache, one row a token shared by all heads
                                 (FlashMLA's [s_kv, 1, d_qk] accepted; or the FP8 cache uint8 [s_kv, 656])
    indices  [s_q, topk] int32   selected kv rows a query (FlashMLA's [s_q, 1, topk] accepted);
                                 -1 or >= s_kv means "no row" and is ignored
    out      [s_q, h, d_v]       values are the first d_v columns of kv
    max_logits, lse [s_q, h]     float32

Logits are ``P = (q . kv) * sm_scale`` over a query's valid selected rows, ``max_logits = max P``,
``lse = logsumexp P = log(sum exp P)`` (natural log, as FlashMLA's current release; its first release
returned base 2) and ``out = sum exp(P - lse) * kv[:, :d_v]``.
A query row with no valid index gets ``out = 0``, ``max_logits = -inf`` and ``lse = +inf``.
``attn_sink [h]`` (float32) multiplies ``out`` by ``exp(lse) / (exp(lse) + exp(attn_sink))``; it
leaves ``lse`` and ``max_logits`` unchanged, and infinite sinks are numbers too (+inf zeros the
output, -inf has no effect). The kernels keep base-2 state internally and convert at the public
boundary (``dispatch.natural_log_stats``).
``topk_length [s_q]`` keeps only the first ``topk_length[i]`` entries of row i.

Empty rows and non-finite values. A row is empty (``out = 0``, ``max_logits = -inf``,
``lse = +inf``) when nothing carries weight: no valid index (decided by the validity mask alone,
so ``s_kv = 0`` makes every row empty), or every valid logit is ``-inf`` (``exp`` gives 0 for all of
them, as for an ignored entry). Every other row follows IEEE float64 arithmetic of the stable
softmax ``lse = m + log sum exp(P - m)``, ``m = max P``: a ``+inf`` logit gives ``inf - inf = NaN``
(NaN ``out`` and ``lse`` for that query and head, ``max_logits = +inf``), a NaN logit NaN (``max_logits``
NaN too; a GPU kernel's max may skip it), a ``-inf`` logit among finite ones weight 0, and a weight
0 times a non-finite value row NaN (``0 * inf``). Ignored entries (invalid, past ``topk_length``)
never touch the sums: non-finite values in rows no query selects cannot reach any output.
"""
from __future__ import annotations

import math

import torch

from ._checks import (
    FLOAT_DTYPES,
    canonical_indices,
    canonical_kv,
    check_attn_sink,
    check_d_v,
    check_sm_scale,
    check_topk_length,
    require_dtype,
    require_ndim,
    require_tensor,
)
from .kv_cache import D_QK, canonical_fp8_cache, dequantize_fp8, is_fp8_cache

LOG2E = math.log2(math.e)


def valid_index_mask(indices: torch.Tensor, s_kv: int, topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean ``[s_q, topk]``: entry selects a real kv row (in range and inside ``topk_length``)."""
    valid = (indices >= 0) & (indices < s_kv)
    if topk_length is not None:
        pos = torch.arange(indices.shape[1], device=indices.device)
        valid &= pos[None, :] < topk_length[:, None].to(indices.device)
    return valid


def apply_attn_sink(out: torch.Tensor, lse: torch.Tensor, attn_sink: torch.Tensor) -> torch.Tensor:
    """Scale ``out [s_q, h, d_v]`` by ``exp(lse) / (exp(lse) + exp(attn_sink)) = 1 / (1 + exp(attn_sink - lse))``
    (natural-log ``lse [s_q, h]``)."""
    factor = torch.sigmoid(lse.to(torch.float64) - attn_sink.to(torch.float64)[None, :])
    factor = torch.where(torch.isinf(lse), torch.zeros_like(factor), factor)  # empty rows stay 0
    return out * factor[..., None].to(out.dtype)


def sparse_prefill_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float | None = None,
    *,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
    chunk: int = 256,
):
    """Sparse-attention prefill computed exactly in ``compute_dtype`` (float64 by default).

    Parameters
    ----------
    q : ``[s_q, h, d_qk]`` float tensor.
    kv : ``[s_kv, d_qk]`` (or ``[s_kv, 1, d_qk]``) float tensor, or the FP8 cache ``uint8 [s_kv, 656]``.
    indices : ``[s_q, topk]`` (or ``[s_q, 1, topk]``) int32.
    sm_scale : softmax scale; default ``d_qk ** -0.5``.
    d_v : value width, the first ``d_v`` columns of kv.
    attn_sink : optional ``[h]`` float32.
    topk_length : optional ``[s_q]`` int32.
    compute_dtype : float64 (exact) or float32 (faster, for large benchmark checks).
    chunk : queries processed at a time (bounds memory).

    Returns
    -------
    out ``[s_q, h, d_v]`` (compute_dtype), max_logits ``[s_q, h]`` and lse ``[s_q, h]`` (float32, natural log).
    """
    require_tensor("q", q)
    require_ndim("q", q, (3,), "[s_q, h, d_qk]")
    require_dtype("q", q, FLOAT_DTYPES)
    require_tensor("kv", kv)
    fp8 = is_fp8_cache(kv)
    if fp8:
        kv = canonical_fp8_cache(kv)
    else:
        kv = canonical_kv(kv)
        require_dtype("kv", kv, FLOAT_DTYPES)
    s_q, h, d_qk = q.shape
    if (D_QK if fp8 else kv.shape[1]) != d_qk:
        raise ValueError(f"kv has d_qk = {D_QK if fp8 else kv.shape[1]} but q has d_qk = {d_qk}")
    d_v = check_d_v(d_v, d_qk)
    indices = canonical_indices(indices, s_q)
    topk_length = check_topk_length(topk_length, s_q, indices.device, indices.shape[1])
    attn_sink = check_attn_sink(attn_sink, h, q.device)
    sm_scale = check_sm_scale(sm_scale, d_qk)
    s_kv = kv.shape[0]
    dev = q.device
    indices = indices.to(dev)
    valid = valid_index_mask(indices, s_kv, topk_length)
    scale = float(sm_scale)

    def gather(rows_idx):
        """kv rows ``[c, topk]`` -> ``[c, topk, d_qk]`` in compute_dtype on q's device: only the gathered rows are
        converted (a pool of millions of rows in float64 would not fit)."""
        g = kv[rows_idx.to(kv.device)]
        if fp8:
            g = dequantize_fp8(g.reshape(-1, g.shape[-1]), torch.float32).reshape(*rows_idx.shape, D_QK)
        return g.to(dev, compute_dtype)

    out = torch.empty(s_q, h, d_v, dtype=compute_dtype, device=dev)
    max_logits = torch.empty(s_q, h, dtype=torch.float32, device=dev)
    lse = torch.empty(s_q, h, dtype=torch.float32, device=dev)
    for a in range(0, s_q, chunk):
        b = min(s_q, a + chunk)
        ok = valid[a:b]  # [c, topk]
        # an ignored entry gathers a zero row: nothing of a row no query selected (inf, NaN) reaches a sum
        rows = (gather(torch.where(ok, indices[a:b], 0).long()) if s_kv else
                torch.zeros(b - a, ok.shape[1], d_qk, dtype=compute_dtype, device=dev))
        rows = rows.masked_fill(~ok[..., None], 0.0)  # [c, topk, d_qk]
        p = torch.einsum("chd,ckd->chk", q[a:b].to(compute_dtype), rows) * scale
        p = p.masked_fill(~ok[:, None, :], float("-inf"))
        m = p.amax(dim=-1)  # [c, h]; NaN where a valid logit is NaN
        # no weight anywhere: no valid index (the mask), or every valid logit -inf (exp gives 0 everywhere);
        # any other row keeps IEEE arithmetic (a +inf logit: inf - inf = NaN, as in the kernels)
        empty = m == float("-inf")
        m_safe = m.masked_fill(empty, 0.0)
        s = torch.exp(p - m_safe[..., None]).sum(-1)
        l_e = m_safe + torch.log(s)
        w = torch.exp(p - l_e.masked_fill(empty, 0.0)[..., None])
        o = torch.einsum("chk,ckd->chd", w, rows[..., :d_v])  # IEEE: 0 * inf = NaN
        o = o.masked_fill(empty[..., None], 0.0)
        l_e = l_e.masked_fill(empty, float("inf"))
        if attn_sink is not None:
            o = apply_attn_sink(o, l_e, attn_sink.to(dev))
        out[a:b] = o
        max_logits[a:b] = m.float()
        lse[a:b] = l_e.float()
    return out, max_logits, lse
