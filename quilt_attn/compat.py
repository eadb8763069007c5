"""Drop-in replacement for FlashMLA's ``flash_mla_sparse_fwd`` (same arguments and results)."""
from __future__ import annotations

import torch

from .api import sparse_prefill


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    workspace: torch.Tensor | None = None,
):
    """Sparse prefill with FlashMLA's signature, run by QUILT; any head count 1..128.

    ``q [s_q, h, d_qk]`` bf16, ``kv [s_kv, 1, d_qk]`` bf16 (or ``[s_kv, d_qk]``, or the FP8 cache),
    ``indices [s_q, 1, topk]`` int32 (or ``[s_q, topk]``). Returns ``(out [s_q, h, d_v],
    max_logits [s_q, h], lse [s_q, h])`` as FlashMLA's current release: ``max_logits = max(q.k * sm_scale)``
    and ``lse = logsumexp(q.k * sm_scale)`` over the valid rows, natural log; a query without a valid row
    gets ``out = 0``, ``max_logits = -inf``, ``lse = +inf``. ``backend``, ``workspace``: see
    ``quilt_attn.sparse_prefill``. No host sync: capturable in a CUDA graph.
    """
    return sparse_prefill(q, kv, indices, sm_scale, method="quilt", d_v=d_v, attn_sink=attn_sink,
                          topk_length=topk_length, backend=backend, workspace=workspace)
