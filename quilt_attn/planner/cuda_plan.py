"""CUDA planner: one CTA a query group, its membership table in shared memory (``ops/csrc/quilt_plan.cu``).

The same plan as the torch and Triton planners. The membership table (member bits by kv row) is a hash
table in shared memory sized by the group's entries, so planning costs the same for any ``s_kv``: slot ids
into a paged pool of millions of rows plan like positions in a short context.
"""
from __future__ import annotations

import torch

from ..ops import cuda_backend
from .buffers import plan_buffers


def unsupported_reason(device: torch.device, G: int, topk: int, s_kv: int | None, tile: int,
                       mask_method: str) -> str | None:
    """Why the CUDA planner cannot plan here (None when it can; ``s_kv`` None: checked at launch)."""
    reason = cuda_backend.unavailable_reason(device)
    if reason:
        return reason
    if mask_method != "bitmap":
        return (f"the CUDA planner computes member masks with its membership table (mask_method='bitmap'), "
                f"got {mask_method!r}")
    return cuda_backend.plan_unsupported_reason(G, topk, tile)


def plan_cuda(indices, s_kv: int | None, topk_length, G, M, T, thr, importance_clip, split_private=False,
              workspace=None):
    """Run the planner kernel (rows ``>= s_kv`` invalid; ``s_kv`` None: only negatives); returns the Plan's
    tensor fields."""
    s_q, topk = indices.shape
    buf = plan_buffers(s_q, topk, G, M, T, split_private, indices.device, filled=False, s_kv=s_kv,
                       workspace=workspace)  # the kernel writes every slot
    lengths = None if topk_length is None else topk_length.contiguous()
    cuda_backend.launch_plan(indices.contiguous(), lengths, s_kv, G, M, T, thr, importance_clip, split_private, buf)
    return buf
